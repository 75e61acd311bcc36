"""Optimizers and the learning-rate schedule, built from `TrainConfig` and the parameter table.

Weight decay applies to matrices only (not norms, biases), read off each leaf's logical
names. Muon gets the matrix dimensions of every stacked weight from the same names
(leading `layers` is a batch dimension), so it orthogonalises per layer instead of
falling back to Adam on 3-D and 4-D arrays; embeddings and the LM head use its Adam path.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from jaxllm.errors import ConfigError
from jaxllm.models.transformer import Leaf
from jaxllm.schema import TrainConfig



def schedule_steps(t: TrainConfig) -> int:
    return t.schedule_steps or t.steps


def warmup_steps(t: TrainConfig) -> int:
    """Warm-up length, kept inside the schedule so a short run still decays."""
    return min(t.warmup_steps, schedule_steps(t) - 1)


def learning_rate(t: TrainConfig):
    """Linear warm-up to `lr`, then cosine to `lr * min_lr_ratio` at `schedule_steps`.

    Indexed by the number of updates already applied, so the first step uses lr/warmup, not 0.
    """
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup_steps(t),
        decay_steps=schedule_steps(t), end_value=t.lr * t.min_lr_ratio)
    if warmup_steps(t) == 0:
        return base
    return lambda count: base(count + 1)


def _matrix_dims(leaf: Leaf) -> tuple[int, ...]:
    """The dimensions of the matrix itself: stacked layers and stacked experts are batches of matrices."""
    return tuple(i for i, n in enumerate(leaf.names) if n not in ("layers", "experts"))


def _is_matrix(leaf: Leaf) -> bool:
    """A weight matrix maps the model dimension somewhere: it has `embed` and one more dimension.
    (Attention biases are 2-D per layer, [heads, head_dim], but are biases; the MoE router is a
    matrix but is left undecayed, as its logits' scale is what the z-loss governs.)"""
    return len(_matrix_dims(leaf)) >= 2 and "embed" in leaf.names and "router" not in leaf.names


def decay_mask(table):
    return jax.tree.map(_is_matrix, table, is_leaf=lambda x: isinstance(x, Leaf))


def muon_dimensions(table):
    """Muon's (reduction, output) axes for each hidden matrix; None (Adam) for the rest."""

    def dims(leaf: Leaf):
        d = _matrix_dims(leaf)
        if not _is_matrix(leaf) or {"vocab", "pos"} & set(leaf.names):
            return None
        if leaf.names[d[0]] == "embed":  # x @ W: contract the model dimension
            return contrib.MuonDimensionNumbers(reduction_axis=(d[0],), output_axis=d[1:])
        return contrib.MuonDimensionNumbers(reduction_axis=d[:-1], output_axis=(d[-1],))

    return jax.tree.map(dims, table, is_leaf=lambda x: isinstance(x, Leaf))


MOMENT_DTYPES = ("float32", "bfloat16")  # train.moment_dtype


class _AdamState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_adam_stored_in(dtype, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's moment estimates kept in `dtype` (DeepSeek-V3's bf16) between steps: each step reads them into fp32,
    updates them as optax.scale_by_adam does, and rounds them back; the update itself is fp32's."""
    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, dtype)
        return _AdamState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params), jax.tree.map(zeros, params))

    def update(grads, state, params=None):
        del params
        f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, f32(state.mu), f32(grads))
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, f32(state.nu), f32(grads))
        count = optax.safe_increment(state.count)
        mu_hat, nu_hat = optax.tree.bias_correction(mu, b1, count), optax.tree.bias_correction(nu, b2, count)
        updates = jax.tree.map(lambda m, v, g: (m / (jnp.sqrt(v) + eps)).astype(g.dtype), mu_hat, nu_hat, grads)
        stored = lambda tree: jax.tree.map(lambda a: a.astype(dtype), tree)
        return updates, _AdamState(count, stored(mu), stored(nu))

    return optax.GradientTransformation(init, update)


def _adamw(t, lr, mask, table):
    if t.moment_dtype == "float32":
        return optax.adamw(lr, b1=t.beta1, b2=t.beta2, eps=t.eps, weight_decay=t.weight_decay, mask=mask)
    return optax.chain(scale_by_adam_stored_in(jnp.dtype(t.moment_dtype), t.beta1, t.beta2, t.eps),
                       optax.add_decayed_weights(t.weight_decay, mask), optax.scale_by_learning_rate(lr))


def _sgd(t, lr, mask, table):
    return optax.chain(optax.add_decayed_weights(t.weight_decay, mask), optax.sgd(lr, momentum=t.momentum))


def _adafactor(t, lr, mask, table):
    return optax.adafactor(lr, weight_decay_rate=t.weight_decay, weight_decay_mask=mask)


def _lion(t, lr, mask, table):
    return optax.lion(lr, b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=mask)


def _muon(t, lr, mask, table):
    return contrib.muon(lr, beta=t.momentum, weight_decay=t.weight_decay, weight_decay_mask=mask,
                        adam_b1=t.beta1, adam_b2=t.beta2, muon_weight_dimension_numbers=muon_dimensions(table))


OPTIMIZERS = {"adamw": _adamw, "sgd": _sgd, "adafactor": _adafactor, "lion": _lion, "muon": _muon}


def make_optimizer(t: TrainConfig, table) -> optax.GradientTransformation:
    opt = OPTIMIZERS[t.optimizer](t, learning_rate(t), decay_mask(table), table)
    if t.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(t.grad_clip), opt)
    return opt


def check_config(t: TrainConfig) -> list[str]:
    """The optimizer and schedule keys: ConfigError (one line) for what cannot run; notes to log."""
    if t.optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer: '{t.optimizer}' is not one of {', '.join(OPTIMIZERS)}")
    if t.moment_dtype not in MOMENT_DTYPES:
        raise ConfigError(f"train.moment_dtype: '{t.moment_dtype}' is not one of {', '.join(MOMENT_DTYPES)}")
    if t.moment_dtype != "float32" and t.optimizer != "adamw":
        raise ConfigError(f"train.moment_dtype={t.moment_dtype} is for adamw's moments; train.optimizer={t.optimizer} "
                          "keeps its state in float32 (set moment_dtype=float32)")
    if t.lr <= 0:
        raise ConfigError(f"train.lr: must be positive, got {t.lr}")
    if t.grad_clip < 0:  # a negative threshold would not clip: refused rather than read as off
        raise ConfigError(f"train.grad_clip: must be 0 (off) or more, got {t.grad_clip}")
    if schedule_steps(t) < t.steps:
        raise ConfigError(f"train.schedule_steps={t.schedule_steps} is shorter than train.steps={t.steps}; raise it "
                          "or set 0")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps: must be 0 or more, got {t.warmup_steps}")
    if t.warmup_steps >= schedule_steps(t):
        return [f"train.warmup_steps={t.warmup_steps} is not shorter than the schedule ({schedule_steps(t)} steps): "
                f"warming up over {warmup_steps(t)} steps instead"]
    return []
