"""The compiled-program readers: collectives, memory and matmuls of one compiled step, from XLA's output.

The planner compiles a train step and needs two numbers per layout: how much
memory a device holds and how much it communicates per step. Both come from the
compiled executable: `compiled.memory_analysis()` for memory and the optimized
HLO text (`compiled.as_text()`) for collectives. The HLO is the only place where
the partitioner's real choices show (e.g. all-reduce + slice instead of
reduce-scatter on CPU), so we parse it rather than guess from shardings.

Counting is per *executed* op: a collective inside a `while` body (layer scan,
gradient-accumulation loop, fori_loop) is counted once per trip. This JAX/XLA
version annotates loops whose trip count it can prove with
`backend_config={..."known_trip_count":{"n":"N"}...}` on the `while`
instruction (verified for `lax.scan(length=N)` and `lax.fori_loop(0, N, ...)`);
a data-dependent `lax.while_loop` has no such annotation and is counted as one
trip, reported in `collective_report(...)["unknown_trip_loops"]`.

Besides the collectives: the element types a program's collective-permutes move (`permute_dtypes`),
its matmuls by runner and operand types (`matmul_operands`), a compiled executable's memory
(`memory_summary`) and `format_bytes`. This module imports no JAX; tests and tools read compiled
programs with it too.
"""

from __future__ import annotations

import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bits per element; XLA's sub-byte types (s4, f4e2m1fn, ...) pack, so round up per array.
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
         "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "f32": 32, "s32": 32, "u32": 32,
         "f64": 64, "s64": 64, "u64": 64, "c64": 64, "c128": 128}

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _array_bytes(type_str: str) -> int:
    """Bytes of every array in an HLO type string (`f32[16,16]{1,0}`, tuples, ...)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_str):
        bits = _BITS.get(dtype)
        if bits is None:  # f8e4m3fn, f6e2m3fn, f4e2m1fn, ...; token[]/opaque carry no payload
            bits = int(dtype[1]) if re.fullmatch(r"f[468]e\w+", dtype) else 0
        n = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        total += -(-n * bits // 8)
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """Split `TYPE opcode(...)...` at the first space outside brackets."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch.isspace() and depth == 0:
            return rest[:i], rest[i:].lstrip()
    return rest, ""


def _tuple_elements(type_str: str) -> list[str]:
    """Top-level elements of a tuple type; a non-tuple type is one element."""
    s = type_str.strip()
    if not s.startswith("("):
        return [s]
    s = re.sub(r"/\*.*?\*/", "", s)
    inner, elems, depth, start = s[1:s.rindex(")")], [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            elems.append(inner[start:i].strip())
            start = i + 1
    elems.append(inner[start:].strip())
    return [e for e in elems if e]


def _is_context_scalar(t: str) -> bool:
    return re.fullmatch(r"[us]32\[\](\{\})?", t.strip()) is not None


def _start_bytes(opcode: str, type_str: str) -> int:
    """Result bytes of an async `<kind>-start`.

    Rule: `all-reduce-start`'s result is already the output (one array, or a
    tuple of outputs when combined), so count all of it. Any other `-start` with
    a tuple result is laid out (operand(s), output(s), context...), e.g.
    `(f32[8], f32[64]) all-gather-start` or
    `(f32[16], f32[16], u32[], u32[]) collective-permute-start`: count element 1,
    the output (itself a tuple for combined ops). `u32[]`/`s32[]` context
    scalars are never counted. A non-tuple result is counted as is.
    """
    elems = [e for e in _tuple_elements(type_str) if not _is_context_scalar(e)]
    if opcode == "all-reduce-start" or len(elems) < 2:
        return sum(_array_bytes(e) for e in elems)
    return _array_bytes(elems[1])


def _parse(hlo_text: str) -> tuple[dict[str, list[dict]], str]:
    """Computations of an HLO module as {name: [instruction, ...]} plus the ENTRY name.

    Each instruction is {"name", "type", "opcode", "attrs", "trip"}; `attrs` has quoted
    strings (metadata, backend_config) removed so names inside them never look
    like references (a custom call keeps them in "raw" too). Expects one instruction
    per line, as `as_text()` prints.
    """
    comps: dict[str, list[dict]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMP_HEADER.match(line.strip())
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        type_str, rest = _split_type(m.group(2))
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        trip = _TRIP.search(rest)
        ins = {"name": m.group(1), "type": type_str, "opcode": op.group(1),
               "attrs": _QUOTED.sub('""', rest[op.end():]), "trip": int(trip.group(1)) if trip else None}
        if ins["opcode"] == "custom-call":  # its target and backend config say what the library call computes
            ins["raw"] = rest[op.end():]
        comps[current].append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation found in HLO text")
    return comps, entry


def computations(hlo_text: str) -> tuple[dict[str, list[dict]], str]:
    """The parsed module: {computation name: [instruction, ...]} and the ENTRY name (see `_parse`)."""
    return _parse(hlo_text)


def _refs(attrs: str, key: str) -> list[str]:
    """Computation names referenced by `key=%c` or `key={%a, %b}`."""
    m = re.search(r"\b" + key + r"=(\{[^}]*\}|%?[\w.\-]+)", attrs)
    if not m:
        return []
    return [n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", m.group(1))]


def _summary(ops: list[dict], unknown: int = 0) -> dict:
    out = {"collectives": {k: {"count": 0, "bytes": 0} for k in KINDS}, "unknown_trip_loops": unknown}
    for o in ops:
        out["collectives"][o["kind"]]["count"] += o["times"]
        out["collectives"][o["kind"]]["bytes"] += o["times"] * o["bytes"]
    return out


_GROUPS = re.compile(r"replica_groups=(\{[{}\d,]*\}|\[[^\]]*\]<=\[[^\]]*\][^,\s]*|mesh\[[^\]]*\](?:, device_ids=\S+)? \{[^}]*\})")


def _collective(ins: dict) -> dict | None:
    """A collective instruction (or the `-start` of an async one) as one run of `executed_collectives`."""
    op = ins["opcode"]
    kind = op if op in KINDS else op[:-6] if op.endswith("-start") and op[:-6] in KINDS else None
    if kind is None:
        return None
    groups = _GROUPS.search(ins["attrs"])
    return {"kind": kind, "type": ins["type"], "times": 1, "groups": groups.group(1) if groups else "",
            "bytes": _array_bytes(ins["type"]) if kind == op else _start_bytes(op, ins["type"])}


def executed_collectives(hlo_text: str) -> tuple[list[dict], int]:
    """Every collective reached from ENTRY, as {"kind", "type", "bytes" (one run), "groups" (its
    replica_groups text), "times" (runs per step)}, and the number of loops of unknown trip count.

    The walk (`_executed`) follows `calls=` (fusion, call, async-start; not async-update/-done, which name the
    same computation), `to_apply=` of `call` only (elsewhere it is a reducer), `body=` (x trips),
    `condition=` (x trips + 1: it runs once more than the body), and `branch_computations=`/
    `true_computation=`/`false_computation=` of a `conditional`, where only the branch with the most
    collective bytes is counted (ties: most ops) since exactly one branch runs per execution: an upper
    bound. A `while` without `known_trip_count` counts as one trip and adds 1 to the unknown loops (per
    loop instruction reached, not multiplied by enclosing trips).
    """
    weight = lambda ops: (sum(o["bytes"] * o["times"] for o in ops), sum(o["times"] for o in ops))
    comps, entry = _parse(hlo_text)
    return _executed(comps, entry, lambda ins: _collective(ins), weight)


def _executed(comps: dict, entry: str, pick, weight) -> tuple[list[dict], int]:
    """The instructions `pick` turns into records (with "times": 1), reached from ENTRY, each with the times it
    runs per step (see `executed_collectives`); of a conditional's branches, the one `weight` ranks highest."""
    memo: dict[str, tuple[list[dict], int]] = {}
    times = lambda ops, n: [{**o, "times": o["times"] * n} for o in ops]

    def visit(name: str, stack: tuple = ()) -> tuple[list[dict], int]:
        if name in memo:
            return memo[name]
        if name in stack or name not in comps:
            return [], 0
        stack += (name,)
        ops, unknown = [], 0
        for ins in comps[name]:
            op, attrs = ins["opcode"], ins["attrs"]
            if (record := pick(ins)) is not None:
                ops.append(record)
            if op == "while":
                trips = ins["trip"]
                unknown += trips is None
                trips = 1 if trips is None else trips
                for c, extra in [(c, 0) for c in _refs(attrs, "body")] + [(c, 1) for c in _refs(attrs, "condition")]:
                    part, u = visit(c, stack)
                    ops, unknown = ops + times(part, trips + extra), unknown + u
            elif op == "conditional":
                branches = (_refs(attrs, "branch_computations") + _refs(attrs, "true_computation")
                            + _refs(attrs, "false_computation"))
                parts = [visit(c, stack) for c in branches]
                if parts:
                    part, u = max(parts, key=lambda p: weight(p[0]))
                    ops, unknown = ops + part, unknown + u
            elif op not in ("async-update", "async-done"):
                called = _refs(attrs, "calls") + _refs(attrs, "called_computations")
                if op == "call":
                    called += _refs(attrs, "to_apply")
                for c in called:
                    part, u = visit(c, stack)
                    ops, unknown = ops + part, unknown + u
        memo[name] = ops, unknown
        return memo[name]

    return visit(entry)


def _dims(type_str: str) -> list[int]:
    """The dimensions of an HLO array type (its first array, for a tuple)."""
    m = _ARRAY.search(type_str)
    return [int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip()] if m else []


_GEMM_CALL = re.compile(r"__cublas\$")  # __cublas$gemm, __cublas$lt$matmul, __cublas$lt$matmul$f8
_FMHA_CALL = re.compile(r"__cudnn\$fmha")  # cuDNN's fused attention, forward and backward
_KERNEL_CALL = re.compile(r"triton|tpu_custom_call|mosaic", re.I)  # a Pallas kernel: its FLOPs are not stated
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_LAYOUTS = re.compile(r"operand_layout_constraints=\{(.*?)\}\s*,\s*\w+=")


def _operands(ins: dict) -> list[str]:
    """The names an instruction reads, in order."""
    return re.findall(r"%([\w.\-]+)", ins["attrs"].split(")")[0])


def _dot_flops(ins: dict, shape_of: dict) -> int:
    """2 × the output's elements × the contracted elements per output, of a `dot` or a cuBLAS call."""
    raw = ins.get("raw", ins["attrs"])
    contracting = _CONTRACTING.search(raw) or re.search(r"lhs_contracting_dims=\{([\d,]*)\}", raw)
    dims = _dims(shape_of.get(_operands(ins)[0], ""))
    axes = [int(i.strip('" ')) for i in contracting.group(1).split(",") if i.strip('" ')] if contracting else []
    k = math.prod(dims[i] for i in axes)
    return 2 * math.prod(_dims(_tuple_elements(ins["type"])[0])) * k


def _fmha_flops(ins: dict) -> int:
    """cuDNN's fused attention from its q, k, v as laid out [b, s, heads, d]: the forward's two matmuls
    (Q·Kᵀ, P·V), the backward's five (Q·Kᵀ again, dP, dV, dQ, dK); half of each under a causal mask, whose blocks
    above the diagonal the kernel skips."""
    q, k, v = [_dims(t.group(0)) for t in _ARRAY.finditer(_LAYOUTS.search(ins["raw"]).group(1))][:3]
    pairs = q[0] * q[2] * q[1] * k[1]  # b · heads · query rows · key rows
    scores, values = 2 * pairs * q[3], 2 * pairs * v[3]
    flops = 3 * scores + 2 * values if "Backward" in _CALL_TARGET.search(ins["raw"]).group(1) else scores + values
    return flops // 2 if re.search(r'"mask_type"\s*:\s*"(PADDING_)?CAUSAL"', ins["raw"]) else flops


def executed_matmul_flops(hlo_text: str) -> tuple[int, int, int]:
    """(FLOPs of the matmuls executed per step, loops of unknown trip count, custom calls not counted): `dot`s,
    the cuBLAS calls XLA:GPU rewrites them into and cuDNN's fused attention (`_fmha_flops`), 2 × the output's
    elements × the contracted elements per output, times the runs per step (`_executed`: loop bodies by their
    trip counts, a conditional's costliest branch). Elementwise work is not counted, nor what a kernel whose
    FLOPs its call does not state computes (a Pallas kernel's Triton or Mosaic call): those are counted apart."""
    comps, entry = _parse(hlo_text)
    shape_of = {ins["name"]: ins["type"] for body in comps.values() for ins in body}  # parameters are instructions

    def matmul(ins):
        if ins["opcode"] == "dot":
            return {"flops": _dot_flops(ins, shape_of), "uncounted": 0, "times": 1}
        if ins["opcode"] != "custom-call":
            return None
        target = _CALL_TARGET.search(ins["raw"]).group(1)
        if _GEMM_CALL.match(target):
            return {"flops": _dot_flops(ins, shape_of), "uncounted": 0, "times": 1}
        if _FMHA_CALL.match(target):
            return {"flops": _fmha_flops(ins), "uncounted": 0, "times": 1}
        return {"flops": 0, "uncounted": 1, "times": 1} if _KERNEL_CALL.search(target) else None

    ops, unknown = _executed(comps, entry, matmul, lambda p: sum(o["flops"] * o["times"] for o in p))
    return sum(o["flops"] * o["times"] for o in ops), unknown, sum(o["uncounted"] for o in ops)


_NO_TRAFFIC = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "iota"}


def _sliced_reads(fused: list[dict]) -> dict[int, int]:
    """{parameter number: bytes read} of a fused computation's parameters that only `dynamic-slice`s read (a
    layer's slice of a stacked array) or that a `dynamic-update-slice` root updates in place (nothing read)."""
    params = {ins["name"]: int(re.match(r"\s*(\d+)", ins["attrs"]).group(1)) for ins in fused
              if ins["opcode"] == "parameter"}
    users: dict[str, list[dict]] = {name: [] for name in params}
    for ins in fused:
        for o in _operands(ins):
            if o in users:
                users[o].append(ins)
    out = {}
    for name, number in params.items():
        uses = users[name]
        if uses and all(u["opcode"] == "dynamic-slice" and _operands(u)[0] == name for u in uses):
            out[number] = sum(_array_bytes(u["type"]) for u in uses)
        elif len(uses) == 1 and uses[0]["opcode"] == "dynamic-update-slice" and _operands(uses[0])[0] == name:
            out[number] = 0
    return out


def _written(ins: dict, called: list[dict] | None, type_of: dict) -> int:
    """Bytes an instruction writes: an in-place `dynamic-update-slice` (or a fusion rooted in one) its update
    alone; an async start its output (element 1); a library call its results less its byte-typed scratch."""
    root = called[-1] if called else ins
    if root["opcode"] == "dynamic-update-slice":
        update = _operands(root)[1]
        return _array_bytes(type_of.get(update, ""))
    if ins["opcode"].endswith("-start"):
        return _start_bytes(ins["opcode"], ins["type"])
    if ins["opcode"] == "custom-call":
        return sum(_array_bytes(e) for e in _tuple_elements(ins["type"]) if not re.match(r"[su]8\[", e))
    return _array_bytes(ins["type"])


def executed_bytes(hlo_text: str) -> int:
    """Bytes the executed top-level operations read and write per step (each fusion, dot, copy, collective...:
    its operands and its result, once per run; what a fusion does inside stays in registers and caches), the
    roofline's memory traffic. A stacked array that a fusion only slices counts the slice; a buffer updated in
    place, the update (`_sliced_reads`, `_written`); an async pair once, at its start. Loop bodies by their trip
    counts; a conditional's costliest branch."""
    comps, entry = _parse(hlo_text)
    type_of = {ins["name"]: ins["type"] for body in comps.values() for ins in body}
    fused = {c for body in comps.values() for ins in body if ins["opcode"] in ("fusion", "fusion-start")
             for c in _refs(ins["attrs"], "calls")}
    top = {name: body for name, body in comps.items() if name not in fused}

    def traffic(ins):
        op = ins["opcode"]
        if op in _NO_TRAFFIC or op.endswith(("-done", "-update")):
            return None
        called = next((comps.get(c) for c in _refs(ins["attrs"], "calls") if c in fused), None)
        reads = _sliced_reads(called) if called else {}
        if op == "dynamic-update-slice":  # in place: the buffer is not read
            reads = {0: 0}
        elif op == "dynamic-slice":
            reads = {0: _array_bytes(ins["type"])}
        operands = _operands(ins)
        read = sum(reads.get(i, _array_bytes(type_of.get(o, ""))) for i, o in enumerate(operands))
        return {"bytes": read + _written(ins, called, type_of), "times": 1}

    ops, _ = _executed(top, entry, traffic, lambda p: sum(o["bytes"] * o["times"] for o in p))
    return sum(o["bytes"] * o["times"] for o in ops)


def dtype_of(op: dict) -> str:
    """The element type of a collective from `executed_collectives` (of its first array, for a tuple)."""
    return op["type"].lstrip("(").split("[")[0]


def bytes_by_kind_and_dtype(ops: list[dict]) -> dict[tuple[str, str], int]:
    """{(kind, element type): bytes per step} of collectives from `executed_collectives`."""
    out: dict[tuple[str, str], int] = {}
    for o in ops:
        key = (o["kind"], dtype_of(o))
        out[key] = out.get(key, 0) + o["bytes"] * o["times"]
    return out


def collective_report(hlo_text: str) -> dict:
    """Collectives executed per step per device, plus loops whose trip count is unknown:
    {"collectives": {kind: {"count", "bytes"}}, "unknown_trip_loops": n} (see `executed_collectives`).
    `bytes` is the op's result size on one device (summed over tuple elements of variadic ops; see
    `_start_bytes` for async `-start` ops; `-done` ops are not counted)."""
    return _summary(*executed_collectives(hlo_text))


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def permute_bytes_by_device(hlo_text: str, n_devices: int) -> list[int]:
    """Bytes each device sends through the `collective-permute`s of a straight-line program (no loops: the
    hand-built algorithms of `jaxllm/parallel/allreduce.py` unroll theirs). An SPMD permute has one shape on
    every device, but only the sources of its `source_target_pairs` send it: a device in no pair is not
    charged."""
    comps, _ = _parse(hlo_text)
    sent = [0] * n_devices
    for ins in (i for body in comps.values() for i in body):
        op = ins["opcode"]
        if op not in ("collective-permute", "collective-permute-start"):
            continue
        size = _array_bytes(ins["type"]) if op == "collective-permute" else _start_bytes(op, ins["type"])
        pairs = _PAIRS.search(ins["attrs"])
        for src, _ in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1) if pairs else ""):
            sent[int(src)] += size
    return sent


def group_size(groups: str, n_devices: int) -> int:
    """Devices in each replica group of a collective's `replica_groups` text: `{{0,1},{2,3}}`, the iota form
    `[groups,size]<=[...]`, the named form `mesh['axis_0'=2,...][, device_ids=(...)] {'axis_0'}` (the named axes'
    sizes multiplied), or none (every device in one group)."""
    if not groups:
        return n_devices
    if groups.startswith("mesh["):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", groups[:groups.index("]")]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", groups[groups.rindex("{"):]))
    if groups.startswith("["):
        return int(groups[1:groups.index("]")].split(",")[-1])
    return len(re.match(r"\{\{([\d,]*)\}", groups).group(1).split(","))


def all_gather_received_bytes(hlo_text: str, n_devices: int) -> int:
    """Bytes one device receives through the program's all-gathers: of each, its result less its own part."""
    ops, _ = executed_collectives(hlo_text)
    return sum(o["times"] * o["bytes"] * (1 - 1 / group_size(o["groups"], n_devices))
               for o in ops if o["kind"] == "all-gather")


def collectives_per_step(hlo_text: str) -> dict[str, dict]:
    """{kind: {"count", "bytes"}} for all five kinds; see `collective_report`."""
    return collective_report(hlo_text)["collectives"]


_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


def permute_dtypes(hlo_text: str, elements: int) -> list[str]:
    """Element types (as numpy names) of the compiled collective-permutes that move `elements` values."""
    comps, _ = computations(hlo_text)
    found = set()
    for ins in (i for instrs in comps.values() for i in instrs):
        if ins["opcode"] in ("collective-permute", "collective-permute-start"):
            for dtype, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", ins["type"]):
                if math.prod(int(x) for x in dims.split(",") if x) == elements:
                    found.add(_HLO_DTYPES.get(dtype, dtype))
    return sorted(found)


_MATMUL_LINE = re.compile(r"\s(dot|custom-call)\(([^)]*)\)")
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z]\w*)\[")


def matmul_operands(hlo_text: str) -> dict[str, int]:
    """The compiled program's matmuls counted by what runs them and their two operands' element types, e.g.
    {"dot bf16×bf16": 6, "__cublas$lt$matmul$f8 f8e4m3fn×f8e4m3fn": 18}: `dot`s and the cuBLAS calls
    (custom calls whose target names a gemm or matmul) that XLA rewrote them into. This is how one reads
    whether `precision.matmul = "fp8"` reached an fp8 GEMM or was widened back (XLA:CPU widens every one).
    Instructions are counted as written, a loop body once; operands are looked up by name, since
    `as_text()` prints them without their types."""
    lines = hlo_text.splitlines()
    element = {m.group(1): m.group(2) for m in map(_DEFINED.match, lines) if m}
    found: dict[str, int] = {}
    for line in lines:
        m = _MATMUL_LINE.search(line)
        if not m:
            continue
        runner = m.group(1)
        if runner == "custom-call":
            target = _CALL_TARGET.search(line)
            if not target or not re.search(r"gemm|matmul", target.group(1), re.I):
                continue
            runner = target.group(1)
        names = re.findall(r"%?([\w.\-]+)\s*(?:,|$)", m.group(2).strip())[:2]
        key = f"{runner} {'×'.join(element.get(n, '?') for n in names)}"
        found[key] = found.get(key, 0) + 1
    return dict(sorted(found.items()))


def memory_summary(compiled) -> dict:
    """Per-device memory of a compiled executable, from `memory_analysis()`.

    `total_bytes = argument + output - alias + temp` estimates what a device must
    hold (donated/aliased outputs reuse argument buffers). We do not report
    `peak_memory_in_bytes`: on the CPU backend it just equals the argument size.
    """
    ma = compiled.memory_analysis()
    out = {"argument_bytes": int(ma.argument_size_in_bytes),
           "output_bytes": int(ma.output_size_in_bytes),
           "alias_bytes": int(ma.alias_size_in_bytes),
           "temp_bytes": int(ma.temp_size_in_bytes),
           "generated_code_bytes": int(ma.generated_code_size_in_bytes)}
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"]
                          - out["alias_bytes"] + out["temp_bytes"])
    return out


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. 1572864 -> '1.50 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
