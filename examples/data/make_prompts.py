"""How prompts.jsonl beside this file was made (committed): the GRPO examples' prompts.

    .venv/bin/python examples/data/make_prompts.py

48 prompts of 4 to 40 words, from the chat rows' vocabulary (so chat-tokenizer/ reads
them without unknown tokens), every third as chat messages with a system turn: rows of
uneven length, some past a GRPO spec's 32-token prompt cap.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    rng = random.Random(7)
    words = sorted({w for line in (HERE / "chat.jsonl").read_text().splitlines()
                    for m in json.loads(line)["messages"] for w in m["content"].split()
                    if w.isalpha()})
    rows = []
    for i in range(48):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 40))) + " ?"
        if i % 3 == 2:
            rows.append({"prompt": [{"role": "system", "content": "you are a good assistant ."},
                                    {"role": "user", "content": text}]})
        else:
            rows.append({"prompt": text})
    (HERE / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
