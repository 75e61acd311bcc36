"""Qwen3, Gemma 2 and Gemma 3, read as features (`model.qk_norm`, `norm_placement`, `mlp = "geglu_tanh"`,
`norm_offset`, `embed_scale`, the soft caps, `query_pre_attn_scalar`, per-layer windows and RoPE, linear RoPE
scaling) on tiny random transformers checkpoints (`hf_families.py`). test_hf_interop.py's import/export test and
test_generate_hf.py's greedy generation run these families with the others; here: the features are active
(soft caps that scores pass), the older config.json forms read alike, a run's first loss is transformers',
bf16 sources round-trip bitwise, a multimodal Gemma 3's text tower is transformers' Gemma3ForCausalLM, and a
Gemma-3-shaped model on dp2×fsdp2×tp2 (ZeRO-3) and on sp=4 (ring) equals one device."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from harness import assert_matches, equivalence_config, loss_and_grads, step_fns, tiers
from jaxllm.config import build_config
from jaxllm.interop import hf
from jaxllm.models import attention, transformer

NEW = ("qwen3", "gemma2", "gemma3")
SEQ = 64
TOKENS = H.sample_tokens(H.VOCAB_SIZE, 2, SEQ, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense_families")
    return {f: H.build(f, str(root / f)) for f in NEW}


def logits_of(cfg, params, m=None) -> np.ndarray:
    m = m or cfg.model
    return np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, m))(params, jnp.asarray(TOKENS)))


def test_gemma2_soft_caps_are_passed_by_its_scores_and_logits(models):
    """Without its final cap some logits pass the cap, and some of the first layer's attention scores pass the
    attention cap: the caps change the numbers the logits tests compare."""
    cfg, params = hf.load_pretrained(models["gemma2"], overrides={"model.seq_len": SEQ})
    m = cfg.model
    assert m.attn_softcap == H.GEMMA2_SOFTCAPS["attn_logit_softcapping"] and m.final_softcap > 0
    assert np.abs(logits_of(cfg, params, dataclasses.replace(m, final_softcap=0.0))).max() > m.final_softcap
    first = jax.tree.map(lambda a: a[0], params["blocks"][0])
    pos = jnp.broadcast_to(jnp.arange(SEQ), TOKENS.shape)
    with jax.default_matmul_precision("float32"):
        x = transformer.embed(params, jnp.asarray(TOKENS), pos, m, jnp.float32)
        h = transformer.norm_of(m, first["ln1"], x)
        q, k, *_ = attention._project(first["attn"], h, pos, m, jnp.float32)
    groups = m.n_heads // attention.kv_heads(m)
    scores = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, groups, axis=2)) * m.query_pre_attn_scalar ** -0.5
    assert float((jnp.abs(scores) > m.attn_softcap).mean()) > 0.01


YARN = {  # an original context of 16 under a 64-token test sequence; the ramp's ends land between dimensions
    "default": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16},
    "mscale_untruncated": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                           "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 0.5,
                           "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
}


@pytest.mark.parametrize("variant", tiers(list(YARN), {"mscale_untruncated"}))
def test_yarn_rope_equals_transformers(variant, tmp_path):
    """YaRN (transformers' `_compute_yarn_parameters`: the ramp, `truncate`, the attention factor from the factor or
    from mscale / mscale_all_dim) on a Qwen3 checkpoint: logits within 1e-4, and export → transformers the same."""
    path = H.build("qwen3", str(tmp_path / "src"), rope_parameters=dict(YARN[variant]))
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    assert cfg.model.rope_scaling == "yarn" and attention.rope_scale(cfg.model) > 1
    ref = H.reference_logits(path, TOKENS)
    assert np.abs(logits_of(cfg, params) - ref).max() <= 1e-4
    hf.save_pretrained(params, cfg, str(tmp_path / "out"))
    assert np.abs(H.reference_logits(str(tmp_path / "out"), TOKENS) - ref).max() <= 1e-4


@pytest.mark.parametrize("family", NEW)
def test_the_older_config_form_reads_alike(family, models, tmp_path):
    """transformers 4.x's config.json (Gemma 3: rope_local_base_freq, rope_scaling and sliding_window_pattern;
    Gemma 2: no layer_types) gives the same model keys, and transformers itself computes the same logits."""
    v4 = H.build(family, str(tmp_path / "v4"), config_form="v4")
    assert "layer_types" not in json.load(open(os.path.join(v4, "config.json")))
    assert hf.config_for(v4, {"model.seq_len": SEQ}).model == hf.config_for(models[family], {"model.seq_len": SEQ}).model
    np.testing.assert_array_equal(H.reference_logits(v4, TOKENS), H.reference_logits(models[family], TOKENS))


@pytest.mark.parametrize("family", tiers(NEW, {"gemma3"}))
def test_bf16_import_export_is_bitwise(family, tmp_path):
    from test_hf_interop import assert_bitwise, file_tensors

    path = H.build(family, str(tmp_path / "src"), dtype="bfloat16")
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    hf.save_pretrained(params, cfg.model, str(tmp_path / "out"), dtype="bfloat16", source=path)  # a model config
    assert_bitwise(file_tensors(path), file_tensors(str(tmp_path / "out")))


RUN_CASES = [(f, "dp8") for f in NEW] + [("gemma3", "one device, the command line")]


@pytest.mark.slow
@pytest.mark.parametrize("family,where", RUN_CASES)
def test_a_run_starts_at_transformers_loss(family, where, models, tmp_path):
    """jaxllm train from the checkpoint, in this process over 8 devices (data parallel, which changes no number:
    test_equivalence.py) and, for Gemma 3, as a user runs it on one device: the first step's loss is
    transformers' on the same batch."""
    import subprocess
    import sys

    from harness import REPO, subprocess_env
    from jaxllm.trainer.loop import train

    over = H.one_step_run(models[family], str(tmp_path / "run"), SEQ)
    if where == "dp8":
        train(build_config(None, over))
    else:
        args = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in over.items()]
        done = subprocess.run([sys.executable, "-m", "jaxllm", "train", *args],
                              cwd=REPO, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    ref = H.first_batch_loss(build_config(None, over))
    assert abs(H.first_logged_loss(over["run.dir"]) - ref) <= 1e-4 * abs(ref)


def multimodal_gemma3(out: str) -> str:
    """A tiny Gemma3ForConditionalGeneration (a one-layer vision tower beside hf_families' Gemma 3 text model),
    perturbed as hf_families perturbs, saved."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return H.build_multimodal("gemma3", out, "Gemma3Config", "Gemma3TextConfig", vision, mm_tokens_per_image=4,
                              image_token_index=300, boi_token_index=298, eoi_token_index=299)


@pytest.mark.slow
def test_a_multimodal_gemma3_gives_its_text_tower(tmp_path):
    """Its text tower's logits are transformers' Gemma3ForCausalLM's on the same weights; exported, it is a
    gemma3_text checkpoint transformers loads with those logits."""
    import torch
    import transformers

    path = multimodal_gemma3(str(tmp_path / "mm"))
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "gemma3"
    full = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                         attn_implementation="eager")
    causal = transformers.Gemma3ForCausalLM(full.config.text_config).eval()
    causal.model.load_state_dict(full.model.language_model.state_dict())
    causal.lm_head.weight = causal.model.embed_tokens.weight
    with torch.no_grad():
        ref = causal(input_ids=torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    assert np.abs(logits_of(cfg, params) - ref).max() <= 1e-4
    hf.save_pretrained(params, cfg, str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["model_type"] == "gemma3_text"
    assert np.abs(H.reference_logits(str(tmp_path / "out"), TOKENS) - ref).max() <= 1e-4


GEMMA3_SHAPED = {"model.family": "gemma3", "model.n_layers": 4, "model.sliding_window": 8,
                 "model.window_pattern": ["local", "local", "global", "local"], "model.rope_theta": 1e6,
                 "model.rope_scaling": "linear", "model.rope_factor": 4.0, "model.rope_local_theta": 1e4,
                 "model.query_pre_attn_scalar": 12.0, "model.attn_softcap": 5.0, "model.final_softcap": 10.0}
MESHES = {"dp2_fsdp2_tp2_zero3": {"mesh.dp": 2, "mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3},
          "sp4_ring": {"mesh.sp": 4, "mesh.dp": 2, "model.cp_strategy": "ring"}}


@pytest.mark.parametrize("mesh", tiers(list(MESHES), {"sp4_ring"}))
def test_a_gemma3_shaped_model_on_meshes_equals_one_device(mesh):
    """Every Gemma 3 feature at once (sandwich norms offset by 1, q/k norms, GeGLU, the scaled embedding, local
    and global layers with their own windows and RoPE, soft caps): one step's loss and gradients on the mesh
    equal one device's (the plain reference has none of these features)."""
    one = equivalence_config("tiny-llama", **GEMMA3_SHAPED)
    params = transformer.init_params(one.model, jax.random.key(0))
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(1), a.shape), params)  # norms off 0
    loss, grads = loss_and_grads(step_fns(one), params)
    got = loss_and_grads(step_fns(equivalence_config("tiny-llama", **GEMMA3_SHAPED, **MESHES[mesh])), params)
    assert_matches(*got, (params, float(loss), grads))
