"""Every test process sees 8 fake CPU devices (set before JAX is imported anywhere).

The tests' programs are tiny, so their run time is nothing next to XLA's compile time:
LLVM's optimisation level 0 roughly halves the compile time of a train step on CPU.
"""

import os

_FLAGS = ["--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"]
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
