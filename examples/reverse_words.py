"""A generated instruction task whose answers are checkable: reverse a short list of words.

    python examples/reverse_words.py --out data/reverse      # writes train.jsonl and eval.jsonl there

Each line is {"prompt": "reverse: apple river stone\\n", "completion": "stone river apple"}; the eval file's
word lists never occur in the train file, so a model must learn the operation, not the examples.
"""
import argparse
import json
import random
from pathlib import Path

WORDS = ("apple river stone cloud tiger lamp orange music paper glass honey window silver forest candle "
         "rocket garden mirror pencil thunder").split()


def example(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(2, 4))
    return "reverse: " + " ".join(words) + "\n", " ".join(reversed(words))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    held = {}
    while len(held) < a.eval:
        prompt, completion = example(rng)
        held[prompt] = completion
    train = []
    while len(train) < a.train:
        prompt, completion = example(rng)
        if prompt not in held:
            train.append((prompt, completion))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, pairs in (("train.jsonl", train), ("eval.jsonl", list(held.items()))):
        (out / name).write_text("".join(json.dumps({"prompt": q, "completion": c}) + "\n" for q, c in pairs))
    print(f"{len(train)} train and {len(held)} eval examples -> {out}")


if __name__ == "__main__":
    main()
