"""Greedy generation against transformers' `generate(do_sample=False)`, token for token, on tiny random
Hugging Face models of every family (`hf_families.py`), imported into jaxllm in fp32 on one device.

Three prompts of 13, 6 and 2 tokens generate 32 new tokens each, with no stop ids (every row runs the
full length). jaxllm left-pads them to its bucket of 16 (by 3, 10 and 14 tokens); transformers gets them
left-padded to 13 (by 0, 7 and 11) with an attention mask, and also each prompt alone, unpadded: that run
is the ground truth, so a difference that came from transformers' own handling of padding would show as
its two runs disagreeing. What is compared:

- the new tokens, row by row and step by step, with both transformers runs;
- jaxllm's logits at every step with transformers' raw logits (`output_logits`) of the padded run
  (at most 1e-4 apart, as the import tests in test_hf_interop.py).

Why the margins matter: greedy decoding takes the argmax, so where a step's best two logits are closer
than the numerical differences between two correct fp32 implementations (~1e-5 here), either token is
right and a mismatch would say nothing. The test first asserts, from jaxllm's logits, that the best
logit beats the second by more than 1e-4 at every step of every row, so any token mismatch is a real one.

The checkpoints are built with hf_families' WEIGHT_STD (every weight matrix but embeddings, lm_head, routers)
at 0.2, the issue's "initialiser range ~0.2", instead of its default 0.1. At 0.1 the tied-embedding models
(gpt2, llama3.2, qwen2) fall into repeating one or two tokens, which tests neither the cache nor the
positions, and on other prompts llama2 and mistral reached a step with a top-2 margin of 9.7e-5. At 0.2
every row produces at least 8 distinct tokens (asserted) and the smallest margin over the families is
9e-4 (qwen2), 40 times the largest logit difference from transformers (2e-5).

Qwen3, Gemma 2 and Gemma 3 generate from checkpoints with an untied head (`UNTIED`): tied, their rows fall
into repeating one to five tokens (the last token's own embedding wins; Gemma's scaled embedding and sandwich
norms make it worse), for every seed tried; untied, every row has at least 17 distinct tokens and the
smallest top-2 margin is 4e-4. The tied forms are what test_hf_interop.py's logits tests import.

GPT-2 is the fast-tier case: its learned absolute positions are what a wrong position for a padded row
changes; RoPE sees only position differences, so a row's positions all off by the same amount (e.g.
counted from the slot, padding included) give RoPE models the same result.
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_families as H
from harness import tiers
from jaxllm.generate.decode import generate_arrays
from jaxllm.interop import hf
from jaxllm.models import transformer

NEW = 32
_RNG = np.random.default_rng(1)
PROMPTS = [_RNG.integers(0, H.VOCAB_SIZE, n).tolist() for n in (13, 6, 2)]  # unrelated random prompts
PAD = 0  # a real token id: were the mask ignored, the padding would change the result
INIT_STD = 0.2
MIN_MARGIN = 1e-4
LOGIT_ATOL = 1e-4
MIN_DISTINCT = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """family -> its float32 checkpoint directory, built on first use and kept for the file."""
    root, built = tmp_path_factory.mktemp("generate_hf"), {}

    def get(family: str, **overrides) -> str:
        name = "-".join([family, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
        if name not in built:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(H, "WEIGHT_STD", INIT_STD)
                built[name] = H.build(family, str(root / name), **overrides)
        return built[name]

    return get


def ours(path: str) -> tuple[np.ndarray, np.ndarray]:
    """jaxllm's greedy tokens [rows, NEW] and fp32 logits [rows, NEW, vocab] for PROMPTS, one device."""
    cfg, params = hf.load_pretrained(path, overrides={"precision.compute": "float32"})
    out = generate_arrays(params, cfg, PROMPTS, NEW, temperature=0.0, keep_logits=True)
    assert (out["lengths"] == NEW).all() and not out["stopped"].any()
    return out["tokens"], out["logits"]


def transformers_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def theirs(model, prompts: list) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy tokens [rows, NEW] and raw logits [rows, NEW, vocab] for `prompts`, left-padded
    to the longest with PAD and an attention mask; end-of-sequence stopping off (eos_token_id=None)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, width:].numpy(), torch.stack(out.logits, 1).float().numpy()


def margins(logits: np.ndarray) -> np.ndarray:
    """The best logit minus the second best, per row and step."""
    best = np.sort(logits, axis=-1)[..., -2:]
    return best[..., 1] - best[..., 0]


def top2(logits: np.ndarray) -> str:
    ids = np.argsort(logits)[::-1][:2]
    return ", ".join(f"{i}: {logits[i]:.6f}" for i in ids)


def assert_same_tokens(family: str, what: str, tokens, logits, ref_tokens, ref_logits=None):
    """Row by row, the first step where `tokens` and `ref_tokens` differ, with both sides' best two logits."""
    for r in range(len(PROMPTS)):
        differ = np.flatnonzero(tokens[r] != ref_tokens[r])
        if differ.size:
            s = differ[0]
            theirs_at = "" if ref_logits is None else f"; transformers' top-2 {top2(ref_logits[r, s])}"
            pytest.fail(f"{family}: row {r} (prompt of {len(PROMPTS[r])}) differs from {what} at step {s}: "
                        f"jaxllm {tokens[r, s]}, transformers {ref_tokens[r, s]}; jaxllm's top-2 "
                        f"{top2(logits[r, s])}{theirs_at}")


UNTIED = {"qwen3", "gemma2", "gemma3"}  # see the module's docstring
# transformers' Llama 4 counts a row's left padding into the positions of its attention temperature tuning (an
# arange over the cache, not the position ids), so its left-padded batch disagrees with its own unpadded runs (up
# to 11 in a logit here; equal with the tuning off): there jaxllm is held to the unpadded runs, tokens and logits
PADDING_DIFFERS = {"llama4"}


@pytest.mark.parametrize("family", tiers(H.FAMILIES, {"gpt2"}))
def test_greedy_generation_equals_transformers(family, checkpoint):
    path = checkpoint(family, **({"tie_word_embeddings": False} if family in UNTIED else {}))
    tokens, logits = ours(path)
    margin = margins(logits)
    r, s = np.unravel_index(np.argmin(margin), margin.shape)
    assert margin[r, s] > MIN_MARGIN, f"{family}: near-tie at row {r}, step {s}: top-2 {top2(logits[r, s])}"
    distinct = min(len(set(row)) for row in tokens.tolist())
    assert distinct >= MIN_DISTINCT, f"{family}: a row has only {distinct} distinct new tokens"

    model = transformers_model(path)
    alone = [theirs(model, [p]) for p in PROMPTS]
    assert_same_tokens(family, "transformers on the prompt alone", tokens, logits,
                       np.concatenate([a[0] for a in alone]))
    if family in PADDING_DIFFERS:
        ref_tokens, ref_logits = (np.concatenate([a[i] for a in alone]) for i in (0, 1))
    else:
        ref_tokens, ref_logits = theirs(model, PROMPTS)
    what = "transformers on the prompt alone" if family in PADDING_DIFFERS else "transformers' left-padded batch"
    assert_same_tokens(family, what, tokens, logits, ref_tokens, ref_logits)
    diff = np.abs(logits - ref_logits).max()
    assert diff <= LOGIT_ATOL, f"{family}: logits differ from transformers' by up to {diff:.3g}"


WINDOW = 16  # shorter than every row's prompt and new tokens together (34 to 45), and than the 64-token logits


WINDOWED = {  # a window on every layer (Mistral), on the second of two layers only (Qwen2's max_window_layers)
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, max_window_layers=1, sliding_window=WINDOW),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_windows_equal_transformers(family, checkpoint):
    """Windows (16) shorter than what the model reads: logits over 64 tokens within 1e-4 of transformers', and
    greedy generation equal token for token over 32 new tokens (the cache keeps every slot; the window masks)."""
    import jax
    import jax.numpy as jnp

    path = checkpoint(family, **WINDOWED[family])
    tokens = H.sample_tokens(H.VOCAB_SIZE, 2, 64, 0)
    cfg, params = hf.load_pretrained(path, overrides={"model.seq_len": 64, "precision.compute": "float32"})
    assert cfg.model.sliding_window == WINDOW
    logits = np.asarray(jax.jit(lambda p, t: transformer.logits(p, t, cfg.model))(params, jnp.asarray(tokens)))
    diff = np.abs(logits - H.reference_logits(path, tokens)).max()
    assert diff <= LOGIT_ATOL, f"{family}: windowed logits differ from transformers' by up to {diff:.3g}"

    ours_tokens, ours_logits = ours(path)
    assert margins(ours_logits).min() > MIN_MARGIN
    ref_tokens, ref_logits = theirs(transformers_model(path), PROMPTS)
    assert_same_tokens(family, "transformers' left-padded batch", ours_tokens, ours_logits, ref_tokens, ref_logits)


@pytest.mark.slow
def test_deepseek_with_yarn_generates_as_transformers(checkpoint):
    """DeepSeek-V3 with YaRN and `mscale_all_dim` (the softmax scale changes too): greedy generation over the latent
    cache (absorbed up-projections) equals transformers' token for token, logits within 1e-4, margins asserted."""
    path = checkpoint("deepseek_v3", rope_parameters=dict(H.DEEPSEEK_YARN))
    tokens, logits = ours(path)
    assert margins(logits).min() > MIN_MARGIN
    ref_tokens, ref_logits = theirs(transformers_model(path), PROMPTS)
    assert_same_tokens("deepseek_v3", "transformers' left-padded batch", tokens, logits, ref_tokens, ref_logits)
    assert np.abs(logits - ref_logits).max() <= LOGIT_ATOL
