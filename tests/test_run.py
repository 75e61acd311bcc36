"""The trainer as a user runs it: the CLI, resume, restore onto another mesh, config errors.

Config errors run the CLI's `main` in-process (it prints the one line and returns the exit
code, as `python -m experiments.run` does); one subprocess run checks the real command's exit
code and output, and one trains through the real command.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from harness import CORPUS, REPO, subprocess_env
from jaxllm.config import build_config
from jaxllm.trainer.loop import train
from experiments import run as run_cli

# tiny-gpt2 with 4 layers (so pp=4 divides them) on the small fixture corpus, fp32, ZeRO-3 over fsdp=8
TINY = {"model.preset": "tiny-gpt2", "model.n_layers": 4, "precision.compute": "float32", "train.global_batch": 16,
        "train.lr": 1e-3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
        "run.sample_tokens": 0, "run.progress": False, "mesh.dp": 1, "mesh.fsdp": 8, "train.zero_stage": 3,
        "data.source": CORPUS}
SIX = {"train.steps": 6, "train.schedule_steps": 6, "train.checkpoint_every": 3}
PIPELINE = {"mesh.pp": 2, "mesh.dp": 2, "mesh.fsdp": 1, "mesh.tp": 2, "train.zero_stage": 1,
            "train.microbatches": 2}


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run(run_dir, **over):
    return train(build_config(None, {**TINY, "run.dir": str(run_dir), **over}))


def resumed_from(checkpointed, run_dir, **over) -> dict[int, float]:
    """Copy a 3-step run and continue it to step 6 with `over` (another mesh, say): its losses."""
    shutil.copytree(checkpointed, run_dir)
    run(run_dir, **SIX, **over, **{"train.resume": True})
    return losses(run_dir)


@pytest.mark.slow
def test_resume_is_exact_and_restores_onto_another_mesh(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run(full, **SIX)
    run(part, **{**SIX, "train.steps": 3})
    ref = losses(full)
    moved = resumed_from(part, tmp_path / "other", **{"mesh.dp": 2, "mesh.fsdp": 4, "train.zero_stage": 1})
    piped = resumed_from(part, tmp_path / "piped", **PIPELINE)
    run(part, **SIX, **{"train.resume": True})
    resumed = losses(part)
    assert sorted(resumed) == list(range(1, 7))
    assert [resumed[s] for s in range(1, 7)] == [ref[s] for s in range(1, 7)]  # bit for bit
    # saved on fsdp=8, continued on dp=2 x fsdp=4 (and ZeRO-1): same losses up to reduction order
    np.testing.assert_allclose([moved[s] for s in range(4, 7)], [ref[s] for s in range(4, 7)], rtol=1e-5)
    assert moved[4] != ref[3]  # it really trained on
    # and continued through a pipeline (pp=2 × dp=2 × tp=2, 1F1B): the checkpoint's layer order is canonical
    np.testing.assert_allclose([piped[s] for s in range(4, 7)], [ref[s] for s in range(4, 7)], rtol=1e-5)


@pytest.mark.slow
def test_a_pipelined_checkpoint_restores_without_a_pipeline_and_onto_another_pp(tmp_path):
    """Saved on pp=2 × dp=2 × tp=2, continued on pp=1 (fsdp=8, ZeRO-3) and on pp=4 × dp=2: the losses of
    steps 4-6 are the uninterrupted one-mesh run's."""
    full, piped = tmp_path / "full", tmp_path / "piped"
    run(full, **SIX)
    run(piped, **{**SIX, "train.steps": 3}, **PIPELINE)
    ref = losses(full)
    np.testing.assert_allclose([losses(piped)[s] for s in range(1, 4)], [ref[s] for s in range(1, 4)], rtol=1e-5)
    unpiped = resumed_from(piped, tmp_path / "unpiped")
    four = resumed_from(piped, tmp_path / "four", **{"mesh.pp": 4, "mesh.dp": 2, "mesh.fsdp": 1,
                                                     "train.zero_stage": 0, "train.microbatches": 4})
    for resumed in (unpiped, four):
        np.testing.assert_allclose([resumed[s] for s in range(4, 7)], [ref[s] for s in range(4, 7)], rtol=1e-5)


def cli(*args, n_devices=8):
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=REPO, env=subprocess_env(n_devices),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_trains_and_writes_a_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    res = cli("model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=256", "model.seq_len=64",
              "train.steps=30", "train.log_every=10", "train.eval_every=15", "train.checkpoint_every=15",
              "run.sample_tokens=20", f"run.dir={run_dir}", "mesh.dp=2", "mesh.fsdp=4", "train.zero_stage=2",
              f"data.source={CORPUS}")
    assert res.returncode == 0, res.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 10, 20, 30]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "time/data_s"):
        assert all(np.isfinite(r[key]) for r in train_rows), key
    # the goodput columns account for the time between rows, validation and checkpoints included (at 15), but for
    # the loop's own bookkeeping between its blocks: a few ms, which a machine busy with other tests stretches to
    # tens (20-30 ms seen beside the suite's 16-device programs)
    for r in train_rows:
        accounted = sum(v for k, v in r.items() if k.startswith("time/") and k != "time/wall_s")
        assert accounted >= 0.98 * r["time/wall_s"] - 0.05, r
    assert train_rows[2]["time/eval_s"] > 0 and train_rows[2]["time/checkpoint_s"] > 0
    assert "goodput " in res.stderr and "the most time lost: " in res.stderr
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


def test_cli_config_error_is_one_line_exit_2(tmp_path):
    """The real command: a bad key is `error: ...` on stderr, exit code 2, no traceback, nothing written."""
    run_dir = tmp_path / "run"
    res = cli("train.stepz=5", f"run.dir={run_dir}")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and res.stderr.startswith("error: ")
    assert "train.stepz" in res.stderr and not run_dir.exists()


BAD = {
    "mesh_mismatch": (["mesh.dp=3"], "mesh"),
    "heads_not_divisible_by_tp": (["mesh.dp=1", "mesh.tp=8", "model.n_heads=4"], "model.n_heads"),
    "unknown_key": (["train.stepz=5"], "train.stepz"),
    "wrong_type": (["train.steps=lots"], "train.steps"),
    "missing_data_path": (["data.source=/no/such/corpus.txt"], "data.source"),
    "batch_not_divisible": (["train.global_batch=12", "train.microbatches=2"], "train.global_batch"),
    "collective_matmul_without_sp": (["mesh.dp=2", "mesh.tp=4", "model.collective_matmul=true"],
                                     "model.collective_matmul"),
    "negative_grad_clip": (["train.grad_clip=-1"], "train.grad_clip"),  # it was read as off, in silence
    "negative_sample_tokens": (["run.sample_tokens=-1"], "run.sample_tokens"),
    "process_id_past_the_count": (["distributed.coordinator_address=localhost:1", "distributed.num_processes=2",
                                   "distributed.process_id=2"], "ids run from 0 to 1"),
    "processes_without_a_coordinator": (["distributed.num_processes=2", "distributed.process_id=0"],
                                        "distributed.coordinator_address"),  # it trained as one process, in silence
}


@pytest.mark.parametrize("case", BAD)
def test_config_errors_are_one_line_exit_2_nothing_written(tmp_path, capsys, case):
    args, key = BAD[case]
    run_dir = tmp_path / "run"
    assert run_cli.main([*args, f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], err
    assert not run_dir.exists()


@pytest.mark.slow
def test_auto_distribution_off_a_cluster_is_one_line(tmp_path):
    """JAX's cluster detection finds nothing here: one line naming distributed.auto (not JAX's ValueError)."""
    res = cli("distributed.auto=true", f"run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and res.stderr.startswith("error: distributed.auto=true: JAX detected no cluster")
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_url_run_dir_is_refused_before_a_local_folder_of_its_name_is_made(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli.main(["run.dir=gs://bucket/runs/x"]) == 2
    assert "run.dir 'gs://bucket/runs/x' is a URL" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert run_cli.main([f"run.dir={run_dir}", f"data.source={CORPUS}"]) == 2
    assert "train.resume=true" in capsys.readouterr().err
    assert os.listdir(run_dir) == ["metrics.jsonl"]
