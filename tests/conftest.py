"""Test-session set-up, done before JAX is imported anywhere.

- 8 fake CPU devices in every test process.
- Compile time is most of the suite's time (the programs are tiny), so XLA is told to
  compile cheaply: LLVM at optimisation level 0, and the older loop emitters instead of
  the fusion emitters (`--xla_cpu_use_fusion_emitters=false` halves the compile time of a
  train step on XLA:CPU, JAX 0.10; jaxlib 0.11 dropped that switch, so it is set only before).
- JAX's persistent compilation cache for the one-device command lines the tests start
  (`harness.subprocess_env`), in a temporary folder for this session: a program one CLI run
  compiled is read back by the next (two processes of one run, a run and its resumption).
  The test process itself compiles each program once (`harness.compile_each_program_once`) and
  keeps it across test files until it holds half the memory mappings Linux allows.
- JAXLLM_COMPILE_LEDGER=DIR records every compile for `python -m tools.dev.compile_ledger DIR`.
- The `slow` marker: `python -m pytest -m "not slow"` is the fast tier for development.
- pytest-xdist workers (pyproject's addopts) inherit the controller's environment, so they share its
  compilation cache folder, which only the controller (the process that made it) removes at the end.
"""

import functools
import os
import shutil
import tempfile

import pytest

from harness import compile_each_program_once, compile_flags, free_programs_near_the_map_limit, freeze_what_lives

for _flag in compile_flags(8).split():
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

compile_each_program_once()
if os.environ.get("JAXLLM_COMPILE_LEDGER"):  # where the compile time goes: python -m tools.dev.compile_ledger
    from tools.dev.compile_ledger import install

    install(os.environ["JAXLLM_COMPILE_LEDGER"])

_OWN_CACHE = None
if not os.environ.get("JAXLLM_TEST_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="jaxllm-test-xla-cache-")
    os.environ["JAXLLM_TEST_CACHE_DIR"] = _OWN_CACHE


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each test file, drop the compiled programs if the process holds half the memory mappings
    Linux allows. XLA:CPU maps its code for every executable (a train step's in about a hundred): a whole
    session that kept them all passed Linux's 65,530 mappings per process and crashed inside a compile.
    Then what is still alive is frozen out of Python's cyclic collector (`harness.freeze_what_lives`)."""
    yield
    freeze_what_lives(thaw=free_programs_near_the_map_limit())


@pytest.fixture(scope="module")
def one_reader_per_file():
    """For a module of real GGUF files: transformers' GGUF loading handed jaxllm's reader of each file (`gguf_io`:
    one per file as it is, the gguf package's over a plain view of its memory map) where it would parse the file
    for its config, again for its weights and again for its tokenizer (a real vocabulary takes the package's
    reader seconds each time). The reader only reads: its arrays map the file read-only. And the gguf package's
    name map of an architecture built once: transformers builds it afresh for every module of the model it maps
    (397 times for SmolLM2, 11 s), and only reads it."""
    import gguf

    from jaxllm.interop import gguf_io

    def jaxllms(path, mode="r"):
        assert mode == "r", mode
        return gguf_io._reader(os.fspath(path))[0]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", jaxllms)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compile-heavy or subprocess tests; deselect with -m 'not slow'")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
