"""Compiling the train step without running it, and what the compiled program alone can tell.

`resolve` settles a config as training would (minus the corpus), `compile_step` lowers and compiles its
train step from abstract inputs (nothing allocated, no data loaded); from the executable, `host_state_bytes`
reads the state offloaded to host memory and `remat_summary` the effect of activation-recomputation
groups (the same step compiled without them). Reading the program's text is `jaxllm.plan.hlo`'s.
"""

from __future__ import annotations

import copy
import time

import jax

from jaxllm.mesh import make_mesh
from jaxllm.models.transformer import remat_group
from jaxllm.parallel.pipeline_schedules import model_chunks
from jaxllm.plan.hlo import memory_summary
from jaxllm.plan.memory import device_bytes
from jaxllm.stack import segments
from jaxllm.trainer.loop import resolve as resolve_config
from jaxllm.trainer.step import make_step_fns


def resolve(cfg):
    """The config resolved as `trainer.loop.prepare` does, minus the corpus: (cfg copy, mesh shape, notes)."""
    cfg = copy.deepcopy(cfg)
    _, shape, notes = resolve_config(cfg)
    return cfg, shape, notes


def host_state_bytes(abstract_state, compiled) -> int:
    """Bytes per device of the state kept in host memory between steps (`memory.*`): what the compiled
    program reports as host arguments, or, where the backend reports none (XLA:CPU), the shards of the
    state leaves whose shardings carry the host memory kind."""
    reported = int(compiled.memory_analysis().host_argument_size_in_bytes)
    if reported:
        return reported
    return device_bytes([a for a in jax.tree.leaves(abstract_state) if a.sharding.memory_kind == "pinned_host"])


def compile_step(cfg, shape: dict):
    """(step fns, the train step compiled for `cfg` on its mesh, seconds the compile took)."""
    fns, t = make_step_fns(cfg, make_mesh(shape, cfg)), cfg.train
    start = time.perf_counter()
    compiled = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(t.global_batch, cfg.model.seq_len)).compile()
    return fns, compiled, time.perf_counter() - start


def remat_summary(cfg, shape: dict, temp_bytes: int) -> dict:
    """What `model.remat` and `model.remat_group` keep for this config, beside the seeds' table; with
    groups, the temporaries of the same step compiled without them (the groups' effect)."""
    m, t = cfg.model, cfg.train
    chunks = shape["pp"] * (model_chunks(t.pp_schedule, t.pp_virtual) if shape["pp"] > 1 else 1)
    repeats = max(seg.repeats for seg in segments(m)) // chunks  # the longest segment's, where the memory is
    out = {"remat": m.remat, "group": remat_group(m, repeats), "repeats": repeats, "temp_bytes": temp_bytes}
    if out["group"]:
        plain = copy.deepcopy(cfg)
        plain.model.remat_group = 0
        out["temp_bytes_without_group"] = memory_summary(compile_step(plain, shape)[1])["temp_bytes"]
    return out
