"""DeepSeek-V3's fine-grained FP8 (`precision.matmul = "fp8_block"`, `jaxllm/ops/fp8_block.py`).

- The tiled product and both gradients equal a NumPy quantize–dequantize–multiply reference written here (fp32
  scales, ml_dtypes' E4M3 rounding, float64 products) within 1e-5 · max|reference|, for shapes not a multiple of
  128, fp32 and bf16 inputs (bf16 gradients: within their own rounding), a dense matmul, latent attention's
  per-head one and the experts'.
- One token 1e5 times the others: on the other tokens the tiled product's error is at least 10× smaller than
  per-tensor `fp8`'s (both against float64).
- Tiles never cross a row: 4 rows at once compute what each row does alone. On dp2×fsdp2 under ZeRO-3 with 4
  microbatches and on pp2×dp4 the step's loss and gradients equal one device's with as many rows a microbatch
  (1e-5: E4M3 turns the last-bit differences of differently shaped fp32 sums into whole steps, so the peers
  multiply the same shapes); with tp2 too, whose partial sums flip some roundings, each gradient leaf's error
  against fp32 stays within twice one device's (DESIGN.md's low-precision rule); a tensor-parallel width that
  does not split into 128s is refused in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import harness as H
from jaxllm.config import validate
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from jaxllm.ops import fp8

TILE, TOP = 128, np.float32(448)
INVERSE_TOP = np.float32(1 / 448)  # the scale is amax × fp32(1/448), as the module docstring says


def tiled(a: np.ndarray, axis: int) -> np.ndarray:
    """a rounded through E4M3 in tiles of 128 along `axis` (zero-padded), each scaled by amax · (1/448) in fp32: the
    float64 values the fp8 product multiplies."""
    a = np.moveaxis(a.astype(np.float32), axis, -1)
    n = a.shape[-1]
    t = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -n % TILE)]).reshape(*a.shape[:-1], -1, TILE)
    amax = np.abs(t).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, np.maximum(amax * INVERSE_TOP, np.finfo(np.float32).tiny), 1).astype(np.float32)
    q = np.clip(t / scale, -TOP, TOP).astype(ml_dtypes.float8_e4m3fn)
    v = (q.astype(np.float64) * scale.astype(np.float64)).reshape(*a.shape[:-1], -1)[..., :n]
    return np.moveaxis(v, -1, axis)


def blocked(w: np.ndarray) -> np.ndarray:
    """w [K, N] rounded through E4M3 in 128 × 128 blocks, each scaled by its amax · (1/448) in fp32 (float64 values)."""
    k, n = w.shape
    b = np.pad(w.astype(np.float32), [(0, -k % TILE), (0, -n % TILE)])
    b = b.reshape(b.shape[0] // TILE, TILE, b.shape[1] // TILE, TILE)
    amax = np.abs(b).max(axis=(1, 3), keepdims=True)
    scale = np.where(amax > 0, np.maximum(amax * INVERSE_TOP, np.finfo(np.float32).tiny), 1).astype(np.float32)
    q = np.clip(b / scale, -TOP, TOP).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float64) * scale).reshape(b.shape[0] * TILE, -1)[:k, :n]


def reference(x: np.ndarray, w: np.ndarray, g: np.ndarray):
    """y = x · w for x [rows, tokens, K], w [K, N] and its gradients for the cotangent g [rows, tokens, N]: x and g
    in 1 × 128 tiles along their last axis, w in blocks; for w's gradient x and g in 128 × 1 tiles over each
    row's tokens."""
    wb = blocked(w)
    dw = sum(tiled(x[r], 0).T @ tiled(g[r], 0) for r in range(x.shape[0]))
    return tiled(x, -1) @ wb, tiled(g, -1) @ wb.T, dw


def per_head(x, w, g):
    """latent attention's "bthd,rhd->bthr": one dense reference per head (w[:, h].T is its [d, r])."""
    outs = [reference(x[:, :, h], w[:, h].T, g[:, :, h]) for h in range(x.shape[2])]
    return (np.stack([o[0] for o in outs], 2), np.stack([o[1] for o in outs], 2),
            np.stack([o[2].T for o in outs], 1))


def per_expert(x, w, g):
    """the experts' "ecd,edf->ecf": one dense reference per expert, its capacity rows as the tokens of one row."""
    outs = [reference(x[e][None], w[e], g[e][None]) for e in range(x.shape[0])]
    return tuple(np.stack([o[i][0] if i < 2 else o[i] for o in outs]) for i in range(3))


CASES = {  # name -> (spec, x shape, w shape, reference)
    "dense": ("btk,kn->btn", (2, 150, 200), (200, 130), reference),
    "mla_heads": ("bthd,rhd->bthr", (2, 40, 3, 136), (24, 3, 136), per_head),
    "experts": ("ecd,edf->ecf", (3, 140, 72), (3, 72, 260), per_expert),
}


def block_product(spec, x, w, g):
    with fp8.use(fp8.Coverage({"mlp"}, "fp8_block")):
        y, vjp = jax.vjp(lambda a, b: fp8.einsum("mlp", spec, a, b, jnp.float32), x, w)
        return (y, *vjp(g.astype(jnp.float32)))


@pytest.mark.parametrize("case, dtype", H.tiers([(c, d) for c in CASES for d in ("float32", "bfloat16")],
                                                fast=(("dense", "bfloat16"),)))
def test_the_tiled_product_and_its_gradients_equal_a_numpy_reference(case, dtype):
    spec, x_shape, w_shape, ref = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape) * np.exp(rng.uniform(-3, 3, x_shape[:-1] + (1,)))
    w = rng.standard_normal(w_shape) * 0.05
    y_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), x, w).shape
    g = rng.standard_normal(y_shape) * 1e-3
    x, w, g = (jnp.asarray(a, dtype) for a in (x, w, g))
    got = block_product(spec, x, w, g)
    want = ref(*(np.asarray(a.astype(jnp.float32)) for a in (x, w, g)))
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert a.shape == b.shape, name
        rounding = 0 if name == "y" or dtype == "float32" else 2.0 ** -8  # gradients in the inputs' dtype
        err = np.abs(np.asarray(a, np.float64) - b) - rounding * np.abs(b)
        assert err.max() <= 1e-5 * np.abs(b).max(), (name, err.max() / np.abs(b).max())


def test_an_outlier_token_costs_only_its_own_tiles():
    """One token 1e5 times the others: per tensor its scale crushes every other token's precision; in tiles only
    its own. (A channel outlier shares every token's tile across that channel: no gain expected, docs say so.)"""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 256, 256)).astype(np.float32)
    x[0, 7] *= 1e5
    w = (rng.standard_normal((256, 192)) * 0.05).astype(np.float32)
    exact = x.astype(np.float64) @ w
    others = np.arange(256) != 7

    def error(mode):
        with fp8.use(fp8.Coverage({"mlp"}, mode)):
            y = fp8.einsum("mlp", "btk,kn->btn", jnp.asarray(x), jnp.asarray(w), jnp.float32)
        return np.abs(np.asarray(y, np.float64) - exact)[0, others].max()

    assert error("fp8_block") * 10 <= error("fp8"), (error("fp8_block"), error("fp8"))


WIDE = {"model.d_model": 256, "model.n_heads": 4, "model.head_dim": 64, "model.d_ff": 256,
        "precision.matmul": "fp8_block"}  # every tensor-parallel width 256: 128 per tp2 rank
# mesh -> the one-device peer whose microbatches hold as many rows as a device's on the mesh: XLA:CPU's fp32 dot
# sums in an order that depends on its shapes, and E4M3 rounding turns a last-bit difference into a whole step,
# so equality holds between runs whose devices multiply the same shapes (tiles never cross a row: below)
EXACT = {
    "dp2_fsdp2_zero3_mb4": ({"mesh.dp": 2, "mesh.fsdp": 2, "train.zero_stage": 3, "train.microbatches": 4},
                            {"train.microbatches": 16}),
    "pp2_dp4": ({"mesh.pp": 2, "mesh.dp": 4, "train.microbatches": 2}, {"train.microbatches": 8}),
}


def _loss_and_grads(**over):
    cfg = H.equivalence_config("tiny-llama", **{**WIDE, **over})
    params = transformer.init_params(H.equivalence_config("tiny-llama", **WIDE).model, jax.random.key(0))
    return H.loss_and_grads(H.step_fns(cfg), params)


@pytest.mark.slow
def test_tiles_never_cross_a_row():
    """The product of 4 rows at once is each row's alone: outputs and input gradients row for row, the weight's
    gradient the sum of the rows' (fp32 rounding)."""
    rng = np.random.default_rng(2)
    x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 40, 256), (256, 4, 64), (4, 40, 4, 64)))
    spec = "btd,dhk->bthk"
    whole = block_product(spec, x, w, g)
    rows = [block_product(spec, x[i:i + 1], w, g[i:i + 1]) for i in range(4)]
    for i, part in enumerate((0, 1)):
        np.testing.assert_allclose(whole[part], jnp.concatenate([r[part] for r in rows]), rtol=0,
                                   atol=1e-6 * float(jnp.abs(whole[part]).max()))
    np.testing.assert_allclose(whole[2], sum(r[2] for r in rows), rtol=0, atol=1e-6 * float(jnp.abs(whole[2]).max()))


@pytest.mark.slow  # 5-7 s each; the fast tier's fp8_block share is the dense reference, the outlier and the refusals
@pytest.mark.parametrize("mesh", list(EXACT))
def test_fp8_block_on_a_mesh_of_rows_equals_one_device(mesh):
    """Splitting the rows (data parallel, ZeRO-3, microbatches, a pipeline's stages) changes no scale: loss and
    gradients equal one device's with as many rows a microbatch (1e-5)."""
    over, peer = EXACT[mesh]
    loss, grads = _loss_and_grads(**over)
    ref_loss, ref_grads = _loss_and_grads(**peer)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert H.max_rel_err(grads, ref_grads) <= 1e-5


@pytest.mark.slow
def test_fp8_block_under_tensor_parallelism_keeps_one_devices_error():
    """Under tp the activations differ from one device's in their last bits (partial sums all-reduced), which flips
    some E4M3 roundings, so equality is not the contract (DESIGN.md, low precision): per gradient leaf the error
    against fp32 of dp2×fsdp2×tp2 ZeRO-3 with 4 microbatches stays within twice one device's, plus 1e-6; its
    tiles stay whole on a device (the widths split into 128s, else refused: below)."""
    exact = _loss_and_grads(**{"precision.matmul": "default"})[1]
    one = _loss_and_grads()[1]
    mesh = _loss_and_grads(**{"mesh.dp": 2, "mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3,
                              "train.microbatches": 4})[1]
    error = lambda a: {k: d / max(n, 1e-30) for k, (d, n) in H.leaf_errors(a, exact).items()}  # relative
    one_error, mesh_error = error(one), error(mesh)
    for leaf, e in mesh_error.items():
        assert e <= 2 * one_error[leaf] + 1e-6, (leaf, e, one_error[leaf])


@pytest.mark.parametrize("over, message", [
    ({"mesh.tp": 2}, r"fp8_block: model.n_heads × head_dim = 64 does not split into multiples of 128 over mesh.tp=2"),
    ({**WIDE, "mesh.sp": 2}, r"fp8_block: model.seq_len=32 does not split into multiples of 128 tokens over mesh.sp=2"),
])
def test_a_mesh_that_would_split_a_tile_is_refused_in_one_line(over, message):
    with pytest.raises(ConfigError, match=message):
        validate(H.equivalence_config("tiny-llama", **{"precision.matmul": "fp8_block", "mesh.dp": -1, **over}), 8)
