"""`python -m tools.bench.attention [--seq 2048 4096 ...] [--pairs 5] [--impls dense chunked ...] [key=value ...]`:
the train step with each `model.attention_impl` (default dense and chunked; on a GPU also pallas_gpu), timed
in interleaved rounds at each sequence length.

For each length the config (default: tiny-llama, batch 1, fp32, one device; overrides as for `jaxllm train`)
is compiled with each implementation, warmed up, then timed in `--pairs` rounds of `--steps` steps, taking
turns (the order reversed every other round) so load from other processes hits all alike. Reported: the
median step time of each, its ratio to the first implementation's (the median of the per-round ratios),
and each program's compiled temporaries. An implementation that does not compile or run at a length (out of
memory) is reported as such. With --json the last stdout line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time



def compiled_step(overrides: list[str], seq: int, impl: str):
    """(the compiled train step, a state, a batch, temporaries in bytes) for the config at `seq` with `impl`."""
    import jax
    import numpy as np

    from jaxllm.batch import from_windows, global_arrays
    from jaxllm.config import build_config, validate
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.step import make_step_fns

    base = ["model.preset=tiny-llama", "model.vocab_size=257", "train.global_batch=1", "precision.compute=float32",
            "mesh.dp=1"]
    cfg = build_config(None, [*base, *overrides, f"model.seq_len={seq}", f"model.attention_impl={impl}"])
    shape, _ = validate(cfg, 1)
    fns = make_step_fns(cfg, make_mesh(shape, cfg, devices=jax.devices()[:1]))
    rows = np.random.default_rng(0).integers(0, 257, (cfg.train.global_batch, seq + 1), dtype=np.int32)
    batch = global_arrays(from_windows(rows), fns.batch_sharding)
    state = fns.init(0)
    step = fns.train_step.lower(state, batch).compile()
    return step, state, batch, step.memory_analysis().temp_size_in_bytes


def timed(step, box: dict, batch, n: int) -> float:
    """Seconds per step over n steps (the state carried on in `box`)."""
    import jax

    state, start = box["state"], time.perf_counter()
    for _ in range(n):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    box["state"] = state
    return (time.perf_counter() - start) / n


def compare(overrides: list[str], seq: int, pairs: int, steps: int, impls: list[str]) -> dict:
    """Every implementation at one length: median seconds per step, the ratio to the first, temporaries."""
    programs, row = {}, {"seq": seq}
    for impl in impls:
        try:
            step, state, batch, temp = compiled_step(overrides, seq, impl)
            box = {"state": state}
            timed(step, box, batch, 1)  # warm-up
            programs[impl] = (step, box, batch, temp)
        except Exception as e:  # out of memory (XLA's RESOURCE_EXHAUSTED), reported rather than fatal
            row[f"{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times = {impl: [] for impl in programs}
    for r in range(pairs):
        for impl in list(programs) if r % 2 == 0 else list(programs)[::-1]:
            step, box, batch, _ = programs[impl]
            times[impl].append(timed(step, box, batch, steps))
    first = next(iter(programs), None)
    for impl in programs:
        row[f"{impl}_s"] = statistics.median(times[impl])
        row[f"{impl}_ratio"] = statistics.median(a / b for a, b in zip(times[impl], times[first]))
        row[f"{impl}_temp_bytes"] = programs[impl][3]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.attention", description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--pairs", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=3, help="steps per implementation per round (default 3)")
    p.add_argument("--impls", nargs="+", default=["dense", "chunked"], help="implementations, the first the baseline")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="config keys, e.g. model.n_layers=4 train.global_batch=2")
    args = p.parse_args(argv)
    print(f"{'seq':>6} {'implementation':>15} {'s/step':>9} {'/ ' + args.impls[0]:>10} {'temporaries':>14}", flush=True)
    rows = []
    for seq in args.seq:  # each length printed as it is measured
        rows.append(compare(args.overrides, seq, args.pairs, args.steps, args.impls))
        for impl in args.impls:
            r = rows[-1]
            if f"{impl}_error" in r:
                print(f"{seq:>6} {impl:>15}  {r[f'{impl}_error']}", flush=True)
            else:
                print(f"{seq:>6} {impl:>15} {r[f'{impl}_s']:>9.4f} {r[f'{impl}_ratio']:>10.3f} "
                      f"{r[f'{impl}_temp_bytes'] / 2**20:>10.0f} MiB", flush=True)
    if args.json:
        print(json.dumps({"rows": rows, "pairs": args.pairs, "steps": args.steps, "overrides": args.overrides}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
