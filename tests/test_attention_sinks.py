"""Attention sinks (gpt-oss's `self_attn.sinks`, `model.attn_sinks`): a learned logit per query head that joins each
query's softmax denominator and is then dropped.

- Attention level: `dense` and `chunked` (blocks of 8 over 32 tokens) give the output and the gradients of q, k, v
  and the sinks within 1e-5 (of each tensor's max abs) of a float64 NumPy reference written here (its sinks'
  gradient itself checked by central differences), causal, packed (two documents in a row), windowed and in the
  zig-zag order, with grouped queries (4 query heads on 2 KV heads) and one KV head.
- Model level: tiny-llama with sinks (random, non-zero) has on sp=2 (ring with zig-zag, all-gather, Ulysses; and
  sp2 × tp2, ring and Ulysses, slow) the loss and gradients of one device, the sinks' own gradient included.
- Generation: greedy decoding with the KV cache gives the whole-sequence forward's logits token by token; the
  rollout engine's paged cache gives the static cache's tokens and log-probabilities.
- The fused kernels (cudnn, pallas_gpu, pallas_tpu, the ring on pallas_gpu, the paged decode kernel) are refused
  in one line naming `model.attn_sinks`; `auto` picks dense or chunked where sinks are on.

Mutants each test was seen to catch (then restored): the sink dropped from the dense softmax; the chunked
backward's sink gradient zeroed; the sink added at every ring step; Ulysses passing the first heads' sinks on
every rank; the cache path attending without sinks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import equivalence_config, loss_and_grads, step_fns
from jaxllm.config import validate
from jaxllm.errors import ConfigError
from jaxllm.generate import generate_arrays
from jaxllm.generate.engine import Engine, _choose_paged_kernel
from jaxllm.models import transformer
from jaxllm.models.attention import choose
from jaxllm.ops.attention import attention, dot_product_attention
from jaxllm.ops.chunked_attention import chunked_attention
from jaxllm.ops.masking import Masking
from test_generate import assert_decodes_as_the_forward

B, T, D, BLOCK = 2, 32, 8, 8
TOL = 1e-5


# ---------------------------------------------------------------- the float64 reference


def reference(q, k, v, q_pos, k_pos, q_seg, k_seg, window, sinks, ct):
    """(out, dq, dk, dv, dsinks) of sum(attention · ct) in float64: scores q·k/√d, masked by segment, causal by
    position and the window; each row's softmax over its keys and its head's sink; the sink's column dropped."""
    q, k, v, ct, sinks = (np.asarray(x, np.float64) for x in (q, k, v, ct, sinks))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    kh = np.repeat(k, g, axis=2)  # query head i reads KV head i // g
    vh = np.repeat(v, g, axis=2)
    scale = d ** -0.5
    s = np.einsum("bthd,bshd->bhts", q, kh) * scale
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    mask = (diff >= 0) & (q_seg[:, :, None] == k_seg[:, None, :])
    if window:
        mask &= diff < window
    mask = mask[:, None]
    top = np.maximum(np.where(mask, s, -np.inf).max(-1), sinks[None, :, None])  # [b, h, t]
    e = np.where(mask, np.exp(s - top[..., None]), 0.0)
    e_sink = np.exp(sinks[None, :, None] - top)
    denom = e.sum(-1) + e_sink
    p, p_sink = e / denom[..., None], e_sink / denom
    out = np.einsum("bhts,bshd->bthd", p, vh)
    # backward of sum(out · ct): dP = ct·V; dS = P (dP − Σ P dP), the sink's value 0, so Σ P dP = ct·out
    dp = np.einsum("bthd,bshd->bhts", ct, vh)
    delta = np.einsum("bthd,bthd->bht", ct, out)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhts,bshd->bthd", ds, kh) * scale
    dkh = np.einsum("bhts,bthd->bshd", ds, q) * scale
    dvh = np.einsum("bhts,bthd->bshd", p, ct)
    fold = lambda x: x.reshape(b, x.shape[1], k.shape[2], g, d).sum(3)
    dsinks = -(p_sink * delta).sum((0, 2))
    return out, dq, fold(dkh), fold(dvh), dsinks


def test_the_references_sink_gradient_is_the_derivative_of_its_output():
    """The reference's dsinks against central differences of its own forward (float64)."""
    q, k, v, ct, sinks = inputs(2)
    sinks = np.asarray(sinks, np.float64)
    pos = np.broadcast_to(np.arange(T), (B, T))
    seg = np.ones((B, T), np.int32)
    value = lambda s: float((reference(q, k, v, pos, pos, seg, seg, 0, s, ct)[0] * np.asarray(ct, np.float64)).sum())
    dsinks = reference(q, k, v, pos, pos, seg, seg, 0, sinks, ct)[4]
    eps = 1e-6
    numeric = [(value(sinks + eps * e) - value(sinks - eps * e)) / (2 * eps) for e in np.eye(len(sinks))]
    np.testing.assert_allclose(dsinks, numeric, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- dense and chunked against it


def inputs(kv: int, heads: int = 4):
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (B, T, heads, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, kv, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, kv, D), jnp.float32)
    ct = jax.random.normal(keys[3], (B, T, heads, D), jnp.float32)
    sinks = 1.5 * jax.random.normal(keys[4], (heads,), jnp.float32)  # some above the scores, some below
    return q, k, v, ct, sinks


def zigzag(t: int) -> np.ndarray:
    """The positions laid out as 4 chunks in the order 0, 3, 1, 2 (two ranks' zig-zag halves)."""
    c = np.arange(t).reshape(4, t // 4)
    return np.concatenate([c[0], c[3], c[1], c[2]])


def layout(case: str):
    """(positions, segment ids [B, T] int32, window) of a case."""
    pos, seg, window = np.arange(T), np.ones(T, np.int32), 0
    if case == "packed":  # two documents in a row, each from position 0
        pos, seg = np.concatenate([np.arange(20), np.arange(12)]), np.repeat(np.int32([1, 2]), [20, 12])
    if case == "window":
        window = 5
    if case == "zigzag":
        pos = zigzag(T)
    if case == "packed_window_zigzag":
        order = zigzag(T)
        pos = np.concatenate([np.arange(20), np.arange(12)])[order]
        seg = np.repeat(np.int32([1, 2]), [20, 12])[order]
        window = 7
    as_rows = lambda x: np.broadcast_to(np.asarray(x, np.int32), (B, T)).copy()
    return as_rows(pos), as_rows(seg), window


IMPLS = {
    "dense": lambda q, k, v, pos, seg, masking, sinks: dot_product_attention(q, k, v, pos, pos, seg, seg, masking,
                                                                             sinks),
    "chunked": lambda q, k, v, pos, seg, masking, sinks: chunked_attention(q, k, v, pos, pos, seg, seg, masking,
                                                                           block=BLOCK, sinks=sinks),
}
CASES = ["causal", "packed", "window", "zigzag", "packed_window_zigzag"]


def assert_close(got, want, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err, size = np.abs(got - want).max(), np.abs(want).max()
    assert err <= TOL * size, f"{name}: max |error| {err:.3g} against max |reference| {size:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,kv", [(c, 2) for c in CASES] + [("packed", 1)])
def test_attention_with_sinks_matches_the_float64_reference(impl, case, kv):
    q, k, v, ct, sinks = inputs(kv)
    pos, seg, window = layout(case)
    masking = Masking(window=window)
    f = jax.jit(lambda q, k, v, s: IMPLS[impl](q, k, v, pos, seg, masking, s))
    out, pull = jax.vjp(f, q, k, v, sinks)
    grads = pull(ct)
    want = reference(q, k, v, pos, pos, seg, seg, window, sinks, ct)
    for name, got, ref in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), want):
        assert_close(got, ref, f"{impl}/{case}/kv{kv} {name}")
    assert np.abs(want[4]).min() > 1e-3  # every sink's gradient is there to get wrong


def test_without_sinks_the_interface_is_what_it_was():
    """sinks=None takes the old path: the same program, so the same bits as before the key existed."""
    q, k, v, _, _ = inputs(2)
    pos, seg, _ = layout("packed")
    for impl in ("dense", "chunked"):
        lowered = lambda **kw: jax.jit(lambda q, k, v: attention(q, k, v, pos, pos, seg, seg, Masking(), impl, **kw)
                                       ).lower(q, k, v).as_text()
        assert lowered() == lowered(sinks=None)
    assert "sinks" not in transformer.param_table(equivalence_config("tiny-llama").model)["blocks"][0]["attn"]


# ---------------------------------------------------------------- the model on a mesh


def with_sinks(cfg, seed: int = 5):
    """cfg's fresh parameters with every layer's sinks drawn at random (init leaves them 0)."""
    params = transformer.init_params(cfg.model, jax.random.key(0))
    for i, block in enumerate(params["blocks"]):
        shape = block["attn"]["sinks"].shape
        block["attn"]["sinks"] = jax.random.normal(jax.random.key(seed + i), shape, jnp.float32)
    return params


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


SINKS = {"model.attn_sinks": True}
MESHES = [pytest.param({"mesh.sp": 2, "model.cp_strategy": "ring"}, id="sp2-ring"),
          pytest.param({"mesh.sp": 2, "model.cp_strategy": "ulysses"}, id="sp2-ulysses", marks=pytest.mark.slow),
          pytest.param({"mesh.sp": 2, "model.cp_strategy": "allgather"}, id="sp2-allgather", marks=pytest.mark.slow),
          pytest.param({"mesh.sp": 2, "mesh.tp": 2, "model.cp_strategy": "ring"}, id="sp2-tp2-ring",
                       marks=pytest.mark.slow),
          pytest.param({"mesh.sp": 2, "mesh.tp": 2, "model.cp_strategy": "ulysses"}, id="sp2-tp2-ulysses",
                       marks=pytest.mark.slow)]


@pytest.mark.parametrize("mesh", MESHES)
def test_a_model_with_sinks_on_sp2_equals_one_device(mesh):
    one = equivalence_config("tiny-llama", **SINKS)
    params = with_sinks(one)
    assert params["blocks"][0]["attn"]["sinks"].shape == (one.model.n_layers, one.model.n_heads)
    loss, grads = loss_and_grads(step_fns(one), params)
    got_loss, got = loss_and_grads(step_fns(equivalence_config("tiny-llama", **SINKS, **mesh)), params)
    assert abs(float(got_loss) - float(loss)) <= TOL * abs(float(loss)), (float(got_loss), float(loss))
    errors = {jax.tree_util.keystr(path): rel(a, b) for (path, a), b in
              zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(grads))}
    assert max(errors.values()) <= TOL, {k: e for k, e in errors.items() if e > TOL}
    assert np.abs(np.asarray(grads["blocks"][0]["attn"]["sinks"])).min() > 0


# ---------------------------------------------------------------- generation


PROMPTS = [list(range(5, 16)), list(range(40, 46))]  # left-padded by 0 and 5 in one batch
NEW = 10


def generation_config(**over):
    return equivalence_config("tiny-llama", **SINKS, **{"model.init_std": 0.1, "model.seq_len": 64}, **over)


@pytest.mark.slow  # the fast tier's sinks: the float64 references and the ring
def test_cached_generation_with_sinks_equals_the_whole_sequence_forward():
    cfg = generation_config()
    params = with_sinks(cfg)
    assert_decodes_as_the_forward(params, cfg, PROMPTS, NEW)
    # the sinks matter: without them the model's logits differ
    plain = dataclasses.replace(cfg.model, attn_sinks=False)
    no_sinks = jax.tree.map(lambda x: x, params)
    for block in no_sinks["blocks"]:
        del block["attn"]["sinks"]
    seq = jnp.asarray([PROMPTS[0]], jnp.int32)
    assert np.abs(np.asarray(transformer.logits(no_sinks, seq, plain))
                  - np.asarray(transformer.logits(params, seq, cfg.model))).max() > 1e-2


@pytest.mark.slow
def test_the_paged_engine_with_sinks_equals_the_static_cache():
    cfg = generation_config()
    params = with_sinks(cfg)
    static = generate_arrays(params, cfg, PROMPTS, NEW, temperature=0.0)
    for r, c in enumerate(Engine(params, cfg, slots=2, page=4).generate(PROMPTS, NEW, temperature=0.0)):
        np.testing.assert_array_equal(c.tokens, static["tokens"][r])
        np.testing.assert_allclose(c.logprobs, static["logprobs"][r], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- what cannot compute them


@pytest.mark.parametrize("impl,mesh", [("cudnn", {}), ("pallas_gpu", {}), ("pallas_tpu", {}),
                                       ("pallas_gpu", {"mesh.sp": 2, "model.cp_strategy": "ring"})])
def test_the_fused_kernels_are_refused_in_one_line(impl, mesh):
    cfg = equivalence_config("tiny-llama", **SINKS, **{"model.attention_impl": impl}, **mesh)
    with pytest.raises(ConfigError) as info:
        validate(cfg, 2 if mesh else 1)
    message = str(info.value)
    assert message.startswith("model.attn_sinks:") and f"the {impl} kernel" in message and "\n" not in message
    q, k, v, _, sinks = inputs(2)
    pos, seg, _ = layout("causal")
    with pytest.raises(ConfigError, match=f"model.attn_sinks: the {impl} kernel"):
        attention(q, k, v, pos, pos, seg, seg, Masking(), impl, sinks)  # the interface refuses too


def test_latent_attention_refuses_the_key_in_one_line():
    mla = {"model.attention": "mla", "model.mla.kv_lora_rank": 16, "model.mla.qk_nope_head_dim": 8,
           "model.mla.qk_rope_head_dim": 4, "model.mla.v_head_dim": 8}
    with pytest.raises(ConfigError, match="set model.attn_sinks=false$") as info:  # the fix, as a key is written
        validate(equivalence_config("tiny-llama", **SINKS, **mla), 1)
    assert "\n" not in str(info.value)


def test_the_paged_decode_kernel_is_refused_and_auto_avoids_it():
    m = generation_config().model
    with pytest.raises(ConfigError, match="model.attn_sinks: the pallas_gpu paged kernel") as info:
        _choose_paged_kernel("pallas_gpu", m, 16, None)
    assert "\n" not in str(info.value)
    assert _choose_paged_kernel("auto", m, 16, None) == (None, False)


@pytest.mark.parametrize("platform,sp", [("cuda", 1), ("tpu", 1), ("cuda", 2), ("cpu", 1)])
def test_auto_picks_an_implementation_that_adds_the_sinks(platform, sp):
    cfg = equivalence_config("tiny-llama", **SINKS)
    impl, why = choose(cfg, platform, sp)
    assert impl in ("dense", "chunked"), (impl, why)
    plain = equivalence_config("tiny-llama")
    if platform == "cpu":  # CPU's choice is the same with or without sinks
        assert choose(plain, platform, sp)[0] == impl
    validate(equivalence_config("tiny-llama", **SINKS, **{"model.attention_impl": "chunked"}), 1)
