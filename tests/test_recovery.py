"""A killed, stopped or broken run loses nothing and never lies (real processes, real Orbax checkpoints).

- Hard kills (SIGKILL) at four points of a real `jaxllm train` (jaxllm/trainer/faults.py
  picks the point): the run resumed with train.resume=true writes the same metrics.jsonl, row for
  row and loss for loss (fp32, bitwise), as the run that was never killed.
- SIGTERM and Ctrl-C: the run saves the step it is at, exits 128 + the signal with one line, and
  resumes exactly.
- Damaged checkpoints: each kind is skipped with a log line and set aside as `<step>.bad`; the run
  goes on from the newest good one and can save the damaged step again; with none good, one line
  and exit 2, nothing moved.
- A non-finite loss ends the run with one line; the checkpoints left are all finite.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from harness import CORPUS, REPO, subprocess_env, unmeasured
from jaxllm.config import build_config
from jaxllm.errors import CheckpointError, ConfigError
from jaxllm.trainer import checkpoint as ckpt
from jaxllm.trainer.loop import train
from jaxllm.cli import train as run_cli

pytestmark = [
    pytest.mark.slow,  # real processes and whole training runs
    # Orbax leaves the reads of a damaged checkpoint's other arrays un-awaited when one fails
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

# tiny-gpt2 on 8 devices (fsdp=8, ZeRO-3), fp32, one row per step; the schedule is pinned so runs of
# different lengths share it
RUN = {"model.preset": "tiny-gpt2", "precision.compute": "float32", "train.global_batch": 16, "train.lr": 1e-3,
       "train.warmup_steps": 1, "train.schedule_steps": 100, "train.log_every": 1, "train.eval_every": 0,
       "train.checkpoint_every": 2, "train.keep_checkpoints": 3, "run.sample_tokens": 0, "run.progress": False,
       "mesh.dp": 1, "mesh.fsdp": 8, "train.zero_stage": 3, "data.source": CORPUS}


def config(run_dir, **over):
    return build_config(None, {**RUN, "run.dir": str(run_dir), **over})


def rows(run_dir) -> list[dict]:
    """metrics.jsonl without the timing columns."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [unmeasured(json.loads(line)) for line in f]


def args(run_dir, **over) -> list[str]:
    literal = lambda v: str(v).lower() if isinstance(v, bool) else v  # TOML's true/false
    return [f"{k}={literal(v)}" for k, v in {**RUN, "run.dir": run_dir, **over}.items()]


def start(run_dir, env: dict | None = None, **over) -> subprocess.Popen:
    """`python -m jaxllm train` with RUN and `over`, on 8 fake devices."""
    return subprocess.Popen([sys.executable, "-m", "jaxllm", "train", *args(run_dir, **over)], cwd=REPO,
                            env={**subprocess_env(8), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The metrics of a 6-step run that nothing interrupted, and its run directory."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    train(config(run_dir, **{"train.steps": 6}))
    return rows(run_dir), run_dir


def listing(run_dir) -> list[str]:
    path = ckpt.checkpoint_dir(str(run_dir))
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def tensorboard_losses(run_dir) -> list[tuple[int, float]]:
    """(step, loss) as TensorBoard shows them, read by TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("loss")] if "loss" in events.Tags()["scalars"] else []


# ---------------------------------------------------------------- hard kills

KILLS = {  # point -> what the killed run left in checkpoints/ and the steps of its metrics rows
    "compile": ([], []),
    "dispatched:3": (["2"], [1, 2]),
    "saving:4": (["2", "4" + ckpt.TMP_MARK], [1, 2, 3, 4]),
    "saved:4": (["2", "4"], [1, 2, 3, 4]),
}


@pytest.mark.parametrize("point", KILLS)
def test_a_killed_run_resumes_to_the_same_metrics(point, uninterrupted, tmp_path):
    reference, _ = uninterrupted
    run_dir = tmp_path / "run"
    env = {"JAXLLM_TEST_KILL": point}
    if point == "compile":  # a compile read from the cache would be over before the kill
        env["JAX_COMPILATION_CACHE_DIR"] = ""
    proc = start(run_dir, env, **{"train.steps": 6})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    saved, logged = KILLS[point]
    assert [name.split(ckpt.TMP_MARK)[0] + (ckpt.TMP_MARK if ckpt.TMP_MARK in name else "")
            for name in listing(run_dir)] == saved  # a temporary folder's name ends in a timestamp
    assert [r["step"] for r in rows(run_dir)] == logged if logged else not (run_dir / "metrics.jsonl").exists()

    train(config(run_dir, **{"train.steps": 6, "train.resume": True}))
    assert rows(run_dir) == reference  # every step once, the same losses bit for bit
    assert tensorboard_losses(run_dir) == [(r["step"], r["loss"]) for r in reference]
    assert listing(run_dir) == (["2", "4", "4.bad", "6"] if point.startswith("saving") else ["2", "4", "6"])


# ---------------------------------------------------------------- SIGTERM and Ctrl-C


def wait_for_row(proc, run_dir, timeout: float = 120) -> None:
    """Until the run has logged its first step."""
    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_a_step_with_a_checkpoint(signum, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, **{"train.steps": 100, "train.checkpoint_every": 0})
    wait_for_row(proc, run_dir)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    stop = rows(run_dir)[-1]["step"]
    assert last.startswith(f"stopped: {signal.Signals(signum).name} at step {stop}: checkpoint saved in ")
    assert "train.resume=true" in last and "Traceback" not in err
    assert 1 <= stop < 100 and listing(run_dir) == [str(stop)]
    assert [r["step"] for r in rows(run_dir)] == list(range(1, stop + 1))

    train(config(run_dir, **{"train.steps": stop + 2, "train.resume": True}))
    reference = tmp_path / "reference"
    train(config(reference, **{"train.steps": stop + 2}))
    assert rows(run_dir) == rows(reference)


# ---------------------------------------------------------------- damaged checkpoints


def data_files(step_dir) -> list:
    """The array data files of a checkpoint's state (OCDBT), largest first."""
    found = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
             if os.path.basename(d) == "d"]
    return sorted(found, key=os.path.getsize, reverse=True)


def missing_array_file(step_dir):
    os.remove(data_files(step_dir)[0])


def truncated_array_file(step_dir):
    path = data_files(step_dir)[0]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def garbage_metadata(step_dir):
    with open(os.path.join(step_dir, "state", "_METADATA"), "w") as f:
        f.write("{not json")


def interrupted_save(step_dir):  # what a kill during the save leaves: the folder under Orbax's temporary name
    os.rename(step_dir, f"{step_dir}{ckpt.TMP_MARK}-1700000000")


def flipped_bit(step_dir, array="params.embed.tok", at=(3, 5), bit=20) -> tuple[float, float]:
    """One bit of one element of a saved array flipped through TensorStore, which writes it back as a new
    version of the checkpoint's OCDBT store: every file stays well formed. (value before, value after)."""
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{step_dir}/state/", "path": f"{array}/"}}
    stored = ts.open(spec).result()
    before = np.asarray(stored[at].read().result())
    stored[at].write((before.view(np.uint32) ^ np.uint32(1 << bit)).view(np.float32)).result()
    return float(before), float(np.asarray(ts.open(spec).result()[at].read().result()))


DAMAGE = {f.__name__: f for f in (missing_array_file, truncated_array_file, garbage_metadata, interrupted_save,
                                  flipped_bit)}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_skipped_and_set_aside(damage, uninterrupted, tmp_path, caplog):
    reference, done = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    DAMAGE[damage](os.path.join(ckpt.checkpoint_dir(str(run_dir)), "6"))
    with caplog.at_level("WARNING", logger="jaxllm"):
        train(config(run_dir, **{"train.steps": 8, "train.resume": True}))
    assert "checkpoint 6" in caplog.text and "skipped" in caplog.text and "6.bad" in caplog.text
    if damage == "flipped_bit":  # caught by its checksum (train.checkpoint_checksums, on by default)
        assert "array params/embed/tok does not match the checksum saved with it" in caplog.text
    assert listing(run_dir) == ["4", "6", "6.bad", "8"]  # step 6 saved again; pruning left 6.bad alone
    assert rows(run_dir)[:6] == reference and [r["step"] for r in rows(run_dir)] == list(range(1, 9))


def test_without_checksums_a_flipped_bit_restores_silently(uninterrupted, tmp_path, caplog):
    """What `train.checkpoint_checksums` is for (the damage above, caught with it): without it the changed value
    is read back as if it had been saved, and training goes on from it."""
    _, done = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    before, after = flipped_bit(os.path.join(ckpt.checkpoint_dir(str(run_dir)), "6"))
    assert before != after
    off = {"train.steps": 7, "train.resume": True, "train.checkpoint_checksums": False}
    with caplog.at_level("INFO", logger="jaxllm"):
        train(config(run_dir, **off))
    assert "resumed from step 6" in caplog.text and "skipped" not in caplog.text
    assert listing(run_dir) == ["4", "6", "7"]  # nothing set aside


def test_starting_from_a_changed_checkpoint_is_refused_naming_the_array(uninterrupted, tmp_path):
    """init.from = "run:DIR@STEP" checks the parameters it reads against their checksums too."""
    _, done = uninterrupted
    source = tmp_path / "source"
    shutil.copytree(done, source)
    flipped_bit(os.path.join(ckpt.checkpoint_dir(str(source)), "6"))
    keys = {k: v for k, v in RUN.items() if k != "model.preset"}  # the model comes from the checkpoint
    longer = build_config(None, {**keys, "init.from": f"run:{source}@4", "run.dir": str(tmp_path / "longer")})
    with pytest.raises(ConfigError, match="model.seq_len=256 is longer than model.max_positions=64"):
        train(longer)  # its learned positions have 64 rows: a longer sequence is one line, not a shape error
    keys["model.seq_len"] = 64
    for step, error in ((6, "step 6: array params/embed/tok does not match the checksum"), (4, None)):
        cfg = build_config(None, {**keys, "init.from": f"run:{source}@{step}", "train.steps": 1,
                                  "train.checkpoint_every": 0, "run.dir": str(tmp_path / f"from{step}")})
        if error:
            with pytest.raises(CheckpointError, match=error):
                train(cfg)
            assert not (tmp_path / f"from{step}").exists()
        else:
            train(cfg)  # the step before is intact


@pytest.mark.parametrize("command", ["generate", "export"])
def test_reading_a_changed_checkpoint_is_one_line_naming_the_run(command, uninterrupted, tmp_path):
    """`jaxllm generate --from RUN` and `jaxllm hf export RUN OUT` on a run whose newest checkpoint changed after
    its save: one line naming the run, the step and its other checkpoints (not init.from, which the user did not
    set), no line of Orbax's, exit 2 and nothing written."""
    _, done = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    flipped_bit(os.path.join(ckpt.checkpoint_dir(str(run_dir)), "6"))
    argv = {"generate": ["generate", "--from", str(run_dir), "--prompt", "def"],
            "export": ["hf", "export", str(run_dir), str(tmp_path / "out")]}[command]
    done = subprocess.run([sys.executable, "-m", "jaxllm", *argv], cwd=REPO, env=subprocess_env(8),
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (f"error: {run_dir} step 6: array params/embed/tok does not match the checksum saved with it "
                        "(its stored data changed after the save); its other checkpoints: 2, 4"), lines
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_no_good_checkpoint_is_one_line_exit_2_and_nothing_moved(uninterrupted, tmp_path, capsys):
    _, done = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(done, run_dir)
    for step in listing(run_dir):
        missing_array_file(os.path.join(ckpt.checkpoint_dir(str(run_dir)), step))
    before = listing(run_dir), (run_dir / "metrics.jsonl").read_text()
    assert run_cli.main([*args(run_dir, **{"train.steps": 8, "train.resume": True})]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no checkpoint in ") and "6: its arrays" in err[0], err
    assert (listing(run_dir), (run_dir / "metrics.jsonl").read_text()) == before


# ---------------------------------------------------------------- a non-finite loss


def test_a_non_finite_loss_ends_the_run_in_one_line_keeping_good_checkpoints(tmp_path, capsys):
    """lr 1e30 makes step 1's update enormous: step 2's loss overflows. Without the guard the run ends there;
    with it, steps 2.. are skipped until train.max_consecutive_skips end the run, and the checkpoints of
    skipped steps are not offered as finite ones."""
    run = {"train.steps": 6, "train.lr": 1e30, "train.checkpoint_every": 1}
    code = run_cli.main(args(tmp_path / "off", **run, **{"train.skip_nonfinite": False}))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: loss ") and "at step 2" in err[-1], err
    assert "train.lr" in err[-1] and "checkpoint with a finite loss is step 1" in err[-1]
    assert listing(tmp_path / "off") == ["1"]
    assert [r["step"] for r in rows(tmp_path / "off")] == [1, 2] and np.isfinite(rows(tmp_path / "off")[0]["loss"])

    code = run_cli.main(args(tmp_path / "on", **run, **{"train.max_consecutive_skips": 3}))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "3 steps in a row skipped through step 4" in err[-1], err
    assert "checkpoint with a finite loss is step 1" in err[-1]
    assert [r["skipped"] for r in rows(tmp_path / "on")] == [0, 1, 1, 1]
