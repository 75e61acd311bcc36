"""GRPO's objective and advantages against references written per sequence: every loss normalisation and
reward scaling, zero-spread groups, the one-iteration policy gradient, clipping, the k3 term's gradient
against finite differences, and the whole step against the plain model."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.rl.advantages import group_advantages, token_fields
from jaxllm.trainer.objectives import finish, grpo, gspo

G, GROUPS, SEQ, EPS, EPS_HIGH, BETA = 4, 3, 12, 0.2, 0.28, 0.05


def fixture(seed: int = 0):
    """Rewards, completion lengths and per-token log-probabilities (policy, sampler, reference) for
    GROUPS × G completions of up to SEQ tokens; the sampler's and the reference's are near the policy's,
    so some ratios fall outside the clip range."""
    rng = np.random.default_rng(seed)
    n = G * GROUPS
    rewards = rng.integers(0, 3, n).astype(np.float64)
    rewards[:G] = 1.0  # one group with no spread
    lengths = rng.integers(1, SEQ + 1, n)
    logp = -rng.uniform(0.1, 3.0, (n, SEQ))
    old = logp + rng.normal(0, 0.3, (n, SEQ))
    ref = logp + rng.normal(0, 0.3, (n, SEQ))
    return rewards, lengths, logp, old, ref


def reference_advantages(rewards, scale):
    """Written per group: (r − mean) / (sample std + 1e-4), or over the batch, or not divided."""
    out = []
    for g in range(len(rewards) // G):
        r = rewards[g * G:(g + 1) * G]
        mean = sum(r) / G
        std = (sum((x - mean) ** 2 for x in r) / (G - 1)) ** 0.5
        if scale == "batch":
            m = sum(rewards) / len(rewards)
            std = (sum((x - m) ** 2 for x in rewards) / (len(rewards) - 1)) ** 0.5
        out += [(x - mean) / (std + 1e-4) if scale != "none" else x - mean for x in r]
    return out


def reference_loss(logp, old, ref, adv, lengths, norm, beta):
    """The GRPO loss, one completion at a time (jnp, so it can be differentiated)."""
    per_seq, total = [], 0.0
    for i, n in enumerate(lengths):
        ratio = jnp.exp(logp[i, :n] - old[i, :n])
        surrogate = jnp.minimum(ratio * adv[i], jnp.clip(ratio, 1 - EPS, 1 + EPS_HIGH) * adv[i])
        gap = ref[i, :n] - logp[i, :n]
        token = -surrogate + beta * (jnp.exp(gap) - gap - 1)
        per_seq.append(jnp.sum(token) / n)
        total = total + jnp.sum(token)
    if norm == "token":
        return total / sum(lengths)
    if norm == "sequence":
        return sum(per_seq) / len(lengths)
    return total / (len(lengths) * SEQ)


def ours(logp, old, ref, fields, beta):
    obj = grpo(EPS, EPS_HIGH, beta)
    batch = {**{k: jnp.asarray(v) for k, v in fields.items()}, "old_logp": jnp.asarray(old, jnp.float32),
             "ref_logp": jnp.asarray(ref, jnp.float32)}
    total, metrics = obj.token_terms(logp, None, batch)
    return total / obj.count(batch), metrics


@pytest.mark.parametrize("norm, scale", list(itertools.product(("token", "sequence", "constant"),
                                                               ("group", "batch", "none"))))
def test_loss_and_gradients_equal_the_per_sequence_reference(norm, scale):
    rewards, lengths, logp, old, ref = fixture()
    adv = group_advantages(rewards, G, scale)
    np.testing.assert_allclose(adv, reference_advantages(rewards, scale), rtol=1e-12, atol=1e-12)
    mask = np.arange(SEQ)[None, :] < lengths[:, None]
    fields = token_fields(adv, mask, norm, SEQ)
    mine = jax.value_and_grad(lambda lp: ours(lp, old, ref, fields, BETA)[0])(jnp.asarray(logp, jnp.float32))
    want = jax.value_and_grad(lambda lp: reference_loss(lp, old, ref, adv, lengths, norm, BETA))(
        jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(float(mine[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mine[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-8)


def test_decoupled_ppo_weighs_the_surrogate_by_the_capped_behaviour_ratio():
    """Asynchronous RL's loss (behaviour_cap C): per token −min(ρÂ, clip(ρ)Â) · min(π_prox/μ, C) + β·k3, ρ = π/π_prox,
    written per completion; some behaviour weights above C (capped), and C = 0 (synchronous) is GRPO's loss."""
    rewards, lengths, logp, old, ref = fixture(3)
    behav = old + np.random.default_rng(5).normal(0, 0.6, old.shape)  # μ: older parameters' log-probabilities
    adv = group_advantages(rewards, G, "group")
    fields = token_fields(adv, np.arange(SEQ)[None, :] < lengths[:, None], "token", SEQ)
    cap = 1.5
    batch = {**{k: jnp.asarray(v) for k, v in fields.items()}, "old_logp": jnp.asarray(old, jnp.float32),
             "ref_logp": jnp.asarray(ref, jnp.float32), "behav_logp": jnp.asarray(behav, jnp.float32)}
    obj = grpo(EPS, EPS_HIGH, BETA, behaviour_cap=cap)

    def reference(lp):
        total = 0.0
        for i, n in enumerate(lengths):
            ratio = jnp.exp(lp[i, :n] - old[i, :n])
            surrogate = jnp.minimum(ratio * adv[i], jnp.clip(ratio, 1 - EPS, 1 + EPS_HIGH) * adv[i])
            weight = jnp.minimum(jnp.exp(old[i, :n] - behav[i, :n]), cap)
            gap = ref[i, :n] - lp[i, :n]
            total = total + jnp.sum(-surrogate * weight + BETA * (jnp.exp(gap) - gap - 1))
        return total / sum(lengths)

    mine = lambda lp: obj.token_terms(lp, None, batch)[0] / obj.count(batch)
    got, want = (jax.value_and_grad(f)(jnp.asarray(logp, jnp.float32)) for f in (mine, reference))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-8)
    capped = float(obj.token_terms(jnp.asarray(logp, jnp.float32), None, batch)[1]["behaviour_capped_frac"])
    assert 0 < capped < sum(lengths)
    assert "behav_logp" in obj.fields and "behav_logp" not in grpo(EPS, EPS_HIGH, BETA).fields


def reference_gspo(logp, old, ref, adv, lengths, eps, eps_high, beta):
    """GSPO (Zheng et al. 2025, eq. 5-7), one completion at a time: s_i = exp(mean of its tokens' log π − log π_old),
    −min(s_i Â_i, clip(s_i, 1 − ε, 1 + ε_high) Â_i) + β · the mean of its tokens' k3, the mean over completions."""
    losses = []
    for i, n in enumerate(lengths):
        s = jnp.exp(jnp.mean(logp[i, :n] - old[i, :n]))
        gap = ref[i, :n] - logp[i, :n]
        kl = jnp.mean(jnp.exp(gap) - gap - 1)
        losses.append(-jnp.minimum(s * adv[i], jnp.clip(s, 1 - eps, 1 + eps_high) * adv[i]) + beta * kl)
    return sum(losses) / len(lengths)


@pytest.mark.parametrize("eps, eps_high", [(0.05, 0.08), (3e-4, 4e-4)], ids=["wide", "papers"])
def test_gspo_loss_and_gradients_equal_the_per_sequence_reference(eps, eps_high):
    """On GRPO's fields with sequence normalisation; some completions' ratios clipped, some not (both checked)."""
    rewards, lengths, logp, old, ref = fixture(3)  # two groups with spread (the first has none by construction)
    adv = group_advantages(rewards, G, "group")
    fields = token_fields(adv, np.arange(SEQ)[None, :] < lengths[:, None], "sequence", SEQ)
    obj = gspo(eps, eps_high, BETA)
    batch = {**{k: jnp.asarray(v) for k, v in fields.items()}, "old_logp": jnp.asarray(old, jnp.float32),
             "ref_logp": jnp.asarray(ref, jnp.float32)}

    def mine(lp):
        total, metrics = finish(obj, *obj.token_terms(lp, None, batch))
        return total / obj.count(batch), metrics

    (loss, metrics), grads = jax.value_and_grad(mine, has_aux=True)(jnp.asarray(logp, jnp.float32))
    want, want_grads = jax.value_and_grad(
        lambda lp: reference_gspo(lp, old, ref, adv, lengths, eps, eps_high, BETA))(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(want_grads), rtol=1e-5, atol=1e-8)
    assert 0 < float(metrics["clip_frac"]) < np.count_nonzero(adv)  # clipped and unclipped completions


def test_a_group_without_spread_gets_zero_advantage_and_no_nan():
    rewards = np.array([1.0] * G + [0.0, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, G, "group")
    assert (adv[:G] == 0).all() and np.isfinite(adv).all() and (adv[G:] != 0).all()
    fields = token_fields(adv, np.ones((2 * G, SEQ)), "token", SEQ)
    loss, grads = jax.value_and_grad(lambda lp: ours(lp, lp, lp, fields, BETA)[0])(jnp.zeros((2 * G, SEQ)) - 1.0)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grads)).all()
    assert (np.asarray(grads)[:G] == 0).all()


def test_one_iteration_is_the_policy_gradient():
    """π_old = π (the first update on fresh rollouts), β = 0: the gradient is −Â·w / Σ norm per token."""
    rewards, lengths, logp, _, _ = fixture(1)
    adv = group_advantages(rewards, G, "group")
    fields = token_fields(adv, np.arange(SEQ)[None, :] < lengths[:, None], "token", SEQ)
    lp = jnp.asarray(logp, jnp.float32)
    grads = jax.grad(lambda x: ours(x, jax.lax.stop_gradient(x), logp, fields, 0.0)[0])(lp)
    np.testing.assert_allclose(np.asarray(grads), -fields["advantages"] * fields["weights"] / fields["norm"].sum(),
                               rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("ratio, advantage, flat", [(1.5, 1.0, True), (0.5, -1.0, True), (1.5, -1.0, False),
                                                    (0.5, 1.0, False), (1.1, 1.0, False)])
def test_clipping_stops_the_gradient_only_where_it_should(ratio, advantage, flat):
    fields = token_fields(np.array([advantage]), np.ones((1, 1)), "token", 1)
    old = np.zeros((1, 1))
    grad = float(jax.grad(lambda lp: ours(lp, old, old, fields, 0.0)[0])(jnp.full((1, 1), np.log(ratio)))[0, 0])
    assert (grad == 0.0) == flat, grad
    _, metrics = ours(jnp.full((1, 1), np.log(ratio)), old, old, fields, 0.0)
    assert float(metrics["clip_frac"]) == float(flat)


def test_the_k3_gradient_matches_finite_differences():
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        logp, ref = -rng.uniform(0.1, 2.0, (2, 5)), -rng.uniform(0.1, 2.0, (2, 5))
        fields = {k: v.astype(np.float64) for k, v in token_fields(np.zeros(2), np.ones((2, 5)), "token", 5).items()}
        batch = {**{k: jnp.asarray(v) for k, v in fields.items()}, "old_logp": jnp.asarray(logp),
                 "ref_logp": jnp.asarray(ref)}
        obj = grpo(EPS, EPS_HIGH, 1.0)
        loss = lambda lp: obj.token_terms(lp, None, batch)[0] / obj.count(batch)
        grads = np.asarray(jax.grad(loss)(jnp.asarray(logp)))
        h, numeric = 1e-6, np.zeros_like(logp)
        for idx in np.ndindex(logp.shape):
            up, down = logp.copy(), logp.copy()
            up[idx] += h
            down[idx] -= h
            numeric[idx] = (float(loss(jnp.asarray(up))) - float(loss(jnp.asarray(down)))) / (2 * h)
        np.testing.assert_allclose(grads, numeric, rtol=1e-6, atol=1e-9)
        assert float(obj.token_terms(jnp.asarray(ref), None, batch)[1]["kl"]) == 0.0  # π = π_ref: no KL


@pytest.mark.slow
def test_the_step_minimises_grpo_on_the_model():
    """The train step with the GRPO objective at temperature 0.7 (sequence normalisation, β > 0): its loss,
    metrics and gradients are the formula applied to the plain reference model's log-probabilities."""
    from harness import BATCH, SEQ as T, assert_matches, equivalence_config, loss_metrics_and_grads, step_fns, tokens
    from jaxllm.models import transformer
    from tools.reference import plain_model

    temperature, rng = 0.7, np.random.default_rng(5)
    m = equivalence_config("tiny-llama").model
    module, c = plain_model(m)
    params = jax.device_get(jax.jit(lambda k: transformer.init_params(m, k))(jax.random.key(0)))
    toks = tokens()
    inputs, targets = jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:])

    def policy_logp(p):
        logits, _ = module.logits(module.from_jaxllm(p), inputs, c)
        return jnp.take_along_axis(jax.nn.log_softmax(logits / temperature), targets[..., None], -1)[..., 0]

    logp = np.asarray(jax.jit(policy_logp)(params), np.float64)
    mask = np.arange(T)[None, :] >= rng.integers(4, T - 4, BATCH)[:, None]  # completions after a prompt
    fields = token_fields(group_advantages(rng.integers(0, 2, BATCH), G, "group"), mask, "sequence", T)
    old = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)

    def reference(p):
        lp = policy_logp(p)
        ratio = jnp.exp(lp - old)
        adv = fields["advantages"]
        surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - EPS, 1 + EPS_HIGH) * adv)
        k3 = jnp.exp(ref - lp) - (ref - lp) - 1
        return jnp.sum(fields["weights"] * (-surrogate + BETA * k3)) / jnp.sum(fields["norm"])

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    fns = step_fns(equivalence_config("tiny-llama"), objective=grpo(EPS, EPS_HIGH, BETA, temperature))
    loss, metrics, grads = loss_metrics_and_grads(fns, params, fields={**fields, "old_logp": old, "ref_logp": ref})
    assert_matches(loss, grads, (params, float(ref_loss), jax.device_get(ref_grads)))
    assert 0 < float(metrics["clip_frac"]) < 1 and float(metrics["kl"]) > 0


def test_rollouts_become_rows_whose_mask_is_the_completion():
    from jaxllm.errors import ConfigError
    from jaxllm.rl.rollouts import rows

    out = rows([[5, 6, 7], [8]], [[1, 2, 0], [3, 4]], [True, False], seq_len=6, mask_truncated=True)
    assert out["inputs"].tolist() == [[5, 6, 7, 1, 2, 0], [8, 3, 0, 0, 0, 0]]
    assert out["targets"].tolist() == [[6, 7, 1, 2, 0, 0], [3, 4, 0, 0, 0, 0]]
    # the completion [1, 2, 0] is predicted at positions 2, 3, 4 (the stop id 0 counts); the truncated one is masked
    assert out["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [0] * 6]
    assert out["segment_ids"].tolist() == [[1] * 5 + [0], [1, 1, 0, 0, 0, 0]]
    assert out["positions"][0].tolist() == [0, 1, 2, 3, 4, 0]
    kept = rows([[8]], [[3, 4]], [False], seq_len=6, mask_truncated=False)
    assert kept["loss_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
    with pytest.raises(ConfigError, match="do not fit model.seq_len=3"):
        rows([[1, 2, 3]], [[4, 5]], [True], seq_len=3, mask_truncated=True)


LOGP_MESHES = {"one_device": {}, "sp_zigzag": {"mesh.sp": 4, "mesh.dp": 2, "model.cp_load_balance": True},
               "zero3_tp": {"mesh.dp": 2, "mesh.fsdp": 2, "mesh.tp": 2, "train.zero_stage": 3},
               "pipeline": {"mesh.pp": 2, "mesh.dp": 2, "mesh.tp": 2, "train.microbatches": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", LOGP_MESHES)
def test_token_logp_is_the_plain_models_at_the_temperature(mesh):
    """StepFns.token_logp (GRPO's old_logp and ref_logp), on each mesh, in the batch's own order: the plain
    reference model's log-probabilities of the targets at temperature 0.7."""
    from harness import as_batch, equivalence_config, step_fns, tokens
    from jaxllm.models import transformer
    from tools.reference import plain_model

    m = equivalence_config("tiny-llama").model
    module, c = plain_model(m)
    params = jax.device_get(jax.jit(lambda k: transformer.init_params(m, k))(jax.random.key(0)))
    toks = tokens()
    logits, _ = jax.jit(lambda p: module.logits(module.from_jaxllm(p), toks[:, :-1], c))(params)
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits / 0.7)), toks[:, 1:, None].astype(np.int64), -1)[..., 0]
    fns = step_fns(equivalence_config("tiny-llama", **LOGP_MESHES[mesh]), objective=grpo(temperature=0.7))
    got = fns.token_logp(jax.device_put(params, fns.state_shardings.params),
                         jax.device_put(as_batch(toks), fns.batch_sharding))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
