"""Llama 4's attention features (`Llama4TextAttention`): chunked local attention (`model.attention_chunk`), layers
without RoPE (`model.rope_global = false`) with attention temperature tuning (`model.attn_temperature_floor`,
`attn_temperature_scale`), and the weightless L2 q/k norm after RoPE (`model.qk_l2_norm`).

- Attention level: `dense` and `chunked` (blocks of 8 over 32 tokens, chunks of 6 so blocks straddle chunks) give
  the output and the gradients of q, k, v within 1e-5 (of each tensor's max abs) of a float64 NumPy reference
  written here: causal by position within a segment and in the query's chunk of positions, packed (two documents
  in a row, positions restarting), zig-zag, and the chunk a traced per-layer value (0: none); the chunked kernel
  skips the block pairs chunks rule out.
- Model level: the tiny Llama 4 of `hf_families.py` (chunks of 8 and RoPE on layers 0, 1, 3; no RoPE with
  temperature tuning (floor 4) on layer 2; L2 q/k norms; MoE on layers 1, 3) imported gives transformers' logits
  (1e-4), and each feature turned off moves them far from it; on pp2 × ep2 × dp2 and on sp2 (ring, zig-zag) its
  loss and gradients equal one device's. (test_hf_interop.py and test_generate_hf.py run the family too.)
- The fused kernels (cudnn, pallas_gpu, pallas_tpu, the ring on pallas_gpu, the paged decode kernel) are refused in
  one line naming `model.attention_chunk`; `auto` picks dense or chunked.

Mutants each test was seen to catch (then restored): see the report of the change that added this file.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from harness import assert_matches, equivalence_config, loss_and_grads, step_fns, tokens
from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError
from jaxllm.generate import generate_arrays
from jaxllm.generate.engine import Engine, _choose_paged_kernel
from jaxllm.interop import hf
from jaxllm.models import attention as model_attention
from jaxllm.models import transformer
from jaxllm.models.attention import choose
from jaxllm.ops.attention import attention, dot_product_attention
from jaxllm.ops.chunked_attention import chunked_attention
from jaxllm.ops.masking import Masking

B, T, D, BLOCK, CHUNK = 2, 32, 8, 8, 6
TOL = 1e-5


# ---------------------------------------------------------------- the float64 reference


def reference(q, k, v, q_pos, k_pos, q_seg, k_seg, chunk, ct):
    """(out, dq, dk, dv) of sum(attention · ct) in float64: scores q·k/√d, masked by segment, causal by position
    and (chunk > 0) to the keys of the query's chunk of positions (q_pos // chunk = k_pos // chunk)."""
    q, k, v, ct = (np.asarray(x, np.float64) for x in (q, k, v, ct))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    kh, vh = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads KV head i // g
    scale = d ** -0.5
    s = np.einsum("bthd,bshd->bhts", q, kh) * scale
    mask = (q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
    if chunk:
        mask &= q_pos[:, :, None] // chunk == k_pos[:, None, :] // chunk
    mask = mask[:, None]
    top = np.where(mask, s, -np.inf).max(-1)
    e = np.where(mask, np.exp(s - top[..., None]), 0.0)
    p = e / e.sum(-1)[..., None]
    out = np.einsum("bhts,bshd->bthd", p, vh)
    dp = np.einsum("bthd,bshd->bhts", ct, vh)
    ds = p * (dp - np.einsum("bthd,bthd->bht", ct, out)[..., None])
    dq = np.einsum("bhts,bshd->bthd", ds, kh) * scale
    fold = lambda x: x.reshape(b, x.shape[1], k.shape[2], g, d).sum(3)
    return out, dq, fold(np.einsum("bhts,bthd->bshd", ds, q) * scale), fold(np.einsum("bhts,bthd->bshd", p, ct))


def inputs(kv: int = 2, heads: int = 4):
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (B, T, heads, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, kv, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, kv, D), jnp.float32)
    ct = jax.random.normal(keys[3], (B, T, heads, D), jnp.float32)
    return q, k, v, ct


def zigzag(t: int) -> np.ndarray:
    """The positions laid out as 4 chunks in the order 0, 3, 1, 2 (two ranks' zig-zag halves)."""
    c = np.arange(t).reshape(4, t // 4)
    return np.concatenate([c[0], c[3], c[1], c[2]])


def layout(case: str):
    """(positions, segment ids [B, T] int32) of a case."""
    pos, seg = np.arange(T), np.ones(T, np.int32)
    if case == "packed":  # two documents in a row, each from position 0 (chunks restart with them)
        pos, seg = np.concatenate([np.arange(20), np.arange(12)]), np.repeat(np.int32([1, 2]), [20, 12])
    if case == "zigzag":
        pos = zigzag(T)
    if case == "packed_zigzag":
        order = zigzag(T)
        pos = np.concatenate([np.arange(20), np.arange(12)])[order]
        seg = np.repeat(np.int32([1, 2]), [20, 12])[order]
    as_rows = lambda x: np.broadcast_to(np.asarray(x, np.int32), (B, T)).copy()
    return as_rows(pos), as_rows(seg)


IMPLS = {
    "dense": lambda q, k, v, pos, seg, masking: dot_product_attention(q, k, v, pos, pos, seg, seg, masking),
    "chunked": lambda q, k, v, pos, seg, masking: chunked_attention(q, k, v, pos, pos, seg, seg, masking,
                                                                    block=BLOCK),
}
CASES = ["causal", "packed", "zigzag", "packed_zigzag"]


def assert_close(got, want, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err, size = np.abs(got - want).max(), np.abs(want).max()
    assert err <= TOL * size, f"{name}: max |error| {err:.3g} against max |reference| {size:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,kv,traced", [(c, 2, False) for c in CASES] + [("packed", 1, False),
                                                                             ("packed_zigzag", 2, True)])
def test_chunked_local_attention_matches_the_float64_reference(impl, case, kv, traced):
    """The chunk mask as a Python int, or (`traced`) as the scanned layers carry it: a traced int32 scalar."""
    q, k, v, ct = inputs(kv)
    pos, seg = layout(case)

    def f(q, k, v, chunk):
        return IMPLS[impl](q, k, v, pos, seg, Masking(chunk=chunk if traced else CHUNK))

    out, pull = jax.vjp(jax.jit(f), q, k, v, jnp.int32(CHUNK))
    grads = pull(ct)[:3]
    want = reference(q, k, v, pos, pos, seg, seg, CHUNK, ct)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        assert_close(got, ref, f"{impl}/{case}/kv{kv} {name}")
    # the chunks matter here: plain causal attention is far from it
    assert np.abs(reference(q, k, v, pos, pos, seg, seg, 0, ct)[0] - want[0]).max() > 0.1


@pytest.mark.parametrize("impl", IMPLS)
def test_a_traced_chunk_of_0_is_plain_causal_attention(impl):
    """A layer without chunks among layers with them (its row of the scanned data is 0)."""
    q, k, v, ct = inputs()
    pos, seg = layout("packed_zigzag")
    f = jax.jit(lambda q, k, v, chunk: IMPLS[impl](q, k, v, pos, seg, Masking(chunk=chunk)))
    out, pull = jax.vjp(f, q, k, v, jnp.int32(0))
    want = reference(q, k, v, pos, pos, seg, seg, 0, ct)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *pull(ct)[:3]), want):
        assert_close(got, ref, f"{impl} chunk 0 {name}")


def test_the_chunked_kernel_skips_the_block_pairs_chunks_rule_out():
    """Chunks of 8 over blocks of 8 in sequence order: each query block sees its own key block only (4 pairs of
    the 10 causal ones); a traced chunk skips the same."""
    q = inputs()[0]
    pos, seg = layout("causal")
    count = lambda masking: int(chunked_attention(q, q, q, pos, pos, seg, seg, masking, block=BLOCK, count=True)[1])
    assert count(Masking()) == 10
    assert count(Masking(chunk=8)) == 4
    assert int(jax.jit(lambda c: chunked_attention(q, q, q, pos, pos, seg, seg, Masking(chunk=c), block=BLOCK,
                                                   count=True)[1])(jnp.int32(8))) == 4


def test_without_chunks_the_interface_is_what_it_was():
    """chunk=0 adds nothing to the program (the same lowering as a Masking without the field's use)."""
    q, k, v, _ = inputs()
    pos, seg = layout("packed")
    for impl in ("dense", "chunked"):
        lowered = lambda masking: jax.jit(lambda q, k, v: attention(q, k, v, pos, pos, seg, seg, masking, impl)
                                          ).lower(q, k, v).as_text()
        assert lowered(Masking()) == lowered(Masking(window=0, chunk=0))
    m = equivalence_config("tiny-llama").model
    assert model_attention.layer_data(m) is None


# ---------------------------------------------------------------- the tiny Llama 4


SEQ = 32


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> str:
    return H.build("llama4", str(tmp_path_factory.mktemp("llama4") / "hf"))


@pytest.mark.slow  # the import's features are read in the fast tier by test_hf_interop's llama4 case
def test_llama4_reads_as_its_features_and_its_layers_differ(llama4):
    m = hf.config_for(llama4, {"model.seq_len": SEQ}).model
    assert (m.window_pattern, m.sliding_window, m.attention_chunk) == (["local", "local", "global", "local"], 0, 8)
    assert (m.rope_global, m.attn_temperature_floor, m.attn_temperature_scale, m.qk_l2_norm) == (False, 4, 0.1, True)
    data = model_attention.layer_data(m)
    assert set(data) == {"chunk", "rope", "temperature", "l2"}
    assert data["chunk"].tolist() == [8, 8, 0, 8] and data["l2"].tolist() == [True, True, False, True]
    assert np.asarray(data["temperature"]).tolist() == pytest.approx([0, 0, 0.1, 0])
    assert (np.asarray(data["rope"])[2] == 0).all() and (np.asarray(data["rope"])[[0, 1, 3]] > 0).any(1).all()


def llama4_logits(path, **over):
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    m = dataclasses.replace(cfg.model, **over)
    tokens = H.sample_tokens(H.VOCAB_SIZE, 2, SEQ, 0)
    return np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, m))(params, jnp.asarray(tokens))), tokens


@pytest.mark.slow  # test_hf_interop's llama4 case holds the logits to transformers' in the fast tier
def test_llama4_logits_equal_transformers(llama4):
    """Chunks, no-RoPE layers with temperature tuning and L2 q/k norms, end to end (32 tokens: 4 chunks)."""
    ours, tokens = llama4_logits(llama4)
    assert np.abs(ours - H.reference_logits(llama4, tokens)).max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("off", [{"attention_chunk": 0}, {"attn_temperature_floor": 0}, {"qk_l2_norm": False},
                                 {"rope_global": True}], ids=lambda o: next(iter(o)))
def test_each_llama4_feature_moves_the_logits(llama4, off):
    """The tiny model exercises each feature: without it the logits are far from transformers'."""
    ours, tokens = llama4_logits(llama4, **off)
    assert np.abs(ours - H.reference_logits(llama4, tokens)).max() > 1e-2


def one_device(path, **over):
    one = {"init.from": f"hf:{path}", "model.seq_len": SEQ, "precision.compute": "float32", "train.global_batch": 16,
           "mesh.dp": 1, **over}
    cfg, params = hf.load_pretrained(path, overrides=one)
    toks = tokens(seq=cfg.model.seq_len)
    loss, grads = loss_and_grads(step_fns(cfg), params, toks)
    return one, params, toks, (params, float(loss), jax.device_get(grads))


@pytest.mark.slow
def test_the_paged_engine_equals_the_static_cache_on_llama4(llama4):
    """The rollout engine's pages (gathered, the chunk mask by position) give the static KV cache's tokens and
    log-probabilities, over prompts and new tokens that cross chunks of 8 (test_generate_hf.py holds the static
    cache to transformers)."""
    cfg, params = hf.load_pretrained(llama4, overrides={"model.seq_len": 32, "precision.compute": "float32"})
    prompts, new = [list(range(5, 16)), list(range(40, 46))], 10
    static = generate_arrays(params, cfg, prompts, new, temperature=0.0)
    for r, c in enumerate(Engine(params, cfg, slots=2, page=4).generate(prompts, new, temperature=0.0)):
        np.testing.assert_array_equal(c.tokens, static["tokens"][r])
        np.testing.assert_allclose(c.logprobs, static["logprobs"][r], rtol=0, atol=1e-5)


# The pipeline's microbatches take each batch shard's rows in turn, so a microbatch holds other rows than one device's
# microbatch does, and the Switch balance loss (a product of statistics over a microbatch's tokens) differs with the
# grouping (3e-4 in the router's gradient here): off there, its own equivalence is the MoE tests'. On sp2, 48 tokens:
# zig-zag quarters of 12 that chunks of 8 straddle.
@pytest.mark.slow
@pytest.mark.parametrize("mesh,both", [
    pytest.param({"mesh.pp": 2, "mesh.ep": 2, "mesh.dp": 2, "train.microbatches": 2}, {"model.moe.balance_weight": 0.0},
                 id="pp2-ep2-dp2"),
    pytest.param({"mesh.sp": 2, "model.cp_strategy": "ring", "model.cp_load_balance": True}, {"model.seq_len": 48},
                 id="sp2-ring-zigzag")])
def test_llama4_on_a_mesh_equals_one_device(llama4, mesh, both):
    """The per-layer chunks, RoPE, temperatures and norms scanned with the layers through the pipeline's stages,
    and the chunk mask under the ring in zig-zag order: loss and every gradient leaf equal one device's."""
    one, params, toks, ref = one_device(llama4, **both)
    assert_matches(*loss_and_grads(step_fns(build_config(None, {**one, **mesh})), params, toks), ref)


# ---------------------------------------------------------------- what cannot compute them


CHUNKED = {"model.attention_chunk": 8, "model.window_pattern": ["local", "global"]}


@pytest.mark.parametrize("impl,mesh", [("cudnn", {}), ("pallas_gpu", {}), ("pallas_tpu", {}),
                                       ("pallas_gpu", {"mesh.sp": 2, "model.cp_strategy": "ring"})])
def test_the_fused_kernels_are_refused_in_one_line(impl, mesh):
    cfg = equivalence_config("tiny-llama", **CHUNKED, **{"model.attention_impl": impl}, **mesh)
    with pytest.raises(ConfigError) as info:
        validate(cfg, 2 if mesh else 1)
    message = str(info.value)
    assert message.startswith("model.attention_chunk:") and f"the {impl} kernel" in message and "\n" not in message
    q, k, v, _ = inputs()
    pos, seg = layout("causal")
    with pytest.raises(ConfigError, match=f"model.attention_chunk: the {impl} kernel"):
        attention(q, k, v, pos, pos, seg, seg, Masking(chunk=8), impl)  # the interface refuses too


def test_the_paged_decode_kernel_is_refused_and_auto_avoids_it():
    m = equivalence_config("tiny-llama", **CHUNKED).model
    with pytest.raises(ConfigError, match="model.attention_chunk: the pallas_gpu paged kernel") as info:
        _choose_paged_kernel("pallas_gpu", m, 16, None)
    assert "\n" not in str(info.value)
    assert _choose_paged_kernel("auto", m, 16, None) == (None, False)


@pytest.mark.parametrize("platform,sp", [("cuda", 1), ("tpu", 1), ("cuda", 2), ("cpu", 1)])
def test_auto_picks_an_implementation_that_masks_by_chunks(platform, sp):
    impl, why = choose(equivalence_config("tiny-llama", **CHUNKED), platform, sp)
    assert impl in ("dense", "chunked"), (impl, why)
    validate(equivalence_config("tiny-llama", **CHUNKED, **{"model.attention_impl": "dense"}), 1)


def test_latent_attention_refuses_the_rope_and_query_features_in_one_line():
    mla = {"model.attention": "mla", "model.mla.kv_lora_rank": 16, "model.mla.qk_nope_head_dim": 8,
           "model.mla.qk_rope_head_dim": 4, "model.mla.v_head_dim": 8}
    for key, value, fix in (("model.qk_l2_norm", True, "false"), ("model.attn_temperature_floor", 4, "0"),
                            ("model.rope_global", False, "true")):
        with pytest.raises(ConfigError, match=f"set {key}={fix}$") as info:  # the fix, as the key is written
            validate(equivalence_config("tiny-llama", **mla, **{key: value}), 1)
        assert "\n" not in str(info.value)
