"""FLOPs per step per device: the compiled program's matmuls beside the model's, and a roofline step time.

- compiled: the matmuls of the compiled step (`dot`s, and on a GPU the cuBLAS calls and cuDNN's fused attention
  XLA rewrites them into), each run as often as its loops run it (`hlo.executed_matmul_flops`; XLA's own
  `cost_analysis` counts a loop body once, and counts elementwise work too); a Pallas kernel's call states no
  FLOPs, so those calls are counted apart and make the figure a lower bound;
- model: the model FLOPs per token MFU divides by (`trainer.loop.flops_per_token`: 6N + 6·L·S·width, attention's
  causal half of the S×S scores) times the step's tokens, over the devices;
- model as computed: the same with attention's full S×S, which `dense` computes whatever the mask (the chunked
  kernel and the fused ones skip most masked blocks: for them the model's count is the one to compare);
- the ratio compiled / model is HFU / MFU: 1 plus what recomputation runs again (with `model.remat = "full"`
  every layer's forward but its last matmul, the head's not: `recomputed_flops_per_token`).

`--chip` adds a roofline: the step cannot take less than the compiled FLOPs at the chip's peak, nor than the
bytes its top-level operations read and write (`hlo.executed_bytes`) at its HBM bandwidth.
"""

from __future__ import annotations

import math

from jaxllm.errors import ConfigError
from jaxllm import stack
from jaxllm.models import attention, gated_deltanet, lora, transformer
from jaxllm.plan.hlo import executed_bytes, executed_matmul_flops
from jaxllm.trainer.loop import flops_per_token

# peak dense bf16 FLOP/s, HBM bytes/s and interconnect bytes/s one chip receives at (vendor specifications:
# NVLink 4's 900 GB/s is both ways, 450 GB/s in; TPU ICI as Google lists it per chip, 4,800 and 3,584 Gbit/s)
CHIPS = {"h100": (989e12, 3.35e12, 450e9), "h200": (989e12, 4.8e12, 450e9), "tpu-v5p": (459e12, 2.765e12, 600e9),
         "tpu-v6e": (918e12, 1.64e12, 448e9)}


def check_chip(chip: str | None) -> None:
    """ConfigError (one line) for a chip the roofline has no numbers for."""
    if chip is not None and chip not in CHIPS:
        raise ConfigError(f"--chip {chip}: not one of {', '.join(CHIPS)}")


def full_attention_flops_per_token(cfg) -> float:
    """What the causal half leaves out of attention's training FLOPs per token: 6·L·S·width (L the attention
    layers)."""
    m = lora.base_model(cfg.model)
    return 6.0 * stack.attention_layers(m) * m.seq_len * attention.score_width(m)


def recomputed_flops_per_token(cfg) -> float:
    """The forward FLOPs per token `model.remat = "full"` runs again: every layer's matmuls (2·N of the layers)
    and its attention over the full S×S (4·L·S·width), less each layer's last matmul (the MLP's output
    projection: its output only joins the residual stream, which the next layer keeps, so XLA drops its
    recomputation), and not the head's."""
    m = lora.base_model(cfg.model)
    layers = transformer.count_params(m, embeddings=False, active=True)
    last = sum(math.prod(leaf.shape) for block in transformer.param_table(m)["blocks"] if "mlp" in block
               for name, leaf in block["mlp"].items() if name in ("w_down", "w_out"))
    linear = (m.n_layers - stack.attention_layers(m)) * gated_deltanet.recurrence_flops_per_token(
        gated_deltanet.sizes_of(m), m.linear_attn.chunk) / 3  # the recurrence's forward
    return 2.0 * (layers - last) + 4.0 * stack.attention_layers(m) * m.seq_len * attention.score_width(m) + linear


def recomputed_head_flops_per_token(cfg, loss_chunk: int) -> float:
    """The head's forward FLOPs per token a chunked loss (`train.loss_chunk` resolved, > 0) runs again in its
    backward (`models/chunked_loss` recomputes each chunk's logits): the logits' matmul over the padded vocabulary."""
    m = cfg.model
    return 2.0 * m.d_model * transformer.padded_vocab(m) if loss_chunk else 0.0


def flops_report(cfg, hlo_text: str, devices: int, chip: str | None = None) -> dict:
    """{"compiled", "model", "model_full_attention" (FLOPs per device per step), "hfu_over_mfu",
    "unknown_trip_loops", "uncounted_calls" (kernel calls whose FLOPs are not stated)} and, with `chip`,
    {"roofline": {"chip", "peak_flops", "hbm_bytes_per_s", "bytes", "compute_s", "memory_s", "step_s"}}."""
    tokens = cfg.train.global_batch * cfg.model.seq_len / devices
    compiled, unknown, uncounted = executed_matmul_flops(hlo_text)
    model = flops_per_token(cfg) * tokens
    out = {"compiled": compiled, "model": model,
           "model_full_attention": model + full_attention_flops_per_token(cfg) * tokens,
           "hfu_over_mfu": compiled / model, "unknown_trip_loops": unknown, "uncounted_calls": uncounted}
    if chip is not None:
        check_chip(chip)
        peak, bandwidth, _ = CHIPS[chip]
        moved = executed_bytes(hlo_text)
        out["roofline"] = {"chip": chip, "peak_flops": peak, "hbm_bytes_per_s": bandwidth, "bytes": moved,
                           "compute_s": compiled / peak, "memory_s": moved / bandwidth,
                           "step_s": max(compiled / peak, moved / bandwidth)}
    return out
