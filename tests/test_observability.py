"""Seeing inside a run: where the wall time goes (goodput columns), profiler traces, memory, Weights & Biases.

The run test trains the default job (its config, fewer steps) in this process, with validation, checkpoints,
a profiled window and an offline W&B run, then resumes it from an earlier checkpoint, as after a kill.
W&B's record of each run is read back with W&B's own reader of its run files (`wandb leet inspect`, wandb
0.31.0 as the test extra pins it).
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from jaxllm.config import CONFIG_DIR, build_config, to_dict
from jaxllm.trainer import goodput, metrics as metrics_lib, profiling
from jaxllm.trainer.loop import _dispatch, train

SCOPES = ("embed", "attention", "mlp", "head", "optimizer")  # the named scopes of a dense model's train step


# ---------------------------------------------------------------- the clock


def _fresh_compile() -> float:
    """Compile a program no test compiled before (its constant is new), of some size: JAX reports the time.
    The seconds it took."""
    k, start = float(time.perf_counter_ns() % 10**6), time.perf_counter()

    def chain(x):
        for i in range(15):
            x = jnp.sin(x @ x.T + i * k)
        return x

    jax.jit(chain).lower(jnp.ones((8, 8))).compile()
    return time.perf_counter() - start


def _slept(seconds: float) -> float:
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start


def test_the_clock_gives_nested_blocks_and_compiling_their_own_time():
    """Each block's own time (what it measured itself) goes to its category and no other's; the margins are
    less than the other blocks' times, so time counted twice or in the wrong place shows. The compile column is
    what JAX reported (its trace, lowering and backend-compile durations, recorded here by a listener of our own:
    how much of the call they cover depends on the machine's load)."""
    reported, compile_events = [], {f"/jax/core/compile/{e}_duration" for e in
                                    ("jaxpr_trace", "jaxpr_to_mlir_module", "backend_compile")}
    record = lambda event, duration, **_: reported.append(duration) if event in compile_events else None
    clock = goodput.Clock()
    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        with clock.timing("setup"):
            setup = _slept(0.05)
            with clock.timing("data"):  # longer than a compile on a busy machine (0.5 s seen): the most time lost
                data, compiling = _slept(1.0), _fresh_compile()
            with clock.timing("data") as part:
                step = _slept(0.1)
                part.category = "step"  # the block decided what it was
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    row = clock.lap()
    assert 0 < row["time/compile_s"] == pytest.approx(sum(reported), abs=1e-9) and row["time/compile_s"] <= compiling
    assert setup <= row["time/setup_s"] < setup + 0.05
    assert data <= row["time/data_s"] < data + (compiling - row["time/compile_s"]) + 0.05
    assert step <= row["time/step_s"] < step + 0.05
    assert abs(sum(v for k, v in row.items() if k != "time/wall_s") - row["time/wall_s"]) < 0.01
    took = []
    other = threading.Thread(target=lambda: took.append(_fresh_compile()))  # another thread's compiling is its own
    with clock.timing("eval"):
        other.start()
        other.join()
    later = clock.lap()  # a lap starts a new window
    assert later["time/compile_s"] == later["time/data_s"] == 0 and later["time/eval_s"] >= took[0]
    summary = clock.summary()
    assert summary["data_s"] == row["time/data_s"] and 0 < summary["goodput"] < 1
    assert "the most time lost: data" in goodput.summary_text(summary)


def test_a_batch_made_while_the_previous_step_runs_is_step_time():
    """The loop's rule: making a batch counts as data time only when the devices have no step to run."""
    long = jax.jit(lambda x: jax.lax.fori_loop(0, 60, lambda i, y: jnp.tanh(y @ y), x))  # ~0.3 s on a CPU
    x = jnp.ones((512, 512)) / 512
    long.lower(x).compile()

    class Batches:
        def train_batch(self, step, sharding):
            time.sleep(0.05)
            return {"step": step}

    run = SimpleNamespace(cfg=build_config(None, {}), data=Batches(), fns=SimpleNamespace(batch_sharding=None),
                          clock=goodput.Clock(), mngr=None, step_fn=lambda state, batch: (state, {"loss": state}))
    for previous, spent in ((lambda: long(x), "step"), (lambda: jnp.zeros(()).block_until_ready(), "data")):
        run.clock.lap()
        _dispatch(run, 1, None, previous())
        row = run.clock.lap()
        idle = "data" if spent == "step" else "step"
        assert row[f"time/{spent}_s"] >= 0.05 and row[f"time/{idle}_s"] < 0.01, (spent, row)


def test_memory_columns_give_the_host_peak_and_no_device_figure_on_cpu():
    before = metrics_lib.memory_columns()
    held = bytearray(300 * 2**20)  # touched: resident
    for i in range(0, len(held), 4096):
        held[i] = 1
    after = metrics_lib.memory_columns()
    assert after["memory/host_peak_bytes"] >= max(before["memory/host_peak_bytes"], 300 * 2**20)
    assert "memory/device_peak_bytes" not in after  # the CPU backend reports none


@pytest.mark.parametrize("over, key", [
    ({"run.profile_steps": [0, 2]}, "run.profile_steps"), ({"run.profile_steps": [3]}, "run.profile_steps"),
    ({"run.profile_steps": [290, 20]}, "run.profile_steps"), ({"run.wandb": "yes"}, "run.wandb"),
    ({"run.wandb": "offline", "run.wandb_tags": [1]}, "run.wandb_tags")])
def test_bad_observability_keys_are_one_line_naming_the_key(over, key, tmp_path, capsys):
    from experiments import run as run_cli

    args = [f"{k}={json.dumps(v)}" for k, v in {**over, "run.dir": str(tmp_path / "run")}.items()]
    assert run_cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {key}") and "\n" not in err and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- a run, and its resumption


def _config(run_dir, **over):
    """The default job, shortened: validation and a checkpoint every 2 steps, a row every step."""
    return build_config(os.path.join(CONFIG_DIR, "default.toml"), {
        "train.steps": 4, "train.log_every": 1, "train.eval_every": 2, "train.checkpoint_every": 2,
        "train.eval_batches": 1, "run.sample_tokens": 0, "run.progress": False, "run.dir": str(run_dir),
        "run.wandb": "offline",
        "run.wandb_tags": ["observability"], **over})


def _rows(run_dir):
    return metrics_lib.read_metrics(str(run_dir))


def _by_step(rows) -> dict:
    """metrics.jsonl's rows merged by step, as W&B merges the rows logged at one step."""
    merged = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step"})
    return merged


def _wandb_records(run_dir) -> list[list[dict]]:
    """Each offline W&B run in run_dir, oldest first: its records, read by W&B's own reader."""
    wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
    runs = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        out = subprocess.run([wandb, "leet", "inspect", "--json", path], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs.append([json.loads(line) for line in out.stdout.splitlines() if line.strip()])
    return runs


def _history(records) -> dict:
    return {r["history"]["step"]["num"]: {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            for r in records if r["type"] == "history"}


def _scopes_in_trace(run_dir, steps) -> set:
    """The named scopes of the train step's ops that ran in the trace, which must hold steps `steps` exactly."""
    trace_dir = profiling.trace_dir(str(run_dir))
    [path] = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.xplane.pb"))
    hlo = open(os.path.join(trace_dir, profiling.HLO_FILE)).read()
    module = re.match(r"HloModule (\S+?),", hlo).group(1)
    op_names = dict(re.findall(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo, re.M))
    annotated, ran = [], set()
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if event.name == "train" and "step_num" in stats:
                    annotated.append(stats["step_num"])
                if stats.get("hlo_module") == module:
                    ran.add(stats["hlo_op"])
    assert sorted(annotated) == list(steps)
    return {word for op in ran for word in re.findall(r"\w+", op_names.get(op, ""))}


def _unattributed(row) -> float:
    return 1 - sum(v for k, v in row.items() if k.startswith("time/") and k != "time/wall_s") / row["time/wall_s"]


def _cut_after_first_row(wandb_file) -> None:
    """Cut an offline W&B file as a kill cuts it when W&B's service had written step 1 and no later row: inside
    the record that follows step 1's (W&B writes each step's summary, then its history; the third
    `grad_norm` in the file is step 2's summary). Checked with W&B's own reader."""
    data = wandb_file.read_bytes()
    third = [m.start() for m in re.finditer(b"grad_norm", data)][2]
    wandb_file.write_bytes(data[:third])
    assert sorted(_history(_wandb_records(wandb_file.parents[2])[0])) == [1]


@pytest.mark.slow
def test_a_run_accounts_for_its_time_traces_its_steps_and_logs_to_wandb_and_its_resumption_continues(tmp_path):
    """A row every 2 steps and a trace of step 3, a step that is neither logged nor checkpointed; then the run is
    resumed as after a kill that lost W&B's rows after step 1 and the checkpoint of step 4."""
    run_dir = tmp_path / "run"
    summary = train(_config(run_dir, **{"run.profile_steps": [3, 1], "train.log_every": 2}))
    rows = _rows(run_dir)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 4]
    assert max(_unattributed(r) for r in steps) <= 0.02, [_unattributed(r) for r in steps]
    first, second, fourth = steps
    assert first["time/compile_s"] > 0.1 and first["time/setup_s"] > 0 and first["time/data_s"] > 0
    assert fourth["time/eval_s"] > 0 and fourth["time/checkpoint_s"] > 0 and fourth["time/profile_s"] > 0
    assert second["time/eval_s"] == 0 and all(r["memory/host_peak_bytes"] > 2**20 for r in steps)
    whole = summary["time"]  # the end counts what follows the last row too (its validation and checkpoint)
    assert whole["wall_s"] > sum(r["time/wall_s"] for r in steps) and whole["eval_s"] > fourth["time/eval_s"]
    assert sum(whole[f"{c}_s"] for c in goodput.CATEGORIES) >= 0.98 * whole["wall_s"]

    assert set(SCOPES) <= _scopes_in_trace(run_dir, [3])

    [records] = _wandb_records(run_dir)
    before = _by_step(rows)
    assert _history(records) == before and sorted(before) == [1, 2, 4]  # every row, every number, its step
    [started] = [r["run"] for r in records if r["type"] == "run"]
    config = {k: v for k, v in started["config"]["update"].items() if k != "_wandb"}
    assert config == json.loads(json.dumps(to_dict(build_config(str(run_dir / "config.toml")))))
    assert started["tags"] == ["observability"] and started["display_name"] == "run"

    # killed after logging step 4, before its checkpoint was written, W&B's service holding rows 2 and 4 unwritten
    shutil.rmtree(run_dir / "checkpoints" / "4")
    _cut_after_first_row(next((run_dir / "wandb").glob("offline-run-*/run-*.wandb")))
    train(_config(run_dir, **{"train.resume": True, "train.log_every": 2}))
    first, second = _wandb_records(run_dir)
    ids = {r["run"]["run_id"] for records in (first, second) for r in records if r["type"] == "run"}
    assert ids == {(run_dir / "wandb_id").read_text()}  # one W&B run
    after = _by_step(_rows(run_dir))
    assert sorted(after) == [1, 2, 3, 4] and {s: after[s] for s in (1, 2)} == {s: before[s] for s in (1, 2)}
    # every step of metrics.jsonl once across the two files: the restored step 2 sent again, step 1 not
    assert _history(first) == {1: after[1]} and _history(second) == {s: after[s] for s in (2, 3, 4)}
