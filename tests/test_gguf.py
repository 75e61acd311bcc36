"""GGUF in (`init.from = "gguf:FILE"`, `jaxllm/interop/gguf_io.py`).

- A tiny random LLaMA, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 2 (norms stored as 1 + w, soft caps,
  windows; the query scale the file leaves out as llama.cpp sets it), Qwen2-MoE (a shared expert and its gate, a
  dense layer) and Qwen3-MoE (top-k weights normalised, a dense layer) written here as llama.cpp's converter writes
  them (the `gguf` package's writer, llama.cpp's names, LLaMA's q and k rows permuted, F32) import with
  the model jaxllm imports from the transformers directory (logits within 1e-6) and transformers' logits (1e-4, as
  every import is held to): the metadata makes the config, the permutation is undone.
- Bad input is one line: an architecture jaxllm lacks (named), a tokenizer kind not read, a file that is not GGUF,
  one cut short, a tensor type the gguf package cannot dequantize (named).
- GGUF out: a tiny LLaMA as F32 (transformers' GGUF loader gives jaxllm's logits; read back bitwise) and Q8_0.
- The real models: tests/test_smollm2.py and tests/test_gemma3_270m.py.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_families as H
from harness import step_fns, tiers
from jaxllm.config import build_config
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.errors import DataError, ModelFileError
from jaxllm.interop import export, gguf_io, hf
from jaxllm.models import transformer
from tools.bench.gguf_load import counting_reader

LAYER_NAMES = {v: k for k, v in gguf_io._LAYER.items()}
GEMMA_NAMES = {v: k for k, v in gguf_io._GEMMA_LAYER.items()}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q and k rows (its `LlamaModel.permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, path: str, arch: str = "llama", raw: dict | None = None) -> None:
    """A transformers directory as a GGUF file of `arch`, F32, the way llama.cpp's converter writes it
    (`_llama_cpp_tensors`); the tensors `raw` names written as zero bytes of the GGML type it gives."""
    import gguf
    import torch
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    tensors = {k: v.to(torch.float32).numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    writer = gguf.GGUFWriter(path, arch)
    _write_keys(writer, cfg, arch)
    for name, w in _llama_cpp_tensors(tensors, cfg, arch):
        if name in (raw or {}):
            block, size = gguf.GGML_QUANT_SIZES[raw[name]]
            w = np.zeros((*w.shape[:-1], w.shape[-1] // block * size), np.uint8)
        writer.add_tensor(name, np.ascontiguousarray(w), raw_dtype=(raw or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_keys(writer, cfg: dict, arch: str) -> None:
    """The architecture's keys, as llama.cpp's converter writes them from config.json."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch == "gemma2":
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


# llama.cpp's names of a Qwen MoE layer's experts (each expert's matrix stacked into one [experts, out, in]), its
# router and its shared expert
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
MOE_NAMES = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _llama_cpp_tensors(tensors: dict, cfg: dict, arch: str):
    """(llama.cpp's name, tensor) of each transformers tensor: LLaMA's q and k rows permuted, Gemma's norms as 1 + w,
    experts stacked, the shared expert's gate a vector."""
    stacks: dict[str, list] = {}
    for key, w in tensors.items():
        parts = key.split(".")
        if not key.startswith("model.layers."):
            gemma_norm = arch == "gemma2" and key == "model.norm.weight"
            yield {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[key], w + 1 if gemma_norm else w
            continue
        if parts[4] == "experts":
            stacks.setdefault(f"blk.{parts[2]}.{EXPERT_NAMES[parts[6]]}.weight", []).append((int(parts[5]), w))
            continue
        layer = ".".join(parts[3:-1])
        kind = MOE_NAMES.get(layer) or (GEMMA_NAMES if arch == "gemma2" else LAYER_NAMES)[layer]
        if arch == "llama" and kind in ("attn_q", "attn_k") and parts[-1] == "weight":
            w = _permute(w, cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"])
        if arch == "gemma2" and kind.endswith("norm"):
            w = w + 1  # llama.cpp's converter stores Gemma's norms as the 1 + w they multiply by
        yield f"blk.{parts[2]}.{kind}.{parts[-1]}", w.reshape(-1) if kind == "ffn_gate_inp_shexp" else w
    for name, experts in stacks.items():
        yield name, np.stack([w for _, w in sorted(experts, key=lambda e: e[0])])


def logits_of(source: str, tokens: np.ndarray) -> np.ndarray:
    cfg = build_config(None, {"init.from": source, "model.seq_len": tokens.shape[1], "precision.compute": "float32"})
    files = gguf_io.GgufFiles(source[5:]) if source.startswith("gguf:") else hf.Files(source[3:])
    params = hf.load_from(files, cfg.model)
    return np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(tokens)))


TO_TRANSFORMERS = {"gemma2": 1e-4}  # where jaxllm and transformers part by more than 1e-5, as HF imports
ARCHS = {"llama": ("llama3.1", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
         "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
         "gemma2": ("gemma2", {"query_pre_attn_scalar": H.HEAD_DIM}), "qwen2moe": ("qwen2_moe", {}),
         "qwen3moe": ("qwen3_moe", {})}  # GGUF arch -> (tiny family, its overrides)


def _norms_held_as_one_plus(hf_dir: str) -> None:
    """Round a Gemma model's norm weights w to what (1 + w) in fp32 holds, so the file's 1 + w gives w back exactly
    and transformers' reference reads the weights jaxllm reads (otherwise up to 6e-8 a weight apart)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    save_file({k: (v + 1) - 1 if k.endswith("norm.weight") else v for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
    assert all(t.dtype == torch.float32 for t in tensors.values())


@pytest.mark.parametrize("arch", tiers(list(ARCHS), fast=("llama",)))
def test_a_model_written_as_llama_cpp_writes_it_imports_with_transformers_logits(arch, tmp_path):
    family, over = ARCHS[arch]
    source = H.build(family, str(tmp_path / "hf"), **over)
    if arch.startswith("gemma"):
        _norms_held_as_one_plus(source)
    write_gguf(source, str(tmp_path / "tiny.gguf"), arch)
    tokens = H.sample_tokens(H.VOCAB_SIZE, 2, 24, 0)
    ours = logits_of(f"gguf:{tmp_path / 'tiny.gguf'}", tokens)[..., :H.VOCAB_SIZE]
    assert np.abs(ours - logits_of(f"hf:{source}", tokens)[..., :H.VOCAB_SIZE]).max() <= 1e-6  # the same model
    # transformers' logits within 1e-5; Gemma 2 within test_hf_interop's 1e-4, which its import from the
    # transformers directory itself needs (its soft caps: 1.1e-5 apart either way)
    assert np.abs(ours - H.reference_logits(source, tokens)).max() <= TO_TRANSFORMERS.get(arch, 1e-5)


def test_bad_gguf_files_are_refused_in_one_line(tmp_path, capsys):
    """An architecture jaxllm lacks, Mixtral's experts in a llama file, a tokenizer kind not read, a file that is not GGUF, one cut short, a tensor
    type the gguf package cannot dequantize (Q8_1): each one line naming it (`jaxllm generate`: exit code 2)."""
    import gguf

    from jaxllm.cli import generate as command

    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="GGUF general.architecture='bert': jaxllm reads llama"):
        gguf_io.GgufFiles(str(tmp_path / "bert.gguf"))
    with pytest.raises(ModelFileError, match="GGUF llama with 8 experts .*: not read yet"):
        gguf_io.hf_config({"general.architecture": "llama", "llama.expert_count": 8}, set())
    with pytest.raises(DataError, match="tokenizer.ggml.model=None .*jaxllm reads the byte-level BPE"):
        get_tokenizer(f"gguf:{tmp_path / 'bert.gguf'}")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="junk.gguf: not a readable GGUF file"):
        gguf_io.GgufFiles(str(tmp_path / "junk.gguf"))
    source = H.build("llama3.1", str(tmp_path / "hf"), rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    write_gguf(source, str(tmp_path / "whole.gguf"))
    data = (tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelFileError, match="cut.gguf: not a readable GGUF file"):
        gguf_io.GgufFiles(str(tmp_path / "cut.gguf"))
    write_gguf(source, str(tmp_path / "q8_1.gguf"), raw={"blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q8_1})
    capsys.readouterr()
    assert command.main(["--from", f"gguf:{tmp_path / 'q8_1.gguf'}", "--prompt", "a", "data.tokenizer=byte"]) == 2
    err = capsys.readouterr().err.strip()
    assert "tensor 'blk.0.attn_v.weight' is Q8_1, which the gguf package cannot dequantize" in err
    assert len(err.splitlines()) == 1, err


def strings(n: int = 520) -> list[str]:
    """n strings mixing ASCII words, accents, CJK, emoji, code, digits and whitespace runs (seeded)."""
    rng = np.random.default_rng(0)
    pieces = ["Hello", "world", "don't", "we'll", "Café", "naïve", "façade", "Ünïcödé", "東京", "日本語の文",
              "中文字符", "한국어", "🙂", "🚀🔥", "👩‍💻", "def f(x):", "return x**2", "{'a': [1, 2]}", "x=1e-5",
              "3.14159", "1234567890", "0x1F", "  ", "\t", "\n", "\n\n", "   ", "<|im_start|>", "<|im_end|>",
              "---", "!!!", "Über", "ß", "ñ", "α+β=γ", "$100.00", "C++", "#include <stdio.h>", "  indented"]
    out = []
    for _ in range(n):
        k = int(rng.integers(1, 7))
        glue = rng.choice(["", " ", "  ", "\n"], size=k)
        out.append("".join(str(p) + str(g) for p, g in zip(rng.choice(pieces, size=k), glue)))
    return out


def _exported(tmp_path, dtype: str) -> tuple[str, object, object]:
    """A tiny random LLaMA imported from transformers and exported as GGUF in `dtype`: (file, its config, params)."""
    source = H.build("llama3.1", str(tmp_path / "hf"), rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    cfg, params = hf.load_pretrained(source, overrides={"model.seq_len": 24})
    path = str(tmp_path / f"tiny.{dtype}.gguf")
    export.gguf_file(cfg, params, path, dtype)
    return path, cfg, params


def test_a_gguf_export_in_f32_loads_in_transformers_with_jaxllms_logits(tmp_path):
    """The f32 file: read back by the gguf reader with llama.cpp's arch keys, by transformers' GGUF loader with
    jaxllm's logits (1e-5), and by jaxllm bit for bit."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    path, cfg, params = _exported(tmp_path, "f32")
    meta = gguf_io.metadata(gguf.GGUFReader(path))
    assert (meta["general.architecture"], meta["llama.block_count"], meta["llama.attention.head_count_kv"]) == (
        "llama", cfg.model.n_layers, cfg.model.n_kv_heads)
    tokens = H.sample_tokens(H.VOCAB_SIZE, 2, 24, 0)
    ours = np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(tokens)))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(ours[..., :H.VOCAB_SIZE] - theirs).max() <= 1e-5
    back = hf.load_from(gguf_io.GgufFiles(path), cfg.model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def within_q8_0(got: np.ndarray, want: np.ndarray) -> bool:
    """Each weight within half its Q8_0 block's step (amax / 127 over 32 values of a row; the fp16 scale adds
    127 · 2^-11 of a step at most)."""
    step = np.repeat(np.abs(want.reshape(*want.shape[:-1], -1, 32)).max(-1) / 127, 32, axis=-1)
    return bool((np.abs(got - want) <= (0.5 + 127 * 2.0 ** -11) * step + 1e-12).all())


def test_a_q8_0_export_stays_within_its_quantization_error(tmp_path):
    """Q8_0: each weight read back within half its block's step (`within_q8_0`), norms exact (llama.cpp keeps
    vectors in F32)."""
    path, cfg, params = _exported(tmp_path, "q8_0")
    files = gguf_io.GgufFiles(path)
    for key, want in hf.file_tensors(params, cfg.model):
        got = files.read(key, ())
        if want.ndim < 2:
            np.testing.assert_array_equal(got, want)
        else:
            assert within_q8_0(got, want), key


@pytest.mark.slow
def test_a_gguf_file_loads_onto_a_mesh_dequantizing_each_tensor_once(tmp_path):
    """Loaded onto 8 devices (ZeRO-3 over fsdp: each device reads its block of every layer), the Q8_0 file's
    tensors are dequantized once each, not once per device block, and the parameters are one device's load's."""
    path, _, _ = _exported(tmp_path, "q8_0")
    cfg = build_config(None, {"init.from": f"gguf:{path}", "model.seq_len": 24, "mesh.dp": 1, "mesh.fsdp": 8,
                              "train.zero_stage": 3})
    files = counting_reader(path)
    params = hf.load_from(files, cfg.model, step_fns(cfg).state_shardings.params)
    assert files.dequantized == {t.name: 1 for t in files.reader.tensors}
    one = hf.load_from(gguf_io.GgufFiles(path), cfg.model)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(one), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_jaxllms_reader_reads_what_the_gguf_packages_reader_reads(tmp_path):
    """`gguf_io.reader_class`, the gguf package's reader over a plain array view of its memory map (numpy's memmap
    runs Python on every slice): every metadata value and every tensor's bytes as the package's own reader reads
    them."""
    import gguf

    path, _, _ = _exported(tmp_path, "q8_0")
    ours, theirs = gguf_io.reader_class()(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert gguf_io.metadata(ours) == gguf_io.metadata(theirs)
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors]
