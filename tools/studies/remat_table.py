"""`python -m tools.studies.remat_table [--config FILE] [--rounds 5] [key=value ...]`: the seeds' time-memory table of
activation recomputation beside the compiled train step of each setting.

For each row (`model.remat`, `model.remat_group`) it compiles the config's train step (as `jaxllm train`
builds it) and reads the compiled temporaries, then times the steps on random tokens, every setting taking
its turn in each of `--rounds` rounds (so load from other processes hits all alike); step times are medians,
and both columns are ratios to no recomputation. Default: tiny-llama at 16 layers, seq 128, batch 16, fp32,
one device. BENCHMARKS.md "Activation memory" records one run.

| setting | the seeds' activation memory | the seeds' compute |
|---|---|---|
| none | O(L): everything | 1 |
| selective (= save-dots) | the linear layers' outputs | ~1 + attention |
| full | O(L) layer inputs (O(1) per layer) | ~1.33 (one more forward) |
| √L groups over none | O(√L) group inputs + one group's activations | ~1.33 |
| √L groups over full | O(√L) group and layer inputs | ~1.67 (two more forwards) |
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

ROWS = [("none", 0, "O(L): everything", "1"), ("selective", 0, "linear layers' outputs", "~1 + attention"),
        ("full", 0, "O(L) layer inputs", "~1.33"), ("none", -1, "O(√L) + one group", "~1.33"),
        ("full", -1, "O(√L) inputs", "~1.67")]
DEFAULTS = {"model.preset": "tiny-llama", "model.n_layers": 16, "model.seq_len": 128, "train.global_batch": 16,
            "precision.compute": "float32", "mesh.dp": 1, "model.vocab_size": 257}


def build(overrides: dict, config: str | None):
    """(step fns, a state, a batch) for the config with `overrides`, on as many devices as its mesh asks."""
    import jax
    import numpy as np

    from jaxllm.batch import from_windows, global_arrays
    from jaxllm.config import build_config, validate
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.step import make_step_fns

    cfg = build_config(config, overrides)
    shape, _ = validate(cfg, len(jax.devices()))
    fns = make_step_fns(cfg, make_mesh(shape, cfg))
    m, t = cfg.model, cfg.train
    toks = np.random.default_rng(0).integers(0, m.vocab_size, (t.global_batch, m.seq_len + 1))
    return fns, fns.init(t.seed), global_arrays(from_windows(toks), fns.batch_sharding)


def measure(config: str | None, overrides: dict, rounds: int, steps: int) -> list[dict]:
    import jax

    from jaxllm.plan.hlo import memory_summary

    runs = []
    for remat, group, memory, compute in ROWS:
        fns, state, batch = build({**overrides, "model.remat": remat, "model.remat_group": group}, config)
        step = fns.train_step.lower(state, batch).compile()
        state, _ = step(state, batch)  # warm
        runs.append({"remat": remat, "group": group, "memory": memory, "compute": compute, "step": step,
                     "state": state, "batch": batch, "times": [],
                     "temp_bytes": memory_summary(step)["temp_bytes"]})
    for _ in range(rounds):
        for r in runs:
            start = time.perf_counter()
            for _ in range(steps):
                r["state"], metrics = r["step"](r["state"], r["batch"])
            jax.block_until_ready(metrics)
            r["times"].append((time.perf_counter() - start) / steps)
    return runs


def table(runs: list[dict]) -> str:
    base = runs[0]
    lines = ["| model.remat | remat_group | the seeds' memory | the seeds' compute | temporaries | vs none | "
             "step time | vs none |", "|---|---|---|---|---|---|---|---|"]
    t0 = statistics.median(base["times"])
    for r in runs:
        t = statistics.median(r["times"])
        lines.append(f"| {r['remat']} | {r['group']} | {r['memory']} | {r['compute']} | "
                     f"{r['temp_bytes'] / 2**20:.1f} MiB | {r['temp_bytes'] / base['temp_bytes']:.2f} | "
                     f"{t * 1e3:.1f} ms | {t / t0:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.config import parse_overrides

    p = argparse.ArgumentParser(prog="python -m tools.studies.remat_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a TOML config (default: tiny-llama, 16 layers, seq 128)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed window")
    args, rest = p.parse_known_args(argv)
    overrides = {} if args.config else dict(DEFAULTS)
    overrides.update(parse_overrides(rest))
    print(table(measure(args.config, overrides, args.rounds, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
