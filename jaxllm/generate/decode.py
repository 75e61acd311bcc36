"""Prefill, then decode, in one compiled program; `generate` is its host side.

The program takes a batch of left-padded prompts [rows, bucket] and their mask. Prefill runs the
whole prompt through the model once, writing every layer's keys and values into the KV cache
(`cache.py`) at slots 0 .. bucket-1; the first new token is sampled from the last slot's logits (left
padding puts every prompt's last token there). Each decode step then feeds the newest token at the
next slot (all rows write the same slot; each row's position is its own prompt length plus the step)
and samples the next, in a `while_loop` that ends after `max_new_tokens` or when every row has
produced a stop id. Positions come from the mask (left padding has none), so a padded prompt computes
what it computes alone.

It runs on the training mesh with the training parameters: at its start the program casts them to the
compute dtype and lays them out as used (`cache.generation_layout`: under ZeRO-3 or a pipeline that is
an all-gather over fsdp/pp, a transient copy of Φ·B/tp bytes per device that `jaxllm plan` reports and
that lives only while the program runs), each layer's weights arrays of their own (`transformer.per_repeat`:
the layers run unrolled), then every decode step reads that copy in place instead of gathering again or
slicing a layer's weights out of the stack (a copy of every weight at every step under a layer scan). MoE
layers run dropless: prefill and decode see different groups of tokens, and only dropless routing gives each
token what the full forward gives it. One program is compiled per (rows, prompt bucket, max new tokens) on a
model and mesh; sampling settings, stop ids and the seed are arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxllm.errors import ConfigError
from jaxllm.batch import global_arrays
from jaxllm.generate.cache import init_cache, layout_for, padded_rows
from jaxllm.generate.sampling import sample
from jaxllm.models import transformer
from jaxllm.models.attention import CacheView
from jaxllm.stack import has_moe
from jaxllm.sharding import BATCH_AXES, Layout, current_layout, tree_shardings, use_layout
from jaxllm.models.layers import matmul_precision

MAX_STOP_IDS = 8  # stop ids travel as a fixed-size array (padded with -1), so their number compiles nothing


class Completion(NamedTuple):
    """One prompt's new tokens (through the first stop id, which is kept) and each one's log-probability."""

    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n], under log_softmax(logits / temperature) over the whole vocabulary
    stopped: bool  # ended at a stop id (rather than at max_new_tokens)


def _forward(p, cache, tokens, positions, segment_ids, slots: CacheView, m, dtype, last: bool = False):
    """fp32 logits [rows, len, vocab] of tokens written into the cache at slots.start (`last`: the last column's
    alone, [rows, 1, vocab]: the head not run on the other positions), and the cache."""
    x = transformer.embed(p, tokens, positions, m, dtype)
    x, cache = transformer.cached_blocks(p["blocks"], cache, x, positions, segment_ids, slots, m, dtype)
    if last:
        return transformer.head_logits_at(p, x, jnp.full(x.shape[0], x.shape[1] - 1), m, dtype)[:, None], cache
    return transformer.head_logits(p, x, m, dtype), cache


def _gathered_weights(params, m, dtype, layout: Layout | None, stored: Layout | None = None):
    """The compute-dtype copy of the parameters every step reads, laid out as used (see the docstring). The cast
    is pinned where the parameters are `stored`, so the gather moves compute-dtype bytes (XLA would otherwise
    gather fp32 and cast after)."""
    p = transformer.compute_weights(params, dtype)
    if layout is None:
        return p
    names = transformer.param_names(m)
    if stored is not None:
        p = jax.lax.with_sharding_constraint(p, tree_shardings(names, p, stored, stored.params))
    return jax.lax.with_sharding_constraint(p, tree_shardings(names, p, layout, layout.weights))


def _draw(logits, key, step, settings):
    """`sampling.sample` with one key per row and step, so a row's draws do not depend on the batch or mesh."""
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, step), r))(jnp.arange(logits.shape[0]))
    return sample(logits, keys, *settings)


class _State(NamedTuple):
    """What the decode loop carries from one token to the next."""

    step: jax.Array  # the index among the new tokens of `token`
    token: jax.Array  # [rows] the newest token, fed to the next step
    cache: list  # the KV cache (cache.py)
    slot_positions: jax.Array  # [rows, slots] every slot's position and segment id (0: padding or empty)
    slot_segments: jax.Array
    done: jax.Array  # [rows] has stopped (or pads the batch)
    length: jax.Array  # [rows] new tokens to keep: through the first stop id, else all
    out: dict  # tokens, logprobs [rows, new] (and logits [rows, new, vocab])


def _record(state: _State, token, logp, logits, stop_ids) -> _State:
    """The step's sampled token written out, and whether its row stops here."""
    i, out = state.step, state.out
    out = {**out, "tokens": out["tokens"].at[:, i].set(token), "logprobs": out["logprobs"].at[:, i].set(logp)}
    if "logits" in out:
        out["logits"] = out["logits"].at[:, i].set(logits)
    stops = jnp.any(token[:, None] == stop_ids[None, :], axis=-1) & ~state.done
    return state._replace(token=token, done=state.done | stops, length=jnp.where(stops, i + 1, state.length), out=out)


def _prefill(p, prompts, mask, seed, settings, stop_ids, m, dtype, new: int, keep_logits: bool) -> _State:
    """The prompts through the model into an empty cache, and the first new token sampled."""
    rows, bucket = prompts.shape
    empty = jnp.zeros((rows, new), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)  # from the mask: left padding takes none
    slots = CacheView(None, None, 0, 0, jnp.concatenate([positions, empty], 1), jnp.concatenate([mask, empty], 1))
    cache = init_cache(m, rows, bucket + new, dtype, current_layout())
    logits, cache = _forward(p, cache, prompts, positions, mask, slots, m, dtype, last=True)
    logits = logits[:, 0]  # every prompt's last token is in the last column
    out = {"tokens": empty, "logprobs": jnp.zeros((rows, new))}
    if keep_logits:
        out["logits"] = jnp.zeros((rows, new, logits.shape[-1]))
    done = jnp.sum(mask, axis=1) == 0  # rows of no prompt pad the batch to the batch shards
    state = _State(jnp.int32(0), None, cache, slots.positions, slots.segment_ids, done, jnp.full(rows, new), out)
    return _record(state, *_draw(logits, jax.random.key(seed), 0, settings), logits, stop_ids)


def _decode_step(state: _State, p, lengths, key, settings, stop_ids, m, dtype, bucket: int) -> _State:
    """Feed the newest token at the next slot (position: its row's prompt length + step) and sample the next."""
    i = state.step + 1
    one = jnp.ones((state.token.shape[0], 1), jnp.int32)
    slot, position = bucket + i - 1, (lengths + i - 1)[:, None]
    slots = CacheView(None, None, 0, slot, jax.lax.dynamic_update_slice(state.slot_positions, position, (0, slot)),
                      jax.lax.dynamic_update_slice(state.slot_segments, one, (0, slot)))
    logits, cache = _forward(p, state.cache, state.token[:, None], position, one, slots, m, dtype)
    state = state._replace(step=i, cache=cache, slot_positions=slots.positions, slot_segments=slots.segment_ids)
    return _record(state, *_draw(logits[:, 0], key, i, settings), logits[:, 0], stop_ids)


def _program(params, prompts, mask, seed, temperature, top_k, top_p, stop_ids, *, m, dtype, layout, stored, new: int,
             keep_logits: bool):
    """The compiled generation (see the module docstring): new tokens and log-probabilities [rows, new],
    lengths and stopped [rows] (and every step's logits [rows, new, vocab] with keep_logits)."""
    with matmul_precision(dtype), use_layout(layout):
        # each layer's weights apart, sliced once here rather than at every token by the layer scan
        p = transformer.per_repeat(_gathered_weights(params, m, dtype, layout, stored))
        settings = (temperature, top_k, top_p)
        state = _prefill(p, prompts, mask, seed, settings, stop_ids, m, dtype, new, keep_logits)
        step = functools.partial(_decode_step, p=p, lengths=jnp.sum(mask, axis=1), key=jax.random.key(seed),
                                 settings=settings, stop_ids=stop_ids, m=m, dtype=dtype, bucket=prompts.shape[1])
        state = jax.lax.while_loop(lambda s: (s.step + 1 < new) & ~jnp.all(s.done), step, state)
        out = {**state.out, "lengths": state.length, "stopped": state.done}
        if keep_logits:
            out["logits"] = out["logits"][..., :m.vocab_size]
        return out


_programs: dict = {}  # (model, dtype, layout, new, keep_logits) -> the jitted program; the newest few


def _compiled(m, dtype, on, new: int, keep_logits: bool):
    layout, stored = layout_for(on), layout_for(on, as_stored=True)
    key = (repr(m), str(dtype), stored, new, keep_logits)
    if key not in _programs:
        if len(_programs) >= 8:
            _programs.pop(next(iter(_programs)))
        out = None if layout is None else NamedSharding(layout.mesh, P())  # small: every process gets it all
        _programs[key] = jax.jit(functools.partial(_program, m=m, dtype=dtype, layout=layout, stored=stored, new=new,
                                                   keep_logits=keep_logits), out_shardings=out)
    return _programs[key]


def _dropless(m):
    """The model as generation runs it: MoE layers dropless (see the module docstring)."""
    if not has_moe(m):
        return m
    return dataclasses.replace(m, moe=dataclasses.replace(m.moe, capacity_factor=0.0))


def check_sampling(temperature, top_k, top_p,
                   names=("generation: temperature", "generation: top_k", "generation: top_p")) -> None:
    """The sampling values within their bounds: ConfigError (one line) naming the first that is not, as `names`
    call them (a command names its flags)."""
    for name, value, ok, need in ((names[0], temperature, temperature >= 0, "0 (greedy) or more"),
                                  (names[1], top_k, top_k >= 0, "0 (off) or more"),
                                  (names[2], top_p, 0 < top_p <= 1, "in (0, 1] (1: off)")):
        if not ok:
            raise ConfigError(f"{name} {value}: must be {need}")


def _check(m, prompts, new: int, temperature, top_k, top_p, stop_ids) -> None:
    """One ConfigError line for what generation cannot do."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generation: every prompt needs at least one token")
    if any(t < 0 or t >= m.vocab_size for p in prompts for t in p):
        raise ConfigError(f"generation: a prompt token is outside the model's vocabulary of {m.vocab_size}")
    if new < 1:
        raise ConfigError(f"generation: max_new_tokens={new}; ask for at least 1")
    longest, limit = max(len(p) for p in prompts), transformer.max_positions(m)
    if longest + new > limit:
        raise ConfigError(f"generation: a prompt of {longest} tokens plus {new} new ones is {longest + new} positions, "
                          f"more than the model's {limit} (model.max_positions); shorten the prompt or generate fewer")
    check_sampling(temperature, top_k, top_p)
    if len(stop_ids) > MAX_STOP_IDS:
        raise ConfigError(f"generation: {len(stop_ids)} stop ids; at most {MAX_STOP_IDS}")


def limits_checked(m, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids) -> list[int]:
    """Each prompt's max_new_tokens (one for all, or one per prompt), checked as `_check` checks one."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ConfigError(f"generation: {len(limits)} max_new_tokens for {len(prompts)} prompts; give one for all, "
                          "or one per prompt")
    for new in {min(limits, default=1), max(limits, default=1)}:
        _check(m, prompts, new, temperature, top_k, top_p, stop_ids)
    return limits


def bucket(longest: int) -> int:
    """Prompts are left-padded to a power of two (at least 8), so nearby lengths share a program."""
    return max(8, 1 << (longest - 1).bit_length())


def put_host_arrays(arrays: dict, layout: Layout | None, spec: P) -> dict:
    """Host arrays every process holds whole, as global arrays laid out by `spec` (one device: placed on it)."""
    if layout is None:
        return {k: jnp.asarray(a) for k, a in arrays.items()}
    return global_arrays(arrays, NamedSharding(layout.mesh, spec))


def generate_arrays(params, cfg, prompts: list, max_new_tokens: int, *, on=None, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, stop_ids=(), seed: int = 0, keep_logits: bool = False,
                    timings: dict | None = None):
    """`generate` as host arrays, one row per prompt: tokens and logprobs [n, max_new_tokens] (valid up to
    `lengths`), lengths [n], stopped [n], and with keep_logits every step's fp32 logits [n, new, vocab].
    A `timings` dict gets `compile_s` and `run_s` (the program is then compiled apart from running it)."""
    m, dtype = cfg.model, jnp.dtype(cfg.precision.compute)
    _check(m, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids)
    layout = layout_for(on)
    rows, width = padded_rows(len(prompts), layout), bucket(max(len(p) for p in prompts))
    tokens, mask = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
    for r, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        tokens[r, width - len(p):], mask[r, width - len(p):] = p, 1
    stops = np.full(MAX_STOP_IDS, -1, np.int32)
    stops[:len(stop_ids)] = stop_ids
    rows_in = put_host_arrays({"tokens": tokens, "mask": mask}, layout, P(BATCH_AXES))
    whole = put_host_arrays({"seed": np.asarray(seed, np.uint32), "temperature": np.asarray(temperature, np.float32),
                  "top_k": np.asarray(top_k, np.int32), "top_p": np.asarray(top_p, np.float32), "stops": stops},
                 layout, P())
    args = (params, rows_in["tokens"], rows_in["mask"], whole["seed"], whole["temperature"], whole["top_k"],
            whole["top_p"], whole["stops"])
    program = _compiled(_dropless(m), dtype, on, max_new_tokens, keep_logits)
    start = time.perf_counter()
    if timings is not None:
        program = program.lower(*args).compile()
        timings["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    if timings is not None:
        timings["run_s"] = time.perf_counter() - start
    return {k: np.asarray(v.addressable_data(0))[:len(prompts)] for k, v in out.items()}


def generate(params, cfg, prompts: list, max_new_tokens, *, on=None, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, stop_ids=(), seed: int = 0, timings: dict | None = None) -> list[Completion]:
    """New tokens for each prompt (a list of token ids), sampled by the model `cfg.model` with parameters
    `params` in `cfg.precision.compute`, on the mesh of `on` (a Layout, StepFns or Mesh; None: one device)
    where the parameters live as that layout stores them.

    temperature 0 is greedy; top_k 0 and top_p 1 leave the distribution whole. Each completion ends after
    its first stop id (kept) or after max_new_tokens (one for all, or one per prompt: the batch runs to the
    largest and each row is cut at its own, which gives the tokens a row of its own length would draw, since a
    draw depends only on what came before it); each token comes with its log-probability under
    log_softmax(logits / temperature) over the whole vocabulary (temperature 1 when greedy). A row's draws
    depend on the seed and its place in `prompts`, not on the mesh. A `timings` dict gets the seconds spent
    compiling (`compile_s`) and generating (`run_s`).
    """
    limits = limits_checked(cfg.model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids)
    out = generate_arrays(params, cfg, prompts, max(limits), on=on, temperature=temperature, top_k=top_k,
                          top_p=top_p, stop_ids=stop_ids, seed=seed, timings=timings)
    return [Completion(out["tokens"][r, :min(n, limit)], out["logprobs"][r, :min(n, limit)],
                       bool(out["stopped"][r]) and n <= limit)
            for r, (n, limit) in enumerate(zip(out["lengths"], limits))]


def _copied_leaves(m, dtype, on):
    """(elements one device holds as stored, as used, bytes an element of the copy) of each leaf the copy makes:
    the leaves whose compute-dtype layout as used differs from how they are stored (`on`'s parameter layout,
    fp32)."""
    stored = layout_for(on, as_stored=True)
    used = layout_for(on)
    names, shapes = transformer.param_names(m), transformer.param_shapes(m)
    cast = jax.eval_shape(functools.partial(transformer.compute_weights, dtype=dtype), shapes)
    for name, s, c in zip(jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(shapes),
                          jax.tree.leaves(cast)):
        before = stored.sharding(name, stored.params, s.shape) if stored else None
        after = used.sharding(name, used.weights, s.shape) if used else None
        if c.dtype != s.dtype or (after is not None and not after.is_equivalent_to(before, len(s.shape))):
            own = lambda sharding: math.prod(sharding.shard_shape(s.shape) if sharding else s.shape)
            yield own(before), own(after), c.dtype.itemsize


def weights_copy_bytes(m, dtype, on) -> int:
    """Bytes per device of the weights copy the program makes (`_copied_leaves`): all of them under ZeRO-3 or a
    pipeline, none in fp32 with parameters stored as used."""
    return sum(used * size for _, used, size in _copied_leaves(m, dtype, on))


def reshard_bytes(m, dtype, on) -> int:
    """Bytes one device receives making that copy: of each leaf, its shard as used less the part of it the device
    holds as stored (an all-gather over fsdp under ZeRO-3, over pp of a pipeline's stages), in the compute dtype
    (the cast comes first)."""
    return sum((used - stored) * size for stored, used, size in _copied_leaves(m, dtype, on))


def lower(cfg, on, abstract_params, rows: int, prompt_len: int, new: int):
    """The generation program for `rows` prompts of `prompt_len` tokens and `new` new ones, lowered without
    data (for `jaxllm plan`'s compiled memory)."""
    m, dtype, layout = _dropless(cfg.model), jnp.dtype(cfg.precision.compute), layout_for(on)
    rows, width = padded_rows(rows, layout), bucket(prompt_len)
    batch = jax.ShapeDtypeStruct((rows, width), jnp.int32,
                                 sharding=None if layout is None else NamedSharding(layout.mesh, P(BATCH_AXES)))
    scalar = lambda t: jax.ShapeDtypeStruct((), t)
    return _compiled(m, dtype, on, new, False).lower(
        abstract_params, batch, batch, scalar(jnp.uint32), scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32),
        jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32))
