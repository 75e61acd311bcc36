"""docs/limits.md is the list of what jaxllm refuses: each row's keys, over a small LLaMA, are refused in one line
naming one of them (or its section: `model.lora`), before anything compiles; without those keys the model is
accepted."""

from __future__ import annotations

import math
import re

import pytest

from harness import REPO
from jaxllm.config import build_config, parse_overrides, validate
from jaxllm.errors import ConfigError

BASE = {"model.preset": "tiny-llama", "model.vocab_size": 257, "model.n_layers": 8, "model.seq_len": 32,
        "train.global_batch": 16}
ROW = re.compile(r"^\| `([^`]+)` \| (not yet|by design) \| .+ \|$", re.M)
ROWS = ROW.findall((REPO / "docs" / "limits.md").read_text())


def devices(cfg) -> int:
    return math.prod(v for v in vars(cfg.mesh).values() if isinstance(v, int) and v > 0)


def test_the_page_lists_the_refusals():
    assert len(ROWS) >= 10 and {status for _, status in ROWS} == {"not yet", "by design"}
    cfg = build_config(None, BASE)
    validate(cfg, devices(cfg))  # the model the rows change is fine on its own


@pytest.mark.parametrize("keys", [keys for keys, _ in ROWS])
def test_each_listed_combination_is_refused_in_one_line_naming_its_keys(keys):
    given = parse_overrides(keys.split())
    cfg = build_config(None, {**BASE, **given})
    with pytest.raises(ConfigError) as refused:
        validate(cfg, devices(cfg))
    message = str(refused.value)
    assert "\n" not in message, message
    assert any(key in message or key.rsplit(".", 1)[0] in message for key in given), (keys, message)
