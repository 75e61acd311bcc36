"""Activation memory (`model.remat`, `model.remat_group`): recomputation in groups of layers and every
policy give the gradients of no recomputation; for 16 layers the compiled temporaries order √L groups <
full < selective < none; the offloading policy marks what it saves for host memory."""

from __future__ import annotations

import jax
import pytest

import harness as H
from jaxllm.config import validate
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from tools.collectives import memory_summary

DEEP = {"model.n_layers": 16, "train.global_batch": 8}  # tiny-llama's width, 16 layers


def deep_fns(**over):
    return H.step_fns(H.equivalence_config("tiny-llama", **DEEP, **over))


# (remat, remat_group, pp): groups over full and over no per-layer remat, each policy, groups per stage chunk
CASES = [("full", -1, 1), ("none", 4, 1), ("selective", 0, 1), ("save-named", 2, 1), ("offload-dots", 0, 1),
         ("full", -1, 2)]


@pytest.mark.parametrize("remat, group, pp", H.tiers(CASES, fast=[("full", -1, 1), ("offload-dots", 0, 1)]))
def test_recomputation_gives_the_gradients_of_none(remat, group, pp):
    mesh = {"mesh.pp": pp, "train.microbatches": 2, "train.pp_schedule": "1f1b"} if pp > 1 else {}
    params = transformer.init_params(H.equivalence_config("tiny-llama", **DEEP).model, jax.random.key(0))
    loss, grads = H.loss_and_grads(deep_fns(**mesh, **{"model.remat": remat, "model.remat_group": group}), params,
                                   H.tokens(batch=8))
    ref_loss, ref_grads = H.loss_and_grads(deep_fns(**mesh), params, H.tokens(batch=8))
    assert abs(float(loss) - float(ref_loss)) <= 1e-7 * abs(float(ref_loss))
    assert H.max_rel_err(grads, ref_grads) <= 1e-6


@pytest.mark.slow
def test_sixteen_layers_order_their_temporaries_by_what_they_keep():
    """seq 128 (activations outweigh the weights): groups of 4 layers recomputed keep 4 + 4 layer inputs,
    full remat 16, selective every weight matmul's output, none everything."""
    def temporaries(remat, group=0):
        fns = deep_fns(**{"model.seq_len": 128, "model.remat": remat, "model.remat_group": group})
        return memory_summary(H.lower_loss_and_grads(fns, batch=8, seq=128).compile())["temp_bytes"]

    grouped, full, selective, none = (temporaries("full", -1), temporaries("full"), temporaries("selective"),
                                      temporaries("none"))
    assert grouped < full < selective < none, (grouped, full, selective, none)


def test_the_offloading_policy_sends_saved_matmuls_to_the_host():
    """The traced gradient program puts each saved weight-matmul output in host memory (XLA:CPU then
    compiles the placement away: no memory saving shows here)."""
    def host_values(remat):
        fns = deep_fns(**{"model.remat": remat})
        jaxpr = jax.make_jaxpr(fns.loss_and_grads)(fns.abstract_state.params, fns.abstract_batch(8, H.SEQ))
        return str(jaxpr).count("MemorySpace.Host")

    assert host_values("selective") == 0
    assert host_values("offload-dots") > 0  # the weight matmuls whose outputs the backward pass reads


@pytest.mark.parametrize("repeats, group", [(16, 4), (8, 2), (12, 3), (7, 1), (1, 1)])
def test_remat_group_minus_one_is_the_divisor_nearest_the_square_root(repeats, group):
    m = H.equivalence_config("tiny-llama", **{"model.remat_group": -1}).model
    assert transformer.remat_group(m, repeats) == group


@pytest.mark.parametrize("over", [{"model.remat_group": 3}, {"model.remat_group": 16, "mesh.pp": 2},
                                  {"model.remat_group": -2}])
def test_a_remat_group_that_does_not_divide_a_stage_chunk_is_refused(over):
    cfg = H.equivalence_config("tiny-llama", **DEEP, **{"mesh.dp": -1, "train.microbatches": 2, **over})
    with pytest.raises(ConfigError, match=r"model.remat_group=-?\d+ does not divide the (16|8) pattern repeats"):
        validate(cfg, 8)
