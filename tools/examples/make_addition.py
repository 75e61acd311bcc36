"""Write the fine-tuning example's data: two-digit addition as chat, with held-out pairs.

    python -m tools.examples.make_addition [OUT_DIR]  # default data/addition

Every pair a + b with 10 ≤ a, b ≤ 99 (8,100 of them) is one conversation, user "a+b", assistant the sum.
A fixed 300 pairs (drawn with seed 0) go to OUT_DIR/heldout.jsonl and never to OUT_DIR/train.jsonl, so
`jaxllm exact-match` measures sums the model has not seen. Deterministic: the same files every run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HELD_OUT = 300


def conversations() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(10, 100) for b in range(10, 100)]


def write(out: Path) -> tuple[int, int]:
    chats = conversations()
    order = np.random.default_rng(0).permutation(len(chats))
    held = set(order[:HELD_OUT].tolist())
    out.mkdir(parents=True, exist_ok=True)
    for name, keep in (("train.jsonl", lambda i: i not in held), ("heldout.jsonl", lambda i: i in held)):
        rows = [chats[i] for i in order.tolist() if keep(i)]
        (out / name).write_text("".join(json.dumps(c) + "\n" for c in rows), encoding="utf-8")
    return len(chats) - HELD_OUT, HELD_OUT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "data/addition")
    n_train, n_held = write(out)
    print(f"wrote {n_train} training and {n_held} held-out conversations to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
