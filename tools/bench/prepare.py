"""`jaxllm prepare-data` measured: workers' speed-up, peak memory on a big corpus, a kill and a rerun.

    python -m tools.bench.prepare [--speed-mb 40] [--big-gb 2] [--kill-mb 60] [--only speed,memory,kill]

- speed: a generated JSONL corpus tokenized by the LLaMA-3-style BPE fixture (tests/fixtures/hf_tokenizer, one
  tokenizer thread per worker) with 1 and with 2 workers; the median of 3 runs each, and their ratio.
- memory: a generated corpus of --big-gb GB (JSONL, byte tokenizer, 2 workers); the peak resident memory of
  the whole process tree (the command and its workers, summed, sampled every 50 ms from /proc: Linux only).
- kill: SIGKILL part-way through, run again, compare every output file's bytes with an uninterrupted run.

Each run is the real command in a subprocess. Prints one line per measurement (the numbers BENCHMARKS.md
records, with the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = f"hf:{REPO / 'tests' / 'fixtures' / 'hf_tokenizer'}"
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will more can out def return "
         "import class self data model train loss step value").split()


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    """A JSONL corpus of about `megabytes` MB: documents of 20-2,000 random words, written in 8 MB pieces."""
    rng = np.random.default_rng(seed)
    target, written = int(megabytes * 2**20), 0
    with open(path, "w") as f:
        while written < target:
            lengths = rng.integers(20, 2000, size=2000)
            words = np.asarray(WORDS)[rng.integers(0, len(WORDS), size=int(lengths.sum()))]
            cuts = np.cumsum(lengths)[:-1]
            piece = "".join(json.dumps({"text": " ".join(doc)}) + "\n" for doc in np.split(words, cuts))
            f.write(piece)
            written += len(piece)
    return path


def command(source: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "jaxllm", "prepare-data", str(source), str(out), "--quiet", *args]


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def run(cmd: list[str], sample_rss: bool = False) -> tuple[float, int]:
    """(seconds, peak resident bytes of the process tree, 0 unless sampled)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    if sample_rss:
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)
    _, err = proc.communicate()
    if proc.returncode:
        sys.exit(f"prepare-data failed: {err.strip()}")
    return time.perf_counter() - t0, peak


def speed(work: Path, megabytes: float) -> None:
    source = make_corpus(work / "speed.jsonl", megabytes)
    times = {}
    for workers in (1, 2):
        times[workers] = []
        for i in range(3):
            out = work / f"speed_{workers}_{i}"
            times[workers].append(run(command(source, out, "--tokenizer", TOKENIZER, "--workers", str(workers),
                                              "--unit-bytes", str(2 << 20)))[0])
            shutil.rmtree(out)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"speed: {megabytes:g} MB JSONL, BPE fixture: 1 worker {one:.1f} s, 2 workers {two:.1f} s "
          f"(medians of 3: {times}) -> {one / two:.2f}x")


def memory(work: Path, gigabytes: float) -> None:
    source = make_corpus(work / "big.jsonl", gigabytes * 1024)
    seconds, peak = run(command(source, work / "big_out", "--workers", "2"), sample_rss=True)
    tokens = json.loads((work / "big_out" / "prepare.json").read_text())
    print(f"memory: {source.stat().st_size / 2**30:.2f} GiB JSONL, byte tokenizer, 2 workers: peak RSS of the "
          f"process tree {peak / 2**20:,.0f} MiB, {seconds:.0f} s, {tokens['train']['tokens']:,} train tokens")
    shutil.rmtree(work / "big_out")
    source.unlink()


def kill(work: Path, megabytes: float) -> None:
    source = make_corpus(work / "kill.jsonl", megabytes, seed=1)
    args = ("--workers", "2", "--unit-bytes", str(1 << 20), "--shard-tokens", str(10_000_000))
    run(command(source, work / "whole", *args))
    proc = subprocess.Popen(command(source, work / "cut", *args), cwd=REPO, stderr=subprocess.DEVNULL)
    parts = work / ".cut.partial"
    n_units = None
    while proc.poll() is None:
        done = len(list(parts.glob("part_*.npz")))
        if done >= 10:
            n_units = done
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # the workers see their parent gone and exit
    run(command(source, work / "cut", *args))
    same = sorted(os.listdir(work / "whole")) == sorted(os.listdir(work / "cut")) and all(
        (work / "whole" / n).read_bytes() == (work / "cut" / n).read_bytes() for n in os.listdir(work / "whole"))
    print(f"kill: SIGKILL after {n_units} parts of a {megabytes:g} MB corpus, then a rerun: output "
          f"{'identical to' if same else 'DIFFERENT from'} an uninterrupted run's "
          f"({len(os.listdir(work / 'whole'))} files)")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--speed-mb", type=float, default=40)
    p.add_argument("--big-gb", type=float, default=2)
    p.add_argument("--kill-mb", type=float, default=60)
    p.add_argument("--only", default="speed,memory,kill")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            {"speed": lambda: speed(Path(tmp), args.speed_mb), "memory": lambda: memory(Path(tmp), args.big_gb),
             "kill": lambda: kill(Path(tmp), args.kill_mb)}[name]()


if __name__ == "__main__":
    main()
