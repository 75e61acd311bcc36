"""Write the preference example's data: two-digit sums as preference pairs, the right sum chosen, a wrong one rejected.

    python -m tools.examples.make_addition_pairs [OUT_DIR] [--from RUN_DIR] [--shuffled]   # default data/addition_pairs

The prompts are the fine-tuning example's (`tools.examples.make_addition`: user "a+b"), split the same way:
OUT_DIR/train.jsonl holds a pair for every training sum, OUT_DIR/heldout.jsonl one for each of the 300 held-out sums. The rejected reply
is the model's own mistake where `--from` names a fine-tuned run (its greedy reply, when that is wrong: the pairs
are on-policy), else a near miss of the sum of the kinds a small model makes: off by one or by ten, or its last two
digits swapped. `--shuffled` writes the control: each training pair's chosen and rejected swapped with probability
½ (the labels carry no information); the held-out pairs stay right. Deterministic given the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tools.examples import make_addition


def near_miss(total: int, rng) -> int:
    """A wrong sum near `total`, never negative."""
    digits = str(total)
    swapped = int(digits[:-2] + digits[-1] + digits[-2]) if len(digits) >= 2 and digits[-1] != digits[-2] else None
    choices = [total + 1, total - 1, total + 10, total - 10] + ([swapped] if swapped is not None else [])
    return int(rng.choice([c for c in choices if c >= 0 and c != total]))


def pair(chat: dict, rng, swap: bool = False, answer: str | None = None) -> dict:
    """The chat's pair: its reply chosen; `answer` rejected where it is another reply, else a near miss."""
    prompt, reply = chat["messages"][0], chat["messages"][1]["content"]
    wrong = answer.strip() if answer is not None and answer.strip() != reply else str(near_miss(int(reply), rng))
    chosen, rejected = (wrong, reply) if swap else (reply, wrong)
    return {"prompt": [prompt], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def greedy_replies(run_dir: str, chats_file: Path) -> list[str]:
    """A run's greedy reply to every chat of a file (as `jaxllm exact-match` generates them)."""
    import jaxllm

    return jaxllm.load(run_dir).exact_match(str(chats_file), max_new_tokens=8, batch=256).texts


def write(out: Path, shuffled: bool = False, model: str | None = None) -> dict:
    """Write the pairs; {split: (pairs, of them rejecting the model's own reply)}."""
    make_addition.write(out)  # the example's chats, split as it splits them
    rng, coin = np.random.default_rng(1), np.random.default_rng(2)  # the same near misses with and without swaps
    counts = {}
    for name in ("train.jsonl", "heldout.jsonl"):
        chats = [json.loads(line) for line in (out / name).read_text().splitlines()]
        answers = greedy_replies(model, out / name) if model else [None] * len(chats)
        swaps = coin.random(len(chats)) < 0.5 if shuffled and name == "train.jsonl" else np.zeros(len(chats), bool)
        rows = [pair(c, rng, bool(s), a) for c, s, a in zip(chats, swaps, answers)]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        own = sum(a is not None and a.strip() != c["messages"][1]["content"] for c, a in zip(chats, answers))
        counts[name.split(".")[0]] = (len(rows), own)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.examples.make_addition_pairs",
                                description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="data/addition_pairs")
    p.add_argument("--from", dest="model", help="a fine-tuned run whose mistakes are rejected")
    p.add_argument("--shuffled", action="store_true", help="the control: training labels swapped at random")
    args = p.parse_args(argv)
    counts = write(Path(args.out), args.shuffled, args.model)
    for split, (n, own) in counts.items():
        print(f"{args.out}/{split}.jsonl: {n} pairs{' (shuffled)' if args.shuffled and split == 'train' else ''}, "
              f"{own} rejecting the model's own reply")
    return 0


if __name__ == "__main__":
    sys.exit(main())
