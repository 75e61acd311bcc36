"""Pipeline schedules as tables: which microbatch each stage runs forward and backward at each tick.

Plain Python and numpy, no JAX: a schedule is data that `parallel/pipeline.py` executes
and `tools/studies/pipeline.py` draws.

The model's layers are split into p·v chunks ("global stages" g = 0 ... p·v−1); device
(stage) s holds chunks c = 0 ... v−1. Where each chunk sits is the schedule's `placement`:
`"loop"` puts global stage c·p + s on stage s (Megatron's interleaving; v = 1 is the plain
contiguous split), `"v"` (v = 2, ZB-V) puts global stages s and 2p−1−s there, so the
forward goes down the stages and comes back up. Time runs in lockstep ticks; at the end of
each tick every stage sends what it made (a forward output to the stage of the next global
stage, an input gradient to that of the previous one: a neighbour, round the ring for
interleaving, or itself at the V's turn), so anything produced at tick t is usable from
tick t+1.

Two kinds of tick. The fused schedules (gpipe, 1f1b, interleaved) give each stage one
forward slot and one backward slot per tick (so a stage never waits on its neighbour's
slower kind of work), and their backward re-runs the stage from its saved input and
computes the weight gradients too. The zero-bubble schedules (zb_h1, zb_v) split that
backward in three: R (re-run the chunk from its input, keeping its VJP), B (the input
gradient, on the critical path) and W (the weight gradients, from what B left in the "W
stash"), and give each stage at most one of F, R and B per tick and the rest of the tick
for W, in pieces, so that W fills the time a stage would otherwise wait and R runs before
the gradient arrives (`zero_bubble_rows`; the tables are built for the operations' costs).
(The paper's B keeps activations instead of re-running; here R is B's share of the re-run,
off the critical path.)

For the fused schedules a generator writes each stage's work as an ordered list of
operations and `lockstep` runs every stage down its list as early as the data allows; the
zero-bubble ones are built tick by tick. Either way the table records:

- `fwd_mb`, `fwd_chunk`: the microbatch and chunk run forward (−1: none);
- `r_mb`, `r_chunk`: the same for R (zero-bubble schedules only), `r_slot` the activation
  slot it re-runs from;
- `bwd_mb`, `bwd_chunk`: the same for the backward (B);
- `w_mb`, `w_chunk`: the same for the weight gradients (W; zero-bubble schedules only), of
  pieces `w_first` to `w_first + w_count` (a chunk's W is `pieces` pieces, one per layer or
  group of layers); `w2_*` a second W slot, so a tick can finish one stash and start the next;
- `fwd_slot`: the activation buffer slot holding that forward's input;
- `bwd_slot`, `bwd_grad_slot`: the slots holding the saved input (a fused backward's)
  and the output gradient of that backward; `stash_slot`: where B leaves its W stash,
  `w_slot`, `w2_slot`: where W reads it;
- `send_up`, `send_down`: what the stage sends to s+1 and to s−1 (`NOTHING`, `OUTPUT`:
  its forward's output, `GRADIENT`: its backward's input gradient);
- `below_kind`, `below_slot`: what arrives from stage s−1 at the end of the tick (`OUTPUT`
  into the activation buffer, `GRADIENT` into the gradient buffer) and the slot it goes
  to (−1: nothing arrives); `above_kind`, `above_slot` the same from s+1, `self_kind`,
  `self_slot` for what the stage keeps of its own (at the V's turn). In the V a stage
  may take three values in one tick, one from each.

The first global stage reads tokens, not a buffer; the last one computes the loss,
so its backward needs no gradient and its forward has nothing to send (the executor
skips it: the backward recomputes the stage anyway). Slots are given out interval by
interval (arrival to backward, or to R; backward to its last W piece for the stash), so a
buffer's depth is the most inputs alive at once on any stage: the executor's memory comes
straight from the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm import stack
from jaxllm.errors import ConfigError

FIELDS = ("fwd_mb", "fwd_chunk", "fwd_slot", "r_mb", "r_chunk", "r_slot", "bwd_mb", "bwd_chunk", "bwd_slot",
          "bwd_grad_slot", "stash_slot", "w_mb", "w_chunk", "w_slot", "w_first", "w_count", "w2_mb", "w2_chunk",
          "w2_slot", "w2_first", "w2_count", "send_up", "send_down", "below_kind", "below_slot", "above_kind",
          "above_slot", "self_kind", "self_slot")
SIDES = ("below", "above", "self")  # where an arriving value comes from: stage s−1, s+1, this stage
NOTHING, OUTPUT, GRADIENT = 0, 1, 2  # what a stage sends (and so what arrives)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_v")
SPLIT = ("zb_h1", "zb_v")  # the schedules that split the backward into B and W


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    chunks: int  # v, model chunks per stage
    microbatches: int  # m
    table: np.ndarray  # int32 [ticks, stages, len(FIELDS)]
    act_depth: int  # activation buffer slots per stage
    grad_depth: int  # gradient buffer slots per stage
    placement: str = "loop"  # "loop": chunk c of stage s is global stage c·p + s; "v": s, then 2p−1−s
    stash_depth: int = 0  # W stash slots per stage (0: the backward is not split)
    residual_depth: int = 0  # slots for R's residuals per stage
    pieces: int = 1  # W of a chunk in this many pieces (its layers, or groups of them); a W slot runs w_count

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    @property
    def split(self) -> bool:
        """Whether the backward is split into B and W (one operation per stage per tick)."""
        return self.stash_depth > 0

    @property
    def ring(self) -> bool:
        """Whether values go round the ring (stage p−1 to 0): interleaving with v > 1."""
        return self.placement == "loop" and self.chunks > 1

    def field(self, name: str) -> np.ndarray:
        """One field of the table, [ticks, stages]."""
        return self.table[:, :, FIELDS.index(name)]

    def global_stage(self, stage: int, chunk: int) -> int:
        return global_stage(self.placement, self.stages, stage, chunk)

    def arrivals(self, side: str) -> set[int]:
        """The kinds of value (OUTPUT, GRADIENT) that ever arrive from `side` ("below", "above", "self")."""
        return {int(k) for k in np.unique(self.field(side + "_kind"))} - {NOTHING}


def global_stage(placement: str, p: int, s, c):
    """The global stage of chunk c on stage s (works on ints and on arrays)."""
    if placement == "v":
        return s + c * (2 * p - 1 - 2 * s)
    return c * p + s


def stage_of(placement: str, p: int, g: int) -> tuple[int, int]:
    """(stage, chunk) holding global stage g."""
    if placement == "v":
        return (g, 0) if g < p else (2 * p - 1 - g, 1)
    return g % p, g // p


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


def zero_bubble_rows(p: int, m: int, placement: str, inflight, stashed: int, costs: "Costs", pieces: int):
    """The zero-bubble schedules, built greedily one tick at a time: (rows, done) as `_run` makes them.

    Each tick a stage runs at most one of F, R and B, and fills the rest of the tick with W. R re-runs a chunk's
    forward from its saved input and keeps what its backward needs (the executor keeps stage inputs, not
    activations); B, the input gradient, then needs nothing but the arriving gradient, and W the stash B left.
    A stage picks: a B whose R is done and whose gradient has arrived (the earliest microbatch, the later chunk
    first); else, holding no R's residuals, an R whose downstream stage has run its own (its gradient is a tick
    or two away); else, unless `stashed` W stashes wait, a forward, while the stage holds fewer than
    `inflight(s)` chunk inputs (a chunk-1 forward of the V always goes: it is on its way to the turn, and
    holding it back could starve the B it waits for). The tick lasts as long as the longest of these under
    `costs`; then every stage fills what is left of it with W of its oldest stash, in `pieces` pieces (one per
    layer of the chunk: each layer's weight gradients are separate), as many as fit, a whole W where no stage
    runs anything else. So W takes up the time a stage would wait for the slowest operation of the tick.

    At unit costs no piece fits beside another operation and W runs whole, as one operation: ZB-H1 (placement
    "loop", inflight p − s as 1F1B, stashed p + 2) runs in 4m + p − 1 ticks with p − 1 − s idle ticks in stage s's
    span, and ZB-V (placement "v", inflight 2p − 1, stashed 2p) in 8m + p − 1 with no stage idle between its
    first operation and its last: the schedules of Qi et al. 2024 ("Zero Bubble Pipeline Parallelism"), whose
    (p−1)/(3m+p−1) and (p−1)/(6m+p−1) count three operations, with R added off the critical path. It is a greedy
    order, not the paper's handcrafted one: ZB-H1 holds that for p ≤ 8, m = p … 24; the V needs m ≥ 2p−1 to keep
    its stages busy, and even then 26 of the 119 pairs p ≤ 8, m ≤ 24 idle inside a span or take longer, where the
    last microbatches' backward slips behind the R's it waits for (docs/pipeline.md lists them, the tests check).
    """
    v = 2 if placement == "v" else 1
    cost = {"F": costs.forward / v, "R": costs.recompute / v, "B": costs.backward / v}
    piece = costs.weight / v / pieces
    done = {kind: {} for kind in "FRBW"}  # kind -> {(microbatch, global stage): tick} (W: its last piece's)
    state = [{"next_fwd": [0] * v, "held": 0, "residuals": 0, "waiting_w": []} for _ in range(p)]
    where = lambda s, c: global_stage(placement, p, s, c)
    rows, idle = [], 0
    while len(done["W"]) < m * p * v:
        tick = len(rows)
        ops = [_next_op(s, tick, p, m, v, placement, done, state[s], inflight(s), stashed) for s in range(p)]
        longest = max((cost[op[0]] for op in ops if op), default=piece * pieces)
        row = [{} for _ in range(p)]
        for s, op in enumerate(ops):
            if op:
                _take(op, s, tick, where, done, state[s], row[s])
            room = (longest - cost[op[0]] if op else longest) / piece
            _fill_w(s, tick, where, done, state[s], row[s], room, pieces)
        idle = 0 if any(row) else idle + 1
        if idle > 2:  # three ticks without progress: nothing is in flight any more
            raise ValueError(f"zero-bubble schedule for p={p}, m={m} deadlocks at tick {tick}")
        rows.append(row)
    return rows, done


def _take(op, s, tick, where, done, st, row):
    """Stage s runs F, R or B `op` = (kind, microbatch, chunk) at `tick` (`where(s, c)`: the global stage)."""
    kind, i, c = op
    done[kind][(i, where(s, c))] = tick
    row[kind] = (i, c)
    if kind == "F":
        st["held"] += 1
        st["next_fwd"][c] += 1
    elif kind == "R":
        st["residuals"] += 1
    else:
        st["held"], st["residuals"] = st["held"] - 1, st["residuals"] - 1
        st["waiting_w"].append([i, c, 0])  # microbatch, chunk, pieces done


def _fill_w(s, tick, where, done, st, row, room: float, pieces: int):
    """Stage s runs as many of the `pieces` pieces of its waiting Ws (B done at an earlier tick) as fit in `room`
    pieces' time, oldest first, from at most two of them (the table's two W slots, "W" and "W2")."""
    for slot in ("W", "W2"):
        if not st["waiting_w"]:
            return
        i, c, first = st["waiting_w"][0]
        count = min(pieces - first, int(room + 1e-9))
        if count <= 0 or done["B"][(i, where(s, c))] >= tick:
            return
        row[slot] = (i, c, first, count)
        room -= count
        st["waiting_w"][0][2] += count
        if first + count < pieces:
            return
        st["waiting_w"].pop(0)
        done["W"][(i, where(s, c))] = tick


def _next_op(s, tick, p, m, v, placement, done, st, inflight, stashed):
    """The F, R or B stage s picks at `tick` (see `zero_bubble_rows`), or None."""
    last = p * v - 1
    before = lambda kind, i, g: done[kind].get((i, g), tick) < tick  # done at an earlier tick
    chunks = [(c, global_stage(placement, p, s, c)) for c in range(v)]
    ready_b = [(i, -c) for c, g in chunks for i in range(m) if before("R", i, g) and (i, g) not in done["B"]
               and (g == last or before("B", i, g + 1))]
    if ready_b:
        i, c = min(ready_b)
        return "B", i, -c
    ready_r = [(i, -c) for c, g in chunks for i in range(m) if before("F", i, g) and (i, g) not in done["R"]
               and (g == last or before("R", i, g + 1))]
    if ready_r and st["residuals"] == 0:
        i, c = min(ready_r)
        return "R", i, -c
    for c, g in reversed(chunks if len(st["waiting_w"]) < stashed else []):
        i = st["next_fwd"][c]
        if i < m and (g == 0 or before("F", i, g - 1)) and (st["held"] < inflight or c > 0):
            return "F", i, c
    return None


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


def _ready(kind: str, i: int, g: int, last: int, tick: int, done: dict) -> bool:
    """Whether the forward or backward (`kind` F or B) of microbatch i on global stage g may run at `tick` in a
    fused schedule: its inputs were made at earlier ticks (the last stage's backward may share its forward's
    tick: its forward there is skipped, the backward re-runs the stage)."""
    if kind == "F":
        return g == 0 or done["F"].get((i, g - 1), tick) < tick
    return done["F"].get((i, g), tick + 1) <= tick if g == last else done["B"].get((i, g + 1), tick) < tick


def _run(name: str, orders: list, placement: str, p: int, v: int) -> tuple[list, dict]:
    """Run each stage down its order as early as the data allows, one forward and one backward per tick. (rows:
    per tick and stage {kind: (microbatch, chunk)}, done: kind -> {(i, g): tick})."""
    last = p * v - 1
    done = {kind: {} for kind in "FRBW"}
    at = [0] * p
    rows = []
    while any(at[s] < len(orders[s]) for s in range(p)):
        row = [{} for _ in range(p)]
        for s in range(p):
            while at[s] < len(orders[s]):
                kind, i, c = orders[s][at[s]]
                g = global_stage(placement, p, s, c)
                if kind in row[s] or not _ready(kind, i, g, last, len(rows), done):
                    break
                row[s][kind] = (i, c)
                done[kind][(i, g)] = len(rows)
                at[s] += 1
        if not any(row):
            raise ValueError(f"schedule '{name}' deadlocks at tick {len(rows)}: every stage waits")
        rows.append(row)
    return rows, done


def lockstep(name: str, orders: list[list[tuple[str, int, int]]], m: int, v: int, placement: str = "loop") -> Schedule:
    """Run each stage down its order (one forward and one backward per tick) as early as the data allows and lay
    the result out as a table with buffer slots."""
    rows, done = _run(name, orders, placement, len(orders), v)
    return _layout(name, rows, done, m, v, placement)


def _layout(name: str, rows: list, done: dict, m: int, v: int, placement: str, pieces: int = 1) -> Schedule:
    """The Schedule of a run (rows: per tick and stage {kind: (microbatch, chunk[, first piece, pieces])}, done:
    kind -> {(i, g): tick}), with buffer slots."""
    p = len(rows[0])
    last = p * v - 1
    # Buffers. The input of global stage g > 0 arrives the tick after g−1's forward and lives until g's
    # backward (its R when split); the output gradient of g < last arrives the tick after g+1's backward and
    # lives until g's backward; R's residuals live from the R to the B, the W stash from the B to the last W.
    where = lambda g: stage_of(placement, p, g)[0]
    act, grad, residual, stash = ([[] for _ in range(p)] for _ in range(4))
    for (i, g), t in done["B"].items():
        if g > 0:
            act[where(g)].append((done["F"][(i, g - 1)] + 1, done["R"].get((i, g), t), (i, g)))
        if g < last:
            grad[where(g)].append((done["B"][(i, g + 1)] + 1, t, (i, g)))
        if (i, g) in done["W"]:
            residual[where(g)].append((done["R"][(i, g)], t, (i, g)))
            stash[where(g)].append((t, done["W"][(i, g)], (i, g)))
    slots, depths = [{}, {}, {}, {}], [0, 0, 0, 0]
    for k, per_stage in enumerate((act, grad, residual, stash)):
        for s in range(p):
            got, depth = _slots(per_stage[s])
            slots[k].update(got)
            depths[k] = max(depths[k], depth)
    table = _table(rows, slots, placement, p, last)
    return Schedule(name, p, v, m, table, max(depths[0], 1), max(depths[1], 1), placement, depths[3], depths[2],
                    pieces)


def _table(rows: list, slots: list, placement: str, p: int, last: int) -> np.ndarray:
    """The int32 [ticks, stages, FIELDS] table of a run (`_run`) with its slots (activation, gradient, residual,
    stash)."""
    act_slot, grad_slot, res_slot, stash_slot = slots
    table = np.full((len(rows), p, len(FIELDS)), -1, np.int32)
    col = {f: k for k, f in enumerate(FIELDS)}
    table[:, :, [col[f] for f in FIELDS if f.startswith("send_") or f.endswith("_kind")]] = NOTHING
    table[:, :, [col["w_count"], col["w2_count"]]] = 0

    def send(t, s, g_to, what, value_slot):
        to = stage_of(placement, p, g_to)[0]
        if to == s:
            side = "self"
        elif placement == "v":
            side = "below" if to == s + 1 else "above"  # as the receiver sees it
        else:  # round the ring (at p = 2 both neighbours are one stage): outputs go up, gradients down
            side = "below" if what == OUTPUT else "above"
        if side != "self":
            table[t, s, col["send_up" if side == "below" else "send_down"]] = what
        assert table[t, to, col[side + "_kind"]] == NOTHING, "two values on one channel"
        table[t, to, col[side + "_kind"]], table[t, to, col[side + "_slot"]] = what, value_slot

    def put(t, s, prefix, op):  # an operation's microbatch and chunk; (microbatch, global stage)
        i, c = op[:2]
        table[t, s, col[prefix + "_mb"]], table[t, s, col[prefix + "_chunk"]] = i, c
        return i, global_stage(placement, p, s, c)

    for t, row in enumerate(rows):
        for s, ops in enumerate(row):
            if "F" in ops:
                i, g = put(t, s, "fwd", ops["F"])
                if g > 0:
                    table[t, s, col["fwd_slot"]] = act_slot[(i, g)]
                if g < last:  # its output arrives at global stage g+1's stage at the end of this tick
                    send(t, s, g + 1, OUTPUT, act_slot[(i, g + 1)])
            if "R" in ops:
                i, g = put(t, s, "r", ops["R"])
                if g > 0:
                    table[t, s, col["r_slot"]] = act_slot[(i, g)]
            if "B" in ops:
                i, g = put(t, s, "bwd", ops["B"])
                if g > 0 and (i, g) not in res_slot:  # a fused backward re-runs the stage from its input
                    table[t, s, col["bwd_slot"]] = act_slot[(i, g)]
                if g > 0:
                    send(t, s, g - 1, GRADIENT, grad_slot[(i, g - 1)])
                if g < last:
                    table[t, s, col["bwd_grad_slot"]] = grad_slot[(i, g)]
                if (i, g) in stash_slot:
                    table[t, s, col["stash_slot"]] = stash_slot[(i, g)]
            for w in ("w", "w2"):  # the two W slots: pieces first .. first + count of a stash
                if w.upper() in ops:
                    i, g = put(t, s, w, ops[w.upper()])
                    table[t, s, col[w + "_first"]], table[t, s, col[w + "_count"]] = ops[w.upper()][2:]
                    table[t, s, col[w + "_slot"]] = stash_slot[(i, g)]
    return table


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1, costs: "Costs | None" = None,
                  pieces: int = 1) -> Schedule:
    """The table of schedule `name` (gpipe | 1f1b | interleaved | zb_h1 | zb_v) for p stages, m microbatches,
    v chunks (interleaved; zb_v always has two, in a V). The zero-bubble tables are built for `costs` (unit
    costs by default), with W in `pieces` pieces per chunk (`zero_bubble_rows`)."""
    check(name, stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    costs = costs or UNIT
    if name == "zb_h1":
        rows, done = zero_bubble_rows(p, m, "loop", lambda s: p - s, p + 2, costs, pieces)
        return _layout(name, rows, done, m, 1, "loop", pieces)
    if name == "zb_v":
        rows, done = zero_bubble_rows(p, m, "v", lambda s: 2 * p - 1, 2 * p, costs, pieces)
        return _layout(name, rows, done, m, 2, "v", pieces)
    if name == "gpipe":
        orders = [gpipe_order(p, m, s) for s in range(p)]
    elif name == "1f1b":
        orders = [one_f_one_b_order(p, m, s) for s in range(p)]
    else:
        orders = [interleaved_order(p, m, s, v) for s in range(p)]
    return lockstep(name, orders, m, v)


def model_chunks(name: str, virtual: int) -> int:
    """How many chunks of the model each stage holds: `train.pp_virtual`, two for zb_v."""
    return 2 if name == "zb_v" else virtual


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
    if name in ("1f1b", "zb_h1") and microbatches < stages:
        raise ValueError(f"train.pp_schedule='{name}' needs at least as many microbatches as stages: "
                         f"train.microbatches={microbatches} < mesh.pp={stages}; raise microbatches or use gpipe")


def check_config(m, t, shape: dict) -> list[str]:
    """The pipeline keys against the model and the mesh: ConfigError (one line) for what cannot run."""
    pp, v = shape["pp"], model_chunks(t.pp_schedule, t.pp_virtual)
    if t.pp_virtual < 1:
        raise ConfigError(f"train.pp_virtual: must be at least 1, got {t.pp_virtual}")
    segments = stack.segments(m)  # the last one is pipelined; those before it run on the first stage
    repeats = segments[-1].repeats
    if repeats % (pp * v):
        what = f"model.n_layers={m.n_layers}" if len(segments) == 1 else "the last of model.segments"
        chunks = f"2×mesh.pp (zb_v's two chunks per stage) = {pp * v}" if t.pp_schedule == "zb_v" else (
            f"mesh.pp×train.pp_virtual={pp}×{v}={pp * v}")
        raise ConfigError(f"{what} ({repeats} repeats of the pattern) does not split into {chunks} equal chunks; "
                          "change n_layers, pp or pp_virtual")
    notes = (["train.pp_gather_once=true only matters with mesh.pp>1 and train.zero_stage=3; it has no effect"]
             if t.pp_gather_once and (pp == 1 or t.zero_stage != 3) else [])
    if pp == 1:
        if t.pp_virtual > 1:
            raise ConfigError(f"train.pp_virtual={t.pp_virtual} needs mesh.pp>1; set mesh.pp or pp_virtual=1")
        return notes
    try:
        check(t.pp_schedule, pp, t.microbatches, t.pp_virtual)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return notes


# ---------------------------------------------------------------- what a table costs


@dataclass(frozen=True)
class Costs:
    """What a microbatch's operations cost on a whole stage (on a chunk, 1/v of that): the forward F, the
    recomputation R, the input gradient B, the weight gradients W. A fused backward is all three of R, B, W."""

    forward: float = 1.0
    recompute: float = 1.0
    backward: float = 1.0
    weight: float = 1.0

    @property
    def total(self) -> float:
        return self.forward + self.recompute + self.backward + self.weight


UNIT = Costs()


def layer_costs(matmul: float, attention: float, last_matmul: float) -> Costs:
    """Costs in units of the forward from a layer's forward flops: its matmuls', attention's (scores and values)
    and the last matmul's. The input gradient redoes each matmul once (against the weight) and attention twice,
    the weight gradients each matmul once, R the forward but its last matmul."""
    forward = matmul + attention
    return Costs(1.0, (forward - last_matmul) / forward, (matmul + 2 * attention) / forward, matmul / forward)


def op_times(s: Schedule, costs: Costs = UNIT) -> np.ndarray:
    """[ticks, stages] busy time of each stage in each tick."""
    fused = costs.recompute + costs.backward + costs.weight
    busy = ((s.field("fwd_mb") >= 0) * costs.forward + (s.field("r_mb") >= 0) * costs.recompute
            + (s.field("bwd_mb") >= 0) * (costs.backward if s.split else fused)
            + (s.field("w_count") + s.field("w2_count")) / s.pieces * costs.weight)
    return busy / s.chunks


def tick_times(s: Schedule, costs: Costs = UNIT) -> np.ndarray:
    """How long each tick takes: its busiest stage's work (stages wait for each other only at the exchange
    that ends the tick)."""
    return op_times(s, costs).max(axis=1)


def bubble_fraction(s: Schedule, costs: Costs = UNIT) -> float:
    """The share of stage-time spent idle over the step: 1 − (work per stage) / makespan."""
    return 1.0 - s.microbatches * costs.total / float(tick_times(s, costs).sum())


def idle_in_span(s: Schedule, costs: Costs = UNIT) -> np.ndarray:
    """[stages] idle time of each stage between the start of its first operation and the end of its last (the
    zero-bubble paper's bubble, which leaves out the staircase at the start and the end of a step: hidden
    there by overlapping steps, here every step ends with the optimizer)."""
    busy, ticks = op_times(s, costs), tick_times(s, costs)
    starts = np.cumsum(ticks) - ticks
    out = []
    for stage in range(s.stages):
        used = np.flatnonzero(busy[:, stage] > 0)
        first, last = used[0], used[-1]
        out.append(float(starts[last] + busy[last, stage] - starts[first] - busy[first:last + 1, stage].sum()))
    return np.asarray(out)


def bubble_formula(s: Schedule) -> float:
    """The closed form of the step's bubble at unit costs (F = R = B = W): (p−1)/(m+p−1) for GPipe and 1F1B;
    (p−1)/(v·m+p−1) with v chunks (interleaved); (p−1)/(4m+p−1) for ZB-H1 and (p−1)/(8m+p−1) for ZB-V,
    whose four operations per microbatch and chunk leave only the staircase of the step's start: p−1
    ticks."""
    p, m, v = s.stages, s.microbatches, s.chunks
    if s.split:
        return (p - 1) / (4 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def inputs_alive(s: Schedule) -> int:
    """The most stage inputs (activation buffer slots in use) any stage holds at once."""
    return s.act_depth
