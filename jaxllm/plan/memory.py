"""What a device holds: the ZeRO theory of the train state, and the per-device sizes the other estimates share.

`theory` gives the train state's bytes per device at each ZeRO stage, with Φ = parameter count and
N = `fsdp` size, for this project's layout (fp32 params, grads and Adam moments: the compiled step's
arguments and its total) and for the seeds' bf16 layout. It assumes Adam (two fp32 moments per parameter)
and takes Φ per device (`plan.pipeline.stage_params`: a pipeline stage's share, 1/ep of the experts, 1/tp of
what tensor parallelism splits).

The sizes: bytes per element of a dtype (`dtype_bytes`), rows a device holds of one microbatch
(`microbatch_rows`), the devices ZeRO shards the state over (`zero_shards`), and bytes per device of an abstract
tree's shards (`device_bytes`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxllm.mesh import batch_shards
from jaxllm.models.transformer import logit_bytes_per_token, residual_bytes_per_token
from jaxllm.trainer.step import loss_chunk

THEORY_ASSUMES = ("Adam (2 fp32 moments per parameter); Φ per device: a pipeline stage's share, 1/ep of the "
                  "experts, 1/tp of what tensor parallelism splits; step counters and the batch are left out")

# Bytes per parameter per device as (replicated part a, sharded part b): a·Φ + b·Φ/N.
# fp32: this project's train state (fp32 params = master copy, fp32 grads, fp32 Adam mu and nu).
_FP32_TOTAL = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}
# What the compiled step takes as arguments: the state (params + moments); grads are temporaries.
_FP32_ARGS = {0: (12, 0), 1: (4, 8), 2: (4, 8), 3: (0, 12)}
# The seeds' table: bf16 params and grads beside an fp32 master copy and fp32 Adam moments.
_BF16_TOTAL = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


def zero_shards(shape: dict, train) -> int:
    """The devices ZeRO shards the master weights and the optimizer state over: fsdp, times dp under hpZ
    (`train.zeropp.hpz`)."""
    return shape["fsdp"] * (shape["dp"] if train.zeropp.hpz else 1)


def _formula(a: int, b: int) -> str:
    parts = ([f"{a}Φ"] if a else []) + ([f"{b}Φ/N"] if b else [])
    return " + ".join(parts) or "0"


def _bytes(ab: tuple[int, int], n_params: int, fsdp: int) -> int:
    a, b = ab
    return int(round(a * n_params + b * n_params / fsdp))


def theory(n_params: int, fsdp: int, stage: int) -> dict:
    """ZeRO theory per device for Φ = `n_params` parameters over N = `fsdp` devices.

    Returns {"assumes", "params", "fsdp", "stage",
             "fp32": {"total_bytes", "argument_bytes", "total_formula", "argument_formula",
                      "stages": {"0".."3": same four keys}},
             "bf16_seeds": {"total_bytes", "total_formula", "stages": {"0".."3": same two keys}}}
    where the top-level numbers of each layout are the row for `stage`.
    """
    if stage not in _FP32_TOTAL:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if fsdp < 1:
        raise ValueError(f"fsdp must be at least 1, got {fsdp}")
    fp32 = {str(s): {"total_bytes": _bytes(_FP32_TOTAL[s], n_params, fsdp),
                     "argument_bytes": _bytes(_FP32_ARGS[s], n_params, fsdp),
                     "total_formula": _formula(*_FP32_TOTAL[s]),
                     "argument_formula": _formula(*_FP32_ARGS[s])} for s in _FP32_TOTAL}
    bf16 = {str(s): {"total_bytes": _bytes(_BF16_TOTAL[s], n_params, fsdp),
                     "total_formula": _formula(*_BF16_TOTAL[s])} for s in _BF16_TOTAL}
    return {"assumes": THEORY_ASSUMES, "params": int(n_params), "fsdp": int(fsdp), "stage": int(stage),
            "fp32": {**fp32[str(stage)], "stages": fp32},
            "bf16_seeds": {**bf16[str(stage)], "stages": bf16}}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype or its name ("bfloat16": 2)."""
    return jnp.dtype(dtype).itemsize


def microbatch_rows(t, mesh_shape: dict) -> int:
    """Rows one device holds of one microbatch: global_batch / microbatches / (dp·fsdp·ep)."""
    return t.global_batch // t.microbatches // batch_shards(mesh_shape)


def device_bytes(tree) -> int:
    """Bytes per device of an abstract tree's leaves (each its shard; 4-bit codes at half a byte)."""

    def bits(dtype) -> int:
        kind = jnp.iinfo if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo
        return 8 if dtype == jnp.bool_ else kind(dtype).bits

    return sum(-(-math.prod(a.sharding.shard_shape(a.shape)) * bits(a.dtype) // 8) for a in jax.tree.leaves(tree))


def loss_theory(cfg, mesh_shape: dict) -> dict:
    """The head's logits per device and microbatch (fp32, the padded vocabulary over tp; as many again for their
    gradient) beside the residual stream the layers keep, and the positions per loss chunk they give
    (`train.loss_chunk`, -1: `transformer.default_loss_chunk`'s rule; 0: whole)."""
    m, tokens = cfg.model, microbatch_rows(cfg.train, mesh_shape) * cfg.model.seq_len // mesh_shape["sp"]
    return {"logit_bytes": tokens * logit_bytes_per_token(m, mesh_shape["tp"]),
            "residual_bytes": tokens * residual_bytes_per_token(m, cfg.precision.compute),
            "setting": cfg.train.loss_chunk, "chunk": loss_chunk(cfg, mesh_shape)}
