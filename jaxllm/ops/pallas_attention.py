"""Attention by JAX's own Pallas kernels: Splash attention on TPU (`pallas_tpu`) and the Triton
FlashAttention kernel on GPU (`pallas_gpu`), behind the interface of `ops/attention.py`, with
`supports` saying, before anything is traced, whether a kernel computes a given call exactly.

Both kernels mask by *index*, not by position: a query at index i sees a key at index j when their
segment ids are equal and j ≤ i (and, for Splash, i − j < window). The interface's rule is by position:
0 ≤ q_pos − k_pos (< window). The two agree for every (i, j) of one segment when

    q_pos[b, i] − k_pos[b, j] == i − j   for every query i and key j of the same segment,

i.e. within each segment the positions are the index plus one offset shared by the queries and the
keys of that segment. Plain rows (positions 0..t−1) are such rows; so are packed rows whose
documents restart their positions at 0 (a document starting at index a has positions i − a); rows
in a load-balanced (zig-zag) order, or a decode step's queries against a longer cache, are not.
Nothing traced can check this cheaply, so the caller asserts it: `supports(..., positions_are_index=True)`.
The kernels read no positions at all (the arguments are there for the interface).

Scale, soft cap, grouped queries, precision: q is multiplied by the score scale in its own dtype before
the kernel (as `masking.scores_of` does), the kernels run with scale 1; Splash's soft cap is
cap·tanh(s/cap) on the scaled scores, as ours; query head h reads K/V head h // (h / kv), as
`masking.grouped` (Splash indexes its K/V heads this way itself; the Triton kernel has no grouped
queries, so K/V are repeated to h heads with `jnp.repeat`, whose transpose sums the heads' gradients
back). Both accumulate in fp32 and return q's dtype.

The Pallas modules are imported inside the functions: importing this module costs nothing and works
on JAX versions that move or drop them. `interpret=True` runs either kernel on CPU (tests).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

from jaxllm.ops.masking import Masking, values_as_wide_as_keys

IMPLEMENTATIONS = ("pallas_tpu", "pallas_gpu")
TPU_LANES = 128  # Splash's key blocks (and so the sequences) are multiples of the TPU's 128 lanes


def _block(n: int, sizes) -> int | None:
    """The largest of `sizes` that divides n."""
    return next((b for b in sizes if n % b == 0), None)


def supports(impl: str, masking: Masking, q_shape, k_shape, v_shape, positions_are_index: bool | None) -> str | None:
    """None when `impl` computes this call exactly as `dot_product_attention` does, else a one-line reason.

    Shapes are the interface's: q [b, t, h, dk], k [b, s, kv, dk], v [b, s, kv, dv]. positions_are_index:
    the caller's word that within each segment q_pos − k_pos equals the index difference (module doc);
    None (unknown) is a no."""
    if impl not in IMPLEMENTATIONS:
        return f"'{impl}' is not one of {', '.join(IMPLEMENTATIONS)}"
    _, t, h, dk = q_shape
    _, s, kv, dk_k = k_shape
    dv = v_shape[-1]
    if h % kv or dk != dk_k or tuple(k_shape[:3]) != tuple(v_shape[:3]):
        return f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)} are not the interface's shapes"
    if not positions_are_index:
        return (f"{impl} masks by index, not position: custom positions (or positions not known to be each "
                f"segment's index plus an offset)")
    if not isinstance(masking.chunk, int) or masking.chunk:
        return f"{impl} cannot mask by attention chunks (model.attention_chunk)"
    window = masking.window
    if not isinstance(window, int):
        return f"{impl} needs a window fixed at trace time (a Python int), not a traced one"
    if impl == "pallas_tpu":
        if t % TPU_LANES or s % TPU_LANES:
            return f"pallas_tpu needs sequence lengths that are multiples of {TPU_LANES} (t={t}, s={s})"
        return None
    if window > 0:
        return "pallas_gpu takes no sliding window"
    if masking.softcap:
        return "pallas_gpu takes no soft cap"
    if dv > dk:
        return f"pallas_gpu needs values no wider than keys (dv={dv}, dk={dk}; narrower ones are zero-padded)"
    if t != s:
        return f"pallas_gpu is self-attention only: one sequence length and one set of segment ids (t={t}, s={s})"
    if _block(t, (128, 64, 32, 16)) is None:
        return f"pallas_gpu needs a sequence length that is a multiple of 16 (t={t})"
    return None


def _check(impl, masking, q, k, v):
    reason = supports(impl, masking, q.shape, k.shape, v.shape, positions_are_index=True)
    if reason:
        raise ValueError(reason)


def _splash_kernel(heads: int, t: int, s: int, window: int, softcap: float, block_q: int, block_kv: int,
                   interpret: bool):
    """A Splash kernel, made in each trace (it holds its mask tables as arrays of that trace; Splash
    caches the NumPy work of building them, by mask and block shape)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.CausalMask((t, s), offset=0)
    if window > 0:  # keeps q − (window − 1) ≤ k ≤ q
        mask = mask & sa.LocalMask((t, s), window_size=(window - 1, 0), offset=0)
    sizes = sa.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                          block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                          block_q_dq=block_q, block_kv_dq=block_kv)
    return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=sizes,
                              attn_logits_soft_cap=softcap or None, head_shards=1, q_seq_shards=1,
                              interpret=interpret), sa.SegmentIds


def pallas_tpu(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking, interpret: bool = False,
               block: int | None = None):
    """Splash attention (TPU): causal by index within segments, windows, soft caps, grouped queries,
    dv ≠ dk. Returns [b, t, h, dv] in q's dtype. `block`: the q and k block (a multiple of 128 dividing
    t and s; None: the largest of 512, 256, 128 that does). q_pos, k_pos are not read (module doc)."""
    del q_pos, k_pos
    _check("pallas_tpu", masking, q, k, v)
    t, h, s = q.shape[1], q.shape[2], k.shape[1]
    block_q = block or _block(t, (512, 256, 128))
    block_kv = block or _block(s, (512, 256, 128))
    kernel, segment_ids = _splash_kernel(h, t, s, masking.window, float(masking.softcap), block_q, block_kv,
                                         interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [b, t, h, d] -> [b, h, t, d]
    q = q * masking.score_scale(q.shape[-1])
    out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=segment_ids(q=qs, kv=ks)))(
        heads_first(q), heads_first(k), heads_first(v), q_seg.astype(jnp.int32), k_seg.astype(jnp.int32))
    return heads_first(out).astype(q.dtype)


def _triton():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as triton_attention
    return triton_attention


def _triton_sizes(triton_attention, t: int, block: int | None):
    fwd = block or _block(t, (128, 64, 32, 16))
    bwd = min(fwd, 64)
    return triton_attention.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd,
                                       block_kv_dq=bwd)


def _heads_of_queries(k, h: int):
    """K or V with each KV head repeated for its group of query heads (the Triton kernel has no grouped queries)."""
    return k if k.shape[2] == h else jnp.repeat(k, h // k.shape[2], axis=2)


def pallas_gpu_pair(q, k, v, causal: bool, scale: float, interpret: bool = False, block: int | None = None):
    """One (query block, key block) pair of rows of one segment by the Triton kernel, for a ring that combines
    pairs (`parallel/ring_attention.py`): (out [b, t, h, d] in q's dtype, lse [b, h, t] fp32, natural log of each
    row's Σ exp(scores)). `causal`: the two blocks are one (key j seen by query i ≥ j); else every key is seen. Not
    differentiable: the ring's VJP calls `pallas_gpu_pair_grads`."""
    triton_attention, h = _triton(), q.shape[2]
    out, lse2 = triton_attention.mha(q * jnp.asarray(scale, q.dtype), _heads_of_queries(k, h),
                                     _heads_of_queries(v, h), None, sm_scale=1.0, causal=causal,
                                     block_sizes=_triton_sizes(triton_attention, q.shape[1], block),
                                     interpret=interpret, return_residuals=True)
    return out, lse2 * math.log(2.0)  # the kernel's lse is in base 2


def pallas_gpu_pair_grads(q, k, v, out, lse, d_out, causal: bool, scale: float, interpret: bool = False,
                          block: int | None = None):
    """(dq, dk, dv) of one pair's share of the whole row's attention, whose output `out` and `lse` (natural log,
    [b, h, t]) are those of every pair together: the Triton backward kernel recomputes the pair's probabilities
    from that lse. (jax's `_mha_backward`: no public entry takes another call's residuals.)"""
    triton_attention, h, kv = _triton(), q.shape[2], k.shape[2]
    if not hasattr(triton_attention, "_mha_backward"):
        raise NotImplementedError("this JAX's Pallas Triton attention has no _mha_backward; use the chunked kernel")
    sizes = _triton_sizes(triton_attention, q.shape[1], block)
    residuals = (q * jnp.asarray(scale, q.dtype), _heads_of_queries(k, h), _heads_of_queries(v, h), None, out,
                 lse / math.log(2.0))
    dq, dk, dv, _ = triton_attention._mha_backward(1.0, causal, sizes, "triton", None, 2, None, interpret, False,
                                                   False, residuals, d_out)
    group = lambda g: g if kv == h else g.reshape(*g.shape[:2], kv, h // kv, g.shape[-1]).sum(3)
    return dq * jnp.asarray(scale, dq.dtype), group(dk), group(dv)


def pallas_gpu(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking, interpret: bool = False,
               block: int | None = None):
    """The Pallas Triton FlashAttention kernel (GPU): self-attention causal by index within segments,
    grouped queries by repeating K/V, values narrower than keys zero-padded to their width (latent attention),
    no window or soft cap. One set of segment ids serves queries and keys: q_seg's (k_seg must equal it, as in
    self-attention). Returns [b, t, h, dv] in q's dtype. `block`: the forward's q and k block (None: the largest
    of 128, 64, 32, 16 dividing t); the backward's blocks are at most 64."""
    del q_pos, k_pos, k_seg
    _check("pallas_gpu", masking, q, k, v)
    triton_attention, h, dv = _triton(), q.shape[2], v.shape[-1]
    # query head i reads K/V head i // (h / kv): each K/V head repeated for its group, in order
    k, v = _heads_of_queries(k, h), _heads_of_queries(values_as_wide_as_keys(v, q.shape[-1]), h)
    q = q * masking.score_scale(q.shape[-1])
    out = triton_attention.mha(q, k, v, q_seg.astype(jnp.int32), sm_scale=1.0, causal=True,
                               block_sizes=_triton_sizes(triton_attention, q.shape[1], block),
                               backward_pass_impl="triton", interpret=interpret)
    return out[..., :dv].astype(q.dtype)
