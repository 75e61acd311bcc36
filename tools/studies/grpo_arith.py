"""The GRPO example, measured: seeds of `grpo_arith.toml` beside a control whose rewards carry no signal.

    python -m tools.studies.grpo_arith [--seeds 0 1 2] [--steps 300] [--out runs/grpo_study] [--format-data DIR]
                               [--async-steps K] [--no-control] [key=value ...]

For each seed: the format SFT (`jaxllm/configs/arith_format.toml`, a digit and end-of-text after
`a+b=`, any digit: right one time in ten), then GRPO from it with the exact-match reward
(`jaxllm/configs/grpo_arith.toml`), then the control: the same GRPO run with each group's rewards
shuffled among its completions (`shuffled_exact_match` below, a `python:` reward hook), which keeps their
mean and spread but not which completion earned them. Every run is an ordinary run directory under
`--out`, resumable (one already finished is not run again); `key=value` overrides go to the GRPO runs.
`--async-steps K` adds, per seed, the same GRPO run with `rl.async_steps=K` (asynchronous RL, from the same
format model) beside the synchronous one; `--no-control` leaves the control out.

Prints a table (mean reward over the first and last 20 steps of each run) and writes `rewards.png` (the
reward per step, 20-step moving mean). BENCHMARKS.md "GRPO" records one measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zlib

import numpy as np

from jaxllm.rl.rewards import exact_match

WINDOW = 20  # steps averaged at the start and the end of a run


def shuffled_exact_match(prompts, completions, answer, **_) -> list[float]:
    """Exact match, then each group's scores permuted among its completions (a group: consecutive
    completions of one prompt), seeded by the batch's text so a resumed run draws the same permutation."""
    scores = np.asarray(exact_match(prompts, completions, answer))
    rng = np.random.default_rng(zlib.crc32("\0".join(map(str, prompts + completions)).encode()))
    start = 0
    for end in range(1, len(prompts) + 1):
        if end == len(prompts) or prompts[end] != prompts[start]:
            scores[start:end] = rng.permutation(scores[start:end])
            start = end
    return scores.tolist()


CONTROL_REWARD = "python:tools.studies.grpo_arith:shuffled_exact_match"


def _run(config: str, run_dir: str, overrides: list[str]) -> None:
    """`jaxllm train` into `run_dir`, resumed if it holds a checkpoint; nothing if it is finished."""
    if os.path.exists(os.path.join(run_dir, "done")):
        return
    argv = [sys.executable, "-m", "jaxllm", "train", "--config", config, f"run.dir={run_dir}",
            "train.resume=true", "run.progress=false", *overrides]
    print("$", " ".join(argv[1:]), flush=True)
    subprocess.run(argv, check=True)
    open(os.path.join(run_dir, "done"), "w").close()


def rewards(run_dir: str) -> np.ndarray:
    """reward_mean of each step of a GRPO run directory."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return np.asarray([r["reward_mean"] for r in rows if "reward_mean" in r])


def run_seed(out: str, seed: int, steps: int, format_data: str, overrides: list[str], async_steps: int = 0,
             control: bool = True) -> dict[str, str]:
    """The format SFT, GRPO, its control (unless `control` is false) and with `async_steps` the asynchronous GRPO
    run for one seed: {name: run directory}."""
    run_dir = lambda name: os.path.join(out, f"{name}_seed{seed}")
    _run("arith_format", run_dir("format"),
         [f"train.seed={seed}", f"data.source={os.path.join(format_data, 'format.jsonl')}"])
    common = [f"init.from=run:{run_dir('format')}", f"train.seed={seed}", f"train.steps={steps}", "train.log_every=1",
              *overrides]
    runs = {"grpo": common}
    if control:
        runs["control"] = [*common, f'rl.rewards=["{CONTROL_REWARD}"]']
    if async_steps:
        runs["async"] = [*common, f"rl.async_steps={async_steps}"]
    for name, keys in runs.items():
        _run("grpo_arith", run_dir(name), keys)
    return {name: run_dir(name) for name in runs}


def plot(curves: dict[str, np.ndarray], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in curves.items():
        smooth = np.convolve(r, np.ones(WINDOW) / WINDOW, mode="valid")
        ax.plot(np.arange(WINDOW, len(r) + 1), smooth, label=name,
                ls="--" if "control" in name else ":" if "async" in name else "-")
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward (exact match), {WINDOW}-step mean")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.studies.grpo_arith", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="runs/grpo_study")
    p.add_argument("--format-data", default="data/arith",
                   help="where tools.examples.make_arith writes (if it is not there)")
    p.add_argument("--async-steps", type=int, default=0, help="also the GRPO run with rl.async_steps=K")
    p.add_argument("--no-control", action="store_true", help="leave the shuffled-reward control out")
    args, overrides = p.parse_known_args(argv)
    if not os.path.exists(os.path.join(args.format_data, "format.jsonl")):
        subprocess.run([sys.executable, "-m", "tools.examples.make_arith", args.format_data], check=True)
    os.makedirs(args.out, exist_ok=True)
    curves = {}
    print(f"| run | first {WINDOW} steps | last {WINDOW} steps |\n|---|---|---|")
    for seed in args.seeds:
        made = run_seed(args.out, seed, args.steps, args.format_data, overrides, args.async_steps, not args.no_control)
        for name, run_dir in made.items():
            r = curves[f"{name} seed {seed}"] = rewards(run_dir)
            print(f"| {name} seed {seed} | {r[:WINDOW].mean():.3f} | {r[-WINDOW:].mean():.3f} |", flush=True)
    plot(curves, os.path.join(args.out, "rewards.png"))
    print(f"plot: {os.path.join(args.out, 'rewards.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
