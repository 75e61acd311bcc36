"""Hugging Face checkpoints in and out, tested against transformers itself on tiny random models of every
family (`hf_families.py`): imported logits equal transformers' fp32 logits, exports load back in
transformers with the same logits, import -> export is bitwise, sharded sources and sharded meshes load
the same parameters, and a run started from a checkpoint takes its first step at transformers' loss."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from harness import assert_matches, equivalence_config, loss_and_grads, reference, step_fns, tiers
from jaxllm.config import build_config
from jaxllm.interop import hf
from jaxllm.models import attention, transformer

SEQ = 64
TOKENS = H.sample_tokens(H.VOCAB_SIZE, 2, SEQ, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> a float32 checkpoint directory, built once."""
    root = tmp_path_factory.mktemp("hf")
    return {f: H.build(f, str(root / f)) for f in H.FAMILIES}


def our_logits(path: str) -> np.ndarray:
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    return np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(TOKENS)))


def file_tensors(path: str) -> dict:
    """key -> (dtype, bits) of every parameter tensor in a model directory."""
    files, out = hf.Files(path), {}
    for key in files.where:
        if not hf.IGNORED.search(key):
            value = files.handle(key, "flax").get_tensor(key)
            out[key] = (str(value.dtype), np.asarray(value).view(np.uint16 if value.dtype.itemsize == 2 else np.uint32))
    return out


def assert_bitwise(a: dict, b: dict):
    chex.assert_trees_all_equal(a, b)  # the same names; per name the same dtype name and the same bits


# gpt-oss, Llama 4 and Qwen3-Next in the slow tier (their features' fast tests: test_attention_sinks.py,
# test_llama4_attention.py, test_gated_*.py)
@pytest.mark.parametrize("family", tiers(H.FAMILIES, set(H.FAMILIES) - {"gpt_oss", "llama4", "qwen3_next"}))
def test_import_equals_transformers_and_export_round_trips(family, models, tmp_path):
    path = models[family]
    ref = H.reference_logits(path, TOKENS)
    assert np.abs(our_logits(path) - ref).max() <= 1e-4
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    hf.save_pretrained(params, cfg, str(tmp_path / "out"), source=path)  # the Config load_pretrained returned
    assert_bitwise(file_tensors(path), file_tensors(str(tmp_path / "out")))
    assert np.abs(H.reference_logits(str(tmp_path / "out"), TOKENS) - ref).max() <= 1e-4


@pytest.mark.parametrize("family", ["gpt2", "llama3.1", "qwen2", "mixtral"])
def test_bf16_import_export_is_bitwise(family, tmp_path):
    path = H.build(family, str(tmp_path / "src"), dtype="bfloat16")
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": SEQ})
    assert hf.source_dtype(path) == "bfloat16"
    hf.save_pretrained(params, cfg.model, str(tmp_path / "out"), dtype="bfloat16", source=path)
    assert_bitwise(file_tensors(path), file_tensors(str(tmp_path / "out")))


def test_older_config_form_reads_the_same(models, tmp_path):
    v4 = H.build("llama3.1", str(tmp_path / "v4"), config_form="v4")
    assert "rope_scaling" in json.load(open(os.path.join(v4, "config.json")))
    assert hf.config_for(v4, {"model.seq_len": SEQ}).model == hf.config_for(models["llama3.1"],
                                                                            {"model.seq_len": SEQ}).model


def test_llama3_frequencies_equal_transformers(models):
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = AutoConfig.from_pretrained(models["llama3.1"])
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
    ours = np.asarray(attention.rope_frequencies(hf.config_for(models["llama3.1"]).model))
    assert np.abs(ours - inv_freq.numpy()).max() <= 1e-7
    plain = np.asarray(attention.frequencies(16, 5e5))
    assert (ours < plain).any() and (ours == plain).any()  # scaled and kept bands both present


def test_sharded_source_loads_like_the_single_file(models, tmp_path):
    sharded = H.build("llama3", str(tmp_path / "sharded"), max_shard_size=H.SHARD_SIZE_FOR_5)
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) >= 5
    assert os.path.isfile(os.path.join(sharded, hf.INDEX))
    _, a = hf.load_pretrained(models["llama3"])
    _, b = hf.load_pretrained(sharded)
    chex.assert_trees_all_equal(a, b)


def test_gpt2_files_without_the_transformer_prefix_load_alike(models, tmp_path):
    """GPT-2 as first published names its tensors `h.0.attn.c_attn.weight`, ... (no `transformer.`) and
    has no lm_head: the same tensors under those names load bitwise like transformers' own files."""
    import shutil

    from safetensors.numpy import load_file, save_file

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(models["gpt2"], "config.json"), bare)
    tensors = load_file(os.path.join(models["gpt2"], hf.SINGLE))
    assert any(k.startswith("transformer.") for k in tensors)
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items() if not k.startswith("lm_head.")},
              str(bare / hf.SINGLE))
    _, a = hf.load_pretrained(models["gpt2"])
    _, b = hf.load_pretrained(str(bare))
    chex.assert_trees_all_equal(a, b)


def test_export_writes_shards_with_an_index(models, tmp_path):
    cfg, params = hf.load_pretrained(models["mixtral"])
    out = str(tmp_path / "out")
    hf.save_pretrained(params, cfg.model, out, max_shard_size="40KB", source=models["mixtral"])
    index = json.load(open(os.path.join(out, hf.INDEX)))
    assert len(set(index["weight_map"].values())) >= 5
    assert_bitwise(file_tensors(models["mixtral"]), file_tensors(out))


@pytest.mark.parametrize("family", ["gpt2", "llama3.2", "mixtral"])
def test_loading_onto_fsdp4_tp2_equals_one_device(family, models):
    cfg = hf.config_for(models[family], {"model.seq_len": SEQ, "mesh.fsdp": 4, "mesh.tp": 2, "mesh.dp": 1,
                                         "train.zero_stage": 3, "train.global_batch": 8,
                                         "precision.compute": "float32"})
    fns = step_fns(cfg)
    sharded = hf.load_params(models[family], cfg.model, fns.state_shardings.params)
    _, single = hf.load_pretrained(models[family])
    split = [x for x in jax.tree.leaves(sharded) if len(x.sharding.device_set) > 1 and not x.is_fully_replicated]
    assert len(split) > len(jax.tree.leaves(sharded)) // 2  # most leaves really are read in blocks
    chex.assert_trees_all_equal(sharded, single)


def test_free_head_dim_imports_and_reaches_the_plan(tmp_path):
    path = H.build("llama3", str(tmp_path / "hd"), head_dim=24)
    assert np.abs(our_logits(path) - H.reference_logits(path, TOKENS)).max() <= 1e-4
    cfg = hf.config_for(path, {"model.seq_len": SEQ})
    assert attention.head_dim(cfg.model) == 24 != cfg.model.d_model // cfg.model.n_heads
    shapes = transformer.param_shapes(cfg.model)
    chex.assert_shape(shapes["blocks"][0]["attn"]["wq"], (2, 64, 4, 24))
    from jaxllm.plan.attention import attention_memory_theory

    one_device = {a: 1 for a in ("pp", "dp", "fsdp", "ep", "sp", "tp")}
    assert attention_memory_theory(cfg.model, cfg.train, one_device, "float32")["head_dim"] == 24
    with pytest.raises(Exception, match=r"RoPE.s dimensions \(23\) must be even"):
        from jaxllm.config import validate

        validate(build_config(None, {"model.family": "llama", "model.head_dim": 23, "model.vocab_size": 301}), 1)


def test_family_shorthand_fills_features_and_explicit_keys_win():
    m = build_config(None, {"model.family": "qwen2"}).model
    assert (m.norm, m.mlp, m.positions, m.attn_bias, m.tie_embeddings) == ("rmsnorm", "swiglu", "rope", "qkv", False)
    m = build_config(None, {"model.family": "llama", "model.tie_embeddings": True, "model.attn_bias": "qkvo"}).model
    assert m.tie_embeddings and m.attn_bias == "qkvo" and m.norm == "rmsnorm"
    assert "head" not in transformer.param_shapes(m) and "bo" in transformer.param_shapes(m)["blocks"][0]["attn"]


@pytest.mark.slow
def test_a_run_from_a_checkpoint_starts_at_transformers_loss_and_exports(models, tmp_path):
    """jaxllm train's loop with init.from=hf:DIR on dp2×fsdp2×tp2, ZeRO-3: the first step's loss is
    transformers' loss on the same batch; jaxllm hf export of the run loads in transformers with our logits;
    a run from that run's step 2 (init.from=run:DIR@2, fsdp=8) starts at transformers' loss of the export."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.data.loader import window_starts
    import jaxllm
    from jaxllm.trainer.loop import prepare, train

    path, run_dir = models["qwen2"], str(tmp_path / "run")
    over = {"init.from": f"hf:{path}", "model.seq_len": SEQ, "mesh.dp": 2, "mesh.fsdp": 2, "mesh.tp": 2,
            "train.zero_stage": 3, "train.global_batch": 8, "train.steps": 2, "train.eval_every": 0,
            "train.checkpoint_every": 2, "precision.compute": "float32", "run.dir": run_dir, "run.sample_tokens": 0,
            "run.progress": False, "data.source": "stdlib"}
    train(build_config(None, over))
    cfg = build_config(None, over)
    corpus = prepare(cfg)[3].corpus
    starts = window_starts(len(corpus.train), cfg.train.seed, 0, 8, SEQ)  # step 0's batch
    windows = np.stack([np.asarray(corpus.train[s:s + SEQ + 1], np.int64) for s in starts])
    first = json.loads(open(os.path.join(run_dir, "metrics.jsonl")).readline())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # labels shift inside: the loss of each window's SEQ next-token predictions
        ref = float(model(input_ids=torch.as_tensor(windows), labels=torch.as_tensor(windows)).loss)
    assert abs(first["loss"] - ref) <= 1e-4 * abs(ref)

    jaxllm.load(run_dir).export(str(tmp_path / "out"))
    out = str(tmp_path / "out")
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "qwen2"
    assert np.abs(our_logits(out) - H.reference_logits(out, TOKENS)).max() <= 1e-4
    assert not os.path.isfile(os.path.join(out, "tokenizer.json"))  # the run used the byte tokenizer

    # init.from = "run:DIR@2" on another mesh (fsdp=8): a new run's first loss is transformers' loss of the
    # step-2 parameters (the export above) on the same first batch
    again = {**over, "init.from": f"run:{run_dir}@2", "run.dir": str(tmp_path / "again"), "train.steps": 1,
             "train.checkpoint_every": 0, "mesh.dp": 1, "mesh.fsdp": 8, "mesh.tp": 1}
    train(build_config(None, again))
    first = json.loads(open(tmp_path / "again" / "metrics.jsonl").readline())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ref = float(model(input_ids=torch.as_tensor(windows), labels=torch.as_tensor(windows)).loss)
    assert abs(first["loss"] - ref) <= 1e-4 * abs(ref)


@pytest.mark.slow
def test_two_process_export_equals_one_process(models, tmp_path):
    """jaxllm hf import, then export from one process and from 2 processes × 4 devices over jax.distributed
    (fsdp=8, ZeRO-3: every tensor is gathered across the processes): the same files, bitwise."""
    import jaxllm
    from test_multiprocess import Procs, _free_port

    run_dir = str(tmp_path / "run")
    jaxllm.import_hf(models["mixtral"], run_dir, ["model.seq_len=64", "mesh.fsdp=8", "mesh.dp=1",
                                                  "train.zero_stage=3", "train.global_batch=8"])
    jaxllm.load(run_dir).export(str(tmp_path / "one"), max_shard_size="40KB")
    procs, address = Procs(tmp_path), f"127.0.0.1:{_free_port()}"
    for pid in (0, 1):
        procs.start(f"export{pid}", ["-m", "jaxllm", "hf", "export", run_dir, str(tmp_path / "two"),
                                     "--max-shard-size", "40KB", f"distributed.coordinator_address={address}",
                                     "distributed.num_processes=2", f"distributed.process_id={pid}"], n_devices=4)
    procs.wait()
    assert sorted(os.listdir(tmp_path / "one")) == sorted(os.listdir(tmp_path / "two"))
    assert_bitwise(file_tensors(str(tmp_path / "one")), file_tensors(str(tmp_path / "two")))


FREE_HEAD_DIM_MESHES = {  # head_dim 24 with d_model 64 and 8 heads: projections wider than the residual
    "one": {},
    "ulysses_sp2_tp2": {"mesh.sp": 2, "mesh.tp": 2, "mesh.dp": 2, "model.cp_strategy": "ulysses"},
    "collective_matmul_tp4": {"mesh.tp": 4, "mesh.dp": 2, "train.sequence_parallel": True,
                              "model.collective_matmul": True},
}


@pytest.mark.parametrize("mesh", [m if m == "one" else pytest.param(m, marks=pytest.mark.slow)
                                  for m in FREE_HEAD_DIM_MESHES])
def test_free_head_dim_on_meshes_equals_the_reference(mesh):
    """A model whose head_dim is not d_model / n_heads: loss and gradients on Ulysses and collective-matmul
    meshes equal the plain reference's (tools/reference/plain_llama.py with the same head_dim)."""
    cfg = equivalence_config("tiny-llama", **{"model.head_dim": 24, **FREE_HEAD_DIM_MESHES[mesh]})
    ref = reference(cfg.model)
    chex.assert_shape(ref[0]["blocks"][0]["attn"]["wq"], (2, 64, 8, 24))
    loss, grads = loss_and_grads(step_fns(cfg), ref[0])
    assert_matches(loss, grads, ref)
