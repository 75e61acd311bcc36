"""The suite's own compile machinery: each XLA program compiled once per test process
(`harness.compile_each_program_once`), freed near Linux's limit on memory mappings, what outlives a test file
frozen out of Python's collector (`harness.freeze_what_lives`), the ledger that
says where compile time goes (`tools/dev/compile_ledger.py`), and the XLA:CPU bug that keeps
multi-device programs out of JAX's persistent cache (`tools/dev/xla_cpu_cache_hang.py`)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import harness
from harness import REPO, subprocess_env
from tools.dev import compile_ledger, xla_cpu_cache_hang


def fresh_jit():
    """A new jitted function each call, every one lowering to the same program (`jit_program`)."""
    def program(x):
        return jnp.sin(x) * 3.0 + 1.0

    return jax.jit(program)


def test_two_jitted_functions_with_one_program_compile_once():
    x, other = jnp.arange(37.0), jnp.arange(38.0)  # shapes no other test compiles this program for
    held = len(harness._executables)
    first = fresh_jit()(x)
    assert len(harness._executables) == held + 1
    second = fresh_jit()(x)  # a new function: JAX's own caches miss, the harness hands over the executable
    assert len(harness._executables) == held + 1
    np.testing.assert_array_equal(first, second)
    fresh_jit()(other)  # another shape is another program
    assert len(harness._executables) == held + 2


def test_a_program_on_other_devices_is_another_executable():
    """The key holds the device assignment: the same program on devices 4-7 is not handed devices 0-3's."""
    for devices in (jax.devices()[:4], jax.devices()[4:]):
        mesh = Mesh(np.array(devices), ("d",))
        x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("d")))
        y = fresh_jit()(x)
        assert y.sharding.device_set == set(devices)
        np.testing.assert_allclose(y, np.sin(np.arange(8.0)) * 3 + 1, rtol=1e-6)


def test_programs_are_freed_once_the_process_holds_its_share_of_the_map_limit(monkeypatch):
    for n in (41, 42, 43):
        fresh_jit()(jnp.arange(float(n)))
    monkeypatch.setattr(harness, "MAP_SHARE", 1.0)
    assert not harness.free_programs_near_the_map_limit() and harness._executables
    held, limit = harness.memory_maps()
    assert 0 < held < limit
    monkeypatch.setattr(harness, "MAP_SHARE", 0.0)
    assert harness.free_programs_near_the_map_limit()
    assert not harness._executables and not harness._programs
    assert harness.memory_maps()[0] < held  # the code XLA mapped for them went with them


LEDGER_SCRIPT = """
import os
import jax, jax.numpy as jnp
x = jnp.ones(29)
for name in ("tests/test_a.py", "tests/test_b.py", "tests/test_b.py"):
    os.environ["PYTEST_CURRENT_TEST"] = name + "::test_x (call)"
    def program(x):
        return jnp.cos(x) * 2.0
    jax.jit(program)(x).block_until_ready()
"""


def test_the_ledger_records_a_command_line_and_counts_its_repeats_by_file(tmp_path, capsys):
    """A process the tests start records its compiles (the ledger's sitecustomize on its path): one program
    compiled by 'test_a', again by 'test_b', and again by 'test_b'."""
    env = {**subprocess_env(1), "JAXLLM_COMPILE_LEDGER": str(tmp_path / "ledger"), "JAX_COMPILATION_CACHE_DIR": "",
           "PYTHONPATH": f"{compile_ledger.SITE}:{REPO}"}
    done = subprocess.run([sys.executable, "-c", LEDGER_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = compile_ledger.read(tmp_path / "ledger")
    ours = [r for r in lines if r.get("key", "").startswith("jit_program-")]
    assert [r["file"] for r in ours] == ["tests/test_a.py", "tests/test_b.py", "tests/test_b.py"]
    assert len({r["key"] for r in ours}) == 1 and not any(r["hit"] for r in ours)
    summary = compile_ledger.summarise(lines)
    program = summary["programs"][ours[0]["key"]]
    assert program["compiles"] == 3 and program["files"] == ["tests/test_a.py", "tests/test_b.py"]
    assert program["repeated"] == pytest.approx(ours[1]["seconds"] + ours[2]["seconds"])
    totals = summary["totals"]
    assert totals["other_file"] >= ours[1]["seconds"] > 0 and totals["same_file"] >= ours[2]["seconds"] > 0
    assert totals["trace"] > 0 and totals["lower"] > 0 and totals["maps_peak"] > 0

    assert compile_ledger.main([str(tmp_path / "ledger")]) == 0
    assert "`jit_program`" in capsys.readouterr().out
    assert compile_ledger.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "JAXLLM_COMPILE_LEDGER" in err[0]


def test_the_test_processes_compile_hook_keeps_jaxs_signature_for_the_ledger():
    """The ledger installs itself over the hook that keeps each program (conftest: both in one test process) and
    binds JAX's arguments by name: the hook must show JAX's signature (a bare *args, **kwargs made every compile
    of a ledger-recorded test fail)."""
    import inspect

    from jax._src import compiler

    assert compiler.compile_or_get_cached._once
    assert {"computation", "devices", "compile_options", "backend"} <= set(
        inspect.signature(compiler.compile_or_get_cached).parameters)


def test_what_lives_is_frozen_and_what_died_is_collected_after_a_thaw():
    """`harness.freeze_what_lives` after each file: a cycle that died during the file is collected, one alive
    is frozen (kept from the collector's walks even once it dies), and a thaw collects it."""
    import gc
    import weakref

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a

    died, lives = cycle(), cycle()
    died_ref, lives_ref = weakref.ref(died), weakref.ref(lives)
    del died
    harness.freeze_what_lives()
    assert died_ref() is None and lives_ref() is not None and gc.get_freeze_count() > 0
    del lives
    harness.freeze_what_lives()
    assert lives_ref() is not None  # frozen: the collector no longer walks it
    harness.freeze_what_lives(thaw=True)
    assert lives_ref() is None


@pytest.mark.slow
def test_xla_cpu_still_drops_the_order_of_collectives_it_reads_back(tmp_path):
    """The upstream bug behind `subprocess_env` keeping multi-device programs out of JAX's persistent cache: the
    loops of an 8-device program read back no longer wait for the collectives before them. Two loops and one
    run: the edges are missing without the hang the tool provokes with twelve."""
    cache = str(tmp_path / "cache")
    compiled, read_back = (xla_cpu_cache_hang.run_once(2, 1, cache, timeout=300) for _ in range(2))
    assert compiled[0] and read_back[0] and set(compiled[1]) == set(read_back[1]) and len(compiled[1]) == 2
    lost = {name: compiled[1][name] - deps for name, deps in read_back[1].items()}
    assert any(lost.values()), ("XLA:CPU now keeps the order of collectives it reads back: multi-device programs "
                                "may come from the persistent cache (tests/harness.py subprocess_env, design notes)")
