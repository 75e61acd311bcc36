"""Real multi-process runs over jax.distributed on localhost (CPU, gloo collectives).

- Two processes × 4 CPU devices of `jaxllm train` sharing one run.dir, started with the environment SLURM gives
  its tasks (job id, task count and ids, a node list naming this host) and found by JAX's SLURM detection
  (`distributed.auto=true`), train the same losses as one process × 8 devices (same dp=2 × fsdp=4 mesh, ZeRO-3,
  fp32); only process 0 writes metrics.jsonl and config.toml; Orbax saves checkpoints from both processes.
- The two processes resume from that multi-process checkpoint and continue on the
  single-process run's loss curve.
- Each process's loader reads only the token rows (and columns) its own devices hold
  (tests/multiprocess_worker.py).

Each launched process gets its own XLA_FLAGS (4 or 8 fake devices), not the test process's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import subprocess_env

pytestmark = pytest.mark.slow  # real processes, each compiling its own programs

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TIMEOUT_S = 300

# schedule_steps is pinned so the 4-step run, its 6-step resumption and the 6-step reference
# share one learning-rate schedule.
COMMON = [
    "model.preset=tiny-gpt2", "model.vocab_size=0", "data.tokenizer=byte", "precision.compute=float32",
    "train.global_batch=16", "train.schedule_steps=6", "train.warmup_steps=1", "train.log_every=1",
    "train.eval_every=0", "run.sample_tokens=0", "run.progress=false",
    "mesh.dp=2", "mesh.fsdp=4", "train.zero_stage=3",
]


def _env(n_devices: int) -> dict:
    return subprocess_env(n_devices)  # replaces the test process's 8 devices


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Processes launched together; stdout/stderr go to files (no pipe can fill up and block)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.items: list[tuple[str, subprocess.Popen, Path, Path]] = []

    def start(self, name: str, argv: list[str], n_devices: int, env: dict | None = None) -> None:
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        with open(out, "w") as fo, open(err, "w") as fe:
            proc = subprocess.Popen([PYTHON, *argv], cwd=REPO, env={**_env(n_devices), **(env or {})}, stdout=fo,
                                    stderr=fe)
        self.items.append((name, proc, out, err))

    def stderr(self, name: str) -> str:
        return next(e for n, _, _, e in self.items if n == name).read_text(errors="replace")

    def stdout(self, name: str) -> str:
        return next(o for n, _, o, _ in self.items if n == name).read_text(errors="replace")

    def _kill_all(self) -> None:
        for _, proc, _, _ in self.items:
            if proc.poll() is None:
                proc.kill()
        for _, proc, _, _ in self.items:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def _report(self, why: str) -> str:
        parts = [why]
        for name, proc, out, err in self.items:
            tail = "\n".join(err.read_text(errors="replace").splitlines()[-40:])
            parts.append(f"--- {name} (exit {proc.returncode}) stderr tail:\n{tail}")
            stdout = out.read_text(errors="replace").strip()
            if stdout:
                parts.append(f"--- {name} stdout:\n{stdout[-2000:]}")
        return "\n".join(parts)

    def wait(self, timeout: float = TIMEOUT_S) -> None:
        """Wait for all; on a timeout or any non-zero exit, kill the rest (a peer of a failed
        process would otherwise hang in a collective) and fail with every process's stderr."""
        deadline = time.monotonic() + timeout
        while True:
            codes = {name: proc.poll() for name, proc, _, _ in self.items}
            failed = [n for n, c in codes.items() if c not in (None, 0)]
            if failed:
                self._kill_all()
                pytest.fail(self._report(f"process(es) {failed} failed"), pytrace=False)
            if all(c == 0 for c in codes.values()):
                return
            if time.monotonic() > deadline:
                self._kill_all()
                pytest.fail(self._report(f"timed out after {timeout:.0f} s"), pytrace=False)
            time.sleep(0.2)


def _start_distributed_run(procs: Procs, config: Path, run_dir: Path, extra: list[str], tag: str) -> None:
    address = f"127.0.0.1:{_free_port()}"
    for pid in (0, 1):
        procs.start(f"{tag}{pid}", ["-m", "jaxllm", "train", "--config", str(config), *COMMON, *extra,
                                    f"run.dir={run_dir}", f"distributed.coordinator_address={address}",
                                    "distributed.num_processes=2", f"distributed.process_id={pid}"], n_devices=4)


def _slurm_job_id() -> int:
    """A job id whose coordinator port, as JAX's SLURM detection derives it (61440 + id mod 4096), is free here."""
    for _ in range(100):
        job = random.randrange(10**5, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", 61440 + job % 4096))
                return job
            except OSError:
                continue
    raise RuntimeError("no free port in 61440-65535")


def _slurm_env(job: int, task: int, tasks: int = 2) -> dict:
    """What SLURM sets for task `task` of a job step with `tasks` tasks on this one node (named as the host calls
    itself, or localhost where that name does not resolve)."""
    try:
        node = socket.gethostname()
        socket.gethostbyname(node)
    except OSError:
        node = "localhost"
    return {"SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(tasks),
            "SLURM_NPROCS": str(tasks), "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NODEID": "0",
            "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODELIST": node,
            "SLURM_JOB_NODELIST": node, "SLURM_STEP_NODELIST": node, "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_TASKS_PER_NODE": str(tasks), "SLURMD_NODENAME": node}


def _start_slurm_run(procs: Procs, config: Path, run_dir: Path, extra: list[str], tag: str) -> None:
    """Two tasks as `srun` starts them: the same command, found by JAX's SLURM detection (distributed.auto)."""
    job = _slurm_job_id()
    for task in (0, 1):
        procs.start(f"{tag}{task}", ["-m", "jaxllm", "train", "--config", str(config), *COMMON, *extra,
                                     f"run.dir={run_dir}", "distributed.auto=true"], n_devices=4,
                    env=_slurm_env(job, task))


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    assert path.is_file(), f"no metrics.jsonl in {run_dir}: {sorted(p.name for p in run_dir.iterdir())}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _assert_close(got: list[float], want: list[float], rel: float, what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), f"{what} differ at #{i}: 2 processes {g!r} vs 1 process {w!r}\n{got}\n{want}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launches together: 2 processes × 4 devices (4 steps, checkpoints every 2, shared run.dir)
    and 1 process × 8 devices (6 steps, no checkpoints) as the reference."""
    work = tmp_path_factory.mktemp("multiprocess")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog def class return import for while if else".split()
    (work / "data.txt").write_text("".join(" ".join(rng.choice(words) for _ in range(12)) + "\n"
                                           for _ in range(4000)))
    # An explicit config file: the default one sets model sizes that would beat the preset.
    config = work / "config.toml"
    config.write_text(f'[data]\nsource = "{work / "data.txt"}"\n')
    multi, single = work / "multi", work / "single"

    procs = Procs(work)
    t0 = time.monotonic()
    # started as SLURM starts its tasks; the resumption below gives the coordinator explicitly
    _start_slurm_run(procs, config, multi, ["train.steps=4", "train.checkpoint_every=2", "run.profile_steps=[3,1]",
                                            "run.wandb=offline"], tag="multi")
    procs.start("single", ["-m", "jaxllm", "train", "--config", str(config), *COMMON, "train.steps=6",
                           "train.checkpoint_every=0", f"run.dir={single}"], n_devices=8)
    procs.wait()
    print(f"first runs took {time.monotonic() - t0:.1f} s")
    return {"work": work, "config": config, "multi": multi, "single": single, "procs": procs,
            "multi_rows": _metrics(multi), "single_rows": _metrics(single)}


def test_two_processes_train_like_one(runs):
    procs, multi = runs["procs"], runs["multi"]
    err0, err1 = procs.stderr("multi0"), procs.stderr("multi1")
    assert "process 0 of 2, 4 local devices, 8 in all" in err0
    assert "process 1 of 2, 4 local devices, 8 in all" in err1
    assert "dp=2 fsdp=4 over 8 cpu device(s)" in err0 and "dp=2 fsdp=4 over 8 cpu device(s)" in err1

    rows, ref = runs["multi_rows"], [r for r in runs["single_rows"] if "loss" in r]
    # Only process 0 writes metrics: each step exactly once (two writers would duplicate rows).
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5, 6], ref
    assert "step      1 | loss" in err0 and "| loss" not in err1
    _assert_close([r["loss"] for r in rows], [r["loss"] for r in ref[:4]], 1e-5, "losses")
    _assert_close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref[:4]], 1e-4, "grad norms")
    _assert_close([r["lr"] for r in rows], [r["lr"] for r in ref[:4]], 1e-6, "learning rates")
    assert rows[-1]["loss"] < rows[0]["loss"]

    assert (multi / "config.toml").is_file()
    assert "auto = true" in (multi / "config.toml").read_text()  # found through SLURM's environment
    # Orbax wrote complete multi-process checkpoints into the shared run.dir.
    assert sorted(os.listdir(multi / "checkpoints")) == ["2", "4"]
    for step in ("2", "4"):
        assert (multi / "checkpoints" / step / "state").is_dir(), sorted(os.listdir(multi / "checkpoints"))
    assert not list(multi.glob("checkpoints/*.orbax-checkpoint-tmp*")), "an unfinished checkpoint was left behind"
    # each process traced step 3 into its own folder; process 0 alone logged to W&B
    for pid in (0, 1):
        assert len(list(multi.glob(f"profile/process_{pid}/plugins/profile/*/*.xplane.pb"))) == 1, pid
    assert len(list(multi.glob("wandb/offline-run-*"))) == 1 and "goodput " in err0


def test_two_processes_resume_from_their_checkpoint(runs):
    multi, work = runs["multi"], runs["work"]
    procs = Procs(work)
    t0 = time.monotonic()
    _start_distributed_run(procs, runs["config"], multi,  # and the end-of-run sample, generated by both
                           ["train.steps=6", "train.checkpoint_every=2", "train.resume=true", "run.sample_tokens=16"],
                           tag="resume")
    procs.wait()
    print(f"resumed run took {time.monotonic() - t0:.1f} s")
    for pid in (0, 1):
        assert f"resumed from step 4 in {multi}" in procs.stderr(f"resume{pid}")

    rows = _metrics(multi)
    ref = [r for r in _metrics(runs["single"]) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], rows  # appended once, by process 0
    # Steps 5-6 after a 2-process save + restore (params and Adam moments) follow the uninterrupted run.
    _assert_close([r["loss"] for r in rows[4:]], [r["loss"] for r in ref[4:]], 1e-5, "losses after resume")
    _assert_close([r["lr"] for r in rows[4:]], [r["lr"] for r in ref[4:]], 1e-6, "learning rates after resume")
    assert sorted(os.listdir(multi / "checkpoints"), key=int)[-1] == "6"
    assert (multi / "sample.txt").read_text().startswith("def ")  # written by process 0


def test_each_process_reads_only_its_rows(tmp_path):
    """Pre-training windows and fine-tuning rows: each process reads only its own; both processes build the
    same fine-tuning rows as this one process does, and the same mixture batches as one process resumed at the
    step where the mixture's weights changed."""
    from test_data_sources import texts, write_jsonl
    from test_sft import conversations

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(60)))
    write_jsonl(tmp_path / "a.jsonl", texts(200, seed=4))
    write_jsonl(tmp_path / "b.jsonl", texts(200, seed=5, words=8))
    procs = Procs(tmp_path)
    address = f"127.0.0.1:{_free_port()}"
    for pid in (0, 1):
        procs.start(f"worker{pid}", [str(REPO / "tests" / "multiprocess_worker.py"), address, "2", str(pid),
                                     str(chats), str(tmp_path)], n_devices=4)
    procs.wait(timeout=120)
    results = []
    for pid in (0, 1):
        lines = [l for l in procs.stdout(f"worker{pid}").splitlines() if l.startswith("RESULT ")]
        assert len(lines) == 1, procs.stdout(f"worker{pid}")
        results.append(json.loads(lines[0][len("RESULT "):]))
    for pid, res in enumerate(results):
        assert (res["process"], res["process_count"], res["local_devices"], res["devices"]) == (pid, 2, 4, 8)
        # dp is the outer mesh axis and each process holds one dp slice: half of the 16 rows.
        want_rows = list(range(8 * pid, 8 * pid + 8))
        for layout in (*res["batch"], res["blocks"]):
            assert layout["rows"] == want_rows, res
            assert layout["n_reads"] <= len(want_rows) * 33  # the 33-token windows of its own rows, no more
        # Rows split over dp×fsdp: this process's 8 rows of 32 positions per field.
        assert all(b["n_cells"] == 8 * 32 for b in res["batch"]), res
        assert res["sft"]["rows"] == want_rows
    from test_sft import sft_data
    one_process = sft_data(tmp_path, pack=True, chats=conversations(60),
                           **{"train.seed": 7, "model.seq_len": 64}).train.members
    assert results[0]["sft"]["members"] == results[1]["sft"]["members"] == one_process
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxllm.mesh import make_mesh
    from jaxllm.sharding import BATCH_AXES
    from multiprocess_worker import mixture_digests

    mesh = make_mesh({"pp": 1, "dp": 2, "fsdp": 4, "ep": 1, "sp": 1, "tp": 1})  # this process's 8 devices
    one = mixture_digests(str(tmp_path), NamedSharding(mesh, P(BATCH_AXES)))
    assert results[0]["mixture"] == results[1]["mixture"] == one and len(set(one)) == 4


def test_sigterm_to_one_process_stops_both_at_one_step_with_one_checkpoint(runs, tmp_path):
    """A preemption notice that reaches one process only: JAX's preemption service tells the other, both
    stop after the same step, save it together and exit 143 with the same line."""
    run_dir = tmp_path / "run"
    procs = Procs(tmp_path)
    _start_distributed_run(procs, runs["config"], run_dir,
                           ["train.steps=400", "train.schedule_steps=400", "train.checkpoint_every=0"], tag="p")
    victim = next(proc for name, proc, _, _ in procs.items if name == "p1")
    deadline = time.monotonic() + TIMEOUT_S
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
        assert all(p.poll() is None for _, p, _, _ in procs.items) and time.monotonic() < deadline
        time.sleep(0.01)
    victim.send_signal(signal.SIGTERM)
    codes = [proc.wait(timeout=TIMEOUT_S) for _, proc, _, _ in procs.items]
    lines = [procs.stderr(name).strip().splitlines()[-1] for name in ("p0", "p1")]
    assert codes == [143, 143], procs._report("exit codes")
    stop = _metrics(run_dir)[-1]["step"]
    assert lines[0] == lines[1] and lines[0].startswith(f"stopped: SIGTERM at step {stop}: "), lines
    assert 1 <= stop < 400 and [r["step"] for r in _metrics(run_dir)] == list(range(1, stop + 1))
    assert sorted(os.listdir(run_dir / "checkpoints")) == [str(stop)]
