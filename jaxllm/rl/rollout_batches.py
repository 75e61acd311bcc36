"""The batches of a GRPO run: the policy's own samples, scored and laid out for the step.

Every `rl.num_iterations` steps (the first step of each batch of rollouts) the current parameters make a
new batch, which the following steps reuse:

1. the step's prompts (`prompts.step_prompts`), each repeated `rl.group_size` times, group after group
   (with DAPO's dynamic sampling, `rl.max_num_gen_batches`, further rounds of prompts until the batch holds
   groups whose rewards differ: `_rollouts`);
2. one completion per row on the run's mesh, at `rl.temperature`, seeded by (train.seed, rollout): by
   `jaxllm.generate`'s static program (which hands every process all of them), or with `rl.sampler = "engine"`
   by the rollout engine, its weights resharded into the rollout layout once per rollout (timed as `reshard`);
3. the rewards (`rewards.py`, with DAPO's overlong penalty where `rl.overlong_buffer` is set), which every
   process computes over every completion, so a group never straddles processes and all agree on its advantages;
4. advantages (`advantages.py`) and rows (`rollouts.py`), as global arrays over the batch axes;
5. `old_logp` from the trainer's own forward pass at the temperature (`StepFns.token_logp`) with the
   parameters that sampled, and `ref_logp` with the reference policy's (β > 0; zeros otherwise), `reference(params)`
   giving its parameters from the policy's.

The generator's own log-probabilities are kept for one metric, `logp_mismatch`: the mean over completion
tokens of |generator − trainer|, which is rounding alone when both run the same model in the same dtype.
"""

from __future__ import annotations

import concurrent.futures
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxllm import batch as batch_lib
from jaxllm.errors import ConfigError
from jaxllm.generate import generate_arrays
from jaxllm.generate.engine import Engine
from jaxllm.rl import advantages, prompts as prompts_lib, rewards as rewards_lib, rollouts


class RolloutBatches:
    """The data object of a GRPO run (the loop's `data`): `train_batch(step, sharding, params)` and the
    rollout metrics of the batch each step trained on."""

    has_validation = False
    steps_per_epoch = None

    def __init__(self, cfg, tokenizer, prompts: prompts_lib.Prompts, fns, reference=None, clock=None):
        self.cfg, self.tokenizer, self.prompts, self.fns, self.reference = cfg, tokenizer, prompts, fns, reference
        self.clock = clock  # the run's goodput clock (the engine's resharding is timed on it), or None
        self.score = rewards_lib.parse(cfg.rl.rewards, cfg.rl.format_pattern)
        self.per_step = cfg.train.global_batch // cfg.rl.group_size
        self.current = None  # (rollout index, batch, metrics)
        self.padding: dict[int, float] = {}  # rollout index -> share of padding positions
        self.pending: dict[int, concurrent.futures.Future] = {}  # asynchronous RL: rollout -> its sampling
        if cfg.rl.async_steps and jax.process_count() > 1:  # the sampler's collectives would race the step's
            raise ConfigError(f"rl.async_steps={cfg.rl.async_steps} runs in one process, and this run has "
                              f"{jax.process_count()}; set rl.async_steps=0")
        self.sampler = concurrent.futures.ThreadPoolExecutor(1) if cfg.rl.async_steps else None

    @property
    def description(self) -> str:
        r = self.cfg.rl
        return (f"{self.prompts.description}; {self.per_step} prompts × {r.group_size} completions per step, "
                f"up to {r.max_new_tokens} new tokens at temperature {r.temperature}")

    def rollout_of(self, step: int) -> int:
        return step // self.cfg.rl.num_iterations

    def train_batch(self, step: int, sharding, params) -> dict:
        """The batch of step `step` (0-based): made from `params` at the first step of its rollout."""
        r = self.rollout_of(step)
        if self.current is None or self.current[0] != r:
            self.current = (r, *self._make(r, sharding, params))
            self.padding[r] = self.current[2].pop("padding_frac")
        return self.current[1]

    def metrics(self, step: int) -> dict:
        """The rollout metrics of the batch step `step` (0-based) trained on."""
        assert self.current is not None and self.current[0] == self.rollout_of(step)
        return dict(self.current[2])

    def padding_frac(self, steps) -> float:
        """The share of padding positions over the batches of `steps` (0-based); forgets older ones."""
        used = sorted({self.rollout_of(s) for s in steps} & set(self.padding))
        for r in [r for r in self.padding if used and r < used[0]]:
            del self.padding[r]
        return float(np.mean([self.padding[r] for r in used])) if used else 0.0

    def _round(self, r: int, k: int, sample) -> dict:
        """Round k of rollout r's generation: its prompts (the step's for k = 0; with dynamic sampling, further
        ones drawn from (seed, r, k)) each G times, their completions and rewards, as lists a row each."""
        cfg, rl = self.cfg, self.cfg.rl
        chosen = (prompts_lib.step_prompts(len(self.prompts.ids), self.per_step, cfg.train.seed, r) if k == 0 else
                  np.random.default_rng([cfg.train.seed, r, k]).choice(len(self.prompts.ids), self.per_step))
        chosen = np.repeat(chosen, rl.group_size)
        prompt_ids = [self.prompts.ids[i] for i in chosen]
        seed = int(np.random.SeedSequence([cfg.train.seed, r] + ([k] if k else [])).generate_state(1)[0])
        out = sample(prompt_ids, seed)
        completions = [out["tokens"][i, :n].tolist() for i, n in enumerate(out["lengths"])]
        total, each = self.score([self.prompts.texts[i] for i in chosen], [self._text(c) for c in completions],
                                 **{k: [v[i] for i in chosen] for k, v in self.prompts.columns.items()})
        if rl.overlong_buffer:
            each["overlong"] = rewards_lib.overlong_penalty(out["lengths"], rl.max_new_tokens, rl.overlong_buffer)
            total = total + rl.overlong_factor * each["overlong"]
        return {"prompt_ids": prompt_ids, "completions": completions, "stopped": out["stopped"].tolist(),
                "logprobs": list(out["logprobs"]), "total": total, "each": each}

    def _sampler(self, params, timed: bool):
        """`sample(prompt_ids, seed)`: one completion per prompt, as `generate_arrays` gives them, by `rl.sampler`
        (the same tokens). The engine is built (its weights resharded) once, here, timed as `reshard` if `timed`."""
        rl = self.cfg.rl
        sampling = {"temperature": rl.temperature, "stop_ids": self.tokenizer.stop_ids}
        if rl.sampler == "static":
            return lambda ids, seed: generate_arrays(params, self.cfg, ids, rl.max_new_tokens, on=self.fns, seed=seed,
                                                     **sampling)
        slots = rl.engine_slots or self.cfg.train.global_batch
        with self.clock.timing("reshard") if timed and self.clock else contextlib.nullcontext():
            engine = Engine(params, self.cfg, slots=slots, on=self.fns, steps_per_call=rl.engine_steps_per_call,
                            pages=rl.engine_pages)
        return lambda ids, seed: _as_arrays(engine.generate(ids, rl.max_new_tokens, seed=seed, **sampling),
                                            rl.max_new_tokens)

    def _rollouts(self, r: int, params, timed: bool = True) -> tuple[dict, int]:
        """The rows rollout r trains on, and the rounds of generation it took: round 0 whole, or with dynamic
        sampling (`rl.max_num_gen_batches`) the first per_step groups with reward spread over the rounds,
        filled where short with groups without (marked `idle`: their loss mask is zeroed)."""
        rl, g = self.cfg.rl, self.cfg.rl.group_size
        if timed and self.clock:  # the step computing `params` may still run: step time, not the rollout's
            with self.clock.timing("step"):
                jax.block_until_ready(params)
        sample = self._sampler(params, timed)
        first = self._round(r, 0, sample)
        if not rl.max_num_gen_batches:
            return first, 1
        rounds = [first]
        while True:
            spread = [_spread(x["total"], g) for x in rounds]
            if sum(map(np.sum, spread)) >= self.per_step or len(rounds) == rl.max_num_gen_batches:
                break
            rounds.append(self._round(r, len(rounds), sample))
        order = [(j, i, True) for j, x in enumerate(spread) for i in np.flatnonzero(x)]
        order += [(j, i, False) for j, x in enumerate(spread) for i in np.flatnonzero(~x)]
        picked = order[:self.per_step]
        rows = lambda of: [v for j, i, _ in picked for v in of(rounds[j])[i * g:(i + 1) * g]]  # picked groups' rows
        out = {key: rows(lambda x, key=key: x[key]) for key in ("prompt_ids", "completions", "stopped", "logprobs")}
        out["total"] = np.asarray(rows(lambda x: x["total"]))
        out["each"] = {name: np.asarray(rows(lambda x, name=name: x["each"][name])) for name in first["each"]}
        out["idle"] = np.repeat([not kept for _, _, kept in picked], g)
        return out, len(rounds)

    def _sampled(self, r: int, params) -> tuple[dict, int, int]:
        """Rollout r's samples, rounds and staleness (rollouts between the sampling parameters and `params`).
        Synchronous: sampled now by `params`. Asynchronous (`rl.async_steps` = k): sampled on the sampler thread
        by the parameters at rollout r − k, started then; rollouts before k (or after a resume) by `params`. Either
        way rollout r + k is started now, on a copy of `params` (the step donates its buffers)."""
        k = self.cfg.rl.async_steps
        if not k:
            return (*self._rollouts(r, params), 0)
        future = self.pending.pop(r, None)
        made, rounds, staleness = (*future.result(), k) if future is not None else (*self._rollouts(r, params), 0)
        snapshot = jax.tree.map(jnp.copy, params)
        self.pending[r + k] = self.sampler.submit(self._rollouts, r + k, snapshot, False)
        return made, rounds, staleness

    def _make(self, r: int, sharding, params) -> tuple[dict, dict]:
        cfg, rl = self.cfg, self.cfg.rl
        made, rounds, staleness = self._sampled(r, params)
        host = rollouts.rows(made["prompt_ids"], made["completions"], made["stopped"], cfg.model.seq_len,
                             rl.mask_truncated)
        if "idle" in made:
            host["loss_mask"] = host["loss_mask"] * ~made["idle"][:, None]
        adv = advantages.group_advantages(made["total"], rl.group_size, rl.scale_rewards)
        host.update(advantages.token_fields(adv, host["loss_mask"], rl.loss_norm, rl.max_new_tokens))
        batch = batch_lib.global_arrays(host, sharding)
        contract = {k: batch[k] for k in batch_lib.FIELDS}
        batch["old_logp"] = self.fns.token_logp(params, contract)
        batch["ref_logp"] = (self.fns.token_logp(self.reference(params), contract) if self.reference is not None
                             else batch_lib.global_arrays({"z": np.zeros_like(host["weights"])}, sharding)["z"])
        if rl.async_steps:
            batch["behav_logp"] = batch_lib.global_arrays({"mu": _aligned(made, host["loss_mask"].shape)},
                                                          sharding)["mu"]
        batch_lib.check(batch, self.fns.objective.fields)
        metrics = self._metrics(made, host, batch["old_logp"])
        if rl.max_num_gen_batches:
            metrics.update(gen_rounds=float(rounds), idle_group_frac=float(np.mean(made["idle"])))
        if rl.async_steps:
            metrics["staleness"] = float(staleness)
        return batch, metrics

    def _text(self, completion: list) -> str:
        """A completion as the rewards read it: its text up to the stop id."""
        ids = [t for t in completion if t not in self.tokenizer.stop_ids and t < self.tokenizer.vocab_size]
        return self.tokenizer.decode(np.asarray(ids, np.uint32))

    def _metrics(self, made: dict, host, old_logp) -> dict:
        rl, total, each = self.cfg.rl, made["total"], made["each"]
        groups = total.reshape(-1, rl.group_size)
        lengths = np.asarray([len(c) for c in made["completions"]])
        trainer = np.asarray(multihost_utils.process_allgather(old_logp, tiled=True))  # every process's rows
        gaps = [np.abs(made["logprobs"][i][:n] - trainer[i, len(p) - 1:len(p) - 1 + n])
                for i, (p, n) in enumerate(zip(made["prompt_ids"], lengths))]
        metrics = {"reward_mean": float(total.mean()), "reward_std": float(total.std()),
                   "completion_len": float(lengths.mean()),
                   "zero_std_frac": float(np.mean(groups.max(axis=1) == groups.min(axis=1))),
                   "truncated_frac": float(1 - np.mean(made["stopped"])),
                   "logp_mismatch": float(np.concatenate(gaps).mean()),
                   "padding_frac": float(1 - np.mean(host["segment_ids"] > 0))}
        if len(each) > 1:
            metrics.update({f"reward_{name}": float(v.mean()) for name, v in each.items()})
        return metrics


def _aligned(made: dict, shape) -> np.ndarray:
    """The generator's log-probabilities [rows, seq] where the trainer's for the same tokens sit: a completion's
    tokens are the targets at positions P − 1 … (`rollouts.rows`); 0 elsewhere."""
    out = np.zeros(shape, np.float32)
    for i, (p, c) in enumerate(zip(made["prompt_ids"], made["completions"])):
        out[i, len(p) - 1:len(p) - 1 + len(c)] = made["logprobs"][i][:len(c)]
    return out


def _spread(total, group_size: int) -> np.ndarray:
    """Per group of `total` (rewards, group after group): whether its rewards differ."""
    groups = np.asarray(total).reshape(-1, group_size)
    return groups.max(axis=1) > groups.min(axis=1)


def _as_arrays(done: list, new: int) -> dict:
    """The engine's completions as `generate_arrays` gives them: tokens and logprobs [n, new] (valid up to
    `lengths`), lengths [n], stopped [n]."""
    out = {"tokens": np.zeros((len(done), new), np.int32), "logprobs": np.zeros((len(done), new), np.float32),
           "lengths": np.asarray([len(c.tokens) for c in done]), "stopped": np.asarray([c.stopped for c in done])}
    for i, c in enumerate(done):
        out["tokens"][i, :len(c.tokens)], out["logprobs"][i, :len(c.tokens)] = c.tokens, c.logprobs
    return out
