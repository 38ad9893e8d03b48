"""Model factories for tests: real tiny models, some of which misbehave on purpose
for one batch size, to prove a crash or a hang is contained to its trial."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 512, "n_positions": 64}


def tiny_gpt2(config=None):
    """A tiny GPT-2 whose shape the spec does not reveal (no memory model: probe)."""
    return GPT2LMHeadModel(config or GPT2Config(**TINY))


def gpt2_64(config=None):
    """GPT-2 2x64, vocab 8192: the CLI test's model, hidden from the memory model so the
    search must find the budget by probing (an OOM trial)."""
    return GPT2LMHeadModel(config or GPT2Config(n_layer=2, n_embd=64, n_head=2,
                                                vocab_size=8192, n_positions=256))


class _Misbehaving(GPT2LMHeadModel):
    action: str = "crash"
    bad_batch: int = 8  # 0: every batch
    hang_marker: str | None = None  # touched as it starts to hang
    ballast: int = 0  # host bytes written just before it hangs

    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and self.bad_batch in (0, input_ids.shape[0]):
            if self.action == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            self._held = b"\x01" * self.ballast  # written, so resident: the RSS grows
            if self.hang_marker:
                Path(self.hang_marker).touch()
            time.sleep(3600)  # hang
        return super().forward(input_ids=input_ids, **kwargs)


def crashes_at_batch_8(config=None):
    model = _Misbehaving(config or GPT2Config(**TINY))
    model.action = "crash"
    return model


def hangs_at_batch_8(config=None):
    model = _Misbehaving(config or GPT2Config(**TINY))
    model.action = "hang"
    return model


def nan_loss(config=None):
    model = GPT2LMHeadModel(config or GPT2Config(**TINY))
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    return model


class _OutOfMemoryOnRank1(GPT2LMHeadModel):
    """Runs out of memory on rank 1 only, at its second micro-batch: rank 0 is by then
    inside a collective waiting for it."""

    calls = 0

    def forward(self, input_ids=None, **kwargs):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                         "(raised on purpose by tests.factories)")
        return super().forward(input_ids=input_ids, **kwargs)


def oom_on_rank_1(config=None):
    return _OutOfMemoryOnRank1(config or GPT2Config(**TINY))


def rendezvous_gpt2(config):
    """A tiny GPT-2 that is built only once a second trial is building one too (each
    leaves a marker in `config.rendezvous_dir` and waits for two): trials that build it
    ran at the same time, however long each took to start."""
    folder = Path(config.rendezvous_dir)
    (folder / str(os.getpid())).touch()
    deadline = time.time() + 120
    while len(list(folder.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.05)
    return GPT2LMHeadModel(config)


def stalls_the_first_time(config):
    """A tiny GPT-2 whose first build (no marker at `config.stall_marker` yet) hangs in its
    first forward of 4 samples, and leaves the marker as it starts to: once the marker is
    there, the trial is surely mid-run (its Trainer built, its host watch's figure
    written), however slowly a busy machine got it there. Its retry finds the marker and
    trains."""
    model = _Misbehaving(config)
    if Path(config.stall_marker).exists():
        model.bad_batch = -1  # never matches: a normal model
    else:
        model.action, model.hang_marker = "hang", config.stall_marker
        model.bad_batch = getattr(config, "stall_batch", 4)
        model.ballast = getattr(config, "stall_ballast", 0)
    return model
