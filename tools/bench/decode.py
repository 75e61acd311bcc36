"""`python -m tools.bench.decode [--prompt 2048] [--new 65] [--rows 16] [--variant NAME KEY=VALUE ...]`:
the decode step of jaxllm's cached generation for model variants of one shape (default: the LLaMA-1B
preset in bf16 with its grouped-query cache, beside the same stack with latent attention, DeepSeek-V3's
head sizes), on one device.

Each variant's parameters are drawn at random (seed 0); its prompts are random token ids, --rows of
--prompt tokens. Generation is greedy and timed twice, with --new tokens and with 1 (the prefill alone),
each compiled first and run --repeats times (the median kept): one decode step costs
(t(new) - t(1)) / (new - 1). Reported per variant: that step's milliseconds, new tokens per second over
all rows, and the cache's bytes per device (`generate.cache.cache_bytes`). With --json the last stdout
line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SHAPE = ["model.preset=llama-1b", "model.vocab_size=128256", "precision.compute=bfloat16"]
VARIANTS = {
    "gqa": [],
    "mla": ["model.attention=mla", "model.mla.kv_lora_rank=512", "model.mla.qk_nope_head_dim=128",
            "model.mla.qk_rope_head_dim=64", "model.mla.v_head_dim=128", "model.mla.q_lora_rank=1536"],
}


def _seconds(params, cfg, prompts, new: int, repeats: int) -> float:
    from jaxllm.generate.decode import generate_arrays

    timings: dict = {}
    generate_arrays(params, cfg, prompts, new, temperature=0.0, timings=timings)  # compiles, runs once
    runs = []
    for _ in range(repeats):
        generate_arrays(params, cfg, prompts, new, temperature=0.0, timings=timings)
        runs.append(timings["run_s"])
    return statistics.median(runs)


def measure(overrides: list[str], prompt: int, new: int, rows: int, repeats: int) -> dict:
    """One variant: the decode step's seconds, tokens/s and the cache's bytes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.config import build_config
    from jaxllm.generate.cache import cache_bytes
    from jaxllm.models.transformer import count_params, init_params

    cfg = build_config(None, [*SHAPE, f"model.seq_len={prompt + new}", *overrides])
    m, dtype = cfg.model, jnp.dtype(cfg.precision.compute)
    params = jax.jit(lambda k: jax.tree.map(lambda a: a.astype(dtype), init_params(m, k)))(jax.random.key(0))
    prompts = [list(r) for r in np.random.default_rng(0).integers(0, m.vocab_size, (rows, prompt))]
    step = (_seconds(params, cfg, prompts, new, repeats) - _seconds(params, cfg, prompts, 1, repeats)) / (new - 1)
    return {"params": count_params(m), "step_ms": step * 1e3, "tokens_per_s": rows / step,
            "cache_bytes": cache_bytes(m, rows, prompt + new, dtype, None)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.decode", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=65)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
                   help="a variant of SHAPE: its name, then its overrides (default: gqa and mla)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    variants = {v[0]: v[1:] for v in args.variant} if args.variant else VARIANTS
    results = {name: measure(o, args.prompt, args.new, args.rows, args.repeats) for name, o in variants.items()}
    first = next(iter(results.values()))
    print(f"| variant | parameters | decode step | tokens/s | / {next(iter(results))} | cache bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['params']:,} | {r['step_ms']:.2f} ms | {r['tokens_per_s']:,.0f} | "
              f"{r['step_ms'] / first['step_ms']:.3f} | {r['cache_bytes']:,} |")
    if args.json:
        print(json.dumps({"prompt": args.prompt, "new": args.new, "rows": args.rows, "variants": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
