"""Pipeline parallelism per device: the parameters a stage holds, and what the schedule's table costs.

`stage_params`: a device holds one stage's share of the layer stack (and 1/ep of its experts) beside the
embedding, head and final norm, replicated over pp, and 1/tp of what tensor parallelism splits; the ZeRO theory's Φ. `pipeline_theory`
(no compiling): ticks, bubble (from the table and in closed form), activation buffers, the W stash of a
split backward, and the 2 × ticks collective-permutes the table predicts; `pipeline_compiled` sets the
compiled program's permutes and the element type they actually move beside them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
import math

import jax

from jaxllm.models import taps, transformer
from jaxllm.parallel.pipeline_schedules import bubble_formula, bubble_fraction
from jaxllm.plan.hlo import permute_dtypes
from jaxllm.sharding import TENSOR_RULES
from jaxllm.plan.memory import dtype_bytes, microbatch_rows
from jaxllm.stack import segments
from jaxllm.trainer.step import pipeline_schedule

PIPELINE_ASSUMES = ("stage inputs and output gradients kept in the compute dtype, one microbatch's residual "
                    "stream per slot; per device")


def _over(leaf, axis: str) -> list[int]:
    """The extents of this parameter's dimensions whose rules split them over `axis`."""
    rules = dict(TENSOR_RULES)
    return [extent for n, extent in zip(leaf.names, leaf.shape) if axis in rules.get(n, ())]


def split(leaf, axis: str, size: int) -> int:
    """`size` where the rules split a dimension of this parameter over `axis` (and it divides), else 1."""
    return size if size > 1 and any(extent % size == 0 for extent in _over(leaf, axis)) else 1


def device_share(model_cfg, pp: int, ep: int = 1, tp: int = 1) -> tuple[dict, Callable, set]:
    """(the model's parameter table, `held(leaf)`: the elements of that leaf of the table one device holds, the ids
    of the stack's leaves): a leaf of the pipelined (last) segment's blocks is split over pp, an expert's over ep,
    what tensor parallelism splits over tp."""
    table = transformer.param_table(model_cfg)
    stack_ids = {id(l) for l in _leaves(table["blocks"][segments(model_cfg)[-1].blocks])}
    share = lambda l: (pp if id(l) in stack_ids else 1) * split(l, "ep", ep) * split(l, "tp", tp)
    return table, lambda l: math.prod(l.shape) // share(l), stack_ids


def _leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, transformer.Leaf))


def stage_params(model_cfg, pp: int, ep: int = 1, tp: int = 1) -> dict:
    """Parameters one device holds of the model: {"stack" (the pipelined layers: the last segment's), "experts"
    (every MoE expert's weights), "shared" (embedding, head, final norm, the layers of the segments before and the
    prediction modules: replicated over pp), "tp_split" (what tensor parallelism splits: heads, hidden units,
    vocabulary), "stage" = Σ over parameters of its size / (pp if in the stack) / (ep if an expert's) / (tp if
    split), "stage_stack" = the same sum over the stack's parameters}."""
    table, held, stack_ids = device_share(model_cfg, pp, ep, tp)
    leaves = _leaves(table)
    size = lambda l: math.prod(l.shape)
    stack = sum(size(l) for l in leaves if id(l) in stack_ids)
    return {"stack": stack, "experts": sum(size(l) for l in leaves if _over(l, "ep")), "ep": ep,
            "shared": transformer.count_params(model_cfg) - stack, "tp": tp,
            "tp_split": sum(size(l) for l in leaves if split(l, "tp", tp) > 1),
            "stage": sum(held(l) for l in leaves),
            "stage_stack": sum(held(l) for l in leaves if id(l) in stack_ids)}


def pipeline_theory(model_cfg, train_cfg, mesh_shape: dict, compute_dtype) -> dict:
    """The pipeline schedule's table and what it costs per device: pure arithmetic, no compiling.

    b = rows per microbatch per device (global_batch / microbatches / (dp·fsdp·ep)); s = seq_len over
    the axes that split the residual stream's sequence (sp, and sp·tp under sequence parallelism);
    d = d_model; E = bytes per element of `compute_dtype`. One slot is b·s·d·E bytes.

    - the activation buffers hold (act_depth + grad_depth) slots: stage inputs kept for the
      backward and output gradients waiting for it (parallel/pipeline_schedules.py);
    - the executor sends 2 collective-permutes per tick (forward output downstream, input gradient
      upstream), one slot each: 2 × ticks per step;
    - the bubble from the table (`bubble_fraction`) at unit costs (F = R = B = W) beside its closed form
      (`bubble_formula`), and at this model's per-layer costs (`transformer.layer_costs`, which the
      zero-bubble tables are built for);
    - with a split backward (zb_h1, zb_v) the W stash (`models/taps.py`): one slot holds a chunk's stash for
      one microbatch, b·seq_len·E times the tapped projections' input and output elements per token
      (`taps.stash_elements`) times the chunk's layers; the program holds stash_depth slots, the stash B is
      making and the zero probes it makes it from: (stash_depth + 2) slots.

    Returns {"enabled" (pp > 1), "note", "pp", "params" (`stage_params`), "assumes"} and, when enabled,
    "schedule", "p", "v", "m", "ticks", "bubble": {"table", "formula", "model_costs", "costs"}, "act_depth",
    "grad_depth", "b", "s", "d", "dtype", "dtype_bytes", "slot_bytes", "buffer_bytes",
    "collective_permute": {"count", "bytes_per_call", "bytes"}, and with a split backward "stash_depth",
    "stash_slot_bytes", "stash_bytes".
    """
    m, t = model_cfg, train_cfg
    pp = int(mesh_shape.get("pp", 1))
    out = {"enabled": pp > 1, "note": "" if pp > 1 else "no pipeline parallelism (mesh.pp=1)", "pp": pp,
           "params": stage_params(m, pp, int(mesh_shape.get("ep", 1)), int(mesh_shape.get("tp", 1))),
           "assumes": PIPELINE_ASSUMES}
    if pp == 1:
        return out
    sch = pipeline_schedule(m, t, pp)
    split = mesh_shape.get("sp", 1) * (mesh_shape.get("tp", 1) if t.sequence_parallel else 1)
    b = microbatch_rows(t, mesh_shape)
    s = m.seq_len // split if m.seq_len % split == 0 else m.seq_len  # not divisible: replicated (sharding.py)
    E = dtype_bytes(compute_dtype)
    slot = b * s * m.d_model * E
    stash = _stash(m, sch, b, E, int(mesh_shape.get("tp", 1))) if sch.split else {}
    costs = transformer.layer_costs(m)
    return {**out, **stash, "schedule": sch.name, "p": pp, "v": sch.chunks, "m": sch.microbatches, "ticks": sch.ticks,
            "bubble": {"table": bubble_fraction(sch), "formula": bubble_formula(sch),
                       "model_costs": bubble_fraction(sch, costs), "costs": dataclasses.astuple(costs)},
            "act_depth": sch.act_depth, "grad_depth": sch.grad_depth, "b": b, "s": s, "d": m.d_model,
            "dtype": str(getattr(compute_dtype, "name", compute_dtype)), "dtype_bytes": E, "slot_bytes": slot,
            "buffer_bytes": (sch.act_depth + sch.grad_depth) * slot,
            "collective_permute": {"count": 2 * sch.ticks, "bytes_per_call": slot, "bytes": 2 * sch.ticks * slot}}


def _stash(m, sch, b: int, E: int, tp: int) -> dict:
    """The W stash of a split backward per device (see `pipeline_theory`)."""
    last = segments(m)[-1]  # the pipelined segment
    per_token = taps.stash_elements(transformer.param_table(m)["blocks"][last.blocks], tp)
    slot = b * m.seq_len * E * last.repeats // (sch.stages * sch.chunks) * per_token
    return {"stash_depth": sch.stash_depth, "stash_slot_bytes": slot, "stash_bytes": (sch.stash_depth + 2) * slot}


def pipeline_compiled(pl: dict, hlo_text: str, compiled: dict) -> dict:
    """The pipeline theory with the compiled program's side: the element type its permutes of one slot
    move ("moved_dtype"; XLA:CPU promotes bf16 collective-permutes to f32), the table's bytes at that
    type ("moved") and the compiled collective-permutes per step ("compiled", all of them)."""
    if not pl["enabled"]:
        return pl
    cp = pl["collective_permute"]
    elements = cp["bytes_per_call"] // pl["dtype_bytes"]
    moved = permute_dtypes(hlo_text, elements)
    moved_dtype = moved[0] if len(moved) == 1 else pl["dtype"]
    per_call = elements * dtype_bytes(moved_dtype)
    return {**pl, "collective_permute": {
        **cp, "moved_dtype": moved_dtype, "compiled_dtypes": moved,
        "moved": {"count": cp["count"], "bytes_per_call": per_call, "bytes": cp["count"] * per_call},
        "compiled": dict(compiled)}}
