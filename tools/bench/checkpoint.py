"""Checkpoint checksums measured: save and restore of the default job's train state, with and without them.

    python -m tools.bench.checkpoint [--repeats 5] [--config default] [key=value ...]

- save: the state of `--config`'s run (random parameters, its optimizer state) saved as the loop saves it,
  timed until the async save is on disk; with checksums the time includes computing them (after a warm-up
  save of each kind, whose difference is printed on its own line).
- restore: a fresh process restores the newest step as a resumed run does (`checkpoint.restore_newest`),
  timed from the call to the restored state; with checksums it includes the check, as every resume pays it.

Medians over --repeats, with and without alternating; the ratio of each. Prints the lines BENCHMARKS.md
records, with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _state(config: str, overrides: list[str]):
    """(config, step functions, the run's initial state) of `config` with `overrides`."""
    from jaxllm.config import build_config, config_path
    from jaxllm.mesh import make_mesh
    from jaxllm.trainer.loop import resolve
    from jaxllm.trainer.step import make_step_fns

    cfg = build_config(config_path(config), overrides)
    _, shape, _ = resolve(cfg)
    fns = make_step_fns(cfg, make_mesh(shape, cfg))
    return cfg, fns, fns.init(cfg.train.seed)


def _save_once(mngr, step: int, state, checked: bool) -> float:
    from jaxllm.trainer import checkpoint as ckpt

    start = time.perf_counter()
    ckpt.save(mngr, step, state, {"step": step}, checked=checked)
    mngr.wait_until_finished()
    return time.perf_counter() - start


def measure_saves(run_dir: str, args) -> dict:
    from jaxllm.trainer import checkpoint as ckpt

    cfg, fns, state = _state(args.config, args.overrides)
    mngr = ckpt.open_manager(run_dir, keep=2 * args.repeats + 2)
    first_plain, first_checked = _save_once(mngr, 1, state, False), _save_once(mngr, 2, state, True)
    times, step = {False: [], True: []}, 2
    for i in range(args.repeats):
        for checked in ((False, True) if i % 2 else (True, False)):
            step += 1
            times[checked].append(_save_once(mngr, step, state, checked))
    _save_once(mngr, step + 1, state, True)  # the newest step, which the restores read, has checksums
    mngr.close()
    return {"first_save_extra_s": first_checked - first_plain, "plain": times[False], "checked": times[True]}


def restore_child(run_dir: str, args) -> None:
    """In a fresh process: restore the newest step as a resumed run does; print the seconds it took."""
    import jax

    from jaxllm.trainer import checkpoint as ckpt

    cfg, fns, _ = _state(args.config, args.overrides)
    start = time.perf_counter()
    state, _ = ckpt.restore_newest(run_dir, lambda meta: fns.abstract_state, lambda meta: None,
                                   verify=args.verify == 1)
    jax.block_until_ready(state)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def measure_restores(run_dir: str, args) -> dict:
    times = {0: [], 1: []}
    for i in range(args.repeats):
        for verify in ((0, 1) if i % 2 else (1, 0)):
            out = subprocess.run([sys.executable, "-m", "tools.bench.checkpoint", "--restore", run_dir,
                                  "--verify", str(verify), "--config", args.config, *args.overrides],
                                 cwd=REPO, capture_output=True, text=True, check=True)
            times[verify].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    return {"plain": times[0], "checked": times[1]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", default="default")
    p.add_argument("--restore", help=argparse.SUPPRESS)  # the child of measure_restores
    p.add_argument("--verify", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.restore:
        return restore_child(args.restore, args)
    with tempfile.TemporaryDirectory() as run_dir:
        saves = measure_saves(run_dir, args)
        restores = measure_restores(run_dir, args)
    print(f"first save of a run: +{saves['first_save_extra_s']:.3f} s with checksums")
    for what, t in (("save", saves), ("restore", restores)):
        plain, checked = statistics.median(t["plain"]), statistics.median(t["checked"])
        print(f"{what}: {plain:.3f} s without checksums, {checked:.3f} s with (medians of {args.repeats}): "
              f"{checked / plain:.3f}x")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
