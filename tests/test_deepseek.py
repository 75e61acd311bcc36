"""DeepSeek-V3 on tiny random transformers checkpoints (`hf_families.py`: latent attention with query compression,
RoPE interleaved, 8 routed experts in 4 groups, a shared expert, a dense first layer, random routing biases) and
latent attention on its own. test_hf_interop.py's import/export test (logits within 1e-4, export bitwise) and
test_generate_hf.py's greedy generation run the family with the others (YaRN off); here: the config.json reads as
latent attention, segments and DeepSeek's routing; YaRN with `mscale_all_dim`; a run's first loss is transformers';
the latent cache decodes what the whole-sequence forward computes and holds kv_lora_rank + qk_rope_head_dim values
per token per layer; a quantized checkpoint is refused in one line; the DeepSeek-shaped model (with a multi-token
prediction module) on meshes, and latent attention under context parallelism, equal one device; prediction layers
are written and read under DeepSeek-V3's names."""

from __future__ import annotations

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from harness import assert_matches, equivalence_config, loss_and_grads, step_fns
from jaxllm import stack
from jaxllm.config import build_config
from jaxllm.errors import ModelFileError
from jaxllm.generate import cache
from jaxllm.generate.decode import generate_arrays
from jaxllm.interop import hf
from jaxllm.models import attention, transformer

SEQ = 64
TOKENS = H.sample_tokens(H.VOCAB_SIZE, 2, SEQ, 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return H.build("deepseek_v3", str(tmp_path_factory.mktemp("deepseek") / "v3"))


def test_the_config_reads_as_latent_attention_segments_and_routing(model):
    m = hf.config_for(model).model
    assert (m.attention, m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim,
            m.mla.v_head_dim) == ("mla", 32, 24, 16, 8, 12)
    assert stack.layer_kinds(m) == ["dense", "moe", "moe"]
    e = m.moe
    assert (e.score, e.n_group, e.topk_group, e.routed_scale, e.router_bias, e.n_experts, e.top_k) == (
        "sigmoid", 4, 2, 2.5, True, 8, 2)
    assert (transformer.shared_d_ff(m), e.d_ff, e.shared_gate) == (32, 32, False)
    _, params = hf.load_pretrained(model)
    bias = np.asarray(params["blocks"][1]["moe"]["router_bias"])  # the routing buffers, read into the parameters
    chex.assert_shape(bias, (2, 8))
    assert np.abs(bias).min() > 0


def test_yarn_with_mscale_all_dim_equals_transformers(tmp_path):
    path = H.build("deepseek_v3", str(tmp_path / "yarn"), rope_parameters=dict(H.DEEPSEEK_YARN))
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    m = cfg.model
    assert (m.rope_scaling, m.rope_mscale_all_dim) == ("yarn", 0.6) and attention.softmax_scale(m) != 24 ** -0.5
    ours = np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, m))(params, jnp.asarray(TOKENS)))
    assert np.abs(ours - H.reference_logits(path, TOKENS)).max() <= 1e-4
    hf.save_pretrained(params, cfg, str(tmp_path / "out"))
    assert np.abs(H.reference_logits(str(tmp_path / "out"), TOKENS) - ours).max() <= 1e-4


def test_the_latent_cache_decodes_what_the_forward_computes(model):
    """Greedy generation over the latent cache (absorbed up-projections) against the whole sequence through the
    training forward (per-head keys and values): every step's logits within 1e-5 (fp32), so the tokens equal."""
    cfg, params = hf.load_pretrained(model, overrides={"precision.compute": "float32", "model.seq_len": SEQ})
    prompts = [TOKENS[0, :13].tolist(), TOKENS[1, :5].tolist()]
    out = generate_arrays(params, cfg, prompts, 24, temperature=0.0, keep_logits=True)
    for row, prompt in enumerate(prompts):
        sequence = jnp.asarray([prompt + out["tokens"][row].tolist()])
        full = np.asarray(transformer.logits(params, sequence, cfg.model))[0, len(prompt) - 1:-1]
        diff = np.abs(out["logits"][row][:, :cfg.model.vocab_size] - full).max()
        assert diff <= 1e-5, f"row {row}: cached decode off the forward by {diff:.3g}"


def test_the_latent_cache_holds_the_latent_per_token_per_layer(model):
    """The cache generation builds holds layers × rows × slots × (kv_lora_rank + qk_rope_head_dim) × 4 bytes (fp32),
    what `cache_bytes` (the plan's) says; a per-head cache of the same model would hold 2 × heads × head widths."""
    m = hf.config_for(model).model
    rows, slots = 3, 40
    built = jax.jit(lambda: cache.init_cache(m, rows, slots, jnp.float32, None))()
    per_token = (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * 4
    assert sum(a.nbytes for a in jax.tree.leaves(built)) == m.n_layers * rows * slots * per_token
    assert cache.cache_bytes(m, rows, slots, jnp.float32, None) == m.n_layers * rows * slots * per_token
    assert [set(block) for block in built] == [{"k"}, {"k"}]  # no per-head keys or values
    assert cache.per_token(m) == (32, "kv_lora_rank + qk_rope_head_dim = 24 + 8")  # what jaxllm plan prints


@pytest.mark.slow
def test_a_run_from_the_checkpoint_starts_at_transformers_loss(model, tmp_path):
    """jaxllm train from the checkpoint on dp8 (its routing bias fixed, no balance losses: what transformers
    computes): the first step's logged loss is transformers' language-model loss on the same batch."""
    from jaxllm.trainer.loop import train

    over = H.one_step_run(model, str(tmp_path / "run"), SEQ)
    train(build_config(None, over))
    ref = H.first_batch_loss(build_config(None, over))
    assert abs(H.first_logged_loss(over["run.dir"]) - ref) <= 1e-4 * abs(ref)


# The DeepSeek-shaped model (latent attention with query compression, a dense layer then two MoE layers with
# DeepSeek's routing, a shared expert and a routing bias moved by its load, a multi-token prediction module whose
# block is an MoE layer too) on meshes against one device; with pp the module runs on the last stage. Balanced by the
# bias alone, as DeepSeek-V3 (the Switch loss is not linear in per-microbatch statistics: the pipeline splits them).
DEEPSEEK = {"model.attention": "mla", "model.mla.q_lora_rank": 16, "model.mla.kv_lora_rank": 24,
            "model.mla.qk_nope_head_dim": 8, "model.mla.qk_rope_head_dim": 4, "model.mla.v_head_dim": 10,
            "model.n_layers": 3, "model.segments": [{"layers": 1, "pattern": ["dense"]},
                                                    {"layers": 2, "pattern": ["moe"]}],
            "model.moe.score": "sigmoid", "model.moe.n_group": 4, "model.moe.topk_group": 2,
            "model.moe.routed_scale": 2.5, "model.moe.n_shared_experts": 1, "model.moe.bias_update_rate": 0.001,
            "model.moe.capacity_factor": 0.0, "model.moe.balance_weight": 0.0, "model.mtp_depth": 1}
MESHES = {"ep4_fsdp2_zero3": {"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 3},
          "dp2_tp2_ep2": {"mesh.dp": 2, "mesh.tp": 2, "mesh.ep": 2},
          "pp2_dp4": {"mesh.pp": 2, "mesh.dp": 4, "train.zero_stage": 2, "train.microbatches": 2}}


def assert_mesh_equals_one_device(preset: str, model_keys: dict, mesh_keys: dict) -> None:
    """Loss and gradients of `preset` with `model_keys` on the mesh `mesh_keys` names equal one device's."""
    one = step_fns(equivalence_config(preset, **model_keys))
    params = jax.device_get(one.init(0).params)
    loss, grads = loss_and_grads(one, params)
    mesh = step_fns(equivalence_config(preset, **model_keys, **mesh_keys))
    assert_matches(*loss_and_grads(mesh, params), (params, float(loss), jax.device_get(grads)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_the_deepseek_shaped_model_on_a_mesh_equals_one_device(mesh):
    assert_mesh_equals_one_device("tiny-moe", DEEPSEEK, MESHES[mesh])


@pytest.mark.slow
def test_latent_attention_with_context_parallelism_equals_one_device():
    """A dense stack of latent attention (values narrower than keys) and a prediction module, with the sequence
    over sp=2 (ring attention, zig-zag order) and tp=2: the islands take MLA's per-head keys and values as MHA's."""
    keys = {k: v for k, v in DEEPSEEK.items() if k.startswith(("model.mla.", "model.attention", "model.mtp"))}
    assert_mesh_equals_one_device("tiny-llama", keys, {"mesh.sp": 2, "mesh.tp": 2, "mesh.dp": 2})


@pytest.mark.slow
def test_prediction_layers_are_written_and_read_under_deepseeks_names(model, tmp_path):
    """A model with a multi-token prediction module exports it as layer n_layers (its norms, projection, block and
    final norm, with copies of the embedding and head, as DeepSeek-V3's files hold them), transformers loads the
    export to the same logits (it does not run that layer), and the export imports back bitwise, module included."""
    cfg, params = hf.load_pretrained(model, overrides={"model.seq_len": SEQ})
    with_mtp = build_config(None, {**{f"model.{k}": v for k, v in hf.hf_config.model_keys(
        hf.hf_config.read(model)).items()}, "model.mtp_depth": 1, "model.seq_len": SEQ, "model.vocab_size": 301})
    table = jax.jit(lambda k: transformer.init_params(with_mtp.model, k))(jax.random.key(1))
    params = {**params, "mtp": table["mtp"]}
    out = str(tmp_path / "out")
    hf.save_pretrained(params, with_mtp, out)
    names = hf.Files(out).where
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.mlp.gate.e_score_correction_bias"} <= set(names)
    ours = np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(TOKENS)))
    assert np.abs(H.reference_logits(out, TOKENS) - ours).max() <= 1e-4
    back_cfg, back = hf.load_pretrained(out)
    assert back_cfg.model.mtp_depth == 1
    chex.assert_trees_all_equal(back, params)
