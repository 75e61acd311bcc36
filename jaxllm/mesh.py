"""The one device mesh, and multi-process start-up.

Axes outermost to innermost: pp, dp, fsdp, ep, sp, tp. Inner axes get neighbouring
devices (fast links): tp talks every layer, pp once per microbatch. All axes are
`Auto`: the model places sharding constraints at logical boundaries and XLA's
partitioner does the rest.
"""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxllm.errors import ConfigError

from jaxllm.schema import Config, DistributedConfig, MeshConfig

MESH_AXES = ("pp", "dp", "fsdp", "ep", "sp", "tp")

log = logging.getLogger("jaxllm")


def resolve_mesh_shape(mc: MeshConfig, n_devices: int) -> dict[str, int]:
    """Per-axis sizes over all devices (ICI size × DCN size), with the one -1 axis filled in."""
    sizes = {a: getattr(mc, a) for a in MESH_AXES}
    dcn = {a: getattr(mc.dcn, a) for a in MESH_AXES}
    for a in MESH_AXES:
        if sizes[a] == 0 or sizes[a] < -1:
            raise ConfigError(f"mesh.{a}: must be a positive size or -1, got {sizes[a]}")
        if dcn[a] < 1:
            raise ConfigError(f"mesh.dcn.{a}: must be a positive size, got {dcn[a]}")
    free = [a for a in MESH_AXES if sizes[a] == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in free)}; give the others sizes")
    fixed = math.prod(sizes[a] * dcn[a] for a in MESH_AXES if sizes[a] != -1)
    if free:
        a = free[0]
        if n_devices % (fixed * dcn[a]):
            raise ConfigError(
                f"mesh: the fixed axes use {fixed * dcn[a]} devices, which does not divide the {n_devices} available; "
                "change the mesh sizes")
        sizes[a] = n_devices // (fixed * dcn[a])
    total = {a: sizes[a] * dcn[a] for a in MESH_AXES}
    if math.prod(total.values()) != n_devices:
        desc = "×".join(f"{a}={total[a]}" for a in MESH_AXES if total[a] > 1) or "1"
        raise ConfigError(
            f"mesh: {desc} uses {math.prod(total.values())} devices but {n_devices} are available; "
            "make the product of mesh.* match, or set one axis to -1")
    return total


def batch_shards(mesh_shape: dict[str, int]) -> int:
    """Devices that split the batch: dp × fsdp × ep."""
    return mesh_shape["dp"] * mesh_shape["fsdp"] * mesh_shape["ep"]


def initialize_distributed(d: DistributedConfig) -> None:
    """Start jax.distributed when the config says so: an explicit coordinator, or JAX's cluster detection.

    Must run before anything touches the devices. Single-process runs skip it.
    """
    _check_distributed(d)
    if d.coordinator_address:
        jax.distributed.initialize(
            coordinator_address=d.coordinator_address,
            num_processes=d.num_processes or None,
            process_id=d.process_id if d.process_id >= 0 else None,
        )
    elif d.auto:
        try:
            jax.distributed.initialize()  # SLURM, Open MPI, TPU pods, ... detected by JAX
        except ValueError as e:  # no cluster JAX knows: it asks for what it could not find
            raise ConfigError(f"distributed.auto=true: JAX detected no cluster here ({e}); give "
                              "distributed.coordinator_address, num_processes and process_id, or leave auto off "
                              "for one process") from None
    else:
        return
    log.info("jax.distributed: process %d of %d, %d local devices, %d in all",
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def _check_distributed(d: DistributedConfig) -> None:
    """The distributed keys fit together (one ConfigError line), before jax.distributed starts."""
    if d.num_processes < 0 or d.process_id < -1:
        raise ConfigError(f"distributed.num_processes ({d.num_processes}) must be 0 (left to JAX) or more and "
                          f"distributed.process_id ({d.process_id}) -1 (left to JAX) or more")
    if d.num_processes and d.process_id >= d.num_processes:
        raise ConfigError(f"distributed.process_id={d.process_id} of distributed.num_processes={d.num_processes}: "
                          f"ids run from 0 to {d.num_processes - 1}")
    if (d.num_processes or d.process_id >= 0) and not (d.coordinator_address or d.auto):
        raise ConfigError("distributed.num_processes and process_id start several processes only with "
                          "distributed.coordinator_address (host:port of process 0) or distributed.auto=true; "
                          "give one, or leave them unset for one process")


def make_mesh(shape: dict[str, int], cfg: Config | None = None, devices=None) -> Mesh:
    """A mesh over all devices with the given per-axis sizes (already validated).

    With several processes and `mesh.dcn.*` sizes, builds a hybrid mesh: each axis is
    (size across nodes) × (size within a node), so the slow links carry the outer axes.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = tuple(shape[a] for a in MESH_AXES)
    types = (AxisType.Auto,) * len(MESH_AXES)
    dcn = tuple(getattr(cfg.mesh.dcn, a) for a in MESH_AXES) if cfg is not None else (1,) * len(MESH_AXES)
    if any(d > 1 for d in dcn) and jax.process_count() > 1:
        from jax.experimental import mesh_utils

        ici = tuple(s // d for s, d in zip(sizes, dcn))
        # Multi-slice TPUs: the slow links are between slices. GPU/CPU clusters (one slice):
        # between processes, i.e. hosts.
        slices = {getattr(d, "slice_index", 0) for d in devices}
        arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                   process_is_granule=len(slices) != math.prod(dcn))
        return Mesh(arr, MESH_AXES, axis_types=types)
    if devices == jax.devices():
        return jax.make_mesh(sizes, MESH_AXES, axis_types=types)
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=types)


def barrier(name: str, timeout_s: int = 600) -> None:
    """Wait until every process gets here (no-op with one process).

    Uses the coordinator's key-value barrier, which waits as long as `timeout_s`; the
    public `multihost_utils.sync_global_devices` goes through a collective whose
    connection set-up times out after 30 s when one process is slow to arrive.
    """
    if jax.process_count() == 1:
        return
    try:
        from jax._src import distributed

        distributed.global_state.client.wait_at_barrier(name, timeout_s * 1000)
    except (ImportError, AttributeError):
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def all_agree(name: str, ok: bool, timeout_s: int = 600) -> bool:
    """True when `ok` holds on every process (itself with one), through the coordinator's key-value
    store: no collective, so no device program is needed to decide."""
    if jax.process_count() == 1:
        return ok
    from jax._src import distributed

    client = distributed.global_state.client
    client.key_value_set(f"{name}/{jax.process_index()}", "1" if ok else "0")
    return all(client.blocking_key_value_get(f"{name}/{p}", timeout_s * 1000) == "1"
               for p in range(jax.process_count()))
