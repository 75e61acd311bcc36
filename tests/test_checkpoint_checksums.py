"""Checkpoint checksums (jaxllm/trainer/checksums.py): the same on every mesh, changed by any flipped bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.errors import CheckpointError
from jaxllm.trainer import checksums


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {"params": {"w": rng.standard_normal((16, 24)).astype(np.float32),
                       "h": rng.standard_normal((8, 6)).astype(jnp.bfloat16),
                       "layers": rng.standard_normal((8, 8, 6)).astype(np.float32)},
            "count": np.int32(7), "mask": rng.random(40) > 0.5}


def _on(tree, mesh_shape):
    """`tree` laid out over a mesh of 8 devices (`mesh_shape` over axes a, b): split where the sizes divide."""
    mesh = jax.make_mesh(mesh_shape, ("a", "b"))
    def place(x):
        x = np.asarray(x)
        spec = P(*("a" if i == 0 and x.shape[0] % mesh_shape[0] == 0 else
                   "b" if i == 1 and x.shape[1] % mesh_shape[1] == 0 else None for i in range(x.ndim)))
        return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.tree.map(place, tree)


def test_an_arrays_checksum_is_the_same_on_every_mesh():
    tree = _tree()
    one = checksums.of(jax.device_put(tree, jax.devices()[0]))
    assert sorted(one) == ["count", "mask", "params/h", "params/layers", "params/w"]
    assert one["params/h"][0] == "bfloat16"
    for shape in ((8, 1), (2, 4), (4, 2)):
        assert checksums.of(_on(tree, shape)) == one, shape


@pytest.mark.parametrize("where", [(0, 0), (7, 13), (15, 23)])
def test_one_flipped_bit_or_two_swapped_values_change_it(where):
    tree = _tree()
    saved = checksums.of(_on(tree, (2, 4)))
    for bit in (0, 17, 31):
        w = tree["params"]["w"].copy()
        w.view(np.uint32)[where] ^= np.uint32(1 << bit)
        flipped = {**tree, "params": {**tree["params"], "w": w}}
        with pytest.raises(CheckpointError, match="array params/w does not match"):
            checksums.verify(_on(flipped, (4, 2)), saved)
    swapped = tree["params"]["w"].copy()
    swapped[0, 0], swapped[0, 1] = swapped[0, 1], swapped[0, 0]
    with pytest.raises(CheckpointError, match="params/w"):
        checksums.verify(jax.device_put({**tree, "params": {**tree["params"], "w": swapped}}), saved)
    checksums.verify(_on(tree, (8, 1)), saved)  # unchanged: no error
