"""Stopping on request: SIGTERM (a scheduler's preemption notice) or Ctrl-C ends a run at a step boundary.

The loop asks `should_stop(step)` after dispatching each step; when it says yes the loop saves a
checkpoint of that step, flushes its metrics and raises `errors.Stopped`, which the command line turns
into one line and exit code 128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C).

One process: a Python handler notes the signal. Several processes: a signal may reach one of them
first, and all must still save the same step together. JAX's preemption service (started by
`jax.distributed.initialize`) catches SIGTERM in whichever process gets it, tells the others through
the coordination service, and `multihost_utils.reached_preemption_sync_point(step)` turns true on
every process at the same step. Ctrl-C is forwarded to it as SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator

import jax
from jax.experimental import multihost_utils

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _preemption_service() -> bool:
    from jax._src import distributed  # where jax.distributed keeps its state; no public accessor

    return jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None


@contextlib.contextmanager
def stop_requests() -> Iterator[Callable[[int], int | None]]:
    """Within the block, signals request a stop instead of killing the process. Yields
    `should_stop(step)`: None to go on, or the signal number to stop at this step (with several
    processes, the same step on every one; SIGTERM's number for a stop another process was told of)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield lambda step: None
        return
    if _preemption_service():
        def forward(signum, frame):  # Ctrl-C takes the path JAX's service watches
            os.kill(os.getpid(), signal.SIGTERM)

        previous = {signal.SIGINT: signal.signal(signal.SIGINT, forward)}

        def should_stop(step: int) -> int | None:
            return signal.SIGTERM if multihost_utils.reached_preemption_sync_point(step) else None
    else:
        def note(signum, frame):
            received.append(signum)

        previous = {s: signal.signal(s, note) for s in _SIGNALS}

        def should_stop(step: int) -> int | None:
            return received[0] if received else None
    try:
        yield should_stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
