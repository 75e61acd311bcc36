"""The shipped configs: every file validates as it is (fast tier), and the parallel ones train.

The parallel configs run two steps each in the slow tier with the model shrunk — the tiny
preset of their family, a short sequence, as many layers as the pipeline needs — and the small
fixture corpus; every other key as shipped, so their meshes, schedules, precision, evaluation,
checkpoint and end-of-run sample all run.
"""

import glob
import json
import os

import pytest

from harness import CORPUS, REPO
from jaxllm.config import build_config, validate
from jaxllm.train.loop import train

CONFIGS = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.toml")))
SHRUNK = {  # file -> the keys that shrink its model
    "pipeline_1f1b.toml": {"model.preset": "tiny-gpt2", "model.n_layers": 4, "model.seq_len": 64},
    "pipeline_3d.toml": {"model.preset": "tiny-gpt2", "model.n_layers": 4, "model.seq_len": 64},
    "moe_ep.toml": {"model.preset": "tiny-moe", "model.seq_len": 64},
    "long_context_sp.toml": {"model.preset": "tiny-gpt2", "model.seq_len": 64},
}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate_on_eight_devices(path):
    validate(build_config(path, {"model.vocab_size": 257}), 8)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHRUNK)
def test_parallel_configs_train_two_steps(name, tmp_path):
    path = os.path.join(REPO, "experiments", "configs", name)
    shipped = build_config(path)
    over = {**SHRUNK[name], "train.steps": 2, "data.source": CORPUS, "run.dir": str(tmp_path / "run"),
            "run.progress": False}
    cfg = build_config(path, over)
    # every key the file sets, other than the model's size, is as shipped
    assert (cfg.mesh, cfg.train.microbatches, cfg.train.zero_stage, cfg.precision) == (
        shipped.mesh, shipped.train.microbatches, shipped.train.zero_stage, shipped.precision)
    summary = train(cfg)
    assert summary["val_loss"] == summary["val_loss"] and summary["loss"] < 6  # evaluated, finite, not diverged
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    assert (tmp_path / "run" / "sample.txt").read_text().startswith(cfg.run.sample_prompt)
