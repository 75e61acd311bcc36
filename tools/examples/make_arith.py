"""Write the GRPO example's format data: `a+b=` followed by every digit, so a model learns the answer's form
and nothing of the sum.

    python -m tools.examples.make_arith [OUT_DIR]  # default data/arith

OUT_DIR/format.jsonl holds, for each of the 100 prompts `a+b=` (a, b ∈ 0..9), ten prompt_completion lines,
one per digit 0..9 as the completion. A model fine-tuned on it (jaxllm/configs/arith_format.toml)
answers with one digit and its end-of-text, right one time in ten: the start GRPO learns the sums from
(jaxllm/configs/grpo_arith.toml, whose built-in task `arith` asks for (a+b) mod 10). Deterministic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxllm.rl.prompts import arith_lines


def lines() -> list[dict]:
    return [{"prompt": p["prompt"], "completion": str(d)} for p in arith_lines() for d in range(10)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "data/arith")
    out.mkdir(parents=True, exist_ok=True)
    rows = lines()
    (out / "format.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} format lines to {out / 'format.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
