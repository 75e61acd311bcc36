"""Multi-token prediction (DeepSeek-V3 §2.2): `model.mtp_depth` = D modules after the main model, module k
predicting the token k + 1 ahead; `train.mtp_weight` = λ.

Module k = 1..D reads h^(k-1) (h^0: the main model's residual stream before its final norm) and the embedding of
the token k ahead:

    h^k = Block_k(W_k · [RMSNorm_e(Emb(t_(i+k))); RMSNorm_h(h^(k-1))])
    p^k = softmax(Head(RMSNorm_k(h^k)))          predicting t_(i+k+1)

sharing the embedding and the output head with the main model; its two input norms, W_k (`eh_proj`), block (the
stack's last block kind) and final norm are its own (`params["mtp"]`, stacked over D, scanned). The embedding comes
first in the joined vector, as in the code that runs DeepSeek-V3's published MTP weights (the paper writes the
hidden state first).

The tokens ahead are batch fields (`with_fields`) made from the batch in its natural order, before the step
reorders or splits it: `mtp_targets_k` = targets shifted left by k (t_(i+k+1); `mtp_targets_0` is `targets`) and
`mtp_mask_k` = 1 where position i + k is in position i's segment and its target counts for the loss, 0 past the
row's end. The objective's token sum gains λ/D · Σ_k Σ_i −log p^k(t_(i+k+1))·mask_k, divided by the same count as
the language-model term (DeepSeek-V3's eq. 24 divides by the whole sequence too), so microbatches, devices and
pipeline stages add it as they add the loss; the metrics `lm_loss` and `mtp_loss` (Σ_k Σ_i −log p^k·mask_k / D)
are its two parts over that count. Evaluation and generation read no MTP field and run none of it; with D = 0
nothing here runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm import stack
from jaxllm.models import transformer
from jaxllm.ops import fp8
from jaxllm.sharding import constrain, weight


def with_fields(batch: dict, depth: int) -> dict:
    """The batch with the MTP fields, from fields in their natural order (global arrays)."""
    if not depth:
        return batch
    targets, segments, counts = batch["targets"], batch["segment_ids"], batch["loss_mask"]

    def ahead(a, k, fill):  # a[:, i + k], `fill` past the row's end
        return jnp.pad(a[:, k:], ((0, 0), (0, min(k, a.shape[1]))), constant_values=fill)

    out = dict(batch)
    for k in range(1, depth + 1):
        same = (ahead(segments, k, 0) == segments) & (segments > 0)
        out[f"mtp_targets_{k}"] = ahead(targets, k, 0)
        out[f"mtp_mask_{k}"] = jnp.where(same, ahead(counts, k, 0), 0).astype(counts.dtype)
    return out


def _runs(m, batch: dict) -> bool:
    """Whether the modules run on this batch: the model has them and the batch their fields (training's)."""
    return bool(m.mtp_depth) and "mtp_targets_1" in batch


def zero_metrics(m, batch: dict) -> dict:
    """The metric sums `output_terms` adds for this batch, at zero (the start of a sum over microbatches)."""
    if not _runs(m, batch):
        return {}
    return {"lm_loss": jnp.float32(0), "mtp_loss": jnp.float32(0)}


def moe_layers(m) -> int:
    """The MTP modules' MoE layers (each module's block is the stack's last kind)."""
    return m.mtp_depth if m.mtp_depth and stack.is_moe(stack.kinds(m)[-1]) else 0


def _lm_sum(logp, lse, batch):
    return jnp.sum(-logp * batch["mask"]), {}


def trunk(params: dict, x, batch: dict, m, dtype):
    """(h^1..h^D stacked [D, b, s, d], the modules' blocks' auxiliary terms) for the main model's residual stream x:
    the modules without their heads (what may hold islands: a pipeline runs it on every stage)."""
    depth, kind = m.mtp_depth, stack.kinds(m)[-1]
    ahead = [batch["targets"]] + [batch[f"mtp_targets_{k}"] for k in range(1, depth)]

    def module(carry, xs):
        h, aux = carry
        p, tokens = xs
        e = transformer.embed(params, tokens, batch["positions"], m, dtype)
        joined = jnp.concatenate([transformer.norm_of(m, p["enorm"], e), transformer.norm_of(m, p["hnorm"], h)], -1)
        z = fp8.einsum("mlp", "bsc,cd->bsd", joined, weight(p["eh_proj"], ("mtp_in", "embed"), dtype))
        z = constrain(z, transformer.ACT)
        z, stats, _ = transformer.BLOCK_APPLY[kind](p["block"], z, batch["positions"], batch["segment_ids"], m, dtype)
        return (z, jax.tree.map(jnp.add, aux, stats) if stats else aux), z

    (_, aux), hs = jax.lax.scan(module, (x, transformer.zero_aux(m)), (params["mtp"], jnp.stack(ahead)))
    return hs, aux


def _heads_sum(params: dict, hs, batch: dict, m, dtype, loss_chunk: int):
    """Σ_k Σ_i −log p^k·mask_k from the modules' outputs hs [D, b, s, d], each through its final norm and the head."""
    depth = m.mtp_depth
    xs = (params["mtp"]["final_norm"], hs, jnp.stack([batch[f"mtp_targets_{k}"] for k in range(1, depth + 1)]),
          jnp.stack([batch[f"mtp_mask_{k}"] for k in range(1, depth + 1)]))

    def head(_, xs):
        norm, z, targets, mask = xs
        total, _ = transformer.head_terms({**params, "final_norm": norm}, z, {"targets": targets, "mask": mask}, m,
                                          dtype, _lm_sum, loss_chunk)
        return None, total

    return jnp.sum(jax.lax.scan(head, None, xs)[1])


def output_terms(params: dict, x, batch: dict, m, dtype, terms, loss_chunk: int = 0, temperature: float = 1.0,
                 mtp_weight: float = 0.0, finish=None, trunk_out=None):
    """The objective's (token sum, metric sums) from the main model's residual stream x (`finish`: a sequence
    objective's stage, `transformer.head_terms`), with the MTP modules' λ/D-weighted sum and the `lm_loss` and
    `mtp_loss` metrics when the model has them and the batch their fields; and the MTP blocks' auxiliary terms
    (none without MTP). `trunk_out`: the modules' `trunk` as already run on x (else it runs here)."""
    total, sums = transformer.head_terms(params, x, batch, m, dtype, terms, loss_chunk, temperature, finish)
    if not _runs(m, batch):
        return total, sums, transformer.zero_aux(m)
    hs, aux = trunk(params, x, batch, m, dtype) if trunk_out is None else trunk_out
    mtp_sum = _heads_sum(params, hs, batch, m, dtype, loss_chunk)
    mean = mtp_sum / m.mtp_depth
    return total + mtp_weight * mean, {**sums, "lm_loss": total, "mtp_loss": mean}, aux


def forward(params: dict, batch: dict, m, dtype, terms, loss_chunk: int = 0, temperature: float = 1.0,
            mtp_weight: float = 0.0, finish=None):
    """`transformer.forward` with the MTP modules: (objective sum, metric sums, auxiliary terms of every block)."""
    x = transformer.embed(params, batch["inputs"], batch["positions"], m, dtype)
    x, aux = transformer.blocks(params["blocks"], x, batch["positions"], batch["segment_ids"], m, dtype)
    total, sums, more = output_terms(params, x, batch, m, dtype, terms, loss_chunk, temperature, mtp_weight, finish)
    return total, sums, jax.tree.map(jnp.add, aux, more)
