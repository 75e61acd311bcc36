"""Tensor parallelism: the activation collectives of one layer and the activations autodiff saves, per device.

Pure arithmetic, no compiling (`tensor_parallel_theory`): for TP alone, with Megatron sequence parallelism
and with collective matmuls, the count, bytes per call and ring bytes sent of each collective; and an
estimate of the activations autodiff saves per layer with and without sequence parallelism. The
collectives are exact for the layers (tests/test_plan.py checks the collective-permutes of a compiled
step against them); the activations are an estimate, not read from XLA.
"""

from __future__ import annotations

from jaxllm.models.attention import kv_heads, qk_dim
from jaxllm.plan.memory import dtype_bytes, microbatch_rows

TP_SETTINGS = {"tp": "TP alone", "sp": "sequence parallel", "sp_cm": "SP + collective matmul"}

TP_ASSUMES = ("Megatron layout: per layer 2 column-parallel entries (QKV, MLP in) and 2 row-parallel exits "
              "(attention out, MLP out); only the [b, s, d] activation collectives of the layers are counted "
              "(not the embedding, the loss, or parameter-gradient reductions such as the norms' over tp "
              "under SP); per device per microbatch")


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
    [b, s, d]; reduce-scatter and collective-permute: the shard), as jaxllm.plan.hlo counts;
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
    m, t = model_cfg, train_cfg
    n = int(mesh_shape.get("tp", 1))
    E = dtype_bytes(compute_dtype)
    b = microbatch_rows(t, mesh_shape)
    s = m.seq_len // mesh_shape.get("sp", 1)
    d = m.d_model
    setting = "sp_cm" if t.sequence_parallel and m.collective_matmul else "sp" if t.sequence_parallel else "tp"
    enabled = n > 1
    reps = m.n_layers * t.microbatches  # the layer scan runs once per microbatch
    collectives: dict[str, dict] = {}
    for name in TP_SETTINGS:
        fwd, bwd = _layer_collectives(name, n, b, s, d, E)
        per_layer = _sum_by_kind(fwd + bwd)
        collectives[name] = {
            "forward": fwd, "backward": bwd, "per_layer": per_layer,
            "per_step": {k: {key: v * reps for key, v in c.items()} for k, c in per_layer.items()}}
    terms = saved_activation_terms(m, n, b, s, E)
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


def _layer_collectives(setting: str, n: int, b: int, s: int, d: int, E: int) -> tuple[list[dict], list[dict]]:
    """(forward, backward) collectives of one layer under `setting` on tp = n (see `tensor_parallel_theory`);
    none with n = 1."""
    if n == 1:
        return [], []
    full = b * s * d * E
    shard = full // n  # the residual stream's sequence block under SP (s divisible by sp·tp there)
    if setting == "tp":
        ar = 2 * (n - 1) * full // n
        return ([_collective("all-reduce", 2, full, ar, "outputs of the 2 row-parallel projections")],
                [_collective("all-reduce", 2, full, ar, "input gradients of the 2 column-parallel entries")])
    if setting == "sp":
        ring = (n - 1) * full // n
        ag_in = _collective("all-gather", 2, full, ring, "the sequence into the 2 column-parallel entries")
        rs_out = _collective("reduce-scatter", 2, shard, ring, "the 2 row-parallel outputs into the residual")
        ag_bwd = _collective("all-gather", 2, full, ring, "gradients of the 2 row-parallel outputs")
        rs_bwd = _collective("reduce-scatter", 2, shard, ring, "input gradients of the 2 column-parallel entries")
        return [ag_in, rs_out], [rs_bwd, ag_bwd]
    block = s // n  # "sp_cm"
    pieces = 1 if block % 2 else 2
    per_call = 2 * (n - 1) if pieces == 2 else n - 1
    size = b * (block // pieces) * d * E
    count = 4 * per_call
    return ([_collective("collective-permute", count, size, size,
                         f"4 calls (2 all-gather→matmul, 2 matmul→reduce-scatter) × {per_call} permutes")],
            [_collective("collective-permute", count, size, size, "the dual rings of the same 4 calls")])


def saved_activation_terms(m, n: int, b: int, s: int, E: int) -> dict:
    """What autodiff saves of one layer per device by term, {name: {"without_sp", "with_sp"}} (an estimate, see
    `tensor_parallel_theory`)."""
    d, H, F = m.d_model, m.n_heads, m.d_ff
    dh = qk_dim(m)  # MLA: its values' width v_head_dim counted as the queries' (an estimate)
    kv_eff = max(kv_heads(m), n)
    terms_tp = {
        "residual": 2 * b * s * d * E,
        "region_inputs": 2 * b * s * d * E,
        "qkv": b * s * (H + 2 * kv_eff) * dh * E // n,
        "attention_probs": b * H * s * m.seq_len * (4 + (E if E != 4 else 0)) // n,
        "attention_out": b * s * H * dh * E // n,
        "mlp_hidden": (2 if m.mlp == "gelu_tanh" else 3) * b * s * F * E // n,
    }
    return {k: {"without_sp": v, "with_sp": v // n if k == "residual" else v} for k, v in terms_tp.items()}
