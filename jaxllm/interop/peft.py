"""LoRA adapters out and in as PEFT adapter directories (`adapter_config.json`, `adapter_model.safetensors`).

PEFT names a Linear's adapters `base_model.model.<module>.lora_A.weight` [r, in_features] and `.lora_B.weight`
[out_features, r], the module being the Hugging Face weight's own name (`model.layers.3.self_attn.q_proj`), so
`peft.PeftModel.from_pretrained(transformers_model, DIR)` puts them back on the base. Each adapter's layout
follows from its base weight's table entry (`hf_tables`): the file tensor [out, in] is its two groups, and ours
is [our input dims, r] and [r, our output dims]. Families whose weights are fused or reordered in the file
(GPT-2's q|k|v, fused experts) are refused in one line; an output dimension the file holds in another order
(DeepSeek's interleaved RoPE rows in q_b_proj and kv_a_proj_with_mqa) is B's, reordered as the base weight is.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import einops
import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxllm.errors import ConfigError, ModelFileError
from jaxllm.interop import hf
from jaxllm.models import base_quant, lora, transformer

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def _nodes(m) -> dict[tuple, lora.LoraWeight]:
    """Every `LoraWeight` of the table by its path (("blocks", k, part, name))."""
    found = {}

    def visit(path, x):
        if lora.is_node(x):
            found[tuple(hf._key_name(k) for k in path)] = x
        return x

    jax.tree_util.tree_map_with_path(visit, transformer.param_table(m), is_leaf=lora.is_node)
    return found


def _layouts(m) -> dict[tuple, tuple]:
    """Per adapted weight: (its entry, the einops layouts of lora_A and lora_B, file -> ours, for one layer)."""
    entries, out = hf.leaf_entries(lora.base_model(m), interleaved=True), {}  # as `hf export` writes the base
    for path, node in _nodes(m).items():
        e = entries[path]
        src, dst = (s.strip() for s in e.pattern.split("->"))
        groups = re.findall(r"\([^)]*\)|\S+", src)
        if "{x}" in e.key or "experts" in e.key:
            raise ModelFileError(f"PEFT adapters: adapters on the routed experts ({e.key}) are not exported yet (PEFT "
                                 "addresses transformers 5's fused expert tensors by target_parameters); export the "
                                 "merged model instead (jaxllm hf export without --adapter)")
        n_in = len(node.a.shape) - 2  # A is [layers, *in, r]
        ours = dst.split()
        if e.select is not None or len(groups) != 2 or (e.order and e.order[0] in ours[:n_in]):
            raise ModelFileError(f"PEFT adapters: {e.key} is fused or reordered in this family's files "
                                 f"({m.family}); export the merged model instead (jaxllm hf export without --adapter)")
        a = f"rank {groups[1]} -> {' '.join(ours[:n_in])} rank"  # "rank": the tables' "r" is a latent's width
        b = f"{groups[0]} rank -> rank {' '.join(ours[n_in:])}"
        # an output dimension whose rows the file holds in another order (DeepSeek's interleaved RoPE pairs): B's
        b_order = None if not e.order else (1 + ours[n_in:].index(e.order[0]), np.asarray(e.order[1]))
        out[path] = (e, a, b, dict(zip(ours, node.w.shape[1:])), b_order)
    return out


def _module(e, m, path, r: int) -> str:
    return PREFIX + hf._keys(e, m, path, [r])[0][0].removesuffix(".weight")


def adapter_tensors(params, m):
    """(file key, host tensor) of every adapter, layer by layer."""
    for path, (e, a, b, _, b_order) in _layouts(m).items():
        node = hf._at(params, path)
        A, B = hf._fetch(node.a), hf._fetch(node.b)
        for r in range(A.shape[0]):
            module = _module(e, m, path, r)
            b_file = B[r] if b_order is None else np.take(B[r], np.argsort(b_order[1]), axis=b_order[0])
            yield f"{module}.lora_A.weight", np.ascontiguousarray(einops.rearrange(A[r], _inverse(a)))
            yield f"{module}.lora_B.weight", np.ascontiguousarray(einops.rearrange(b_file, _inverse(b)))


def _inverse(pattern: str) -> str:
    src, dst = pattern.split("->")
    return f"{dst.strip()} -> {src.strip()}"


def save_adapter(params, m, path: str, source: str | None = None) -> None:
    """Write the adapters of `params` (model `m`, with `model.lora`) as a PEFT adapter directory `path`."""
    if os.path.exists(path) and os.listdir(path):
        raise ModelFileError(f"{path}: exists and is not empty; choose a new directory")
    tensors = dict(adapter_tensors(params, m))
    if jax.process_index():
        return
    lc, partial = m.lora, path.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(tensors, os.path.join(partial, WEIGHTS), metadata={"format": "pt"})
    modules = sorted({k.removeprefix(PREFIX).split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.rank, "lora_alpha": lc.alpha,
              "use_rslora": lc.rslora, "target_modules": modules, "lora_dropout": lc.dropout, "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "base_model_name_or_path": os.path.abspath(source) if source else None}
    with open(os.path.join(partial, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if os.path.isdir(path):
        os.rmdir(path)
    os.replace(partial, path)


def read_config(path: str) -> dict:
    """`model.lora` keys from a PEFT adapter directory's adapter_config.json (ModelFileError for what jaxllm
    cannot compute exactly)."""
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{file}: not a readable adapter config ({e})") from None
    refusals = [(c.get("peft_type") != "LORA", f"peft_type {c.get('peft_type')!r} (only LORA)"),
                (c.get("bias", "none") != "none", f"bias {c.get('bias')!r} (only 'none')"),
                (bool(c.get("modules_to_save")), "modules_to_save (fully trained modules beside the adapters)"),
                (bool(c.get("rank_pattern") or c.get("alpha_pattern")), "per-module rank_pattern/alpha_pattern"),
                (bool(c.get("use_dora")), "DoRA"), (bool(c.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D)")]
    for refused, what in refusals:
        if refused:
            raise ModelFileError(f"{file}: {what} is not supported by jaxllm's adapters")
    modules = c.get("target_modules") or []
    return {"model.lora.rank": int(c["r"]), "model.lora.alpha": float(c["lora_alpha"]),
            "model.lora.rslora": bool(c.get("use_rslora", False)),
            "model.lora.targets": list(lora.TARGETS)[:7] if modules == "all-linear" else targets_of(modules)}


def check_matches(path: str, m) -> None:
    """ConfigError unless `model.lora` is the adapter directory's rank, alpha, scaling and targets."""
    want, lc = read_config(path), m.lora
    have = {"model.lora.rank": lc.rank, "model.lora.alpha": float(lc.alpha), "model.lora.rslora": lc.rslora,
            "model.lora.targets": list(lc.targets)}
    for k, v in want.items():
        if (sorted(v) if isinstance(v, list) else v) != (sorted(have[k]) if isinstance(v, list) else have[k]):
            shown = json.dumps(v).lower() if isinstance(v, bool) else json.dumps(v)
            raise ConfigError(f"init.adapter: {path} was trained with {k} = {shown}, this run has "
                              f"{json.dumps(have[k])}; set {k}={shown}")


def load_adapter(path: str, params, m):
    """`params` (with `LoraWeight` nodes of model `m`) with A and B read from the PEFT directory `path`."""
    check_matches(path, m)
    file = os.path.join(path, WEIGHTS)
    try:
        handle = safe_open(file, "numpy")
    except (OSError, SafetensorError) as e:
        raise ModelFileError(f"{file}: not a readable safetensors file ({e})") from None
    keys, used = set(handle.keys()), set()

    def read(key: str, pattern: str, sizes: dict):
        if key not in keys:
            raise ModelFileError(f"{file}: no tensor '{key}'; the adapter does not target what model.lora.targets "
                                 "names on this model")
        used.add(key)
        letters = {k: v for k, v in sizes.items() if k in pattern}
        return einops.rearrange(handle.get_tensor(key).astype(np.float32), pattern, **letters)

    for path_, (e, a, b, sizes, b_order) in _layouts(m).items():
        node = hf._at(params, path_)
        n = node.a.shape[0]
        A = np.stack([read(f"{_module(e, m, path_, r)}.lora_A.weight", a, sizes) for r in range(n)])
        B = np.stack([read(f"{_module(e, m, path_, r)}.lora_B.weight", b, sizes) for r in range(n)])
        B = B if b_order is None else np.take(B, b_order[1], axis=1 + b_order[0])  # past the layer dimension
        for mine, got in ((node.a, A), (node.b, B)):
            if mine.shape != got.shape:
                raise ModelFileError(f"{file}: adapter of {e.key} has shape {got.shape}, this model's {mine.shape}")
        params = _set(params, path_, node.replace(a=jax.device_put(A, node.a.sharding),
                                                   b=jax.device_put(B, node.b.sharding)))
    unused = sorted(keys - used)
    if unused:
        raise ModelFileError(f"{file}: {len(unused)} tensors target modules model.lora.targets leaves out "
                             f"(first: {unused[0]}); add their targets")
    return params


def _set(tree, path: tuple, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, list):
        return [_set(t, rest, value) if i == head else t for i, t in enumerate(tree)]
    return {**tree, head: _set(tree[head], rest, value)}


def merged(params):
    """The parameters with every adapter merged into its base weight, W + scale·A·B, in fp32."""
    def merge(x):
        if not lora.is_node(x):
            return x
        lead = x.w.shape[:x.a.ndim + x.b.ndim - x.w.ndim - 2]  # the stacking dimensions (layers, experts)
        rank = x.a.shape[-1]
        a = x.a.reshape(*lead, -1, rank).astype(np.float32)
        b = x.b.reshape(*lead, rank, -1).astype(np.float32)
        delta = (a @ b).reshape(x.w.shape)
        w = base_quant.dequantize(x.w, np.float32) if base_quant.is_quantized(x.w) else x.w.astype(np.float32)
        return w + x.scale * delta

    return jax.jit(lambda p: jax.tree.map(merge, p, is_leaf=lora.is_node))(params)


def targets_of(modules: list[str]) -> list[str]:
    """model.lora.targets from PEFT's target_modules (the Hugging Face module names)."""
    names = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
             "down_proj": "down", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
             "kv_b_proj": "kv_b"}
    unknown = [x for x in ([modules] if isinstance(modules, str) else modules) if x not in names]
    if unknown:
        raise ModelFileError(f"adapter target_modules {unknown} are not weights jaxllm can adapt; known: "
                             f"{', '.join(names)}")
    return sorted({names[x] for x in modules}, key=list(lora.TARGETS).index)

