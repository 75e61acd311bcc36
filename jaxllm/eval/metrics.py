"""The metrics of lm-evaluation-harness 0.4, from per-request log-likelihoods.

Multiple choice, per document then averaged: `acc` (the choice of largest log-likelihood is the gold one; ties to
the first), `acc_norm` (log-likelihood over the choice's length in characters), `acc_bytes` (over its UTF-8 bytes).
Rolling log-likelihood, over the whole corpus: `word_perplexity` = exp(-Σ ll / Σ words) with words as
`re.split(r"\\s+", text)` counts them, `byte_perplexity` = exp(-Σ ll / Σ bytes), `bits_per_byte` =
-Σ ll / Σ bytes / ln 2.
"""

from __future__ import annotations

import math
import re

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
