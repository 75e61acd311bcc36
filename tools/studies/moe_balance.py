"""Auxiliary-loss-free balancing, measured: a tiny MoE model trained with and without the router bias.

    python -m tools.studies.moe_balance [--steps 200] [--rate 0.01] [--out runs/moe_balance] [key=value ...]

Two runs of `tiny-moe` reshaped to a dense layer then one MoE layer (8 experts, top-2, dropless, no
load-balancing loss, so the logged per-expert load is that one layer's): one with `model.moe.bias_update_rate`
= `--rate`, one without. Each is an ordinary run directory under `--out` (one already finished is not run
again); `key=value` overrides go to both. Prints the busiest expert's load over the mean (1 = even) at step 1
(before any bias has moved), averaged over steps 2–11 and over the last 10 steps, and the language-model loss at
the end. BENCHMARKS.md "MoE balancing"
records one measurement.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

WINDOW = 10  # steps averaged after the first and at the end


def run_keys(steps: int, rate: float, run_dir: str) -> dict:
    return {"model.preset": "tiny-moe", "model.segments": [{"layers": 1, "pattern": ["dense"]},
                                                           {"layers": 1, "pattern": ["moe"]}],
            "model.seq_len": 64, "model.moe.capacity_factor": 0.0, "model.moe.balance_weight": 0.0,
            "model.moe.bias_update_rate": rate, "train.steps": steps, "train.global_batch": 16,
            "train.log_every": 1, "train.eval_every": 0, "train.checkpoint_every": 0, "run.sample_tokens": 0,
            "run.progress": False, "run.dir": run_dir}


def rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "moe_load_max_over_mean" in r]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.studies.moe_balance", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0.01)
    parser.add_argument("--out", default="runs/moe_balance")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from jaxllm.config import build_config, parse_overrides
    from jaxllm.trainer.loop import train

    table = []
    for name, rate in (("bias", args.rate), ("no bias", 0.0)):
        run_dir = os.path.join(args.out, name.replace(" ", "_"))
        if not (os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and len(rows(run_dir)) >= args.steps):
            train(build_config(None, {**run_keys(args.steps, rate, run_dir), **parse_overrides(args.overrides)}))
        r = rows(run_dir)
        ratio = [x["moe_load_max_over_mean"] for x in r]
        table.append((name, rate, ratio[0], np.mean(ratio[1:1 + WINDOW]), np.mean(ratio[-WINDOW:]), r[-1]["loss"]))
    print(f"{'run':8} {'rate':>6} {'step 1':>7} {'steps 2-11':>10} {'last 10':>8} {'final loss':>10}  (max/mean load)")
    for name, rate, first, early, end, loss in table:
        print(f"{name:8} {rate:6.3f} {first:7.3f} {early:10.3f} {end:8.3f} {loss:10.4f}")


if __name__ == "__main__":
    main()
