"""Where a run's wall time goes: the seconds since the last log row spent in each part of the run, and goodput.

Each training row of metrics.jsonl carries `time/wall_s` (the seconds since the previous row, or since the run
started) and `time/CATEGORY_s` for every category below: what the controlling process was doing. Their sum
is the wall time but for the loop's own bookkeeping between the parts (tests/test_observability.py holds it
under 2%); there is no catch-all column. The end of a run prints goodput, the time in steps over the wall time,
and the category that lost the most.

- data: making the next batch while no step was running (a batch made while the previous step still ran on
  the devices is hidden by it and counts as step time); reading the data at start-up; GRPO's sampling and
  DPO's reference scoring, which need the previous step's parameters.
- reshard: laying the weights out for the rollout engine (`rl.sampler = "engine"`), once per rollout, where the
  trainer waits for it (with `rl.async_steps` the sampler thread does it, hidden behind the steps).
- step: dispatching steps and waiting for them.
- compile: tracing, lowering and compiling programs, wherever it happens (JAX reports each through
  `jax.monitoring`; the part it happened in gives that time up).
- eval: the validation loss and the benchmark tasks. checkpoint: saving, restoring and waiting for async saves.
- log: building and writing metric rows (metrics.jsonl, TensorBoard, W&B, the console).
- profile: starting and writing a profiler trace (`run.profile_steps`).
- setup: the mesh, the sharded programs' wrappers, the starting parameters and the run directory.

The time is one process's (every process counts its own; process 0's is logged). A restarted run counts from
its own start: the time between a kill and the restart is not seen by either.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import types

import jax

CATEGORIES = ("data", "reshard", "step", "compile", "eval", "checkpoint", "log", "profile", "setup")
LOST = tuple(c for c in CATEGORIES if c != "step")

# JAX's own durations of compiling (one each per program, not nested: tracing is reported at the top level only)
_COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"})
_compiled = collections.defaultdict(float)  # seconds compiling, by thread: another thread's compiles are its own


def _on_duration(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compiled[threading.get_ident()] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)  # once per process, at import


def compiling_seconds() -> float:
    """Seconds this thread has spent tracing, lowering and compiling since the process started."""
    return _compiled[threading.get_ident()]


class Clock:
    """Seconds per category since the last row (`lap`) and since the clock started (`summary`). Timed blocks may
    nest: a block inside another takes its time out of the outer one's. One thread uses a clock."""

    def __init__(self):
        self.started = self.mark = time.perf_counter()
        self.window = dict.fromkeys(CATEGORIES, 0.0)
        self.total = dict.fromkeys(CATEGORIES, 0.0)
        self._inner = []  # per open block: [seconds, compiling] of the blocks inside it

    def _add(self, category: str, seconds: float) -> None:
        self.window[category] += seconds
        self.total[category] += seconds

    @contextlib.contextmanager
    def timing(self, category: str):
        """Count the block's time to `category` (which the block may change: `part.category = ...` on what it
        yields), but for the compiling inside it and the blocks inside it."""
        part = types.SimpleNamespace(category=category)
        start, compiled = time.perf_counter(), compiling_seconds()
        self._inner.append([0.0, 0.0])
        try:
            yield part
        finally:
            seconds, compiling = time.perf_counter() - start, compiling_seconds() - compiled
            inner_seconds, inner_compiling = self._inner.pop()
            if self._inner:
                self._inner[-1][0] += seconds
                self._inner[-1][1] += compiling
            own, own_compiling = seconds - inner_seconds, compiling - inner_compiling
            if part.category == "compile":
                self._add("compile", own)
            else:
                self._add(part.category, own - own_compiling)
                self._add("compile", own_compiling)

    def lap(self) -> dict:
        """The row's columns: `time/wall_s` and `time/CATEGORY_s` since the last lap; starts the next window."""
        now = time.perf_counter()
        row = {"time/wall_s": now - self.mark, **{f"time/{c}_s": s for c, s in self.window.items()}}
        self.mark, self.window = now, dict.fromkeys(CATEGORIES, 0.0)
        return row

    def summary(self) -> dict:
        """The whole run so far: goodput (step time over wall time), the wall time and each category's."""
        wall = time.perf_counter() - self.started
        return {"goodput": self.total["step"] / wall, "wall_s": wall, **{f"{c}_s": s for c, s in self.total.items()}}


def summary_text(summary: dict) -> str:
    """One line for the end of a run: goodput and where the most time was lost."""
    worst = max(LOST, key=lambda c: summary[f"{c}_s"])
    return (f"goodput {summary['goodput'] * 100:.1f}%: {summary['step_s']:.1f} s in steps of {summary['wall_s']:.1f} s; "
            f"the most time lost: {worst} {summary[f'{worst}_s']:.1f} s ("
            + ", ".join(f"{c} {summary[f'{c}_s']:.1f} s" for c in LOST if c != worst) + ")")
