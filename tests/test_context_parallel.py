"""Context parallelism over `sp`: ring, all-gather and Ulysses attention (fp32, 8 fake CPU devices).

Attention level: each strategy's forward and the gradients of q, k and v equal plain
causal attention for sp ∈ {2, 4, 8}, with and without zig-zag load balancing (pairwise), with
grouped-query attention (2 KV heads for 8 query heads: fewer than sp at sp=4 and 8).
Model level: one step's loss and gradients equal the independent reference on
sp=4, sp=2×fsdp=4 and sp=2×tp=2×fsdp=2, and with 2 microbatches (the accumulation island
at ZeRO-0 and the sharded scan at ZeRO-3) for each strategy. Then the compiled programs (the
ring moves K/V by collective-permutes only; each strategy's attention memory at seq 4096 and
sp=8 against jaxllm plan's estimate), the score blocks the ring computes (counted inside the
island), and the causal work per rank under load balancing.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from harness import (BATCH, SEQ, assert_matches, equivalence_config, loss_and_grads, lower_loss_and_grads, reference,
                     step_fns, tiers)
from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError
from jaxllm.mesh import make_mesh
from jaxllm.models.attention import CONTEXT_ATTENTION, attend
from jaxllm.ops.attention import attention, dot_product_attention
from jaxllm.ops.masking import Masking
from jaxllm.parallel import ring_attention, ulysses_attention
from jaxllm.parallel.load_balance import visible_blocks, zigzag_order
from jaxllm.sharding import Layout, param_rules, use_layout
from jaxllm.plan.attention import attention_memory_theory
from jaxllm.plan.hlo import collectives_per_step, executed_collectives, memory_summary

PRESETS = {"gpt2": "tiny-gpt2", "llama": "tiny-llama"}

STRATEGIES = ("ring", "allgather", "ulysses")
B, S, H, KV, D = 4, 64, 8, 2, 8
RTOL = 1e-5


def layout_for(sp: int, strategy: str, devices=None):
    cfg = build_config(None, {"model.preset": "tiny-llama", "model.vocab_size": 257, "mesh.dp": -1, "mesh.sp": sp})
    devices = devices or jax.devices()
    shape, _ = validate(cfg, len(devices))
    return Layout(make_mesh(shape, cfg, devices=devices), param_rules(False), context_attention=strategy)


def qkv(seq: int = S, heads: int = H, kv: int = KV, batch: int = B):
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, D), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq, kv, D), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq, kv, D), jnp.float32)
    ct = jax.random.normal(keys[3], (batch, seq, heads, D), jnp.float32)
    return q, k, v, ct


def loss_fn(layout, order, seq: int):
    """sum(attention(q, k, v) * ct) with the sequence laid out in `order` (positions follow)."""
    identity = bool(np.all(order == np.arange(seq)))  # then no gather: the arrays stay where they are
    laid_out = (lambda x: x) if identity else (lambda x: x[:, order])
    back = (lambda x: x) if identity else (lambda x: x[:, np.argsort(order)])

    def f(q, k, v, ct):
        b = q.shape[0]
        pos = laid_out(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq)))
        seg = jnp.zeros((b, seq), jnp.int32)
        with use_layout(layout):
            out = attend(laid_out(q), laid_out(k), laid_out(v), pos, seg)
        return jnp.sum(back(out) * ct)

    return f


@functools.lru_cache(maxsize=None)
def attention_reference():
    q, k, v, ct = qkv()
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    seg = jnp.zeros((B, S), jnp.int32)
    f = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, pos, pos, seg, seg) * ct)
    return jax.device_get(jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v))


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


# every strategy at every sp, each (strategy, order) and (sp, order) pair covered
ATTENTION_CASES = [("ring", 2, True), ("ring", 4, False), ("ring", 8, True),
                   ("allgather", 2, False), ("allgather", 4, True), ("allgather", 8, False),
                   ("ulysses", 2, True), ("ulysses", 4, False), ("ulysses", 8, True)]


@pytest.mark.parametrize("strategy,sp,balanced", tiers(ATTENTION_CASES, {("ring", 4, False), ("ulysses", 8, True)}))
def test_attention_matches_full_causal_attention(strategy, sp, balanced):
    layout = layout_for(sp, strategy)
    order = zigzag_order(S, sp) if balanced else np.arange(S)
    q, k, v, ct = qkv()
    seq_sharded = NamedSharding(layout.mesh, P("dp", "sp"))
    args = [jax.device_put(x, seq_sharded) for x in (q, k, v, ct)]
    f = jax.jit(jax.value_and_grad(loss_fn(layout, order, S), argnums=(0, 1, 2)))
    value, grads = f(*args)
    ref_value, ref_grads = attention_reference()
    assert abs(float(value) - float(ref_value)) <= RTOL * abs(float(ref_value))
    for g, r in zip(grads, ref_grads):  # dq, dk, dv
        assert rel(g, r) <= RTOL
    # the forward output itself, not only its projection on ct
    with use_layout(layout):
        pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[order], (B, S))
        out = jax.jit(lambda q, k, v: attend(q[:, order], k[:, order], v[:, order], pos, jnp.zeros_like(pos)))(
            *args[:3])
    seg = jnp.zeros((B, S), jnp.int32)
    natural = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    expected = dot_product_attention(q, k, v, natural, natural, seg, seg)
    assert rel(np.asarray(out)[:, np.argsort(order)], expected) <= RTOL


WINDOW_CASES = [("ring", 2, True, Masking(window=17)), ("ring", 8, False, Masking(window=5, softcap=30.0)),
                ("allgather", 4, True, Masking(window=17, softcap=30.0)), ("ulysses", 4, False, Masking(window=17))]


@pytest.mark.parametrize("strategy,sp,balanced,masking", tiers(WINDOW_CASES, {WINDOW_CASES[0]}))
def test_windowed_attention_matches_one_device(strategy, sp, balanced, masking):
    """With a window (and a soft cap): each island's output and its gradients of q, k and v equal one device's
    dense attention with the same masking, zig-zag order or not."""
    layout = layout_for(sp, strategy)
    order = zigzag_order(S, sp) if balanced else np.arange(S)
    q, k, v, ct = qkv()
    natural = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    seg = jnp.zeros((B, S), jnp.int32)
    pos = natural[:, order]

    def island(q, k, v):
        out = CONTEXT_ATTENTION[strategy].attend(q[:, order], k[:, order], v[:, order], pos, seg, layout, masking)
        return out[:, np.argsort(order)]

    one = lambda q, k, v: dot_product_attention(q, k, v, natural, natural, seg, seg, masking)
    args = [jax.device_put(x, NamedSharding(layout.mesh, P("dp", "sp"))) for x in (q, k, v)]
    for got, want in zip(output_and_grads(island, args, ct), output_and_grads(one, (q, k, v), ct)):
        assert rel(got, want) <= RTOL  # out, dq, dk, dv


def output_and_grads(f, args, ct):
    out, pull = jax.vjp(jax.jit(f), *args)
    return (out, *pull(ct))


# name -> (mesh axes, zero stage, extra settings)
MESHES = {
    "sp4": (dict(sp=4), 0, {}),
    "sp2_fsdp4": (dict(sp=2, fsdp=4), 3, {}),
    "sp2_tp2_fsdp2": (dict(sp=2, tp=2, fsdp=2), 3, {"train.sequence_parallel": True}),
}
CASES = [(mesh, "ring") for mesh in MESHES] + [("sp4", "allgather"), ("sp4", "ulysses"),
                                               ("sp2_tp2_fsdp2", "ulysses")]
# Several microbatches: the accumulation island (ZeRO-0/1, manual over the batch axes, the attention
# island nested in it) and the sharded accumulation scan (ZeRO-3), each strategy on each, pairwise
# with the model family.
MICROBATCHES = {
    "dp2_sp2_fsdp2_zero0_mb2": (dict(dp=2, sp=2, fsdp=2), 0, {"train.microbatches": 2}),
    "dp2_sp2_fsdp2_zero3_mb2": (dict(dp=2, sp=2, fsdp=2), 3, {"train.microbatches": 2}),
}
MESHES.update(MICROBATCHES)
MICROBATCH_CASES = [("gpt2", "dp2_sp2_fsdp2_zero0_mb2", "ring"), ("llama", "dp2_sp2_fsdp2_zero3_mb2", "ring"),
                    ("llama", "dp2_sp2_fsdp2_zero0_mb2", "allgather"), ("gpt2", "dp2_sp2_fsdp2_zero3_mb2", "allgather"),
                    ("gpt2", "dp2_sp2_fsdp2_zero0_mb2", "ulysses"), ("llama", "dp2_sp2_fsdp2_zero3_mb2", "ulysses")]


def cp_config(family: str, mesh: str, strategy: str, **extra):
    axes, stage, options = MESHES[mesh]
    return equivalence_config(PRESETS[family], **{**{f"mesh.{a}": n for a, n in axes.items()}, **options,
                                                  "train.zero_stage": stage, "model.cp_strategy": strategy, **extra})


@pytest.mark.parametrize("family,mesh,strategy", tiers(
    [(f, *c) for c in CASES for f in PRESETS] + MICROBATCH_CASES,
    {("gpt2", "sp4", "ring"), ("llama", "sp2_tp2_fsdp2", "ulysses"), ("llama", "dp2_sp2_fsdp2_zero3_mb2", "ring")}))
def test_loss_and_grads_match_the_reference(family, mesh, strategy):
    cfg = cp_config(family, mesh, strategy)
    ref = reference(equivalence_config(PRESETS[family]).model)
    loss, grads = loss_and_grads(step_fns(cfg), ref[0])
    assert_matches(loss, grads, ref)


@pytest.mark.slow
def test_collective_matmuls_under_context_parallelism_equal_one_device_and_gather_nothing_over_sp():
    """sp2 × tp2 × fsdp2 (ZeRO-3, sequence parallel, ring) with the projections as collective matmuls: one step's
    loss and gradients equal the plain reference; the rings run within each sp rank's block of the sequence, so
    the residual stream's all-gathers of that block ([b, s/sp, d]) give way to collective-permutes of half of a
    tp block ([b, s/(2·sp·tp), d]) and no whole sequence is gathered."""
    ref = reference(equivalence_config(PRESETS["llama"]).model)
    plain, rings = (step_fns(cp_config("llama", "sp2_tp2_fsdp2", "ring", **{"model.collective_matmul": cm}))
                    for cm in (False, True))
    assert_matches(*loss_and_grads(rings, ref[0]), ref)
    b, d = BATCH // 2, equivalence_config(PRESETS["llama"]).model.d_model  # the rows of one fsdp shard
    shapes = {"block": f"f32[{b},{SEQ // 2},{d}]", "half": f"f32[{b},{SEQ // 8},{d}]", "whole": f"f32[{b},{SEQ},{d}]"}

    def moved(fns, kind: str, size: str) -> int:
        ops, _ = executed_collectives(lower_loss_and_grads(fns).compile().as_text())
        return sum(1 for o in ops if o["kind"] == kind and o["type"].startswith(shapes[size] + "{"))

    assert moved(rings, "all-gather", "block") < moved(plain, "all-gather", "block")
    assert moved(rings, "collective-permute", "half") > 0 == moved(plain, "collective-permute", "half")
    assert moved(rings, "all-gather", "whole") == 0


WINDOWED = {"model.sliding_window": 8, "model.window_pattern": ["local", "global"]}  # per-layer windows, scanned


@pytest.mark.slow
@pytest.mark.parametrize("mesh,strategy", [("sp4", "ring"), ("sp4", "allgather"), ("sp4", "ulysses"),
                                           ("sp2_tp2_fsdp2", "ring")])
def test_windowed_model_matches_one_device(mesh, strategy):
    """tiny-llama with a window of 8 on every other layer (seq 32): one step's loss and gradients over sp equal
    the same model's on one device (the plain reference has no window; one device's chunked kernel is checked
    against a float64 reference in tests/test_attention_kernels.py)."""
    params = reference(equivalence_config(PRESETS["llama"]).model)[0]  # a window changes no parameter
    loss, grads = loss_and_grads(step_fns(equivalence_config(PRESETS["llama"], **WINDOWED)), params)
    got = loss_and_grads(step_fns(cp_config("llama", mesh, strategy, **WINDOWED)), params)
    assert_matches(*got, (params, float(loss), grads))


@pytest.mark.parametrize("impl,over,why", [
    ("dense", {}, "the context-parallel islands run the chunked kernel"),
    ("pallas_gpu", {"model.cp_strategy": "allgather"}, "model.cp_strategy=ulysses"),
    ("pallas_gpu", {"model.sliding_window": 8}, "a window"),
    ("pallas_gpu", {}, "runs on gpu")])  # this machine: CPU
def test_an_explicit_kernel_the_islands_do_not_run_is_refused(impl, over, why):
    """With sp > 1 the islands run the chunked kernel, and the ring pallas_gpu where it computes every pair: another
    explicit `model.attention_impl`, or pallas_gpu where a pair is neither diagonal nor full, is refused in one
    line naming the key and why, not replaced."""
    with pytest.raises(ConfigError) as info:
        validate(cp_config("llama", "sp4", "ring", **{"model.attention_impl": impl, **over}), 4)
    message = str(info.value)
    assert f"model.attention_impl={impl}" in message and why in message and "\n" not in message, message
    validate(cp_config("llama", "sp4", "ring", **{"model.attention_impl": "chunked"}), 4)


RING_PAIRS = {"sp2_zigzag": (2, True), "sp4": (4, False)}  # the kernel: chunks of ≥ 16 rows


@pytest.mark.parametrize("case", tiers(RING_PAIRS, ()))  # the fast tier: the export below
def test_the_ring_on_the_pallas_kernel_equals_the_chunked_ring(case):
    """Grouped queries over sp ranks, in sequence order or zig-zag, the Triton kernel in interpret mode on the
    causal and full chunk pairs (its log-sum-exp combining them, its backward kernel from the whole row's): the
    value and dq, dk, dv equal the chunked ring's and the one-device reference within 1e-5."""
    sp, balanced = RING_PAIRS[case]
    order = zigzag_order(S, sp) if balanced else np.arange(S)
    layout = dataclasses.replace(layout_for(sp, "ring"), sequence_order=tuple(order.tolist()) if balanced else None)
    q, k, v, ct = qkv()
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[order], (B, S))
    seg = jnp.zeros((B, S), jnp.int32)
    ring = lambda kernel: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(ring_attention.attend(
        q[:, order], k[:, order], v[:, order], pos, seg, layout, kernel=kernel, interpret=True) * ct[:, order]),
        argnums=(0, 1, 2)))
    (value, grads), (chunked_value, chunked_grads) = ring("pallas_gpu")(q, k, v), ring("chunked")(q, k, v)
    ref_value, ref_grads = attention_reference()
    for want, want_grads in ((chunked_value, chunked_grads), (ref_value, ref_grads)):
        assert abs(float(value) - float(want)) <= RTOL * abs(float(want))
        assert max(rel(g, r) for g, r in zip(grads, want_grads)) <= RTOL



ULYSSES_FUSED = {"sp2_zigzag_packed": (2, True, True), "sp4": (4, False, False)}


@pytest.mark.parametrize("case", tiers(ULYSSES_FUSED, ()))  # the fast tier: the export below
def test_ulysses_on_the_pallas_kernel_equals_one_device(case):
    """The Ulysses island on the Triton kernel (interpret mode), each rank's heads over the whole sequence, the
    zig-zag order put back in index order around the call, and packed rows (two segments a row, positions from
    each one's start), which the ring's fused pairs cannot take: the value and dq, dk, dv equal the one-device
    reference within 1e-5."""
    sp, balanced, packed = ULYSSES_FUSED[case]
    order = zigzag_order(S, sp) if balanced else np.arange(S)
    layout = dataclasses.replace(layout_for(sp, "ulysses"), sequence_order=tuple(order.tolist()) if balanced else None)
    q, k, v, ct = qkv()
    index, length = jnp.arange(S, dtype=jnp.int32), S // 2 if packed else S
    pos, seg = (jnp.broadcast_to(x, (B, S)) for x in (index % length, index // length))
    reference = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, pos, pos, seg, seg) * ct)
    fused = lambda q, k, v: jnp.sum(ulysses_attention.attend(
        q[:, order], k[:, order], v[:, order], pos[:, order], seg[:, order], layout, kernel="pallas_gpu",
        interpret=True) * ct[:, order])
    (value, grads), (want, want_grads) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)
                                          for f in (fused, reference))
    assert abs(float(value) - float(want)) <= RTOL * abs(float(want))
    assert max(rel(g, r) for g, r in zip(grads, want_grads)) <= RTOL


def test_ulysses_exports_for_cuda_with_the_triton_kernel_between_its_all_to_alls():
    """Ulysses on pallas_gpu (interpret off), forward and backward exported for CUDA from this CPU machine over
    sp=2: the Triton custom call is there, between the island's all-to-alls."""
    text = _exported_for_cuda("ulysses")
    assert TRITON in text and "stablehlo.all_to_all" in text


TRITON = "__gpu$xla.gpu.triton"


def _exported_for_cuda(strategy: str) -> str:
    """The MLIR of the gradients of `strategy`'s island on pallas_gpu over sp=2, exported for CUDA from this CPU."""
    layout = layout_for(2, strategy, devices=jax.devices()[:2])
    q, k, v, ct = qkv()
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    seg = jnp.zeros((B, S), jnp.int32)
    island = CONTEXT_ATTENTION[strategy]
    loss = lambda q, k, v: jnp.sum(island.attend(q, k, v, pos, seg, layout, kernel="pallas_gpu") * ct)
    return jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(TRITON)])(q, k, v).mlir_module()


def _functions_calling(text: str, target: str) -> set[str]:
    """The MLIR module's functions whose body holds `target` or calls such a function."""
    bodies = dict(re.findall(r"func\.func (?:public|private) @([\w.$]+)\((.*?)(?=\n  func\.func |\Z)", text, re.S))
    found, grew = set(), True
    while grew:
        new = {name for name, body in bodies.items() if target in body or any(f"@{f}(" in body for f in found)}
        grew, found = new != found, new
    return found


def _while_bodies(text: str) -> list[str]:
    """The text of each stablehlo.while op, from its line to the closing brace at its own indentation."""
    lines, out = text.split("\n"), []
    for i, line in enumerate(lines):
        if "stablehlo.while(" in line:
            indent = line[:len(line) - len(line.lstrip())]
            closing = [j for j in range(i + 1, len(lines)) if lines[j].startswith(indent + "}")]
            out.append("\n".join(lines[i:closing[1] + 1] if len(closing) > 1 else lines[i:]))
    return out


def test_the_ring_exports_for_cuda_with_the_triton_kernel_inside_its_loops():
    """The ring's forward and backward on pallas_gpu (interpret off), exported for CUDA from this CPU machine over
    sp=2: the Triton custom call is called from inside each ring loop (the forward's and the backward's)."""
    text = _exported_for_cuda("ring")
    calling = _functions_calling(text, TRITON)
    loops = _while_bodies(text)
    assert len(loops) == 2, len(loops)  # the forward's ring and the backward's
    for loop in loops:
        assert TRITON in loop or any(f"@{f}(" in loop for f in calling), loop[:500]


@functools.lru_cache(maxsize=None)
def compiled_attention(sp: int, strategy: str, seq: int, heads: int = H, kv: int = KV):
    """The attention forward + backward (gradients of q, k, v), compiled for batch 1."""
    q, k, v, ct = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv(seq, heads, kv, batch=1))
    if sp == 1:
        layout, shardings = None, None
    else:
        layout = layout_for(sp, strategy, devices=jax.devices()[:sp])
        shardings = NamedSharding(layout.mesh, P(None, "sp"))
    f = jax.value_and_grad(loss_fn(layout, np.arange(seq), seq), argnums=(0, 1, 2))
    devices_note = {} if shardings is None else dict(in_shardings=(shardings,) * 4)
    return jax.jit(f, **devices_note).lower(q, k, v, ct).compile()


def test_ring_moves_kv_by_collective_permutes_only():
    counts = {k: v["count"] for k, v in collectives_per_step(compiled_attention(4, "ring", S).as_text()).items()}
    assert counts["collective-permute"] > 0
    assert counts["all-gather"] == counts["all-to-all"] == counts["reduce-scatter"] == 0
    # the control: all-gather attention does gather
    gathered = collectives_per_step(compiled_attention(4, "allgather", S).as_text())
    assert gathered["all-gather"]["count"] > 0


def planned_bytes(seq: int, sp: int, strategy: str, impl: str = "chunked") -> int:
    """`jaxllm plan`'s estimate (`attention_memory_theory`) for this file's attention shapes, batch 1, fp32."""
    cfg = build_config(None, {"model.preset": "tiny-llama", "model.vocab_size": 257, "model.n_kv_heads": KV,
                              "model.seq_len": seq, "model.cp_strategy": strategy, "model.attention_impl": impl,
                              "mesh.dp": 1, "mesh.sp": sp, "train.global_batch": 1, "precision.compute": "float32"})
    theory = attention_memory_theory(cfg.model, cfg.train, validate(cfg, sp)[0], "float32")
    assert (theory["heads"], theory["kv_heads"], theory["head_dim"], theory["b"]) == (H, KV, D, 1)
    return theory["this"]["bytes_per_layer"] if sp > 1 else theory["sp1"]["bytes_per_layer"]


@functools.lru_cache(maxsize=None)
def one_device_temporaries(seq: int, impl: str) -> int:
    q, k, v, ct = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv(seq, batch=1))
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (1, seq))
    f = lambda q, k, v, ct: jnp.sum(attention(q, k, v, pos, pos, jnp.zeros_like(pos), jnp.zeros_like(pos),
                                              impl=impl) * ct)
    return memory_summary(jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v, ct).compile())["temp_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_attention_memory_is_what_the_planner_says(strategy):
    """seq_len 4096: the compiled attention's per-device temporaries (forward and backward) within 0.8× to 1.2×
    of `jaxllm plan`'s estimate, for dense and chunked on one device and the strategy at sp=8; and at most 1/40
    of dense's (which keeps [heads, seq, seq] scores; the islands run the chunked kernel)."""
    seq, sp = 4096, 8
    dense = one_device_temporaries(seq, "dense")
    assert dense >= seq * seq * 4 * H  # the scores are there
    for got, planned in ((dense, planned_bytes(seq, 1, strategy, "dense")),
                         (one_device_temporaries(seq, "chunked"), planned_bytes(seq, 1, strategy)),
                         (memory_summary(compiled_attention(sp, strategy, seq))["temp_bytes"],
                          planned_bytes(seq, sp, strategy))):
        assert 0.8 <= got / planned <= 1.2, (got, planned)
    assert memory_summary(compiled_attention(sp, strategy, seq))["temp_bytes"] <= dense / 40


@functools.lru_cache(maxsize=None)
def island_temporaries(strategy: str, sp: int, rows: int, block: int) -> int:
    """Temporaries of the island's forward + backward, `rows` query rows per rank (the sequence sp·rows), blocks
    of `block` rows, head_dim 64 (so the rows, not the blocks, dominate)."""
    seq, layout = sp * rows, layout_for(sp, strategy, devices=jax.devices()[:sp])
    split = NamedSharding(layout.mesh, P(None, "sp"))
    x = lambda heads: jax.ShapeDtypeStruct((1, seq, heads, 64), jnp.float32, sharding=split)

    def f(q, k, v, ct):
        pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (1, seq))
        out = CONTEXT_ATTENTION[strategy].attend(q, k, v, pos, jnp.zeros_like(pos), layout, block=block)
        return jnp.sum(out * ct)

    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(x(H), x(KV), x(KV), x(H)).compile()
    return memory_summary(compiled)["temp_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_island_memory_does_not_grow_with_the_kv_steps(strategy):
    """256 query rows per rank, from sp=4 to sp=8 (twice the K/V steps): the temporaries grow by no more than
    what the strategy holds whole by design, not by a softmax state per step (fp32 out, max and sum of the
    rank's rows: 2.1 MB more here, as the blockwise kernel before the chunked one kept). The ring holds
    nothing whole: flat. Allgather holds the gathered K and V and, in its backward, their gradients
    and the all-reduce that transposes the gather on CPU: 6 [S, kv, 64] fp32 arrays, with the int32 positions
    and segment ids; Ulysses the same of its one KV head per rank."""
    rows, block = 256, 64
    grown = island_temporaries(strategy, 8, rows, block) - island_temporaries(strategy, 4, rows, block)
    kv_per_rank = {"ring": 0, "allgather": KV, "ulysses": 1}[strategy]
    whole = 6 * (8 - 4) * rows * kv_per_rank * 64 * 4 + (2 * (8 - 4) * rows * 4 if kv_per_rank else 0)
    assert grown <= whole, (grown, whole)


def blocks_seen_by_the_mask(order: np.ndarray, sp: int, pieces: int = 2) -> list[int]:
    """Per rank, the (query piece, key piece) pairs in which the dense causal mask lets some query see
    some key: counted from the [S, S] mask itself, not from the kernel's skip test."""
    n = sp * pieces
    mask = order[:, None] >= order[None, :]  # laid-out order; a query sees keys at earlier positions
    seen = mask.reshape(n, len(order) // n, n, len(order) // n).any(axis=(1, 3))  # [query piece, key piece]
    return seen.reshape(sp, pieces * n).sum(axis=1).tolist()


@pytest.mark.parametrize("sp,balanced", tiers([(sp, b) for sp in (2, 4, 8) for b in (False, True)],
                                              {(4, False), (4, True)}))
def test_ring_computes_only_the_visible_blocks(sp, balanced):
    """The ring island counts, in the branch that runs, the (query piece, key piece) score blocks it
    computes: per rank, exactly the blocks in which some query may see some key (by position), fewer
    than all of them, and with zig-zag the same number on every rank."""
    layout = layout_for(sp, "ring")
    order = zigzag_order(S, sp) if balanced else np.arange(S)
    q, k, v, _ = qkv()
    pos = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, S))
    seq_sharded = NamedSharding(layout.mesh, P("dp", "sp"))
    args = [jax.device_put(x, seq_sharded) for x in (q[:, order], k[:, order], v[:, order], pos, jnp.zeros_like(pos))]
    pieces = 2  # query blocks per rank, and key blocks per K/V block
    count = lambda *a: ring_attention.attend(*a, layout, count_blocks=True, block=S // sp // pieces)
    _, counts = jax.jit(count)(*args)
    counts = [int(c) for c in np.asarray(counts)]
    assert counts == blocks_seen_by_the_mask(order, sp, pieces)
    assert sum(counts) < sp * pieces * sp * pieces
    assert (len(set(counts)) == 1) == balanced


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(sp):
    balanced = visible_blocks(zigzag_order(S, sp), sp)
    assert balanced == blocks_seen_by_the_mask(zigzag_order(S, sp), sp)
    assert len(set(balanced)) == 1
    in_order = visible_blocks(np.arange(S), sp)
    assert len(set(in_order)) == sp  # without it, the later ranks do more
    assert sum(balanced) < sp * 2 * sp * 2  # and masked blocks are skipped at all
    assert sorted(zigzag_order(S, sp)) == list(range(S))


@pytest.fixture(autouse=True, scope="module")
def _free_attention_programs():
    """compiled_attention's executables go with the file's other programs (see conftest.py)."""
    yield
    for cached in (compiled_attention, one_device_temporaries, island_temporaries):
        cached.cache_clear()
