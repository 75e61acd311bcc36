"""The verifiable rewards on fixtures: GSM8K's `#### N`, the last `\\boxed{...}`, exact match, a format pattern
and a Python hook, with negatives, decimals, commas, nested braces and no match; their weighted sum."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from jaxllm.errors import ConfigError, DataError
from jaxllm.rl import rewards


def score(spec: str, completions, answers, pattern: str = "") -> list[float]:
    total, _ = rewards.parse([spec], pattern)([""] * len(completions), completions, answer=answers)
    return total.tolist()


GSM8K = [  # (completion, answer, reward)
    ("She pays 3 * 24 = 72 dollars.\n#### 72", "72", 1.0),
    ("#### 1,234.50.", "1234.5", 1.0),
    ("#### $18", "18", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### 5", "-5", 0.0),
    ("#### .5", "0.5", 1.0),
    ("first #### 3\nthen #### 4", "4", 1.0),  # the last mark counts
    ("first #### 4\nthen #### 3", "4", 0.0),
    ("The answer is 72.", "72", 0.0),  # no mark
    ("#### seventy-two", "72", 0.0),  # no number after it
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # a whole GSM8K solution as the answer
    ("#### 71", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 0.0),
]


@pytest.mark.parametrize("completion, answer, reward", GSM8K)
def test_gsm8k(completion, answer, reward):
    assert score("gsm8k", [completion], [answer]) == [reward]


BOXED = [
    ("so \\boxed{42}", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # unclosed
    ("\\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box
    ("\\boxed{ 3.0 }", "3", 1.0),  # as numbers
    ("\\boxed{-1,000}", "-1000", 1.0),
    ("\\boxed{x+1}", "x + 1", 0.0),  # text compares as text
    ("no box: 42", "42", 0.0),
    ("\\boxed{7}", "The answer is \\boxed{7}.", 1.0),  # the answer's own box
]


@pytest.mark.parametrize("completion, answer, reward", BOXED)
def test_boxed(completion, answer, reward):
    assert score("boxed", [completion], [answer]) == [reward]


def test_exact_match_and_format():
    assert score("exact_match", [" 7\n", "7.0", ""], ["7", "7", "7"]) == [1.0, 0.0, 0.0]
    pattern = r"^<think>.*</think>\s*<answer>.*</answer>$"
    assert score("format", ["<think>a\nb</think> <answer>3</answer>", "<answer>3</answer>", "<think></think>"],
                 ["", "", ""], pattern) == [1.0, 0.0, 0.0]


def length_reward(prompts, completions, answer, **columns):
    """A hook for the test below: the completion's length times a column."""
    return [len(c) * w for c, w in zip(completions, columns["weight"])]


def bad_reward(prompts, completions, **_):
    return [1.0]


def test_weighted_sum_of_rewards_and_a_python_hook():
    fn = rewards.parse(["exact_match*2", "python:test_rewards:length_reward*0.5", "gsm8k"])
    total, each = fn(["p", "q"], ["#### 3", "ab"], answer=["#### 3", "3"], weight=[1.0, 10.0])
    assert each["exact_match"].tolist() == [1.0, 0.0] and each["gsm8k"].tolist() == [1.0, 0.0]
    assert each["python:test_rewards:length_reward"].tolist() == [6.0, 20.0]
    np.testing.assert_array_equal(total, [2 * 1 + 0.5 * 6 + 1, 0 + 0.5 * 20 + 0])


@pytest.mark.parametrize("specs, problem", [
    ([], "at least one"), (["f1"], "not one of"), (["gsm8k*x"], "must be a number"), (["format"], "regular expression"),
    (["python:no_such_module:f"], "cannot import"), (["python:test_rewards:GSM8K"], "not a function"),
])
def test_bad_reward_specs_are_one_line(specs, problem):
    with pytest.raises(ConfigError, match=problem) as e:
        rewards.parse(specs)
    assert "\n" not in str(e.value)


def test_a_hook_module_in_the_current_directory_is_found_and_shadows_nothing(tmp_path, monkeypatch):
    """As `python -m` finds a module in the current directory (the `jaxllm` command does not put it on the path):
    searched last, and off the path again afterwards."""
    (tmp_path / "my_rewards_here.py").write_text("def brevity(prompts, completions, **_):\n"
                                                 "    return [-float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    total, _ = rewards.parse(["python:my_rewards_here:brevity*0.1"])(["p", "q"], ["ab", "abcd"], answer=["", ""])
    np.testing.assert_allclose(total, [-0.2, -0.4])
    assert sys.path == path


def test_a_hook_returning_the_wrong_number_of_scores_is_refused():
    with pytest.raises(DataError, match="returned 1 scores"):
        rewards.parse(["python:test_rewards:bad_reward"])(["a", "b"], ["x", "y"], answer=["", ""])
