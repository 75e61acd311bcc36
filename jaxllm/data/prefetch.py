"""Batches built ahead (`data.prefetch`): a background thread builds the batches of the next steps, in order, and
puts them on the devices while the current step runs, so that a step waits for its data only when building a
batch takes longer than a step.

The thread calls the data's own `train_batch(step, sharding)`, so what a step receives is unchanged; it builds
at most `depth` batches ahead (their device memory is the price). An error while building is raised in the
training loop at the step that needed the batch. Everything else (validation batches, metrics) is the
wrapped data's.
"""

from __future__ import annotations

import queue
import threading


class Prefetched:
    """`data`, with the batches of steps first_step, first_step + 1, ... built `depth` ahead."""

    def __init__(self, data, sharding, first_step: int, depth: int):
        self.data, self.sharding, self.next_step = data, sharding, first_step
        self.ready: queue.Queue = queue.Queue(depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._build, args=(first_step,), daemon=True, name="jaxllm-prefetch")

    def _build(self, step: int) -> None:
        while not self.stopping.is_set():
            try:
                item = (self.data.train_batch(step, self.sharding), None)
            except Exception as e:  # raised where the batch is wanted
                item = (None, e)
            while not self.stopping.is_set():
                try:
                    self.ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return
            step += 1

    def train_batch(self, step: int, sharding) -> dict:
        if step != self.next_step or sharding != self.sharding:  # not the next in line: built here
            return self.data.train_batch(step, sharding)
        if self.thread.ident is None:
            self.thread.start()  # started by the first batch asked for, so nothing runs before the loop
        batch, error = self.ready.get()
        self.next_step += 1
        if error is not None:
            raise error
        return batch

    def close(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()

    def __getattr__(self, name: str):
        return getattr(self.data, name)
