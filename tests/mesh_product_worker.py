"""One mesh product against one device, in a process of its own with 16 fake CPU devices (tests/test_mesh_products.py).

    python tests/mesh_product_worker.py '{"mesh.pp": 2, "mesh.sp": 2, ...}'

Builds the equivalence model (`model.preset` among the keys, else tiny-llama; 4 layers unless the keys say) on one
device, with the keys' model.* keys, and on the mesh all the keys give, from the same parameters: step 1's loss and gradients through `harness.assert_matches` (1e-5 on the loss, each leaf 1e-4 relative
to its norm); then four optimizer steps from the same warm state (`harness.warm`: Adam past its first step, so one
update is a smooth function of the gradient) on both. Prints one JSON line: the mesh's and the one device's losses
of the four steps. Exits non-zero on a failed check.
"""

from __future__ import annotations

import json
import sys

import harness as H


def losses(fns, state) -> list[float]:
    out = []
    for step in range(4):
        state, metrics = H.train_step(fns, state, H.tokens(step))
        out.append(float(metrics["loss"]))
    return out


def main(keys: dict) -> dict:
    import jax

    keys = {"model.n_layers": 4, **keys}
    preset = keys.pop("model.preset", "tiny-llama")
    model = {k: v for k, v in keys.items() if k.startswith("model.")}
    one = H.step_fns(H.equivalence_config(preset, **model), devices=1)
    mesh = H.step_fns(H.equivalence_config(preset, **keys))
    params = jax.device_get(one.init(0).params)
    loss, grads = H.loss_and_grads(one, params)
    H.assert_matches(*H.loss_and_grads(mesh, params), (params, float(loss), jax.device_get(grads)))
    start = jax.device_get(H.warm(one.init(0)))
    return {"mesh": losses(mesh, start), "one": losses(one, start)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
