"""Hugging Face checkpoints in and out: `load_pretrained` and `save_pretrained`.

Import reads config.json (`hf_config.py`) and the safetensors files (one, or shards named by
`model.safetensors.index.json`) straight into the parameters' shardings: each device's block of a
parameter is read from the file as a slice of one tensor at a time (per layer, per expert), converted
to fp32, the vocabulary rows padded to `padded_vocab`. Export streams one tensor at a time the other
way (the vocabulary sliced back), into shards of at most `max_shard_size` bytes with their index,
config.json and generation_config.json, written under a temporary name and renamed when complete.
With several processes every process reads its own devices' blocks; export gathers one tensor at a
time and process 0 writes.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil

import einops
import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxllm import stack
from jaxllm.config import build_config
from jaxllm.errors import ModelFileError
from jaxllm.interop import hf_config
from jaxllm.interop.hf_tables import Entry, entries, mtp_layers
from jaxllm.models import transformer
from jaxllm.schema import Config

log = logging.getLogger("jaxllm")
INDEX, SINGLE = hf_config.INDEX, hf_config.SINGLE
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
FILE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# block FP8's weights and its power-of-two scales: numpy has no such dtypes, so safetensors' numpy and flax readers
# cannot make their arrays; they are mapped from the file by the format's header (`Files.mapped`)
FP8_FILE_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu}
SCALE_SUFFIX = "_scale_inv"  # block FP8: `X.weight_scale_inv` beside `X.weight`, which it multiplies
# Buffers some files hold that are not parameters (GPT-2's causal mask, old rotary tables).
IGNORED = re.compile(r"(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq|weight_scale_inv)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


# ---------------------------------------------------------------- reading files


class Files:
    """The tensors of a model directory by key: which file holds each, its dtype and shape."""

    def __init__(self, path: str):
        self.path, self.where = path, hf_config.weight_map(path)
        self.blocks = hf_config.fp8_blocks(hf_config.read(path))  # block FP8's (rows, columns), or None
        self._open: dict = {}
        self._headers: dict = {}

    def handle(self, key: str, framework: str):
        file = self.where[key]
        if (file, framework) not in self._open:
            try:
                self._open[file, framework] = safe_open(os.path.join(self.path, file), framework)
            except (OSError, SafetensorError) as e:
                raise ModelFileError(f"{self.path}/{file}: not a readable safetensors file ({e})") from None
        return self._open[file, framework]

    def full_key(self, key: str) -> str:
        """The file's name for a table key: as written, or GPT-2's without its `transformer.` prefix (as first
        published), or a multimodal Gemma 3's text tower (`model.language_model.*`, or `language_model.model.*`
        as transformers 5 saves it)."""
        rest = key.removeprefix("model.")
        aliases = [key, key.removeprefix("transformer."), "model.language_model." + rest, "language_model.model." + rest,
                   "language_model." + key]
        full = next((k for k in aliases if k in self.where), key)
        if full not in self.where:
            raise ModelFileError(f"{self.path}: no tensor '{full}', which this model's config.json needs; the files "
                                 "do not match the config")
        return full

    def raw_dtype(self, key: str) -> str:
        """The file's dtype name of a tensor ("F32", "BF16", "F8_E4M3", ...)."""
        return self.handle(key, "numpy").get_slice(key).get_dtype()

    def dtype(self, key: str) -> str:
        raw = self.raw_dtype(key)
        if raw == "F8_E4M3" and self.blocks and key + SCALE_SUFFIX in self.where:
            return "float8_e4m3fn"
        if raw not in FILE_DTYPES:
            raise ModelFileError(f"{self.path}: tensor '{key}' is {raw}; jaxllm reads F32, BF16 and F16, and E4M3 "
                                 "weights with a weight_scale_inv beside them under a block-FP8 quantization_config")
        return FILE_DTYPES[raw]

    def mapped(self, key: str) -> np.ndarray:
        """A whole fp8 tensor (E4M3 weights, E8M0 scales), mapped read-only from its file: the safetensors format
        is an 8-byte header length, the JSON header (each tensor's dtype, shape and byte offsets), the data."""
        file = os.path.join(self.path, self.where[key])
        if file not in self._headers:
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + n, json.loads(f.read(n)))
        start, header = self._headers[file]
        info = header[key]
        return np.memmap(file, FP8_FILE_DTYPES[info["dtype"]], "r", start + info["data_offsets"][0],
                         tuple(info["shape"]))

    def stored(self, key: str) -> np.ndarray:
        """A whole tensor as the file holds it (its dtype and bits; fp8 ones mapped, the rest through safetensors'
        flax reader on the CPU device)."""
        if self.raw_dtype(key) in FP8_FILE_DTYPES:
            return np.asarray(self.mapped(key))
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return np.asarray(self.handle(key, "flax").get_tensor(key))

    def dequantized(self, key: str, index: tuple) -> np.ndarray:
        """A slice of a block-FP8 weight in fp32: each E4M3 value times its block's weight_scale_inv (which
        multiplies, despite its name); the last blocks of a dimension not a multiple of the block are partial."""
        q = self.mapped(key)
        scale = self.stored(key + SCALE_SUFFIX).astype(np.float32)  # fp32 (DeepSeek-V3) or powers of two (UE8M0)
        for axis, size in zip((-2, -1), self.blocks):
            scale = np.repeat(scale, size, axis=axis)
        scale = scale[..., :q.shape[-2], :q.shape[-1]]
        return q[index].astype(np.float32) * scale[index]

    def read(self, key: str, index: tuple) -> np.ndarray:
        """A slice of one tensor, as fp32 on the host (bf16 through safetensors' flax reader, on the CPU device;
        block FP8 dequantized)."""
        dtype = self.dtype(key)
        if dtype == "float8_e4m3fn":
            return self.dequantized(key, index)
        if dtype == "bfloat16":
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                return np.asarray(self.handle(key, "flax").get_slice(key)[index], np.float32)
        return np.asarray(self.handle(key, "numpy").get_slice(key)[index], np.float32)


def _groups(side: str) -> list[list[str]]:
    """'(h d) e' -> [['h', 'd'], ['e']]"""
    return [g.strip("()").split() for g in re.findall(r"\([^)]*\)|\S+", side)]


def _bounds(s: slice, size: int) -> tuple[int, int]:
    return s.start or 0, size if s.stop is None else s.stop


def read_block(files: Files, entry: Entry, key: str, shape: tuple[int, ...], index: tuple, vocab: int) -> np.ndarray:
    """Block `index` of one layer's (one expert's) leaf of `shape`, read from the file's tensor `key`.

    Each file dimension is a group of our dimensions ('(h d)'); it is read as the rows of our block when
    the group's inner dimensions are whole, else whole, and what is left is sliced after the rearrange.
    """
    src, dst = (s.strip() for s in entry.pattern.split("->"))
    names = dst.split()
    fused = entry.select is not None  # one part p of a fused tensor ('p e h d' with p fixed)
    sizes = dict(zip(names[1:] if fused else names, shape)) | ({"p": entry.parts} if fused else {}) | {"1": 1}
    want = dict(zip(names[1:] if fused else names, index)) | {"1": slice(None)}  # "1": a unit axis of the file's
    want |= {"p": slice(entry.select, entry.select + 1)} if fused else {}
    groups, file_index, got, rest = _groups(src), [], {}, {}
    for group in groups:
        inner = int(np.prod([sizes[n] for n in group[1:]]))
        if all(_bounds(want[n], sizes[n]) == (0, sizes[n]) for n in group[1:]):
            a, b = _bounds(want[group[0]], sizes[group[0]])
            file_index.append(slice(a * inner, min(b, vocab if group == ["v"] else b) * inner))
            got |= {group[0]: b - a} | {n: sizes[n] for n in group[1:]}
        else:
            file_index.append(slice(0, sizes[group[0]] * inner))
            got |= {n: sizes[n] for n in group}
            rest |= {n: want[n] for n in group}
    block = files.read(key, tuple(file_index))
    if ["v"] in groups:  # vocabulary rows past the file's are padding (zeros)
        axis = groups.index(["v"])
        block = np.pad(block, [(0, got["v"] - block.shape[axis]) if i == axis else (0, 0) for i in range(block.ndim)])
    split = {n: got[n] for g in groups if len(g) > 1 for n in g}
    block = einops.rearrange(block, f"{src} -> {dst}", **split)
    block = block[tuple(rest.get(n, slice(None)) for n in names)]
    if entry.order:  # a dimension whose rows the file holds in another order (it is whole here)
        block = np.take(block, entry.order[1], axis=names.index(entry.order[0]))
    return block[0] if fused else block


# ---------------------------------------------------------------- which file tensor is which leaf


def leaf_entries(m, fused: bool = False, interleaved: bool = False) -> dict[tuple, Entry]:
    """Every parameter leaf's path in `params` (blocks: ("blocks", block index, ...); the prediction modules'
    ("mtp", ...), their block's ("mtp", "block", ...)) -> its table entry (`fused`: the checkpoint's experts are
    fused tensors; `interleaved`: its RoPE dimensions interleaved pairs)."""
    table, out = entries(m, fused, interleaved), {}
    for e in table:
        if "{i}" not in e.key or e.path[0] == "mtp":
            out[e.path] = e
            continue
        for k, kind in enumerate(stack.kinds(m)):
            out[("blocks", k, *e.path)] = e
        out[("mtp", "block", *e.path)] = e
    leaves = {tuple(_key_name(k) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(
        transformer.param_shapes(m))}
    missing = sorted(leaves - set(out))
    if missing:
        raise ModelFileError(f"no Hugging Face tensor for the parameter {'.'.join(map(str, missing[0]))}; "
                             "this model cannot be exported or imported")
    return {p: e for p, e in out.items() if p in leaves}


def _key_name(k):
    return getattr(k, "key", getattr(k, "idx", None))


def _segment_of(m, k: int) -> stack.Segment:
    return next(seg for seg in stack.segments(m) if seg.blocks.start <= k < seg.blocks.stop)


def _stack(m, path: tuple) -> tuple:
    """(which stack a per-layer leaf is in: its block index or "mtp", its repeats, repeat -> file layer)."""
    if path[0] == "mtp":  # the prediction modules: after the stack's layers, or numbered apart (`mtp_layers`)
        first = mtp_layers(m)[1]
        return "mtp", m.mtp_depth, lambda r: first + r
    seg, k = _segment_of(m, path[1]), path[1]
    return k, seg.repeats, lambda r: seg.first_layer + r * len(seg.pattern) + k - seg.first_block


def _keys(e: Entry, m, path: tuple, repeats) -> list[list[str]]:
    """The file keys of a per-layer leaf at `path`, [repeat][expert] (one expert for a leaf without {x})."""
    experts = range(m.moe.n_experts) if "{x}" in e.key else [None]
    layer = _stack(m, path)[2]
    key = e.key.replace("model.layers.", mtp_layers(m)[0]) if path[0] == "mtp" else e.key
    return [[key.format(i=layer(r), x=x) for x in experts] for r in repeats]


def read_leaf(files: Files, m, path: tuple, e: Entry, shape: tuple, index: tuple) -> np.ndarray:
    """Block `index` of the leaf at `path` (of `shape`), one file tensor at a time."""
    vocab = m.vocab_size
    if "{i}" not in e.key:
        return read_block(files, e, files.full_key(e.key), shape, index, vocab)
    r0, r1 = _bounds(index[0], shape[0])
    layers = []
    for keys in _keys(e, m, path, range(r0, r1)):
        if "{x}" not in e.key:
            layers.append(read_block(files, e, files.full_key(keys[0]), shape[1:], index[1:], vocab))
            continue
        x0, x1 = _bounds(index[1], shape[1])
        layers.append(np.stack([read_block(files, e, files.full_key(key), shape[2:], index[2:], vocab)
                                for key in keys[x0:x1]]))
    return np.stack(layers)


# ---------------------------------------------------------------- import


def config_for(path: str, overrides: dict | None = None):
    """The run config of a Hugging Face model directory (its architecture keys, then `overrides`)."""
    return build_config(None, {"init.from": f"hf:{path}", **(overrides or {})})


def load_params(path: str, m, shardings=None) -> dict:
    """fp32 parameters of model config `m` from the safetensors files in `path`, placed as `shardings` says
    (a tree like the parameters; default: the first device). Each device's block is read from the files."""
    return load_from(Files(path), m, shardings, hf_config.rope_interleaved(hf_config.read(path)))


def load_from(files, m, shardings=None, interleaved: bool = False) -> dict:
    """`load_params` from `files` (anything serving tensors by transformers' names as `Files` does: a GGUF file's,
    `gguf_io.GgufFiles`); `interleaved`: the checkpoint's RoPE rows are pairs (DeepSeek's)."""
    shapes = transformer.param_shapes(m)
    by_path = leaf_entries(m, fused=any(k.endswith(".experts.gate_up_proj") for k in files.where),
                           interleaved=interleaved)
    if shardings is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), shapes)

    def load(key_path, shape, sharding):
        path_ = tuple(_key_name(k) for k in key_path)
        read = lambda index: read_leaf(files, m, path_, by_path[path_], shape.shape, index)
        return jax.make_array_from_callback(shape.shape, sharding, read)

    params = jax.tree_util.tree_map_with_path(load, shapes, shardings)
    gc.collect()  # host blocks handed to the devices are freed at collection (measured: ~1 GiB for a 1B model)
    return params


def load_pretrained(path: str, shardings=None, overrides: dict | None = None):
    """(Config, fp32 params) of a Hugging Face model directory; `shardings` places the parameters (a tree like
    them, e.g. a run's `StepFns.state_shardings.params`), `overrides` sets run keys such as model.seq_len.
    A multimodal Gemma 3 or Llama 4 gives its text model (exported as gemma3_text, llama4_text); the rest is not
    read."""
    cfg = config_for(path, overrides)
    kind = hf_config.read(path).get("model_type")
    if kind in ("gemma3", "llama4"):
        log.info("%s: a multimodal %s; reading its text model, the vision model and projector skipped", path,
                 {"gemma3": "Gemma 3", "llama4": "Llama 4"}[kind])
    return cfg, load_params(path, cfg.model, shardings)


def source_dtype(path: str) -> str:
    """The dtype of a model directory's weights (its first tensor's; config.json's `dtype` if it names one)."""
    named = hf_config.source_dtype(hf_config.read(path))
    if named in DTYPES:
        return named
    files = Files(path)
    weights = (k for k in files.where if not k.endswith(SCALE_SUFFIX))
    return next((d for d in map(files.dtype, weights) if d in DTYPES), "float32")


# ---------------------------------------------------------------- export


def _fetch(x: jax.Array) -> np.ndarray:
    """A (small) array on the host of every process: gathered across processes when it spans them."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def file_tensors(params: dict, m):
    """(file key, fp32 host tensor) for every tensor of the checkpoint, in the table's order, one at a time."""
    by_key: dict[tuple, list[tuple[tuple, Entry]]] = {}  # (key, stack) -> the leaves it holds
    for path, e in leaf_entries(m, interleaved=True).items():  # DeepSeek's RoPE rows as published
        by_key.setdefault((e.key, _stack(m, path)[0] if "{i}" in e.key else None), []).append((path, e))
    take = jax.jit(lambda leaf, r: leaf[r])  # one layer of a stacked leaf, where its devices are
    for (key, k), leaves in by_key.items():
        leaves.sort(key=lambda pe: pe[1].select or 0)
        if k is None:
            yield key, _to_file(leaves, [_fetch(_at(params, path)) for path, _ in leaves], m)
            continue
        path = leaves[0][0]
        for r, keys in enumerate(_keys(leaves[0][1], m, path, range(_stack(m, path)[1]))):
            values = [_fetch(take(_at(params, path), r)) for path, _ in leaves]
            for x, file_key in enumerate(keys):
                yield file_key, _to_file(leaves, [v[x] if "{x}" in key else v for v in values], m)
    yield from _mtp_copies(params, m)


def _mtp_copies(params: dict, m):
    """Each prediction layer's copies of the shared embedding and head, as DeepSeek-V3's files hold them (Qwen3-Next's
    hold none)."""
    if hf_config.model_type(m) != "deepseek_v3":
        return
    head = params["embed"]["tok"].T if m.tie_embeddings else params["head"]["w"]
    for r in range(m.mtp_depth):
        layer = f"model.layers.{m.n_layers + r}"
        yield f"{layer}.embed_tokens.weight", _fetch(params["embed"]["tok"])[:m.vocab_size]
        yield f"{layer}.shared_head.head.weight", np.ascontiguousarray(_fetch(head)[:, :m.vocab_size].T)


def _at(params: dict, path: tuple):
    for p in path:
        params = params[p]
    return params


def _to_file(leaves: list, values: list[np.ndarray], m) -> np.ndarray:
    """Our layer's (expert's) values of the leaves that make up one file tensor -> that tensor."""
    e = leaves[0][1]
    src, dst = (s.strip() for s in e.pattern.split("->"))
    value = np.stack(values) if e.select is not None else values[0]
    if e.order:  # back to the file's order of that dimension
        value = np.take(value, np.argsort(e.order[1]), axis=dst.split().index(e.order[0]))
    if "v" in dst.split():
        value = np.take(value, np.arange(m.vocab_size), axis=dst.split().index("v"))
    return np.ascontiguousarray(einops.rearrange(value, f"{dst} -> {src}"))


class BlockFp8Source:
    """A block-FP8 source's projections, written back as published: a tensor equal to the source's dequantized one
    with the source's fp8 bytes and scales (carried, not recomputed), another quantized in the source's blocks
    (scale = the block's amax / 448 in fp32, rounded up to a power of two where the source's scales are UE8M0)."""

    def __init__(self, source: str):
        self.files = Files(source)

    def encode(self, key: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """[(key, tensor)] as the file holds them: `value` itself, or its E4M3 values and their scales."""
        scale_key = key + SCALE_SUFFIX
        if not (self.files.blocks and scale_key in self.files.where):
            return [(key, value)]
        if np.array_equal(self.files.read(key, ()), value):
            return [(key, self.files.stored(key)), (scale_key, self.files.stored(scale_key))]
        power_of_two = self.files.raw_dtype(scale_key) == "F8_E8M0"
        return list(zip((key, scale_key), quantize_blocks(value, self.files.blocks, power_of_two)))


def quantize_blocks(w: np.ndarray, blocks: tuple[int, int], power_of_two: bool) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 w / scale, scale) per block of w's last two dimensions (the last blocks partial where a dimension is
    not a multiple): scale = amax / 448 (fp32; UE8M0: rounded up to a power of two and stored as E8M0)."""
    (br, bc), (r, c) = blocks, w.shape[-2:]
    padded = np.pad(w.astype(np.float32), [(0, 0)] * (w.ndim - 2) + [(0, -r % br), (0, -c % bc)])
    tiles = padded.reshape(*w.shape[:-2], padded.shape[-2] // br, br, padded.shape[-1] // bc, bc)
    top = np.float32(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    scale = np.abs(tiles).max(axis=(-3, -1), keepdims=True) / top
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    if power_of_two:
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    q = np.clip(tiles / scale, -top, top).astype(ml_dtypes.float8_e4m3fn).reshape(padded.shape)[..., :r, :c]
    scale = scale[..., 0, :, 0]
    return np.ascontiguousarray(q), scale.astype(ml_dtypes.float8_e8m0fnu) if power_of_two else scale


def _write_shards(tensors, out: str, dtype: str, max_shard_bytes: int) -> dict[str, str]:
    """Write (key, tensor) pairs as safetensors shards of at most `max_shard_bytes`; returns (key -> file,
    total bytes)."""
    shards, current, size, where, total = [], {}, 0, {}, 0

    def flush():
        name = f"part-{len(shards):05d}.safetensors"
        save_file(current, os.path.join(out, name), metadata={"format": "pt"})
        shards.append((name, list(current)))

    for key, value in tensors:
        if value.dtype == np.float32 and not key.endswith(SCALE_SUFFIX):  # block FP8's are written as they are
            value = value.astype(DTYPES[dtype])
        if current and size + value.nbytes > max_shard_bytes:
            flush()
            current, size = {}, 0
        current[key], size, total = value, size + value.nbytes, total + value.nbytes
    flush()
    for n, (name, keys) in enumerate(shards):
        final = SINGLE if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out, name), os.path.join(out, final))
        where.update({k: final for k in keys})
    return where, total


def parse_size(text: str) -> int:
    """'5GB', '500MB', '40KB' or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ModelFileError(f"--max-shard-size {text!r}: give bytes or a size like 5GB, 500MB")
    unit = (match.group(2) or "B").upper().replace("I", "")
    return int(float(match.group(1)) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit])


def save_pretrained(params: dict, config, path: str, *, dtype: str = "float32", max_shard_size: str | int = "5GB",
                    source: str | None = None, tokenizer: str | None = None) -> None:
    """Write `params` as a Hugging Face model directory `path` that transformers' from_pretrained loads:
    safetensors in `dtype`, config.json, generation_config.json. `config` is the `Config` `load_pretrained`
    returns (or its model section); `source` (a Hugging Face directory the run started from) lends its token
    ids and generation config (and a block-FP8 source its format: its projections are written in block FP8,
    `BlockFp8Source`), `tokenizer` (a directory) its tokenizer files. Written to `path`.partial and
    renamed, so `path` is whole or absent."""
    m = config.model if isinstance(config, Config) else config
    hf_config.exportable(m)
    if dtype not in DTYPES:
        raise ModelFileError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if os.path.exists(path) and os.listdir(path):
        raise ModelFileError(f"{path}: exists and is not empty; choose a new directory")
    lead, partial = jax.process_index() == 0, path.rstrip("/") + ".partial"
    if lead:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    fp8 = BlockFp8Source(source) if hf_config.fp8_blocks(_source_config(source)) else None
    tensors = file_tensors(params, m)
    if fp8 is not None:
        tensors = (pair for key, value in tensors for pair in fp8.encode(key, value))
    if not lead:
        for _ in tensors:  # every process takes part in each gather
            pass
        return
    where, total = _write_shards(tensors, partial, dtype, parse_size(max_shard_size))
    _write_metadata(partial, m, dtype, where, total, source, tokenizer)
    if os.path.isdir(path):
        os.rmdir(path)
    os.replace(partial, path)


def _source_config(source: str | None) -> dict:
    """The source directory's config.json ({} without one)."""
    return hf_config.read(source) if source and os.path.isfile(os.path.join(source, "config.json")) else {}


def _write_metadata(out: str, m, dtype: str, where: dict, total: int, source: str | None,
                    tokenizer: str | None) -> None:
    src = _source_config(source)
    config = hf_config.hf_config(m, dtype, src)
    if hf_config.fp8_blocks(src):  # the projections written as the source publishes them (`BlockFp8Source`)
        config["quantization_config"] = src["quantization_config"]
    _write_json(os.path.join(out, "config.json"), config)
    if len(set(where.values())) > 1:
        _write_json(os.path.join(out, INDEX), {"metadata": {"total_size": total}, "weight_map": where})
    generation = os.path.join(source or "", "generation_config.json")
    if source and os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(out, "generation_config.json"))
    else:
        _write_json(os.path.join(out, "generation_config.json"),
                    {k: v for k, v in src.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    for name in TOKENIZER_FILES if tokenizer else ():
        if os.path.isfile(os.path.join(tokenizer, name)):
            shutil.copyfile(os.path.join(tokenizer, name), os.path.join(out, name))


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
