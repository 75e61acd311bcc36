"""Orbax checkpoints of the train state: async saves, keep the last K, restore onto any mesh.

A checkpoint holds the state (step, fp32 params, optimizer state) and, beside it as
JSON, the resolved config. Restoring reads each array straight into the shardings of
the *current* mesh, so a run saved on fsdp=8 continues on dp=2×fsdp=4.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

from jaxllm.errors import CheckpointError


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "checkpoints")


def open_manager(run_dir: str, keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        checkpoint_dir(run_dir),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True),
    )


def latest_step(run_dir: str) -> int | None:
    """The newest complete checkpoint's step in run_dir, or None (without creating anything)."""
    path = checkpoint_dir(run_dir)
    if not os.path.isdir(path):
        return None
    steps = [int(d) for d in os.listdir(path) if d.isdigit() and os.path.isdir(os.path.join(path, d))]
    return max(steps) if steps else None


def save(mngr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
    """Start an async save; `mngr.wait_until_finished()` before reading it back or exiting."""
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def restore(mngr: ocp.CheckpointManager, abstract_state, step: int | None = None):
    """(state, meta) of a checkpoint, laid out as `abstract_state`'s shardings say."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {mngr.directory}; start without train.resume=true")
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many kinds; all mean the same to the user
        raise CheckpointError(f"checkpoint {step} in {mngr.directory} is unreadable ({type(e).__name__}); "
                              "delete that step's folder to fall back to an earlier one") from None
    try:
        state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {step} in {mngr.directory} does not fit this run's model/optimizer "
                              f"({first}); resume with the settings it was saved with") from None
    return state, meta
