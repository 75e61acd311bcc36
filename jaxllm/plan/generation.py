"""Generation's memory per device, without compiling: the weights as the KV-cache generator reads them, and its cache.

A rollout of train.global_batch prompts of seq_len/2 tokens and seq_len/2 new ones on the training mesh:
the transient compute-dtype copy of the weights (gathered under ZeRO-3 or a pipeline) and the cache (the
attention layers' KV cache, which grows with the slots, and the linear layers' fixed-size state, which does
not), each from the generator's own sizing (`jaxllm.generate`); and the resharding that makes the copy (the rollout
engine runs it once per rollout): the bytes a device receives, and with a chip their time at its interconnect
bandwidth (a lower bound: every link busy, no latency). With `rl.sampler = "engine"` the rollout engine's page
pools besides: `rl.engine_pages` a shard, or what its slots' longest completions (seq_len tokens) need at once.
"""

from __future__ import annotations

from jaxllm.generate import cache, decode, engine
from jaxllm.plan.flops import CHIPS
from jaxllm.plan.memory import dtype_bytes


def generation_theory(cfg, fns, chip: str | None = None) -> dict:
    """Generation's memory per device (no compiling): a rollout of train.global_batch prompts of seq_len/2
    tokens and seq_len/2 new ones on this mesh. The program reads a compute-dtype copy of the weights laid
    out as used (under ZeRO-3 or pp > 1 gathered: the whole model / tp), alive only while it runs, and
    the KV cache; tests/test_plan.py checks both against the compiled program's temporaries, and
    tests/test_engine.py the resharding's bytes against its compiled all-gathers."""
    m, dtype = cfg.model, cfg.precision.compute
    prompt = max(1, m.seq_len // 2)
    new = max(1, m.seq_len - prompt)
    slots = decode.bucket(prompt) + new
    values, formula = cache.per_token(m)
    received = decode.reshard_bytes(m, dtype, fns)
    parts = cache.cache_parts(m, cfg.train.global_batch, slots, dtype, fns)
    return {"rows": cfg.train.global_batch, "prompt": prompt, "new": new, "slots": slots,
            "weights_copy_bytes": decode.weights_copy_bytes(m, dtype, fns), "reshard_bytes": received,
            "reshard_s": None if chip is None else received / CHIPS[chip][2],
            "cache_bytes": sum(parts.values()), "kv_cache_bytes": parts["attention"],
            "attention_layers": cache.layer_counts(m)[0],
            "cache_per_token": {"values": values, "formula": formula, "bytes": values * dtype_bytes(dtype)},
            "linear_state": _linear_state(m, dtype, parts["linear"]), "engine_pool": _engine_pool(cfg, fns)}


def _engine_pool(cfg, fns) -> dict | None:
    """The rollout engine's page pools on a device where GRPO samples on it (None elsewhere): pages a shard
    (`rl.engine_pages`, or `engine.pool_pages` for its slots' completions of up to seq_len tokens) and bytes."""
    rl, m = cfg.rl, cfg.model
    if rl.sampler != "engine":
        return None
    layout = cache.layout_for(fns)
    slots, shards = cache.padded_rows(rl.engine_slots or cfg.train.global_batch, layout), cache.padded_rows(1, layout)
    pages = rl.engine_pages or engine.pool_pages(slots // shards, -(-m.seq_len // engine.PAGE))
    return {"slots": slots, "pages": pages, "page": engine.PAGE,
            "bytes": cache.pool_bytes(m, pages, engine.PAGE, cfg.precision.compute, fns)}


def _linear_state(m, dtype, total: int) -> dict | None:
    """The linear layers' state: `total` bytes on a device, and one layer's per row before any split with its
    formula (the convolution's window in the compute dtype, the recurrence's state in fp32); None without them."""
    layers = cache.layer_counts(m)[1]
    if not layers:
        return None
    window, state, formula = cache.per_row_state(m)
    return {"layers": layers, "bytes": total,
            "per_row": {"formula": formula, "bytes": window * dtype_bytes(dtype) + 4 * state}}
