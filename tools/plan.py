"""`python -m tools.plan [--config FILE] [key=value ...] [--json]`: what one train step costs per device.

Compiles the train step for a config on this machine's devices, without running it
and without loading any data, and reports per device:

- memory of the compiled program (`memory_analysis()`: arguments, outputs, aliased
  (donated) bytes, temporaries, and total = arguments + outputs - aliased + temporaries);
- collectives per step by kind, read from the optimized HLO, loops counted per trip;
- beside them, the ZeRO theory with Φ = parameter count and N = `fsdp` size, for this
  project's layout (fp32 params, grads and Adam moments) and for the seeds' bf16 layout.

The theory assumes Adam (two fp32 moments per parameter) and does not divide the
tensor-parallel parts by `tp`: with tp > 1 the compiled numbers come out below it.

Config handling is the same as `experiments.run`: experiments/configs/default.toml unless
`--config` is given, then the `key=value` overrides; `model.vocab_size=0` takes the
tokenizer's size. A config mistake is one line `error: ...` on stderr and exit code 2.
Logs and the human-readable table go to stderr and stdout; with `--json`, the last line
of stdout is one JSON object (the dict `plan(cfg)` returns).
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time

from jaxllm import cli

THEORY_ASSUMES = ("Adam (2 fp32 moments per parameter); tp-sharded parts counted as replicated over tp "
                  "(Φ is not divided by tp); step counters and the batch are left out")

# Bytes per parameter per device as (replicated part a, sharded part b): a·Φ + b·Φ/N.
# fp32: this project's train state (fp32 params = master copy, fp32 grads, fp32 Adam mu and nu).
_FP32_TOTAL = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}
# What the compiled step takes as arguments: the state (params + moments); grads are temporaries.
_FP32_ARGS = {0: (12, 0), 1: (4, 8), 2: (4, 8), 3: (0, 12)}
# The seeds' table: bf16 params and grads beside an fp32 master copy and fp32 Adam moments.
_BF16_TOTAL = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


def _formula(a: int, b: int) -> str:
    parts = ([f"{a}Φ"] if a else []) + ([f"{b}Φ/N"] if b else [])
    return " + ".join(parts) or "0"


def _bytes(ab: tuple[int, int], n_params: int, fsdp: int) -> int:
    a, b = ab
    return int(round(a * n_params + b * n_params / fsdp))


def theory(n_params: int, fsdp: int, stage: int) -> dict:
    """ZeRO theory per device for Φ = `n_params` parameters over N = `fsdp` devices.

    Returns {"assumes", "params", "fsdp", "stage",
             "fp32": {"total_bytes", "argument_bytes", "total_formula", "argument_formula",
                      "stages": {"0".."3": same four keys}},
             "bf16_seeds": {"total_bytes", "total_formula", "stages": {"0".."3": same two keys}}}
    where the top-level numbers of each layout are the row for `stage`.
    """
    if stage not in _FP32_TOTAL:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if fsdp < 1:
        raise ValueError(f"fsdp must be at least 1, got {fsdp}")
    fp32 = {str(s): {"total_bytes": _bytes(_FP32_TOTAL[s], n_params, fsdp),
                     "argument_bytes": _bytes(_FP32_ARGS[s], n_params, fsdp),
                     "total_formula": _formula(*_FP32_TOTAL[s]),
                     "argument_formula": _formula(*_FP32_ARGS[s])} for s in _FP32_TOTAL}
    bf16 = {str(s): {"total_bytes": _bytes(_BF16_TOTAL[s], n_params, fsdp),
                     "total_formula": _formula(*_BF16_TOTAL[s])} for s in _BF16_TOTAL}
    return {"assumes": THEORY_ASSUMES, "params": int(n_params), "fsdp": int(fsdp), "stage": int(stage),
            "fp32": {**fp32[str(stage)], "stages": fp32},
            "bf16_seeds": {**bf16[str(stage)], "stages": bf16}}


def resolve(cfg):
    """The config resolved as `train.loop.prepare` does, minus the corpus: (cfg copy, mesh shape, notes)."""
    from jaxllm.train.loop import resolve as resolve_config

    cfg = copy.deepcopy(cfg)
    _, shape, notes = resolve_config(cfg)
    return cfg, shape, notes


def plan(cfg) -> dict:
    """Compile the train step for `cfg` (not run it) and report memory, collectives and theory per device.

    Raises UserError for a config that cannot run. Does not modify `cfg`.
    """
    import jax
    import jax.numpy as jnp

    from jaxllm.mesh import make_mesh
    from jaxllm.models import transformer
    from jaxllm.train.step import make_step_fns
    from tools.collectives import collective_report, memory_summary

    log = logging.getLogger("jaxllm")
    cfg, shape, notes = resolve(cfg)
    for note in notes:
        log.info(note)
    m, t = cfg.model, cfg.train
    mesh = make_mesh(shape, cfg)
    fns = make_step_fns(cfg, mesh)
    batch = jax.ShapeDtypeStruct((t.global_batch, m.seq_len + 1), jnp.int32, sharding=fns.batch_sharding)
    start = time.perf_counter()
    compiled = fns.train_step.lower(fns.abstract_state, batch).compile()
    seconds = time.perf_counter() - start
    memory = memory_summary(compiled)
    report = collective_report(compiled.as_text())
    n_params = transformer.count_params(m)
    return {
        "config": {
            "mesh": dict(shape),
            "zero_stage": t.zero_stage,
            "microbatches": t.microbatches,
            "global_batch": t.global_batch,
            "preset": m.preset,
            "family": m.family,
            "n_layers": m.n_layers,
            "d_model": m.d_model,
            "n_heads": m.n_heads,
            "n_kv_heads": m.n_kv_heads,
            "d_ff": m.d_ff,
            "vocab_size": m.vocab_size,
            "seq_len": m.seq_len,
            "remat": m.remat,
            "optimizer": t.optimizer,
            "compute": cfg.precision.compute,
        },
        "params": n_params,
        "memory": {k: memory[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                           "total_bytes")},
        "collectives": report["collectives"],
        "unknown_trip_loops": report["unknown_trip_loops"],
        "theory": theory(n_params, shape["fsdp"], t.zero_stage),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "compile_seconds": round(seconds, 3),
    }


def format_table(p: dict) -> str:
    """The plan as a readable table: compiled memory beside the theory, collectives, all stages."""
    from tools.collectives import KINDS, format_bytes

    c, mem, th = p["config"], p["memory"], p["theory"]
    stage, n = c["zero_stage"], th["fsdp"]
    mesh = " ".join(f"{a}={s}" for a, s in c["mesh"].items() if s > 1) or "1 device"
    preset = f"preset {c['preset']}, " if c["preset"] else ""
    lines = [
        f"plan: {preset}{c['family']} {c['n_layers']} layers, d_model={c['d_model']}, vocab={c['vocab_size']}; "
        f"Φ = {p['params']:,} parameters ({p['params'] / 1e6:.2f}M)",
        f"      mesh {mesh} over {p['devices']} {p['platform']} device(s)",
        f"      zero_stage={stage}, microbatches={c['microbatches']}, global_batch={c['global_batch']}, "
        f"seq_len={c['seq_len']}, compute={c['compute']}, optimizer={c['optimizer']}, remat={c['remat']}",
        "",
        f"memory per device          {'compiled':>12}   {'theory fp32':>12}   {'theory bf16 seeds':>17}",
    ]
    fp, bf = th["fp32"], th["bf16_seeds"]
    rows = [
        ("arguments", mem["argument_bytes"], f"{format_bytes(fp['argument_bytes'])}", ""),
        ("outputs", mem["output_bytes"], "", ""),
        ("aliased (donated)", mem["alias_bytes"], "", ""),
        ("temporaries", mem["temp_bytes"], "", ""),
        ("total", mem["total_bytes"], format_bytes(fp["total_bytes"]), format_bytes(bf["total_bytes"])),
    ]
    for name, val, a, b in rows:
        lines.append(f"  {name:<24}{format_bytes(val):>12}   {a:>12}   {b:>17}")
    lines.append(f"  (total = arguments + outputs - aliased + temporaries; theory for stage {stage}: "
                 f"arguments {fp['argument_formula']}, total {fp['total_formula']}, seeds {bf['total_formula']})")
    if fp["argument_bytes"]:
        lines.append(f"  compiled arguments / theory arguments = {mem['argument_bytes'] / fp['argument_bytes']:.3f}")
    lines += ["", f"collectives per step per device (loops counted per trip)", f"  {'kind':<20}{'count':>8}{'bytes':>14}"]
    for k in KINDS:
        v = p["collectives"][k]
        lines.append(f"  {k:<20}{v['count']:>8}{format_bytes(v['bytes']):>14}")
    if p.get("unknown_trip_loops"):
        lines.append(f"  ({p['unknown_trip_loops']} loop(s) without a known trip count were counted once)")
    lines += ["", f"ZeRO theory per device, Φ = {p['params']:,}, N = fsdp = {n}",
              f"  {'stage':<7}{'fp32 total':>22}{'fp32 arguments':>26}{'bf16 seeds total':>26}"]
    for s in ("0", "1", "2", "3"):
        f32, b16 = fp["stages"][s], bf["stages"][s]
        mark = "*" if int(s) == stage else " "
        lines.append(f"  {mark}{s:<6}{f32['total_formula']:>11} {format_bytes(f32['total_bytes']):>10}"
                     f"{f32['argument_formula']:>15} {format_bytes(f32['argument_bytes']):>10}"
                     f"{b16['total_formula']:>15} {format_bytes(b16['total_bytes']):>10}")
    lines.append(f"  (* this config; assumes {th['assumes']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli.config_parser("python -m tools.plan", __doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object on the last stdout line")
    args = parser.parse_args(argv)

    def go():
        from jaxllm.mesh import initialize_distributed

        cfg = cli.load_config(args)
        initialize_distributed(cfg.distributed)
        result = plan(cfg)
        logging.getLogger("jaxllm").info("compiled in %.1f s", result["compile_seconds"])
        if args.json:
            print(format_table(result), file=sys.stderr)
            print(json.dumps(result, separators=(",", ":"), ensure_ascii=True))
        else:
            print(format_table(result))

    return cli.run(go)


if __name__ == "__main__":
    sys.exit(main())
