"""The batches of a GRPO run: the policy's own samples, scored and laid out for the step.

Every `rl.num_iterations` steps (the first step of each batch of rollouts) the current parameters make a
new batch, which the following steps reuse:

1. the step's prompts (`prompts.step_prompts`), each repeated `rl.group_size` times, group after group;
2. one completion per row from `jaxllm.generate` on the run's mesh, at `rl.temperature`, seeded by
   (train.seed, rollout); the program hands every process all of them;
3. the rewards (`rewards.py`), which every process computes over every completion, so a group never
   straddles processes and all agree on its advantages;
4. advantages (`advantages.py`) and rows (`rollouts.py`), as global arrays over the batch axes;
5. `old_logp` from the trainer's own forward pass at the temperature (`StepFns.token_logp`) with the
   parameters that sampled, and `ref_logp` with the reference policy's (β > 0; zeros otherwise), `reference(params)`
   giving its parameters from the policy's.

The generator's own log-probabilities are kept for one metric, `logp_mismatch`: the mean over completion
tokens of |generator − trainer|, which is rounding alone when both run the same model in the same dtype.
"""

from __future__ import annotations

import numpy as np
from jax.experimental import multihost_utils

from jaxllm import batch as batch_lib
from jaxllm.generate import generate_arrays
from jaxllm.rl import advantages, prompts as prompts_lib, rewards as rewards_lib, rollouts


class RolloutBatches:
    """The data object of a GRPO run (the loop's `data`): `train_batch(step, sharding, params)` and the
    rollout metrics of the batch each step trained on."""

    has_validation = False
    steps_per_epoch = None

    def __init__(self, cfg, tokenizer, prompts: prompts_lib.Prompts, fns, reference=None):
        self.cfg, self.tokenizer, self.prompts, self.fns, self.reference = cfg, tokenizer, prompts, fns, reference
        self.score = rewards_lib.parse(cfg.rl.rewards, cfg.rl.format_pattern)
        self.per_step = cfg.train.global_batch // cfg.rl.group_size
        self.current = None  # (rollout index, batch, metrics)
        self.padding: dict[int, float] = {}  # rollout index -> share of padding positions

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

    def _make(self, r: int, sharding, params) -> tuple[dict, dict]:
        cfg, rl = self.cfg, self.cfg.rl
        chosen = np.repeat(prompts_lib.step_prompts(len(self.prompts.ids), self.per_step, cfg.train.seed, r),
                           rl.group_size)
        prompt_ids = [self.prompts.ids[i] for i in chosen]
        seed = int(np.random.SeedSequence([cfg.train.seed, r]).generate_state(1)[0])
        out = generate_arrays(params, cfg, prompt_ids, rl.max_new_tokens, on=self.fns, temperature=rl.temperature,
                              stop_ids=self.tokenizer.stop_ids, seed=seed)
        completions = [out["tokens"][i, :n].tolist() for i, n in enumerate(out["lengths"])]
        total, each = self.score([self.prompts.texts[i] for i in chosen], [self._text(c) for c in completions],
                                 **{k: [v[i] for i in chosen] for k, v in self.prompts.columns.items()})
        host = rollouts.rows(prompt_ids, completions, out["stopped"].tolist(), cfg.model.seq_len, rl.mask_truncated)
        adv = advantages.group_advantages(total, rl.group_size, rl.scale_rewards)
        host.update(advantages.token_fields(adv, host["loss_mask"], rl.loss_norm, rl.max_new_tokens))
        batch = batch_lib.global_arrays(host, sharding)
        contract = {k: batch[k] for k in batch_lib.FIELDS}
        batch["old_logp"] = self.fns.token_logp(params, contract)
        batch["ref_logp"] = (self.fns.token_logp(self.reference(params), contract) if self.reference is not None
                             else batch_lib.global_arrays({"z": np.zeros_like(host["weights"])}, sharding)["z"])
        batch_lib.check(batch, self.fns.objective.fields)
        return batch, self._metrics(total, each, completions, prompt_ids, out, host, batch["old_logp"])

    def _text(self, completion: list) -> str:
        """A completion as the rewards read it: its text up to the stop id."""
        ids = [t for t in completion if t not in self.tokenizer.stop_ids and t < self.tokenizer.vocab_size]
        return self.tokenizer.decode(np.asarray(ids, np.uint32))

    def _metrics(self, total, each, completions, prompt_ids, out, host, old_logp) -> dict:
        rl = self.cfg.rl
        groups = total.reshape(-1, rl.group_size)
        lengths = np.asarray([len(c) for c in completions])
        trainer = np.asarray(multihost_utils.process_allgather(old_logp, tiled=True))  # every process's rows
        gaps = [np.abs(out["logprobs"][i, :n] - trainer[i, len(p) - 1:len(p) - 1 + n])
                for i, (p, n) in enumerate(zip(prompt_ids, lengths))]
        metrics = {"reward_mean": float(total.mean()), "reward_std": float(total.std()),
                   "completion_len": float(lengths.mean()),
                   "zero_std_frac": float(np.mean(groups.max(axis=1) == groups.min(axis=1))),
                   "truncated_frac": float(1 - np.mean(out["stopped"])),
                   "logp_mismatch": float(np.concatenate(gaps).mean()),
                   "padding_frac": float(1 - np.mean(host["segment_ids"] > 0))}
        if len(each) > 1:
            metrics.update({f"reward_{name}": float(v.mean()) for name, v in each.items()})
        return metrics
