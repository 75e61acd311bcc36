"""Gated DeltaNet layers in the stack (`model.pattern` kinds `linear` / `linear_moe`, `model.linear_attn`):
generation with the fixed-size state equals the model without a cache, meshes equal one device, the train
step's memory grows linearly in t, and what is not built yet is refused in one line.

The layer itself against transformers is in test_gated_deltanet.py, the recurrence in test_gated_delta.py and
the whole Qwen3-Next model in test_qwen3_next.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import equivalence_config, loss_and_grads, lower_loss_and_grads, max_rel_err, step_fns, tiers
from jaxllm.config import validate
from jaxllm.errors import ConfigError
from jaxllm.generate import generate_arrays
from jaxllm.generate.cache import cache_bytes, init_cache
from jaxllm.models import gated_deltanet, transformer
from jaxllm.models.attention import head_dim, kv_heads
from test_generate import MIN_MARGIN, NEW, PROMPTS, margins, uncached_greedy

HYBRID = {"model.pattern": ["linear", "linear", "linear", "dense"], "model.n_layers": 4,
          "model.linear_attn.num_k_heads": 2, "model.linear_attn.num_v_heads": 4,
          "model.linear_attn.head_k_dim": 8, "model.linear_attn.head_v_dim": 8, "model.linear_attn.chunk": 16}


def config(**over):
    return equivalence_config("tiny-llama", **{**HYBRID, **over})


def params_of(m):
    """Fresh parameters with slow decays: A_log near −3 (a token's state kept at ~e^−0.05, not transformers'
    initial e^−1.3 to e^−20), so the state carries across a whole sequence, a rank's share of it, and a
    decode: what these tests check."""
    params = transformer.init_params(m, jax.random.key(0))
    for i, block in enumerate(params["blocks"]):
        if "linear_attn" in block:
            a_log = block["linear_attn"]["A_log"]
            block["linear_attn"]["A_log"] = -3.0 + 0.5 * jax.random.normal(jax.random.key(i), a_log.shape)
    return params


@pytest.mark.slow  # the fast tier decodes the recurrence alone (test_gated_delta.py)
def test_generation_with_the_state_equals_the_model_without_a_cache():
    """Left-padded prompts (0, 5 and 9 pad tokens; the last prompt shorter than the convolution's window), 32
    greedy tokens: tokens equal, logits within 1e-5 of each prompt alone through the training forward pass; the
    linear layers' state does not grow with the slots."""
    cfg = config(**{"model.init_std": 0.07, "model.seq_len": 64})  # logits ~2 apart: no near-ties
    params = params_of(cfg.model)
    prompts = PROMPTS + [[7, 8]]
    got = generate_arrays(params, cfg, prompts, NEW, temperature=0.0, keep_logits=True)
    want_tokens, want_logits = uncached_greedy(params, cfg.model, prompts, NEW)
    assert margins(want_logits).min() > MIN_MARGIN
    np.testing.assert_array_equal(got["tokens"], want_tokens)
    np.testing.assert_allclose(got["logits"], want_logits, rtol=0, atol=1e-5)
    m, s = cfg.model, gated_deltanet.sizes_of(cfg.model)
    linear = [c for c in init_cache(m, 2, 64, jnp.float32, None) if "state" in c]
    assert len(linear) == 3 and linear[0]["state"].shape == (1, 2, s.num_v_heads, s.head_k_dim, s.head_v_dim)
    attention_bytes = lambda slots: 2 * 2 * slots * kv_heads(m) * head_dim(m) * 4  # noqa: E731 — k, v of 1 layer
    for slots in (64, 4096):
        assert cache_bytes(m, 2, slots, jnp.float32, None) == (3 * gated_deltanet.state_bytes(s, 2, jnp.float32)
                                                               + attention_bytes(slots))


QWEN3_NEXT_STACK = {"model.pattern": ["linear_moe", "moe"], "model.n_layers": 4, "model.moe.n_experts": 4,
                    "model.moe.top_k": 2, "model.moe.d_ff": 32, "model.moe.n_shared_experts": 1,
                    "model.moe.shared_d_ff": 48, "model.moe.shared_gate": True, "model.moe.capacity_factor": 0.0}
MESHES = {  # Qwen3-Next's stack: Gated DeltaNet and attention layers, MoE with a gated shared expert
    "sp4": {**QWEN3_NEXT_STACK, "mesh.sp": 4, "model.cp_load_balance": False},
    "sp2_tp2_dp2": {**QWEN3_NEXT_STACK, "mesh.sp": 2, "mesh.tp": 2, "mesh.dp": 2, "train.sequence_parallel": True,
                    "model.cp_load_balance": False},
    # no balance loss under pp: summed per microbatch it is not one device's (test_llama4's pp × ep likewise)
    "pp2_ep2_dp2": {**QWEN3_NEXT_STACK, "model.moe.balance_weight": 0.0, "mesh.pp": 2, "mesh.ep": 2, "mesh.dp": 2,
                    "train.microbatches": 2},
}  # fsdp × tp (ZeRO-3) runs Qwen3-Next's first loss in test_qwen3_next.py, the sp island alone its own file


@pytest.mark.parametrize("mesh", tiers(MESHES, set()))  # the fast tier: the refusals
def test_a_mesh_equals_one_device(mesh):
    """One step's loss (1e-5) and every gradient leaf (1e-4, the equivalence contract) on the mesh equal one
    device's: the key-head groups split over tp, the stack over pipeline stages."""
    one = config(**{k: v for k, v in MESHES[mesh].items() if k.startswith("model.")})
    params = params_of(one.model)
    ref_loss, ref_grads = loss_and_grads(step_fns(one), params)
    loss, grads = loss_and_grads(step_fns(config(**MESHES[mesh])), params)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert max_rel_err(jax.device_get(grads), jax.device_get(ref_grads)) <= 1e-4


@pytest.mark.slow
def test_train_step_memory_is_linear_in_the_sequence():
    """A linear-only model's compiled loss-and-gradients temporaries grow at most 2.2× per doubling of t from
    2,048 to 8,192 (softmax attention's dense scores would grow 4×)."""
    temps = []
    for t in (2048, 4096, 8192):
        cfg = equivalence_config("tiny-llama", **{**HYBRID, "model.pattern": ["linear"], "model.n_layers": 2,
                                                  "model.seq_len": t, "train.global_batch": 1,
                                                  "model.linear_attn.chunk": 64})
        lowered = lower_loss_and_grads(step_fns(cfg), batch=1, seq=t)
        temps.append(lowered.compile().memory_analysis().temp_size_in_bytes)
    growth = [b / a for a, b in zip(temps, temps[1:])]
    assert max(growth) <= 2.2, (temps, growth)


@pytest.mark.parametrize("over,devices,words", [
    ({"mesh.sp": 2}, 2, "set model.cp_load_balance=false"),
    ({"mesh.tp": 4}, 4, "num_k_heads=2 is not divisible by mesh.tp=4"),
    ({"model.linear_attn.num_v_heads": 3}, 1, "num_v_heads=3 is not a multiple"),
    ({"model.pattern": ["dense", "linear"], "model.mtp_depth": 1}, 1, "end the pattern with an attention block"),
])
def test_what_is_not_built_is_refused_in_one_line(over, devices, words):
    with pytest.raises(ConfigError, match=words):
        validate(config(**over), devices)


@pytest.mark.slow
def test_model_flops_count_the_recurrence_the_step_computes():
    """A linear-only model's compiled step's matmul FLOPs (loops by their trip counts) within 5% of the model
    FLOPs MFU divides by: 6N plus the chunked recurrence (`gated_deltanet.recurrence_flops_per_token`, here most
    of the step), no softmax attention term."""
    from jaxllm.plan.flops import flops_report

    cfg = equivalence_config("tiny-llama", **{**HYBRID, "model.pattern": ["linear"], "model.n_layers": 2,
                                              "model.seq_len": 1024, "train.global_batch": 1,
                                              "model.linear_attn.num_k_heads": 4, "model.linear_attn.num_v_heads": 8,
                                              "model.linear_attn.head_k_dim": 64, "model.linear_attn.head_v_dim": 64,
                                              "model.linear_attn.chunk": 64})
    fns = step_fns(cfg, devices=1)
    compiled = fns.train_step.lower(fns.abstract_state, fns.abstract_batch(1, 1024)).compile()
    report = flops_report(cfg, compiled.as_text(), 1)
    assert report["unknown_trip_loops"] == 0 and report["model_full_attention"] == report["model"]
    assert abs(report["compiled"] / report["model"] - 1) <= 0.05, report


def test_the_paged_engine_refuses_linear_layers_in_one_line():
    from jaxllm.generate.engine import Engine

    cfg = config()
    with pytest.raises(ConfigError, match="use rl.sampler=static"):
        Engine(params_of(cfg.model), cfg)
