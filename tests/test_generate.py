"""Generation with the KV cache (`jaxllm.generate`) computes what the model computes without one.

- Greedy generation with the cache equals the no-cache model token for token over 32 new tokens, its
  logits within 1e-5 of the full forward pass (fp32), for a batch whose prompts are left-padded by 0 and
  5 tokens; the reference runs each prompt alone, unpadded, through the training forward pass, so
  positions from the mask, the cache's slots and the padding are all checked. Every step's top-1/top-2
  margin is > 1e-4, so equal tokens are not luck and unequal ones not a near-tie.
- On dp×fsdp×tp (ZeRO-3) and ep meshes generation equals one device (tokens, logits 1e-5); the
  end-of-run sample on pp, sp, tp and ep meshes is in test_evaluation.py.
- Sampling: temperature → 0 is argmax; top-k and top-p never leave the k best and the nucleus; draws
  follow the (truncated) distribution by a χ² test on 20,000 draws; the returned log-probabilities equal
  the trainer's recomputation at the same temperature (≤ 1e-5).
- Requests past the model's positions are refused with one line; `jaxllm generate` serves run
  directories.

Comparisons with transformers' `generate` are in test_generate_hf.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import equivalence_config, step_fns, tiers
from jaxllm.errors import ConfigError
from jaxllm.generate import generate, generate_arrays
from jaxllm.generate.sampling import sample
from jaxllm.models import transformer
from jaxllm.trainer.objectives import Objective

NEW, LOGIT_ATOL, MIN_MARGIN = 32, 1e-5, 1e-4
PROMPTS = [list(range(5, 16)), list(range(40, 46))]  # 11 and 6 tokens: left-padded by 0 and 5 in one batch
# Weights of std 0.1 (not the presets' 0.02) put the tiny models' logits ~3 apart, far from ties.
BASE = {"model.init_std": 0.1, "model.seq_len": 64}


def config(preset: str, **over):
    return equivalence_config(preset, **BASE, **over)


def params_of(cfg):
    return transformer.init_params(cfg.model, jax.random.key(0))


def uncached_greedy(params, m, prompts, new: int):
    """(tokens [rows, new], logits [rows, new, vocab]): each prompt alone through the full forward pass for
    every new token (no cache, no left padding: tokens at positions 0.., padding after them)."""
    width = max(map(len, prompts)) + new

    @jax.jit
    def logits(tokens, filled):
        positions = jnp.broadcast_to(jnp.arange(width), tokens.shape)
        with jax.default_matmul_precision("highest"):
            x = transformer.embed(params, tokens, positions, m, jnp.float32)
            x, _ = transformer.blocks(params["blocks"], x, positions, filled, m, jnp.float32)
            return transformer.head_logits(params, x, m, jnp.float32)[..., :m.vocab_size]

    seqs, out_tokens, out_logits = [list(p) for p in prompts], [], []
    for _ in range(new):
        tokens, filled = np.zeros((len(seqs), width), np.int32), np.zeros((len(seqs), width), np.int32)
        for r, s in enumerate(seqs):
            tokens[r, :len(s)], filled[r, :len(s)] = s, 1
        step = np.asarray(logits(tokens, filled))[np.arange(len(seqs)), [len(s) - 1 for s in seqs]]
        out_logits.append(step)
        out_tokens.append(step.argmax(-1))
        for s, t in zip(seqs, out_tokens[-1]):
            s.append(int(t))
    return np.stack(out_tokens, 1), np.stack(out_logits, 1)


def assert_decodes_as_the_forward(params, cfg, prompts, new: int) -> None:
    """Greedy generation's logits at each new token within 1e-5 of the whole sequence's forward pass (each prompt
    and what it generated, alone), and each token their argmax."""
    got = generate_arrays(params, cfg, prompts, new, temperature=0.0, keep_logits=True)
    for r, prompt in enumerate(prompts):
        seq = np.asarray([prompt + [int(t) for t in got["tokens"][r, :-1]]], np.int32)
        full = np.asarray(transformer.logits(params, jnp.asarray(seq), cfg.model))[0]
        want = full[len(prompt) - 1:]  # the logits that chose each new token
        np.testing.assert_allclose(got["logits"][r], want, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(got["tokens"][r], want.argmax(-1))


def margins(logits) -> np.ndarray:
    top = np.sort(logits, axis=-1)
    return top[..., -1] - top[..., -2]


def dropless(m):
    import dataclasses

    return dataclasses.replace(m, moe=dataclasses.replace(m.moe, capacity_factor=0.0)) if "moe" in m.pattern else m


@pytest.mark.parametrize("preset", tiers(("tiny-llama", "tiny-gpt2", "tiny-moe"), {"tiny-llama"}))
def test_cached_greedy_equals_the_model_without_a_cache(preset):
    cfg = config(preset)
    params = params_of(cfg)
    got = generate_arrays(params, cfg, PROMPTS, NEW, temperature=0.0, keep_logits=True)
    tokens, logits = uncached_greedy(params, dropless(cfg.model), PROMPTS, NEW)
    assert margins(logits).min() > MIN_MARGIN
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, rtol=0, atol=LOGIT_ATOL)
    assert (got["lengths"] == NEW).all() and not got["stopped"].any()


def test_each_row_stops_after_its_first_stop_id():
    cfg = config("tiny-llama")
    params = params_of(cfg)
    free = generate_arrays(params, cfg, PROMPTS, NEW, temperature=0.0, keep_logits=True)
    stop = (int(free["tokens"][0, 3]), int(free["tokens"][1, 5]))
    got = generate_arrays(params, cfg, PROMPTS, NEW, temperature=0.0, keep_logits=True, stop_ids=stop)
    for r in range(len(PROMPTS)):
        first = min(i for i, t in enumerate(free["tokens"][r]) if t in stop)
        assert got["lengths"][r] == first + 1 and got["stopped"][r]
        np.testing.assert_array_equal(got["tokens"][r, :first + 1], free["tokens"][r, :first + 1])


MESHES = {  # name -> (preset, mesh and options)
    "dp2_fsdp2_tp2_zero3": ("tiny-llama", {"mesh.dp": 2, "mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3}),
    "ep4_fsdp2_zero3": ("tiny-moe", {"mesh.ep": 4, "mesh.fsdp": 2, "train.zero_stage": 3}),
}  # pp, sp, tp and ep meshes sample as one device does in test_evaluation.py


@pytest.mark.slow
@pytest.mark.parametrize("name", MESHES)
def test_generation_on_a_mesh_equals_one_device(name):
    preset, over = MESHES[name]
    one = config(preset, **{k: v for k, v in over.items() if k.startswith("model.")})
    cfg = config(preset, **over)
    params, fns = params_of(one), step_fns(cfg)
    prompts = PROMPTS + [[7, 8, 9]]  # 3 rows: padded to the 4 batch shards of some meshes
    ref = generate_arrays(params, one, prompts, NEW, temperature=0.0, keep_logits=True)
    got = generate_arrays(jax.device_put(params, fns.state_shardings.params), cfg, prompts, NEW, on=fns,
                          temperature=0.0, keep_logits=True)
    assert margins(ref["logits"]).min() > MIN_MARGIN
    np.testing.assert_array_equal(got["tokens"], ref["tokens"])
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=LOGIT_ATOL)
    # a row's draws do not depend on the mesh (the same two programs: sampling settings are arguments)
    sampled = dict(temperature=0.8, top_k=20, top_p=0.9, seed=3, keep_logits=True)
    a = generate_arrays(params, one, prompts, NEW, **sampled)
    b = generate_arrays(jax.device_put(params, fns.state_shardings.params), cfg, prompts, NEW, on=fns, **sampled)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])


# ---------------------------------------------------------------- sampling

DRAWS = 20_000
_sample = jax.jit(sample)


def draw(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, n=DRAWS) -> np.ndarray:
    """n tokens sampled from one row of logits, each draw with its own key."""
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    keys = jax.random.split(jax.random.key(seed), n)
    tokens, _ = _sample(rows, keys, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
    return np.asarray(tokens)


def reference_distribution(logits, temperature, top_k, top_p) -> np.ndarray:
    """The distribution sampling should follow, in float64 with numpy: softmax(logits / T) over the k best,
    renormalised, then over the fewest best tokens whose mass reaches top_p, renormalised."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z)
    keep = order[:top_k] if top_k else order
    p = np.exp(z[keep] - z[keep].max())
    p /= p.sum()
    nucleus = keep[:int(np.searchsorted(np.cumsum(p), top_p)) + 1]
    out = np.zeros(len(z))
    out[nucleus] = np.exp(z[nucleus] - z[nucleus].max())
    return out / out.sum()


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The χ² value exceeded with probability 0.001 (z = 3.09), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


LOGITS = [2.0, 1.5, 1.2, 0.4, 0.0, -0.3, -1.0, -2.5]


@pytest.mark.parametrize("temperature, top_k, top_p", tiers([(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 6, 0.7)],
                                           {(0.9, 6, 0.7)}))
def test_draws_follow_the_truncated_distribution(temperature, top_k, top_p):
    expected = reference_distribution(LOGITS, temperature, top_k, top_p)
    counts = np.bincount(draw(LOGITS, temperature, top_k, top_p), minlength=len(LOGITS))
    assert counts[expected == 0].sum() == 0  # never outside the k best or the nucleus
    seen = expected > 0
    chi2 = float(np.sum((counts[seen] - DRAWS * expected[seen]) ** 2 / (DRAWS * expected[seen])))
    assert chi2 < chi2_critical(int(seen.sum()) - 1), (chi2, counts, expected)


def test_truncation_never_leaves_the_k_best_or_the_nucleus():
    logits = np.random.default_rng(0).normal(size=50) * 2
    order = np.argsort(-logits)
    for k in (1, 3, 10):
        assert set(draw(logits, 1.5, k, seed=k, n=4000)) <= set(order[:k])
    for p in (0.3, 0.6, 0.9):
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        nucleus = order[:int(np.searchsorted(np.cumsum(probs[order]), p)) + 1]
        got = set(draw(logits, 1.0, 0, p, seed=1, n=4000))
        assert got <= set(nucleus) and len(got) == len(nucleus)


def test_temperature_towards_zero_is_argmax():
    logits = np.random.default_rng(1).normal(size=(64, 40)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 64)
    for t in (0.0, 1e-4):
        tokens, logp = _sample(jnp.asarray(logits), keys, jnp.float32(t), jnp.int32(0), jnp.float32(1.0))
        np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
        if t == 0:  # greedy: log-probabilities at temperature 1
            expected = jax.nn.log_softmax(logits)[np.arange(64), logits.argmax(-1)]
            np.testing.assert_allclose(np.asarray(logp), expected, rtol=0, atol=1e-6)


def _token_logp(params, cfg, prompts, completions, temperature):
    """Each new token's log-probability recomputed as the train step computes it: the objective's per-token
    term (`transformer.forward`, the loss head at the temperature), read as the gradient of Σ w·logp by w."""
    m = dropless(cfg.model)
    seqs = [p + list(c) for p, c in zip(prompts, completions)]
    width = max(map(len, seqs)) - 1
    batch = {k: np.zeros((len(seqs), width), np.int32) for k in ("inputs", "targets", "segment_ids")}
    for r, s in enumerate(seqs):
        batch["inputs"][r, :len(s) - 1], batch["targets"][r, :len(s) - 1] = s[:-1], s[1:]
        batch["segment_ids"][r, :len(s) - 1] = 1
    batch["positions"] = np.broadcast_to(np.arange(width), (len(seqs), width))
    terms = Objective("probe", count=lambda b: 1.0, token_terms=lambda logp, lse, b: (jnp.sum(logp * b["w"]), {}))

    def total(w):
        with jax.default_matmul_precision("highest"):
            return transformer.forward(params, {**batch, "w": w}, m, jnp.float32, terms.token_terms,
                                       temperature=temperature)[0]

    logp = np.asarray(jax.grad(total)(jnp.zeros((len(seqs), width))))
    return [logp[r, len(p) - 1:len(s) - 1] for r, (p, s) in enumerate(zip(prompts, seqs))]


@pytest.mark.parametrize("preset", tiers(("tiny-llama", "tiny-moe"), {"tiny-llama"}))
def test_returned_logprobs_equal_the_trainers_recomputation(preset):
    cfg = config(preset)
    params = params_of(cfg)
    done = generate(params, cfg, PROMPTS, 16, temperature=0.7, top_k=20, top_p=0.9, seed=5)
    recomputed = _token_logp(params, cfg, PROMPTS, [c.tokens.tolist() for c in done], 0.7)
    for c, want in zip(done, recomputed):
        np.testing.assert_allclose(c.logprobs, want, rtol=0, atol=1e-5)
    assert min(len(c.tokens) for c in done) == 16


# ---------------------------------------------------------------- refusals and the command line


def test_a_request_past_the_models_positions_is_refused_in_one_line():
    cfg = config("tiny-gpt2")  # learned positions: 64
    with pytest.raises(ConfigError, match=r"a prompt of 60 tokens plus 5 new ones is 65 positions, more than the "
                                          r"model's 64 \(model.max_positions\)"):
        generate({}, cfg, [[1] * 60, [2]], 5)
    with pytest.raises(ConfigError, match="outside the model's vocabulary of 257"):
        generate({}, cfg, [[300]], 5)


@pytest.mark.slow
def test_the_command_line_serves_run_directories_and_hf_directories(tmp_path, capsys, caplog):
    """`jaxllm generate` from an imported run and from the Hugging Face directory it came from prints the same
    greedy text (the HF tokenizer's <|begin_of_text|> first) and the speed."""
    import shutil

    import hf_families
    from jaxllm.cli import generate as tool
    from jaxllm.cli import hf as hf_tool

    caplog.set_level("INFO", logger="jaxllm")
    hf_dir = hf_families.build("llama3", str(tmp_path / "hf"), vocab_size=640)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{hf_families.__file__.rsplit('/', 1)[0]}/fixtures/hf_tokenizer/{name}", hf_dir)
    assert hf_tool.main(["import", hf_dir, str(tmp_path / "run"), "model.seq_len=64"]) == 0
    args = ["--prompt", "def fib(n):", "--prompt", "hi", "--max-new-tokens", "12", "--greedy", "model.seq_len=64",
            "precision.compute=float32"]
    texts = []
    for source in (str(tmp_path / "run"), f"hf:{hf_dir}"):
        capsys.readouterr()
        caplog.clear()
        assert tool.main(["--from", source, *args]) == 0
        texts.append(capsys.readouterr().out)
        assert "new tokens in" in caplog.text and "tokens/s" in caplog.text
    assert texts[0] == texts[1] and texts[0].startswith("<|begin_of_text|>def fib(n):")
    assert len(texts[0].splitlines()) == 2
