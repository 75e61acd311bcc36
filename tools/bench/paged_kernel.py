"""`python -m tools.bench.paged_kernel [key=value ...] [--rows 64] [--prompt 2048] [--new 64] [--page 16]
[--splits 16 ...] [--blocks 8 ...] [--warps 8 ...] [--stages 2 ...] [--chip auto] [--interpret]`: the Pallas paged
attention kernel alone (`jaxllm/ops/paged_attention.attend`) at one layer of a decode step, for each launch shape
(`paged_attention.Tuning`) of the grid the lists span.

Each row holds --prompt + --new / 2 positions (the decode's mean) on pages of its own; one call reads every row's
keys and values once, so its bound is those bytes over the chip's HBM bandwidth (`jaxllm/plan/flops.CHIPS`). Each
shape is compiled, checked against attention over the gathered pages in float32 (its largest error beside the
default shape's: a shape that computes something else is marked, never ranked), then --calls calls are queued
back to back, --repeats times, the median kept. Default model: LLaMA-1B in bf16 (the rollout issue's);
`key=value` (first, before the lists) overrides it. --interpret runs the kernel in Pallas's interpreter (off a GPU: checks, no timing worth
reading). With --json the last stdout line is a JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

from tools.bench.engine_decode import chip_and_config


def inputs(cfg, rows: int, length: int, page: int, seed: int = 0):
    """q [rows, 1, heads, d], the pools [kv_heads, 1 + rows·per, page, d] (page 0 scratch), each row's table of
    its own `per` pages, and the lengths, in the compute dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models.attention import head_dim, kv_heads

    m, dtype = cfg.model, jnp.dtype(cfg.precision.compute)
    d, per = head_dim(m), -(-length // page)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    pool = (kv_heads(m), 1 + rows * per, page, d)
    table = np.arange(1, 1 + rows * per, dtype=np.int32).reshape(rows, per)
    return (jax.random.normal(kq, (rows, 1, m.n_heads, d), dtype), jax.random.normal(kk, pool, dtype),
            jax.random.normal(kv, pool, dtype), jnp.asarray(table), jnp.full((rows,), length, jnp.int32))


def gathered(q, k_pool, v_pool, table, lengths, scale: float):
    """Attention of each row's query over its pages gathered in order, in float32: the reference."""
    import jax
    import jax.numpy as jnp

    f32 = lambda x: x.astype(jnp.float32)
    k = f32(k_pool[:, table]).reshape(k_pool.shape[0], table.shape[0], -1, k_pool.shape[-1])  # [kv, rows, t, d]
    v = f32(v_pool[:, table]).reshape(k.shape)
    group = q.shape[2] // k.shape[0]
    qg = f32(q[:, 0]).reshape(q.shape[0], k.shape[0], group, q.shape[-1]) * scale  # [rows, kv, group, d]
    scores = jnp.einsum("rkgd,krtd->rkgt", qg, k)
    seen = jnp.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
    weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    return jnp.einsum("rkgt,krtd->rkgd", weights, v).reshape(q.shape)


def _timed(call, args, calls: int, repeats: int) -> float:
    """Median seconds of one call, `calls` queued back to back per repeat."""
    import jax

    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = [call(*args) for _ in range(calls)]
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def sweep(cfg, args) -> list[dict]:
    """Every launch shape of the grid: its error against the reference and, off the interpreter, its time."""
    import jax
    import numpy as np

    from jaxllm.ops import paged_attention
    from jaxllm.ops.masking import Masking

    length = args.prompt + args.new // 2
    data = inputs(cfg, args.rows, length, args.page)
    reference = np.asarray(gathered(*data, Masking().score_scale(data[0].shape[-1])))
    grid = [paged_attention.DEFAULT] + [paged_attention.Tuning(*t) for t in itertools.product(
        args.splits, args.blocks, args.warps, args.stages)]
    results, seen = [], set()
    for tuning in grid:
        shape = paged_attention.partitions(data[3].shape[1], tuning) + tuning[2:]
        if shape in seen:  # caps that give the same launch as one already run
            continue
        seen.add(shape)
        call = jax.jit(lambda q, k, v, t, n, tuning=tuning: paged_attention.attend(
            q, k, v, t, n, Masking(), interpret=args.interpret, tuning=tuning))
        error = float(np.max(np.abs(np.asarray(call(*data), np.float32) - reference)))
        seconds = None if args.interpret else _timed(call, data, args.calls, args.repeats)
        results.append({**tuning._asdict(), "k_splits": shape[0], "block": shape[1], "error": error,
                        "seconds": seconds})
    return results


def report(results: list[dict], moved: int, bandwidth: float) -> None:
    """Marks each shape's error against the default's (the first), adds its share of the bound, prints the table."""
    worst = 2 * results[0]["error"] + 1e-3  # another order of the same sums, in bf16, stays near the default's
    print("| splits | block | warps | stages | max error | µs a call | of the bound |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        r["computes_attention"] = r["error"] <= worst
        r["of_bound"] = moved / bandwidth / r["seconds"] if r["seconds"] else None
        timing = (f"{r['seconds'] * 1e6:.1f} | {r['of_bound'] * 100:.1f}%" if r["seconds"] else "- | -")
        mark = "" if r["computes_attention"] else " (wrong)"
        print(f"| {r['k_splits']} | {r['block']} | {r['num_warps']} | {r['num_stages']} | {r['error']:.2e}{mark} | "
              f"{timing} |")


def fastest(results: list[dict]) -> dict | None:
    """The fastest launch shape of a sweep's results that computes attention (None: none timed)."""
    return min((r for r in results if r["seconds"] and r["computes_attention"]), key=lambda r: r["seconds"],
               default=None)


def tuning_of(result: dict):
    """A sweep result's launch shape as `paged_attention.Tuning`."""
    from jaxllm.ops import paged_attention

    return paged_attention.Tuning(*(result[f] for f in paged_attention.Tuning._fields))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.paged_kernel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16, 32], help="Tuning.max_splits values")
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 8, 16], help="Tuning.block_pages values")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chip", default="auto", help="the chip's HBM bandwidth (auto: h200 on an H200, else h100)")
    ap.add_argument("--interpret", action="store_true", help="Pallas's interpreter: checks only, off a GPU")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxllm.generate.cache import per_token
    from jaxllm.plan.flops import CHIPS

    chip, cfg = chip_and_config(args)
    length = args.prompt + args.new // 2
    moved = args.rows * length * per_token(cfg.model)[0] * jnp.dtype(cfg.precision.compute).itemsize
    results = sweep(cfg, args)
    report(results, moved, CHIPS[chip][1])
    best = fastest(results)
    if best:
        print(f"fastest: {best['k_splits']} splits of {best['block']}-page blocks, {best['num_warps']} warps, "
              f"{best['num_stages']} stages: {best['of_bound'] * 100:.1f}% of {moved / 1e6:.1f} MB at {chip}'s HBM "
              f"(the default: {results[0]['of_bound'] * 100:.1f}%)")
    if args.json:
        print(json.dumps({"chip": chip, "device": jax.devices()[0].device_kind, "bytes": moved, "rows": args.rows,
                          "length": length, "page": args.page, "shapes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
