"""The train state: one pytree type, checkpointed whole, with room for what objectives and precision keep.

- `step`: optimizer steps taken, which is also the data position (the batch of step s is
  a function of (seed, s));
- `applied`: updates actually applied to the parameters (equal to `step` until a step guard
  skips updates);
- `params`: fp32 parameters (the master copy); `opt_state`: the optimizer's state;
- `guard`: the loss scale and the step guard's counters and loss history (`trainer/guard.py`).

A field added later gets a default, so a checkpoint saved before it existed restores:
`saved_fields(meta)` says which fields a checkpoint holds (its metadata lists them; one saved
before this type existed held a dict of `step`, `params` and `opt_state`), the checkpoint is read
into just those, and `complete` fills in the rest: from the saved fields (`DEFAULTS`) or, for the
`FRESH` fields, as a new run starts them (the guard: the configured initial loss scale).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.errors import ConfigError

LEGACY_FIELDS = ("step", "params", "opt_state")  # the dict checkpoints of jaxllm before TrainState
PARAMS_ONLY = ("step", "params")  # an imported model (`jaxllm hf import`): the optimizer starts fresh on resume


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    applied: jax.Array
    params: Any
    opt_state: Any
    guard: Any


FIELDS = tuple(TrainState.__dataclass_fields__)

# A field's value when a checkpoint predates it, from the fields the checkpoint has (a new buffer: the step
# donates the whole state, and one buffer must not be donated twice).
DEFAULTS = {"applied": lambda saved: jnp.copy(saved["step"])}
FRESH = ("guard",)  # fields a checkpoint may lack that start as in a new run (`complete`'s `fresh`)


def saved_fields(meta: dict) -> tuple[str, ...]:
    """The state fields a checkpoint holds, from the metadata saved beside it."""
    return tuple(meta.get("state_fields", LEGACY_FIELDS))


def check_fields(meta: dict, where: str) -> None:
    """ConfigError unless this version can complete a checkpoint with these fields."""
    names = saved_fields(meta)
    if names == PARAMS_ONLY:
        return
    unknown = [n for n in names if n not in FIELDS]
    missing = [n for n in FIELDS if n not in names and n not in DEFAULTS and n not in FRESH]
    if unknown or missing:
        raise ConfigError(f"{where}: its train state has fields {list(names)} and this jaxllm's has {list(FIELDS)}; "
                          "resume it with the jaxllm version that saved it")


def as_saved(abstract: TrainState, names: tuple[str, ...]):
    """The restore target for a checkpoint holding `names`: the state itself when it holds every field,
    else a dict of the fields it has (as checkpoints were written before this type)."""
    if tuple(names) == FIELDS:
        return abstract
    return {n: getattr(abstract, n) for n in names}


def complete(saved, fresh: dict) -> TrainState:
    """A restored checkpoint as this version's state, missing fields set from their defaults; `fresh` gives
    the `FRESH` fields as a new run would start them."""
    if isinstance(saved, TrainState):
        return saved
    values = {n: saved[n] if n in saved else DEFAULTS[n](saved) if n in DEFAULTS else fresh[n] for n in FIELDS}
    return TrainState(**values)
