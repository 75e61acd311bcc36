"""Draw a pipeline schedule and print what it costs: `python -m tools.studies.pipeline [--schedule 1f1b] ...`.

Builds the table `jaxllm/parallel/pipeline_schedules.py` builds for training (the same
`make_schedule`), then:

- writes a PNG timeline: one row per stage (stage 0 on top), time along x. Each tick is
  as wide as its `tick_times` (the busiest stage's work); inside a tick a stage runs its
  forward box (width F/v), then its backward box (width (R+B+W)/v, fused), or in the
  zero-bubble schedules at most one of F, R (the re-run, width R/v) and B (the input
  gradient), then pieces of W (the weight gradients, W/v for a whole chunk). Forwards are
  blue, R purple, backwards orange, W green, darker for later chunks (interleaved, ZB-V),
  with the microbatch number in each box; idle time is left blank. Costs are per
  microbatch and stage, 1 each unless given (`--forward` ..., or `--costs-from PRESET`:
  one layer's, compiled), and the zero-bubble tables are built for them, with W in one
  piece per layer of `--layers` (the preset's by default: as the trainer builds them);
- prints the bubble fraction measured on the table next to the closed form at unit costs
  ((p−1)/(m+p−1), (p−1)/(v·m+p−1) with v chunks, (p−1)/(4m+p−1) for ZB-H1,
  (p−1)/(8m+p−1) for ZB-V), the most idle time inside one stage's span (the
  zero-bubble paper's bubble), and the buffer depths (the most stage inputs any stage
  holds at once, at most 2p−1 for 1F1B and m for GPipe; W stashes for zero-bubble);
  with `--compare`, every schedule's time and bubble at the same p, m and costs.

With --json the last stdout line is a JSON object of those numbers. A combination the
trainer would refuse (e.g. interleaved with microbatches not a multiple of stages)
prints `error: ...` to stderr and exits 2 without writing anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import NamedTuple

import numpy as np

from jaxllm.config import PRESETS
from jaxllm.parallel.pipeline_schedules import (SCHEDULES, UNIT, Costs, Schedule, bubble_formula, bubble_fraction,
                                                check, idle_in_span, make_schedule, model_chunks, tick_times)

FORMULAS = {"zb_h1": "(p-1)/(4m+p-1)", "zb_v": "(p-1)/(8m+p-1)"}


class Box(NamedTuple):
    stage: int
    x0: float
    width: float
    kind: str  # "F", "R", "B" or "W"
    microbatch: int
    chunk: int


def boxes(s: Schedule, costs: Costs = UNIT) -> list[Box]:
    """Every operation of the schedule as a box on the timeline (x0 and width in cost units)."""
    starts = np.concatenate([[0.0], np.cumsum(tick_times(s, costs))[:-1]])
    fused = costs.recompute + costs.backward + costs.weight
    widths = {"F": costs.forward, "R": costs.recompute, "B": costs.backward if s.split else fused,
              "W": costs.weight / s.pieces}  # a W slot runs w_count pieces
    fields = {"F": ("fwd_mb", "fwd_chunk"), "R": ("r_mb", "r_chunk"), "B": ("bwd_mb", "bwd_chunk"),
              "W": ("w_mb", "w_chunk"), "W2": ("w2_mb", "w2_chunk")}
    out = []
    for t in range(s.ticks):
        for stage in range(s.stages):
            x = float(starts[t])
            for kind, (mb, chunk) in fields.items():
                i = s.field(mb)[t, stage]
                if i >= 0:
                    w = kind.lower() + "_count"
                    width = widths[kind[0]] / s.chunks * (s.field(w)[t, stage] if kind[0] == "W" else 1)
                    out.append(Box(stage, x, width, kind[0], int(i), int(s.field(chunk)[t, stage])))
                    x += width
    return out


def compiled_costs(preset: str = "tiny-llama", rows: int = 8, **overrides) -> dict:
    """What a microbatch's operations cost on a stage, read off compiled programs (XLA's cost analysis, in
    flops) of one layer of `preset` (`rows` rows of seq_len tokens, fp32, one device; shapes only, so a real
    model's layer costs nothing to measure; one layer, since the cost analysis counts a loop's body once and a
    stage's costs are its layers' sum): the forward F; the split backward's R (the layer re-run from its
    input, keeping its VJP's residuals; as a middle stage's, which keeps no output, so its last matmul is not
    run), B (the input gradient from those) and W (the weight gradients from B's stash); and the fused
    backward (all three in one, as 1F1B's). Returns {"costs": `Costs` in units of F, "fused": the fused
    backward in units of F, "weight_dots": how many matmuls of each program make a tapped weight's
    gradient: dot_generals of its jaxpr (nested ones included) whose result has the shape of a tapped
    weight (one layer's, or all layers' batched)}."""
    import jax

    programs, shapes = _layer_programs(preset, rows, overrides)
    flops, dots = {}, {}
    for name, (fn, args) in programs.items():
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        flops[name] = float((cost[0] if isinstance(cost, list) else cost)["flops"])
        dots[name] = sum(tuple(eqn.outvars[0].aval.shape) in shapes
                         for eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr) if eqn.primitive.name == "dot_general")
    unit = lambda name: flops[name] / flops["forward"]
    return {"costs": Costs(1.0, unit("recompute"), unit("backward"), unit("weight")), "fused": unit("fused"),
            "weight_dots": dots}


def _layer_programs(preset: str, rows: int, overrides: dict):
    """({name: (function, abstract arguments)} of one layer's F, R, B, W and fused backward, the shapes of its
    tapped weights)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.config import build_config
    from jaxllm.models import taps, transformer

    m = build_config(None, {"model.preset": preset, "precision.compute": "float32", **overrides}).model
    params = jax.eval_shape(lambda: transformer.init_params(m, jax.random.PRNGKey(0)))
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1,) + a.shape[1:], a.dtype), params["blocks"])
    x = jax.ShapeDtypeStruct((rows, m.seq_len, m.d_model), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(m.seq_len), x.shape[:2])
    run = lambda ch, x: transformer.blocks(ch, x, positions, jnp.ones(x.shape[:2], jnp.int32), m, jnp.float32)[0]
    t = taps.Taps(transformer.param_names(m)["blocks"])

    def pullback(ch, x):  # as the executor's R: the tapped weights closed over, their probes differentiated
        tapped, rest = t.split(ch)
        probes = t.probes(tapped, x.shape[:2], x.dtype)
        return jax.vjp(lambda pr, re, x: run(t.join(tapped, pr, re), x), probes, rest, x)[1]

    pull = jax.eval_shape(pullback, layer, x)
    stash = jax.eval_shape(lambda ch: t.probes(t.split(ch)[0], x.shape[:2], x.dtype), layer)  # an argument:
    programs = {  # constant stashes would let XLA merge equal matmuls
        "forward": (run, (layer, x)),
        "recompute": (lambda ch, x: jax.tree.leaves(pullback(ch, x)), (layer, x)),
        "backward": (lambda res, dy: jax.tree.unflatten(jax.tree.structure(pull), res)(dy),
                     (jax.tree.leaves(pull), x)),
        "weight": (lambda ch, st: t.weight_grads(t.split(ch)[0], st), (layer, stash)),
        "fused": (lambda ch, x, dy: jax.vjp(run, ch, x)[1](dy), (layer, x, x))}
    return programs, {s for a in jax.tree.leaves(t.split(layer)[0]) for s in (a.shape, a.shape[1:])}


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (scans, conds, remat, custom derivatives)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def pieces(layers: int | None, p: int, v: int) -> int:
    """W's pieces per chunk: one per layer where `layers` splits into p·v equal chunks, else one (W whole)."""
    return layers // (p * v) if layers and layers % (p * v) == 0 else 1


def compare(p: int, m: int, costs: Costs, layers: int | None = None) -> dict:
    """{schedule: {ticks, time, bubble}} of every schedule that can run at p stages, m microbatches
    (interleaved with v = 2), built for and measured at `costs`, with W in one piece per layer of `layers`."""
    out = {}
    for name in SCHEDULES:
        virtual = 2 if name == "interleaved" else 1
        try:
            s = make_schedule(name, p, m, virtual, costs, pieces(layers, p, model_chunks(name, virtual)))
        except ValueError:
            continue
        out[name] = {"ticks": s.ticks, "time": float(tick_times(s, costs).sum()), "bubble": bubble_fraction(s, costs)}
    return out


def depth_bound(s: Schedule) -> tuple[str, int] | None:
    """The known bound on the activation buffer depth: 2p−1 for 1F1B, m for GPipe (None: no simple one)."""
    if s.name == "1f1b":
        return "2p-1", 2 * s.stages - 1
    if s.name == "gpipe":
        return "m", s.microbatches
    return None


def summary(s: Schedule, costs: Costs) -> dict:
    """The numbers the CLI prints (and writes as JSON)."""
    bound = depth_bound(s)
    return {
        "schedule": s.name, "stages": s.stages, "microbatches": s.microbatches, "virtual": s.chunks,
        **dataclasses.asdict(costs), "ticks": s.ticks,
        "time": float(tick_times(s, costs).sum()),
        "bubble_table": bubble_fraction(s, costs),
        "bubble_formula": bubble_formula(s),
        "formula": FORMULAS.get(s.name, "(p-1)/(v*m+p-1)" if s.chunks > 1 else "(p-1)/(m+p-1)"),
        "idle_in_span": float(idle_in_span(s, costs).max()),
        "act_depth": s.act_depth,
        "stash_depth": s.stash_depth,
        "act_depth_bound": bound[1] if bound else None,
        "act_depth_bound_formula": bound[0] if bound else None,
    }


def describe(r: dict) -> str:
    """The summary as plain text."""
    v = f", v={r['virtual']}" if r["virtual"] > 1 else ""
    bound = (f" (bound {r['act_depth_bound_formula']} = {r['act_depth_bound']})" if r["act_depth_bound"] is not None
             else "")
    return "\n".join([
        f"schedule {r['schedule']}: p={r['stages']} stages, m={r['microbatches']} microbatches{v}; "
        f"costs per microbatch and stage: forward {r['forward']:.3g}, recompute {r['recompute']:.3g}, "
        f"input gradient {r['backward']:.3g}, weight gradients {r['weight']:.3g}",
        f"ticks: {r['ticks']} (time {r['time']:g})",
        f"bubble: {r['bubble_table']:.4f} from the table, {r['bubble_formula']:.4f} from {r['formula']} "
        f"(at unit costs); a stage idles at most {r['idle_in_span']:g} between its first and last operation",
        f"activation buffer depth: {r['act_depth']} inputs alive per stage at most{bound}"
        + (f"; W stash depth {r['stash_depth']}" if r["stash_depth"] else ""),
    ])


def draw(s: Schedule, costs: Costs, path: str) -> None:
    """Write the timeline of `s` as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmaps = {"F": plt.get_cmap("Blues"), "R": plt.get_cmap("Purples"), "B": plt.get_cmap("Oranges"),
             "W": plt.get_cmap("Greens")}
    labels = {"F": "forward", "R": "recompute (R)", "B": "input gradient (B)" if s.split else "backward",
              "W": "weight gradients (W)"}
    shade = lambda c: 0.45 + 0.4 * c / max(s.chunks - 1, 1)  # chunk 0 light, the last chunk dark
    total = float(tick_times(s, costs).sum())
    all_boxes = boxes(s, costs)
    fig, ax = plt.subplots(figsize=(min(max(6.0, 0.35 * len(all_boxes) / s.stages), 40.0), 0.6 * s.stages + 1.5))
    for x in np.cumsum(tick_times(s, costs))[:-1]:
        ax.axvline(x, color="0.9", lw=0.5, zorder=0)
    fontsize = 7 if len(all_boxes) / s.stages <= 40 else 5
    for bx in all_boxes:
        ax.barh(bx.stage, bx.width, left=bx.x0, height=0.8, color=cmaps[bx.kind](shade(bx.chunk)),
                edgecolor="black", linewidth=0.4)
        ax.text(bx.x0 + bx.width / 2, bx.stage, str(bx.microbatch), ha="center", va="center", fontsize=fontsize,
                color="white" if shade(bx.chunk) > 0.7 else "black")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmaps[k](shade(c)),
                             label=labels[k] + (f" chunk {c}" if s.chunks > 1 else ""))
               for k in ("FRBW" if s.split else "FB") for c in range(s.chunks)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks(range(s.stages), [f"stage {i}" for i in range(s.stages)])
    ax.set_ylim(s.stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, total)
    ax.set_xlabel(f"time (per microbatch per stage: forward {costs.forward:g}, recompute {costs.recompute:g}, "
                  f"input gradient {costs.backward:g}, weight gradients {costs.weight:g})")
    v = f", v={s.chunks}" if s.chunks > 1 else ""
    ax.set_title(f"{s.name}: p={s.stages}, m={s.microbatches}{v}; bubble {bubble_fraction(s, costs):.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_path(name: str, p: int, m: int, v: int) -> str:
    return f"pipeline-{name}-p{p}-m{m}" + (f"-v{v}" if name == "interleaved" else "") + ".png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.studies.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages p (mesh.pp; default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches m (default 8)")
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per stage v (interleaved; default 1)")
    parser.add_argument("--forward", type=float, default=1.0, help="relative cost of a forward, F (default 1)")
    parser.add_argument("--recompute", type=float, default=1.0,
                        help="relative cost of re-running a stage from its input, R (default 1)")
    parser.add_argument("--backward", type=float, default=1.0,
                        help="relative cost of a backward's input gradient, B (default 1)")
    parser.add_argument("--weight", type=float, default=1.0, help="relative cost of a backward's weight "
                        "gradients, W (default 1; a fused backward costs R+B+W)")
    parser.add_argument("--costs-from", metavar="PRESET", default=None,
                        help="take the costs from one stage of this model preset, compiled (XLA's flop counts)")
    parser.add_argument("--layers", type=int, default=None,
                        help="the model's pipelined layers: the zero-bubble tables run W in pieces of one layer "
                        "(default: the preset's with --costs-from, else W whole)")
    parser.add_argument("--compare", action="store_true",
                        help="also print every schedule's bubble and time at these p, m and costs (interleaved: v=2)")
    parser.add_argument("--out", default=None, help="PNG path (default: pipeline-<schedule>-p<P>-m<M>[-v<V>].png)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON on the last line")
    args = parser.parse_args(argv)
    try:
        for name, value in (("--stages", args.stages), ("--microbatches", args.microbatches)):
            if value < 1:
                raise ValueError(f"{name}: must be at least 1, got {value}")
        costs = Costs(args.forward, args.recompute, args.backward, args.weight)
        if min(dataclasses.astuple(costs)) <= 0:
            raise ValueError(f"--forward, --recompute, --backward and --weight must be positive, got {costs}")
        check(args.schedule, args.stages, args.microbatches, args.virtual)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = args.out or default_path(args.schedule, args.stages, args.microbatches, args.virtual)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    layers = args.layers
    if args.costs_from:
        costs = compiled_costs(args.costs_from)["costs"]
        layers = layers or PRESETS[args.costs_from]["n_layers"]
    v = model_chunks(args.schedule, args.virtual)
    s = make_schedule(args.schedule, args.stages, args.microbatches, args.virtual, costs,
                      pieces(layers, args.stages, v))
    draw(s, costs, path)
    result = dict(summary(s, costs), png=path)
    print(describe(result))
    print(f"png: {path}")
    if args.compare:
        result["compare"] = compare(args.stages, args.microbatches, costs, layers)
        print("\n".join(f"  {name:12s} {r['ticks']:4d} ticks  time {r['time']:7.2f}  bubble {r['bubble']:.4f}"
                        for name, r in result["compare"].items()))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
