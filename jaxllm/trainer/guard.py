"""The step guard and the loss scaler: which updates a step applies, decided inside the compiled step.

A step's update is skipped (parameters and optimizer state left exactly as they were, no host sync) when

- its gradients or loss are not finite (`train.skip_nonfinite`, on by default), or
- its loss is a spike: above `train.spike_factor` × the median of the last `train.spike_window`
  finite losses of applied steps, once half a window of them is known (0 = off; only for objectives
  whose loss is a likelihood: `Objective.spiky`).

A skipped step still consumes its batch (`step` advances) but not the learning-rate schedule: the
optimizer's own counters sit in the untouched optimizer state, and `applied` counts the updates made.
`train.max_consecutive_skips` skips in a row end the run (the loop's check); an overflow the dynamic
scaler answers by halving a scale still above `loss_scale_min` does not count towards them.

Loss scaling (`precision.loss_scale`) multiplies the loss by a power of two S inside the differentiated
function and divides the gradients by S once per step, before clipping. Dynamic scaling halves S after a
step with non-finite gradients and doubles it after `loss_scale_window` finite steps in a row, never below
`loss_scale_min`; static keeps S; none (and auto outside float16) uses no scale at all. The scaler and the
guard are one piece: the scaler's overflow is the guard's non-finite step.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError

LOSS_SCALES = ("auto", "dynamic", "static", "none")  # precision.loss_scale


@flax.struct.dataclass
class Guard:
    loss_scale: jax.Array  # fp32 S (1 when not scaling)
    good_steps: jax.Array  # finite steps since S last changed
    consecutive_skips: jax.Array  # skipped steps in a row, up to this one
    skipped_total: jax.Array
    history: jax.Array  # [spike_window] fp32: the recent finite losses of applied steps, oldest overwritten
    history_len: jax.Array  # how many of `history` are filled (≤ spike_window)


def scaling(cfg) -> str:
    """dynamic | static | none: `precision.loss_scale` with auto resolved (dynamic under float16)."""
    mode = cfg.precision.loss_scale
    if mode == "auto":
        return "dynamic" if cfg.precision.compute == "float16" else "none"
    return mode


def init(cfg) -> Guard:
    scale = cfg.precision.loss_scale_init if scaling(cfg) != "none" else 1.0
    window = max(cfg.train.spike_window, 1)
    return Guard(loss_scale=jnp.float32(scale), good_steps=jnp.int32(0), consecutive_skips=jnp.int32(0),
                 skipped_total=jnp.int32(0), history=jnp.zeros((window,), jnp.float32), history_len=jnp.int32(0))


def _settings(cfg):
    """The guard's and the scaler's settings as values behind an optimization barrier, so every setting
    compiles to one program. (With them as constants XLA folds the unused logic away, and XLA:CPU was
    seen to fuse the gradient computation differently around what is left: gradients an ulp apart
    between dynamic scaling and none, against the scaler's promise to change no bit in fp32.)"""
    p, t = cfg.precision, cfg.train
    return jax.lax.optimization_barrier({
        "dynamic": jnp.bool_(scaling(cfg) == "dynamic"), "window": jnp.int32(p.loss_scale_window),
        "floor": jnp.float32(p.loss_scale_min), "skip_nonfinite": jnp.bool_(t.skip_nonfinite),
        "spike_factor": jnp.float32(t.spike_factor)})


def _spike(loss, g: Guard, factor):
    """Whether `loss` exceeds factor × the median of the known history (once half of it is known)."""
    window = g.history.shape[0]
    known = jnp.arange(window) < g.history_len
    median = jnp.nanmedian(jnp.where(known, g.history, jnp.nan))
    return (factor > 0) & (g.history_len * 2 >= window) & (loss > factor * median)


def decide(loss, grad_norm, g: Guard, cfg, spiky: bool):
    """(apply the update?, whether the gradients and loss were finite) for this step. The gradients are
    judged by their global norm, which the step computes anyway: an inf or NaN anywhere makes it non-finite
    (and so does a norm past fp32's range), and nothing else here reads the gradients."""
    s = _settings(cfg)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    skip = ~finite & (s["skip_nonfinite"] | s["dynamic"])  # an overflow under dynamic scaling is never applied
    if spiky:
        skip = skip | (finite & _spike(loss, g, s["spike_factor"]))
    return ~skip, finite


def advance(g: Guard, loss, applied, finite, cfg) -> Guard:
    """The guard after a step: the scale updated, the skip counters, the loss remembered if applied."""
    s = _settings(cfg)
    scale, good = g.loss_scale, g.good_steps + 1
    adapting = s["dynamic"] & ~finite & (scale > s["floor"])  # an overflow the scaler still answers by halving
    grow = s["dynamic"] & finite & (good >= s["window"])
    scale = jnp.where(s["dynamic"] & ~finite, jnp.maximum(scale / 2, s["floor"]), jnp.where(grow, scale * 2, scale))
    good = jnp.where(finite & ~grow, good, 0)
    window = g.history.shape[0]
    remember = applied & jnp.isfinite(loss)
    history = jnp.where(remember, g.history.at[g.history_len % window].set(loss.astype(jnp.float32)), g.history)
    return Guard(loss_scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32),
                 consecutive_skips=jnp.where(applied, 0, g.consecutive_skips + ~adapting).astype(jnp.int32),
                 skipped_total=(g.skipped_total + (~applied)).astype(jnp.int32), history=history,
                 history_len=jnp.where(remember, g.history_len + 1, g.history_len).astype(jnp.int32))


def keep_if(applied, new, old):
    """`new` where the update is applied, else `old` unchanged (leaf by leaf, in the compiled step)."""
    return jax.tree.map(lambda a, b: jnp.where(applied, a, b), new, old)


def check_config(cfg) -> list[str]:
    """The precision and guard keys: ConfigError (one line) for what cannot run."""
    p, t = cfg.precision, cfg.train
    if p.loss_scale not in LOSS_SCALES:
        raise ConfigError(f"precision.loss_scale: '{p.loss_scale}' is not one of {', '.join(LOSS_SCALES)}")
    for key in ("loss_scale_init", "loss_scale_min"):
        value = getattr(p, key)
        if value <= 0 or math.frexp(value)[0] != 0.5:
            raise ConfigError(f"precision.{key}: {value} is not a power of two; pick one such as 65536 (2^16)")
    if p.loss_scale_window < 1 or t.spike_window < 1 or t.max_consecutive_skips < 1:
        raise ConfigError("precision.loss_scale_window, train.spike_window and train.max_consecutive_skips must be "
                          "at least 1")
    if t.spike_factor and t.spike_factor <= 1:
        raise ConfigError(f"train.spike_factor: {t.spike_factor} would skip ordinary steps; use 0 (off) or more than 1")
    return []
