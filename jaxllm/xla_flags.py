"""XLA's GPU flags the anchors set (MaxText, NVIDIA's JAX-Toolbox), added at start-up on a GPU machine.

`add_gpu_defaults` appends each of `GPU_DEFAULTS` to the environment's `XLA_FLAGS` unless `XLA_FLAGS` already
names it (the user's value wins), and only where a CUDA plugin for jaxlib is installed: on CPU nothing changes.
It runs when `jaxllm` is imported, before JAX starts a backend (XLA reads `XLA_FLAGS` once, then). Imports no JAX.

What each flag does and its measured effect: docs/performance.md ("XLA's GPU flags").
"""

from __future__ import annotations

import importlib.util
import os

GPU_DEFAULTS = {
    # overlap collectives with computation: the scheduler moves async collectives' starts and ends apart
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # combine small collectives into one up to this many bytes (XLA's defaults are far smaller on GPU)
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * 2**20),
    # start a scanned layer's collectives in the previous iteration (ZeRO-3's gathers, its reduce-scatters)
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # move a reduce-scatter whose result a loop only accumulates out of the loop, once after it (XLA does so for
    # all-reduces by default): the chunked loss's head-weight gradient under ZeRO-2/3
    "xla_gpu_enable_while_loop_reduce_scatter_code_motion": "true",
    # unroll the layer scan by two so one iteration's collectives can overlap the other's computation
    "xla_gpu_enable_while_loop_double_buffering": "true",
}
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def with_gpu_defaults(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) with each of GPU_DEFAULTS it does not name appended."""
    named = {word.lstrip("-").split("=")[0] for word in flags.split()}
    extra = [f"--{name}={value}" for name, value in GPU_DEFAULTS.items() if name not in named]
    return " ".join([flags.strip(), *extra]).strip()


def _cuda_installed() -> bool:
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # the parent package (jax_plugins) is absent
            continue
    return False


def add_gpu_defaults() -> None:
    """On a machine with a CUDA plugin, XLA_FLAGS with GPU_DEFAULTS added (the user's own values kept)."""
    platforms = {p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if (platforms and not platforms & {"cuda", "gpu"}) or not _cuda_installed():
        return
    os.environ["XLA_FLAGS"] = with_gpu_defaults(os.environ.get("XLA_FLAGS", ""))
