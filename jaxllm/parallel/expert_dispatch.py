"""Expert parallelism over `ep`: routed tokens travel to the devices that own their experts and back
(a shard_map island).

Axes: manual over the batch axes `dp`, `fsdp`, `ep` (each device's own tokens are one
group with its own buffers); `tp` stays with the compiler, which splits the experts'
hidden dimension. Expert weights [E, ...] are split over ep: rank r owns experts
r·E/ep ... (r+1)·E/ep − 1. Routing (gates and chosen experts) is computed outside, on
the whole batch, so its statistics are global.

Per call, on each device with T local tokens and C = `moe.capacity(T, E, k, factor)`:
group its tokens by destination into [E, C, D] buffers (`ops.moe.dispatch`; dropless
mode pads every buffer to the worst case C = T, since `ragged_all_to_all` is not
available on CPU), `all_to_all` over ep so that each rank holds [ep, E/ep, C, D]
(every source's tokens for its own experts), run its experts as batched matmuls over
ep·C rows each, `all_to_all` back, and combine with the gates.

Collectives per call (per device, B bytes per element of the compute dtype): two
all-to-alls of E·C·D elements each, (ep−1)/ep of them leaving the device, so
2·(ep−1)/ep·E·C·D·B bytes; the backward pass makes the same two in reverse. Expert
weights are never gathered over ep (under ZeRO-3 they are gathered over fsdp at use,
before the island, like every weight).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.ops import moe
from jaxllm.sharding import BATCH_AXES

AXIS = "ep"


def expert_parallel_moe(p: dict, x: jax.Array, gates: jax.Array, experts: jax.Array, n_experts: int,
                        capacity_factor: float, spec, dtype, mesh, seq_order=None):
    """Routed experts (`spec`: `moe.Experts`, or a `model.mlp` name) on tokens x [..., D] (the leading dimension
    split over the batch axes; gates and experts [..., k]), experts split over ep, queued in the sequence's order (`seq_order`: as
    `moe.queue_positions` takes it). Returns (y like x, dropped pairs over all devices)."""
    ep, spec = mesh.shape[AXIS], moe.experts_of(spec)
    local_experts = n_experts // ep

    def local(p, x, gates, experts):
        shape = x.shape
        x, gates, experts = x.reshape(-1, shape[-1]), gates.reshape(-1, gates.shape[-1]), experts.reshape(-1, experts.shape[-1])
        t, k = experts.shape
        slots = moe.capacity(t, n_experts, k, capacity_factor)
        pos = moe.queue_positions(experts, n_experts, seq_order)
        buffer, weights = moe.gated_pairs(x, gates, experts, pos, n_experts, slots, spec)  # [E, C, D], rank order
        buffer = buffer.reshape(ep, local_experts, slots, -1)
        buffer = jax.lax.all_to_all(buffer, AXIS, split_axis=0, concat_axis=0, tiled=True)  # [ep (source), E/ep, C, D]
        rows = buffer.transpose(1, 0, 2, 3).reshape(local_experts, ep * slots, -1)
        out = moe.expert_ffn(p, rows, spec, dtype).astype(x.dtype)
        out = out.reshape(local_experts, ep, slots, -1).transpose(1, 0, 2, 3)
        out = jax.lax.all_to_all(out, AXIS, split_axis=0, concat_axis=0, tiled=True)  # [ep (owner), E/ep, C, D]
        y = moe.combine(out.reshape(n_experts, slots, -1), experts, pos, weights).reshape(shape)
        return y, jax.lax.psum(jnp.sum(pos >= slots), BATCH_AXES)

    tokens = P(BATCH_AXES)
    return jax.shard_map(local, mesh=mesh, axis_names=set(BATCH_AXES), check_vma=False,
                         in_specs=(P(AXIS), tokens, tokens, tokens), out_specs=(tokens, P()))(p, x, gates, experts)
