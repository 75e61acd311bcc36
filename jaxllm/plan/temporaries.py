"""The compiled step's temporaries per device, estimated from the config: pure arithmetic, no compiling.

The estimate is a sum of what the step holds at once, per device (W = the fp32 bytes of the parameters one device
holds as the ZeRO theory counts them, Φ per device = `pipeline.stage_params`, before any fsdp split; a microbatch's
tokens t = rows per device × seq_len / sp):

- **weights**: weight-sized fp32 buffers: the microbatch's gradients before they are reduced (W), the weights the
  layer loop keeps for the backward (W; gathered under ZeRO-3; none under `model.remat = full`, which recomputes the
  layer instead) and the update's new values before `trainer/guard.keep_if` keeps them (W, or W / fsdp from ZeRO-2
  on, where each rank updates its shard; hpZ shards over dp too). Under ZeRO-3 a pipeline gathers one chunk's
  weights per slot and reduce-scatters its gradients per tick, so the first two are a chunk's (the stack's W / v).
  Under LoRA W is the frozen base in the compute dtype (dequantized as used under QLoRA): the scan saves it, under
  ZeRO-3 it is gathered again for the backward (a second W), latent attention's up-projection merged with its
  adapters (`lora.merged`) is one more copy of that weight, and the adapters' gradients and update (r/d of the
  weights) are left out. Read from the buffers live at the peak of compiled programs.
- **weights moved** (a V-shaped pipeline, `pp_schedule = zb_v` or `interleaved` with v > 1): 2 W_stack — the stack's
  weights moved into the [v, p, layers] view at the island's edge and their gradients moved back
  (`parallel/pipeline.py`); their stored shards (1/fsdp) under ZeRO-3.
- **activations**: what autodiff keeps of one microbatch over the layers a device differentiates at once (one
  microbatch at a time: gradient accumulation adds each into the accumulator, and the pipeline re-runs one stage
  chunk from its saved input), per
  layer the tensor-parallel theory's terms for attention (`tensor_parallel.saved_activation_terms`: residual
  stream, the projections' inputs, q/k/v, attention probabilities, attention output) and six hidden-width arrays
  of the feed-forward (what `jax.ad_checkpoint`'s saved residuals list for SwiGLU and tanh-GELU alike, where
  Megatron counts 2–3); for MoE layers the shared experts' and, per expert row (E·C of them, C = `moe.capacity`:
  every token for every expert when dropless), its input and six hidden-width arrays, the tokens being the whole
  sequence's under ep (the island splits the batch axes, not sp). With `model.remat = full` a
  layer keeps its input only, and one layer's activations exist at a time in the backward.
- **forward slot** (pp > 1): the tick's forward runs beside its backward, one layer of another microbatch.
- **logits**: four fp32 [positions, vocabulary / tp] arrays of one loss chunk (logits, probabilities and the
  gradient of each), the whole microbatch when the loss is not chunked.
- **pipeline**: the schedule's activation buffers and W stash (`pipeline.pipeline_theory`).

The parts are summed (`total`), although the update's buffers and the backward's activations need not be live at
once: on the meshes measured a max of those two phases fits worse (0.86–1.38), since XLA overlaps more than the
phases suggest. A V pipeline's moved weights are the exception: they are live at the island's edges, before the
schedule and after it, where its activations, buffers and stash are not, so the larger of the two counts (summed,
the V rows read 0.75–0.89).
Measured (`python -m tools.studies.plan_temporaries`, XLA:CPU, fp32, tiny models; compiled / estimate, BENCHMARKS.md):
0.83–1.08 on pp2×sp2×tp2 (ZeRO-1), pp2×sp2×tp2×fsdp2 (ZeRO-3, 1F1B ring and interleaved Ulysses), sp2×tp2×fsdp2
(ZeRO-3, collective matmuls), pp2×tp2×dp4 (collective matmuls), DeepSeek-shaped pp2×sp2×ep2 and pp2×ep2×sp2×tp2 under
ZB-V, a Mixtral-shaped sp2×ep2×dp4 (capacity 1.25 and dropless), fsdp8 at ZeRO-0 to 3, dp8 with and without full
recomputation, GPipe, ZB-H1, ZB-V (with fp8 matmuls too), interleaved ZeRO-3 and ep4 dropless MoE; LoRA on latent
attention (fsdp2×tp2), with collective matmuls, ZeRO++ (hpZ, qwZ), host offload and ZB-H1 (`tests/test_plan.py`
asserts 0.8–1.2 on four products and the fsdp8 stages, `tests/test_lora.py` on LoRA and QLoRA-nf4 under ZeRO-3). Off:
tp2×fsdp4 ZeRO-3 without sequence parallelism (1.25: attention's terms are Megatron's count, and XLA keeps more d-wide
arrays per layer there; 1.13 with it). Not estimated: recomputation policies other than `full` and √L groups.
"""

from __future__ import annotations

from jaxllm.models import lora, transformer
from jaxllm.ops import moe
from jaxllm.parallel.pipeline_schedules import model_chunks
from jaxllm.plan.memory import dtype_bytes, microbatch_rows, zero_shards
from jaxllm.plan.pipeline import device_share
from jaxllm.plan.tensor_parallel import saved_activation_terms
from jaxllm.stack import is_moe, segments
from jaxllm.trainer.step import loss_chunk

MOVED_COPIES = 2  # a V pipeline's stack weights moved in and their gradients moved back
LOGIT_COPIES = 4  # logits, probabilities and the gradient of each, fp32

TEMPORARIES_ASSUMES = ("Adam, fp32 master weights; per device; attention's activations as Megatron counts them, six "
                       "hidden-width arrays per feed-forward, one microbatch (a pipeline: one chunk) at a time; "
                       "checked against compiled programs of 27 layouts (tools/studies/plan_temporaries.py)")
HIDDEN_SAVED = 6  # hidden-width arrays autodiff saves of a feed-forward (SwiGLU and tanh-GELU alike)


def _hidden_bytes(tokens: int, width: int, tp: int, E: int) -> int:
    """A feed-forward's saved hidden units for `tokens` rows of hidden `width` split over tp."""
    return HIDDEN_SAVED * tokens * width // tp * E


def _routed_bytes(m, tokens: int, tp: int, E: int) -> int:
    """A MoE layer's routed experts per device for `tokens` routed tokens: E·C rows (C = `moe.capacity`), each its
    input and its saved hidden units."""
    C = moe.capacity(tokens, m.moe.n_experts, m.moe.top_k, m.moe.capacity_factor)
    rows = m.moe.n_experts * C
    return rows * m.d_model * E + _hidden_bytes(rows, m.moe.d_ff or m.d_ff, tp, E)


def layer_activation_bytes(m, kind: str, shape: dict, rows: int, E: int, sequence_parallel: bool) -> int:
    """What autodiff keeps of one layer of `kind` for a device's `rows` rows (see the module docstring)."""
    tp, s = shape["tp"], m.seq_len // shape["sp"]
    terms = saved_activation_terms(m, tp, rows, s, E)
    key = "with_sp" if sequence_parallel else "without_sp"
    out = sum(v[key] for name, v in terms.items() if name != "mlp_hidden")
    if not is_moe(kind):
        return out + _hidden_bytes(rows * s, m.d_ff, tp, E)
    routed = rows * (m.seq_len if shape["ep"] > 1 else s)  # the ep island splits the batch axes, not the sequence
    return out + _hidden_bytes(rows * s, transformer.shared_d_ff(m), tp, E) + _routed_bytes(m, routed, tp, E)


def _merged_bytes(m, pp: int, tp: int, E: int) -> int:
    """Latent attention's up-projection merged with its adapters (`lora.merged`: the absorbed cache multiplies by it
    twice), one copy per layer a device holds, in the compute dtype; 0 where kv_b has no adapters."""
    if m.attention != "mla" or "kv_b" not in m.lora.targets:
        return 0
    table, held, _ = device_share(m, pp, tp=tp)
    ups = [block["attn"]["wkv_b"] for block in table["blocks"] if "wkv_b" in block.get("attn", {})]
    return E * sum(held(up.w if lora.is_node(up) else up) for up in ups)  # the base weight under its adapters


def device_layers(m, chunks: int) -> list[str]:
    """The kinds of the layers one device differentiates at once: the pipelined (last) segment's share of a stage
    chunk (`chunks` = pp × v; the pipeline re-runs one chunk from its saved input), the segments before it and
    multi-token prediction's blocks in full (they run on every stage)."""
    *before, last = segments(m)
    kinds = [k for seg in before for k in seg.pattern * seg.repeats] + list(last.pattern) * (last.repeats // chunks)
    return kinds + list(last.pattern[-1:]) * m.mtp_depth


def _weight_buffers(cfg, shape: dict, params: dict, E: int) -> tuple[float, float]:
    """(weights, weights moved): the step's weight-sized buffers and a V pipeline's moved stack weights, bytes per
    device (see the module docstring)."""
    m, t = cfg.model, cfg.train
    pp = shape["pp"]
    W, W_stack = 4 * params["stage"], 4 * params["stage_stack"]
    v = model_chunks(t.pp_schedule, t.pp_virtual) if pp > 1 else 1
    if m.lora.rank:  # the frozen base in the compute dtype; the adapters' gradients and update are r/d of it
        W = W // 4 * E
    shard = zero_shards(shape, t)
    update = W / shard if t.zero_stage >= 2 else W
    # under ZeRO-3 a pipeline gathers a chunk's weights per slot and reduce-scatters its gradients per tick
    working = W - W_stack + W_stack / v if t.zero_stage == 3 and pp > 1 else W
    moved = MOVED_COPIES * W_stack / (shard if t.zero_stage == 3 else 1) if v > 1 else 0
    # the weights the scan saves; their gradients, or under LoRA and ZeRO-3 the base gathered again for the backward
    copies = (0 if m.remat == "full" else 1) + (0 if m.lora.rank and t.zero_stage < 3 else 1)
    return working * copies + (_merged_bytes(m, pp, shape["tp"], E) if m.lora.rank else update), moved


def temporaries_theory(cfg, shape: dict, pipeline: dict) -> dict:
    """The step's temporaries per device by part (bytes), their total and what the estimate assumes.

    `pipeline` is `pipeline.pipeline_theory`'s result for this config (its "params" and, with pp > 1, its buffers).
    Returns {"weights", "weights_moved", "activations", "forward_slot", "logits", "pipeline", "total", "assumes",
    "note"}; "total" None (with a note) where the estimate does not apply (`model.remat` policies other than
    `full`, `model.remat_group`).
    """
    m, t = cfg.model, cfg.train
    pp, tp, sp = shape["pp"], shape["tp"], shape["sp"]
    E = dtype_bytes(cfg.precision.compute)
    rows, s = max(1, microbatch_rows(t, shape)), m.seq_len // sp
    v = model_chunks(t.pp_schedule, t.pp_virtual) if pp > 1 else 1
    per_layer = [layer_activation_bytes(m, k, shape, rows, E, t.sequence_parallel) for k in device_layers(m, pp * v)]
    residual = rows * s * m.d_model * E // (tp if t.sequence_parallel else 1)
    activations = len(per_layer) * residual + max(per_layer) if m.remat == "full" else sum(per_layer)
    chunk = loss_chunk(cfg, shape)
    positions = rows * (chunk // sp if chunk else s)
    weights, moved = _weight_buffers(cfg, shape, pipeline["params"], E)
    parts = {"weights": int(weights), "weights_moved": int(moved),
             "activations": activations, "forward_slot": max(per_layer) if pp > 1 else 0,
             "logits": LOGIT_COPIES * positions * transformer.logit_bytes_per_token(m, tp),
             "pipeline": pipeline.get("buffer_bytes", 0) + pipeline.get("stash_bytes", 0)}
    note = _not_estimated(m)
    return {**parts, "total": None if note else total(parts), "assumes": TEMPORARIES_ASSUMES, "note": note}


def total(parts: dict) -> int:
    """The parts' sum, but a V pipeline's moved weights against the schedule's: the weights move into the V's view
    before the schedule runs and their gradients back after it, where the schedule's activations, buffers and
    stash are gone, so the larger of the two counts."""
    schedule = parts["activations"] + parts["forward_slot"] + parts["logits"] + parts["pipeline"]
    return parts["weights"] + max(parts["weights_moved"], schedule)


def _not_estimated(m) -> str:
    """Why the estimate does not apply to this model's settings ("" where it does)."""
    if m.remat not in ("none", "full"):
        return f"not estimated for model.remat={m.remat} (what a policy keeps is the compiler's choice)"
    if m.remat_group:
        return "not estimated with model.remat_group (the groups keep their inputs, not each layer's)"
    return ""
