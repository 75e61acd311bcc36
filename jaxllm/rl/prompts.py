"""What reinforcement learning samples from: prompts with their answers, and which of them each step takes.

`data.source` is a JSONL file, one prompt per line: the prompt under `data.prompt_key` (a string, continued
as it is, or with `data.format = "chat"` the user's message; or a list of messages; messages are rendered
by the chat template with its generation prompt), `answer` (read
by the exact_match, gsm8k and boxed rewards) and any other column a reward reads; rewards get each column
as a list with one entry per completion. Every line must have the columns the first one has.

`data.source = "arith"` is the built-in task: the 100 prompts `a+b=` for a, b ∈ 0..9, answered by (a+b) mod
10 as one digit (`jaxllm/configs/grpo_arith.toml`; what GRPO reaches on it: BENCHMARKS.md "GRPO").

Each step takes `train.global_batch / rl.group_size` prompts: epoch after epoch of a permutation drawn
from (train.seed, epoch), so a step's prompts depend on the seed and the step alone.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from jaxllm.data import chat
from jaxllm.data.examples import check_messages, prompt_ids, read_lines
from jaxllm.errors import ConfigError, DataError
from jaxllm.rl import rewards
from jaxllm.rl.advantages import LOSS_NORMS, SCALE_REWARDS

RL_LOSSES = ("grpo", "gspo")  # `rl.loss`: trainer/objectives.grpo and gspo
SAMPLERS = ("static", "engine")  # `rl.sampler`: generate/decode.py and generate/engine.py

BUILT_IN_TASKS = ("arith",)
PROMPT_FORMATS = ("text", "chat")  # data.format: a string prompt continued as it is | as the user's message
ANSWER_REWARDS = ("exact_match", "gsm8k", "boxed")  # the built-in rewards that read `answer`


@dataclass(frozen=True)
class Prompts:
    ids: list  # each prompt's token ids
    texts: list  # each prompt as the data gives it (a string or a list of messages), for the rewards
    columns: dict  # every other column: name -> [one value per prompt]
    description: str


def arith_lines() -> list[dict]:
    """The built-in task's prompts and answers."""
    return [{"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)} for a in range(10) for b in range(10)]


def _lines(source: str, prompt_key: str) -> list[tuple[str, dict]]:
    """(where, object) for each prompt of `data.source`."""
    if source in BUILT_IN_TASKS:
        return [(f"task {source} prompt {i}", {prompt_key: line["prompt"], "answer": line["answer"]})
                for i, line in enumerate(arith_lines(), 1)]
    if not os.path.isfile(source):
        raise DataError(f"data.source: train.objective=grpo reads prompts from a JSONL file or the built-in task "
                        f"{' or '.join(BUILT_IN_TASKS)}, and '{source}' is neither")
    return [(where, obj) for where, _, _, obj in read_lines(source)]


def load(cfg, tokenizer) -> Prompts:
    """Every prompt of `data.source`, tokenized; DataError (one line) for a line that is not one."""
    d = cfg.data
    template = functools.cache(lambda: chat.load_template(d.chat_template, tokenizer, d.chat_template_kwargs))
    lines = _lines(d.source, d.prompt_key)
    if not lines:
        raise DataError(f"data.source: '{d.source}' holds no prompts; give a JSONL file with one prompt per line")
    keys = None
    ids, texts, columns = [], [], {}
    for where, obj in lines:
        if not isinstance(obj, dict) or d.prompt_key not in obj:
            raise DataError(f"{where}: no '{d.prompt_key}' (data.prompt_key); each line needs its prompt")
        keys = set(obj) if keys is None else keys
        if set(obj) != keys:
            raise DataError(f"{where}: columns {sorted(obj)} differ from the first line's {sorted(keys)}; give every "
                            "line the same columns")
        prompt = obj[d.prompt_key]
        if isinstance(prompt, str):
            prompt = prompt + cfg.rl.prompt_suffix
        if isinstance(prompt, str) and d.format == "chat":
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, str):
            prompt = check_messages(prompt, where, f"'{d.prompt_key}'")
        ids.append([int(i) for i in prompt_ids(prompt, template, tokenizer)])
        texts.append(prompt)
        for k, v in obj.items():
            if k != d.prompt_key:
                columns.setdefault(k, []).append(v)
    _check_columns(cfg, columns, lines[0][0])
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if len(ids[longest]) + cfg.rl.max_new_tokens - 1 > cfg.model.seq_len:
        raise DataError(f"{lines[longest][0]}: its {len(ids[longest])} tokens and rl.max_new_tokens="
                        f"{cfg.rl.max_new_tokens} do not fit model.seq_len={cfg.model.seq_len}; raise model.seq_len "
                        f"to {len(ids[longest]) + cfg.rl.max_new_tokens - 1} or shorten the prompt")
    where = template().source if template.cache_info().currsize else "no template"
    return Prompts(ids, texts, columns, f"{d.source} (prompts, {where}): {len(ids)} prompts, columns "
                                        f"{sorted(columns) or 'none'}")


def _check_columns(cfg, columns: dict, where: str) -> None:
    """The columns the configured rewards read are there; answers given as numbers become their text."""
    names = [spec.rpartition("*")[0] if "*" in spec else spec for spec in cfg.rl.rewards]
    needs = [n for n in names if n in ANSWER_REWARDS]
    if not needs:
        return
    if "answer" not in columns:
        raise DataError(f"{where}: no 'answer', which the {needs[0]} reward compares with; add it to every line")
    for i, a in enumerate(columns["answer"]):
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise DataError(f"data.source: prompt {i + 1}'s answer is {a!r}; give a string or a number")
        columns["answer"][i] = str(a)


def step_prompts(n: int, per_step: int, seed: int, step: int) -> np.ndarray:
    """The prompts of step `step` (0-based): positions step·per_step … of the stream of epochs."""
    at = np.arange(step * per_step, (step + 1) * per_step)
    epochs, index = np.divmod(at, n)
    orders = {e: np.random.default_rng([seed, e]).permutation(n) for e in np.unique(epochs).tolist()}
    return np.asarray([orders[e][i] for e, i in zip(epochs.tolist(), index.tolist())], np.int64)


def check_config(cfg) -> list[str]:
    """The `rl` section, for train.objective = grpo, before anything is read."""
    r, t = cfg.rl, cfg.train
    for key, choices in (("scale_rewards", SCALE_REWARDS), ("loss_norm", LOSS_NORMS), ("loss", RL_LOSSES),
                         ("sampler", SAMPLERS)):
        if getattr(r, key) not in choices:
            raise ConfigError(f"rl.{key}: '{getattr(r, key)}' is not one of {', '.join(choices)}")
    if r.engine_slots < 0:
        raise ConfigError(f"rl.engine_slots must be 0 (all of a step's completions) or more, got {r.engine_slots}")
    if r.engine_pages < 0:
        raise ConfigError(f"rl.engine_pages must be 0 (what the slots need) or more, got {r.engine_pages}")
    if r.engine_steps_per_call < 1:
        raise ConfigError(f"rl.engine_steps_per_call must be 1 or more, got {r.engine_steps_per_call}")
    if r.async_steps < 0 or (r.async_steps and r.behaviour_cap <= 0):
        raise ConfigError(f"rl.async_steps must be 0 or more, and with it rl.behaviour_cap above 0 (got "
                          f"{r.async_steps}, {r.behaviour_cap})")
    if r.async_steps and r.loss == "gspo":
        raise ConfigError("rl.async_steps with rl.loss=gspo is not supported yet (the decoupled weight is per token); "
                          "use rl.loss=grpo or rl.async_steps=0")
    if r.loss == "gspo" and r.loss_norm != "sequence":
        raise ConfigError(f"rl.loss=gspo takes each completion's mean log-ratio and the mean over completions: set "
                          f"rl.loss_norm=sequence (not {r.loss_norm})")
    if r.group_size < 2:
        raise ConfigError(f"rl.group_size: a group needs at least 2 completions to compare, got {r.group_size}")
    if t.global_batch % r.group_size:
        raise ConfigError(f"train.global_batch={t.global_batch} is not a multiple of rl.group_size={r.group_size}: "
                          "it counts completions, prompts per step × group_size")
    for key in ("max_new_tokens", "num_iterations"):
        if getattr(r, key) < 1:
            raise ConfigError(f"rl.{key}: must be at least 1, got {getattr(r, key)}")
    if r.max_num_gen_batches < 0 or not 0 <= r.overlong_buffer <= r.max_new_tokens:
        raise ConfigError(f"rl.max_num_gen_batches must be 0 or more and rl.overlong_buffer between 0 and "
                          f"rl.max_new_tokens={r.max_new_tokens} (got {r.max_num_gen_batches}, {r.overlong_buffer})")
    if r.temperature <= 0:
        raise ConfigError(f"rl.temperature: must be > 0 (the ratio needs the sampling distribution), got {r.temperature}")
    if not 0 < r.epsilon < 1 or r.epsilon_high < 0 or r.beta < 0:
        raise ConfigError("rl.epsilon must be in (0, 1), rl.epsilon_high and rl.beta 0 or more")
    if t.steps % r.num_iterations:
        raise ConfigError(f"train.steps={t.steps} is not a multiple of rl.num_iterations={r.num_iterations}: the run "
                          "would end between the updates of one batch of rollouts")
    if t.checkpoint_every % r.num_iterations:
        raise ConfigError(f"train.checkpoint_every={t.checkpoint_every} is not a multiple of rl.num_iterations="
                          f"{r.num_iterations}: a checkpoint would fall between the updates of one batch of rollouts")
    if t.epochs:
        raise ConfigError("train.epochs: GRPO counts optimizer steps; set train.steps and train.epochs = 0")
    if cfg.data.format not in PROMPT_FORMATS:
        raise ConfigError(f"data.format: train.objective=grpo reads prompts as {' or '.join(PROMPT_FORMATS)} (README: "
                          f"GRPO), not '{cfg.data.format}'")
    rewards.parse(r.rewards, r.format_pattern)  # a reward that cannot be built is one line before anything runs
    notes = []
    if cfg.data.val_percent and t.eval_every:
        notes.append("train.objective=grpo: no validation loss (the rewards measure it); train.eval_every is ignored")
    return notes
