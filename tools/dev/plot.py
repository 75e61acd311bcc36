"""Draw a run's loss curves: `python -m tools.dev.plot RUN_DIR [--out PATH]` writes a PNG and prints its path."""

from __future__ import annotations

import argparse
import sys

from jaxllm.errors import UserError
from jaxllm.trainer.metrics import plot_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.dev.plot", description=__doc__)
    parser.add_argument("run_dir", help="a training run directory containing metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/loss.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_metrics(args.run_dir, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
