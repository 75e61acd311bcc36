"""The Gated DeltaNet layer (`jaxllm/models/gated_deltanet.py`) against transformers' `Qwen3NextGatedDeltaNet`
(its pure-torch path) with the same random weights, and packed documents against each document alone."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import gated_deltanet as layer_lib
from jaxllm.models.gated_deltanet import GatedDeltaNetSizes, empty_state, from_hf, state_bytes, to_hf

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

D, HK, HV, DK, DV, K = 64, 2, 4, 8, 12, 4
SIZES = GatedDeltaNetSizes(HK, HV, DK, DV, K, 1e-6)
gated_deltanet = jax.jit(layer_lib.gated_deltanet, static_argnames=("sizes", "chunk"))
cached_gated_deltanet = jax.jit(layer_lib.cached_gated_deltanet, static_argnames=("sizes", "chunk"))


@functools.lru_cache(maxsize=None)  # one layer for the module's tests
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
    hf = {name: w.detach().numpy() for name, w in layer.state_dict().items()}
    return layer, {name: jnp.asarray(w) for name, w in from_hf(hf, SIZES).items()}


def test_matches_transformers():
    layer, p = _torch_layer()
    x = np.random.default_rng(2).normal(size=(2, 37, D)).astype(np.float32)  # 37: not a multiple of the chunk
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    for chunk in (64, 16):
        got = np.asarray(gated_deltanet(p, jnp.asarray(x), SIZES, chunk=chunk))
        err = np.abs(got - want).max()
        assert err <= 1e-5 * np.abs(want).max(), (chunk, err, np.abs(want).max())


@pytest.mark.slow  # the fast tier packs the recurrence alone (test_gated_delta.py)
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


def test_transformers_layout_round_trips_bit_for_bit():
    layer, p = _torch_layer()
    hf = {name: w.detach().numpy() for name, w in layer.state_dict().items()}
    back = to_hf({name: np.asarray(w) for name, w in p.items()}, SIZES)
    assert set(back) == set(hf)
    for name, w in hf.items():
        np.testing.assert_array_equal(back[name], w, err_msg=name)


def test_carried_state_continues_the_sequence():
    """A prompt (after left padding, its own document), then tokens one at a time with the carried state, equals
    the whole sequence at once: the state and window are all that pass between calls, and they do not grow."""
    _, p = _torch_layer()
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 30, D)).astype(np.float32))
    pad, prompt = 3, 20
    want = np.asarray(gated_deltanet(p, x[:, pad:], SIZES, chunk=16))
    resets = jnp.zeros((2, prompt), bool).at[:, 0].set(True).at[:, pad].set(True)  # padding, then the prompt
    start = empty_state(SIZES, 2, jnp.float32)
    y, carried = cached_gated_deltanet(p, x[:, :prompt], SIZES, start, resets, chunk=16)
    got = [np.asarray(y[:, pad:])]
    for t in range(prompt, 30):
        y, carried = cached_gated_deltanet(p, x[:, t:t + 1], SIZES, carried, jnp.zeros((2, 1), bool))
        got.append(np.asarray(y))
        assert jax.tree.map(jnp.shape, carried) == jax.tree.map(jnp.shape, start)
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert state_bytes(SIZES, 2, jnp.float32) == sum(a.nbytes for a in carried)
