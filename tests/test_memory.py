"""Memory (`model.remat`, `model.remat_group`, `memory.*`): recomputation in groups of layers and every
policy give the gradients of no recomputation; for 16 layers the compiled temporaries order √L groups <
full < selective < none; the offloading policy marks what it saves for host memory. Host offload of the
optimizer state and the parameters changes no bit on every ZeRO stage it runs, the compiled step takes and
returns them in host memory, and runs resume with offload kept, turned on or turned off."""

from __future__ import annotations

import json
import shutil

import chex
import jax
import pytest

import harness as H
from jaxllm.config import build_config, validate
from jaxllm.errors import ConfigError
from jaxllm.models import transformer
from jaxllm.mesh import make_mesh
from jaxllm.trainer import loop
from jaxllm.trainer.loop import train
from jaxllm.trainer.step import make_step_fns
from jaxllm.plan.hlo import memory_summary

DEEP = {"model.n_layers": 16, "train.global_batch": 8}  # tiny-llama's width, 16 layers


def deep_fns(**over):
    return H.step_fns(H.equivalence_config("tiny-llama", **DEEP, **over))


# (remat, remat_group, pp): groups over full and over no per-layer remat, each policy, groups per stage chunk
CASES = [("full", -1, 1), ("none", 4, 1), ("selective", 0, 1), ("save-named", 2, 1), ("offload-dots", 0, 1),
         ("offload-named", 0, 1), ("full", -1, 2)]


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


def test_the_offloading_policies_send_what_they_save_to_the_host():
    """The traced gradient program puts each saved weight-matmul output in host memory (XLA:CPU then
    compiles the placement away: no memory saving shows here)."""
    def host_values(remat):
        fns = deep_fns(**{"model.remat": remat})
        jaxpr = jax.make_jaxpr(fns.loss_and_grads)(fns.abstract_state.params, fns.abstract_batch(8, H.SEQ))
        return str(jaxpr).count("MemorySpace.Host")

    assert host_values("selective") == host_values("save-named") == 0
    assert host_values("offload-dots") > 0  # the weight matmuls whose outputs the backward pass reads
    assert host_values("offload-named") > 0  # q, k, v, the attention output, the MLP hidden state


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


# ---------------------------------------------------------------- host offload of the train state

OFFLOAD = {"memory.offload_optimizer": True, "memory.offload_params": True}


def memory_kinds(shardings) -> set:
    return {s.memory_kind for s in jax.tree.leaves(shardings)}


@pytest.mark.parametrize("zero, microbatches, lora", H.tiers([(0, 1, 0), (1, 1, 0), (2, 2, 0), (3, 2, 0), (3, 2, 4)],
                                                              fast=[(3, 2, 0)]))
def test_offload_changes_no_bit_and_the_step_keeps_the_state_on_the_host(zero, microbatches, lora):
    """3 steps on dp2 × fsdp2 with the optimizer state and the parameters in host memory and without; and with
    LoRA adapters (rank 4): the frozen base, the adapters and their optimizer state on the host."""
    def run(**over):
        fns = H.step_fns(H.equivalence_config("tiny-llama", **{"mesh.dp": 2, "mesh.fsdp": 2, "train.zero_stage": zero,
                                                               "train.microbatches": microbatches,
                                                               "model.lora.rank": lora, **over}))
        state = fns.init(0)
        for step in range(3):
            state, metrics = H.train_step(fns, state, H.tokens(step))
        return fns, jax.device_get((state.params, state.opt_state, metrics["loss"])), state

    fns, on, state = run(**OFFLOAD)
    _, off, _ = run()
    chex.assert_trees_all_equal(on, off)
    compiled = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(H.BATCH, H.SEQ)).compile()
    state_in, state_out = compiled.input_shardings[0][0], compiled.output_shardings[0]
    for shardings in (state_in.params, state_in.opt_state, state_out.params, state_out.opt_state,
                      state.params, state.opt_state):
        assert memory_kinds(jax.tree.map(lambda a: getattr(a, "sharding", a), shardings)) == {"pinned_host"}
    assert memory_kinds(state_in.step) == {"device"}
    jaxpr = str(jax.make_jaxpr(fns.train_step)(fns.abstract_state, fns.abstract_batch(H.BATCH, H.SEQ)))
    assert jaxpr.count("device_put[") == 2  # the parameters and the optimizer state come to the device to be used


def offload_run(run_dir, steps: int, resume: bool = False, **over):
    train(build_config(None, {"model.preset": "tiny-llama", "data.source": H.CORPUS, "train.global_batch": 8,
                              "mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 3, "train.steps": steps,
                              "train.log_every": 1, "train.checkpoint_every": 2, "train.keep_checkpoints": 5,
                              "train.eval_every": 2,
                              "run.sample_tokens": 8, "run.progress": False, "run.dir": str(run_dir),
                              "train.resume": resume, **over}))
    return [H.unmeasured(json.loads(line)) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_runs_resume_with_offload_kept_turned_on_or_turned_off(tmp_path):
    """4 steps with offload and without (checkpoints at 2 and 4): the same rows, bit for bit; each resumed
    from its step 2 with offload turned off or turned on repeats them. A resumed offloaded state is in host
    memory."""
    ref = offload_run(tmp_path / "on", 4, **OFFLOAD)
    assert offload_run(tmp_path / "off", 4) == ref
    for name, source, then in (("turned_off", "on", {}), ("turned_on", "off", OFFLOAD)):
        shutil.copytree(tmp_path / source, tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "4")
        assert offload_run(tmp_path / name, 4, resume=True, **then) == ref, name
    cfg = build_config(str(tmp_path / "on" / "config.toml"), {"train.resume": True, "train.steps": 6})
    _, shape, _ = loop.resolve(cfg)
    state, start, _ = loop._restore(cfg, make_step_fns(cfg, make_mesh(shape, cfg)))
    assert start == 4 and memory_kinds([a.sharding for a in jax.tree.leaves((state.params, state.opt_state))]) == \
        {"pinned_host"}


@pytest.mark.parametrize("over, what", [({"mesh.pp": 2, "mesh.dp": 4, "train.microbatches": 2}, "mesh.pp > 1"),
                                        ({"train.microbatches": 2, "train.zero_stage": 1},
                                         "train.microbatches > 1 at ZeRO-0/1 .the accumulation island."),
                                        ({"train.allreduce": "ring"},
                                         "train.allreduce=ring at ZeRO-0/1 .the accumulation island.")])
def test_offload_where_it_is_not_checked_yet_is_refused_in_one_line(over, what):
    cfg = H.equivalence_config("tiny-llama", **{"mesh.dp": -1, **OFFLOAD, **over})
    with pytest.raises(ConfigError, match=f"memory.offload_optimizer / memory.offload_params with {what}"):
        validate(cfg, 8)


@pytest.mark.slow
def test_the_planner_counts_the_offloaded_state_and_shows_the_remat_group():
    """jaxllm plan: host bytes per device = the parameters' and optimizer state's shards (fp32: Φ·4 over fsdp
    for each of params, mu, nu at ZeRO-3), none without offload; the resolved group of the stage chunk, and
    beside the step's temporaries those of the same step without groups (as planning that config reports)."""
    from jaxllm.plan import format_table, plan

    over = {"mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 3, **DEEP, "model.remat": "full", "model.remat_group": -1}
    on = plan(H.equivalence_config("tiny-llama", **over, **OFFLOAD))
    off = plan(H.equivalence_config("tiny-llama", **over))
    params = on["params"]
    assert off["memory"]["host_bytes"] == 0
    assert 3 * params * 4 / 4 <= on["memory"]["host_bytes"] <= 3 * params * 4 / 4 + 1024  # + Adam's counters
    ungrouped = plan(H.equivalence_config("tiny-llama", **{**over, **OFFLOAD, "model.remat_group": 0}))
    assert on["remat"] == {"remat": "full", "group": 4, "repeats": 16, "temp_bytes": on["memory"]["temp_bytes"],
                           "temp_bytes_without_group": ungrouped["memory"]["temp_bytes"]}
    assert "temp_bytes_without_group" not in ungrouped["remat"]
    assert "groups of 4 of 16 repeats per stage chunk" in format_table(on) and "host memory" in format_table(on)
    assert "without groups" in format_table(on)
