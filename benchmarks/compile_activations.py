"""What torch.compile keeps of a model's activations, measured on this CPU.

The memory model's physics takes compile's saved activations as a share of eager
autograd's (COMPILED_ACTIVATIONS in autotune/plan/memory.py). Inductor's partitioner,
which decides what the forward saves for the backward, is the same on CPU and GPU, so the
share can be read here: every tensor autograd saves is counted through
saved_tensors_hooks (AOTAutograd's compiled function saves through the same path), in
the transformer body alone (backward from its hidden states) and in the whole causal LM.

    .venv/bin/python benchmarks/compile_activations.py   # about 3 minutes on 2 cores
"""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = [  # (model_type, config kwargs, batch, seq)
    ("gpt2", {"n_layer": 2, "n_embd": 256, "n_head": 4, "n_positions": 256}, 8, 128),
    ("gpt2", {"n_layer": 2, "n_embd": 512, "n_head": 8, "n_positions": 512}, 4, 256),
    ("llama", {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 688,
               "num_attention_heads": 4, "num_key_value_heads": 2}, 8, 128),
]
VOCAB = 4096


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs its forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return sum(seen.values())


def measure(kind: str, kwargs: dict, batch: int, seq: int) -> tuple[float, float]:
    """(body, whole LM) saved bytes under compile over eager."""
    cfg = AutoConfig.for_model(kind, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                               pad_token_id=0, attn_implementation="sdpa", **kwargs)
    ids = torch.randint(0, VOCAB, (batch, seq))
    figures = {}
    for mode in ("eager", "compile"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).train()
        body = model.base_model
        run_body, run_lm = body, model
        if mode == "compile":
            run_body, run_lm = torch.compile(body), torch.compile(model)
        for _ in range(2):  # the first call compiles; the second is what a step keeps
            b = saved_bytes(lambda f=run_body: f(input_ids=ids).last_hidden_state.float().sum())
            lm = saved_bytes(lambda f=run_lm: f(input_ids=ids, labels=ids).loss)
        figures[mode] = (b, lm)
    (eb, el), (cb, cl) = figures["eager"], figures["compile"]
    return cb / eb, cl / el


def main() -> None:
    print(f"torch {torch.__version__}; saved for backward, compile over eager")
    print("| model | batch x seq | body | whole LM |")
    print("| --- | --- | ---: | ---: |")
    for kind, kwargs, batch, seq in SHAPES:
        started = time.time()
        body, lm = measure(kind, kwargs, batch, seq)
        width = kwargs.get("n_embd") or kwargs.get("hidden_size")
        print(f"| {kind} {width} wide | {batch} x {seq} | {body:.2f} | {lm:.2f} |"
              f"  ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
