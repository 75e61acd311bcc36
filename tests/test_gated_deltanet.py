"""The Gated DeltaNet layer (`jaxllm/models/gated_deltanet.py`) against transformers' `Qwen3NextGatedDeltaNet`
(its pure-torch path) with the same random weights, and packed documents against each document alone."""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.gated_deltanet import GatedDeltaNetSizes, gated_deltanet

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

D, HK, HV, DK, DV, K = 64, 2, 4, 8, 12, 4
SIZES = GatedDeltaNetSizes(HK, HV, DK, DV, K, 1e-6)


def _torch_layer():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    # no fused kernel may stand in for the torch functions: neither FLA, causal-conv1d nor the kernels hub
    for package in ("fla", "causal_conv1d", "kernels"):
        assert importlib.util.find_spec(package) is None, package
    config = Qwen3NextConfig(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
                             linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=K,
                             num_hidden_layers=1, rms_norm_eps=1e-6, hidden_act="silu")
    assert config.layer_types[0] == "linear_attention"
    torch.manual_seed(0)
    layer = m.Qwen3NextGatedDeltaNet(config, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(1)
    scales = {"in_proj_qkvz.weight": D ** -0.5, "in_proj_ba.weight": D ** -0.5, "conv1d.weight": 0.5,
              "dt_bias": 0.5, "A_log": 0.5, "norm.weight": 0.3, "out_proj.weight": (HV * DV) ** -0.5}
    with torch.no_grad():
        for name, param in layer.named_parameters():
            new = torch.randn(param.shape, generator=gen) * scales[name]
            if name == "norm.weight":
                new = new + 1.0
            if name == "A_log":
                new = new - 1.0  # decays exp(-softplus(..) e^A_log) of a few per cent a token: the state matters
            param.copy_(new)
    p = {"in_proj_qkvz": layer.in_proj_qkvz.weight.T, "in_proj_ba": layer.in_proj_ba.weight.T,
         "conv1d": layer.conv1d.weight[:, 0, :], "dt_bias": layer.dt_bias, "A_log": layer.A_log,
         "norm": layer.norm.weight, "out_proj": layer.out_proj.weight.T}
    return layer, {name: jnp.asarray(w.detach().numpy()) for name, w in p.items()}


def test_matches_transformers():
    layer, p = _torch_layer()
    x = np.random.default_rng(2).normal(size=(2, 37, D)).astype(np.float32)  # 37: not a multiple of the chunk
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    for chunk in (64, 16):
        got = np.asarray(gated_deltanet(p, jnp.asarray(x), SIZES, chunk=chunk))
        err = np.abs(got - want).max()
        assert err <= 1e-5 * np.abs(want).max(), (chunk, err, np.abs(want).max())


def test_packed_documents_equal_each_alone():
    _, p = _torch_layer()
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 37, D)).astype(np.float32))
    n1 = 21  # the second document starts inside a chunk of 16
    seg = jnp.asarray([[1] * n1 + [2] * (37 - n1)])
    for chunk in (64, 16):
        packed = np.asarray(gated_deltanet(p, x, SIZES, chunk=chunk, segment_ids=seg))
        first = np.asarray(gated_deltanet(p, x[:, :n1], SIZES, chunk=chunk))
        second = np.asarray(gated_deltanet(p, x[:, n1:], SIZES, chunk=chunk))
        scale = np.abs(packed).max()
        np.testing.assert_allclose(packed[:, :n1], first, atol=1e-5 * scale, rtol=0)
        np.testing.assert_allclose(packed[:, n1:], second, atol=1e-5 * scale, rtol=0)
    # the test can see a leak: without the segment ids the second document differs, in its first K - 1 tokens
    # (the conv window) and after them (the state)
    joint = np.asarray(gated_deltanet(p, x, SIZES))
    leak = np.abs(joint[:, n1:] - second).max(axis=(0, 2))
    assert leak[:K - 1].min() > 1e-3 * scale and leak[K:].max() > 1e-3 * scale, leak
