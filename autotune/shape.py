"""The few architecture figures that memory and FLOP estimates need.

Kept apart from the model itself so a 70B model (or a landscape that never had one)
can be reasoned about without instantiating any weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    num_parameters: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_len: int
    causal_lm: bool = True
    intermediate_size: int | None = None  # None: 4 x hidden, as in GPT-2/BERT
    name: str = "model"
    # "eager" materialises the seq x seq attention matrix; "sdpa"/"flash_attention_2" do
    # not; "auto": not known, the memory model decides from the device.
    attn_implementation: str = "auto"
    task: str = ""  # causal-lm | masked-lm | sequence-classification; "" = from causal_lm

    @property
    def has_lm_logits(self) -> bool:
        """A vocabulary-sized output per token (causal or masked LM), not a class head."""
        return self.task in ("causal-lm", "masked-lm") if self.task else self.causal_lm

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_landscape_meta(cls, meta: dict[str, Any]) -> ModelShape:
        m = meta["model"]
        return cls(
            num_parameters=int(m["num_parameters"]),
            num_layers=int(m["num_layers"]),
            hidden_size=int(m["hidden_size"]),
            num_attention_heads=int(m["num_attention_heads"]),
            vocab_size=int(m["vocab_size"]),
            seq_len=int(m["seq_len"]),
            causal_lm=bool(m.get("causal_lm", True)),
            intermediate_size=m.get("intermediate_size"),
            name=str(m.get("name", "model")),
            attn_implementation=str(m.get("attn_implementation", "auto")),
            task=str(m.get("task", "")),
        )
