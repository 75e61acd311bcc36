"""The mask rule and the scores every attention implementation shares.

A query sees a key when their segment ids are equal and 0 ≤ q_pos − k_pos (< window, when a window is
set; and q_pos // chunk = k_pos // chunk, when a chunk is set: Llama 4's chunked local attention): causal by
*position*, so reordered sequences and packed documents work. Scores are fp32:
(q · scale)·k, then cap·tanh(score/cap) with a soft cap (Gemma 2), then the mask. Queries are grouped
by the K/V head they share ([b, t, kv, g, d]), so grouped-query attention never repeats K/V.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from einops import rearrange

NEG_INF = -1e30  # finite, so fully masked rows never produce NaN


@dataclass(frozen=True)
class Masking:
    """What a query may see and how its scores are shaped, beyond causal-by-position within a segment.

    window: a key is visible when q_pos − k_pos < window (0: no window); an int, or a traced int32
    scalar when the window differs by layer. softcap: scores → softcap·tanh(scores/softcap) before the
    mask (0: none). scale: the score scale (None: 1/√head_dim; Gemma's query_pre_attn_scalar^−½). chunk: a key
    is visible when q_pos // chunk = k_pos // chunk (0: no chunks; Llama 4's `attention_chunk_size`); an int, or a
    traced int32 scalar when it differs by layer."""

    window: int | jax.Array = 0
    softcap: float = 0.0
    scale: float | None = None
    chunk: int | jax.Array = 0

    def score_scale(self, head_dim: int) -> float:
        return head_dim ** -0.5 if self.scale is None else self.scale

    def limits(self) -> dict:
        """The mask's integers as traced int32 scalars, for a custom VJP or a shard_map island to carry: the
        window always, the chunk only when one is set (a Python 0 stays out, so a run without chunks traces what
        it always has)."""
        out = {"window": jnp.asarray(self.window, jnp.int32)}
        if not is_off(self.chunk):
            out["chunk"] = jnp.asarray(self.chunk, jnp.int32)
        return out

    def with_limits(self, limits: dict) -> "Masking":
        """This masking with `limits` (`limits()`'s dict, traced) in place of its window and chunk."""
        return dataclasses.replace(self, **limits)


CAUSAL = Masking()


def is_off(limit) -> bool:
    """A window or chunk known at trace time to be 0 (none)."""
    return isinstance(limit, int) and limit == 0


def same_chunk(q_pos, k_pos, chunk):
    """q_pos // chunk == k_pos // chunk (broadcast as given), true everywhere where chunk ≤ 0 (a traced chunk)."""
    if isinstance(chunk, int):
        return q_pos // chunk == k_pos // chunk
    c = jnp.maximum(chunk, 1)  # no division by 0 where the layer has no chunks
    return (chunk <= 0) | (q_pos // c == k_pos // c)


def visible(q_pos, k_pos, q_seg, k_seg, window=0, chunk=0) -> jax.Array:
    """[b, t, s]: whether each query sees each key (same segment, 0 ≤ q_pos − k_pos < window or no window, and
    in the same chunk of positions or no chunks)."""
    mask = (q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
    if not is_off(window):
        mask = mask & ((window <= 0) | (q_pos[:, :, None] - k_pos[:, None, :] < window))
    if not is_off(chunk):
        mask = mask & same_chunk(q_pos[:, :, None], k_pos[:, None, :], chunk)
    return mask


def grouped(q, kv_heads: int):
    """[b, t, h, d] -> [b, t, kv, g, d]: the query heads that share each K/V head."""
    return rearrange(q, "b t (k g) d -> b t k g d", k=kv_heads)


def ungrouped(x):
    return rearrange(x, "b t k g d -> b t (k g) d")


def grouped_sinks(sinks, kv_heads: int):
    """Attention sinks [h] -> [kv, g] fp32, grouped as `grouped` groups the query heads."""
    return sinks.astype(jnp.float32).reshape(kv_heads, -1)


def values_as_wide_as_keys(v, dk: int):
    """v [b, s, kv, dv] zero-padded to dk: for kernels that take one head dimension. The padded columns of the
    output are zeros (each output row is a weighted sum of value rows) and are sliced off, so the first dv are
    the call's exactly, gradients included (a pad's and a slice's transposes)."""
    return jnp.pad(v, ((0, 0),) * 3 + ((0, dk - v.shape[-1]),))


def capped(scores, softcap: float):
    """Gemma 2's logit soft cap (softcap = 0: the scores as they are)."""
    return softcap * jnp.tanh(scores / softcap) if softcap else scores


def scores_of(qg, k, masking: Masking, equation: str = "btkgd,bskd->bkgts"):
    """fp32 scores [b, kv, g, t, s] of grouped queries qg [b, t, kv, g, dk] against k [b, s, kv, dk], capped
    (another `equation` for keys and scores laid out otherwise). The scale multiplies q in its own dtype, before
    the product, as it always has (bitwise today's numbers)."""
    qg = qg * masking.score_scale(qg.shape[-1])
    return capped(jnp.einsum(equation, qg, k, preferred_element_type=jnp.float32), masking.softcap)
