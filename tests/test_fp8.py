"""FP8 matmuls (`precision.matmul = "fp8"`, `jaxllm/ops/fp8.py`): the dot and both gradients equal an
independent ml_dtypes reference; the largest element maps to the format's largest value exactly; zeros stay
finite; a tensor's scale is the whole tensor's wherever its pieces live (a shard-skewed input, the
accumulation and pipeline islands); meshes equal one device; the lowered step holds both fp8 formats;
tiny-llama trains as bf16 does."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness as H
from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from jaxllm.ops import fp8
from jaxllm.trainer.loop import train


def reference_quantize(x: np.ndarray, dtype) -> tuple[np.ndarray, np.float32]:
    """ml_dtypes' rounding of x / (amax / largest), as float64 values, and the fp32 scale."""
    top = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.float32(np.abs(x).max())
    scale = np.float32(amax / top) if amax > 0 else np.float32(1)
    q = np.clip(x.astype(np.float32) / scale, -top, top).astype(dtype)
    return q.astype(np.float64), scale


def reference_dot(x, w, g):
    """(x @ w, its gradients for the cotangent g) in float64 from E4M3 x, w and E5M2 g."""
    (qx, sx), (qw, sw), (qg, sg) = (reference_quantize(x, ml_dtypes.float8_e4m3fn),
                                    reference_quantize(w, ml_dtypes.float8_e4m3fn),
                                    reference_quantize(g, ml_dtypes.float8_e5m2))
    return qx @ qw * sx * sw, qg @ qw.T * sg * sw, qx.T @ qg * sx * sg


def fp8_dot_and_grads(x, w, g):
    with fp8.use(frozenset({"mlp"})):
        y, vjp = jax.vjp(lambda a, b: fp8.einsum("mlp", "tk,kn->tn", a, b), x, w)
        return (y, *vjp(g))


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def test_the_fp8_dot_and_its_gradients_equal_an_ml_dtypes_reference():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 48)) * np.exp(rng.uniform(-4, 4, (32, 1)))).astype(np.float32)
    w = (rng.standard_normal((48, 24)) * 0.02).astype(np.float32)
    g = (rng.standard_normal((32, 24)) * 1e-5).astype(np.float32)
    got, want = fp8_dot_and_grads(x, w, g), reference_dot(x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert rel(a, b) <= 1e-6, (name, rel(a, b))
    bf16 = fp8_dot_and_grads(*(jnp.asarray(v, jnp.bfloat16) for v in (x, w, g)))
    assert [v.dtype for v in bf16] == [jnp.bfloat16] * 3  # the operands' dtype comes back


def test_the_largest_element_maps_to_the_largest_value_and_zeros_stay_finite():
    x = np.linspace(-3.7, 2.9, 97, dtype=np.float32)
    for dtype, top in ((fp8.E4M3, 448.0), (fp8.E5M2, 57344.0)):
        q, scale = fp8.quantize(jnp.asarray(x), dtype)
        q = np.asarray(q, np.float32)
        assert q[0] == -top and np.abs(q).max() == top and np.isfinite(q).all()
        assert float(scale) == np.float32(np.float32(3.7) / np.float32(top))
    zeros = np.zeros((8, 8), np.float32)
    for v in fp8_dot_and_grads(zeros, zeros, zeros):
        assert np.array_equal(np.asarray(v), np.zeros((8, 8)))


def test_a_shard_skewed_tensor_gets_the_one_device_scale():
    """The maximum sits on one of 8 shards: inside a shard_map island (the amax's pmax) and under the
    compiler's sharding, every device's scale is the one-device scale, bit for bit."""
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    x[5, 3] = 40.0
    mesh = jax.make_mesh((8,), ("dp",), devices=jax.devices()[:8])
    one = float(fp8.quantize(jnp.asarray(x), fp8.E4M3)[1])
    sharded = jax.device_put(x, NamedSharding(mesh, P("dp")))
    island = jax.jit(jax.shard_map(lambda v: fp8.quantize(v, fp8.E4M3)[1][None], mesh=mesh, in_specs=P("dp"),
                                   out_specs=P("dp")))(sharded)
    assert np.asarray(island).tolist() == [one] * 8 and one == np.float32(40.0) / np.float32(448)
    assert float(jax.jit(lambda v: fp8.quantize(v, fp8.E4M3)[1])(sharded)) == one


def fp8_loss_and_grads(microbatches: int = 1, **over):
    cfg = H.equivalence_config("tiny-llama", **{"precision.matmul": "fp8", "train.microbatches": microbatches,
                                                **over})
    return H.loss_and_grads(H.step_fns(cfg), transformer.init_params(cfg.model, jax.random.key(0)))


# (mesh, microbatches, the other run, bound): with one microbatch a mesh equals one device; with two, a
# device's microbatches are its own rows, so the peers are runs that split the batch alike: the accumulation
# island (ZeRO-0, amax reduced over the manual batch axes) against the compiler's ZeRO-2 on the same mesh,
# and the pipeline (pp not reduced over: its ranks hold different layers) against one device.
DP_FSDP = {"mesh.dp": 2, "mesh.fsdp": 2}
CASES = {
    "dp2xfsdp2": (DP_FSDP, 1, {}, 1e-5),
    "dp2xtp2": ({"mesh.dp": 2, "mesh.tp": 2}, 1, {}, 1e-5),  # measured 1.1e-6 (tensor-parallel sums)
    "island": ({**DP_FSDP, "train.zero_stage": 0}, 2, {**DP_FSDP, "train.zero_stage": 2}, 1e-6),
    "pp2": ({"mesh.pp": 2, "train.pp_schedule": "1f1b"}, 2, {}, 1e-6),
}


@pytest.mark.slow  # 3 to 5 s each; the fast tier's fp8 share is the unit tests and the lowered step
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_on_a_mesh_equals_its_peer(case):
    mesh, microbatches, peer, bound = CASES[case]
    loss, grads = fp8_loss_and_grads(microbatches, **mesh)
    ref_loss, ref_grads = fp8_loss_and_grads(microbatches, **peer)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert H.max_rel_err(grads, ref_grads) <= bound


def test_the_lowered_step_multiplies_e4m3_and_e5m2_and_keeps_the_head_out():
    def fp8_types(**over):
        fns = H.step_fns(H.equivalence_config("tiny-llama", **DP_FSDP, **over))  # fp8 on a mesh, too
        text = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(H.BATCH, H.SEQ)).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line and "xf8E4M3FN" in line]
        return {t for t in ("f8E4M3FN", "f8E5M2") if t in text}, len(dots)

    assert fp8_types() == (set(), 0)
    types, dots = fp8_types(**{"precision.matmul": "fp8"})
    assert types == {"f8E4M3FN", "f8E5M2"}
    # tiny-llama: q, k, v, o, gate, up, down forward; two gradients each (both take an E4M3 operand)
    assert dots == 7 * 3
    assert fp8_types(**{"precision.matmul": "fp8", "precision.fp8_exclude": []})[1] == 8 * 3


@pytest.mark.parametrize("over, message", [
    ({"precision.matmul": "fp4"}, "precision.matmul: 'fp4' is not one of default, fp8"),
    ({"precision.matmul": "fp8", "precision.fp8_exclude": ["lm_head"]}, r"\['lm_head'\] are not matmul groups"),
    ({"precision.matmul": "fp8", "model.collective_matmul": True, "train.sequence_parallel": True, "mesh.tp": 2},
     "precision.matmul=fp8 with model.collective_matmul=true is not supported yet"),
])
def test_bad_fp8_settings_are_refused_in_one_line(over, message):
    with pytest.raises(ConfigError, match=message):
        validate(H.equivalence_config("tiny-llama", **{"mesh.dp": -1, **over}), 8)


@pytest.mark.slow
def test_tiny_llama_trains_in_fp8_within_3_percent_of_bf16(tmp_path):
    """jaxllm/configs/tiny_llama.toml at seq_len 64 and batch 8 (a quarter of its work) for 30 steps
    (seed 0) in bf16, with and without fp8 matmuls."""
    def final_loss(name, **over):
        run_dir = tmp_path / name
        train(build_config("jaxllm/configs/tiny_llama.toml",
                           {"train.steps": 30, "train.seed": 0, "precision.compute": "bfloat16", "run.dir": str(run_dir),
                            "model.seq_len": 64, "train.global_batch": 8,
                            "train.eval_every": 0, "train.checkpoint_every": 0, "train.log_every": 10, **over}))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r][-1]

    bf16, fp8_loss = final_loss("bf16"), final_loss("fp8", **{"precision.matmul": "fp8"})
    print(f"tiny-llama after 30 steps: bf16 {bf16:.4f}, fp8 {fp8_loss:.4f}")
    assert abs(fp8_loss - bf16) <= 0.03 * bf16, (fp8_loss, bf16)
