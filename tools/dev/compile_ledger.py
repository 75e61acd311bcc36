"""Where a test session's compile time goes: every XLA compile, its program's fingerprint, the
test file that asked for it and its seconds, and the table of what was compiled more than once.

    JAXLLM_COMPILE_LEDGER=/tmp/ledger python -m pytest       # record (tests/conftest.py installs it)
    python -m tools.dev.compile_ledger /tmp/ledger [--top 20]  # the table, as Markdown

The fingerprint is the key of JAX's persistent compilation cache (`jax._src.cache_key.get`: the
canonical StableHLO, the compile options with the device assignment, XLA flags, jaxlib), so two
compiles with one fingerprint are one program that the cache could have served. Each process
appends one JSON line per compile to `<dir>/<pid>.jsonl`; the command lines the tests start record
too (`tests/harness.subprocess_env` puts `tools/dev/ledger_site` on their path), under the file of the
test that started them. A compile served without compiling (JAX's persistent cache, or an executable
the tests kept) is recorded as a hit. Tracing and lowering, which no cache saves, are totalled too.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path

ENV = "JAXLLM_COMPILE_LEDGER"
SITE = Path(__file__).resolve().parent / "ledger_site"  # its sitecustomize.py installs the hook
# A compile served without compiling: read back from JAX's persistent cache, or an executable the tests'
# harness kept (tests/harness.compile_each_program_once).
HIT_EVENTS = {"/jax/compilation_cache/cache_hits", "/jaxllm/tests/executable_reused"}
_STAGES = {"/jax/core/compile/jaxpr_trace_duration": "trace", "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}


# ---------------------------------------------------------------- recording


def _source() -> str:
    """The test file asking: pytest's current test (inherited by the command lines tests start)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.split("::")[0] if current else "(outside a test)"


def _mappings() -> int:
    """Memory mappings this process holds (Linux: at most vm.max_map_count; XLA:CPU maps each executable)."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _record(directory: Path, compile_or_get_cached):
    """A compile_or_get_cached that also writes one ledger line per call."""
    from jax import monitoring
    from jax._src import cache_key

    hits = threading.local()
    monitoring.register_event_listener(
        lambda event, **_: setattr(hits, "n", getattr(hits, "n", 0) + 1) if event in HIT_EVENTS else None)
    out = directory / f"{os.getpid()}.jsonl"

    last = {"file": None}

    def write(line: dict) -> None:
        lines = [{**line, "file": _source(), "at": time.time()}]
        if lines[0]["file"] != last["file"]:  # a new test file: how many mappings the last one left
            last["file"] = lines[0]["file"]
            lines.insert(0, {"stage": "maps", "held": _mappings(), "file": last["file"], "at": time.time()})
        with open(out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)

    def stage(event, seconds, **_):  # what the persistent cache cannot save: tracing and lowering
        if event in _STAGES:
            write({"stage": _STAGES[event], "seconds": round(seconds, 4)})

    monitoring.register_event_duration_secs_listener(stage)

    signature = inspect.signature(compile_or_get_cached)  # arguments by name: JAX versions add parameters

    @functools.wraps(compile_or_get_cached)
    def wrapped(*args, **kwargs):
        a = signature.bind(*args, **kwargs).arguments
        key = cache_key.get(a["computation"], a["devices"], a["compile_options"], a["backend"])
        before, start = getattr(hits, "n", 0), time.monotonic()
        executable = compile_or_get_cached(*args, **kwargs)
        write({"stage": "compile", "key": key, "seconds": round(time.monotonic() - start, 4),
               "devices": int(a["devices"].size), "hit": getattr(hits, "n", 0) > before})
        return executable

    return wrapped


def install(directory: str | os.PathLike) -> None:
    """Record every compile of this process into `directory` (JAX is imported here)."""
    from jax._src import compiler

    Path(directory).mkdir(parents=True, exist_ok=True)
    if not getattr(compiler.compile_or_get_cached, "_ledger", False):
        compiler.compile_or_get_cached = _record(Path(directory), compiler.compile_or_get_cached)
        compiler.compile_or_get_cached._ledger = True


# ---------------------------------------------------------------- the table


def read(directory: str | os.PathLike) -> list[dict]:
    """Every ledger line of `directory`, in the order the compiles finished."""
    lines = [{**json.loads(s), "pid": p.stem} for p in sorted(Path(directory).glob("*.jsonl")) for s in open(p)
             if s.strip()]
    return sorted(lines, key=lambda r: r["at"])


def summarise(lines: list[dict]) -> dict:
    """Compile seconds in all, and split by whether the program had been compiled before: by another
    file, or by the same file. Per program: its compiles, files and repeated seconds."""
    programs = collections.defaultdict(lambda: {"compiles": 0, "seconds": 0.0, "repeated": 0.0, "files": []})
    first_file_seconds = {}
    totals = collections.Counter()
    held = collections.defaultdict(list)  # pid -> mappings at each file boundary
    for r in lines:
        if r["stage"] == "maps":
            held[r["pid"]].append(r["held"])
            continue
        if r["stage"] != "compile":
            totals[r["stage"]] += r["seconds"]
            continue
        if r["hit"]:
            totals["hits"] += 1
            totals["hit_seconds"] += r["seconds"]
            continue
        p = programs[r["key"]]
        totals["compiles"] += 1
        totals["seconds"] += r["seconds"]
        if p["compiles"]:
            kind = "same_file" if r["file"] in p["files"] else "other_file"
            totals[kind] += r["seconds"]
            p["repeated"] += r["seconds"]
        else:
            first_file_seconds[r["key"]] = r["seconds"]
        p["compiles"] += 1
        p["seconds"] += r["seconds"]
        if r["file"] not in p["files"]:
            p["files"].append(r["file"])
        p["devices"] = r["devices"]
    totals["programs"] = len(programs)
    totals["maps_peak"] = max((max(h) for h in held.values()), default=0)
    totals["maps_growth"] = max((b - a for h in held.values() for a, b in zip(h, h[1:])), default=0)
    return {"totals": dict(totals), "programs": dict(programs)}


def table(summary: dict, top: int = 20) -> str:
    t = summary["totals"]
    seconds = t.get("seconds", 0.0) or 1e-9
    rows = [
        "| | compiles | seconds | share |",
        "|---|---:|---:|---:|",
        f"| all compiles | {t.get('compiles', 0)} | {t.get('seconds', 0):.0f} | 100% |",
        f"| distinct programs (first compile) | {t.get('programs', 0)} | "
        f"{seconds - t.get('other_file', 0) - t.get('same_file', 0):.0f} | "
        f"{1 - (t.get('other_file', 0) + t.get('same_file', 0)) / seconds:.1%} |",
        f"| again, compiled before by another file | | {t.get('other_file', 0):.0f} | "
        f"{t.get('other_file', 0) / seconds:.1%} |",
        f"| again, compiled before by the same file | | {t.get('same_file', 0):.0f} | "
        f"{t.get('same_file', 0) / seconds:.1%} |",
        f"| served without compiling (cache hits) | {t.get('hits', 0)} | {t.get('hit_seconds', 0):.0f} | |",
        "",
        f"Besides compiling: tracing {t.get('trace', 0):.0f} s, lowering to StableHLO {t.get('lower', 0):.0f} s.",
        f"Memory mappings held by one process at a test file's start: at most {t.get('maps_peak', 0):,}; "
        f"the most one file added: {t.get('maps_growth', 0):,}.",
        "",
        f"The {top} programs with the most repeated compile seconds:",
        "",
        "| program | devices | compiles | seconds each | repeated seconds | files |",
        "|---|---:|---:|---:|---:|---|",
    ]
    worst = sorted(summary["programs"].items(), key=lambda kv: -kv[1]["repeated"])[:top]
    for key, p in worst:
        if p["repeated"] <= 0:
            break
        name, _, digest = key.rpartition("-")
        files = ", ".join(Path(f).stem.removeprefix("test_") for f in p["files"])
        rows.append(f"| `{name}` ({digest[:8]}) | {p['devices']} | {p['compiles']} | "
                    f"{p['seconds'] / p['compiles']:.2f} | {p['repeated']:.1f} | {files} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.dev.compile_ledger", description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", help="the folder a session recorded into (JAXLLM_COMPILE_LEDGER)")
    ap.add_argument("--top", type=int, default=20, help="how many programs to list by repeated cost")
    args = ap.parse_args(argv)
    lines = read(args.directory)
    if not lines:
        print(f"error: no ledger lines in {args.directory}: run the tests with {ENV}={args.directory} first",
              file=sys.stderr)
        return 2
    print(table(summarise(lines), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
