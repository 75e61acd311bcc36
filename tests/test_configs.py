"""The shipped configs: every file validates as it is (fast tier), and the parallel ones train.

The parallel configs run two steps each in the slow tier with the model shrunk — the tiny
preset of their family, a short sequence, as many layers as the pipeline needs — and the small
fixture corpus; every other key as shipped, so their meshes, schedules, precision, evaluation,
checkpoint and end-of-run sample all run.
"""

import glob
import json
import math
import os
import tomllib

import pytest

from harness import CORPUS, REPO
from jaxllm.config import CONFIG_DIR
from jaxllm.config import build_config, to_dict
from jaxllm.trainer.loop import resolve, train

CONFIGS = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.toml")))
SHRUNK = {  # file -> the keys that shrink its model
    "pipeline_1f1b.toml": {"model.preset": "tiny-gpt2", "model.n_layers": 4, "model.seq_len": 64},
    "pipeline_3d.toml": {"model.preset": "tiny-gpt2", "model.n_layers": 4, "model.seq_len": 64},
    "moe_ep.toml": {"model.preset": "tiny-moe", "model.seq_len": 64},
    "long_context_sp.toml": {"model.preset": "tiny-gpt2", "model.seq_len": 64},
}


# The fine-tuning configs name their data on the command line (sft.toml) or after a script wrote it
# (sft_addition.toml, tools/examples/make_addition.py): a small chat file stands in.
DATA_GIVEN = {"sft.toml": {"data.source": os.path.join(REPO, "tests", "fixtures", "chats.jsonl")},
              "sft_addition.toml": {"data.source": os.path.join(REPO, "tests", "fixtures", "chats.jsonl")},
              "arith_format.toml": {"data.source": os.path.join(REPO, "tests", "fixtures", "gsm8k.jsonl")},
              # DPO: a few pairs in the example's form, and no SFT run to start from in a clean checkout
              "dpo_addition.toml": {"data.source": os.path.join(REPO, "tests", "fixtures", "pairs.jsonl"),
                                    "init.from": ""},
              # GRPO: no model to start from in a clean checkout (init.from names one the user makes or downloads)
              "grpo_arith.toml": {"init.from": ""},
              "grpo_gsm8k.toml": {"data.tokenizer": "byte",
                                  "data.source": os.path.join(REPO, "tests", "fixtures", "gsm8k.jsonl")}}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate_on_eight_devices(path):
    # as the trainer does: the tokenizer's vocabulary, then the 8 devices
    resolve(build_config(path, DATA_GIVEN.get(os.path.basename(path), {})))


def test_a_missing_run_to_start_from_is_one_line_naming_it(tmp_path, monkeypatch):
    """grpo_arith starts from the format model's run directory; before that run exists the config says so (it said
    "--config: no such file 'runs/arith_format/config.toml'", blaming the config the user gave)."""
    from jaxllm.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^init.from=run:runs/arith_format: 'runs/arith_format' is not a run "):
        build_config(os.path.join(CONFIG_DIR, "grpo_arith.toml"), {})


def file_keys(path: str) -> set[str]:
    """The dotted keys a TOML file sets."""
    def walk(table: dict, prefix: str):
        for k, v in table.items():
            yield from walk(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    with open(path, "rb") as f:
        return set(walk(tomllib.load(f), ""))


def dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


@pytest.mark.slow
@pytest.mark.parametrize("name", SHRUNK)
def test_parallel_configs_train_two_steps(name, tmp_path):
    path = os.path.join(CONFIG_DIR, name)
    shipped = build_config(path)
    over = {**SHRUNK[name], "train.steps": 2, "data.source": CORPUS, "run.dir": str(tmp_path / "run"),
            "run.progress": False}
    cfg = build_config(path, over)
    assert file_keys(path) - set(over)  # every key the file sets, other than these, is as shipped
    for key in file_keys(path) - set(over):
        assert dotted(to_dict(cfg), key) == dotted(to_dict(shipped), key), key
    summary = train(cfg)
    assert math.isfinite(summary["val_loss"]) and summary["loss"] < 6  # evaluated, finite, not diverged
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    assert (tmp_path / "run" / "sample.txt").read_text().startswith(cfg.run.sample_prompt)
