"""bf16, the default precision, on every parallel form: the project's rule for low-precision equivalence.

bf16 cannot meet the fp32 contract, so the rule is relative (docs/design-notes.md): with `f` the
fp32 reference (tools/reference/plain_llama.py) and err(x) = ||x - f|| / ||f|| per gradient leaf,

    err(bf16 on the mesh) <= 2 · err(bf16 on one device) + 1e-3    for every leaf,

and the bf16 loss on the mesh is within 2e-3 (absolute) of the fp32 loss. One program per form:
ZeRO-3 over fsdp, tensor parallelism with Megatron SP (and with collective matmuls), context
parallelism with each strategy (ring, all-gather, Ulysses), the pipeline (1F1B and interleaved)
and expert parallelism (dropless MoE). Errors measured on this fixture are in docs/design-notes.md.

MoE: bf16 rounds the router's input, and at initialisation the second and third choices of some
tokens are closer than that rounding (a gap of 3e-5 in the logits at layer 0), so bf16 routes
some tokens differently from fp32. Both bf16 runs route them alike, so the expert leaves meet the
same rule as every other leaf here; a mesh that routed differently from one device would fail it.
"""

import pytest

from harness import equivalence_config, leaf_errors, loss_and_grads, reference, step_fns, tiers

LOSS_ATOL = 2e-3

LLAMA = {"model.n_layers": 4}  # four layers, so pp=2 can interleave two chunks per stage
FORMS = {  # name -> (preset, mesh and options)
    "fsdp8_zero3": ("tiny-llama", {"mesh.fsdp": 8, "train.zero_stage": 3}),
    "dp2_tp4_sequence_parallel": ("tiny-llama", {"mesh.dp": 2, "mesh.tp": 4, "train.sequence_parallel": True}),
    "dp2_tp4_collective_matmul": ("tiny-llama", {"mesh.dp": 2, "mesh.tp": 4, "train.sequence_parallel": True,
                                                 "model.collective_matmul": True}),
    "dp2_sp4_ring": ("tiny-llama", {"mesh.dp": 2, "mesh.sp": 4, "model.cp_strategy": "ring"}),
    "dp2_sp4_allgather": ("tiny-llama", {"mesh.dp": 2, "mesh.sp": 4, "model.cp_strategy": "allgather"}),
    "dp2_sp4_ulysses": ("tiny-llama", {"mesh.dp": 2, "mesh.sp": 4, "model.cp_strategy": "ulysses"}),
    "pp2_dp4_1f1b": ("tiny-llama", {"mesh.pp": 2, "mesh.dp": 4, "train.microbatches": 2}),
    "pp2_dp2_tp2_interleaved": ("tiny-llama", {"mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2, "train.microbatches": 2,
                                               "train.pp_schedule": "interleaved", "train.pp_virtual": 2}),
    "ep4_fsdp2": ("tiny-moe", {"mesh.ep": 4, "mesh.fsdp": 2}),
}
MODEL = {"tiny-llama": LLAMA, "tiny-moe": {"model.moe.capacity_factor": 0.0}}


def config(preset: str, precision: str, **over):
    return equivalence_config(preset, **{**MODEL[preset], "precision.compute": precision, **over})


def errors(preset: str, mesh: dict) -> tuple[dict, dict, float, float]:
    """(per-leaf err of bf16 on the mesh, per-leaf err of bf16 on one device, |loss error| of each)."""
    params, ref_loss, ref_grads = reference(config(preset, "float32").model)
    out = []
    for over in (mesh, {}):
        loss, grads = loss_and_grads(step_fns(config(preset, "bfloat16", **over)), params)
        out.append(({k: d / n for k, (d, n) in leaf_errors(grads, ref_grads).items()}, abs(float(loss) - ref_loss)))
    (mesh_err, mesh_loss), (one_err, one_loss) = out
    return mesh_err, one_err, mesh_loss, one_loss


@pytest.mark.parametrize("form", tiers(FORMS, {"fsdp8_zero3"}))
def test_bf16_on_the_mesh_is_as_close_to_fp32_as_on_one_device(form):
    preset, mesh = FORMS[form]
    mesh_err, one_err, mesh_loss, one_loss = errors(preset, mesh)
    assert mesh_loss <= LOSS_ATOL, (mesh_loss, one_loss)
    assert min(one_err.values()) > 0  # bf16 really ran
    bad = {k: (mesh_err[k], one_err[k]) for k in mesh_err if mesh_err[k] > 2 * one_err[k] + 1e-3}
    assert not bad, f"leaves where bf16 on the mesh is off by more than the rule allows: {bad}"
