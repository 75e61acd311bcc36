"""`python -m tools.bench.profile_step [--config FILE] [key=value ...]`: where the train step's device time goes.

Usage: `python -m tools.bench.profile_step [key=value ...] [--steps N] [--warmup N] [--top K] [--json] [--out DIR]`;
`--from DIR` reads an earlier run's DIR again (its profile.json, trace and HLO) without running anything.

Builds the train step for the config as `tools.bench.train_step` does (the same config file default, overrides,
validation, mesh and `make_step_fns`, on synthetic random tokens), compiles it, runs `--warmup` steps, times `--steps` steps
untraced, then captures `jax.profiler.trace(DIR, create_perfetto_trace=True)` around `--steps` more (ending with
block_until_ready). It reads the Perfetto file itself (the gzipped Chrome trace-event JSON that jax writes
beside the XPlane file; no TensorBoard plugin needed) and reports, per step:

- the device time of each HLO op (the `hlo_op` the profiler puts on every kernel), its kernels, its
  *category* and its *part* of the step, the top `--top` by time;
- the device time by category: `matmul` (dots; cuBLAS/cuBLASLt, nvjet, CUTLASS, Triton gemm fusions),
  `attention` (fused attention custom calls: cuDNN, Pallas/Triton, flash), `elementwise` (fusions and ops with
  no dot and no reduce: arithmetic, copies, transposes, slices), `reduction` (fusions with a reduce),
  `collective`, `memcpy` (copies and memsets the runtime issues), `other`;
- the device time by part, split by category: the model's named scopes (embed, attention, mlp, moe, head,
  optimizer) in the `op_name` metadata of the op's instructions (a fusion's: the scope most of them name),
  forward or backward (`transpose(jvp(...))`), and `rest` for ops outside every scope (the loss, the gradient
  norm, the layer loop's stacking, copies XLA adds);
- the step's wall time (host clock, untraced and traced), the device's busy time (the union of its events'
  intervals) and its idle fraction, 1 - busy / traced wall time: the gaps in which no kernel ran.

Where the events come from. On a GPU: the `/device:GPU:N` processes of the trace, one thread per CUDA stream
(`Stream #K`), one event per kernel or memcpy, named by the kernel, with `hlo_op` and `hlo_module` in its args
(XProf's derived lines, `XLA Ops`, `Steps`, ..., are skipped). Inside XLA:GPU's command buffers (CUDA graphs;
jax 0.11 runs the whole LLaMA step in them, profiled or not) `hlo_op` names only the buffer (`command_buffer_N`).
An XLA kernel is then mapped to the fusion it is named after (`loop_add_fusion_3` for `loop_add_fusion.3`; XLA
shares one kernel between identical fusions, so a shared kernel counts in the part of the fusion it is named
after), and cuBLAS's and cuDNN's kernels, which name no op, are placed by the program's schedule (`place`); what
stays unnamed (the graphs' memcpy nodes) is in part `unknown`. On XLA:CPU there is no device process: the
`/host:CPU` threads carry one event per thunk of the executable, named by its HLO op, so the same tables describe
the CPU step (control-flow thunks, `while` and `conditional`, hold their bodies' thunks and are left out).
Ops are looked up in the compiled program's HLO text (written beside the trace as `train_step.hlo.txt`): opcode,
custom-call target, what a fusion's computations contain, and `op_name`. Device time is the sum of the events'
durations: where several threads (XLA:CPU) or streams run at once it can exceed the busy time.

MFU is the trainer's (`flops_per_token`, `peak_flops`) at the untraced step time. With --json the last stdout line
is a JSON object; config mistakes print `error: ...` and exit 2.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import logging
import os
import re
import sys
import tempfile
import time

from jaxllm.trainer.profiling import HLO_FILE
from tools.bench.train_step import step_parser

CATEGORIES = ("matmul", "attention", "elementwise", "reduction", "collective", "memcpy", "other")
SCOPES = ("embed", "attention", "mlp", "moe", "head", "optimizer")  # the named scopes of models/ and trainer/step.py
DERIVED_LINES = {"Steps", "XLA Modules", "XLA Ops", "Async XLA Ops", "TensorFlow Ops", "TensorFlow Name Scope",
                 "Framework Ops", "Framework Name Scope", "Launch Stats", "Source code", "SparseCore Ops"}
CONTAINERS = {"while", "conditional", "call"}
LAUNCHERS = {"fusion", "while", "conditional", "call", "custom-call", "sort"}  # ops that launch kernels of their own
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
               "collective-broadcast", "send", "recv")
MATMUL_OPS = {"dot", "convolution", "scaled-dot", "ragged-dot"}
ATTENTION_TARGET = re.compile(r"fmha|flash|sdpa|attention|triton|pallas|mosaic", re.I)
MATMUL_TARGET = re.compile(r"cublas|gemm|matmul|cudnn\$conv", re.I)
KERNEL_PATTERNS = (  # for events the HLO does not name: by kernel name
    ("memcpy", re.compile(r"memcpy|memset", re.I)),
    ("collective", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter", re.I)),
    ("attention", re.compile(r"fmha|flash|sdpa|attention|attn|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cublas|cutlass|xmma|wgmma|matmul", re.I)),
    ("reduction", re.compile(r"reduce", re.I)),
)


# ---- the step

def build(cfg):
    """(compiled train step, state, tokens): `tools.bench.train_step`'s jaxllm half, built by the same jaxllm calls."""
    import numpy as np

    from jaxllm.batch import from_windows, global_arrays
    from jaxllm.mesh import initialize_distributed, make_mesh
    from jaxllm.trainer.loop import resolve
    from jaxllm.trainer.step import make_step_fns

    m, t = cfg.model, cfg.train
    initialize_distributed(cfg.distributed)
    _, shape, _ = resolve(cfg)  # vocab from the tokenizer, validated as the trainer does
    fns = make_step_fns(cfg, make_mesh(shape, cfg))
    tokens_np = np.random.default_rng(0).integers(0, m.vocab_size, (t.global_batch, m.seq_len + 1), dtype=np.int32)
    tokens = global_arrays(from_windows(tokens_np), fns.batch_sharding)
    state = fns.init(t.seed)
    return fns.train_step.lower(state, tokens).compile(), state, tokens


def run_steps(step, state, tokens, n: int):
    """(state, seconds per step) after n steps, timed from the first dispatch to block_until_ready."""
    import jax

    start = time.perf_counter()
    for _ in range(n):
        state, metrics = step(state, tokens)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - start) / n


def capture(step, state, tokens, n: int, out_dir: str):
    """(state, traced seconds per step) for n steps under `jax.profiler.trace`, written under out_dir."""
    import jax

    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        return run_steps(step, state, tokens, n)


def newest_trace(out_dir: str) -> str:
    paths = glob.glob(os.path.join(out_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no plugins/profile/*/perfetto_trace.json.gz under {out_dir}")
    return max(paths, key=os.path.getmtime)


# ---- the compiled program

@dataclasses.dataclass
class Op:
    name: str
    opcode: str
    target: str = ""  # custom_call_target
    calls: tuple = ()  # computations a fusion (or call) runs
    op_name: str = ""  # metadata: jit(...)/scopes/primitive


INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(?:\(.*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")


def parse_hlo(text: str) -> tuple[dict, dict]:
    """({instruction name: Op}, {computation name: [its Ops]}) of an HLO module's text."""
    ops, computations, current = {}, {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = computations.setdefault(line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%"), [])
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        target = re.search(r'custom_call_target="([^"]*)"', line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        calls = re.search(r"calls=(\{[^}]*\}|%?[\w.\-]+)", line)
        ops[name] = Op(name, opcode, target.group(1) if target else "",
                       tuple(c.strip(" {}%") for c in calls.group(1).split(",")) if calls else (),
                       op_name.group(1) if op_name else "")
        if current is not None:
            current.append(ops[name])
    return ops, computations


def inside(op: Op, computations: dict) -> list:
    """The op and every Op in the computations it calls, nested fusions included."""
    seen, todo, found = set(), list(op.calls), [op]
    while todo:
        c = todo.pop()
        if c in seen or c not in computations:
            continue
        seen.add(c)
        found += computations[c]
        todo += [d for o in computations[c] for d in o.calls]
    return found


def base_opcode(opcode: str) -> str:
    return re.sub(r"-(start|done|update)$", "", opcode)


def category(kernel: str, op: Op | None, computations: dict) -> str:
    """One of CATEGORIES for a device event: the runtime's copies by kernel name, then by its HLO op, else by
    the kernel's name."""
    if KERNEL_PATTERNS[0][1].search(kernel):
        return "memcpy"
    if op is None:
        return next((c for c, p in KERNEL_PATTERNS if p.search(kernel)), "other")
    opcode = base_opcode(op.opcode)
    if opcode in COLLECTIVES:
        return "collective"
    if opcode == "copy" and op.opcode != "copy":  # copy-start/done: host offload and async copies
        return "memcpy"
    body = inside(op, computations)
    opcodes, targets = {o.opcode for o in body}, [o.target for o in body if o.target]
    if any(ATTENTION_TARGET.search(t) for t in targets):
        return "attention"
    if opcodes & MATMUL_OPS or any(MATMUL_TARGET.search(t) for t in targets):
        return "matmul"
    if opcodes & {"reduce", "reduce-window", "select-and-scatter"}:
        return "reduction"
    if opcode == "custom-call" or opcode in {"sort", "rng", "rng-bit-generator", "infeed", "outfeed"}:
        return "other"
    return "elementwise"


def scope_of(op_name: str) -> str:
    """'SCOPE fwd', 'SCOPE bwd' or 'optimizer' for an op_name (SCOPE one of SCOPES, else 'rest'; no direction
    outside the gradient)."""
    scope = next((p for p in re.split(r"[/()]", op_name) if p in SCOPES), "rest")  # "attention", "jvp(head)"
    if scope == "optimizer":
        return scope
    if "transpose(" in op_name:
        return f"{scope} bwd"
    return f"{scope} fwd" if "jvp(" in op_name else scope


def part(op: Op | None, computations: dict) -> str:
    """The part of the step an op belongs to: the scope most of its instructions (a fusion's included) name,
    else its own (a fusion's root can be a select or a copy outside every scope, e.g. the guard's keep-or-skip
    of the updated parameters)."""
    if op is None:
        return "unknown"
    named = collections.Counter(scope_of(o.op_name) for o in inside(op, computations) if o.op_name)
    named = collections.Counter({k: v for k, v in named.items() if not k.startswith("rest")}) or named
    return named.most_common(1)[0][0] if named else scope_of(op.op_name)


# ---- the trace

@dataclasses.dataclass
class Event:
    kernel: str
    hlo_op: str
    ts: float  # µs
    dur: float  # µs
    line: tuple  # (pid, tid)


def hlo_op_of(args: dict) -> str:
    """The event's HLO op: its `hlo_op` arg, else one named in an annotation arg (`...#hlo_op=NAME,...#`)."""
    if "hlo_op" in args:
        return str(args["hlo_op"])
    found = (re.search(r"hlo_op=([^,#\s]+)", v) for v in args.values() if isinstance(v, str))
    return next((m.group(1) for m in found if m), "")


def device_events(path: str, module: str) -> tuple[list, dict]:
    """(events of the device's work in the program `module`, what was read) from a Perfetto trace file: the
    `/device:*` processes' lines but XProf's derived ones, or, where there is none (XLA:CPU), the host's thunk
    events. Events of other programs are left out when any event names `module`."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    kept, modules, lines = [], collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args, line = e.get("args") or {}, (e["pid"], e.get("tid"))
        hlo_op = hlo_op_of(args)
        on_device = e["pid"] in devices and threads.get(line, "") not in DERIVED_LINES
        if not (on_device if devices else hlo_op):  # on the host (XLA:CPU), the executable's thunks
            continue
        kept.append((Event(e.get("name", ""), hlo_op, float(e["ts"]), float(e["dur"]), line), args.get("hlo_module")))
        modules[args.get("hlo_module")] += 1
    if module in modules:
        kept = [(e, m) for e, m in kept if m in (module, None)]
    for e, _ in kept:
        lines[f"{processes.get(e.line[0], e.line[0])} / {threads.get(e.line, e.line[1])}"] += 1
    source = {"from": "device streams" if devices else "host threads (thunks)", "modules": dict(modules),
              "lines": dict(lines)}
    return [e for e, _ in kept], source


def busy(events: list) -> float:
    """The length of the union of the events' intervals (µs): time in which the device ran something."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.ts):
        start, stop = max(e.ts, end), e.ts + e.dur
        if stop > start:
            total += stop - start
        end = max(end, stop)
    return total


# ---- the tables

def op_key(e: Event, ops: dict) -> str:
    """The HLO op an event belongs to: its `hlo_op`, else the op its kernel is named after (XLA:GPU names a
    fusion's kernel `loop_add_fusion_3` for `loop_add_fusion.3`), else the kernel itself."""
    for name in (e.hlo_op, e.kernel, re.sub(r"_(\d+)$", r".\1", e.kernel)):
        if name in ops:
            return name
    return e.kernel or e.hlo_op


def library_kind(kernel: str) -> str | None:
    """'attention' or 'matmul' for a cuDNN attention or cuBLAS/CUTLASS GEMM kernel, else None."""
    patterns = dict(KERNEL_PATTERNS)
    return next((k for k in ("attention", "matmul") if patterns[k].search(kernel)), None)


def call_kind(op: Op) -> str | None:
    """'attention' or 'matmul' for a library custom call (cuDNN attention, cuBLAS GEMM), else None."""
    if op.opcode != "custom-call":
        return None
    return "attention" if ATTENTION_TARGET.search(op.target) else "matmul" if MATMUL_TARGET.search(op.target) else None


def library_runs(events: list, keys: list, ops: dict):
    """(previous op, [slots], next op) for each run of library kernels no op names, between the kernels of named
    ops before and after it on its stream (None at a stream's ends). A slot is one library call's kernels: one
    GEMM kernel, or consecutive attention kernels (cuDNN's backward launches several); other unnamed kernels
    (memcpy, memset) inside a run are passed over."""
    order = sorted(range(len(events)), key=lambda i: (events[i].line, events[i].ts))
    prev, slots, line = None, [], None
    for i in order:
        e, key = events[i], keys[i]
        if e.line != line:
            if slots:
                yield prev, slots, None
            prev, slots, line = None, [], e.line
        if key in ops:
            if slots:
                yield prev, slots, key
            prev, slots = key, []
        elif kind := library_kind(e.kernel):
            if kind == "attention" and slots and slots[-1][0] == "attention":
                slots[-1][1].append(i)
            else:
                slots.append((kind, [i]))
    if slots:
        yield prev, slots, None


def adjacent_calls(body: list, start: int, step: int, limit: int) -> list:
    """Up to `limit` library calls met walking `body` from `start` by `step`, stopping at the first instruction
    that launches kernels of its own (a fusion, a loop, another custom call): the calls a run of library kernels
    can be, next to a named kernel's op."""
    found, i = [], start
    while 0 <= i < len(body) and len(found) < limit:
        if call_kind(body[i]):
            found.append(body[i])
        elif body[i].opcode in LAUNCHERS or base_opcode(body[i].opcode) in COLLECTIVES:
            break
        i += step
    return found


def align(prev, slots, nxt, computations: dict, position: dict) -> dict:
    """{event index: op} for one run: the library calls right after `prev` in the schedule of its computation,
    then, for the slots left, those right before `nxt` in its (a run can cross from a loop body to what follows
    it, or from one iteration into the next); else those right before `nxt` alone (XLA:GPU shares one kernel
    between identical fusions and names it after one of them, so `prev` can name another op than the one that
    ran). Only calls whose kinds match the slots' in order count."""
    n, kinds = len(slots), [k for k, _ in slots]
    (pc, pi), (nc, nj) = position.get(prev, (None, -1)), position.get(nxt, (None, 0))
    after = adjacent_calls(computations[pc], pi + 1, 1, n) if pc is not None else []
    before = adjacent_calls(computations[nc], nj - 1, -1, n)[::-1] if nc is not None else []
    tries = [after, before]
    if len(after) < n and not (pc == nc and pi < nj):
        tries.insert(0, after + before[len(before) - (n - len(after)):])
    found = next((t for t in tries if [call_kind(o) for o in t] == kinds), None)
    return {i: o.name for o, (_, members) in zip(found, slots) for i in members} if found else {}


def place(events: list, ops: dict, computations: dict) -> tuple[list, set]:
    """(each event's op, the indices of the events placed by the schedule): `op_key`, then the library kernels
    placed by the program's schedule. Inside XLA:GPU's command buffers (CUDA graphs) the profiler names each
    kernel's op only by the buffer's (`command_buffer_N`); XLA's own kernels carry their fusion's name, but
    cuBLAS's and cuDNN's do not. A run of them between two named kernels is matched, in order and by kind
    (GEMM or attention), to the library custom calls between those two ops in the scheduled HLO."""
    keys = [op_key(e, ops) for e in events]
    position = {o.name: (c, i) for c, body in computations.items() for i, o in enumerate(body)}
    placed = {}
    for prev, slots, nxt in library_runs(events, keys, ops):
        placed.update(align(prev, slots, nxt, computations, position))
    for i, name in placed.items():
        keys[i] = name
    return keys, set(placed)


def summarize(events: list, ops: dict, computations: dict, steps: int, traced_s: float) -> dict:
    """Per step: time by op (with its kernels), by category and by part; busy time and idle fraction."""
    events = [e for e in events if not (e.hlo_op in ops and ops[e.hlo_op].opcode in CONTAINERS
                                        and e.kernel == e.hlo_op)]
    keys, placed = place(events, ops, computations)
    by_op = {}
    for e, key in zip(events, keys):
        row = by_op.setdefault(key, {"op": key, "us": 0.0, "count": 0, "kernels": collections.Counter()})
        row["us"] += e.dur
        row["count"] += 1
        row["kernels"][e.kernel] += e.dur
    step_ms = traced_s * 1e3
    rows = []
    for key, r in by_op.items():
        op = ops.get(r["op"])
        kernel = r["kernels"].most_common(1)[0][0]
        ms = r["us"] / 1e3 / steps
        rows.append({"op": r["op"], "kernel": kernel, "kernels": len(r["kernels"]),
                     "category": category(kernel, op, computations), "part": part(op, computations),
                     "opcode": op.opcode if op else "", "ms": ms, "pct": 100 * ms / step_ms,
                     "count": r["count"] / steps})
    rows.sort(key=lambda r: -r["ms"])
    cats, parts = dict.fromkeys(CATEGORIES, 0.0), collections.defaultdict(lambda: dict.fromkeys(CATEGORIES, 0.0))
    for r in rows:
        cats[r["category"]] += r["ms"]
        parts[r["part"]][r["category"]] += r["ms"]
    busy_ms = busy(events) / 1e3 / steps
    span_ms = (max(e.ts + e.dur for e in events) - min(e.ts for e in events)) / 1e3 / steps if events else 0.0
    return {"device_ms": sum(cats.values()), "placed_ms": sum(events[i].dur for i in placed) / 1e3 / steps,
            "unnamed_ms": sum(r["ms"] for r in rows if r["op"] not in ops), "busy_ms": busy_ms, "span_ms": span_ms,
            "idle_fraction": 1 - busy_ms / step_ms, "events_per_step": len(events) / steps, "ops": rows,
            "categories": {c: {"ms": v, "pct": 100 * v / step_ms} for c, v in cats.items()},
            "parts": {p: {"ms": sum(v.values()), "pct": 100 * sum(v.values()) / step_ms, "by_category": v}
                      for p, v in sorted(parts.items(), key=lambda kv: -sum(kv[1].values()))}}


def analyze(out_dir: str, steps: int, traced_s: float) -> dict:
    """The tables from what `profile` left in out_dir: the newest trace and the program's HLO text."""
    with open(os.path.join(out_dir, HLO_FILE)) as f:
        text = f.read()
    path = newest_trace(out_dir)
    events, source = device_events(path, re.match(r"HloModule\s+([^\s,]+)", text).group(1))
    ops, computations = parse_hlo(text)
    return {"trace": path, "source": source["from"], "modules": {str(k): v for k, v in source["modules"].items()},
            "lines": source["lines"], **summarize(events, ops, computations, steps, traced_s)}


def profile(cfg, steps: int = 5, warmup: int = 2, out_dir: str | None = None) -> dict:
    """Build, warm up, time, trace and summarize the train step of `cfg` (see the module docstring); the result
    is also written to out_dir/profile.json."""
    import jax

    from jaxllm.errors import ConfigError
    from jaxllm.trainer.loop import flops_per_token, peak_flops

    for name, v, low in (("--steps", steps, 1), ("--warmup", warmup, 0)):
        if v < low:
            raise ConfigError(f"{name}: must be at least {low}, got {v}")
    out_dir = out_dir or tempfile.mkdtemp(prefix="jaxllm-profile-")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    step, state, tokens = build(cfg)
    compile_s = time.perf_counter() - t0
    with open(os.path.join(out_dir, HLO_FILE), "w") as f:
        f.write(step.as_text())
    if warmup:
        state, _ = run_steps(step, state, tokens, warmup)
    state, untraced_s = run_steps(step, state, tokens, steps)
    state, traced_s = capture(step, state, tokens, steps, out_dir)
    m, t, dev = cfg.model, cfg.train, jax.devices()[0]
    peak = peak_flops(cfg)
    result = {
        "config": {"family": m.family, "n_layers": m.n_layers, "d_model": m.d_model, "seq_len": m.seq_len,
                   "global_batch": t.global_batch, "compute": cfg.precision.compute,
                   "attention_impl": m.attention_impl, "remat": m.remat},
        "platform": dev.platform, "device_kind": dev.device_kind, "devices": jax.device_count(), "jax": jax.__version__,
        "steps": steps, "warmup": warmup, "compile_s": compile_s,
        "step_ms": untraced_s * 1e3, "traced_step_ms": traced_s * 1e3,
        "mfu": t.global_batch * m.seq_len * flops_per_token(cfg) / untraced_s / peak, "peak_flops": peak,
        **analyze(out_dir, steps, traced_s),
    }
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(result, f)
    return result


def format_table(r: dict, top: int = 15) -> str:
    c = r["config"]
    lines = [
        f"{c['family']} {c['n_layers']}L d{c['d_model']}, batch {c['global_batch']} x seq {c['seq_len']}, "
        f"{c['compute']}, attention {c['attention_impl']}; {r['devices']} {r['platform']} [{r['device_kind']}], "
        f"jax {r['jax']}",
        f"step {r['step_ms']:.1f} ms untraced (MFU {100 * r['mfu']:.1f}%), {r['traced_step_ms']:.1f} ms traced; "
        f"events from {r['source']}, {r['events_per_step']:.0f} per step: "
        + ", ".join(f"{k} {v}" for k, v in sorted(r["lines"].items(), key=lambda kv: -kv[1])[:4]),
    ]
    return "\n".join(lines) + "\n" + format_breakdown(r, top)


def format_breakdown(r: dict, top: int = 15) -> str:
    """The device time of `analyze`'s result by category, by part and by op, a step's."""
    lines = [
        f"device time {r['device_ms']:.1f} ms/step (sum of events), busy {r['busy_ms']:.1f} ms "
        f"(union), idle {100 * r['idle_fraction']:.1f}% of the traced step",
        "",
        f"{'category':<12} {'ms/step':>9} {'% step':>7}",
    ]
    lines += [f"{k:<12} {v['ms']:>9.2f} {v['pct']:>6.1f}%" for k, v in r["categories"].items() if v["ms"]]
    cats = [c for c, v in r["categories"].items() if v["ms"]]
    lines += ["", f"{'part':<16} {'ms/step':>9} {'% step':>7}  " + " ".join(f"{c:>11}" for c in cats)]
    lines += [f"{k:<16} {v['ms']:>9.2f} {v['pct']:>6.1f}%  " + " ".join(f"{v['by_category'][c]:>11.2f}" for c in cats)
              for k, v in r["parts"].items()]
    lines += ["", f"{'ms/step':>8} {'% step':>7} {'n':>4}  {'category':<11} {'part':<14} {'op':<28} kernel"]
    for o in r["ops"][:top]:
        kernel = o["kernel"] if o["kernel"] != o["op"] else ""
        more = f" (+{o['kernels'] - 1})" if o["kernels"] > 1 else ""
        kernel = kernel[:60] + ("…" if len(kernel) > 60 else "") + more
        lines.append(f"{o['ms']:>8.2f} {o['pct']:>6.1f}% {o['count']:>4.0f}  {o['category']:<11} {o['part']:<14} "
                     f"{o['op'][:28]:<28} {kernel}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = step_parser("python -m tools.bench.profile_step", __doc__.splitlines()[0], 5,
                         "steps timed, then steps traced")
    parser.add_argument("--top", type=int, default=15, help="ops in the table (default 15; --json has all)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where the trace goes (default: a new temp dir)")
    parser.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                        help="run nothing: read again the trace an earlier run left in DIR (its --out)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)

    from jaxllm.config import build_config, config_path
    from jaxllm.errors import UserError

    try:
        if args.from_dir:
            with open(os.path.join(args.from_dir, "profile.json")) as f:
                result = json.load(f)
            result.update(analyze(args.from_dir, result["steps"], result["traced_step_ms"] / 1e3))
        else:
            cfg = build_config(config_path(args.config), args.overrides)
            result = profile(cfg, steps=args.steps, warmup=args.warmup, out_dir=args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result, args.top), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
