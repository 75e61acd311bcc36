"""GGUF files in (`init.from = "gguf:FILE"`): llama.cpp's format, as llama.cpp, Ollama and LM Studio hold models.

A GGUF file carries the architecture in its metadata (`general.architecture` and `ARCH.*` keys) and every tensor
under llama.cpp's names, quantized or not. jaxllm reads it through the `gguf` package (llama.cpp's own Python
reader): the metadata becomes the Hugging Face config.json it stands for (`hf_config`), each tensor is
dequantized to fp32 by `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants:
whatever the package reads) and named as transformers names it, so the Hugging Face tables
(`hf.load_from`) place it. llama.cpp permutes the rows of q and k for arch `llama` (its RoPE pairs (x0, x1), ...
where transformers' takes halves); that is undone here, as transformers' GGUF loader undoes it.

Architectures: llama (and Mistral converted as llama), qwen2 (its q/k/v biases) and qwen3 (its q/k norms), whose
rows llama.cpp does not permute, gemma2 and gemma3 (four norms a layer, which llama.cpp stores as the 1 + w they
multiply by: read back as w; what the file leaves out is filled as llama.cpp fills it — Gemma 2's query scale —
or from transformers' Gemma 3 defaults — the local RoPE base, the 5 local : 1 global pattern, the query scale —
as its GGUF loader takes them). Others are refused in one line, naming the architecture.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from jaxllm.errors import ModelFileError

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2moe", "qwen3moe")
GEMMA = ("gemma2", "gemma3")
_MODEL_TYPE = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          # MoE layers (Qwen2-MoE, Qwen3-MoE): each expert's matrices stacked [experts, out, in]; gate and up are
          # read as transformers 5's one gate|up tensor (`GgufFiles._whole` joins them)
          "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_up_proj",
          "ffn_up_exps": "mlp.experts.gate_up_proj", "ffn_down_exps": "mlp.experts.down_proj",
          "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
          "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Gemma's four norms a layer: llama.cpp's ffn_norm is its pre-feedforward norm
_GEMMA_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GLOBAL_GGUF = {v: k for k, v in _GLOBAL.items()}


def _reader(path: str):
    """(the gguf package's reader of the file, its `metadata`)."""
    if not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such GGUF file")
    stat = os.stat(path)
    return _parsed(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.cache
def reader_class():
    """The `gguf` package's reader (llama.cpp's) over a plain array view of its memory map: numpy's memmap
    subclass runs Python code on every slice, and parsing a 262k-token vocabulary slices the file ten million
    times (3.4-3.7x faster as a plain view of the same map, nothing read early: BENCHMARKS.md)."""
    from gguf.gguf_reader import GGUFReader  # where it is defined (tests hand transformers ours as gguf.GGUFReader)

    class Reader(GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray)

    return Reader


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int):
    """The gguf package's reader of a file and its metadata, kept for the file as it is (the config, the tokenizer
    and the tensors each read them; parsing and listing a 262k-token vocabulary takes the reader seconds each).
    Four files: a source and the exports written from it are read in turn."""
    try:
        reader = reader_class()(path)
    except (ValueError, OSError, IndexError) as e:
        raise ModelFileError(f"{path}: not a readable GGUF file ({e})") from None
    return reader, metadata(reader)


def metadata(reader) -> dict:
    """The file's key-value metadata (arrays of strings or numbers as lists; the tokenizer's long arrays too)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def file_metadata(path: str) -> dict:
    """`metadata` of the GGUF file at `path` (ModelFileError, one line, for a missing or unreadable file)."""
    return _reader(path)[1]


def hf_config(meta: dict, tensor_names: set[str]) -> dict:
    """The Hugging Face config.json the metadata stands for (ModelFileError for an architecture jaxllm lacks)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(f"GGUF general.architecture={arch!r}: jaxllm reads {', '.join(ARCHITECTURES)}")
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    if arch == "llama" and a("expert_count"):
        raise ModelFileError(f"GGUF llama with {a('expert_count')} experts (Mixtral as llama.cpp converts it): not read "
                             "yet; import its Hugging Face directory (init.from = \"hf:DIR\")")
    heads = a("attention.head_count")
    head_dim = a("attention.key_length", a("embedding_length") // heads)
    config = {"model_type": _MODEL_TYPE.get(arch, arch),
              "hidden_size": a("embedding_length"), "intermediate_size": a("feed_forward_length"),
              "num_hidden_layers": a("block_count"), "num_attention_heads": heads,
              "num_key_value_heads": a("attention.head_count_kv", heads), "head_dim": head_dim,
              "rms_norm_eps": a("attention.layer_norm_rms_epsilon"), "rope_theta": a("rope.freq_base", 10000.0),
              "max_position_embeddings": a("context_length"),
              "vocab_size": a("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
              "tie_word_embeddings": "output.weight" not in tensor_names}
    if arch in ("qwen2moe", "qwen3moe"):
        config |= _experts(meta, arch, tensor_names)
    if arch not in GEMMA:
        return {**config, "hidden_act": "silu", "use_sliding_window": False}
    config |= {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": a("attention.sliding_window")}
    if arch == "gemma2":  # the query scale llama.cpp uses: hidden / heads for the 27B (46 layers), else head_dim
        scalar = a("embedding_length") // heads if a("block_count") == 46 else head_dim
        config |= {"query_pre_attn_scalar": scalar, "attn_logit_softcapping": a("attn_logit_softcapping"),
                   "final_logit_softcapping": a("final_logit_softcapping")}
    return config


def _experts(meta: dict, arch: str, tensor_names: set[str]) -> dict:
    """Qwen MoE's expert keys; the layers without stacked experts are dense (`mlp_only_layers`). llama.cpp
    normalises Qwen3-MoE's top-k weights and not Qwen2-MoE's, as transformers' configs say."""
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    layers = a("block_count")
    return {"num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
            "moe_intermediate_size": a("expert_feed_forward_length"), "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensor_names],
            "norm_topk_prob": arch == "qwen3moe", "output_router_logits": False,
            **({"shared_expert_intermediate_size": a("expert_shared_feed_forward_length"), "qkv_bias": True}
               if arch == "qwen2moe" else {})}


def hf_name(name: str, arch: str = "llama") -> str:
    """transformers' name of a llama.cpp tensor ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight')."""
    stem, _, suffix = name.rpartition(".")
    layer = _GEMMA_LAYER if arch in GEMMA else _LAYER
    if stem.startswith("blk."):
        _, i, kind = stem.split(".", 2)
        if kind not in layer:
            raise ModelFileError(f"GGUF tensor {name!r}: not a tensor of the layers jaxllm reads")
        stacked = kind.endswith("_exps")  # transformers 5 names its stacked experts' tensors without ".weight"
        return f"model.layers.{i}.{layer[kind]}" + ("" if stacked else f".{suffix}")
    if stem not in _GLOBAL:
        raise ModelFileError(f"GGUF tensor {name!r}: not a tensor of the models jaxllm reads")
    return f"{_GLOBAL[stem]}.{suffix}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k rows (each head's RoPE pairs interleaved) back to transformers' (halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


CACHE_BYTES = 2 << 30  # dequantized tensors a reader keeps (every leaf of a model up to a few billion parameters)


class GgufFiles:
    """A GGUF file's tensors as `hf.Files` serves a model directory's: by transformers' name, fp32 on the host."""

    def __init__(self, path: str):
        self.path, (self.reader, self.meta) = path, _reader(path)
        self.config = hf_config(self.meta, {t.name for t in self.reader.tensors})
        arch = self.meta["general.architecture"]
        self.tensors: dict[str, list] = {}  # transformers' name -> the file's tensors it joins (gate|up: two)
        for t in sorted(self.reader.tensors, key=lambda t: "ffn_up_exps" in t.name):  # gate before up
            self.tensors.setdefault(hf_name(t.name, arch), []).append(t)
        self.where = dict.fromkeys(self.tensors, os.path.basename(path))
        self._cache: dict[str, np.ndarray] = {}  # dequantized tensors, the least recently read first

    def full_key(self, key: str) -> str:
        if key not in self.tensors:
            raise ModelFileError(f"{self.path}: no tensor for '{key}', which this model's metadata needs")
        return key

    def _whole(self, key: str) -> np.ndarray:
        """The tensor `key` in fp32 as transformers holds it. Each device's block of a stacked leaf reads every
        layer's tensor in turn, so the tensors read last are kept up to CACHE_BYTES: a leaf's tensors within it
        are dequantized once, not once per device block (8 times on 8 devices: `tools.bench.gguf_load`)."""
        w = self._cache.pop(key, None)
        self._cache[key] = self._read_whole(key) if w is None else w
        while len(self._cache) > 1 and sum(a.nbytes for a in self._cache.values()) > CACHE_BYTES:
            del self._cache[next(iter(self._cache))]
        return self._cache[key]

    def _read_whole(self, key: str) -> np.ndarray:
        parts = [self._dequantized(t) for t in self.tensors[key]]
        w = np.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]
        if key.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp keeps the shared expert's gate a vector
        heads = {"q_proj": self.config["num_attention_heads"], "k_proj": self.config["num_key_value_heads"]}
        part = key.split(".")[-2]
        permuted = self.config["model_type"] == "llama" and part in heads  # llama.cpp permutes llama's alone
        if self.meta["general.architecture"] in GEMMA and key.endswith("norm.weight"):
            w = w - 1  # llama.cpp stores Gemma's norms as the 1 + w they multiply by
        return _unpermute(w, heads[part]) if permuted else w

    def _dequantized(self, t) -> np.ndarray:
        import gguf

        try:
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError:
            raise ModelFileError(f"{self.path}: tensor {t.name!r} is {t.tensor_type.name}, which the gguf "
                                 "package cannot dequantize") from None

    def read(self, key: str, index: tuple) -> np.ndarray:
        return self._whole(key)[index]


# llama.cpp's pre-tokenizer for each `tokenizer.ggml.pre` jaxllm reads (llama.cpp's llama-vocab.cpp): the splits
# before the byte-level BPE, as `tokenizers` pre-tokenizers. GPT-2's regex is ByteLevel's own.
_DIGITS_FIRST = ("smollm",)  # each digit its own piece, then GPT-2's rule
_GPT2_RULE = ("gpt2", "default")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` from the file's `tokenizer.ggml.*`: the byte-level BPE (`model` gpt2: vocabulary,
    merges and the pre-tokenizer `pre` names) or SentencePiece's BPE (`model` llama: vocabulary and its merge
    order, byte fallback); its control tokens special and its user-defined ones whole, as llama.cpp parses them.
    ModelFileError (one line) for a kind not read yet."""
    from tokenizers import AddedToken

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre in _DIGITS_FIRST + _GPT2_RULE:
        tok = _byte_level_bpe(meta, pre)
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta)
    else:
        raise ModelFileError(f"GGUF tokenizer.ggml.model={kind!r} with tokenizer.ggml.pre={pre!r}: jaxllm reads the "
                             f"byte-level BPE (gpt2) with pre {', '.join(_DIGITS_FIRST + _GPT2_RULE)} and "
                             "SentencePiece's (llama); give data.tokenizer another tokenizer")
    tokens, types = meta["tokenizer.ggml.tokens"], [int(t) for t in meta.get("tokenizer.ggml.token_type", [])]
    tok.add_special_tokens([AddedToken(str(t), special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(str(t), special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tok


def _byte_level_bpe(meta: dict, pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    merges = [tuple(str(m).split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = byte_level if pre in _GPT2_RULE else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict):
    """SentencePiece's BPE as llama.cpp runs it on a `llama` vocabulary: spaces spelled "▁" (one prepended where
    `add_space_prefix`), no pre-tokenizer, the best-ranked pair merged first, unknown characters as their
    <0xXX> bytes. The file keeps no merges: they are every split of a token into two tokens, ranked by the token's
    place in the vocabulary (Gemma's scores are all equal; its file order is its merge order), longer left parts
    first. (Runs of spaces, tabs and newlines are user-defined tokens, matched whole before the BPE.)"""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a token spelled twice keeps its first id
    merges = [(t[:j], t[j:]) for t in vocab for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab]
    merges.sort(key=lambda m: (vocab[m[0] + m[1]], -len(m[0]), -len(m[1])))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                               unk_token=None if unk is None else tokens[int(unk)]))
    prefix = [normalizers.Prepend("▁")] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


# ---------------------------------------------------------------- GGUF out

OUT_TYPES = ("f32", "f16", "bf16", "q8_0")  # `jaxllm hf export --format gguf --dtype`
_GGUF_NAME = {v: k for k, v in _LAYER.items()}
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def gguf_name(key: str) -> str:
    """llama.cpp's name of a transformers tensor (the inverse of `hf_name`)."""
    if key.startswith("model.layers."):
        _, _, i, *kind, suffix = key.split(".")
        return f"blk.{i}.{_GGUF_NAME['.'.join(kind)]}.{suffix}"
    stem, _, suffix = key.rpartition(".")
    return f"{_GLOBAL_GGUF[stem]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' q/k rows (halves) as llama.cpp stores them (pairs): the inverse of `_unpermute`."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encoded(w: np.ndarray, out: str):
    """(the tensor's data, its GGML type): norms and vectors stay F32 (as llama.cpp writes them); matrices in `out`
    (Q8_0: blocks of 32 along a row with an fp16 scale, through the gguf package's quantizer)."""
    import gguf

    types = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    kind = types["f32" if w.ndim < 2 or (out == "q8_0" and w.shape[-1] % 32) else out]
    if kind == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(w, np.float32), kind
    return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), kind), kind


def write(tensors, config: dict, path: str, out: str = "f32", tokenizer_meta: dict | None = None) -> None:
    """A GGUF file of arch llama at `path`: `tensors` ((transformers name, fp32 host tensor) pairs, as
    `hf.file_tensors` gives them) renamed and q/k permuted as llama.cpp's converter writes them, in `out`; the
    architecture keys from `config` (the Hugging Face config.json the model stands for) and the tokenizer's
    `tokenizer.ggml.*` and chat template from `tokenizer_meta` where given."""
    import gguf

    if out not in OUT_TYPES:
        raise ModelFileError(f"--dtype {out}: a GGUF export writes one of {', '.join(OUT_TYPES)}")
    kind = config.get("model_type")
    extra = [k for k in ("sliding_window", "rope_scaling", "attention_bias", "mlp_bias") if config.get(k)]
    if kind not in ("llama", "mistral") or extra:
        raise ModelFileError(f"GGUF export: model type {kind!r}{' with ' + ', '.join(extra) if extra else ''} is not "
                             "written yet; jaxllm writes plain llama GGUF files (export a Hugging Face directory)")
    writer = gguf.GGUFWriter(path, "llama")
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    for add, key in ((writer.add_block_count, "num_hidden_layers"), (writer.add_context_length, "max_position_embeddings"),
                     (writer.add_embedding_length, "hidden_size"), (writer.add_feed_forward_length, "intermediate_size"),
                     (writer.add_head_count, "num_attention_heads"), (writer.add_head_count_kv, "num_key_value_heads"),
                     (writer.add_layer_norm_rms_eps, "rms_norm_eps"), (writer.add_vocab_size, "vocab_size")):
        add(config[key])
    writer.add_rope_freq_base(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1e4))
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    for key, value in (tokenizer_meta or {}).items():
        _add(writer, key, value)
    for key, w in tensors:
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, heads if "q_proj" in key else kv)
        data, kind = _encoded(w, out)
        writer.add_tensor(gguf_name(key), data, raw_dtype=kind)  # uint8 blocks: the writer reads their shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer, key: str, value) -> None:
    """One tokenizer key of a source file's metadata, written with the type it had."""
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_string(key, value)


def tokenizer_metadata(path: str) -> dict:
    """The tokenizer keys and chat template of a GGUF file, to carry into an export."""
    meta = file_metadata(path)
    return {k: meta[k] for k in _TOKENIZER_KEYS if k in meta}
