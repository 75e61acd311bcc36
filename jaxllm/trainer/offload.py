"""Host offload of the train state (`memory.offload_optimizer`, `memory.offload_params`): ZeRO-Offload's
storage form, not its host compute.

What is offloaded is stored in host memory: its shardings carry the memory kind `pinned_host` (the same
layout over the mesh, another memory), so the compiled step takes it as a host argument and writes it back
as a host output. The step brings it to the device at its start (`fetch`, one host-to-device copy of the
optimizer state and/or the fp32 parameters per step) and the update runs on the device as it would
without offload; the arithmetic is unchanged, so offloading changes no bit. Checkpoints do not record a
memory kind: a run resumes with offload on or off whatever it was saved with.

First version: the plain gradient path and ZeRO-2/3's accumulation scan. The shard_map islands (the
ZeRO-0/1 accumulation island, the pipeline, ring attention, collective matmuls, expert dispatch) and
GRPO's rollouts are refused in one line until they are checked on a GPU.
"""

from __future__ import annotations

import jax

from jaxllm.errors import ConfigError
from jaxllm.stack import has_moe
from jaxllm.trainer.gradients import uses_island

HOST = "pinned_host"


def check_config(cfg, shape: dict) -> list[str]:
    """ConfigError (one line) for an offload this version does not run."""
    mem, t, m = cfg.memory, cfg.train, cfg.model
    if not (mem.offload_optimizer or mem.offload_params):
        return []
    by = "train.microbatches > 1" if t.microbatches > 1 else f"train.allreduce={t.allreduce}"
    unchecked = ("mesh.pp > 1" if shape["pp"] > 1 else "mesh.sp > 1 (ring attention)" if shape["sp"] > 1
                 else "mesh.ep > 1 (expert dispatch)" if shape["ep"] > 1
                 else "model.collective_matmul" if m.collective_matmul
                 else f"{by} at ZeRO-0/1 (the accumulation island)"
                 if uses_island(t.zero_stage, t.microbatches, t.allreduce, has_moe(m))
                 else "train.objective = grpo" if t.objective == "grpo" else None)
    if unchecked:
        raise ConfigError(f"memory.offload_optimizer / memory.offload_params with {unchecked} are not supported yet "
                          "(not checked on a GPU); turn offload off, or use the plain or ZeRO-2/3 accumulation path")
    return []


def stored(shardings, offloaded: bool):
    """Where a part of the state is kept: `shardings` in host memory when `offloaded`."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings) if offloaded else shardings


def fetch(tree, shardings, offloaded: bool):
    """`tree` on the device, laid out as `shardings` (inside a jitted function): a copy from host memory
    when `offloaded`, else `tree` itself."""
    return jax.device_put(tree, shardings) if offloaded else tree
