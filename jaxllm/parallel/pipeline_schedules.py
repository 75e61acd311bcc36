"""Pipeline schedules as tables: which microbatch each stage runs forward and backward at each tick.

Plain Python and numpy, no JAX: a schedule is data that `parallel/pipeline.py` executes
and `tools/pipeline.py` draws.

The model's layers are split into p·v chunks ("global stages" g = 0 ... p·v−1); device
(stage) s holds chunks c = 0 ... v−1, i.e. global stages g = c·p + s (Megatron's
interleaving; v = 1 is the plain contiguous split). Time runs in lockstep ticks. In
each tick a stage has one forward slot and one backward slot (so a stage never waits
on its neighbour's slower kind of work), and at the end of the tick every stage sends
its forward output downstream (to stage s+1, round the ring for interleaving) and its
input gradient upstream, so anything produced at tick t is usable from tick t+1.

A generator writes each stage's work as an ordered list of operations (PipeDream's
one-forward-one-backward, Megatron's interleaving, ...); `lockstep` then runs every
stage down its list as early as the data allows (one forward and one backward per
tick, in list order) and records:

- `fwd_mb`, `fwd_chunk`: the microbatch and chunk run forward (−1: none);
- `bwd_mb`, `bwd_chunk`: the same for the backward;
- `fwd_slot`: the activation buffer slot holding that forward's input;
- `bwd_slot`, `bwd_grad_slot`: the slots holding the saved input and the output
  gradient of that backward;
- `recv_slot`, `grad_recv_slot`: where the activation and the gradient that arrive at
  the end of the tick go (−1: nothing arrives).

The first global stage reads tokens, not a buffer; the last one computes the loss,
so its backward needs no gradient and its forward has nothing to send (the executor
skips it: the backward recomputes the stage anyway). Slots are given out interval by
interval (arrival to backward), so a buffer's depth is the most inputs alive at once
on any stage: the executor's memory comes straight from the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm import stack
from jaxllm.errors import ConfigError

FIELDS = ("fwd_mb", "fwd_chunk", "fwd_slot", "bwd_mb", "bwd_chunk", "bwd_slot", "bwd_grad_slot",
          "recv_slot", "grad_recv_slot")

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    chunks: int  # v, model chunks per stage
    microbatches: int  # m
    table: np.ndarray  # int32 [ticks, stages, len(FIELDS)]
    act_depth: int  # activation buffer slots per stage
    grad_depth: int  # gradient buffer slots per stage

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    def field(self, name: str) -> np.ndarray:
        """One field of the table, [ticks, stages]."""
        return self.table[:, :, FIELDS.index(name)]


# ---------------------------------------------------------------- per-stage orders of work


def gpipe_order(p: int, m: int, s: int) -> list[tuple[str, int, int]]:
    """GPipe: every forward, then every backward."""
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def one_f_one_b_order(p: int, m: int, s: int) -> list[tuple[str, int, int]]:
    """PipeDream-Flush (1F1B) in lockstep: warm-up forwards, then one forward one backward, then
    the cool-down backwards.

    Run asynchronously, stage s warms up with p−s−1 forwards. In lockstep ticks a gradient
    takes one tick per stage to come back up, so the first backward reaches stage s
    2(p−s−1) ticks after its first forward; warming up with that many forwards keeps every
    steady tick full (this is Megatron's interleaved warm-up at v = 1). The bubble is then
    GPipe's, (p−1)/(m+p−1), and a stage holds at most 2(p−s)−1 ≤ 2p−1 inputs, whatever m is.
    """
    return interleaved_order(p, m, s, 1)


def interleaved_order(p: int, m: int, s: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: microbatches in groups of p go through chunk 0, then chunk 1, ...;
    backwards run the chunks in reverse. Warm-up: (p−s−1)·2 + (v−1)·p forwards."""
    total = m * v

    def forward(k):
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k):
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    ops = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [forward(warmup + k), backward(k)]
    return ops + [backward(k) for k in range(total - warmup, total)]


# ---------------------------------------------------------------- orders -> table


def _slots(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Give each (start, end, key) interval a slot no overlapping interval holds; (key -> slot, depth)."""
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (end, slot)
    out, depth = {}, 0
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for e, slot in [b for b in busy if b[0] < start]:
            busy.remove((e, slot))
            free.append(slot)
        if free:
            slot = min(free)
            free.remove(slot)
        else:
            slot, depth = depth, depth + 1
        busy.append((end, slot))
        out[key] = slot
    return out, depth


def lockstep(name: str, orders: list[list[tuple[str, int, int]]], m: int, v: int) -> Schedule:
    """Run each stage down its order as early as the data allows (one forward and one backward
    per tick) and lay the result out as a table with buffer slots."""
    p = len(orders)
    last = p * v - 1
    fwd_tick: dict[tuple[int, int], int] = {}  # (microbatch, global stage) -> tick
    bwd_tick: dict[tuple[int, int], int] = {}
    done = [0] * p
    rows: list[list[list]] = []
    tick = 0
    while any(done[s] < len(orders[s]) for s in range(p)):
        row = [[None, None] for _ in range(p)]  # [forward op, backward op] per stage
        for s in range(p):
            while done[s] < len(orders[s]):
                kind, i, c = orders[s][done[s]]
                g = c * p + s
                if kind == "F":
                    ready = g == 0 or fwd_tick.get((i, g - 1), tick) < tick
                    if row[s][0] is not None or not ready:
                        break
                    fwd_tick[(i, g)] = tick
                    row[s][0] = (i, c)
                else:
                    ready = (fwd_tick.get((i, g), tick + 1) <= tick if g == last
                             else bwd_tick.get((i, g + 1), tick) < tick)
                    if row[s][1] is not None or not ready:
                        break
                    bwd_tick[(i, g)] = tick
                    row[s][1] = (i, c)
                done[s] += 1
        if all(r == [None, None] for r in row):
            raise ValueError(f"schedule '{name}' deadlocks at tick {tick}: every stage waits")
        rows.append(row)
        tick += 1

    # Buffers. The input of global stage g > 0 arrives the tick after stage g−1's forward and
    # lives until g's backward; the output gradient of g < last arrives the tick after g+1's
    # backward and lives until g's backward.
    act = [[] for _ in range(p)]
    grad = [[] for _ in range(p)]
    for (i, g), t in bwd_tick.items():
        s = g % p
        if g > 0:
            act[s].append((fwd_tick[(i, g - 1)] + 1, t, (i, g)))
        if g < last:
            grad[s].append((bwd_tick[(i, g + 1)] + 1, t, (i, g)))
    act_slot, grad_slot, act_depth, grad_depth = {}, {}, 0, 0
    for s in range(p):
        a, da = _slots(act[s])
        b, db = _slots(grad[s])
        act_slot.update(a)
        grad_slot.update(b)
        act_depth, grad_depth = max(act_depth, da), max(grad_depth, db)

    table = np.full((len(rows), p, len(FIELDS)), -1, np.int32)
    col = {f: k for k, f in enumerate(FIELDS)}
    for t, row in enumerate(rows):
        for s, (fwd, bwd) in enumerate(row):
            if fwd is not None:
                i, c = fwd
                g = c * p + s
                table[t, s, col["fwd_mb"]], table[t, s, col["fwd_chunk"]] = i, c
                if g > 0:
                    table[t, s, col["fwd_slot"]] = act_slot[(i, g)]
                if g < last:  # its output arrives downstream at the end of this tick
                    table[t, (s + 1) % p, col["recv_slot"]] = act_slot[(i, g + 1)]
            if bwd is not None:
                i, c = bwd
                g = c * p + s
                table[t, s, col["bwd_mb"]], table[t, s, col["bwd_chunk"]] = i, c
                if g > 0:
                    table[t, s, col["bwd_slot"]] = act_slot[(i, g)]
                    table[t, (s - 1) % p, col["grad_recv_slot"]] = grad_slot[(i, g - 1)]
                if g < last:
                    table[t, s, col["bwd_grad_slot"]] = grad_slot[(i, g)]
    return Schedule(name, p, v, m, table, max(act_depth, 1), max(grad_depth, 1))


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The table of schedule `name` (gpipe | 1f1b | interleaved) for p stages, m microbatches, v chunks."""
    check(name, stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    if name == "gpipe":
        orders = [gpipe_order(p, m, s) for s in range(p)]
    elif name == "1f1b":
        orders = [one_f_one_b_order(p, m, s) for s in range(p)]
    else:
        orders = [interleaved_order(p, m, s, v) for s in range(p)]
    return lockstep(name, orders, m, v)


def check(name: str, stages: int, microbatches: int, chunks: int) -> None:
    """Raise ValueError (one line: the problem and the fix) for a schedule that cannot be built."""
    if name not in SCHEDULES:
        raise ValueError(f"train.pp_schedule: '{name}' is not one of {', '.join(SCHEDULES)}")
    if chunks < 1:
        raise ValueError(f"train.pp_virtual: must be at least 1, got {chunks}")
    if name != "interleaved" and chunks != 1:
        raise ValueError(f"train.pp_virtual={chunks} needs train.pp_schedule='interleaved'; set pp_virtual=1 "
                         "or use the interleaved schedule")
    if name == "interleaved" and microbatches % stages:
        raise ValueError(f"train.pp_schedule='interleaved' runs microbatches in groups of mesh.pp={stages}: "
                         f"train.microbatches={microbatches} must be a multiple of {stages}")
    if name == "1f1b" and microbatches < stages:
        raise ValueError(f"train.pp_schedule='1f1b' needs at least as many microbatches as stages: "
                         f"train.microbatches={microbatches} < mesh.pp={stages}; raise microbatches or use gpipe")


def check_config(m, t, shape: dict) -> list[str]:
    """The pipeline keys against the model and the mesh: ConfigError (one line) for what cannot run."""
    pp, v = shape["pp"], t.pp_virtual
    if v < 1:
        raise ConfigError(f"train.pp_virtual: must be at least 1, got {v}")
    segments = stack.segments(m)  # the last one is pipelined; those before it run on the first stage
    repeats = segments[-1].repeats
    if repeats % (pp * v):
        what = f"model.n_layers={m.n_layers}" if len(segments) == 1 else "the last of model.segments"
        raise ConfigError(f"{what} ({repeats} repeats of the pattern) does not split into "
                          f"mesh.pp×train.pp_virtual={pp}×{v}={pp * v} equal chunks; change n_layers, pp or pp_virtual")
    notes = (["train.pp_gather_once=true only matters with mesh.pp>1 and train.zero_stage=3; it has no effect"]
             if t.pp_gather_once and (pp == 1 or t.zero_stage != 3) else [])
    if pp == 1:
        if v > 1:
            raise ConfigError(f"train.pp_virtual={v} needs mesh.pp>1; set mesh.pp or pp_virtual=1")
        return notes
    try:
        check(t.pp_schedule, pp, t.microbatches, v)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # The islands' ppermutes inside a stage's branch wait for every device of the mesh on XLA:CPU,
    # while only that stage's devices take the branch: they hang (docs/design-notes.md).
    if shape["sp"] > 1:
        raise ConfigError(f"mesh.pp={pp} with mesh.sp={shape['sp']}: context parallelism inside pipeline stages "
                          "is not supported yet; set mesh.sp=1 or mesh.pp=1")
    if m.collective_matmul:
        raise ConfigError(f"model.collective_matmul=true with mesh.pp={pp} is not supported yet; set "
                          "collective_matmul=false (sequence_parallel works) or mesh.pp=1")
    return notes


# ---------------------------------------------------------------- what a table costs


def tick_times(s: Schedule, forward: float = 1.0, backward: float = 2.0) -> np.ndarray:
    """How long each tick takes when a chunk's forward costs forward/v and its backward backward/v:
    the busiest stage's forward slot plus backward slot (stages wait for each other only at the
    exchange that ends the tick)."""
    f = (s.field("fwd_mb") >= 0) * forward / s.chunks
    b = (s.field("bwd_mb") >= 0) * backward / s.chunks
    return (f + b).max(axis=1)


def bubble_fraction(s: Schedule, forward: float = 1.0, backward: float = 2.0) -> float:
    """The share of stage-time spent idle: 1 − (work per stage) / makespan."""
    work = s.microbatches * (forward + backward)
    return 1.0 - work / float(tick_times(s, forward, backward).sum())


def bubble_formula(s: Schedule) -> float:
    """(p−1)/(m+p−1) for GPipe and 1F1B; (p−1)/(v·m+p−1) with v chunks (interleaved)."""
    p, m, v = s.stages, s.microbatches, s.chunks
    return (p - 1) / (v * m + p - 1)


def inputs_alive(s: Schedule) -> int:
    """The most stage inputs (activation buffer slots in use) any stage holds at once."""
    return s.act_depth
