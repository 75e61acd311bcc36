"""Attention by cuDNN's fused kernel, through `jax.nn.dot_product_attention(implementation="cudnn")` (GPU).

Its public API masks by index (`is_causal`) and by a local window; it takes no positions, no segment ids, no
soft cap, and v's head dimension must be q's (narrower values, latent attention's, are zero-padded to it and
the output sliced: exact). So it computes the interface's rule exactly when every row is
one segment whose positions are its index: jaxllm's pre-training rows (`data.format = "text"` with the
language-model objective), which the caller vouches for (`one_segment_rows`); packed fine-tuning rows, GRPO's
padded rollouts and a decode step against a cache are not such rows. cuDNN's own limits: bf16 or fp16
operands, a head dimension that is a multiple of 8 and at most 256 (Hopper; 128 before it). The score scale is
passed to the kernel (it scales in fp32, where the other implementations scale q in its own dtype first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.ops.masking import Masking, values_as_wide_as_keys

DTYPES = ("bfloat16", "float16")


def supports(masking: Masking, q_shape, k_shape, v_shape, dtype, one_segment_rows: bool) -> str | None:
    """None when cuDNN's kernel computes this call exactly as `dot_product_attention` does, else a one-line reason."""
    dk, dv = q_shape[-1], v_shape[-1]
    if not one_segment_rows:
        return "cudnn takes no segment ids or positions: only rows of one segment at their index (pre-training text)"
    if jnp.dtype(dtype).name not in DTYPES:
        return f"cudnn computes in {' or '.join(DTYPES)}, not {jnp.dtype(dtype).name}"
    if masking.softcap:
        return "cudnn takes no soft cap"
    if dv > dk or dk % 8 or dk > 256:
        return f"cudnn needs a key head dimension that is a multiple of 8 up to 256 and values no wider (got {dk} and {dv})"
    if not isinstance(masking.window, int):
        return "cudnn takes one window for every layer"
    if not isinstance(masking.chunk, int) or masking.chunk:
        return "cudnn cannot mask by attention chunks (model.attention_chunk)"
    return None


def cudnn_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking: Masking):
    """cuDNN's fused attention, causal by index (with the window), grouped queries as they are. Positions and
    segment ids are not read: `supports` says when that is exact."""
    del q_pos, k_pos, q_seg, k_seg
    window, dv = masking.window, v.shape[-1]
    out = jax.nn.dot_product_attention(q, k, values_as_wide_as_keys(v, q.shape[-1]),
                                       scale=masking.score_scale(q.shape[-1]), is_causal=True,
                                       local_window_size=(window - 1, 0) if window else None, implementation="cudnn")
    return out[..., :dv]
