"""Block-FP8 checkpoints in (`jaxllm/interop/hf.py`): a tiny DeepSeek-V3 quantized here as DeepSeek-V3 and Qwen3's
FP8 releases are published (every decoder projection E4M3 in blocks, `X.weight_scale_inv` beside it: the block's
amax / 448, which multiplies despite its name; `quantization_config` with `weight_block_size`), with fp32 scales
and with power-of-two UE8M0 ones:

- jaxllm reads it as the fp32 weights transformers' fine-grained-FP8 dequantization (its CPU path,
  `Fp8Dequantize`) gives, bit for bit, and its logits equal transformers' on those weights (1e-4, as every family);
- a dimension that is not a multiple of the block has a partial last block (DeepSeek-V3's kv_a_proj, 576 rows in
  blocks of 128), read as a NumPy reference does;
- export from it writes every tensor as the source holds it (fp8 bytes and scales carried, not recomputed), a
  projection that changed quantized in the source's blocks (against the reference quantizer here);
- another kind of quantization is refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import pytest

import hf_families as H
from jaxllm.errors import ModelFileError
from jaxllm.interop import hf

from test_hf_interop import our_logits, TOKENS

BLOCK = 8  # the tiny model's projection widths are multiples of 8 (the published block is 128)
PROJECTIONS = re.compile(r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"
                         r"(\.weight)?$|experts\.(gate_up_proj|down_proj)$")


def quantize(w: np.ndarray, block: int, power_of_two: bool) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 w / scale, scale) per block × block of w's last two dimensions; scale = amax / 448 (rounded up to a
    power of two for UE8M0)."""
    *lead, r, c = w.shape
    b = w.reshape(*lead, r // block, block, c // block, block).astype(np.float32)
    scale = np.maximum(np.abs(b).max(axis=(-3, -1), keepdims=True) / np.float32(448), np.float32(2.0 ** -100))
    if power_of_two:
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    q = np.clip(b / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(w.shape)
    return q, scale[..., 0, :, 0]


def write_block_fp8(source: str, out: str, power_of_two: bool) -> None:
    """`source`'s checkpoint with its projections in block FP8, as published."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = {}
    for name in sorted(os.listdir(source)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, name)))
            os.remove(os.path.join(out, name))
    quantized = {}
    for key, t in tensors.items():
        if PROJECTIONS.search(key) and t.ndim >= 2:
            q, s = quantize(t.numpy(), BLOCK, power_of_two)
            quantized[key] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            scales = torch.from_numpy(s)
            quantized[key + "_scale_inv"] = scales.to(torch.float8_e8m0fnu) if power_of_two else scales
        else:
            quantized[key] = t
    save_file(quantized, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: "model.safetensors" for k in quantized}}, f)
    config = json.load(open(os.path.join(out, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    json.dump(config, open(os.path.join(out, "config.json"), "w"))


def transformers_dequantized(quantized_dir: str, out: str) -> None:
    """The block-FP8 checkpoint dequantized by transformers' own fine-grained-FP8 code (its CPU path), saved fp32."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = load_file(os.path.join(quantized_dir, "model.safetensors"))
    dequantize = Fp8Dequantize(None)
    plain = {k: dequantize._dequantize_one(t, tensors[k + "_scale_inv"], output_dtype=tensors[k].new_empty(0,
             dtype=__import__("torch").float32).dtype) if k + "_scale_inv" in tensors else t
             for k, t in tensors.items() if not k.endswith("_scale_inv")}
    shutil.copytree(quantized_dir, out)
    os.remove(os.path.join(out, "model.safetensors.index.json"))
    save_file(plain, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(out, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(out, "config.json"), "w"))


@pytest.mark.slow  # a tiny DeepSeek-V3 through transformers: 2-5 s each
@pytest.mark.parametrize("scales", ["fp32", "ue8m0"])
def test_a_block_fp8_checkpoint_reads_as_transformers_dequantizes_it(scales, tmp_path):
    source = H.build("deepseek_v3", str(tmp_path / "fp32"))
    write_block_fp8(source, str(tmp_path / "fp8"), power_of_two=scales == "ue8m0")
    transformers_dequantized(str(tmp_path / "fp8"), str(tmp_path / "plain"))
    files = hf.Files(str(tmp_path / "fp8"))
    assert sum(files.dtype(k) == "float8_e4m3fn" for k in files.where if not hf.IGNORED.search(k)) >= 10
    _, ours = hf.load_pretrained(str(tmp_path / "fp8"))
    _, theirs = hf.load_pretrained(str(tmp_path / "plain"))
    for a, b in zip(jax_leaves(ours), jax_leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.abs(our_logits(str(tmp_path / "fp8")) - H.reference_logits(str(tmp_path / "plain"), TOKENS)).max() <= 1e-4


def jax_leaves(tree) -> list:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_partial_last_block_is_read_as_published(tmp_path):
    """A 40 × 24 weight in blocks of 16: a scale grid of 3 × 2, the last blocks 8 rows and 8 columns wide."""
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    q = rng.uniform(-448, 448, (40, 24)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, (3, 2)).astype(np.float32)
    save_file({"w.weight": torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn),
               "w.weight_scale_inv": torch.from_numpy(scale)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}}))
    want = q.astype(np.float32) * np.kron(scale, np.ones((16, 16), np.float32))[:40, :24]
    got = hf.Files(str(tmp_path)).read("w.weight", (slice(5, 37), slice(3, 24)))
    np.testing.assert_array_equal(got, want[5:37, 3:24])


def test_another_quantization_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True}}))
    with pytest.raises(ModelFileError, match="quantization_config=.*jaxllm reads block FP8") as e:
        hf.config_for(str(tmp_path))
    assert "\n" not in str(e.value)


def raw_tensors(path: str) -> dict:
    """key -> (dtype, bytes) of every tensor of a model directory, fp8 ones included."""
    files = hf.Files(path)
    return {key: (files.raw_dtype(key), files.stored(key).tobytes()) for key in files.where}


@pytest.mark.slow
@pytest.mark.parametrize("scales", ["fp32", "ue8m0"])
def test_export_carries_the_fp8_bytes_and_scales_and_quantizes_what_changed(scales, tmp_path):
    """Import → export of a block-FP8 checkpoint writes every tensor as the source holds it (the fp8 bytes and the
    scales carried, not recomputed); a projection changed by training is quantized in the source's blocks, and
    transformers reads the export."""
    import jax

    source = H.build("deepseek_v3", str(tmp_path / "fp32"))
    write_block_fp8(source, str(tmp_path / "fp8"), power_of_two=scales == "ue8m0")
    cfg, params = hf.load_pretrained(str(tmp_path / "fp8"))
    hf.save_pretrained(params, cfg, str(tmp_path / "same"), source=str(tmp_path / "fp8"))
    assert raw_tensors(str(tmp_path / "same")) == raw_tensors(str(tmp_path / "fp8"))
    assert json.load(open(tmp_path / "same" / "config.json"))["quantization_config"]["weight_block_size"] == [BLOCK] * 2

    changed = jax.tree.map(lambda x: x, params)
    changed["blocks"][0]["attn"]["wo"] = params["blocks"][0]["attn"]["wo"] * 1.5
    hf.save_pretrained(changed, cfg, str(tmp_path / "trained"), source=str(tmp_path / "fp8"))
    before, after = raw_tensors(str(tmp_path / "fp8")), raw_tensors(str(tmp_path / "trained"))
    differ = sorted(k for k in before if before[k] != after[k])
    assert differ and all(re.search(r"o_proj\.weight(_scale_inv)?$", k) for k in differ), differ
    key = differ[0].removesuffix("_scale_inv")
    want = hf.Files(str(tmp_path / "fp8")).read(key, ()) * 1.5
    q, s = quantize(want, BLOCK, power_of_two=scales == "ue8m0")
    np.testing.assert_array_equal(hf.Files(str(tmp_path / "trained")).read(key, ()),
                                  q.astype(np.float32) * np.kron(s.astype(np.float32), np.ones((BLOCK, BLOCK), np.float32)))
    assert np.isfinite(H.reference_logits(str(tmp_path / "trained"), TOKENS)).all()  # transformers loads it
