"""A decode step's attention over each row's pages, by the Pallas paged-attention kernel JAX ships for GPUs.

The rollout engine's pools hold keys and values heads first, [kv_heads, n_pages, page, head_dim] (every layer's
pages one pool, a layer's table offset to its own), the layout this kernel (and JAX's TPU one) reads, so a decode
step hands it the pool, the rows' page tables and
their lengths, and the kernel reads only the pages a row holds instead of XLA gathering them into a
[rows, slots, ...] copy first. One query per row, causal by length (a row at position p sees positions
0 .. p: the engine writes a request's tokens at their positions), grouped queries by kv head (query head i
reads kv head i // (heads / kv_heads), as everywhere in jaxllm), the soft cap as the model's; the score scale is
applied to the queries first (the kernel has none).

Where it fits (`fits`): no sliding window and no attention chunks on any layer (a per-layer window can be a traced value, and the
kernel has none), keys and values of one width (not latent attention, whose pool holds latent rows), and
Triton's smallest dot: head_dim and the page a multiple of 16. Elsewhere, and on TPU (JAX's TPU paged kernel
takes no interpret mode, so its numbers cannot be checked off a TPU), the pages are gathered by XLA.

The kernel splits each row's table into `k_splits` partitions of whole compute blocks and combines their
partial softmaxes; the table is padded with page 0 (scratch) up to that shape, past the row's length, where the
kernel skips whole partitions and masks the rest. Its final division adds float32's eps to the softmax's
denominator (≥ 1): a relative change under 1.2e-7.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax.numpy as jnp

from jaxllm.ops.masking import Masking

KERNELS = ("pallas_gpu",)  # the paged kernels jaxllm calls; None (XLA's gather) elsewhere


class Tuning(NamedTuple):
    """The kernel's launch shape: at most `max_splits` partitions of a row's pages, compute blocks of at most
    `block_pages` pages, Triton's warps and pipeline stages. The defaults are the kernel's own;
    `tools.bench.paged_kernel` times the others at a decode shape."""

    max_splits: int = 16
    block_pages: int = 8
    num_warps: int = 8
    num_stages: int = 2


DEFAULT = Tuning()


def fits(latent: bool, window: int, head_dim: int, page: int, chunk: int = 0) -> bool:
    """Whether the GPU paged kernel computes a model's decode attention exactly: keys and values, not latent rows;
    no sliding window and no attention chunks (`model.attention_chunk`); Triton's smallest dot for the head and the
    page."""
    return not latent and not window and not chunk and head_dim % 16 == 0 and page % 16 == 0


def _kernel():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
    return gpu_paged


def partitions(width: int, tuning: Tuning = DEFAULT) -> tuple[int, int, int]:
    """(k_splits, pages per compute block, padded table width) for tables of `width` pages: up to
    `tuning.max_splits` partitions of whole compute blocks of up to `tuning.block_pages` pages, a power of two (the
    kernel's Triton lowering takes only arrays of power-of-two sizes: 3 pages a block stopped a decode at 64-token
    pages on an H200)."""
    splits = min(tuning.max_splits, width)
    per = -(-width // splits)
    block = min(tuning.block_pages, 1 << (per - 1).bit_length())
    per = -(-per // block) * block
    return splits, block, splits * per


def attend(q, k_pool, v_pool, pages, lengths, masking: Masking, interpret: bool = False,
           tuning: Tuning | None = None):
    """Attention of q [rows, 1, heads, d] over k_pool, v_pool [kv_heads, n_pages, page, d] through each row's
    `pages` [rows, width], seeing its first `lengths` [rows] positions, launched as `tuning` (None: `DEFAULT` as it
    is when traced, which `tools.bench.engine_decode --tuning-from` sets). Returns [rows, 1, heads, d] in q's
    dtype."""
    tuning = tuning or DEFAULT
    splits, block, width = partitions(pages.shape[1], tuning)
    table = jnp.pad(pages, ((0, 0), (0, width - pages.shape[1])))
    scaled = q[:, 0] * jnp.asarray(masking.score_scale(q.shape[-1]), q.dtype)
    out = _kernel().paged_attention(scaled, k_pool.astype(q.dtype), v_pool.astype(q.dtype), table,
                                    lengths.astype(jnp.int32), block_h=16, pages_per_compute_block=block,
                                    k_splits=splits, num_warps=tuning.num_warps, num_stages=tuning.num_stages,
                                    interpret=interpret,
                                    attn_logits_soft_cap=masking.softcap or None)
    return out[:, None].astype(q.dtype)

