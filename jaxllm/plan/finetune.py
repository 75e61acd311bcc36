"""Fine-tuning's train state per device: full fine-tuning, LoRA and QLoRA of the same model on the same mesh.

Read from each variant's abstract state (no compiling): the frozen base, the trained parameters, the
optimizer state and the step's other arguments; a variant the model cannot run gives its reason.
"""

from __future__ import annotations

import copy
import math

import jax

from jaxllm.config import validate
from jaxllm.errors import UserError
from jaxllm.mesh import make_mesh
from jaxllm.models import lora
from jaxllm.plan.memory import device_bytes
from jaxllm.trainer.step import make_step_fns, trained

FINETUNE = {"full": (0, "none"), "lora": (None, "none"), "qlora_nf4": (None, "nf4")}  # (rank, base_quant)


def finetune_state(cfg, shape: dict) -> dict:
    """The train state's bytes per device for full fine-tuning, LoRA and QLoRA (nf4) of this model on this mesh
    (`model.lora.rank`, else 8, on its targets), read from each one's abstract state (no compiling): the frozen
    base, the trained parameters (fp32) and the optimizer state. A variant the model cannot run gives its reason."""
    out = {}
    for name, (rank, quant) in FINETUNE.items():
        variant = copy.deepcopy(cfg)
        variant.model.lora.rank = cfg.model.lora.rank or 8 if rank is None else rank
        variant.model.lora.base_quant = quant
        try:
            validate(variant, math.prod(shape.values()))
        except UserError as e:
            out[name] = {"refused": str(e)}
            continue
        fns = make_step_fns(variant, make_mesh(shape, variant))
        state = fns.abstract_state
        train, frozen = lora.split(state.params, trained(variant.model)[1])
        parts = {"base_bytes": device_bytes(frozen), "trained_bytes": device_bytes(train),
                 "optimizer_bytes": device_bytes(state.opt_state)}
        adapted = [x.w for x in jax.tree.leaves(state.params, is_leaf=lora.is_node) if lora.is_node(x)]
        # the step's other arguments: its counters, the guard and the batch
        rest = device_bytes((state.step, state.applied, state.guard,
                             fns.abstract_batch(cfg.train.global_batch, cfg.model.seq_len)))
        out[name] = {**parts, "total_bytes": sum(parts.values()), "argument_bytes": sum(parts.values()) + rest,
                     "adapted_base_bytes": device_bytes(adapted)}  # the base's weights that carry adapters
    return out
