"""Verifiable rewards: functions `(prompts, completions, **columns) -> list[float]`, one score per completion.

`columns` holds the data set's columns for each completion (an `answer` list, and any other column a
reward reads). Built in, each 1.0 or 0.0:

- `exact_match`: the completion equals `answer`, both stripped of surrounding whitespace.
- `gsm8k`: the number after the completion's last `#### ` equals the answer's (the answer may be a whole
  GSM8K solution: its own last `#### N`, else the answer itself). Numbers lose their commas, `$` and a
  trailing period and compare as decimals (`1,234.50` equals `1234.5`); no number after `####` scores 0.
- `boxed`: the content of the completion's last `\\boxed{...}`, braces balanced, equals the answer's
  (its own last `\\boxed{...}`, else the answer): as numbers where both are numbers, else as stripped text;
  an unclosed box scores 0.
- `format`: the completion matches a regular expression (`re.search`, `.` matching newlines too; anchor
  it with `^...$` to demand the whole).
- `python:module:function`: any importable function with the signature above.

Several rewards add up with weights: `parse(["gsm8k", "format*0.2"], format_pattern=...)` scores
`gsm8k + 0.2 · format`.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from decimal import Decimal, InvalidOperation
from typing import Callable

import numpy as np

from jaxllm.errors import ConfigError, DataError

_NUMBER = re.compile(r"[-+]?\$?\s*[-+]?(?:\d[\d,]*)?\.?\d+")


def as_number(text: str) -> Decimal | None:
    """The decimal `text` spells, commas, `$` and a trailing period ignored; None if it is not one."""
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    try:
        return Decimal(cleaned) if cleaned else None
    except InvalidOperation:
        return None


def gsm8k_answer(text: str) -> Decimal | None:
    """The number after the last `####` in `text`."""
    marks = text.split("####")
    if len(marks) < 2:
        return None
    found = _NUMBER.search(marks[-1].split("\n")[0])
    return as_number(found.group()) if found else None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, with nested braces; None when absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, at = 0, start + len("\\boxed")
    for i in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[at + 1:i]
    return None


def _same(a: str, b: str) -> bool:
    x, y = as_number(a), as_number(b)
    return x == y if x is not None and y is not None else a.strip() == b.strip()


def exact_match(prompts, completions, answer, **_) -> list[float]:
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]


def gsm8k(prompts, completions, answer, **_) -> list[float]:
    def want(a: str):
        return gsm8k_answer(a) if "####" in a else as_number(a)

    return [float((got := gsm8k_answer(c)) is not None and got == want(a)) for c, a in zip(completions, answer)]


def boxed(prompts, completions, answer, **_) -> list[float]:
    def want(a: str) -> str:
        inner = last_boxed(a)
        return a if inner is None else inner

    return [float((got := last_boxed(c)) is not None and _same(got, want(a))) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> Callable:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"format reward: {pattern!r} is not a regular expression ({e}); fix the pattern") from None

    def fmt(prompts, completions, **_) -> list[float]:
        return [float(compiled.search(c) is not None) for c in completions]

    return fmt


BUILT_IN = {"exact_match": exact_match, "gsm8k": gsm8k, "boxed": boxed}


def _import_here_too(module: str):
    """The module from the Python path or, as `python -m` finds one, the current directory (searched last, so a
    file there shadows no installed module)."""
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.append(here)
    try:
        return importlib.import_module(module)
    finally:
        if added:
            sys.path.remove(here)


def _hook(spec: str) -> Callable:
    """`python:module:function` as the function."""
    module, _, name = spec[len("python:"):].partition(":")
    try:
        fn = getattr(_import_here_too(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"reward {spec!r}: cannot import it ({type(e).__name__}: {e}); give "
                          "python:module:function with the module in the current directory or on the Python "
                          "path") from None
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {name} is not a function")
    return fn


def _one(spec: str, format_pattern: str) -> tuple[str, Callable, float]:
    """'name' or 'name*weight' as (name, function, weight)."""
    name, star, weight = spec.rpartition("*") if "*" in spec else (spec, "", "1")
    try:
        w = float(weight)
    except ValueError:
        raise ConfigError(f"reward {spec!r}: the weight after '*' must be a number") from None
    if name.startswith("python:"):
        return name, _hook(name), w
    if name == "format":
        if not format_pattern:
            raise ConfigError("reward 'format' needs a regular expression to match; set rl.format_pattern")
        return name, format_reward(format_pattern), w
    if name not in BUILT_IN:
        raise ConfigError(f"reward {name!r}: not one of {', '.join([*BUILT_IN, 'format', 'python:module:function'])}")
    return name, BUILT_IN[name], w


def parse(specs: list[str], format_pattern: str = "") -> Callable:
    """The weighted sum of the rewards `specs` names: a function `(prompts, completions, **columns) ->
    (total, {name: scores})`, numpy float64 arrays of one score per completion."""
    if not specs:
        raise ConfigError("rewards: name at least one (exact_match, gsm8k, boxed, format, python:module:function)")
    parts = [_one(s, format_pattern) for s in specs]

    def score(prompts, completions, **columns):
        each = {}
        for name, fn, _ in parts:
            out = np.asarray(fn(prompts, completions, **columns), np.float64)
            if out.shape != (len(completions),) or not np.isfinite(out).all():
                raise DataError(f"reward {name}: returned {out.shape[0] if out.ndim == 1 else out.shape} scores "
                                f"(finite: {bool(np.isfinite(out).all())}) for {len(completions)} completions; "
                                "return one finite float per completion")
            each[name] = out
        return sum(w * each[name] for name, _, w in parts), each

    return score


def overlong_penalty(lengths, max_new: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) with L_max = `max_new` and L_cache = `buffer`:
    0 up to L_max − L_cache tokens, then falling linearly to −1 at L_max, −1 beyond; one per completion."""
    lengths = np.asarray(lengths, np.float64)
    start = max_new - buffer
    return np.where(lengths <= start, 0.0, np.where(lengths <= max_new, (start - lengths) / buffer, -1.0))
