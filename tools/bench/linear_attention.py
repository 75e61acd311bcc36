"""`python -m tools.bench.linear_attention [--seq 2048 4096 ...] [--repeats 3] [--max-temp-gib 8] [key=value ...]`:
Gated DeltaNet (linear attention) against softmax attention: the compiled loss-and-gradients program's
temporaries and its wall time at each sequence length.

Three stacks of one size (default: LLaMA blocks, 2 layers, d_model 256, d_ff 1024, the byte vocabulary,
batch 1, fp32, one device; overrides as for `jaxllm train`), their token mixers equally wide:

    linear   model.pattern=["linear"]: 4 key heads and 4 value heads of 64 (q, k, v each 256 wide)
    dense    softmax attention, 4 heads on 4 KV heads of 64, model.attention_impl=dense
    chunked  the same attention, model.attention_impl=chunked

At each length each stack's `loss_and_grads` (the train step's own gradient path, without the optimizer's
update) is compiled and its temporaries read (`memory_analysis().temp_size_in_bytes`). A program whose
temporaries exceed --max-temp-gib is not run (the reason printed); the others are warmed up once, then called
--repeats times in interleaved rounds (the order reversed every other round, so load from other processes hits
all alike), the minimum taken. Ratios are against the peers measured in the same run: dense and chunked
attention. With --json the last stdout line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

BASE = ["model.family=llama", "model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4",
        "model.d_ff=1024", "model.vocab_size=257", "model.linear_attn.num_k_heads=4",
        "model.linear_attn.num_v_heads=4", "model.linear_attn.head_k_dim=64", "model.linear_attn.head_v_dim=64",
        "train.global_batch=1", "precision.compute=float32", "mesh.dp=1"]
STACKS = {"linear": ['model.pattern=["linear"]'], "dense": ["model.attention_impl=dense"],
          "chunked": ["model.attention_impl=chunked"]}
PEERS = ("dense", "chunked")


def compiled(overrides: list[str], stack: str, seq: int):
    """(the compiled loss-and-gradients program, its arguments, temporaries in bytes) of `stack` at `seq`."""
    import jax
    import numpy as np

    from jaxllm.batch import from_windows, global_arrays
    from jaxllm.config import build_config, validate
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.step import make_step_fns

    cfg = build_config(None, [*BASE, *STACKS[stack], *overrides, f"model.seq_len={seq}"])
    shape, _ = validate(cfg, 1)
    fns = make_step_fns(cfg, make_mesh(shape, cfg, devices=jax.devices()[:1]))
    rows = np.random.default_rng(0).integers(0, 257, (cfg.train.global_batch, seq + 1), dtype=np.int32)
    args = (fns.init(0).params, global_arrays(from_windows(rows), fns.batch_sharding))
    program = fns.loss_and_grads.lower(*args).compile()
    return program, args, program.memory_analysis().temp_size_in_bytes


def seconds(program, args) -> float:
    """Wall seconds of one call, to its results on the host side of the device (block_until_ready)."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    return time.perf_counter() - start


def measure(overrides: list[str], seq: int, repeats: int, limit_bytes: int) -> dict:
    """Every stack at one length: {stack: {"temp_bytes", "s" (min of the repeats) or "skipped" (why)}}."""
    from jaxllm.plan.hlo import format_bytes

    runs, row = {}, {}
    for stack in STACKS:
        program, args, temp = compiled(overrides, stack, seq)
        row[stack] = {"temp_bytes": temp}
        if temp > limit_bytes:  # dense's [heads, t, t] arrays: would not fit, or crowd the machine out
            row[stack]["skipped"] = f"temporaries {format_bytes(temp)} > --max-temp-gib {limit_bytes / 2**30:g}"
            continue
        seconds(program, args)  # warm-up: the first call's allocations
        runs[stack] = (program, args, [])
    for r in range(repeats):
        for stack in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            runs[stack][2].append(seconds(*runs[stack][:2]))
    for stack, (_, _, times) in runs.items():
        row[stack]["s"] = min(times)
    return row


def ratio(row: dict, stack: str, peer: str, key: str) -> str:
    """`stack`'s `key` over the peer's in the same row, or "-" where either was not measured."""
    a, b = row[stack].get(key), row[peer].get(key)
    return "-" if a is None or b is None else f"{a / b:.3f}"


def table(rows: dict) -> list[str]:
    """A markdown table: each stack's absolute numbers and its ratios to dense and to chunked."""
    lines = ["| t | stack | temporaries | s/call | temps / dense | temps / chunked | time / dense | time / chunked |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for seq, row in rows.items():
        for stack, r in row.items():
            s = f"{r['s']:.3f}" if "s" in r else f"not run: {r['skipped']}"
            lines.append(f"| {seq} | {stack} | {r['temp_bytes'] / 2**20:,.1f} MiB | {s} | "
                         + " | ".join(ratio(row, stack, p, k) for k in ("temp_bytes", "s") for p in PEERS) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.linear_attention",
                                description="Gated DeltaNet against softmax attention: the compiled loss and gradients")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each program after its warm-up (default 3)")
    p.add_argument("--max-temp-gib", type=float, default=8.0,
                   help="programs with more temporaries are compiled but not run (default 8)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="config keys, e.g. model.n_layers=4 model.d_model=512")
    args = p.parse_args(argv)
    rows = {}
    for seq in args.seq:  # each length printed as it is measured: a long run shows its progress
        rows[seq] = measure(args.overrides, seq, args.repeats, int(args.max_temp_gib * 2**30))
        print("\n".join(table({seq: rows[seq]})[2 if len(rows) > 1 else 0:]), flush=True)
    if len(rows) > 1:
        print("\n" + "\n".join(table(rows)))
    if args.json:
        print(json.dumps({"rows": rows, "repeats": args.repeats, "overrides": args.overrides}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
