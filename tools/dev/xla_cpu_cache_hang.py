"""XLA:CPU loses the order of a multi-device program's collectives when it reads the program back
from JAX's persistent compilation cache, and the program can then hang: the reproduction for the
upstream report in docs/design-notes.md ("The test suite compiles each program once").

    python -m tools.dev.xla_cpu_cache_hang [--loops 12] [--runs 1000] [--timeout 60]

The program: on 8 CPU devices, `--loops` independent scans whose bodies all-gather a sharded
weight, beside as many all-gathers at the top level. It runs three times in fresh processes sharing
one cache folder: compiled (and written to the cache), read back, read back again. Each run logs
XLA's thunk execution graph (TF_CPP_VMODULE=thunk_executor=6), and the report compares, for every
`while` thunk, the thunks it waits for: compiled, each loop waits for every earlier collective (they
share one "collective communicator" resource, so that every device runs its collectives in one
order); read back, the edges from the top-level collectives are gone, each device may run its
collectives in its own order, and the blocked collectives exhaust the thread pool (a hang, reported
by XLA's rendezvous as "may be stuck"). JAX 0.10.2 on 2 cores: the compiled run finishes, both
read-back runs hang at 12 loops.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

_WAITS = re.compile(r"thunk #\d+: op_name=(while[\w.]*), kind=while, dependencies=\[([^\]]*)\]")


def _program(loops: int, runs: int, cache: str) -> None:
    """The child process: compile (or read back) the program and run it `runs` times."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def stack(ws, x):  # a scan whose body all-gathers its weight: collectives inside a loop
        body = lambda h, w: (jnp.tanh(h @ jax.lax.with_sharding_constraint(w, whole)), None)
        return jax.lax.scan(body, x, ws)[0].sum()

    @jax.jit
    def f(weights, x, ys):
        return [stack(ws, x) for ws in weights], [jax.lax.with_sharding_constraint(y, whole) for y in ys]

    rng = np.random.RandomState(0)
    weights = [jax.device_put(rng.randn(4, 64, 64).astype(np.float32) / 8, NamedSharding(mesh, P(None, "d")))
               for _ in range(loops)]
    x = jax.device_put(np.ones((64, 64), np.float32), rows)
    ys = [jax.device_put(rng.randn(64, 64).astype(np.float32), rows) for _ in range(loops)]
    compiled = f.lower(weights, x, ys).compile()
    for _ in range(runs):
        jax.block_until_ready(compiled(weights, x, ys))
    print("finished", flush=True)


def run_once(loops: int, runs: int, cache: str, timeout: float) -> tuple[bool, dict, float]:
    """(finished, while thunk -> the thunks it waits for, seconds) of one child process."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="thunk_executor=6")
    cmd = [sys.executable, "-m", "tools.dev.xla_cpu_cache_hang", "--child", cache, "--loops", str(loops),
           "--runs", str(runs)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    waits = {name: set(filter(None, (d.strip() for d in deps.split(",")))) for name, deps in _WAITS.findall(err)}
    return "finished" in out, waits, time.monotonic() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.dev.xla_cpu_cache_hang", description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", type=int, default=12, help="independent loops, each with collectives inside")
    ap.add_argument("--runs", type=int, default=1000, help="executions of the program per process")
    ap.add_argument("--timeout", type=float, default=60, help="seconds before a process counts as hung")
    ap.add_argument("--child", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _program(args.loops, args.runs, args.child)
        return 0
    with tempfile.TemporaryDirectory(prefix="xla-cpu-cache-hang-") as cache:
        results = [run_once(args.loops, args.runs, cache, args.timeout) for _ in range(3)]
    compiled = results[0][1]
    for label, (finished, waits, seconds) in zip(("compiled", "read back", "read back again"), results):
        lost = sum(len(compiled.get(name, set()) - deps) for name, deps in waits.items())
        print(f"{label:>16}: {'finished' if finished else 'HUNG'} ({args.runs} runs, {seconds:.0f} s); "
              f"{len(waits)} loops, {lost} edges to other collectives missing against the compiled program")
    return 0 if results[0][0] else 1


if __name__ == "__main__":
    sys.exit(main())
