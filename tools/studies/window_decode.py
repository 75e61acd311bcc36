"""`python -m tools.studies.window_decode [--rows 32] [--prompt 1024] [--window 128] [--repeats 5] [key=value ...]`:
what a windowed layer saves in the rollout engine's decode step, one device.

The decode program of a model whose layers alternate a window and none (`model.window_pattern` local, global), as
the engine runs it (a local layer gathers only the pages its window sees, `attention.in_window`; every decode step
attends with `dense`), beside two peers: every page gathered and masked, with `dense`; and so with the model's own
implementation (`chunked` under a window: the step before the engine narrowed windows). The peers are the library
with `attention.in_window` (and `cache_implementation`) replaced here, in this process only. Each variant's program
runs --calls calls queued on device-resident inputs (every row at position --prompt), the variants interleaved
--repeats times, medians kept. Default model: tiny-llama with 4 layers in fp32; `key=value` overrides it.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def _variants():
    """name -> (in_window, cache_implementation) of each step timed: the engine's, then its peers."""
    from jaxllm.models import attention

    whole, implementation = lambda cache, positions: cache, attention.cache_implementation
    model_impl = lambda m, queries=0: implementation(m)  # the model's implementation at every call
    return {"window pages, dense (the engine's)": (attention.in_window, attention.cache_implementation),
            "every page, dense": (whole, attention.cache_implementation),
            "every page, the model's implementation": (whole, model_impl)}


def _program_ms(cfg, params, args, reads) -> float:
    """The decode program's milliseconds a call with `reads` in place of the library's (in_window,
    cache_implementation)."""
    import jax

    from jaxllm.generate import engine as engine_lib
    from jaxllm.models import attention
    from tools.bench.engine_decode import _queued_calls, _queued_inputs

    kept = attention.in_window, attention.cache_implementation
    attention.in_window, attention.cache_implementation = reads
    try:
        engine_lib._compiled.clear()  # programs traced with these reads
        engine = engine_lib.Engine(params, cfg, slots=args.rows, page=args.page, paged_kernel="xla")
        engine.generate([[1] * args.prompt] * 2, 2, temperature=0.0)  # the pools sized as for a --prompt + 2 row
        inputs = _queued_inputs(engine, args.prompt)
        _queued_calls(engine, inputs, 2)  # compiles
        return _queued_calls(engine, inputs, args.calls) / args.calls * 1e3
    finally:
        attention.in_window, attention.cache_implementation = kept
        engine_lib._compiled.clear()
        jax.clear_caches()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.studies.window_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import jax

    from jaxllm.config import build_config
    from jaxllm.models.transformer import init_params

    cfg = build_config(None, ["model.preset=tiny-llama", "model.n_layers=4", "model.vocab_size=257",
                              "precision.compute=float32", 'model.window_pattern=["local","global"]',
                              f"model.sliding_window={args.window}", f"model.seq_len={args.prompt + 8}",
                              *args.overrides])
    params = init_params(cfg.model, jax.random.key(0))
    variants, times = _variants(), {}
    for _ in range(args.repeats):
        for name, reads in variants.items():
            times.setdefault(name, []).append(_program_ms(cfg, params, args, reads))
    engine = statistics.median(times[next(iter(variants))])
    print(f"decode program, {args.rows} rows at position {args.prompt}, window {args.window} on alternate layers "
          f"of {cfg.model.n_layers}, pages of {args.page} (medians of {args.repeats}):")
    print("| step | ms a call | / the engine's |\n|---|---:|---:|")
    for name, runs in times.items():
        print(f"| {name} | {statistics.median(runs):.3f} | {statistics.median(runs) / engine:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
