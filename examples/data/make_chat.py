"""How chat.jsonl and chat-tokenizer/ beside this file were made (both committed):

    .venv/bin/python examples/data/make_chat.py

64 conversations of one to three exchanges, replies of 3 to 60 words (rows of uneven
length, where padding-free packing pays), every fourth with a system prompt; and a
word-level tokenizer over their words with a ChatML-like chat template whose
{% generation %} tags let TRL find the assistant's turns too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
WORDS = (  # noqa: SIM905 - a paragraph of words reads better than a list literal
    "the a model train training batch size memory gpu fast slow run step loss learning "
    "rate token tokens sequence long short data set chat assistant user answer question "
    "why how what is are can will should would could my your our it this that these "
    "those with without for to of in on at by from and or but not very more less most "
    "least good better best bad worse number large small tiny huge checkpoint gradient "
    "optimizer adam precision half float bits quantized base adapter lora rank kernel "
    "attention flash compile fused cache time second minute hour day please thanks "
    "hello yes no maybe sure okay here there then now").split()
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|im_end|> "
    "{% endgeneration %}{% else %}{{ m['content'] }} <|im_end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def sentence(rng: random.Random, low: int, high: int, end: str) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + f" {end}"


def main() -> None:
    rng = random.Random(7)
    rows = []
    for i in range(64):
        turns = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            turns += [{"role": "user", "content": sentence(rng, 4, 18, "?")},
                      {"role": "assistant", "content": sentence(rng, 3, 60, ".")}]
        if i % 4 == 0:
            turns.insert(0, {"role": "system", "content": "you are a good assistant ."})
        rows.append({"messages": turns})
    (HERE / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = SPECIALS + ["system", "user", "assistant", "?", "."] + sorted(set(WORDS))
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(names)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(HERE / "chat-tokenizer"))
    print(f"{len(names)} words; {len(rows)} conversations")


if __name__ == "__main__":
    main()
