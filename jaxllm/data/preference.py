"""Preference pairs from a JSONL file (`data.format = "preference"`, for `train.objective = "dpo"`).

Each line holds a prompt and two completions of it, the preferred and the other (`data.prompt_key`,
`data.chosen_key`, `data.rejected_key`), as TRL's explicit-prompt preference datasets do: all three strings (the
text prompt + completion, then the end-of-text token), or a list of messages for the prompt and for each
completion (rendered by the chat template; the completion's assistant replies). Each completion becomes one
sequence, prompt then completion, whose completion tokens alone are learned (`data.loss_on` does not apply).

Lengths: `data.max_prompt_tokens` cuts a longer prompt at `data.truncation_side` (`left` keeps its end, next to
the completion; an `hf:DIR` tokenizer's BOS stays first), `data.max_completion_tokens` cuts a longer completion
at its end. A pair's two sequences share one row (so a pair never spans microbatches or devices: the objective's
sums stay whole, `trainer/preference.py`); one that still does not fit follows `data.truncation`: `error`, `drop`,
or `truncate` (the longer sequence's end cut until the pair fits; dropped if a completion is left without a
token to learn).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.data import examples as examples_lib
from jaxllm.data.examples import Example
from jaxllm.errors import ConfigError, DataError

SIDES = ("left", "right")


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    line: int  # 1-based line of the source file
    key: str  # the raw line, for the train/validation split

    @property
    def parts(self) -> tuple:
        return self.chosen, self.rejected


def check_config(d) -> list[str]:
    if d.truncation_side not in SIDES:
        raise ConfigError(f"data.truncation_side: '{d.truncation_side}' is not one of {', '.join(SIDES)}")
    for key in ("max_prompt_tokens", "max_completion_tokens"):
        if getattr(d, key) < 0:
            raise ConfigError(f"data.{key}: must be 0 (no limit) or more, got {getattr(d, key)}")
    if d.format == "preference" and d.loss_on != "assistant":
        raise ConfigError("data.loss_on: a preference pair learns its completions only; leave it at assistant")
    return []


def _limited(ids: np.ndarray, learn: np.ndarray, d, bos: bool) -> Example:
    """The sequence with its prompt and completion cut to the limits. Its first learned token starts the
    completion (never token 0), and each limit keeps at least one token, so one is still learned."""
    start = int(np.argmax(learn))
    prompt, completion = np.arange(start), np.arange(start, len(ids))
    if d.max_prompt_tokens and len(prompt) > d.max_prompt_tokens:
        keep = d.max_prompt_tokens
        if d.truncation_side == "right":
            prompt = prompt[:keep]
        else:  # the end of the prompt, after the BOS an hf:DIR tokenizer puts first
            prompt = np.concatenate([prompt[:int(bos)], prompt[len(prompt) - keep + int(bos):]])
    if d.max_completion_tokens:
        completion = completion[:d.max_completion_tokens]
    at = np.concatenate([prompt, completion]).astype(np.int64)
    return Example(ids[at], learn[at], 0, "")


def _fit(pair: Pair, seq_len: int, truncation: str, source: str) -> Pair | None:
    """The pair cut to fit one row (`truncate`), as it is when it fits, None to drop it; DataError (`error`)."""
    sizes = [len(ex.ids) - 1 for ex in pair.parts]
    if sum(sizes) <= seq_len:
        return pair
    if truncation == "error":
        raise DataError(f"data.source {source} line {pair.line}: the pair's two sequences fill {sizes[0]} + {sizes[1]} "
                        f"positions, more than model.seq_len={seq_len}; raise model.seq_len, set "
                        "data.max_prompt_tokens / data.max_completion_tokens, or data.truncation to drop or truncate")
    if truncation == "drop":
        return None
    while sum(sizes) > seq_len:  # one position off the longer sequence's end
        sizes[int(sizes[1] > sizes[0])] -= 1
    parts = [Example(ex.ids[:n + 1], ex.learn[:n + 1], 0, "") for ex, n in zip(pair.parts, sizes)]
    return Pair(*parts, pair.line, pair.key) if all(ex.learn.any() for ex in parts) else None


def read_pairs(path: str, d, tokenizer, template) -> list[Pair]:
    """Every line of a JSONL file as a Pair within the length limits (blank lines skipped); DataError for a bad
    line."""
    bos = bool(getattr(tokenizer, "add_bos", False))
    keys = (d.prompt_key, d.chosen_key, d.rejected_key)
    pairs = []
    for where, number, line, obj in examples_lib.read_lines(path):
        if not isinstance(obj, dict):
            raise DataError(f"{where}: not a JSON object; each line must be one preference pair")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise DataError(f"{where}: no {' or '.join(repr(k) for k in missing)} (data.prompt_key / data.chosen_key "
                            "/ data.rejected_key); each line needs a prompt, a chosen and a rejected completion")
        sides = []
        for key in keys[1:]:
            ids, learn = examples_lib.completion_example(obj[keys[0]], obj[key], where, (keys[0], key), template,
                                                         tokenizer)
            learn = np.asarray(learn, bool)
            learn[:1] = False
            if not learn.any():
                raise DataError(f"{where}: the '{key}' completion has no token to learn (an empty completion, or "
                                "no assistant reply the template marks); fix the line")
            sides.append(_limited(np.asarray(ids, np.int32), learn, d, bos))
        pairs.append(Pair(*sides, number, line))
    if not pairs:
        raise DataError(f"data.source: '{path}' holds no preference pairs; give a JSONL file with one pair per line")
    return pairs


def fit(pairs: list[Pair], seq_len: int, truncation: str, source: str = "") -> tuple[list[Pair], int, int]:
    """Pairs whose two sequences fit one row: (kept, truncated, dropped), by `data.truncation`."""
    kept, truncated, dropped = [], 0, 0
    for pair in pairs:
        fitted = _fit(pair, seq_len, truncation, source)
        if fitted is None:
            dropped += 1
        else:
            kept.append(fitted)
            truncated += fitted is not pair
    return kept, truncated, dropped
