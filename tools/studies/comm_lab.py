"""`python -m tools.studies.comm_lab [--min-kib 1] [--max-mib 64] [--repeats 5] [--out runs/comm_lab]`: the collectives
lab. Every hand-built all-reduce (`jaxllm/parallel/allreduce.py`) beside XLA's own `psum`, and the primitives,
over message sizes on the current devices (one axis over all of them).

For each (operation, size) it compiles the operation in a shard_map, reads from the compiled program the
`collective-permute` rounds and the bytes each device sends (counted from `source_target_pairs`, so a device
that sends nothing is not charged; max and mean over devices) beside the docstring's formula, then times it:
the median of `--repeats` calls after a warm-up. Bandwidths as nccl-tests defines them: algorithm bandwidth
= S / t (S: the bytes of one device's buffer) and bus bandwidth = algbw × 2(N-1)/N for all-reduce,
(N-1)/N for all-gather, reduce-scatter and all-to-all, 1 for broadcast and reduce.

Per algorithm it fits the α-β model t = α·rounds + β·bytes (bytes: the most one device sends) by least
squares over the sizes, prints α, β (as 1/β, a bandwidth) and writes `comm_lab.png` (time against size per
algorithm, with the fitted lines) and `comm_lab.json` under `--out`. Outside CI. On fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8) the devices share one memory and two cores: read the
rounds and bytes, and the times only as the cost of copies, not of a network. On GPUs the same command
gives the real table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
       "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}


def operations():
    """{name: (kind for the bus bandwidth, fn(x [elements] on one device, axis))}: S is the buffer each device
    holds, in or out (all_gather gathers S/N from each; reduce_scatter and all_to_all split S in N blocks)."""
    import jax

    from jaxllm.parallel import allreduce as A

    ops = {"xla psum": ("all_reduce", lambda x, a: jax.lax.psum(x, a))}
    ops.update({name: ("all_reduce", fn) for name, fn in A.ALGORITHMS.items()})
    blocks = lambda fn: lambda x, a: fn(x.reshape(A.axis_size(a), -1), a)  # [N, S/N] blocks
    ops.update({"all_gather": ("all_gather", lambda x, a: A.all_gather(x.reshape(A.axis_size(a), -1)[0], a)),
                "reduce_scatter": ("reduce_scatter", blocks(A.reduce_scatter)),
                "all_to_all": ("all_to_all", blocks(A.all_to_all)),
                "broadcast": ("broadcast", A.broadcast), "reduce": ("reduce", A.reduce)})
    return ops


def measure(name: str, fn, elements: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxllm.plan.hlo import collective_report, permute_bytes_by_device

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))
    f = jax.jit(jax.shard_map(lambda v: fn(v[0], "x")[None], mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.ones((n, elements), jnp.float32), NamedSharding(mesh, P("x")))
    compiled = f.lower(x).compile()
    hlo = compiled.as_text()
    sent = permute_bytes_by_device(hlo, n)
    report = collective_report(hlo)["collectives"]
    jax.block_until_ready(compiled(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(x))
        times.append(time.perf_counter() - start)
    rounds = report["collective-permute"]["count"]
    if not rounds:  # XLA's own collective: one call, charged the ring's bytes (what NCCL's ring would send)
        rounds, sent = sum(v["count"] for v in report.values()), [2 * (n - 1) * 4 * elements // n] * n
    return {"op": name, "bytes": 4 * elements, "seconds": statistics.median(times),
            "rounds": rounds, "sent_max": max(sent), "sent_mean": sum(sent) / n,
            "xla_collectives": {k: v["count"] for k, v in report.items() if v["count"] and k != "collective-permute"}}


def fit(rows: list[dict]) -> tuple[float, float]:
    """(α seconds per round, β seconds per byte) by least squares of t = α·rounds + β·sent_max in relative
    error (each row divided by its time: sizes span five orders of magnitude), α and β kept ≥ 0 (a
    negative one is set to 0 and the other refitted)."""
    import numpy as np

    t = np.array([r["seconds"] for r in rows])
    a = np.array([[r["rounds"], r["sent_max"]] for r in rows], float) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    if alpha < 0 or beta < 0:
        keep = 1 if alpha < 0 else 0
        only = float(np.linalg.lstsq(a[:, keep:keep + 1], np.ones(len(rows)), rcond=None)[0][0])
        alpha, beta = (0.0, only) if keep else (only, 0.0)
    return float(alpha), float(beta)


def plot(rows: list[dict], fits: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for op, (alpha, beta) in fits.items():
        mine = [r for r in rows if r["op"] == op]
        line = ax.loglog([r["bytes"] for r in mine], [r["seconds"] for r in mine], "o", label=op)[0]
        ax.loglog([r["bytes"] for r in mine], [max(alpha * r["rounds"] + beta * r["sent_max"], 1e-9) for r in mine],
                  "-", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("message bytes per device")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.studies.comm_lab", description=__doc__.split("\n\n")[0])
    p.add_argument("--min-kib", type=float, default=1)
    p.add_argument("--max-mib", type=float, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="runs/comm_lab")
    args = p.parse_args(argv)
    import jax

    n = jax.device_count()
    sizes, size = [], int(args.min_kib * 1024)
    while size <= args.max_mib * 2**20:
        sizes.append(size // 4 // n * n)  # fp32 elements, a multiple of N
        size *= 4
    rows, kinds = [], {}
    for name, (kind, fn) in operations().items():
        if n & (n - 1) and name in ("halving_doubling", "butterfly"):
            continue
        kinds[name] = kind
        for elements in sizes:
            rows.append(measure(name, fn, elements, args.repeats))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    fits = {op: fit([r for r in rows if r["op"] == op]) for op in kinds}
    os.makedirs(args.out, exist_ok=True)
    print(f"{n} {jax.devices()[0].platform} devices\n")
    print("| operation | bytes | rounds | sent max | sent mean | time | algbw | busbw |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        algbw = r["bytes"] / r["seconds"]
        print(f"| {r['op']} | {r['bytes']:,} | {r['rounds']} | {r['sent_max']:,} | {r['sent_mean']:,.0f} | "
              f"{r['seconds'] * 1e6:,.0f} µs | {algbw / 1e9:.2f} GB/s | {algbw * BUS[kinds[r['op']]](n) / 1e9:.2f} GB/s |")
    print("\n| operation | α (per round) | 1/β (bandwidth) |\n|---|---|---|")
    for op, (alpha, beta) in fits.items():
        bandwidth = f"{1 / beta / 1e9:.2f} GB/s" if beta > 0 else "n/a"
        print(f"| {op} | {alpha * 1e6:.1f} µs | {bandwidth} |")
    plot(rows, fits, os.path.join(args.out, "comm_lab.png"))
    with open(os.path.join(args.out, "comm_lab.json"), "w") as f:
        json.dump({"devices": n, "rows": rows, "fits": fits}, f, indent=1)
    print(f"\nplot: {os.path.join(args.out, 'comm_lab.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
