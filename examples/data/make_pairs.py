"""How pairs.jsonl and preference.jsonl beside this file were made (both committed), in
the words of chat.jsonl so that chat-tokenizer/ reads them:

    .venv/bin/python examples/data/make_pairs.py

pairs.jsonl: 64 prompt-completion rows for a seq2seq model (a source of 8 to 60 words,
its target of 3 to 20). preference.jsonl: 64 preference pairs for DPO, a prompt of 4 to 18
words and two replies of 3 to 60 (rows of uneven length), as text;
preference-chat.jsonl: 32 more as conversations (lists of messages, rendered by the chat
template).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_chat import WORDS, sentence

HERE = Path(__file__).resolve().parent


def _said(role: str, text: str) -> list[dict]:
    return [{"role": role, "content": text}]


def main() -> None:
    rng = random.Random(11)
    pairs = [{"prompt": sentence(rng, 8, 60, "?"), "completion": sentence(rng, 3, 20, ".")}
             for _ in range(64)]
    (HERE / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    text, chat = [], []
    for i in range(96):
        prompt = sentence(rng, 4, 18, "?")
        chosen, rejected = sentence(rng, 3, 60, "."), sentence(rng, 3, 60, ".")
        if i % 3 == 2:
            chat.append({"prompt": _said("user", prompt), "chosen": _said("assistant", chosen),
                         "rejected": _said("assistant", rejected)})
        else:
            text.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    for name, rows in (("preference.jsonl", text), ("preference-chat.jsonl", chat)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(WORDS)} words; {len(pairs)} pairs, {len(text)} + {len(chat)} preference rows")


if __name__ == "__main__":
    main()
