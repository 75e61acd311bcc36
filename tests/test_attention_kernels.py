"""The attention implementations (`jaxllm/ops/attention.py`: `dense`, `chunked`) against a float64 NumPy
reference written here: outputs and gradients with respect to q, k and v, for every mask feature — causal,
packed segments, zig-zag positions, windows of 1, 17 and ≥ t, soft caps 30 and 50, grouped queries (8 on
2 K/V heads), one K/V head, and a value head dimension other than the query's. fp32 within 1e-5 of each
tensor's largest value (the soft-cap cases have scores near 50, where an fp32 ulp is 4e-6 and a gradient
element that cancels is off by more than 1e-5 absolute in any fp32 implementation, the dense one too);
bf16 within the low-precision rule (docs/design-notes.md) against the same reference.

The chunked kernel runs with blocks of 16 rows on sequences of 40 and 48, so several blocks, a padded
last block and the skipped blocks are all exercised; its counter shows a window visiting the window's
blocks, not the causal triangle's.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import equivalence_config, leaf_errors, step_fns
from jaxllm.ops.attention import attention
from jaxllm.ops.masking import Masking
from jaxllm.ops.chunked_attention import chunked_attention

BLOCK = 16


def reference(q, k, v, q_pos, k_pos, q_seg, k_seg, d_out, window=0, softcap=0.0, scale=None):
    """float64 attention, written from the definition: (out, dq, dk, dv) for the output cotangent d_out."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    b, t, h, dk = q.shape
    group = h // k.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    delta = q_pos[:, :, None] - k_pos[:, None, :]
    mask = (q_seg[:, :, None] == k_seg[:, None, :]) & (delta >= 0) & ((window <= 0) | (delta < window))
    out, dq, dk_, dv = np.zeros(q.shape[:3] + v.shape[3:]), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for head in range(h):
        kv = head // group
        raw = scale * np.einsum("btd,bsd->bts", q[:, :, head], k[:, :, kv])
        s = softcap * np.tanh(raw / softcap) if softcap else raw
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, head] = np.einsum("bts,bsd->btd", p, v[:, :, kv])
        dp = np.einsum("btd,bsd->bts", d_out[:, :, head], v[:, :, kv])
        ds = p * (dp - (dp * p).sum(-1, keepdims=True))
        if softcap:
            ds *= 1 - np.tanh(raw / softcap) ** 2
        dq[:, :, head] = scale * np.einsum("bts,bsd->btd", ds, k[:, :, kv])
        dk_[:, :, kv] += scale * np.einsum("bts,btd->bsd", ds, q[:, :, head])
        dv[:, :, kv] += np.einsum("bts,btd->bsd", p, d_out[:, :, head])
    return out, dq, dk_, dv


def zigzag(t: int, pieces: int = 4) -> np.ndarray:
    """Positions in the order load-balanced context parallelism puts them (chunk i beside chunk n−1−i)."""
    chunks = np.split(np.arange(t), 2 * pieces)
    return np.concatenate([c for i in range(pieces) for c in (chunks[i], chunks[2 * pieces - 1 - i])])


CASES = {  # name: (t, q heads, kv heads, dk, dv, window, softcap, q scale (large scores reach the cap), layout)
    "causal": (48, 4, 4, 8, 8, 0, 0.0, 1.0, "plain"),
    "packed": (48, 4, 4, 8, 8, 0, 0.0, 1.0, "packed"),
    "zigzag": (48, 4, 4, 8, 8, 0, 0.0, 1.0, "zigzag"),
    "window1": (48, 4, 2, 8, 8, 1, 0.0, 1.0, "plain"),
    "window17": (48, 4, 2, 8, 8, 17, 0.0, 1.0, "packed"),
    "window18": (48, 4, 2, 8, 8, BLOCK + 2, 0.0, 1.0, "plain"),  # a query block's farthest key block holds one key
    "window_ge_t": (40, 4, 2, 8, 8, 64, 0.0, 1.0, "plain"),
    "softcap30": (48, 4, 2, 8, 8, 0, 30.0, 12.0, "plain"),
    "softcap50": (40, 4, 2, 8, 8, 17, 50.0, 16.0, "zigzag"),
    "gqa8to2": (48, 8, 2, 8, 8, 0, 0.0, 1.0, "packed"),
    "mqa": (40, 8, 1, 8, 8, 0, 0.0, 1.0, "plain"),
    "v_dim": (48, 4, 2, 12, 8, 0, 0.0, 1.0, "plain"),
}
FAST = ("causal", "window17", "softcap50", "gqa8to2")


def random_rows(name: str, t, h, kv, dk, dv, q_scale, layout, dtype=jnp.float32):
    """Two rows of random (q, k, v, d_out) seeded by `name`, and their (q_pos, k_pos, q_seg, k_seg): `plain`,
    `zigzag` positions, or `packed` (row 0: three documents from 0, 5t/12 and 11t/16, positions restarting;
    row 1: one document, padding from 37t/48)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q = rng.standard_normal((2, t, h, dk)) * q_scale
    k, v = rng.standard_normal((2, t, kv, dk)), rng.standard_normal((2, t, kv, dv))
    d_out = rng.standard_normal((2, t, h, dv))
    pos = np.tile(zigzag(t) if layout == "zigzag" else np.arange(t), (2, 1)).astype(np.int32)
    seg = np.ones((2, t), np.int32)
    if layout == "packed":
        a, c, e = 5 * t // 12, 11 * t // 16, 37 * t // 48
        seg[0, a:], seg[0, c:], seg[1, e:] = 2, 3, 0
        pos[0] = np.concatenate([np.arange(a), np.arange(c - a), np.arange(t - c)])
    arrays = tuple(jnp.asarray(x, dtype) for x in (q, k, v, d_out))
    return arrays, tuple(jnp.asarray(x) for x in (pos, pos, seg, seg))


def inputs(case: str, dtype=jnp.float32):
    t, h, kv, dk, dv, window, softcap, q_scale, layout = CASES[case]
    return (*random_rows(case, t, h, kv, dk, dv, q_scale, layout, dtype), Masking(window, softcap))


@functools.partial(jax.jit, static_argnames=("masking", "impl"))
def out_and_grads(q, k, v, d_out, q_pos, k_pos, q_seg, k_seg, masking, impl):
    if impl == "chunked":
        f = lambda q, k, v: chunked_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, block=BLOCK)
    else:
        f = lambda q, k, v: attention(q, k, v, q_pos, k_pos, q_seg, k_seg, masking, impl)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(d_out))


def assert_near_reference(got, want, what: str):
    """(out, dq, dk, dv) each within 1e-5 of its largest value from the float64 reference's."""
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        error = np.abs(np.asarray(g, np.float64) - w).max() / (np.abs(w).max() or 1.0)  # dq is 0 at window 1
        assert error <= 1e-5, f"{what}: {name} is {error:.2e} of its largest value off the float64 reference"


def relative_errors(got, want):
    """||got − want|| / ||want|| for the output and each gradient (harness.leaf_errors, in float64)."""
    return [d / n for d, n in leaf_errors(tuple(got), tuple(want)).values()]


@pytest.mark.parametrize("impl", ("dense", "chunked"))
@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_fp32_matches_float64_reference(case, impl):
    (q, k, v, d_out), ints, masking = inputs(case)
    want = reference(q, k, v, *map(np.asarray, ints), d_out, masking.window, masking.softcap)
    got = out_and_grads(q, k, v, d_out, *ints, masking=masking, impl=impl)
    assert_near_reference(got, want, f"{impl} {case}")


@pytest.mark.parametrize("case", ("causal", pytest.param("softcap50", marks=pytest.mark.slow),
                                  pytest.param("gqa8to2", marks=pytest.mark.slow)))
def test_bf16_chunked_within_the_low_precision_rule(case):
    """err(chunked, bf16) ≤ 2·err(dense, bf16) + 1e-3 for the output and each gradient, both against float64."""
    (q, k, v, d_out), ints, masking = inputs(case, jnp.bfloat16)
    want = reference(q, k, v, *map(np.asarray, ints), d_out, masking.window, masking.softcap)
    dense = relative_errors(out_and_grads(q, k, v, d_out, *ints, masking=masking, impl="dense"), want)
    chunked = relative_errors(out_and_grads(q, k, v, d_out, *ints, masking=masking, impl="chunked"), want)
    assert all(c <= 2 * d + 1e-3 for c, d in zip(chunked, dense)), (chunked, dense)


def test_a_window_visits_its_blocks_not_the_triangle():
    """Counted inside the program, at 8192 tokens in blocks of 512: causal attention visits the triangle's
    16·17/2 = 136 key blocks; a window of 512 visits 31 (each query block its own and the one before)."""
    t, block = 8192, 512
    q = jnp.ones((1, t, 2, 8), jnp.float32)
    pos, seg = jnp.arange(t)[None], jnp.ones((1, t), jnp.int32)
    visited = jax.jit(lambda window: chunked_attention(q, q, q, pos, pos, seg, seg, Masking(window=window),
                                                       block=block, count=True)[1])
    n = t // block
    assert int(visited(0)) == n * (n + 1) // 2
    assert int(visited(512)) == 2 * n - 1


def step_temporaries(seq: int, impl: str) -> int:
    """Temporary bytes of the compiled tiny-llama train step (batch 1, one device) at `seq` tokens."""
    cfg = equivalence_config("tiny-llama", **{"model.seq_len": seq, "train.global_batch": 1,
                                              "model.attention_impl": impl})
    fns = step_fns(cfg, devices=1)
    lowered = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(1, seq))
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_chunked_temporaries_grow_linearly_and_dense_quadratically():
    """The compiled train step's temporaries at 2048, 4096 and 8192 tokens: chunked grows at most 2.2× per
    doubling (measured about 1.5×), dense about 4×, and at 8192 chunked needs at most a quarter of dense's."""
    chunked = [step_temporaries(seq, "chunked") for seq in (2048, 4096, 8192)]
    dense = [step_temporaries(seq, "dense") for seq in (2048, 4096, 8192)]
    assert all(b / a <= 2.2 for a, b in zip(chunked, chunked[1:])), chunked
    assert all(3.5 <= b / a <= 4.5 for a, b in zip(dense, dense[1:])), dense
    assert chunked[-1] <= dense[-1] / 4, (chunked, dense)


@pytest.mark.parametrize("impl, over, named", [
    ("pallas_tpu", {}, "runs on tpu"),  # this machine's backend is cpu: refused, not replaced
    ("pallas_gpu", {}, "runs on gpu"),
    ("cudnn", {}, "runs on gpu"),
    ("flash", {}, "is not one of"),
])
def test_an_implementation_that_cannot_run_is_refused_in_one_line(impl, over, named):
    from jaxllm.config import validate
    from jaxllm.errors import ConfigError

    cfg = equivalence_config("tiny-llama", **{"model.attention_impl": impl, **over})
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1)
    message = str(info.value)
    assert "model.attention_impl" in message and named in message and "\n" not in message, message


def test_a_pattern_of_global_layers_has_no_window():
    from jaxllm.models import attention as model_attention

    m = equivalence_config("tiny-llama", **{"model.sliding_window": 8, "model.window_pattern": ["global"]}).model
    assert model_attention.layer_windows(m) == [0, 0] and model_attention.masking(m).window == 0
    m = equivalence_config("tiny-llama", **{"model.sliding_window": 8,
                                            "model.window_pattern": ["global", "local"]}).model
    assert model_attention.layer_windows(m) == [0, 8] and model_attention.windows_differ(m)



@pytest.mark.parametrize("case, dtype, one_segment_rows, named", [
    ("causal", jnp.bfloat16, True, None),
    ("causal", jnp.bfloat16, False, "segment ids"),  # packed fine-tuning rows, GRPO's rollouts
    ("causal", jnp.float32, True, "float32"),
    ("softcap30", jnp.bfloat16, True, "soft cap"),
    ("v_dim", jnp.bfloat16, True, "head dimension"),
])
def test_cudnn_says_what_it_can_compute(case, dtype, one_segment_rows, named):
    """cuDNN's kernel cannot run here (no GPU); what it cannot compute exactly is refused in one line before."""
    from jaxllm.ops import cudnn_attention

    (q, k, v, _), _, masking = inputs(case, dtype)
    why = cudnn_attention.supports(masking, q.shape, k.shape, v.shape, q.dtype, one_segment_rows)
    assert (why is None) if named is None else (named in why and "\n" not in why), why
