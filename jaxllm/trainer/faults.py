"""Test-only faults. `JAXLLM_TEST_KILL=<point>:<step>` sends the process SIGKILL at one chosen point,
so the tests can check what a killed run leaves behind and that resuming loses nothing;
`JAXLLM_TEST_NAN_FROM=<step>` makes the loss of every step from that one (1-based) on NaN (its loss
mask), for the step guard. Unset (as in every real run), each call here only reads the environment.

Points:
- `compile`: 50 ms into compiling the train step (step is ignored);
- `dispatched:N`: right after step N is dispatched, before its metrics are fetched (an earlier
  save still in flight is let finish first);
- `saving:N`: step N's async checkpoint is held open (Orbax never renames its temporary folder into
  place) and the process is killed once step N + 1 is dispatched, the save still in flight;
- `saved:N`: after step N's checkpoint is complete on disk, before the next metrics row is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading

ENV = "JAXLLM_TEST_KILL"


def _target() -> tuple[str, int] | None:
    value = os.environ.get(ENV)
    if not value:
        return None
    point, _, step = value.partition(":")
    return point, int(step or 0)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def after_dispatch(step: int, mngr) -> None:
    target = _target()
    if target == ("dispatched", step):
        if mngr is not None:  # let an earlier save finish, so what is on disk does not depend on timing
            mngr.wait_until_finished()
        _kill()
    if target == ("saving", step - 1):
        _kill()


def after_save(mngr, step: int) -> None:
    if _target() == ("saved", step):
        mngr.wait_until_finished()
        _kill()


def before_save(mngr, step: int) -> None:
    """For `saving:N`: make Orbax's final rename of this save wait forever. The patch holds every save's rename,
    so an earlier save still finishing in the background is let finish first: the manager waits for it before
    starting this one, and would wait forever (a race a loaded machine lost: the run hung at step N)."""
    if _target() == ("saving", step):
        from orbax.checkpoint._src.path import atomicity

        mngr.wait_until_finished()

        async def never_finalize(self):
            await asyncio.Event().wait()

        atomicity.AtomicRenameTemporaryPath.finalize = never_finalize


@contextlib.contextmanager
def compiling():
    """For `compile`: a thread kills the process 50 ms into the block (the compile, which takes longer
    without a persistent-cache hit)."""
    target = _target()
    if target is not None and target[0] == "compile":
        threading.Timer(0.05, _kill).start()
    yield


def corrupt(step: int, batch: dict) -> dict:
    """For `JAXLLM_TEST_NAN_FROM=N`: step `step` (1-based) from N on gets a loss mask of NaN."""
    start = os.environ.get("JAXLLM_TEST_NAN_FROM")
    if not start or step < int(start):
        return batch
    return {**batch, "loss_mask": batch["loss_mask"] * float("nan")}
