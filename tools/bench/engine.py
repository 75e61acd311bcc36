"""`python -m tools.bench.engine [--requests 256] [--slots 32] [--page 16] [--rounds 3] [key=value ...]`: the rollout
engine (`jaxllm/generate/engine.py`: paged cache, continuous batching) against the static engine
(`generate/decode.py`) on the same requests, one device or a mesh.

The requests: --requests random prompts of 8-32 tokens, each with its own max_new_tokens from a skewed
distribution, 90% uniform over 8-32 and 10% 256 (RL's long tail), sampled at temperature 1 with seed 0. The
static engine runs them in batches of --slots rows in arrival order, each batch to its longest request's length
(it has one max_new_tokens per call); the engine keeps --slots slots busy. Both are compiled by a first round;
then --rounds interleaved rounds (the order swapped each round) time both, and the medians give completed
tokens per second (every request's own tokens, nothing past its max_new_tokens) and their ratio. With --json
the last stdout line is a JSON object. Default model: tiny-llama (fp32, seq 320); `key=value` overrides it. With
more than one device (XLA_FLAGS=--xla_force_host_platform_device_count=N on a CPU) both run on the mesh the
overrides name (`mesh.dp=4`: the engine's slots and page pools over 4 shards).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MODEL = ["model.preset=tiny-llama", "model.vocab_size=257", "model.seq_len=320", "precision.compute=float32"]


def requests(n: int, seed: int = 0) -> tuple[list, list]:
    """n prompts of 8-32 tokens and their max_new_tokens: 90% uniform over 8-32, 10% 256."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(1, 257, rng.integers(8, 33))] for _ in range(n)]
    new = [256 if rng.random() < 0.1 else int(rng.integers(8, 33)) for _ in range(n)]
    return prompts, new


def static_run(params, cfg, prompts, new, slots: int, on=None) -> float:
    from jaxllm.generate.decode import generate_arrays

    start = time.perf_counter()
    for b in range(0, len(prompts), slots):
        generate_arrays(params, cfg, prompts[b:b + slots], max(new[b:b + slots]), temperature=1.0, seed=0, on=on)
    return time.perf_counter() - start


def engine_run(engine, prompts, new) -> float:
    start = time.perf_counter()
    engine.generate(prompts, new, temperature=1.0, seed=0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import jax

    from jaxllm.api import step_fns_for
    from jaxllm.config import build_config
    from jaxllm.generate.engine import Engine
    from jaxllm.models.transformer import init_params

    cfg = build_config(None, [*MODEL, *args.overrides])
    params, on = init_params(cfg.model, jax.random.key(0)), None
    if jax.device_count() > 1:  # on the mesh the overrides name (mesh.dp=4 ...), both engines
        on = step_fns_for(cfg)
        params = jax.device_put(params, on.state_shardings.params)
    prompts, new = requests(args.requests)
    engine = Engine(params, cfg, slots=args.slots, page=args.page, on=on)
    runs = {"static": lambda: static_run(params, cfg, prompts, new, args.slots, on),
            "engine": lambda: engine_run(engine, prompts, new)}
    for run in runs.values():  # compile every program both need
        run()
    times = {k: [] for k in runs}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[name].append(runs[name]())
    tokens = sum(new)
    out = {"requests": args.requests, "slots": args.slots, "page": args.page, "completed_tokens": tokens,
           "static_s": statistics.median(times["static"]), "engine_s": statistics.median(times["engine"]),
           "decode_steps": engine.stats["decode_steps"], "prefill_calls": engine.stats["prefill_calls"],
           "devices": jax.device_count()}
    out["static_tokens_per_s"], out["engine_tokens_per_s"] = tokens / out["static_s"], tokens / out["engine_s"]
    out["speedup"] = out["static_s"] / out["engine_s"]
    print(f"{tokens} completed tokens of {args.requests} requests on {args.slots} slots: static engine "
          f"{out['static_tokens_per_s']:.0f} tokens/s ({out['static_s']:.2f} s), paged continuous engine "
          f"{out['engine_tokens_per_s']:.0f} tokens/s ({out['engine_s']:.2f} s, {out['decode_steps']} decode steps, "
          f"{out['prefill_calls']} prefill calls): "
          f"{out['speedup']:.2f}×")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
