"""Attention memory per layer per device: one device's attention against context parallelism's strategies.

`attention_memory_theory` estimates, without compiling, the bytes one attention call's forward and backward
need at sp = 1 (dense, or the chunked kernel) and under each context-parallel strategy (ring, allgather,
ulysses) at this config's sp, with their ratios; checked by hand against compiled attention at seq 4096.
`attention_compiled` compiles one attention call's forward + backward per implementation on one device
at this config's per-device shapes and reads its temporaries, to set beside the estimate.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from jaxllm.models.attention import implementation, kv_heads, masking, qk_dim
from jaxllm.ops.attention import IMPLEMENTATIONS, attention
from jaxllm.ops.chunked_attention import BLOCK
from jaxllm.plan.memory import dtype_bytes, microbatch_rows

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
    m, t = model_cfg, train_cfg
    tp = int(mesh_shape.get("tp", 1))
    sp = int(mesh_shape.get("sp", 1))
    E = dtype_bytes(compute_dtype)
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
def _attention_temp_bytes(impl: str, b: int, s: int, heads: int, kv: int, dh: int, dtype: str, mask) -> int:
    """Temporaries of `jax.grad` of sum(attention(q, k, v) · ct) with `impl`, compiled on one device from
    abstract inputs (nothing allocated)."""
    def loss(q, k, v, ct, pos, seg):
        out = attention(q, k, v, pos, pos, seg, seg, mask, impl)
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
