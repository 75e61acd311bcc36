"""What an issue's tests add to the suite's time: the budget each issue states ("≤ +120 s to the whole suite,
≤ +10 s to the fast tier"), measured.

    python -m tools.dev.test_budget 65 66 67          # both tiers of each issue's tests
    python -m tools.dev.test_budget 67 --tier fast

The suite keeps every core busy (docs/tests.md), so what a set of tests adds to its wall time is the CPU
time they take divided by the cores. Each issue's tests run in one pytest process (`-n 0`) and the CPU
seconds of that process and its children are taken, less those of the same command with no test selected
(the interpreter, JAX and the test modules imported: the suite's workers pay them once each anyway), and
divided by the cores the suite's workers share (`--cores`, this machine's by default). What a test imports
itself (torch, transformers) is counted: an over-estimate where another file on the worker imported it first.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

# The tests each issue brought (its own files, and its cases in the files that test every family).
ISSUES = {
    "65": ["tests/test_smollm2.py", "tests/test_gemma3_270m.py", "tests/test_gguf.py"],
    "66": ["tests/test_gpt_oss.py", "tests/test_llama4.py", "tests/test_llama4_attention.py",
           "tests/test_attention_sinks.py",
           "tests/test_hf_interop.py::test_import_equals_transformers_and_export_round_trips[gpt_oss]",
           "tests/test_hf_interop.py::test_import_equals_transformers_and_export_round_trips[llama4]",
           "tests/test_generate_hf.py::test_greedy_generation_equals_transformers[gpt_oss]",
           "tests/test_generate_hf.py::test_greedy_generation_equals_transformers[llama4]"],
    "67": ["tests/test_gated_delta.py", "tests/test_gated_deltanet.py", "tests/test_gated_delta_context.py",
           "tests/test_qwen3_next.py", "tests/test_linear_stack.py", "tests/test_gated_attention.py",
           "tests/test_hf_interop.py::test_import_equals_transformers_and_export_round_trips[qwen3_next]",
           "tests/test_generate_hf.py::test_greedy_generation_equals_transformers[qwen3_next]",
           "tests/test_bench.py::test_linear_attention_bench_runs_and_skips_what_does_not_fit"],
}
TIERS = {"all": [], "fast": ["-m", "not slow"]}
_PYTEST = ["-q", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider"]


def cpu_seconds(args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one pytest process over `args`."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", *_PYTEST, *args], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime), time.monotonic() - start


def added_seconds(tests: list[str], tier: str, cores: int) -> dict:
    """The tier's CPU seconds over `tests`, the start-up's, and the wall seconds they add on `cores` cores."""
    cpu, wall = cpu_seconds([*tests, *TIERS[tier]])
    files = sorted({t.split("::")[0] for t in tests})
    start_up, _ = cpu_seconds([*files, "-k", "no test has this name"])
    return {"cpu": cpu, "wall_one_process": wall, "start_up": start_up, "added": (cpu - start_up) / cores}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("issues", nargs="+", choices=sorted(ISSUES))
    p.add_argument("--tier", choices=[*TIERS, "both"], default="both")
    p.add_argument("--cores", type=int, default=os.cpu_count())
    a = p.parse_args(argv)
    print("| issue | tier | CPU s | start-up CPU s | one process, wall s | added to the suite, s |")
    print("|---|---|---:|---:|---:|---:|")
    for issue in a.issues:
        for tier in TIERS if a.tier == "both" else [a.tier]:
            r = added_seconds(ISSUES[issue], tier, a.cores)
            print(f"| {issue} | {tier} | {r['cpu']:.0f} | {r['start_up']:.0f} | {r['wall_one_process']:.0f} | "
                  f"{r['added']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
