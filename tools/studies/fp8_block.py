"""DeepSeek-V3's fine-grained FP8 on the default job, against the compute dtype, as a user runs them.

    python -m tools.studies.fp8_block [OUT_DIR] [--steps 300] [key=value ...]

Trains the default job (`jaxllm/configs/default.toml`, seed 0) three times: `precision.matmul = "default"`,
`"fp8_block"`, and `"fp8_block"` with `train.moment_dtype = "bfloat16"`; the same data, schedule and seed. Prints
each run's loss every `train.log_every` steps (the curve), its final loss and its ratio to the default's, and its
wall time; with --json one more line of everything. About 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {"default": [], "fp8_block": ["precision.matmul=fp8_block"],
        "fp8_block + bf16 moments": ["precision.matmul=fp8_block", "train.moment_dtype=bfloat16"]}


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.studies.fp8_block", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="fp8_block_"))
    curves, seconds = {}, {}
    for name, keys in RUNS.items():
        run_dir = out / name.replace(" ", "_").replace("+", "and")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "jaxllm", "train", f"train.steps={args.steps}", "train.seed=0",
                               "train.eval_every=0", "train.checkpoint_every=0", "run.sample_tokens=0",
                               "run.progress=false", f"run.dir={run_dir}", *keys, *args.overrides],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        if done.returncode:
            raise SystemExit(f"{name}: jaxllm train failed: {done.stderr.strip().splitlines()[-1]}")
        seconds[name], curves[name] = time.perf_counter() - start, losses(run_dir)
    base = curves["default"]
    steps = sorted(base)
    print("| step | " + " | ".join(RUNS) + " |")
    print("|---:|" + "---:|" * len(RUNS))
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{curves[n][s]:.4f}" for n in RUNS) + " |")
    final = {n: curves[n][steps[-1]] for n in RUNS}
    print("\nfinal loss: " + "; ".join(f"{n} {final[n]:.4f} (×{final[n] / final['default']:.4f}, "
                                         f"{seconds[n]:.0f} s)" for n in RUNS))
    if args.json:
        print(json.dumps({"curves": curves, "final": final, "seconds": seconds, "steps": args.steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
