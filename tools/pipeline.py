"""Draw a pipeline schedule and print what it costs: `python -m tools.pipeline [--schedule 1f1b] ...`.

Builds the table `jaxllm/parallel/pipeline_schedules.py` builds for training (the same
`make_schedule`), then:

- writes a PNG timeline: one row per stage (stage 0 on top), time along x. Each tick is
  as wide as its `tick_times` (the busiest stage's forward plus backward); inside a tick
  a stage runs its forward box (width F/v) then its backward box (width B/v). Forwards
  are blue, backwards orange, darker for later chunks (interleaved), with the
  microbatch number in each box; idle time is left blank;
- prints the bubble fraction measured on the table next to the closed form
  ((p−1)/(m+p−1), or (p−1)/(v·m+p−1) with v chunks), and the activation buffer depth
  (the most stage inputs any stage holds at once; at most 2p−1 for 1F1B, m for GPipe).

With --json the last stdout line is a JSON object of those numbers. A combination the
trainer would refuse (e.g. interleaved with microbatches not a multiple of stages)
prints `error: ...` to stderr and exits 2 without writing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NamedTuple

import numpy as np

from jaxllm.parallel.pipeline_schedules import (SCHEDULES, Schedule, bubble_formula, bubble_fraction, make_schedule,
                                                tick_times)


class Box(NamedTuple):
    stage: int
    x0: float
    width: float
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int


def boxes(s: Schedule, forward: float = 1.0, backward: float = 2.0) -> list[Box]:
    """Every forward and backward of the schedule as a box on the timeline (x0 and width in cost units)."""
    starts = np.concatenate([[0.0], np.cumsum(tick_times(s, forward, backward))[:-1]])
    fwd_mb, fwd_chunk, bwd_mb, bwd_chunk = (s.field(f) for f in ("fwd_mb", "fwd_chunk", "bwd_mb", "bwd_chunk"))
    f, b = forward / s.chunks, backward / s.chunks
    out = []
    for t in range(s.ticks):
        for stage in range(s.stages):
            x = float(starts[t])
            if fwd_mb[t, stage] >= 0:
                out.append(Box(stage, x, f, "F", int(fwd_mb[t, stage]), int(fwd_chunk[t, stage])))
                x += f
            if bwd_mb[t, stage] >= 0:
                out.append(Box(stage, x, b, "B", int(bwd_mb[t, stage]), int(bwd_chunk[t, stage])))
    return out


def depth_bound(s: Schedule) -> tuple[str, int] | None:
    """The known bound on the activation buffer depth: 2p−1 for 1F1B, m for GPipe (None: no simple one)."""
    if s.name == "1f1b":
        return "2p-1", 2 * s.stages - 1
    if s.name == "gpipe":
        return "m", s.microbatches
    return None


def summary(s: Schedule, forward: float, backward: float) -> dict:
    """The numbers the CLI prints (and writes as JSON)."""
    bound = depth_bound(s)
    return {
        "schedule": s.name, "stages": s.stages, "microbatches": s.microbatches, "virtual": s.chunks,
        "forward": forward, "backward": backward, "ticks": s.ticks,
        "time": float(tick_times(s, forward, backward).sum()),
        "bubble_table": bubble_fraction(s, forward, backward),
        "bubble_formula": bubble_formula(s),
        "formula": "(p-1)/(v*m+p-1)" if s.chunks > 1 else "(p-1)/(m+p-1)",
        "act_depth": s.act_depth,
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
        f"forward {r['forward']:g}, backward {r['backward']:g}",
        f"ticks: {r['ticks']} (time {r['time']:g})",
        f"bubble: {r['bubble_table']:.4f} from the table, {r['bubble_formula']:.4f} from {r['formula']}",
        f"activation buffer depth: {r['act_depth']} inputs alive per stage at most{bound}",
    ])


def draw(s: Schedule, forward: float, backward: float, path: str) -> None:
    """Write the timeline of `s` as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmaps = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges")}
    shade = lambda c: 0.45 + 0.4 * c / max(s.chunks - 1, 1)  # chunk 0 light, the last chunk dark
    total = float(tick_times(s, forward, backward).sum())
    all_boxes = boxes(s, forward, backward)
    fig, ax = plt.subplots(figsize=(min(max(6.0, 0.35 * len(all_boxes) / s.stages), 40.0), 0.6 * s.stages + 1.5))
    for x in np.cumsum(tick_times(s, forward, backward))[:-1]:
        ax.axvline(x, color="0.9", lw=0.5, zorder=0)
    fontsize = 7 if len(all_boxes) / s.stages <= 40 else 5
    for bx in all_boxes:
        ax.barh(bx.stage, bx.width, left=bx.x0, height=0.8, color=cmaps[bx.kind](shade(bx.chunk)),
                edgecolor="black", linewidth=0.4)
        ax.text(bx.x0 + bx.width / 2, bx.stage, str(bx.microbatch), ha="center", va="center", fontsize=fontsize,
                color="white" if shade(bx.chunk) > 0.7 else "black")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmaps[k](shade(c)),
                             label=f"{'forward' if k == 'F' else 'backward'}" + (f" chunk {c}" if s.chunks > 1 else ""))
               for k in "FB" for c in range(s.chunks)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks(range(s.stages), [f"stage {i}" for i in range(s.stages)])
    ax.set_ylim(s.stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, total)
    ax.set_xlabel(f"time (forward = {forward:g}, backward = {backward:g} per microbatch per stage)")
    v = f", v={s.chunks}" if s.chunks > 1 else ""
    ax.set_title(f"{s.name}: p={s.stages}, m={s.microbatches}{v}; bubble {bubble_fraction(s, forward, backward):.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_path(name: str, p: int, m: int, v: int) -> str:
    return f"pipeline-{name}-p{p}-m{m}" + (f"-v{v}" if name == "interleaved" else "") + ".png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages p (mesh.pp; default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches m (default 8)")
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per stage v (interleaved; default 1)")
    parser.add_argument("--forward", type=float, default=1.0, help="relative cost of a forward (default 1)")
    parser.add_argument("--backward", type=float, default=2.0, help="relative cost of a backward (default 2)")
    parser.add_argument("--out", default=None, help="PNG path (default: pipeline-<schedule>-p<P>-m<M>[-v<V>].png)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON on the last line")
    args = parser.parse_args(argv)
    try:
        for name, value in (("--stages", args.stages), ("--microbatches", args.microbatches)):
            if value < 1:
                raise ValueError(f"{name}: must be at least 1, got {value}")
        if args.forward <= 0 or args.backward <= 0:
            raise ValueError(f"--forward and --backward must be positive, got {args.forward:g} and {args.backward:g}")
        s = make_schedule(args.schedule, args.stages, args.microbatches, args.virtual)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = args.out or default_path(args.schedule, args.stages, args.microbatches, args.virtual)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    draw(s, args.forward, args.backward, path)
    result = dict(summary(s, args.forward, args.backward), png=path)
    print(describe(result))
    print(f"png: {path}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
