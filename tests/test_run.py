"""The trainer as a user runs it: the CLI, resume, restore onto another mesh, config errors."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxllm.config import build_config
from jaxllm.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model.preset": "tiny-gpt2", "precision.compute": "float32", "train.global_batch": 16,
        "train.lr": 1e-3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
        "run.sample_tokens": 0, "run.progress": False, "mesh.dp": 1, "mesh.fsdp": 8, "train.zero_stage": 3}


def losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run(run_dir, **over):
    cfg = build_config(None, {**TINY, "run.dir": str(run_dir), **over})
    return train(cfg)


def test_resume_is_exact_and_restores_onto_another_mesh(tmp_path):
    full, part, other, piped = tmp_path / "full", tmp_path / "part", tmp_path / "other", tmp_path / "piped"
    run(full, **{"train.steps": 6, "train.checkpoint_every": 3})
    run(part, **{"train.steps": 3, "train.schedule_steps": 6, "train.checkpoint_every": 3})
    shutil.copytree(part, other)
    shutil.copytree(part, piped)
    run(part, **{"train.steps": 6, "train.checkpoint_every": 3, "train.resume": True})
    ref, resumed = losses(full), losses(part)
    assert sorted(resumed) == list(range(1, 7))
    assert [resumed[s] for s in range(1, 7)] == [ref[s] for s in range(1, 7)]  # bit for bit
    # saved on fsdp=8, continued on dp=2 x fsdp=4 (and ZeRO-1): same losses up to reduction order
    run(other, **{"train.steps": 6, "train.checkpoint_every": 3, "train.resume": True,
                  "mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 1})
    moved = losses(other)
    np.testing.assert_allclose([moved[s] for s in range(4, 7)], [ref[s] for s in range(4, 7)], rtol=1e-5)
    assert moved[4] != ref[3]  # it really trained on
    # and continued through a pipeline (pp=2 × dp=2 × tp=2, 1F1B): the checkpoint's layer order is canonical
    run(piped, **{"train.steps": 6, "train.checkpoint_every": 3, "train.resume": True, "mesh.pp": 2,
                  "mesh.dp": 2, "mesh.fsdp": 1, "mesh.tp": 2, "train.zero_stage": 1, "train.microbatches": 2})
    np.testing.assert_allclose([losses(piped)[s] for s in range(4, 7)], [ref[s] for s in range(4, 7)], rtol=1e-5)


def cli(*args, env_devices=8, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={env_devices}")
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_trains_and_writes_a_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    res = cli("model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=256", "model.seq_len=64",
              "train.steps=30", "train.log_every=10", "train.eval_every=15", "train.checkpoint_every=15",
              "run.sample_tokens=20", f"run.dir={run_dir}", "mesh.dp=2", "mesh.fsdp=4", "train.zero_stage=2")
    assert res.returncode == 0, res.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 10, 20, 30]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu"):
        assert all(np.isfinite(r[key]) for r in train_rows), key
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0
    assert [r["step"] for r in val_rows] == [15, 30] and all("loss" not in r for r in val_rows)
    assert val_rows[-1]["val_loss"] < val_rows[0]["val_loss"]
    for name in ("config.toml", "loss.png", "sample.txt"):
        assert (run_dir / name).stat().st_size > 0, name
    assert any((run_dir / "tensorboard").iterdir())
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["15", "30"]
    # the resolved config reproduces the run's settings
    again = build_config(str(run_dir / "config.toml"))
    assert again.train.zero_stage == 2 and again.mesh.fsdp == 4 and again.model.d_model == 64


BAD = {
    "mesh_mismatch": (["mesh.dp=3"], "mesh"),
    "heads_not_divisible_by_tp": (["mesh.dp=1", "mesh.tp=8", "model.n_heads=4"], "model.n_heads"),
    "unknown_key": (["train.stepz=5"], "train.stepz"),
    "wrong_type": (["train.steps=lots"], "train.steps"),
    "missing_data_path": (["data.source=/no/such/corpus.txt"], "data.source"),
    "batch_not_divisible": (["train.global_batch=12", "train.microbatches=2"], "train.global_batch"),
    "collective_matmul_without_sp": (["mesh.dp=2", "mesh.tp=4", "model.collective_matmul=true"],
                                     "model.collective_matmul"),
}


@pytest.mark.parametrize("case", BAD)
def test_config_errors_are_one_line_exit_2_nothing_written(tmp_path, case):
    args, key = BAD[case]
    run_dir = tmp_path / "run"
    res = cli(*args, f"run.dir={run_dir}")
    assert res.returncode == 2, res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not run_dir.exists()


def test_existing_run_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    res = cli(f"run.dir={run_dir}")
    assert res.returncode == 2 and "train.resume=true" in res.stderr
    assert os.listdir(run_dir) == ["metrics.jsonl"]
