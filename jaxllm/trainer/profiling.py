"""Profiler traces (`run.profile_steps = [start, count]`): a `jax.profiler` trace of those steps.

Every process writes its own trace, RUN_DIR/profile/process_K/plugins/profile/TIME/HOST.xplane.pb (its host's
work and its own devices'): `tensorboard --logdir RUN_DIR/profile` with tensorboard-plugin-profile, or xprof,
opens them, and Perfetto through either. The trace starts before step `start` asks for its batch and stops once
step start + count - 1 has finished on the devices (the loop waits for it there), so it holds those steps' data,
dispatch and device work. Each step is a `StepTraceAnnotation("train", step_num=N)`, which TensorBoard's step
view reads; the model's parts are named scopes (embed, attention, mlp, moe, head, optimizer) in each op's
metadata: a GPU or TPU trace shows them on every op; a CPU trace names the ops of the compiled train step, whose
HLO is written beside the trace (train_step.hlo.txt: each op's `op_name` metadata holds its scopes).
"""

from __future__ import annotations

import logging
import os

import jax

from jaxllm.errors import ConfigError

log = logging.getLogger("jaxllm")
HLO_FILE = "train_step.hlo.txt"


def check_config(cfg) -> None:
    p = cfg.run.profile_steps
    if not p:
        return
    if len(p) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in p):
        raise ConfigError(f"run.profile_steps: [start, count], both whole numbers of at least 1, got {p!r}")
    if p[0] + p[1] - 1 > cfg.train.steps:
        raise ConfigError(f"run.profile_steps: steps {p[0]}..{p[0] + p[1] - 1} pass train.steps={cfg.train.steps}; "
                          "profile steps the run trains")


def trace_dir(run_dir: str) -> str:
    """Where this process writes its trace."""
    return os.path.join(run_dir, "profile", f"process_{jax.process_index()}")


class Profiler:
    """Starts and stops the trace around the configured steps of a run whose first step is `start` + 1."""

    def __init__(self, cfg, start: int):
        first, count = cfg.run.profile_steps or (0, 0)
        self.first, self.last, self.dir, self.tracing = first, first + count - 1, trace_dir(cfg.run.dir), False
        if count and first <= start:
            log.info("run.profile_steps: step %d was trained before the resume from step %d; no trace", first, start)
            self.first = self.last = 0

    def before(self, step: int, program) -> None:
        """Start the trace at its first step, with the compiled train step's HLO beside it (`HLO_FILE`: a CPU
        trace names the program's ops; their metadata in the HLO says which part of the model each one is)."""
        if step == self.first:
            os.makedirs(self.dir, exist_ok=True)
            with open(os.path.join(self.dir, HLO_FILE), "w") as f:
                f.write(program.as_text())
            jax.profiler.start_trace(self.dir)
            self.tracing = True

    def due(self, step: int) -> bool:
        """Whether the trace ends after this step (the loop waits for the step first)."""
        return self.tracing and step == self.last

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
            log.info("profiler trace of steps %d..%d: %s", self.first, self.last, self.dir)
