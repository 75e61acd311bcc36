"""jaxllm.plan.hlo against programs whose collectives we know, on 8 fake CPU devices.

Each program is a shard_map over one axis of 8 devices with a (16,16) f32
local block (1 KiB), so expected bytes are easy to state exactly.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxllm.plan.hlo import (  # noqa: E402
    KINDS, collective_report, collectives_per_step, format_bytes, memory_summary)

BLOCK = 16 * 16 * 4  # bytes of one local (16,16) f32 block
GLOBAL = jax.ShapeDtypeStruct((128, 16), jnp.float32)  # 8 blocks along axis 0


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def hlo(mesh, f, out_specs=P("x")):
    sm = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=out_specs, check_vma=False)
    return jax.jit(sm).lower(GLOBAL).compile().as_text()


def only(kind, count, nbytes):
    """Expected result: `count` ops of `kind` moving `nbytes`, zeros elsewhere."""
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    out[kind] = {"count": count, "bytes": nbytes}
    return out


def psum_step(c, _=None):
    return c + lax.psum(c, "x"), None


def test_scan_counts_each_trip(mesh):
    text = hlo(mesh, lambda a: lax.scan(psum_step, a, None, length=5)[0])
    assert '"known_trip_count":{"n":"5"}' in text  # the mechanism the parser relies on
    assert collective_report(text) == {"collectives": only("all-reduce", 5, 5 * BLOCK),
                                       "unknown_trip_loops": 0}


def test_nested_scans_multiply(mesh):
    def f(a):
        inner = lambda c, _: (lax.scan(psum_step, c, None, length=4)[0], None)
        return lax.scan(inner, a, None, length=3)[0]
    assert collectives_per_step(hlo(mesh, f)) == only("all-reduce", 12, 12 * BLOCK)


def test_fori_loop_known_trip_count(mesh):
    f = lambda a: lax.fori_loop(0, 7, lambda i, c: psum_step(c)[0], a)
    assert collectives_per_step(hlo(mesh, f)) == only("all-reduce", 7, 7 * BLOCK)


def test_while_loop_unknown_trip_count_counts_once(mesh):
    f = lambda a: lax.while_loop(lambda c: c.sum() < 100.0, lambda c: psum_step(c)[0], a)
    rep = collective_report(hlo(mesh, f))
    assert rep == {"collectives": only("all-reduce", 1, BLOCK), "unknown_trip_loops": 1}


@pytest.mark.parametrize("name, f, out_specs, kind, nbytes", [
    ("all_gather", lambda a: lax.all_gather(a, "x", axis=0, tiled=True), P(), "all-gather", 8 * BLOCK),
    ("psum_scatter", lambda a: lax.psum_scatter(a, "x", scatter_dimension=0, tiled=True),
     P("x"), "reduce-scatter", BLOCK // 8),
    ("all_to_all", lambda a: lax.all_to_all(a, "x", 0, 1, tiled=True), P("x"), "all-to-all", BLOCK),
    ("ppermute", lambda a: lax.ppermute(a, "x", [(j, (j + 1) % 8) for j in range(8)]),
     P("x"), "collective-permute", BLOCK),
])
def test_each_kind(mesh, name, f, out_specs, kind, nbytes):
    assert collectives_per_step(hlo(mesh, f, out_specs)) == only(kind, 1, nbytes), name


def test_no_collectives_gives_all_kinds_zero(mesh):
    assert collectives_per_step(hlo(mesh, lambda a: jnp.sin(a) * 2)) == only("all-reduce", 0, 0)


def test_cond_with_collective_in_one_branch(mesh):
    f = lambda a: lax.cond(a.sum() > 0, lambda c: lax.psum(c, "x"), lambda c: c * 2, a)
    text = hlo(mesh, f)
    assert "conditional(" in text
    assert collectives_per_step(text) == only("all-reduce", 1, BLOCK)


def test_cond_takes_branch_with_most_bytes(mesh):
    gather = lambda c: lax.all_gather(c, "x", axis=0, tiled=True).reshape(8, 16, 16).sum(0)
    f = lambda a: lax.cond(a.sum() > 0, lambda c: lax.psum(c, "x"), gather, a)
    assert collectives_per_step(hlo(mesh, f)) == only("all-gather", 1, 8 * BLOCK)


# Modelled on XLA GPU output: async -start/-done pairs with tuple results
# (operand, output[, u32 context]), an async-start wrapper whose called
# computation holds the real op (async-done names it too), a `call`, and a
# while loop with a known trip count whose body holds an all-reduce-start.
GPU_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

%async_computation (p0: bf16[64,32]) -> bf16[8,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  ROOT %reduce-scatter.3 = bf16[8,32]{1,0} reduce-scatter(%p0), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

%called (c0: f32[4,8]) -> f32[4,8] {
  %c0 = f32[4,8]{1,0} parameter(0)
  ROOT %all-to-all.2 = f32[4,8]{1,0} all-to-all(%c0), channel_id=6, replica_groups={{0,1,2,3}}, dimensions={0}
}

%body (bp: (s32[], f32[256])) -> (s32[], f32[256]) {
  %bp = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %v = f32[256]{0} get-tuple-element(%bp), index=1
  %all-reduce-start = f32[256]{0} all-reduce-start(%v), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  %all-reduce-done = f32[256]{0} all-reduce-done(%all-reduce-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[256]{0}) tuple(%next, %all-reduce-done)
}

%cond (cp: (s32[], f32[256])) -> pred[] {
  %cp = (s32[], f32[256]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (a: f32[16,16], b: bf16[64,32], c: f32[4,8], d: f32[256]) -> f32[128,16] {
  %a = f32[16,16]{1,0} parameter(0)
  %b = bf16[64,32]{1,0} parameter(1)
  %c = f32[4,8]{1,0} parameter(2)
  %d = f32[256]{0} parameter(3)
  %all-gather-start = (f32[16,16]{1,0}, f32[128,16]{1,0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/all_gather calls=%called"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false}}
  %collective-permute-start = (f32[16,16]{1,0}, f32[16,16]{1,0}, u32[], u32[]) collective-permute-start(%a), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  %reduce-scatter-start = ((bf16[64,32]{1,0}), bf16[8,32]{1,0}) async-start(%b), calls=%async_computation
  %reduce-scatter-done = bf16[8,32]{1,0} async-done(%reduce-scatter-start), calls=%async_computation
  %call.1 = f32[4,8]{1,0} call(%c), to_apply=%called
  %zero = s32[] constant(0)
  %tw = (s32[], f32[256]{0}) tuple(%zero, %d)
  %while.1 = (s32[], f32[256]{0}) while(%tw), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %collective-permute-done = f32[16,16]{1,0} collective-permute-done(%collective-permute-start)
  ROOT %all-gather-done = f32[128,16]{1,0} all-gather-done(%all-gather-start)
}
"""


def test_gpu_style_async_pairs():
    assert collective_report(GPU_HLO) == {"unknown_trip_loops": 0, "collectives": {
        "all-gather": {"count": 1, "bytes": 128 * 16 * 4},      # output element of the -start tuple
        "collective-permute": {"count": 1, "bytes": 16 * 16 * 4},  # output, not input or u32 context
        "reduce-scatter": {"count": 1, "bytes": 8 * 32 * 2},    # found inside async-start, once
        "all-to-all": {"count": 1, "bytes": 4 * 8 * 4},         # through `call ... to_apply=`
        "all-reduce": {"count": 3, "bytes": 3 * 256 * 4},       # -start once per trip, -done never
    }}


def test_memory_summary_argument_bytes(mesh):
    size = 8 << 20  # 8 MiB f32 global array
    for spec, per_device in [(P(), size), (P("x"), size // 8)]:
        arg = jax.ShapeDtypeStruct((2048, 1024), jnp.float32, sharding=NamedSharding(mesh, spec))
        m = memory_summary(jax.jit(lambda a: a * 2).lower(arg).compile())
        assert m["argument_bytes"] == per_device and m["output_bytes"] == per_device
        assert m["total_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
        donated = memory_summary(jax.jit(lambda a: a * 2, donate_argnums=0).lower(arg).compile())
        assert donated["alias_bytes"] == per_device


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.5 * 2**20) == "1.50 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
