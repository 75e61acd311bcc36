"""Gradient accumulation that all-reduces once per step (ZeRO-0/1): a shard_map island over the batch axes.

Axis: manual over the batch axes `dp`, `fsdp`, `ep` (tp, sp stay with the compiler).
Left to the partitioner, accumulating into a replicated gradient buffer all-reduces
every microbatch's gradients. Here each device sums its own rows' token losses and
gradients over the microbatches, then one `psum` over the batch axes reduces them.

Collectives per call: one all-reduce of the gradients (4·Φ bytes per device for fp32
gradients of Φ parameters; tp-sharded dimensions count 1/tp) and one of the loss
(4 bytes), whatever `train.microbatches` is; with `train.allreduce` other than `xla`, the
gradients' all-reduce becomes that algorithm's collective-permute rounds (`parallel/allreduce.py`).

ZeRO-2/3 do not use it: their accumulation buffer is sharded over `fsdp`, so each
microbatch is reduce-scattered into it by design.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxllm.sharding import BATCH_AXES, Layout, use_layout


def reduce_once(accumulate: Callable, params, batch: dict, norm, local_layout: Layout, reduce: Callable | None = None):
    """(loss, gradients) over the global batch: the per-device sums, all-reduced.

    `accumulate(params, batch, norm)` sums over the microbatches of the rows it is given
    (losses already divided by the global token count; `norm` holds it and the loss scale, replicated); it
    runs on each device's own rows under `local_layout` (activations without batch
    sharding, since those axes are manual here). Parameters must be replicated over
    the batch axes. `reduce(sums, axes)` sums over the batch axes (default `psum`; `train.allreduce`
    passes a hand-built algorithm, `parallel/allreduce.py`, whose rounds replace the one all-reduce).
    """
    reduce = reduce or jax.lax.psum

    def local(params, batch, norm):
        with use_layout(local_layout):
            sums = accumulate(params, batch, norm)
        return reduce(sums, BATCH_AXES)

    return jax.shard_map(local, mesh=local_layout.mesh, in_specs=(P(), P(BATCH_AXES), P()), out_specs=P(),
                         axis_names=set(BATCH_AXES), check_vma=False)(params, batch, norm)
