"""Time jaxllm's train step against the same model in plain JAX.

    python -m tools.bench.train_step [--config FILE] [key=value ...]

Builds the train step for the config exactly as `jaxllm train` would (same config
file default, overrides, validation, mesh and `make_step_fns`), feeds it synthetic
random tokens, and reports tokens/s, step time and MFU (the trainer's own FLOPs per
token and peak). Then does the same for the same model and step written plainly
(`tools/reference/plain_gpt.py` for gpt2, `tools/reference/plain_llama.py` for llama), with identical shapes,
and prints jaxllm's overhead over it (1 - ours/plain tokens/s). The baseline exists for
dense models on one device with AdamW, no remat and no microbatching; otherwise it is
reported as n/a.

Timing: both steps are compiled first (compile time is reported, never timed as a step),
run `--warmup` steps each, then timed in `--windows` rounds of `--steps` steps, jaxllm
and plain taking turns (ABBA order) so that load from other processes hits both alike;
each window ends with block_until_ready. Reported times are window medians; the process
CPU time per step is reported too (less sensitive to other processes on a shared machine).
On CPU the MFU peak is a matmul measured in this process (`peak_flops`), once per round,
keeping the best.
With --json the last stdout line is a JSON object. Config mistakes: `error: ...`, exit 2.

Pipeline parallelism (mesh.pp > 1): also a measured time bubble. Next to the pipelined
step, the bench times one stage's work for one microbatch with no pipeline around it:
the same config with n_layers/pp layers and mesh pp=1 (dp=fsdp=ep=1, sp and tp kept, so
one device when sp=tp=1), the forward and backward (`jax.value_and_grad` of the loss,
the step's own gradient path) of one microbatch's rows per batch shard,
global_batch/(microbatches·dp·fsdp·ep). Then

    pipeline_bubble_measured = 1 - microbatches · t_stage_microbatch / t_step

is the share of the step a stage is not computing, reported next to the schedule
table's `pipeline_bubble_table` (`bubble_fraction` at the model's per-layer costs, `transformer.layer_costs`). The stage
includes the embedding and the head, which only the first and last stages run, so it
over-estimates a middle stage's work (and under-estimates the bubble); the step's
optimizer update and the send/receive between stages count as bubble. On fake CPU
devices (--xla_force_host_platform_device_count) every stage shares the same host cores,
so the number says nothing there; it is meaningful on real accelerators, where each
stage is its own device.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time

from tools.reference import plain_model


def baseline_unavailable(cfg, n_devices: int) -> str | None:
    """Why the plain baseline cannot run this config (None: it can)."""
    m, t = cfg.model, cfg.train
    if n_devices != 1:
        return f"mesh has {n_devices} devices (plain baseline is one device)"
    if m.segments or m.pattern != ["dense"]:
        return f"model.pattern={m.pattern}, segments={m.segments} (the plain MoE runs every expert on every token: not a peer)"
    if m.mtp_depth:
        return f"model.mtp_depth={m.mtp_depth} (the plain model's prediction modules are a reference, not timed)"
    if m.remat != "none":
        return f"model.remat={m.remat} (plain baseline has no remat)"
    if t.microbatches != 1:
        return f"train.microbatches={t.microbatches} (plain baseline has no accumulation)"
    if t.optimizer != "adamw":
        return f"train.optimizer={t.optimizer} (plain baseline is adamw)"
    return None


def bench(cfg, steps: int = 10, warmup: int = 2, windows: int = 3, baseline: bool = True) -> dict:
    """Compile, warm up and time jaxllm's step (and the plain baseline's); return the numbers as a dict."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.config import validate
    from jaxllm.models.transformer import padded_vocab
    from jaxllm.errors import ConfigError
    from jaxllm.mesh import initialize_distributed, make_mesh
    from jaxllm.models import transformer
    from jaxllm.parallel.pipeline_schedules import bubble_fraction
    from jaxllm.trainer.step import pipeline_schedule
    from jaxllm.trainer.loop import flops_per_token, peak_flops, resolve
    from jaxllm.batch import from_windows, global_arrays
    from jaxllm.models.attention import choose
    from jaxllm.models.layers import matmul_precision
    from jaxllm.trainer.step import make_step_fns

    for name, v, low in (("--steps", steps, 1), ("--warmup", warmup, 0), ("--windows", windows, 1)):
        if v < low:
            raise ConfigError(f"{name}: must be at least {low}, got {v}")
    m, t = cfg.model, cfg.train
    initialize_distributed(cfg.distributed)
    _, shape, _ = resolve(cfg)  # vocab from the tokenizer, validated as the trainer does
    mesh = make_mesh(shape, cfg)
    n_dev = jax.device_count()
    dtype = jnp.dtype(cfg.precision.compute)
    tokens_np = np.random.default_rng(0).integers(0, m.vocab_size, (t.global_batch, m.seq_len + 1), dtype=np.int32)
    tokens_per_step = t.global_batch * m.seq_len
    fpt = flops_per_token(cfg)

    # ---- jaxllm
    fns = make_step_fns(cfg, mesh)
    tokens = global_arrays(from_windows(tokens_np), fns.batch_sharding)
    state = fns.init(t.seed)
    t0 = time.perf_counter()
    ours_step = fns.train_step.lower(state, tokens).compile()
    ours_compile = time.perf_counter() - t0
    box = {"state": state}

    def ours_window(n):
        s = box["state"]
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            s, metrics = ours_step(s, tokens)
        jax.block_until_ready((s, metrics))
        box["state"] = s
        return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n

    # ---- plain
    why_not = baseline_unavailable(cfg, n_dev) if baseline else "--no-baseline"
    plain_window = None
    if why_not is None:
        module, c = plain_model(m)
        tx = module.make_optimizer(lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.schedule_steps or t.steps,
                                   min_lr_ratio=t.min_lr_ratio, b1=t.beta1, b2=t.beta2, eps=t.eps,
                                   weight_decay=t.weight_decay, grad_clip=t.grad_clip)
        plain_tokens = jax.device_put(tokens_np, jax.devices()[0])
        params = jax.jit(module.init_params, static_argnums=0)(c, jax.random.key(t.seed))
        pbox = {"params": params, "opt": jax.jit(tx.init)(params)}
        t0 = time.perf_counter()
        with matmul_precision(dtype):  # fp32 means fp32 in both (no TF32 on GPU)
            plain_step = module.make_train_step(c, tx, dtype).lower(pbox["params"], pbox["opt"], plain_tokens).compile()
        plain_compile = time.perf_counter() - t0

        def plain_window(n):
            p, o = pbox["params"], pbox["opt"]
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                p, o, loss = plain_step(p, o, plain_tokens)
            jax.block_until_ready((p, o, loss))
            pbox["params"], pbox["opt"] = p, o
            return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n

    # ---- one pipeline stage, one microbatch, on its own (mesh.pp > 1)
    stage_window = None
    if shape["pp"] > 1:
        scfg = stage_config(cfg, shape)
        n_stage = shape["sp"] * shape["tp"]
        sshape, _ = validate(scfg, n_stage)
        sfns = make_step_fns(scfg, make_mesh(sshape, scfg, devices=jax.local_devices()[:n_stage]))
        stage_tokens = global_arrays(from_windows(tokens_np[:scfg.train.global_batch]), sfns.batch_sharding)
        stage_params = sfns.init(t.seed).params
        t0 = time.perf_counter()
        stage_fn = sfns.loss_and_grads.lower(stage_params, stage_tokens).compile()
        stage_compile = time.perf_counter() - t0

        def stage_window(n):
            start = time.perf_counter()
            for _ in range(n):
                loss_grads = stage_fn(stage_params, stage_tokens)
            jax.block_until_ready(loss_grads)
            return (time.perf_counter() - start) / n

    if warmup:
        ours_window(warmup)
        if plain_window:
            plain_window(warmup)
        if stage_window:
            stage_window(warmup)
    ours_times, plain_times, stage_times, peaks = [], [], [], []
    for i in range(windows):  # interleaved, in ABBA order, so background load and drift hit both alike
        if plain_window and i % 2:
            plain_times.append(plain_window(steps))
        ours_times.append(ours_window(steps))
        if stage_window:  # about as long as the step window: microbatches stage calls per step
            stage_times.append(stage_window(steps * t.microbatches))
        if plain_window and not i % 2:
            plain_times.append(plain_window(steps))
        # On CPU the peak is a matmul measured now: once per round, keeping the best, so that a moment
        # of load from other processes does not halve the denominator (and double the MFU).
        peaks.append(peak_flops(cfg))
    peak = max(peaks)

    def summary(windows, compile_s):
        times, cpu = [w[0] for w in windows], [w[1] for w in windows]
        dt = statistics.median(times)
        tps = tokens_per_step / dt
        return {"tokens_per_s": tps, "step_time_s": dt, "mfu": tps * fpt / peak, "compile_s": compile_s,
                "step_cpu_s": statistics.median(cpu), "window_step_times_s": times, "window_step_cpu_s": cpu}

    out = {
        "config": {"family": m.family, "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                   "d_ff": m.d_ff, "vocab_size": m.vocab_size, "padded_vocab": padded_vocab(m),
                   "seq_len": m.seq_len, "global_batch": t.global_batch, "compute": cfg.precision.compute,
                   "remat": m.remat, "microbatches": t.microbatches, "zero_stage": t.zero_stage,
                   "params": transformer.count_params(m)},
        "devices": n_dev, "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
        "mesh": {a: n for a, n in shape.items() if n > 1},
        "attention": (choose(cfg, jax.default_backend(), shape["sp"])[0] if m.attention_impl == "auto"
                      else m.attention_impl),
        "steps": steps, "warmup": warmup, "windows": windows,
        "tokens_per_step": tokens_per_step, "flops_per_token": fpt, "peak_flops": peak, "peak_flops_measured": peaks,
        "jaxllm": summary(ours_times, ours_compile),
        "plain": None, "overhead": None, "baseline": why_not or "ok",
    }
    if plain_window:
        out["plain"] = summary(plain_times, plain_compile)
        out["overhead"] = 1.0 - out["jaxllm"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
        # Per-round ratios: each pair ran back to back, so this is the least noisy comparison.
        out["overhead_paired"] = statistics.median(1.0 - p[0] / o[0] for o, p in zip(ours_times, plain_times))
    if stage_window:
        t_stage = statistics.median(stage_times)
        out["pipeline_bubble_measured"] = 1.0 - t.microbatches * t_stage / out["jaxllm"]["step_time_s"]
        out["pipeline_bubble_table"] = bubble_fraction(pipeline_schedule(cfg.model, t, shape["pp"]),
                                                       transformer.layer_costs(cfg.model))
        out["pipeline"] = {"schedule": t.pp_schedule, "stages": shape["pp"], "virtual": t.pp_virtual,
                           "microbatches": t.microbatches, "stage_layers": scfg.model.n_layers,
                           "stage_rows": scfg.train.global_batch, "stage_devices": n_stage,
                           "t_stage_microbatch_s": t_stage, "window_stage_times_s": stage_times,
                           "stage_compile_s": stage_compile}
    return out


def stage_config(cfg, shape: dict):
    """One pipeline stage's work for one microbatch as a config of its own: n_layers/pp layers, mesh pp=1 with
    dp=fsdp=ep=1 (sp, tp kept), and one microbatch's rows per batch shard as the whole batch."""
    from jaxllm.schema import MeshConfig
    from jaxllm.mesh import batch_shards

    s = copy.deepcopy(cfg)
    s.model.n_layers = cfg.model.n_layers // shape["pp"]
    s.train.global_batch = cfg.train.global_batch // (cfg.train.microbatches * batch_shards(shape))
    s.train.microbatches, s.train.pp_virtual, s.train.pp_gather_once = 1, 1, False
    s.mesh = MeshConfig(pp=1, dp=1, fsdp=1, ep=1, sp=shape["sp"], tp=shape["tp"])
    return s


def format_table(r: dict) -> str:
    c = r["config"]
    mesh = " ".join(f"{a}={n}" for a, n in r["mesh"].items()) or "1 device"
    lines = [
        f"{c['family']} {c['params'] / 1e6:.1f}M: {c['n_layers']}L d{c['d_model']} h{c['n_heads']} ff{c['d_ff']} "
        f"vocab {c['vocab_size']} (padded {c['padded_vocab']}), batch {c['global_batch']} x seq {c['seq_len']}, "
        f"{c['compute']}, attention {r['attention']}",
        f"{r['devices']} {r['platform']} device(s) [{r['device_kind']}], mesh {mesh}, jax {r['jax']}; "
        f"{r['warmup']} warm-up, then {r['windows']} windows x {r['steps']} steps (medians)",
        f"MFU peak: {r['peak_flops'] / 1e9:,.1f} GFLOP/s; {r['flops_per_token'] / 1e6:,.2f} MFLOP/token",
        "",
        f"{'':8} {'tokens/s':>12} {'step ms':>10} {'MFU':>7} {'compile s':>10} {'CPU ms/step':>12}",
    ]
    for name in ("jaxllm", "plain"):
        s = r[name]
        if s is None:
            lines.append(f"{name:8} {'n/a':>12} {'n/a':>10} {'n/a':>7} {'n/a':>10} {'n/a':>12}   ({r['baseline']})")
        else:
            lines.append(f"{name:8} {s['tokens_per_s']:>12,.0f} {s['step_time_s'] * 1e3:>10.1f} "
                         f"{s['mfu'] * 100:>6.1f}% {s['compile_s']:>10.1f} {s['step_cpu_s'] * 1e3:>12.1f}")
    if r["overhead"] is None:
        lines.append(f"overhead: n/a ({r['baseline']})")
    else:
        lines.append(f"overhead: {r['overhead'] * 100:+.1f}% (1 - jaxllm/plain tokens/s; "
                     f"median of per-window pairs {r['overhead_paired'] * 100:+.1f}%)")
    if "pipeline" in r:
        p = r["pipeline"]
        v = f", v={p['virtual']}" if p["virtual"] > 1 else ""
        lines.append(f"pipeline {p['schedule']} p={p['stages']} m={p['microbatches']}{v}: bubble "
                     f"{r['pipeline_bubble_table'] * 100:.1f}% from the table, "
                     f"{r['pipeline_bubble_measured'] * 100:.1f}% measured (1 - m x "
                     f"{p['t_stage_microbatch_s'] * 1e3:.2f} ms per stage microbatch / step time; "
                     "only meaningful with a device per stage)")
    return "\n".join(lines)


def step_parser(prog: str, description: str, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The arguments the step's benchmarks share: a config and its overrides, the steps, the warm-up, --json."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, metavar="NAME|FILE",
                        help="a shipped config's name (jaxllm/configs/) or a TOML file (default: default)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.preset=llama-1b")
    parser.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default {steps})")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default 2)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = step_parser("python -m tools.bench.train_step", __doc__.splitlines()[0], 10, "timed steps per window")
    parser.add_argument("--windows", type=int, default=3, help="timing windows; medians are reported (default 3)")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the same model in plain JAX (tools/reference/plain_gpt.py, "
                             "tools/reference/plain_llama.py) and report the overhead")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)

    from jaxllm.config import build_config, config_path
    from jaxllm.errors import UserError

    try:
        cfg = build_config(config_path(args.config), args.overrides)
        result = bench(cfg, steps=args.steps, warmup=args.warmup, windows=args.windows, baseline=args.baseline)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    if jax.process_index() == 0:
        print(format_table(result), flush=True)
        if args.json:
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
