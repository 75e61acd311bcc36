"""Validation and the end-of-run sample on every parallel form compute what one device computes.

The trainer evaluates with the step's `eval_loss` and samples with `loop.sample` (the KV-cache generator), both on the
parameters as the mesh holds them (split over pp, tp, ep or fsdp). On a pipeline, context-,
tensor- and expert-parallel mesh: the validation loss (summed token loss over the token count)
equals the independent reference's loss (fp32, 1e-5), and the sampled text equals the sample one
device draws from the same parameters with the same seed.
"""

import jax
import pytest

from harness import LOSS_RTOL, equivalence_config, eval_loss, reference, step_fns, tiers
from jaxllm.data import get_tokenizer
from jaxllm.trainer.loop import sample

FORMS = {  # name -> (preset, mesh and options)
    "pp2_dp4_1f1b": ("tiny-llama", {"model.n_layers": 4, "mesh.pp": 2, "mesh.dp": 4, "train.microbatches": 2}),
    "sp4_dp2_ring_zigzag": ("tiny-gpt2", {"mesh.sp": 4, "mesh.dp": 2}),
    "tp4_dp2_sequence_parallel": ("tiny-llama", {"mesh.tp": 4, "mesh.dp": 2, "train.sequence_parallel": True}),
    "ep4_fsdp2_zero3": ("tiny-moe", {"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 3,
                                     "model.moe.capacity_factor": 0.0}),
}
MODEL_KEYS = ("model.n_layers", "model.moe.capacity_factor")


@pytest.mark.parametrize("form", tiers(FORMS, {"tp4_dp2_sequence_parallel"}))
def test_validation_loss_and_sample_match_one_device(form):
    preset, over = FORMS[form]
    one = equivalence_config(preset, **{k: v for k, v in over.items() if k in MODEL_KEYS})
    params, ref_loss, _ = reference(one.model)
    cfg = equivalence_config(preset, **over)
    fns = step_fns(cfg)
    total, count, _ = eval_loss(fns, params)
    assert abs(float(total) / float(count) - ref_loss) <= LOSS_RTOL * ref_loss

    tokenizer = get_tokenizer("byte")
    on_mesh = sample(jax.device_put(params, fns.state_shardings.params), cfg, tokenizer, "def ", 24, on=fns)
    assert on_mesh == sample(params, one, tokenizer, "def ", 24)
    assert len(on_mesh) > len("def ")
