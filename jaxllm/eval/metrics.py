"""The metrics of lm-evaluation-harness 0.4, from per-request log-likelihoods.

Multiple choice, per document then averaged: `acc` (the choice of largest log-likelihood is the gold one; ties to
the first), `acc_norm` (log-likelihood over the choice's length in characters), `acc_bytes` (over its UTF-8 bytes).
Generation, per document then averaged: `exact_match` after the filters (`regex`: the `group_select`-th match of
the pattern, stripped, else "[invalid]"; `take_first`), both strings first stripped of `regexes_to_ignore`, then
lowered (`ignore_case`), without punctuation or digits (`ignore_punctuation`, `ignore_numbers`).
Rolling log-likelihood, over the whole corpus: `word_perplexity` = exp(-Σ ll / Σ words) with words as
`re.split(r"\\s+", text)` counts them, `byte_perplexity` = exp(-Σ ll / Σ bytes), `bits_per_byte` =
-Σ ll / Σ bytes / ln 2.
"""

from __future__ import annotations

import math
import re
import string

import numpy as np


def gold_index(target, choices: list[str]) -> int:
    return target if isinstance(target, int) else choices.index(target) if target in choices else -100


def choice_scores(lls: list[float], choices: list[str], target) -> dict[str, float]:
    """One document's acc, acc_norm and acc_bytes."""
    lls = np.asarray(lls, np.float64)
    chars = np.asarray([float(len(c)) for c in choices])
    nbytes = np.asarray([float(len(c.encode("utf-8"))) for c in choices])
    gold = gold_index(target, choices)
    return {"acc": float(np.argmax(lls) == gold), "acc_norm": float(np.argmax(lls / chars) == gold),
            "acc_bytes": float(np.argmax(lls / nbytes) == gold)}


def rolling_scores(lls: list[float], texts: list[str]) -> dict[str, float]:
    ll = float(sum(lls))
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"word_perplexity": math.exp(-ll / words), "byte_perplexity": math.exp(-ll / nbytes),
            "bits_per_byte": -ll / nbytes / math.log(2)}


GSM8K_PATTERN = r"#### (\-?[0-9\.\,]+)"  # lm-evaluation-harness's regex filter default


def apply_filter(steps: list[dict], text: str) -> str:
    for step in steps:
        if step["function"] == "regex":
            found = re.findall(step.get("regex_pattern", GSM8K_PATTERN), text)
            if found:
                found = found[step.get("group_select", 0)]
                if isinstance(found, tuple):
                    found = next((m for m in found if m), step.get("fallback", "[invalid]"))
                text = found.strip()
            else:
                text = step.get("fallback", "[invalid]")
    return text  # take_first: one response per request here


def exact_match(prediction: str, gold: str, regexes_to_ignore=(), ignore_case=False, ignore_punctuation=False,
                ignore_numbers=False) -> float:
    for pattern in regexes_to_ignore or ():
        prediction, gold = re.sub(pattern, "", prediction), re.sub(pattern, "", gold)
    if ignore_case:
        prediction, gold = prediction.lower(), gold.lower()
    for flag, chars in ((ignore_punctuation, string.punctuation), (ignore_numbers, string.digits)):
        if flag:
            table = str.maketrans("", "", chars)
            prediction, gold = prediction.translate(table), gold.translate(table)
    return float(prediction == gold)
