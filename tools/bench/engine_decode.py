"""`python -m tools.bench.engine_decode [--rows 64] [--prompt 2048] [--new 64] [--page 16] [--chip auto]
[--kernels auto xla] [--schedules overlap sync] [--windows W ...] [--profile DIR] [--tuning-from JSON]
[key=value ...]`: the rollout engine's decode step against the HBM bound, one device.

--rows requests of --prompt random tokens each decode --new tokens greedily on --rows slots, so every step runs
every slot. Each paged kernel named (`Engine(paged_kernel=...)`: `auto` is the Pallas kernel on a GPU where it
fits, `xla` the gathered pages) under each host schedule named (`overlap`, the engine's: each call sent before the
last one's tokens are read; `sync`: read, then sent) is compiled by a first run, then timed --repeats times with
--new tokens and with 1 (prefill and the first token alone), medians kept: a decode step costs (t(new) − t(1)) /
(new − 1). The bound is the bytes one step must read, the weights in the compute dtype (the embedding table only
where it is the tied head) and every row's cached keys and values at the step's mean length, over the chip's HBM
bandwidth (`jaxllm/plan/flops.CHIPS`). Beside it the decode program alone (`_program_seconds`: calls queued on
device-resident inputs), so the device's share of a step shows apart from the host's. Default shape: LLaMA-1B in
bf16 (the issue's); `key=value` overrides it. --profile also traces 8 queued calls of each engine's program and
prints where a decode step's device time goes (`tools.bench.profile_step`'s tables: by category, by part of the
model, by op). --windows times the model at each `model.sliding_window` named (0: none; which layers are local is
`model.window_pattern`'s), the bound always every row's whole cache. --tuning-from launches the Pallas paged
kernel as the fastest correct shape of a `tools.bench.paged_kernel --json` sweep. With --json the last stdout line
is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SHAPE = ["model.preset=llama-1b", "model.vocab_size=128256", "precision.compute=bfloat16"]


def chip_and_config(args, more: tuple = ()):
    """The chip whose bandwidth bounds the step (`--chip`, auto: an H200's or an H100's) and the decode's config:
    SHAPE with room for --prompt + --new positions, then the command line's key=value overrides, then `more`."""
    import jax

    from jaxllm.config import build_config
    from jaxllm.plan.flops import check_chip

    chip = args.chip if args.chip != "auto" else "h200" if "H200" in jax.devices()[0].device_kind else "h100"
    check_chip(chip)
    return chip, build_config(None, [*SHAPE, f"model.seq_len={args.prompt + args.new}", *args.overrides, *more])


def step_bytes(cfg, rows: int, prompt: int, new: int) -> int:
    """Bytes a decode step reads: the weights as used and the rows' cache at the mean length of the steps."""
    import jax.numpy as jnp

    from jaxllm.generate.cache import per_token
    from jaxllm.models import transformer

    m, size = cfg.model, jnp.dtype(cfg.precision.compute).itemsize
    weights = transformer.count_params(m) - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    length = prompt + (new + 1) / 2
    return int(weights * size + rows * length * m.n_layers * per_token(m)[0] * size)


def _seconds(engine, prompts, new: int, repeats: int) -> float:
    engine.generate(prompts, new, temperature=0.0)  # compiles
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompts, new, temperature=0.0)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _queued_inputs(engine, length: int):
    """A decode call's inputs on the device: every slot at position `length` over pages of its own, never ending."""
    import jax
    import numpy as np

    from jaxllm.generate.engine import slot_inputs

    slots, per, shards = engine.slots, engine.row_pages, engine.shards
    own = np.arange(1, 1 + slots // shards * per, dtype=np.int32).reshape(slots // shards, per)
    table = np.tile(own, (shards, 1))  # a shard's slots over its own pool (1 + its slots × (per + 1) pages)
    ones = np.ones(slots, np.int32)
    return jax.device_put((np.zeros(slots, np.int32), slot_inputs(np.full(slots, length, np.int32), ones, ones,
                                                                  np.arange(slots, dtype=np.int32),
                                                                  np.full(slots, 1 << 20, np.int32), table)))


def _queued_calls(engine, inputs, calls: int) -> float:
    """Seconds for `calls` decode calls queued back to back (no scheduling on the host, no token read back)."""
    import jax

    pools, token = engine.pools, None
    start = time.perf_counter()
    for _ in range(calls):
        pools, token, _, _ = engine.decode(engine.weights, pools, *inputs, engine.seed, engine.settings)
    jax.block_until_ready((pools, token))
    engine.pools = pools
    return time.perf_counter() - start


def _program_seconds(engine, length: int, calls: int, steps_per_call: int) -> float:
    """The decode program alone: `calls` calls queued on inputs already on the device, seconds a decode step.
    Against the engine's step this splits the device's time from the host's."""
    inputs = _queued_inputs(engine, length)
    _queued_calls(engine, inputs, 1)  # warm
    return _queued_calls(engine, inputs, calls) / calls / steps_per_call


def _profile(engine, length: int, calls: int, steps_per_call: int, out_dir: str) -> dict:
    """Where a decode step's device time goes: `calls` queued calls traced and reduced by
    tools.bench.profile_step's tables (by op, category and part), per decode step."""
    import jax

    from jaxllm.trainer.profiling import HLO_FILE
    from tools.bench import profile_step

    os.makedirs(out_dir, exist_ok=True)
    inputs = _queued_inputs(engine, length)
    lowered = engine.decode.lower(engine.weights, engine.pools, *inputs, engine.seed, engine.settings)
    with open(os.path.join(out_dir, HLO_FILE), "w") as f:
        f.write(lowered.compile().as_text())
    _queued_calls(engine, inputs, 1)  # warm
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        seconds = _queued_calls(engine, inputs, calls)
    steps = calls * steps_per_call
    result = profile_step.analyze(out_dir, steps, seconds / steps)
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(result, f)
    print(f"{out_dir}: {seconds / steps * 1e3:.3f} ms a decode step traced; events from {result['source']}",
          profile_step.format_breakdown(result, top=20), sep="\n", flush=True)
    return result


def _timed(choice: str, steps_per_call: int, schedule: str, params, cfg, prompts, args, out: dict) -> dict:
    """One engine's decode step (`choice` of paged kernel, `steps_per_call`, `schedule`) timed, printed and
    returned."""
    from jaxllm.generate.engine import Engine

    engine = Engine(params, cfg, slots=args.rows, page=args.page, paged_kernel=choice, steps_per_call=steps_per_call,
                    overlap=schedule == "overlap")
    whole = _seconds(engine, prompts, args.new, args.repeats)
    length = args.prompt + args.new // 2  # the program alone on the pools this run left: tables wide enough for it
    program = _program_seconds(engine, length, max(args.new // steps_per_call, 8), steps_per_call)
    if args.profile and schedule == args.schedules[0]:  # one program: the schedules differ on the host only
        _profile(engine, length, 8, steps_per_call, os.path.join(args.profile, f"{choice}_{steps_per_call}"))
    step = (whole - _seconds(engine, prompts, 1, args.repeats)) / (args.new - 1)
    bound = out["bound_ms"] / 1e3
    window = f", window {cfg.model.sliding_window}" if cfg.model.sliding_window else ""
    print(f"{choice} ({engine.kernel[0] or 'xla gather'}, {steps_per_call} steps a call, {schedule}{window}): "
          f"{step * 1e3:.3f} ms a "
          f"decode step of {args.rows} rows; the bound {bound * 1e3:.3f} ms ({out['step_bytes'] / 1e9:.3f} GB at "
          f"{out['chip']}'s HBM): {bound / step * 100:.1f}% of it; the program alone {program * 1e3:.3f} ms "
          f"({bound / program * 100:.1f}%), the rest the host's scheduling and the tokens read back", flush=True)
    return {"kernel": engine.kernel[0] or "xla", "steps_per_call": steps_per_call, "schedule": schedule,
            "step_ms": step * 1e3,
            "of_bound": bound / step, "program_ms": program * 1e3}


def _tune(path: str) -> None:
    """The fastest correct launch shape of the sweep whose JSON line `path` holds, made the paged kernel's
    `paged_attention.DEFAULT` for this run (the kernel reads it when traced)."""
    from jaxllm.ops import paged_attention
    from tools.bench.paged_kernel import fastest, tuning_of

    with open(path) as f:
        best = fastest(json.loads(f.read().strip().splitlines()[-1])["shapes"])
    if best is None:
        raise SystemExit(f"{path}: no launch shape was timed and correct")
    paged_attention.DEFAULT = tuning_of(best)
    print(f"the paged kernel launched as {paged_attention.DEFAULT} (the fastest of {path})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.engine_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chip", default="auto", help="the chip's HBM bandwidth for the bound (auto: h200 on an H200, "
                    "else h100)")
    ap.add_argument("--kernels", nargs="+", default=["auto", "xla"])
    ap.add_argument("--steps-per-call", type=int, nargs="+", default=[1],
                    help="decode steps an engine's program call runs (Engine(steps_per_call=...)); each one timed")
    ap.add_argument("--schedules", nargs="+", default=["overlap", "sync"], choices=["overlap", "sync"],
                    help="overlap: each call sent before the last one's tokens are read (the engine's default); sync: "
                    "the host reads each call's tokens before it sends the next. Each one timed")
    ap.add_argument("--windows", type=int, nargs="+", default=[], help="model.sliding_window values, each timed "
                    "(default: the config's)")
    ap.add_argument("--profile", metavar="DIR", help="also trace 8 queued decode calls of each engine and print "
                    "where a step's device time goes (tools.bench.profile_step's tables; the trace under DIR)")
    ap.add_argument("--tuning-from", metavar="JSON", help="launch the Pallas paged kernel as the fastest correct "
                    "shape of a sweep (the JSON line `tools.bench.paged_kernel --json` ends with; default: "
                    "paged_attention.DEFAULT)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from jaxllm.models.transformer import init_params
    from jaxllm.ops import paged_attention
    from jaxllm.plan.flops import CHIPS

    if args.tuning_from:
        _tune(args.tuning_from)
    chip, cfg = chip_and_config(args)
    params = init_params(cfg.model, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, cfg.model.vocab_size, args.prompt)] for _ in range(args.rows)]
    moved = step_bytes(cfg, args.rows, args.prompt, args.new)
    bound = moved / CHIPS[chip][1]
    out = {"rows": args.rows, "prompt": args.prompt, "new": args.new, "chip": chip, "step_bytes": moved,
           "bound_ms": bound * 1e3, "device": jax.devices()[0].device_kind, "kernels": {},
           "paged_tuning": paged_attention.DEFAULT._asdict()}
    for window in args.windows or [None]:
        at = cfg if window is None else chip_and_config(args, (f"model.sliding_window={window}",))[1]
        for choice in args.kernels:
            for k in args.steps_per_call:
                for schedule in args.schedules:
                    name = ", ".join([f"window {window}"] * (window is not None) + [choice]
                                     + [f"{k} steps a call"] * (args.steps_per_call != [1]) + [schedule])
                    out["kernels"][name] = _timed(choice, k, schedule, params, at, prompts, args, out)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
