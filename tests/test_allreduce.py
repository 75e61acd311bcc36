"""The hand-built collectives (`jaxllm/parallel/allreduce.py`): every all-reduce algorithm and primitive equals
its reference (`psum`, `all_gather`, ...) on 2, 4, 6 and 8 devices and the two-level ones on a 2×4 mesh, for
sizes that do and do not divide, exactly on integers and to fp32 rounding on floats; the compiled programs
have the rounds and the bytes per device their docstrings state. DDP with each `train.allreduce` gives xla's
gradients and a 20-step run's losses, and its compiled step reduces the gradients by permutes alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import harness as H
from jaxllm.errors import ConfigError
from jaxllm.config import validate
from jaxllm.models import transformer
from jaxllm.parallel import allreduce as A
from jaxllm.plan.hlo import collective_report, permute_bytes_by_device

POWER_OF_TWO_ONLY = ("halving_doubling", "butterfly")


def per_device(fn, n: int, *arrays, mesh_shape=None, axes=("x",)):
    """fn(each device's slice of every array) on n devices, stacked back [n, ...] (a 1-D or 2-D mesh)."""
    mesh = jax.make_mesh(mesh_shape or (n,), axes, devices=jax.devices()[:n])
    spec = P(axes)
    f = jax.jit(jax.shard_map(lambda *a: jax.tree.map(lambda o: o[None], fn(*(v[0] for v in a))), mesh=mesh,
                              in_specs=spec, out_specs=spec))
    return jax.device_get(f(*(jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays))), f, mesh


def contributions(n: int, shape):
    rng = np.random.default_rng(n)
    return (rng.integers(-1000, 1000, (n, *shape)).astype(np.int32),
            rng.standard_normal((n, *shape)).astype(np.float32))


def assert_sum(got_int, got_float, ints, floats):
    """Every device holds the sum: integers exactly, floats within fp32 rounding of the float64 sum."""
    n = len(ints)
    assert all(np.array_equal(g, ints.sum(0)) for g in got_int)
    bound = n * np.finfo(np.float32).eps * np.abs(floats).sum(0)
    assert all(np.all(np.abs(g - floats.astype(np.float64).sum(0)) <= bound) for g in got_float)


@pytest.mark.parametrize("name", list(A.ALGORITHMS))
@pytest.mark.parametrize("n", H.tiers([2, 4, 6, 8], fast=[8]))
def test_each_all_reduce_equals_psum(name, n):
    if name in POWER_OF_TWO_ONLY and n == 6:
        with pytest.raises(ValueError, match=f"{name} all-reduce needs a power-of-two number of devices, got 6"):
            per_device(lambda v: A.ALGORITHMS[name](v, "x"), n, np.zeros((n, 4), np.float32))
        return
    for shape in ((16,), (5, 3)):  # 16 elements divide 2, 4 and 8; 15 divide none
        ints, floats = contributions(n, shape)
        (got_int, got_float), _, _ = per_device(lambda a, b: (A.ALGORITHMS[name](a, "x"), A.ALGORITHMS[name](b, "x")),
                                                n, ints, floats)
        assert_sum(got_int, got_float, ints, floats)


@pytest.mark.parametrize("name", ["hierarchical", "torus"])
@pytest.mark.parametrize("order", [("outer", "inner"), ("inner", "outer")])
def test_two_level_all_reduces_equal_psum_on_a_2x4_mesh(name, order):
    ints, floats = contributions(8, (5, 3))
    fn = getattr(A, name)
    (got_int, got_float), _, _ = per_device(lambda a, b: (fn(a, *order), fn(b, *order)), 8, ints, floats,
                                            mesh_shape=(2, 4), axes=("outer", "inner"))
    assert_sum(got_int, got_float, ints, floats)


def primitive_reference(name: str, x: np.ndarray) -> np.ndarray:
    """[N, ...] per device from the contributions x [N, ...] (for scatter, all_to_all, reduce_scatter: each
    rank's x is [N, ...] itself), computed in NumPy."""
    n = len(x)
    zeros = np.zeros_like
    return {"reduce": lambda: np.stack([x.sum(0)] + [zeros(x[0])] * (n - 1)),
            "broadcast": lambda: np.stack([x[0]] * n),
            "scatter": lambda: x[0],
            "gather": lambda: np.stack([x] + [zeros(x)] * (n - 1)),
            "all_gather": lambda: np.stack([x] * n),
            "reduce_scatter": lambda: x.sum(0),
            "all_to_all": lambda: np.swapaxes(x, 0, 1)}[name]()


@pytest.mark.parametrize("name", list(A.PRIMITIVES))
@pytest.mark.parametrize("n", H.tiers([4, 6, 8], fast=[8]))
def test_each_primitive_equals_its_reference(name, n):
    blocks = name in ("scatter", "all_to_all", "reduce_scatter")
    x = np.random.default_rng(n).integers(-1000, 1000, (n, n, 3) if blocks else (n, 5, 3)).astype(np.int32)
    got, _, _ = per_device(lambda v: A.PRIMITIVES[name](v, "x"), n, x)
    np.testing.assert_array_equal(got, primitive_reference(name, x))


def test_send_recv_moves_one_value_between_two_ranks():
    x = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    got, _, _ = per_device(lambda v: A.send_recv(v, "x", 5, 2), 8, x)
    np.testing.assert_array_equal(got, np.where(np.arange(8)[:, None] == 2, x[5], 0))


S = 1001 * 4  # bytes of a 1001-element fp32 message: 8 does not divide it (padded chunks of 126)
CHUNK = 126 * 4


# N = 8: (rounds, bytes each device sends) from each docstring's formula
ROUNDS_AND_BYTES = {
    "ring": (14, [14 * CHUNK] * 8),  # 2(N-1) rounds of S/N
    "halving_doubling": (6, [14 * CHUNK] * 8),  # 2 log N rounds; (N/2 + ... + 1) chunks, twice
    "butterfly": (3, [3 * S] * 8),  # log N rounds of S
    "tree": (10, [2 * S, 3 * S, 3 * S, 2 * S, S, S, S, S]),  # the root sends 2S down; inner nodes S up, ≤ 2S down
    "reduce_broadcast": (6, [3 * S, S, 2 * S, S, 3 * S, S, 2 * S, S]),  # binomial: S up once, S per child
    "ps": (14, [7 * S] + [S] * 7),  # the server pulls back 7 times
}


@pytest.mark.parametrize("name", list(ROUNDS_AND_BYTES))
def test_the_compiled_rounds_and_bytes_per_device_are_the_docstrings(name):
    mesh = jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])
    f = jax.jit(jax.shard_map(lambda v: A.ALGORITHMS[name](v[0], "x")[None], mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    hlo = f.lower(jax.ShapeDtypeStruct((8, 1001), jnp.float32, sharding=NamedSharding(mesh, P("x")))).compile()
    text = hlo.as_text()
    rounds, sent = ROUNDS_AND_BYTES[name]
    report = collective_report(text)["collectives"]
    assert report["collective-permute"]["count"] == rounds
    assert sum(v["count"] for k, v in report.items() if k != "collective-permute") == 0  # nothing but permutes
    assert permute_bytes_by_device(text, 8) == sent


@pytest.mark.parametrize("name, rounds, sent", [
    ("hierarchical", 2 * 3 + 2 * 1, 6 * 251 * 4 + 2 * 126 * 4),  # ring RS/AG over 4 in chunks of 251; 2 on 126
    ("torus", 2 * 3 + 2 * 1, 6 * 251 * 4 + 2 * 501 * 4),  # a ring over 4, then over 2 on the whole message
])
def test_two_level_rounds_and_bytes_on_a_2x4_mesh(name, rounds, sent):
    mesh = jax.make_mesh((2, 4), ("outer", "inner"), devices=jax.devices()[:8])
    spec = P(("outer", "inner"))
    f = jax.jit(jax.shard_map(lambda v: getattr(A, name)(v[0], "inner", "outer")[None], mesh=mesh, in_specs=spec,
                              out_specs=spec))
    text = f.lower(jax.ShapeDtypeStruct((8, 1001), jnp.float32, sharding=NamedSharding(mesh, spec))).compile().as_text()
    assert collective_report(text)["collectives"]["collective-permute"]["count"] == rounds
    assert permute_bytes_by_device(text, 8) == [sent] * 8


DDP_MESHES = {"dp8": {"mesh.dp": 8}, "dp2xfsdp4_zero1": {"mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 1}}
DDP_ALGORITHMS = [a for a in A.CHOICES if a != "xla"]


def ddp_config(mesh: str, algorithm: str = "xla"):
    # buckets of 50 KiB: tiny-llama's 0.3 MB of gradients travel in several
    return H.equivalence_config("tiny-llama", **DDP_MESHES[mesh], **{"train.allreduce": algorithm,
                                                                     "train.bucket_mb": 0.05})


@pytest.mark.parametrize("mesh, algorithm", H.tiers([(m, a) for m in DDP_MESHES for a in DDP_ALGORITHMS],
                                                     fast=[("dp8", "ring")]))
def test_ddp_gradients_equal_xlas_all_reduce(mesh, algorithm):
    cfg = ddp_config(mesh, algorithm)
    params = transformer.init_params(cfg.model, jax.random.key(0))
    _, grads = H.loss_and_grads(H.step_fns(cfg), params)
    _, ref = H.loss_and_grads(H.step_fns(ddp_config(mesh)), params)
    assert H.max_rel_err(grads, ref) <= 1e-6
    hlo = H.lower_loss_and_grads(H.step_fns(cfg)).compile().as_text()
    report = collective_report(hlo)["collectives"]
    # the gradients travel by permutes; an all-reduce is left only for scalars (the batch's token count)
    assert report["all-reduce"]["bytes"] <= 16 and report["collective-permute"]["bytes"] > 4 * transformer.count_params(
        cfg.model)


@functools.cache
def twenty_losses(mesh: str, algorithm: str = "xla") -> np.ndarray:
    """The losses of 20 steps; cached so each mesh's `xla` reference runs once for all algorithms."""
    fns, out = H.step_fns(ddp_config(mesh, algorithm)), []
    state = fns.init(0)
    for step in range(20):
        state, metrics = H.train_step(fns, state, H.tokens(step))
        out.append(float(metrics["loss"]))
    return np.asarray(out)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, algorithm", [(m, a) for m in DDP_MESHES for a in DDP_ALGORITHMS])
def test_ddp_trains_twenty_steps_like_xla(mesh, algorithm):
    ours, ref = twenty_losses(mesh, algorithm), twenty_losses(mesh)
    assert np.all(np.abs(ours - ref) <= 1e-5 * ref), np.abs(ours - ref).max()


@pytest.mark.parametrize("over, message", [
    ({"train.allreduce": "nccl"}, "train.allreduce: 'nccl' is not one of xla, ring"),
    ({"train.allreduce": "ring", "train.zero_stage": 2}, "train.allreduce=ring with train.zero_stage >= 2"),
    ({"train.allreduce": "halving_doubling", "mesh.dp": 6}, "needs a power-of-two dp×fsdp×ep, got 6"),
])
def test_bad_allreduce_settings_are_refused_in_one_line(over, message):
    with pytest.raises(ConfigError, match=message):
        validate(H.equivalence_config("tiny-llama", **{"mesh.dp": 8, "train.global_batch": 48, **over}),
                 over.get("mesh.dp", 8))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ring", "tree", "ps", "hierarchical"])
def test_the_planner_reports_the_bytes_each_device_sends_beside_the_formula(algorithm):
    """jaxllm plan on dp2 × fsdp4 (ZeRO-1): the compiled step's most-sending device sends the formula's bytes
    for 4Φ of fp32 gradients, plus the padding of each bucket to a multiple of 8 and the loss's scalars."""
    from jaxllm.plan import format_table, plan

    report = plan(ddp_config("dp2xfsdp4_zero1", algorithm))
    a = report["allreduce"]
    assert a["formula_bytes"] <= a["sent_max"] <= 1.01 * a["formula_bytes"], a
    assert a["seeds_bytes"] == 8 * report["params"]
    assert f"train.allreduce={algorithm} over 8 devices" in format_table(report)
