"""Orbax checkpoints of the train state: async saves, keep the last K, restore onto any mesh, skip damage.

A checkpoint holds the train state (`trainer/state.py`) and, beside it as JSON, the resolved config
and the state's field names. Restoring reads each array straight into the shardings of the *current* mesh, so
a run saved on fsdp=8 continues on dp=2×fsdp=4.

Orbax writes each save into a temporary folder and renames it to `<step>` only when complete, so
a killed save leaves `<step>.orbax-checkpoint-tmp-…` and never a half-written `<step>`. Resuming
takes the newest step that restores; damaged newer steps and temporary folders are logged and
moved aside to `<step>.bad` (Orbax ignores that name, so a new save of the step and pruning work).
Detected: missing or truncated array files, unreadable metadata, interrupted saves, and (with
`train.checkpoint_checksums`, `trainer/checksums.py`) an array whose values changed after the save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import jax
import orbax.checkpoint as ocp

from jaxllm.errors import CheckpointError
from jaxllm.mesh import all_agree, barrier
from jaxllm.trainer import checksums

log = logging.getLogger("jaxllm")
TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax's suffix for a save in progress


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(os.path.abspath(run_dir), "checkpoints")


def open_manager(run_dir: str, keep: int, read_only: bool = False) -> ocp.CheckpointManager:
    with _quiet("absl") if read_only else contextlib.nullcontext():  # Orbax's notices of what read-only implies
        return ocp.CheckpointManager(
            checkpoint_dir(run_dir),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=not read_only,
                                                 create=not read_only, read_only=read_only),
        )


@contextlib.contextmanager
def _quiet(logger: str):
    """`logger` says only errors while the block runs."""
    quieted, level = logging.getLogger(logger), logging.getLogger(logger).level
    quieted.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quieted.setLevel(level)


def _entries(run_dir: str) -> tuple[list[int], list[str]]:
    """(complete steps, newest first; folders of interrupted saves) in run_dir's checkpoint folder."""
    path = checkpoint_dir(run_dir)
    names = os.listdir(path) if os.path.isdir(path) else []
    steps = sorted((int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(path, n))), reverse=True)
    return steps, sorted(n for n in names if TMP_MARK in n and not n.endswith(".bad"))


def has_checkpoints(run_dir: str) -> bool:
    """Whether run_dir holds any checkpoint, complete or not (without creating anything)."""
    steps, interrupted = _entries(run_dir)
    return bool(steps or interrupted)


def save(mngr: ocp.CheckpointManager, step: int, state, meta: dict, checked: bool = True) -> None:
    """Start an async save, with its arrays' checksums in `meta` when `checked` (`train.checkpoint_checksums`);
    `mngr.wait_until_finished()` before reading it back or exiting."""
    meta = {**meta, "checksums": checksums.of(state)} if checked else meta
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def _first_line(e: Exception) -> str:
    """The error's own words: its first line, without the TensorStore spec orbax appends."""
    text = str(e).strip().split(" See full TensorStore details")[0]
    return text.splitlines()[0][:200] if text else type(e).__name__


def _without_abandoned_reads(unraisable, *, then=sys.unraisablehook) -> None:
    """sys.unraisablehook once a restore has failed: orbax leaves its other array reads of that step to be collected
    unawaited or with their event loop closed, and each would print a traceback of the array's whole TensorStore spec
    (hundreds of lines after the one line that says what happened); those alone are dropped."""
    if "_read_array_index" in repr(unraisable.object) or "Event loop is closed" in str(unraisable.exc_value):
        return
    then(unraisable)


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The JSON saved beside step's state; CheckpointError if it cannot be read."""
    try:
        return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many kinds; all mean the same to the user
        raise CheckpointError(f"its metadata is unreadable ({_first_line(e)})") from None


def read_state(mngr: ocp.CheckpointManager, step: int, abstract_state, saved_checksums: dict | None = None):
    """step's train state laid out as `abstract_state`'s shardings say, its arrays checked against
    `saved_checksums` when given; CheckpointError if unreadable or changed since the save."""
    try:
        state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]
    except Exception as e:
        sys.unraisablehook = _without_abandoned_reads
        raise CheckpointError(f"its arrays are unreadable ({_first_line(e)})") from None
    if saved_checksums:
        checksums.verify(state, saved_checksums)
    return state


def _attempt(name: str, read):
    """(read()'s value, None) when it succeeded on every process, else (None, why)."""
    try:
        value, why = read(), None
    except CheckpointError as e:
        value, why = None, str(e)
    if not all_agree(name, why is None):
        return None, why or "unreadable on another process"
    return value, None


def restore_newest(run_dir: str, target, check_meta, verify: bool = True) -> tuple[object, dict]:
    """(state, meta) of the newest checkpoint in run_dir that restores. `check_meta(meta)` raises a
    UserError when the checkpoint belongs to another model (that is not damage: nothing is skipped);
    `target(meta)` is the abstract tree (shapes, dtypes, shardings) to read that checkpoint's state into;
    `verify`: check its arrays against the checksums saved with it (when it has them).
    Damaged newer steps and interrupted saves are logged and set aside once a good step is found;
    when none restores, CheckpointError names them all and nothing is moved."""
    steps, interrupted = _entries(run_dir)
    skipped = [(name, "an interrupted save") for name in interrupted]
    found = None
    mngr = open_manager(run_dir, keep=1, read_only=True)
    try:
        for step in steps:
            meta, why = _attempt(f"jaxllm_meta_{step}", lambda: read_meta(mngr, step))
            if why is None:
                check_meta(meta)
                saved = meta.get("checksums") if verify else None
                state, why = _attempt(f"jaxllm_state_{step}", lambda: read_state(mngr, step, target(meta), saved))
            if why is None:
                found = state, meta
                break
            skipped.append((str(step), why))
    finally:
        mngr.close()
    if found is None:
        what = "; ".join(f"{name}: {why}" for name, why in skipped) or "none found"
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(run_dir)} can be restored ({what}); "
                              "move the run's checkpoints folder away to start again from step 0")
    for name, why in skipped:
        log.warning("checkpoint %s skipped: %s; moved to %s", name, why, set_aside(run_dir, name))
    return found


def read_params(run_dir: str, step: int | None, abstract_params, verify: bool = True):
    """The parameters of run_dir's checkpoint `step` (None: the newest), laid out as `abstract_params` says,
    whatever else the checkpoint holds (`init.from = "run:DIR[@STEP]"`, `jaxllm generate --from DIR`); `verify`:
    checked against the checksums saved with them. CheckpointError naming the run and the step; the caller
    says which of the user's settings named them."""
    steps, _ = _entries(run_dir)
    if step is None and not steps or step is not None and step not in steps:
        raise CheckpointError(f"{checkpoint_dir(run_dir)} has no checkpoint {'at all' if step is None else step}; "
                              f"its steps are {steps or 'none'}")
    target = {"params": abstract_params}
    restore = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                     partial_restore=True)
    step = steps[0] if step is None else step
    others = sorted(set(steps) - {step})
    other = f"; its other checkpoints: {', '.join(map(str, others))}" if others else ""
    mngr = open_manager(run_dir, keep=1, read_only=True)
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(state=restore))["state"]
        if verify:
            checksums.verify(restored, read_meta(mngr, step).get("checksums", {}))
        return restored["params"]
    except CheckpointError as e:
        raise CheckpointError(f"{run_dir} step {step}: {e}{other}") from None
    except Exception as e:
        raise CheckpointError(f"{run_dir} step {step}: its parameters are unreadable ({_first_line(e)}){other}") \
            from None
    finally:
        mngr.close()


def set_aside(run_dir: str, name: str) -> str:
    """Rename checkpoints/<name> to `<step>.bad` (then .bad-2, ...) on process 0; returns the new name."""
    root = checkpoint_dir(run_dir)
    step = name.split(".")[0]
    target, n = f"{step}.bad", 1
    while os.path.exists(os.path.join(root, target)):
        n += 1
        target = f"{step}.bad-{n}"
    barrier(f"jaxllm_before_set_aside_{name}")  # every process has chosen the name before process 0 renames
    if jax.process_index() == 0:
        os.rename(os.path.join(root, name), os.path.join(root, target))
    barrier(f"jaxllm_set_aside_{name}")
    return target
