"""Test-session set-up, done before JAX is imported anywhere.

- 8 fake CPU devices in every test process.
- Compile time is most of the suite's time (the programs are tiny), so XLA is told to
  compile cheaply: LLVM at optimisation level 0, and the older loop emitters instead of
  the fusion emitters (`--xla_cpu_use_fusion_emitters=false` halves the compile time of a
  train step on XLA:CPU, JAX 0.10).
- JAX's persistent compilation cache in a temporary folder for this session (unless
  `JAX_COMPILATION_CACHE_DIR` is set already, e.g. to keep a warm cache between runs of
  the fast tier). Subprocesses the tests start inherit it, so a program compiled once —
  in-process or in a CLI run — is read back, not compiled again.
- The `slow` marker: `python -m pytest -m "not slow"` is the fast tier for development.
"""

import os
import shutil
import tempfile

from harness import compile_flags

for _flag in compile_flags(8).split():
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_OWN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="jaxllm-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
# cache every program that took a noticeable time to compile (the default is 1 s)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compile-heavy or subprocess tests; deselect with -m 'not slow'")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
