"""What each matmul format keeps for the backward, per device, without compiling (`precision.matmul`).

A covered weight matmul y = x·w keeps, for its two gradients, per element of its input x and of its weight w
(`PER_ELEMENT`, checked against JAX's saved residuals of one matmul in tests/test_plan.py):
- `default`: x and w in the compute dtype (B bytes each);
- `fp8`: x and w in E4M3, 1 byte each (and two fp32 scalars);
- `fp8_block`: x in E4M3 with an fp32 scale per 128 tokens of a channel (1 + 4/128 bytes), w in E4M3 with one per
  128 × 128 block (1 + 4/128² bytes);
- `mxfp8`: x and w as they came (B bytes): the scaled dot quantizes again for each gradient.

The step's figure counts the dense layers' attention (q, k, v: the residual width each; o: heads × head_dim) and
MLP (gate and up, or in: the residual width; down: d_ff) inputs over a device's tokens of one microbatch, and
their weights as used (split over tp), each matmul with its own copy of its input (q, k and v quantize the same
x alike, which XLA may share). Expert and latent-attention layers are not estimated (said in the report).
"""

from __future__ import annotations

from jaxllm.models import attention
from jaxllm.ops import fp8
from jaxllm.plan.memory import dtype_bytes, microbatch_rows
from jaxllm.stack import segments

FORMATS = ("default", "fp8", "fp8_block", "mxfp8")


def per_element(fmt: str, compute_bytes: int) -> tuple[float, float]:
    """(bytes per input element, bytes per weight element) a covered matmul keeps for its backward in `fmt`."""
    return {"default": (compute_bytes, compute_bytes), "fp8": (1, 1), "fp8_block": (1 + 4 / 128, 1 + 4 / 128 ** 2),
            "mxfp8": (compute_bytes, compute_bytes)}[fmt]


def _dense_widths(cfg, tp: int) -> tuple[dict[str, int], dict[str, int]]:
    """Per covered group of one dense layer: (the inputs' width summed over its matmuls, its weights' elements per
    tp rank)."""
    m, covered = cfg.model, set(fp8.GROUPS) - set(cfg.precision.fp8_exclude)
    hd = attention.head_dim(m)
    q, kv = m.n_heads * hd, attention.kv_heads(m) * hd
    gated = m.mlp != "gelu_tanh"
    inputs = {"attention": 3 * m.d_model + q, "mlp": (2 if gated else 1) * m.d_model + m.d_ff}
    weights = {"attention": (m.d_model * (q + 2 * kv) + q * m.d_model) // tp,
               "mlp": ((3 if gated else 2) * m.d_model * m.d_ff) // tp}
    return ({g: w for g, w in inputs.items() if g in covered}, {g: w for g, w in weights.items() if g in covered})


def matmul_formats(cfg, shape: dict) -> dict:
    """{"tokens", "dense_layers", "other_layers", "formats": {fmt: {"input_bytes", "weight_bytes", "x", "w"}}}:
    a step's bytes kept for the backward by the covered matmuls of the dense layers, per device and
    microbatch, in each format (the run's covered groups; `default` with the groups fp8 would cover)."""
    m = cfg.model
    tokens = microbatch_rows(cfg.train, shape) * m.seq_len // shape["sp"]
    dense = sum(seg.repeats * seg.pattern.count("dense") for seg in segments(m)) // shape["pp"]
    other = m.n_layers // shape["pp"] - dense if m.attention != "mla" else m.n_layers // shape["pp"]
    dense = 0 if m.attention == "mla" else dense
    inputs, weights = _dense_widths(cfg, shape["tp"])
    out = {}
    for fmt in FORMATS:
        x, w = per_element(fmt, dtype_bytes(cfg.precision.compute))
        out[fmt] = {"x": x, "w": w, "input_bytes": int(dense * tokens * sum(inputs.values()) * x),
                    "weight_bytes": int(dense * sum(weights.values()) * w)}
    return {"tokens": tokens, "dense_layers": dense, "other_layers": other, "groups": sorted(inputs),
            "formats": out}

