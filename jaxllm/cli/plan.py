"""`jaxllm plan [--config NAME|FILE] [key=value ...] [--json]`: what one train step costs per device.

Compiles the train step for a config on this machine's devices, without running it
and without loading any data, and reports per device:

- memory of the compiled program (`memory_analysis()`: arguments, outputs, aliased
  (donated) bytes, temporaries, and total = arguments + outputs - aliased + temporaries);
- collectives per step by kind, read from the optimized HLO, loops counted per trip;
- beside them, the ZeRO theory with Φ = parameter count and N = `fsdp` size, for this
  project's layout (fp32 params, grads and Adam moments) and for the seeds' bf16 layout;
- the tensor-parallel theory (`tensor_parallel_theory`, no compiling): the activation
  collectives of one layer's forward and backward for TP alone, with sequence
  parallelism and with collective matmuls (count, bytes per call, ring bytes sent),
  and an estimate of the activations autodiff saves per layer with and without
  sequence parallelism, beside the compiled temporaries;
- the attention memory per layer (`attention_memory_theory`, no compiling): one device's attention
  (dense, or the chunked kernel) at sp=1 against this config's context-parallel strategy (and the other two) at its sp,
  their ratio, and the ratio for sp = 1, 2, 4, 8 at this seq_len;
- beside it, the compiled attention temporaries of one layer's forward + backward per implementation
  (`attention_compiled`: `jax.grad` of one `ops.attention.attention` call at this config's per-device
  shapes, compiled on one device from abstract inputs, `memory_analysis().temp_size_in_bytes`), marking
  the one `model.attention_impl` picks (sp > 1: at sp=1 shapes, the islands run their own kernel;
  dense skipped beyond seq_len 32768);
- generation (`generation_theory`, no compiling): the transient compute-dtype copy of the weights
  the KV-cache generator reads (gathered under ZeRO-3 or a pipeline) and its KV cache, for a rollout
  of train.global_batch prompts of seq_len/2 tokens and seq_len/2 new ones;
- with mesh.pp > 1, the pipeline (`pipeline_theory`, from the schedule's table): ticks, bubble
  (table and formula), activation buffer bytes, and the 2 × ticks collective-permutes the
  table predicts beside the compiled ones and the element type the program actually moves.

With pp > 1 a device holds one stage's parameters, so the ZeRO theory's Φ is the layer
stack's parameters / pp plus the embedding, head and final norm (replicated over pp);
MoE experts split over ep count 1/ep of theirs.

The ZeRO theory assumes Adam (two fp32 moments per parameter) and does not divide the
tensor-parallel parts by `tp`: with tp > 1 the compiled numbers come out below it. The
tensor-parallel collectives are exact for the layers (tests/test_plan.py checks the
collective-permutes of a compiled step against them); the activation numbers are an
estimate of what autodiff saves (see `tensor_parallel_theory`), not read from XLA; so is
the attention memory (checked by hand against compiled attention at seq 4096, see
`attention_memory_theory`).

Config handling is the same as `jaxllm train`: jaxllm/configs/default.toml unless `--config`
gives a shipped config's name or a file, then the `key=value` overrides; `model.vocab_size=0`
takes the tokenizer's size. A config mistake is one line `error: ...` on stderr and exit code 2.
Logs and the human-readable table go to stderr and stdout; with `--json`, the last line
of stdout is one JSON object (the dict `plan(cfg)` returns).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
import re
import sys
import time

from jaxllm import cli
from jaxllm.hlo import (KINDS, bytes_by_kind_and_dtype, collective_report, computations, executed_collectives,
                        format_bytes, memory_summary, permute_bytes_by_device)

THEORY_ASSUMES = ("Adam (2 fp32 moments per parameter); tp-sharded parts counted as replicated over tp "
                  "(Φ is not divided by tp); step counters and the batch are left out")

# Bytes per parameter per device as (replicated part a, sharded part b): a·Φ + b·Φ/N.
# fp32: this project's train state (fp32 params = master copy, fp32 grads, fp32 Adam mu and nu).
_FP32_TOTAL = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}
# What the compiled step takes as arguments: the state (params + moments); grads are temporaries.
_FP32_ARGS = {0: (12, 0), 1: (4, 8), 2: (4, 8), 3: (0, 12)}
# The seeds' table: bf16 params and grads beside an fp32 master copy and fp32 Adam moments.
_BF16_TOTAL = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


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


# ---------------------------------------------------------------- tensor parallelism

TP_SETTINGS = {"tp": "TP alone", "sp": "sequence parallel", "sp_cm": "SP + collective matmul"}

TP_ASSUMES = ("Megatron layout: per layer 2 column-parallel entries (QKV, MLP in) and 2 row-parallel exits "
              "(attention out, MLP out); only the [b, s, d] activation collectives of the layers are counted "
              "(not the embedding, the loss, or parameter-gradient reductions such as the norms' over tp "
              "under SP); per device per microbatch")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _dtype_bytes(dtype) -> int:
    name = str(getattr(dtype, "name", dtype))
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def _collective(kind: str, count: int, bytes_per_call: int, sent_per_call: int, where: str) -> dict:
    return {"kind": kind, "count": count, "bytes_per_call": bytes_per_call, "bytes": count * bytes_per_call,
            "sent_bytes_per_call": sent_per_call, "sent_bytes": count * sent_per_call, "where": where}


def _sum_by_kind(entries: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for e in entries:
        k = out.setdefault(e["kind"], {"count": 0, "bytes": 0, "sent_bytes": 0})
        for key in k:
            k[key] += e[key]
    return out


def microbatch_rows(t, mesh_shape: dict) -> int:
    """Rows one device holds of one microbatch: global_batch / microbatches / (dp·fsdp·ep)."""
    from jaxllm.mesh import batch_shards

    return t.global_batch // t.microbatches // batch_shards(mesh_shape)


def tensor_parallel_theory(model_cfg, train_cfg, mesh_shape: dict, compute_dtype) -> dict:
    """Tensor-parallel collectives and saved activations of one layer, per device: pure arithmetic.

    b = batch rows per device per microbatch (global_batch / microbatches / (dp·fsdp·ep)),
    s = seq_len / sp, d = d_model, n = tp, E = bytes per element of `compute_dtype`.

    Collectives (Megatron, per layer per device, for the three settings "tp", "sp", "sp_cm"):

    - "tp" (TP alone): forward 2 all-reduces of the [b, s, d] outputs of the row-parallel
      projections; backward 2 all-reduces of the input gradients of the column-parallel ones.
    - "sp" (sequence parallelism): forward 2 all-gathers of the sequence into the region and
      2 reduce-scatters out of it; backward the duals, 2 reduce-scatters and 2 all-gathers.
      (On CPU XLA writes a reduce-scatter as an all-reduce of the full array plus a slice.)
    - "sp_cm" (SP + collective matmul): forward 4 calls × 2(n-1) collective-permutes of
      b·(s/n/2)·d elements (the two halves of a sequence block travel opposite ways; when
      s/n is odd one ring of n-1 permutes of b·(s/n)·d elements); backward the same count,
      since autodiff turns each ring into its dual (jaxllm/parallel/collective_matmul.py).

    Each entry is {kind, count, bytes_per_call, bytes, sent_bytes_per_call, sent_bytes, where}:
    `bytes_per_call` is the size of XLA's result (all-reduce and all-gather: the full
    [b, s, d]; reduce-scatter and collective-permute: the shard), as jaxllm.hlo counts;
    `sent_bytes_per_call` is what each device sends on a ring: (n-1)/n of the full array for
    an all-gather or reduce-scatter, 2(n-1)/n for an all-reduce, the whole operand for a
    collective-permute. `per_layer` sums forward and backward by kind; `per_step` multiplies
    by n_layers × microbatches (the layer scan runs once per microbatch). With tp = 1 there
    is nothing to count: `enabled` is False and every list is empty.

    Activations: an estimate of what autodiff saves for one layer's backward pass (no remat),
    following the form of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models" (their sbh(10 + 24/t + 5as/(ht)) without and sbh(34/t + 5as/(ht)) with
    sequence parallelism assume fp16 and count dropout masks, which this model has not):

    - residual: the two norm inputs, 2·b·s·d·E; divided by n under SP only;
    - region inputs: the two norm outputs gathered to the full sequence that feed the
      column-parallel matmuls, 2·b·s·d·E, in both (collective matmul saves the same blocks);
    - qkv: b·s·(H + 2·KV_eff)·dh·E / n, KV_eff = max(KV, n) (KV heads are repeated up to n);
    - attention probabilities: b·H·s·S/n·(4 + E) with S = seq_len the keys' length, the fp32
      softmax output plus the compute-dtype copy fed to the PV matmul (with E = 4 there is no
      copy, astype to the same dtype is a no-op: 4 bytes);
    - attention output: b·s·d·E/n;
    - MLP hidden: gpt2 2·b·s·F·E/n (before and after GELU), llama 3·b·s·F·E/n (gate, up and
      their product).

    Left out: norm statistics (b·s fp32 per norm), the attention mask, rotary tables, biases.

    Returns {"enabled", "note", "tp", "setting" (this config's: "tp", "sp" or "sp_cm"),
             "settings" (name -> label), "b", "s", "d", "dtype_bytes", "n_layers", "microbatches", "assumes",
             "collectives_per_layer": {"tp" | "sp" | "sp_cm": {"forward": [entry], "backward": [entry],
                                        "per_layer": {kind: {"count", "bytes", "sent_bytes"}}, "per_step": same}},
             "activation_bytes_per_layer": {"without_sp", "with_sp", "sp_saving",
                                            "terms": {name: {"without_sp", "with_sp"}}},
             "activation_bytes": {"without_sp", "with_sp", "sp_saving"} (× n_layers)}.
    """
    from jaxllm.models.attention import kv_heads, qk_dim

    m, t = model_cfg, train_cfg
    n = int(mesh_shape.get("tp", 1))
    E = _dtype_bytes(compute_dtype)
    b = microbatch_rows(t, mesh_shape)
    s = m.seq_len // mesh_shape.get("sp", 1)
    d, H, F = m.d_model, m.n_heads, m.d_ff
    dh = qk_dim(m)  # MLA: its values' width v_head_dim counted as the queries' (an estimate)
    kv_eff = max(kv_heads(m), n)
    setting = "sp_cm" if t.sequence_parallel and m.collective_matmul else "sp" if t.sequence_parallel else "tp"
    full = b * s * d * E
    shard = full // n  # the residual stream's sequence block under SP (s divisible by sp·tp there)
    enabled = n > 1

    collectives: dict[str, dict] = {}
    for name in TP_SETTINGS:
        fwd: list[dict] = []
        bwd: list[dict] = []
        if enabled and name == "tp":
            ar = 2 * (n - 1) * full // n
            fwd = [_collective("all-reduce", 2, full, ar, "outputs of the 2 row-parallel projections")]
            bwd = [_collective("all-reduce", 2, full, ar, "input gradients of the 2 column-parallel entries")]
        elif enabled and name == "sp":
            ring = (n - 1) * full // n
            ag_in = _collective("all-gather", 2, full, ring, "the sequence into the 2 column-parallel entries")
            rs_out = _collective("reduce-scatter", 2, shard, ring, "the 2 row-parallel outputs into the residual")
            ag_bwd = _collective("all-gather", 2, full, ring, "gradients of the 2 row-parallel outputs")
            rs_bwd = _collective("reduce-scatter", 2, shard, ring, "input gradients of the 2 column-parallel entries")
            fwd, bwd = [ag_in, rs_out], [rs_bwd, ag_bwd]
        elif enabled and name == "sp_cm":
            block = s // n
            pieces = 1 if block % 2 else 2
            per_call = 2 * (n - 1) if pieces == 2 else n - 1
            size = b * (block // pieces) * d * E
            count = 4 * per_call
            fwd = [_collective("collective-permute", count, size, size,
                               f"4 calls (2 all-gather→matmul, 2 matmul→reduce-scatter) × {per_call} permutes")]
            bwd = [_collective("collective-permute", count, size, size, "the dual rings of the same 4 calls")]
        per_layer = _sum_by_kind(fwd + bwd)
        reps = m.n_layers * t.microbatches
        collectives[name] = {
            "forward": fwd, "backward": bwd, "per_layer": per_layer,
            "per_step": {k: {key: v * reps for key, v in c.items()} for k, c in per_layer.items()}}

    # saved activations of one layer, per device (estimate, see the docstring)
    terms_tp = {
        "residual": 2 * b * s * d * E,
        "region_inputs": 2 * b * s * d * E,
        "qkv": b * s * (H + 2 * kv_eff) * dh * E // n,
        "attention_probs": b * H * s * m.seq_len * (4 + (E if E != 4 else 0)) // n,
        "attention_out": b * s * H * dh * E // n,
        "mlp_hidden": (2 if m.mlp == "gelu_tanh" else 3) * b * s * F * E // n,
    }
    terms = {k: {"without_sp": v, "with_sp": v // n if k == "residual" else v} for k, v in terms_tp.items()}
    without_sp = sum(v["without_sp"] for v in terms.values())
    with_sp = sum(v["with_sp"] for v in terms.values())
    L = m.n_layers
    return {
        "enabled": enabled,
        "note": "" if enabled else "no tensor parallelism (mesh.tp=1)",
        "tp": n,
        "setting": setting,
        "settings": dict(TP_SETTINGS),
        "b": b, "s": s, "d": d, "dtype_bytes": E, "n_layers": L, "microbatches": t.microbatches,
        "assumes": TP_ASSUMES,
        "collectives_per_layer": collectives,
        "activation_bytes_per_layer": {"without_sp": without_sp, "with_sp": with_sp,
                                       "sp_saving": without_sp - with_sp, "terms": terms},
        "activation_bytes": {"without_sp": L * without_sp, "with_sp": L * with_sp,
                             "sp_saving": L * (without_sp - with_sp)},
    }


# ---------------------------------------------------------------- attention memory (context parallelism)

CP_STRATEGIES = ("ring", "allgather", "ulysses")
CP_TREND_SP = (1, 2, 4, 8)

ATTENTION_ASSUMES = ("estimate of one attention call's forward + backward working set per device per layer, "
                     "same rows per device b at every sp; not read from XLA (the scheduler may overlap or "
                     "free buffers differently); norms, rotary tables and the projections left out")

_ATTENTION_TERMS = {
    "probabilities": "dense: the fp32 softmax output [b, h/tp, s, s], kept for the backward",
    "score_gradients": "dense: the backward's fp32 gradients of the probabilities and of the scores, "
                       "[b, h/tp, s, s] each",
    "block_scores": "chunked: one (query block, key block) pair at a time, its fp32 scores, probabilities and "
                    "their two gradients, b·H·Bq·Bk·16 bytes (blocks of at most 512 rows)",
    "softmax_state": "chunked: the fp32 output [b, rows, H, d] and the rows' softmax (max, sum), kept for the "
                     "backward (not one per K/V step)",
    "output_gradients": "chunked: the backward's fp32 dO and dQ [b, rows, H, d] and rowsum(dO·O)",
    "kv_held": "chunked: the keys a rank holds at once, K and V in the compute dtype and their fp32 gradients, with "
               "the int32 positions and segment ids (one device: the sequence; ring: its block and the one in "
               "flight; allgather: the gathered sequence; ulysses: the sequence of its KV heads)",
    "qkv_out": "q, k, v and the attention output at the island's edge (ulysses: and their head-split copies "
               "after the all-to-all)",
}


def _chunked_shapes(strategy: str, S: int, sp: int, heads: int, kv: int) -> dict | None:
    """Per rank: query rows, heads, KV heads, key rows held at once and rows per key block of the chunked
    kernel, or None where `strategy` cannot run at this sp."""
    from jaxllm.ops.chunked_attention import BLOCK

    if S % sp:
        return None
    t = S // sp
    if strategy == "ulysses" and sp > 1:
        if heads % sp or (kv % sp and sp % kv):
            return None
        return {"rows": S, "heads": heads // sp, "kv": max(kv, sp) // sp, "keys": S, "block_q": min(BLOCK, S),
                "block_k": min(BLOCK, S)}
    ring = strategy == "ring" and sp > 1
    return {"rows": t, "heads": heads, "kv": kv, "keys": 2 * t if ring else S, "block_q": min(BLOCK, t),
            "block_k": min(BLOCK, t if ring else S)}


def _attention_terms(impl: str, strategy: str, b: int, S: int, sp: int, heads: int, kv: int, dh: int,
                     E: int) -> dict | None:
    """Bytes per device of one attention call (forward + backward) by term; see `attention_memory_theory`."""
    t = S // sp
    qkv_out = b * t * (2 * heads + 2 * kv) * dh * E
    if sp == 1 and impl == "dense":
        probs = b * heads * S * S
        return {"probabilities": probs * 4, "score_gradients": probs * 8, "qkv_out": qkv_out}
    c = _chunked_shapes(strategy, S, sp, heads, kv)
    if c is None:
        return None
    rows, H = c["rows"], c["heads"]
    if strategy == "ulysses" and sp > 1:
        qkv_out += b * S * (2 * H + 2 * c["kv"]) * dh * E
    return {
        "block_scores": b * H * c["block_q"] * c["block_k"] * 16,
        "softmax_state": b * rows * H * (dh + 2) * 4,
        "output_gradients": b * rows * H * (2 * dh + 1) * 4,
        "kv_held": b * c["keys"] * c["kv"] * dh * (2 * E + 8) + 2 * b * c["keys"] * 4,
        "qkv_out": qkv_out,
    }


def attention_memory_theory(model_cfg, train_cfg, mesh_shape: dict, compute_dtype) -> dict:
    """Attention memory of one layer per device, one device (sp=1) against context parallelism: pure arithmetic.

    An estimate of the bytes one attention call needs for its forward and backward pass
    (what its backward keeps plus its largest working buffers), per device per layer, with
    b = batch rows per device per microbatch (as in `tensor_parallel_theory`, kept the same at
    every sp), S = seq_len, t = S/sp, h = n_heads/tp, kv = max(n_kv_heads, tp)/tp (KV heads
    repeated up to tp), d = head_dim, E = bytes per element of `compute_dtype`.

    sp = 1 with `dense` (`model.attention_impl`, or `auto`'s choice), the full [b, h, S, S] scores:
    - probabilities: b·h·S·S·4, the fp32 softmax output autodiff keeps;
    - score_gradients: b·h·S·S·8, the backward's fp32 gradients of the probabilities and of the scores
      (12 bytes per score element in all: what the compiled programs hold, in fp32 and in bf16 alike, the
      compute-dtype copies fused away);
    - qkv_out: q, k, v and out, b·S·(2h + 2kv)·d·E.

    sp = 1 with any other implementation, and every context-parallel island (each runs the chunked
    kernel, `ops/chunked_attention.py`): O(rows) memory, no [s, s] array, no state per K/V step. A rank
    has R query rows and H heads and holds K key rows of KV heads at once: one device R = K = S;
    ring R = t, K = 2t (its block and the one in flight); allgather R = t, K = S; ulysses (after the
    all-to-all) R = S, H = h/sp, KV = max(kv, sp)/sp, K = S. Blocks have Bq = min(512, R) query
    rows and Bk = min(512, K) keys (ring: min(512, t)). Terms:
    - block_scores: b·H·Bq·Bk·16: one pair's fp32 scores, probabilities and their gradients;
    - softmax_state: b·R·H·(d + 2)·4: the fp32 output and the rows' (max, sum) the backward reads;
    - output_gradients: b·R·H·(2d + 1)·4: the backward's fp32 dO, dQ and rowsum(dO·O);
    - kv_held: b·K·KV·d·(2E + 8) + 2·b·K·4: K and V, their fp32 gradients, positions and segment ids;
    - qkv_out: the local q, k, v and out, b·t·(2h + 2kv)·d·E (ulysses: plus their head-split
      copies, b·S·(2H + 2KV)·d·E).

    The fused kernels (cudnn, pallas_*) are estimated as chunked (both O(rows), blocks on chip).
    At short sequences the [512, 512] blocks dominate and memory barely falls with sp; at long ones
    the rows do and it falls as 1/sp (ring, ulysses), or less for allgather, which holds the whole K/V.
    Left out: dense attention's mask (XLA fuses it) and what XLA's scheduler overlaps or frees otherwise.

    Checked against compiled attention (`jax.grad` of sum(attend(q, k, v) · ct), b=1, 8 heads / 2 KV
    heads, head_dim 8, seq 4096, fp32): tests/test_context_parallel.py holds the compiled bytes within
    0.8 to 1.2 of these for dense and chunked on one device and each strategy at sp=8.

    Returns {"enabled" (sp > 1), "sp", "strategy" (this config's; "dense" or "chunked" at sp=1), "baseline"
             (sp=1's implementation), "b", "seq_len", "heads", "kv_heads", "head_dim", "dtype_bytes", "n_layers",
             "assumes", "terms" (name -> description), "sp1": {"terms": {name: bytes}, "bytes_per_layer"},
             "this": same for this config, "ratio" (this / sp1),
             "strategies": {strategy: {"terms", "bytes_per_layer", "ratio"} or None where it cannot run},
             "ratio_by_sp": {strategy: {"1" | "2" | "4" | "8": ratio or None}} at this seq_len}.
    """
    from jaxllm.models.attention import implementation, kv_heads, qk_dim

    m, t = model_cfg, train_cfg
    tp = int(mesh_shape.get("tp", 1))
    sp = int(mesh_shape.get("sp", 1))
    E = _dtype_bytes(compute_dtype)
    b = microbatch_rows(t, mesh_shape)
    S = m.seq_len
    H, dh = m.n_heads // tp, qk_dim(m)
    KV = max(kv_heads(m), tp) // tp
    baseline = "dense" if implementation(m) == "dense" else "chunked"

    def total(strategy: str, n: int) -> dict | None:
        terms = _attention_terms(baseline, strategy, b, S, n, H, KV, dh, E)
        return None if terms is None else {"terms": terms, "bytes_per_layer": sum(terms.values())}

    sp1 = total(baseline, 1)
    ratio = lambda x: None if x is None else x["bytes_per_layer"] / sp1["bytes_per_layer"]
    strategies = {}
    for name in CP_STRATEGIES:
        x = total(name, sp)
        strategies[name] = None if x is None else {**x, "ratio": ratio(x)}
    this = total(m.cp_strategy, sp)
    return {
        "enabled": sp > 1,
        "sp": sp,
        "strategy": m.cp_strategy if sp > 1 else baseline,
        "baseline": baseline,
        "b": b, "seq_len": S, "heads": H, "kv_heads": KV, "head_dim": dh, "dtype_bytes": E, "n_layers": m.n_layers,
        "assumes": ATTENTION_ASSUMES,
        "terms": dict(_ATTENTION_TERMS),
        "sp1": sp1,
        "this": this,
        "ratio": ratio(this),
        "strategies": strategies,
        "ratio_by_sp": {name: {str(n): ratio(total(name, n)) for n in CP_TREND_SP} for name in CP_STRATEGIES},
    }


ATTENTION_COMPILED_DENSE_MAX = 32768  # dense beyond this seq_len: [s, s] scores too large to be worth compiling


@functools.lru_cache(maxsize=64)
def _attention_temp_bytes(impl: str, b: int, s: int, heads: int, kv: int, dh: int, dtype: str, masking) -> int:
    """Temporaries of `jax.grad` of sum(attention(q, k, v) · ct) with `impl`, compiled on one device from
    abstract inputs (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from jaxllm.ops.attention import attention

    def loss(q, k, v, ct, pos, seg):
        out = attention(q, k, v, pos, pos, seg, seg, masking, impl)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    x = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    args = (x(b, s, heads, dh), x(b, s, kv, dh), x(b, s, kv, dh), x(b, s, heads, dh),
            x(b, s, dt="int32"), x(b, s, dt="int32"))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def attention_compiled(cfg, shape: dict) -> dict:
    """Compiled temporaries of one attention layer's forward + backward per implementation, per device.

    For each implementation in `ops.attention.IMPLEMENTATIONS`, `jax.jit(jax.grad(sum(attention(q, k, v) · ct)))`
    compiled on one device from `jax.ShapeDtypeStruct` inputs at this config's per-device shapes: b = batch rows
    per device per microbatch (global_batch / microbatches / (dp·fsdp·ep), as the theory, at least 1),
    s = seq_len, heads = n_heads / tp, kv = n_kv_heads / tp (at least 1), head_dim, the compute dtype
    and the model's masking (window). With sp > 1 the context-parallel islands run the chunked kernel inside
    a shard_map, not these: they are compiled at sp = 1 shapes for comparison, with a note. Dense is skipped (None, with a
    note) beyond seq_len 32768; an implementation that does not compile on this platform is None with a note.

    Returns {impl: temp bytes or None, ..., "chosen": `implementation(model)`, "setting" (model.attention_impl),
             "shape": {"b", "seq_len", "heads", "kv_heads", "head_dim", "dtype"}, "notes": [str], "seconds"}.
    """
    import jax
    import jax.numpy as jnp

    from jaxllm.models.attention import implementation, kv_heads, masking, qk_dim
    from jaxllm.ops.attention import IMPLEMENTATIONS

    m, t = cfg.model, cfg.train
    tp, sp = int(shape.get("tp", 1)), int(shape.get("sp", 1))
    b = max(1, microbatch_rows(t, shape))
    heads, kv = max(1, m.n_heads // tp), max(1, kv_heads(m) // tp)
    dtype = jnp.dtype(cfg.precision.compute).name
    s, notes = m.seq_len, []
    if sp > 1:
        notes.append(f"sp={sp}: this run's attention is the {m.cp_strategy} island (the chunked kernel per rank), not these; "
                     f"plain implementations at sp=1 shapes for comparison")
    out: dict = {}
    start = time.perf_counter()
    for impl in IMPLEMENTATIONS:
        if impl == "dense" and s > ATTENTION_COMPILED_DENSE_MAX:
            out[impl] = None
            notes.append(f"dense not compiled at seq_len {s} > {ATTENTION_COMPILED_DENSE_MAX}")
            continue
        try:  # a kernel for another platform (e.g. Pallas) may not compile on this one
            out[impl] = _attention_temp_bytes(impl, b, s, heads, kv, qk_dim(m), dtype, masking(m))
        except Exception as e:  # noqa: BLE001 - reported, not raised: the plan goes on
            out[impl] = None
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            notes.append(f"{impl} not compiled on {jax.devices()[0].platform}: {reason}")
    return {**out, "chosen": implementation(m), "setting": m.attention_impl, "sp": sp,
            "shape": {"b": b, "seq_len": s, "heads": heads, "kv_heads": kv, "head_dim": qk_dim(m), "dtype": dtype},
            "notes": notes, "seconds": round(time.perf_counter() - start, 3)}


# ---------------------------------------------------------------- pipeline parallelism

PIPELINE_ASSUMES = ("stage inputs and output gradients kept in the compute dtype, one microbatch's residual "
                    "stream per slot; per device")

_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


def stage_params(model_cfg, pp: int, ep: int = 1) -> dict:
    """Parameters one device holds of the model: {"stack" (the pipelined layers: the last segment's), "experts"
    (the MoE experts in them), "shared" (embedding, head, final norm and the layers of the segments before:
    replicated over pp), "stage" = (stack − experts) / pp + experts / (pp·ep) + shared}."""
    import jax

    from jaxllm.models import transformer
    from jaxllm.stack import segments

    leaf = lambda x: isinstance(x, transformer.Leaf)
    blocks = transformer.param_table(model_cfg)["blocks"][segments(model_cfg)[-1].blocks]
    size = lambda tree: sum(math.prod(l.shape) for l in jax.tree.leaves(tree, is_leaf=leaf))
    stack = size(blocks)
    experts = sum(size(b["moe"]["experts"]) for b in blocks if "moe" in b)
    shared = transformer.count_params(model_cfg) - stack
    return {"stack": stack, "experts": experts, "ep": ep, "shared": shared,
            "stage": (stack - experts) // pp + experts // (pp * ep) + shared}


def pipeline_theory(model_cfg, train_cfg, mesh_shape: dict, compute_dtype) -> dict:
    """The pipeline schedule's table and what it costs per device: pure arithmetic, no compiling.

    b = rows per microbatch per device (global_batch / microbatches / (dp·fsdp·ep)); s = seq_len over
    the axes that split the residual stream's sequence (sp, and sp·tp under sequence parallelism);
    d = d_model; E = bytes per element of `compute_dtype`. One slot is b·s·d·E bytes.

    - the activation buffers hold (act_depth + grad_depth) slots: stage inputs kept for the
      backward and output gradients waiting for it (parallel/pipeline_schedules.py);
    - the executor sends 2 collective-permutes per tick (forward output downstream, input gradient
      upstream), one slot each: 2 × ticks per step;
    - the bubble from the table (`bubble_fraction`) at unit costs (F = R = B = W) beside its closed form
      (`bubble_formula`), and at this model's per-layer costs (`transformer.layer_costs`, which the
      zero-bubble tables are built for);
    - with a split backward (zb_h1, zb_v) the W stash (`models/taps.py`): one slot holds a chunk's stash for
      one microbatch, b·seq_len·E times the tapped projections' input and output elements per token
      (`taps.stash_elements`) times the chunk's layers; the program holds stash_depth slots, the stash B is
      making and the zero probes it makes it from: (stash_depth + 2) slots.

    Returns {"enabled" (pp > 1), "note", "pp", "params" (`stage_params`), "assumes"} and, when enabled,
    "schedule", "p", "v", "m", "ticks", "bubble": {"table", "formula", "model_costs", "costs"}, "act_depth",
    "grad_depth", "b", "s", "d", "dtype", "dtype_bytes", "slot_bytes", "buffer_bytes",
    "collective_permute": {"count", "bytes_per_call", "bytes"}, and with a split backward "stash_depth",
    "stash_slot_bytes", "stash_bytes".
    """
    from jaxllm.models.transformer import layer_costs
    from jaxllm.parallel.pipeline_schedules import bubble_formula, bubble_fraction
    from jaxllm.train.step import pipeline_schedule

    m, t = model_cfg, train_cfg
    pp = int(mesh_shape.get("pp", 1))
    out = {"enabled": pp > 1, "note": "" if pp > 1 else "no pipeline parallelism (mesh.pp=1)", "pp": pp,
           "params": stage_params(m, pp, int(mesh_shape.get("ep", 1))), "assumes": PIPELINE_ASSUMES}
    if pp == 1:
        return out
    sch = pipeline_schedule(m, t, pp)
    split = mesh_shape.get("sp", 1) * (mesh_shape.get("tp", 1) if t.sequence_parallel else 1)
    b = microbatch_rows(t, mesh_shape)
    s = m.seq_len // split if m.seq_len % split == 0 else m.seq_len  # not divisible: replicated (sharding.py)
    E = _dtype_bytes(compute_dtype)
    slot = b * s * m.d_model * E
    stash = _stash(m, sch, b, E, int(mesh_shape.get("tp", 1))) if sch.split else {}
    costs = layer_costs(m)
    return {**out, **stash, "schedule": sch.name, "p": pp, "v": sch.chunks, "m": sch.microbatches, "ticks": sch.ticks,
            "bubble": {"table": bubble_fraction(sch), "formula": bubble_formula(sch),
                       "model_costs": bubble_fraction(sch, costs), "costs": dataclasses.astuple(costs)},
            "act_depth": sch.act_depth, "grad_depth": sch.grad_depth, "b": b, "s": s, "d": m.d_model,
            "dtype": str(getattr(compute_dtype, "name", compute_dtype)), "dtype_bytes": E, "slot_bytes": slot,
            "buffer_bytes": (sch.act_depth + sch.grad_depth) * slot,
            "collective_permute": {"count": 2 * sch.ticks, "bytes_per_call": slot, "bytes": 2 * sch.ticks * slot}}


def _stash(m, sch, b: int, E: int, tp: int) -> dict:
    """The W stash of a split backward per device (see `pipeline_theory`)."""
    from jaxllm.models import taps, transformer
    from jaxllm.stack import segments

    last = segments(m)[-1]  # the pipelined segment
    per_token = taps.stash_elements(transformer.param_table(m)["blocks"][last.blocks], tp)
    slot = b * m.seq_len * E * last.repeats // (sch.stages * sch.chunks) * per_token
    return {"stash_depth": sch.stash_depth, "stash_slot_bytes": slot, "stash_bytes": (sch.stash_depth + 2) * slot}


def permute_dtypes(hlo_text: str, elements: int) -> list[str]:
    """Element types (as numpy names) of the compiled collective-permutes that move `elements` values."""
    comps, _ = computations(hlo_text)
    found = set()
    for ins in (i for instrs in comps.values() for i in instrs):
        if ins["opcode"] in ("collective-permute", "collective-permute-start"):
            for dtype, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", ins["type"]):
                if math.prod(int(x) for x in dims.split(",") if x) == elements:
                    found.add(_HLO_DTYPES.get(dtype, dtype))
    return sorted(found)


_MATMUL_LINE = re.compile(r"\s(dot|custom-call)\(([^)]*)\)")
_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z]\w*)\[")


def matmul_operands(hlo_text: str) -> dict[str, int]:
    """The compiled program's matmuls counted by what runs them and their two operands' element types, e.g.
    {"dot bf16×bf16": 6, "__cublas$lt$matmul$f8 f8e4m3fn×f8e4m3fn": 18}: `dot`s and the cuBLAS calls
    (custom calls whose target names a gemm or matmul) that XLA rewrote them into. This is how one reads
    whether `precision.matmul = "fp8"` reached an fp8 GEMM or was widened back (XLA:CPU widens every one).
    Instructions are counted as written, a loop body once; operands are looked up by name, since
    `as_text()` prints them without their types."""
    lines = hlo_text.splitlines()
    element = {m.group(1): m.group(2) for m in map(_DEFINED.match, lines) if m}
    found: dict[str, int] = {}
    for line in lines:
        m = _MATMUL_LINE.search(line)
        if not m:
            continue
        runner = m.group(1)
        if runner == "custom-call":
            target = _CALL_TARGET.search(line)
            if not target or not re.search(r"gemm|matmul", target.group(1), re.I):
                continue
            runner = target.group(1)
        names = re.findall(r"%?([\w.\-]+)\s*(?:,|$)", m.group(2).strip())[:2]
        key = f"{runner} {'×'.join(element.get(n, '?') for n in names)}"
        found[key] = found.get(key, 0) + 1
    return dict(sorted(found.items()))


def _pipeline_compiled(pl: dict, hlo_text: str, compiled: dict) -> dict:
    """The pipeline theory with the compiled program's side: the element type its permutes of one slot
    move ("moved_dtype"; XLA:CPU promotes bf16 collective-permutes to f32), the table's bytes at that
    type ("moved") and the compiled collective-permutes per step ("compiled", all of them)."""
    if not pl["enabled"]:
        return pl
    cp = pl["collective_permute"]
    elements = cp["bytes_per_call"] // pl["dtype_bytes"]
    moved = permute_dtypes(hlo_text, elements)
    moved_dtype = moved[0] if len(moved) == 1 else pl["dtype"]
    per_call = elements * _dtype_bytes(moved_dtype)
    return {**pl, "collective_permute": {
        **cp, "moved_dtype": moved_dtype, "compiled_dtypes": moved,
        "moved": {"count": cp["count"], "bytes_per_call": per_call, "bytes": cp["count"] * per_call},
        "compiled": dict(compiled)}}


def generation_theory(cfg, fns) -> dict:
    """Generation's memory per device (no compiling): a rollout of train.global_batch prompts of seq_len/2
    tokens and seq_len/2 new ones on this mesh. The program reads a compute-dtype copy of the weights laid
    out as used (under ZeRO-3 or pp > 1 gathered: the whole model / tp), alive only while it runs, and
    the KV cache; tests/test_plan.py checks both against the compiled program's temporaries."""
    from jaxllm.generate import cache, decode

    m, dtype = cfg.model, cfg.precision.compute
    prompt = max(1, m.seq_len // 2)
    new = max(1, m.seq_len - prompt)
    slots = decode.bucket(prompt) + new
    values, formula = cache.per_token(m)
    return {"rows": cfg.train.global_batch, "prompt": prompt, "new": new, "slots": slots,
            "weights_copy_bytes": decode.weights_copy_bytes(m, dtype, fns),
            "cache_bytes": cache.cache_bytes(m, cfg.train.global_batch, slots, dtype, fns),
            "cache_per_token": {"values": values, "formula": formula, "bytes": values * _dtype_bytes(dtype)}}


def resolve(cfg):
    """The config resolved as `train.loop.prepare` does, minus the corpus: (cfg copy, mesh shape, notes)."""
    from jaxllm.train.loop import resolve as resolve_config

    cfg = copy.deepcopy(cfg)
    _, shape, notes = resolve_config(cfg)
    return cfg, shape, notes


def host_state_bytes(abstract_state, compiled) -> int:
    """Bytes per device of the state kept in host memory between steps (`memory.*`): what the compiled
    program reports as host arguments, or, where the backend reports none (XLA:CPU), the shards of the
    state leaves whose shardings carry the host memory kind."""
    import jax

    reported = int(compiled.memory_analysis().host_argument_size_in_bytes)
    if reported:
        return reported
    return _device_bytes([a for a in jax.tree.leaves(abstract_state) if a.sharding.memory_kind == "pinned_host"])


def compile_step(cfg, shape: dict):
    """(step fns, the train step compiled for `cfg` on its mesh, seconds the compile took)."""
    from jaxllm.mesh import make_mesh
    from jaxllm.train.step import make_step_fns

    fns, t = make_step_fns(cfg, make_mesh(shape, cfg)), cfg.train
    start = time.perf_counter()
    compiled = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(t.global_batch, cfg.model.seq_len)).compile()
    return fns, compiled, time.perf_counter() - start


def remat_summary(cfg, shape: dict, temp_bytes: int) -> dict:
    """What `model.remat` and `model.remat_group` keep for this config, beside the seeds' table; with
    groups, the temporaries of the same step compiled without them (the groups' effect)."""
    from jaxllm.models.transformer import remat_group
    from jaxllm.parallel.pipeline_schedules import model_chunks
    from jaxllm.stack import segments

    m, t = cfg.model, cfg.train
    chunks = shape["pp"] * (model_chunks(t.pp_schedule, t.pp_virtual) if shape["pp"] > 1 else 1)
    repeats = max(seg.repeats for seg in segments(m)) // chunks  # the longest segment's, where the memory is
    out = {"remat": m.remat, "group": remat_group(m, repeats), "repeats": repeats, "temp_bytes": temp_bytes}
    if out["group"]:
        plain = copy.deepcopy(cfg)
        plain.model.remat_group = 0
        out["temp_bytes_without_group"] = memory_summary(compile_step(plain, shape)[1])["temp_bytes"]
    return out


# the most bytes one device sends all-reducing S over N (parallel/allreduce.py's docstrings)
ALLREDUCE_BYTES = {"ring": lambda n, s: 2 * (n - 1) / n * s, "halving_doubling": lambda n, s: 2 * (n - 1) / n * s,
                   "tree": lambda n, s: 3 * s if n > 2 else s, "ps": lambda n, s: (n - 1) * s}


def allreduce_report(cfg, shape: dict, hlo: str, n_params: int) -> dict | None:
    """For a hand-built `train.allreduce`: its rounds and the bytes each device sends in the compiled step
    (from the permutes' source_target_pairs), beside its formula and the seeds' 2Φ for an all-reduce."""
    from jaxllm.mesh import batch_shards

    t = cfg.train
    if t.allreduce == "xla":
        return None
    import jax

    sent = permute_bytes_by_device(hlo, jax.device_count())
    n, message = batch_shards(shape), 4 * n_params  # fp32 gradients
    if t.allreduce == "hierarchical":
        inner, outer = n // shape["dp"], shape["dp"]
        formula = 2 * (inner - 1) / inner * message + 2 * (outer - 1) / outer * message / inner
    else:
        formula = ALLREDUCE_BYTES[t.allreduce](n, message)
    return {"algorithm": t.allreduce, "devices": n, "rounds": collective_report(hlo)["collectives"][
        "collective-permute"]["count"], "sent_max": max(sent), "sent_mean": sum(sent) / len(sent),
        "formula_bytes": formula, "seeds_bytes": 2 * message, "bucket_mb": t.bucket_mb}


def _format_allreduce(a: dict) -> list[str]:
    return ["", f"gradient all-reduce: train.allreduce={a['algorithm']} over {a['devices']} devices, buckets of "
            f"{a['bucket_mb']} MB: {a['rounds']} collective-permute rounds per step",
            f"  bytes sent per device: compiled max {format_bytes(a['sent_max'])}, mean "
            f"{format_bytes(a['sent_mean'])}; formula {format_bytes(a['formula_bytes'])}; the seeds' all-reduce "
            f"2Φ = {format_bytes(a['seeds_bytes'])}"]


def zeropp_report(cfg, shape: dict, hlo: str) -> dict | None:
    """With qwZ or qgZ (`train.zeropp`), per device and step from the compiled programs: the all-gather bytes
    beside those of the same config compiled without quantization; the gradient all-to-alls (int8 blocks and
    their fp32 scales) beside the same elements in the compute dtype; the predicted ratio (1 + 4/block) /
    dtype bytes."""
    import jax.numpy as jnp

    z = cfg.train.zeropp
    if not (z.weights or z.grads):  # hpZ alone quantizes nothing (its state shows in the ZeRO theory)
        return None
    plain = copy.deepcopy(cfg)
    plain.train.zeropp.weights = plain.train.zeropp.grads = False
    ours, unquantized = (bytes_by_kind_and_dtype(executed_collectives(text)[0])
                         for text in (hlo, compile_step(plain, shape)[1].as_text()))
    of = lambda table, kind: sum(b for (k, _), b in table.items() if k == kind)
    width = jnp.dtype(cfg.precision.compute).itemsize
    return {"weights": z.weights, "grads": z.grads, "hpz": z.hpz, "block": z.block, "compute": cfg.precision.compute,
            "gathers": of(ours, "all-gather"), "gathers_unquantized": of(unquantized, "all-gather"),
            "grad_all_to_all": of(ours, "all-to-all"),
            "grad_unquantized": ours.get(("all-to-all", "s8"), 0) * width,
            "predicted_ratio": (1 + 4 / z.block) / width}


def _format_zeropp(z: dict) -> list[str]:
    on = ", ".join(n for n, k in (("qwZ", "weights"), ("qgZ", "grads"), ("hpZ", "hpz")) if z[k])
    ratio = lambda a, b: f"×{a / b:.3f}" if b else "-"
    return ["", f"ZeRO++ ({on}; blocks of {z['block']}; predicted ratio (1 + 4/{z['block']}) / "
            f"{z['compute']} bytes = {z['predicted_ratio']:.3f}), per device per step:",
            f"  all-gathers {format_bytes(z['gathers'])}; compiled without quantization "
            f"{format_bytes(z['gathers_unquantized'])}: {ratio(z['gathers'], z['gathers_unquantized'])}",
            f"  gradient all-to-alls {format_bytes(z['grad_all_to_all'])}; the same elements in {z['compute']} "
            f"{format_bytes(z['grad_unquantized'])}: {ratio(z['grad_all_to_all'], z['grad_unquantized'])}"]


def _device_bytes(tree) -> int:
    """Bytes per device of an abstract tree's leaves (each its shard; 4-bit codes at half a byte)."""
    import jax
    import jax.numpy as jnp

    def bits(dtype) -> int:
        kind = jnp.iinfo if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo
        return 8 if dtype == jnp.bool_ else kind(dtype).bits

    return sum(-(-math.prod(a.sharding.shard_shape(a.shape)) * bits(a.dtype) // 8) for a in jax.tree.leaves(tree))


FINETUNE = {"full": (0, "none"), "lora": (None, "none"), "qlora_nf4": (None, "nf4")}  # (rank, base_quant)


def finetune_state(cfg, shape: dict) -> dict:
    """The train state's bytes per device for full fine-tuning, LoRA and QLoRA (nf4) of this model on this mesh
    (`model.lora.rank`, else 8, on its targets), read from each one's abstract state (no compiling): the frozen
    base, the trained parameters (fp32) and the optimizer state. A variant the model cannot run gives its reason."""
    import jax

    from jaxllm.config import validate
    from jaxllm.errors import UserError
    from jaxllm.mesh import make_mesh
    from jaxllm.models import lora
    from jaxllm.train.step import make_step_fns, trained

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
        parts = {"base_bytes": _device_bytes(frozen), "trained_bytes": _device_bytes(train),
                 "optimizer_bytes": _device_bytes(state.opt_state)}
        adapted = [x.w for x in jax.tree.leaves(state.params, is_leaf=lora.is_node) if lora.is_node(x)]
        # the step's other arguments: its counters, the guard and the batch
        rest = _device_bytes((state.step, state.applied, state.guard,
                              fns.abstract_batch(cfg.train.global_batch, cfg.model.seq_len)))
        out[name] = {**parts, "total_bytes": sum(parts.values()), "argument_bytes": sum(parts.values()) + rest,
                     "adapted_base_bytes": _device_bytes(adapted)}  # the base's weights that carry adapters
    return out


def plan(cfg) -> dict:
    """Compile the train step for `cfg` (not run it) and report memory, collectives and theory per device.

    Raises UserError for a config that cannot run. Does not modify `cfg`.
    """
    import jax

    from jaxllm.models import transformer

    log = logging.getLogger("jaxllm")
    cfg, shape, notes = resolve(cfg)
    for note in notes:
        log.info(note)
    m, t = cfg.model, cfg.train
    fns, compiled, seconds = compile_step(cfg, shape)
    memory = memory_summary(compiled)
    hlo = compiled.as_text()
    report = collective_report(hlo)
    n_params = transformer.count_params(m)
    pipeline = pipeline_theory(m, t, shape, cfg.precision.compute)
    pipeline = _pipeline_compiled(pipeline, hlo, report["collectives"]["collective-permute"])
    return {
        "config": {
            "mesh": dict(shape),
            "zero_stage": t.zero_stage,
            "microbatches": t.microbatches,
            "global_batch": t.global_batch,
            "preset": m.preset,
            "family": m.family,
            "n_layers": m.n_layers,
            "d_model": m.d_model,
            "n_heads": m.n_heads,
            "n_kv_heads": m.n_kv_heads,
            "d_ff": m.d_ff,
            "vocab_size": m.vocab_size,
            "seq_len": m.seq_len,
            "remat": m.remat,
            "optimizer": t.optimizer,
            "compute": cfg.precision.compute,
            "sequence_parallel": t.sequence_parallel,
            "collective_matmul": m.collective_matmul,
        },
        "params": n_params,
        "memory": {**{k: memory[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                              "total_bytes")},
                   "host_bytes": host_state_bytes(fns.abstract_state, compiled)},
        "remat": remat_summary(cfg, shape, memory["temp_bytes"]),
        "collectives": report["collectives"],
        "unknown_trip_loops": report["unknown_trip_loops"],
        # a device holds one pipeline stage and its share of the experts: Φ = (stack − experts) / pp
        # + experts / (pp·ep) + embedding/head/final norm
        # hpZ (train.zeropp.hpz) shards the master and the optimizer state over dp × fsdp
        "theory": theory(pipeline["params"]["stage"], shape["fsdp"] * (shape["dp"] if t.zeropp.hpz else 1),
                         t.zero_stage),
        "tensor_parallel": tensor_parallel_theory(m, t, shape, cfg.precision.compute),
        "attention": attention_memory_theory(m, t, shape, cfg.precision.compute),
        "attention_compiled": attention_compiled(cfg, shape),
        "pipeline": pipeline,
        "generation": generation_theory(cfg, fns),
        "allreduce": allreduce_report(cfg, shape, hlo, n_params),
        "zeropp": zeropp_report(cfg, shape, hlo),
        "finetune": finetune_state(cfg, shape),
        "matmuls": matmul_operands(hlo),
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "compile_seconds": round(seconds, 3),
    }


def _format_tensor_parallel(tp: dict, temp_bytes: int) -> list[str]:
    """The "tensor parallelism" section of `format_table`."""
    n = tp["tp"]
    a, layers = tp["activation_bytes_per_layer"], tp["n_layers"]
    lines = ["", f"tensor parallelism (tp={n})"]
    if not tp["enabled"]:
        lines.append(f"  {tp['note']}: no tensor-parallel collectives")
    else:
        lines.append(f"  collectives per layer per device: b={tp['b']} rows × s={tp['s']} × d={tp['d']}, "
                     f"{tp['dtype_bytes']} bytes per element; size per call as XLA's result, sent = ring bytes "
                     "each device sends")
        lines.append(f"  {'setting':<31}{'pass':<10}{'count':>6}  {'kind':<20}{'size/call':>11}{'sent':>12}")
        for name, label in tp["settings"].items():
            mark = "*" if name == tp["setting"] else " "
            first = f"{mark}{name:<6}{label}"
            c = tp["collectives_per_layer"][name]
            for pas in ("forward", "backward"):
                for e in c[pas]:
                    lines.append(f"  {first:<31}{pas:<10}{e['count']:>6}  {e['kind']:<20}"
                                 f"{format_bytes(e['bytes_per_call']):>11}{format_bytes(e['sent_bytes']):>12}")
                    first, pas = "", ""
            sent = sum(v["sent_bytes"] for v in c["per_layer"].values())
            lines.append(f"  {'':<31}{'layer':<10}{sum(v['count'] for v in c['per_layer'].values()):>6}  "
                         f"{'':<20}{'':>11}{format_bytes(sent):>12}")
        reps = layers * tp["microbatches"]
        lines.append(f"  (* this config; per step × {layers} layers × {tp['microbatches']} microbatch(es) = × {reps}; "
                     "on CPU a reduce-scatter compiles to an all-reduce of the full array and a slice;")
        lines.append("   the embedding, the loss and parameter-gradient reductions are left out here, "
                     "counted in the step totals above)")
    sp_now = tp["setting"] != "tp"
    heads = ("without SP" + ("" if sp_now else "*"), "with SP" + ("*" if sp_now else ""))
    lines.append(f"  saved activations per device, no remat (estimate)  {heads[0]:>12}{heads[1]:>12}")
    labels = {"residual": "residual (2 norm inputs)", "region_inputs": "region inputs (2 gathered)",
              "qkv": "q, k, v", "attention_probs": "attention probabilities", "attention_out": "attention output",
              "mlp_hidden": "MLP hidden"}
    for k, v in a["terms"].items():
        lines.append(f"    {labels.get(k, k):<49}{format_bytes(v['without_sp']):>12}{format_bytes(v['with_sp']):>12}")
    total = tp["activation_bytes"]
    lines.append(f"    {'per layer':<49}{format_bytes(a['without_sp']):>12}{format_bytes(a['with_sp']):>12}")
    lines.append(f"    {f'× {layers} layers':<49}{format_bytes(total['without_sp']):>12}"
                 f"{format_bytes(total['with_sp']):>12}")
    lines.append(f"  sequence parallelism saves {format_bytes(total['sp_saving'])} "
                 f"({format_bytes(a['sp_saving'])} per layer); compiled temporaries of this program: "
                 f"{format_bytes(temp_bytes)} (gradients, logits and optimizer work included)")
    return lines


_ATTENTION_LABELS = {"probabilities": "probabilities", "score_gradients": "score gradients",
                     "block_scores": "block scores", "softmax_state": "softmax state",
                     "output_gradients": "output gradients", "kv_held": "K/V held", "qkv_out": "q/k/v/out"}


def _format_attention(at: dict) -> list[str]:
    """The "attention memory per layer" section of `format_table`."""
    sp, strategy = at["sp"], at["strategy"]
    terms = lambda x: ", ".join(f"{_ATTENTION_LABELS.get(k, k)} {format_bytes(v)}" for k, v in x["terms"].items())
    lines = ["", f"attention memory per layer (sp={sp}, {strategy})",
             f"  per device, estimate: b={at['b']} rows, seq_len={at['seq_len']}, {at['heads']} heads / "
             f"{at['kv_heads']} KV heads per tp rank, head_dim={at['head_dim']}, {at['dtype_bytes']} bytes per element",
             f"  {'sp=1 ' + at['baseline']:<24}{format_bytes(at['sp1']['bytes_per_layer']):>12}   {terms(at['sp1'])}"]
    if at["enabled"]:
        lines.append(f"  {f'sp={sp} {strategy}':<24}{format_bytes(at['this']['bytes_per_layer']):>12}   "
                     f"{terms(at['this'])}")
        others = ", ".join(f"{k} {v['ratio']:.4f}" + ("*" if k == strategy else "") if v else f"{k} n/a"
                           for k, v in at["strategies"].items())
        lines.append(f"  this / sp=1 = {at['ratio']:.4f} (1/sp = {1 / sp:.4f}); at sp={sp}: {others}")
    trend_strategy = strategy if at["enabled"] else next(iter(at["ratio_by_sp"]))
    trend = at["ratio_by_sp"].get(trend_strategy) or {}
    cells = ", ".join(f"sp={n} " + ("n/a" if r is None else f"{r:.4f}") for n, r in trend.items())
    refs = ", ".join(f"{1 / int(n):g}" for n in trend)
    lines.append(f"  this / sp=1 by sp at seq_len {at['seq_len']} ({trend_strategy}): {cells}   (1/sp: {refs})")
    return lines


def _format_attention_compiled(ac: dict) -> list[str]:
    """The compiled line under the attention section of `format_table`: one entry per implementation, the one this
    run uses starred (none with sp > 1: the islands run their own kernel)."""
    from jaxllm.ops.attention import IMPLEMENTATIONS

    names = [k for k in IMPLEMENTATIONS if k in ac] + [k for k in ac if k not in IMPLEMENTATIONS and
                                                       k not in _ATTENTION_COMPILED_KEYS]
    star = lambda k: "*" if k == ac["chosen"] and ac["sp"] == 1 else ""
    cells = ", ".join(f"{k}{star(k)} " + ("n/a" if ac[k] is None else format_bytes(ac[k])) for k in names)
    sh = ac["shape"]
    mark = (f" (* this run: model.attention_impl={ac['setting']})" if ac["sp"] == 1 else "")
    lines = [f"  compiled, one layer's forward+backward: {cells}{mark}",
             f"    (temporaries of jax.grad of one attention call on one device: b={sh['b']}, seq_len={sh['seq_len']}, "
             f"{sh['heads']} heads / {sh['kv_heads']} KV heads, head_dim={sh['head_dim']}, {sh['dtype']})"]
    return lines + [f"    ({note})" for note in ac["notes"]]


_ATTENTION_COMPILED_KEYS = ("chosen", "setting", "sp", "shape", "notes", "seconds")


def _format_pipeline(pl: dict) -> list[str]:
    """The "pipeline" section of `format_table` (pp > 1 only)."""
    cp, bub = pl["collective_permute"], pl["bubble"]
    slots = pl["act_depth"] + pl["grad_depth"]
    lines = ["", f"pipeline (pp={pl['pp']}, {pl['schedule']}, v={pl['v']}, m={pl['m']})",
             f"  {pl['ticks']} ticks; bubble {bub['table']:.4f} from the table at unit costs (closed form "
             f"{bub['formula']:.4f}), {bub['model_costs']:.4f} at this model's per-layer costs "
             f"(F : R : B : W = {' : '.join(f'{c:.2f}' for c in bub['costs'])})",
             f"  buffers: {pl['act_depth']} stage input(s) kept + {pl['grad_depth']} gradient slot(s) = {slots} × "
             f"b={pl['b']} × s={pl['s']} × d={pl['d']} × {pl['dtype_bytes']} B ({pl['dtype']}) = "
             f"{format_bytes(pl['buffer_bytes'])} per device"]
    if "stash_depth" in pl:
        lines.append(f"  W stash: ({pl['stash_depth']} slots + the one B makes + its probes) × "
                     f"{format_bytes(pl['stash_slot_bytes'])} = {format_bytes(pl['stash_bytes'])} per device")
    lines.append(f"  collective-permutes per step       {'count':>6}{'size/call':>12}{'bytes':>12}")
    rows = [(f"table: 2 × {pl['ticks']} ticks, {pl['dtype']}", cp)]
    if "compiled" in cp:
        if cp["moved_dtype"] != pl["dtype"]:
            rows.append((f"table at {cp['moved_dtype']} (as moved)", cp["moved"]))
        c = cp["compiled"]
        rows.append(("compiled", {**c, "bytes_per_call": c["bytes"] // c["count"] if c["count"] else 0}))
    for label, v in rows:
        size, total = format_bytes(v["bytes_per_call"]), format_bytes(v["bytes"])
        lines.append(f"    {label:<33}{v['count']:>6}{size:>12}{total:>12}")
    if "compiled" in cp:
        types = ", ".join(cp["compiled_dtypes"]) or "none found"
        note = (f"the program moves {cp['moved_dtype']}, not {pl['dtype']} (XLA converts around each permute)"
                if cp["moved_dtype"] != pl["dtype"] else f"the program moves {cp['moved_dtype']}")
        lines.append(f"  (element type of the compiled permutes of one slot: {types}; {note}; "
                     "compiled counts every collective-permute of the step)")
    return lines


def _format_generation(g: dict, compute: str) -> list[str]:
    return ["", f"generation per device (no compiling): {g['rows']} prompts of {g['prompt']} tokens + {g['new']} new, "
                f"KV cache of {g['slots']} slots, {compute}",
            f"  {'weights as used (copy)':<28}{format_bytes(g['weights_copy_bytes']):>12}   transient: gathered over "
            "fsdp/pp at the program's start, freed at its end",
            f"  {'KV cache':<28}{format_bytes(g['cache_bytes']):>12}   per token per layer, before any split: "
            f"{g['cache_per_token']['formula']} values = {format_bytes(g['cache_per_token']['bytes'])}"]


SEEDS_REMAT = [("none", "O(L): every activation", "1"), ("full", "O(L) layer inputs", "~1.33"),
               ("√L groups", "O(√L) group (and layer) inputs", "~1.33 to 1.67")]


def _format_remat(r: dict) -> list[str]:
    group = f"groups of {r['group']} of {r['repeats']} repeats per stage chunk" if r["group"] else "no groups"
    effect = (f", without groups {format_bytes(r['temp_bytes_without_group'])} "
              f"({r['temp_bytes'] / r['temp_bytes_without_group']:.2f}×)" if "temp_bytes_without_group" in r else "")
    lines = ["", f"activation recomputation: remat={r['remat']}, {group}; compiled temporaries "
             f"{format_bytes(r['temp_bytes'])}{effect} (python -m tools.remat_table compares the settings)",
             f"  {'seeds':<12}{'activation memory':<34}{'compute':>14}"]
    return lines + [f"  {name:<12}{memory:<34}{compute:>14}" for name, memory, compute in SEEDS_REMAT]


def _format_finetune(f: dict) -> list[str]:
    lines = ["", "train state per device for fine-tuning (model.lora; from each one's abstract state, not compiled)",
             f"  {'':<12}{'frozen base':>14}{'(adapted)':>12}{'trained':>14}{'optimizer':>14}{'total':>14}"
             f"{'step arguments':>16}"]
    for name, v in f.items():
        if "refused" in v:
            lines.append(f"  {name:<12}refused: {v['refused']}")
            continue
        lines.append(f"  {name:<12}{format_bytes(v['base_bytes']):>14}{format_bytes(v['adapted_base_bytes']):>12}"
                     + "".join(f"{format_bytes(v[k]):>14}" for k in ("trained_bytes", "optimizer_bytes", "total_bytes"))
                     + f"{format_bytes(v['argument_bytes']):>16}")
    return lines


def format_table(p: dict) -> str:
    """The plan as a readable table: compiled memory beside the theory, collectives, all stages."""
    c, mem, th = p["config"], p["memory"], p["theory"]
    stage, n = c["zero_stage"], th["fsdp"]
    mesh = " ".join(f"{a}={s}" for a, s in c["mesh"].items() if s > 1) or "1 device"
    preset = f"preset {c['preset']}, " if c["preset"] else ""
    lines = [
        f"plan: {preset}{c['family']} {c['n_layers']} layers, d_model={c['d_model']}, vocab={c['vocab_size']}; "
        f"Φ = {p['params']:,} parameters ({p['params'] / 1e6:.2f}M)",
        f"      mesh {mesh} over {p['devices']} {p['platform']} device(s)",
        f"      zero_stage={stage}, microbatches={c['microbatches']}, global_batch={c['global_batch']}, "
        f"seq_len={c['seq_len']}, compute={c['compute']}, optimizer={c['optimizer']}, remat={c['remat']}",
        "",
        f"memory per device          {'compiled':>12}   {'theory fp32':>12}   {'theory bf16 seeds':>17}",
    ]
    fp, bf = th["fp32"], th["bf16_seeds"]
    rows = [
        ("arguments", mem["argument_bytes"], f"{format_bytes(fp['argument_bytes'])}", ""),
        ("outputs", mem["output_bytes"], "", ""),
        ("aliased (donated)", mem["alias_bytes"], "", ""),
        ("temporaries", mem["temp_bytes"], "", ""),
        ("total", mem["total_bytes"], format_bytes(fp["total_bytes"]), format_bytes(bf["total_bytes"])),
    ]
    for name, val, a, b in rows:
        lines.append(f"  {name:<24}{format_bytes(val):>12}   {a:>12}   {b:>17}")
    lines.append(f"  (total = arguments + outputs - aliased + temporaries; theory for stage {stage}: "
                 f"arguments {fp['argument_formula']}, total {fp['total_formula']}, seeds {bf['total_formula']})")
    pl = p.get("pipeline", {})
    if pl.get("enabled"):
        ps = pl["params"]
        lines.append(f"  (pp={pl['pp']}: a device holds one stage, so theory Φ = stack / pp + embedding/head/final "
                     f"norm (replicated over pp) = {ps['stack']:,} / {pl['pp']} + {ps['shared']:,} = {ps['stage']:,})")
    if fp["argument_bytes"]:
        lines.append(f"  compiled arguments / theory arguments = {mem['argument_bytes'] / fp['argument_bytes']:.3f}")
    lines += ["", f"collectives per step per device (loops counted per trip)", f"  {'kind':<20}{'count':>8}{'bytes':>14}"]
    for k in KINDS:
        v = p["collectives"][k]
        lines.append(f"  {k:<20}{v['count']:>8}{format_bytes(v['bytes']):>14}")
    if p.get("unknown_trip_loops"):
        lines.append(f"  ({p['unknown_trip_loops']} loop(s) without a known trip count were counted once)")
    held = [f"one of {pl['pp']} stages"] if pl.get("enabled") else []
    if pl["params"]["experts"] and pl["params"]["ep"] > 1:
        held.append(f"1/{pl['params']['ep']} of the experts")
    phi = f"Φ = {th['params']:,}" + (f" ({', '.join(held)})" if held else "")
    lines += ["", f"ZeRO theory per device, {phi}, N = fsdp = {n}",
              f"  {'stage':<7}{'fp32 total':>22}{'fp32 arguments':>26}{'bf16 seeds total':>26}"]
    for s in ("0", "1", "2", "3"):
        f32, b16 = fp["stages"][s], bf["stages"][s]
        mark = "*" if int(s) == stage else " "
        lines.append(f"  {mark}{s:<6}{f32['total_formula']:>11} {format_bytes(f32['total_bytes']):>10}"
                     f"{f32['argument_formula']:>15} {format_bytes(f32['argument_bytes']):>10}"
                     f"{b16['total_formula']:>15} {format_bytes(b16['total_bytes']):>10}")
    lines.append(f"  (* this config; assumes {th['assumes']})")
    if mem.get("host_bytes"):
        lines.append(f"  host memory (offloaded state, memory.*): {format_bytes(mem['host_bytes'])} per device, "
                     "counted in the arguments above")
    if "remat" in p:
        lines += _format_remat(p["remat"])
    if "tensor_parallel" in p:
        lines += _format_tensor_parallel(p["tensor_parallel"], mem["temp_bytes"])
    if "attention" in p:
        lines += _format_attention(p["attention"])
    if "attention_compiled" in p:
        lines += _format_attention_compiled(p["attention_compiled"])
    if pl.get("enabled"):
        lines += _format_pipeline(pl)
    if "generation" in p:
        lines += _format_generation(p["generation"], c["compute"])
    if p.get("allreduce"):
        lines += _format_allreduce(p["allreduce"])
    if p.get("zeropp"):
        lines += _format_zeropp(p["zeropp"])
    if p.get("finetune"):
        lines += _format_finetune(p["finetune"])
    if p.get("matmuls"):
        lines += ["", "matmuls in the compiled program by runner and operand types (a loop body counted once)"]
        lines += [f"  {k:<60}{v:>6}" for k, v in p["matmuls"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli.config_parser("jaxllm plan", __doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object on the last stdout line")
    args = parser.parse_args(argv)

    def go():
        from jaxllm.mesh import initialize_distributed

        cfg = cli.load_config(args)
        initialize_distributed(cfg.distributed)
        result = plan(cfg)
        logging.getLogger("jaxllm").info("compiled in %.1f s", result["compile_seconds"])
        if args.json:
            print(format_table(result), file=sys.stderr)
            print(json.dumps(result, separators=(",", ":"), ensure_ascii=True))
        else:
            print(format_table(result))

    return cli.run(go)


if __name__ == "__main__":
    sys.exit(main())
