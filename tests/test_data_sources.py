"""Data for real corpora: sources in four formats, jaxllm prepare-data (workers, resume after a kill, bad inputs),
mixtures (shares, windows, staged weights), document masking and prefetching."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import equivalence_config
from jaxllm.config import build_config
from jaxllm.data import dataset, loader, mixture, prepare
from jaxllm.data.corpus import load_corpus
from jaxllm.data.tokenizers import get_tokenizer
from jaxllm.models import transformer

REPO = Path(__file__).resolve().parents[1]
BYTE = get_tokenizer("byte")
WORDS = "alpha beta gamma delta ünïcödé ✓ 数据 the quick brown fox jumps over".split()


def texts(n: int, seed: int = 0, words: int = 60) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, words)))) + "\n" for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(docs)))
    return path


def shard_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---------------------------------------------------------------- formats and prepare-data

def test_the_same_texts_in_every_format_give_the_same_shards(tmp_path):
    """Text files, JSONL, Parquet, an Arrow IPC stream (datasets' save_to_disk) and an Arrow IPC file (Feather v2,
    lz4-compressed, in several record batches, as pandas' to_feather and polars' write_ipc write it)."""
    import datasets
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    docs = texts(120)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, t in enumerate(docs):
        (folder / f"{i:04d}.txt").write_text(t)
    sources = {"text": folder, "jsonl": write_jsonl(tmp_path / "docs.jsonl", docs),
               "parquet": tmp_path / "docs.parquet", "arrow": tmp_path / "arrow", "feather": tmp_path / "docs.arrow"}
    pq.write_table(pa.table({"text": docs}), sources["parquet"], row_group_size=25)  # five units
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(sources["arrow"]))
    feather.write_feather(pa.table({"id": range(len(docs)), "text": docs}), sources["feather"], compression="lz4",
                          chunksize=25)
    assert pa.ipc.open_file(sources["feather"]).num_record_batches == 5
    made = {}
    for i, (kind, source) in enumerate(sources.items()):
        job = prepare.Job(source=str(source), tokenizer="byte", val_percent=20, shard_tokens=1500, name="d",
                          unit_bytes=700)
        prepare.prepare(job, tmp_path / f"out_{kind}", workers=2 if i % 2 else 1)
        made[kind] = {k: v for k, v in shard_bytes(tmp_path / f"out_{kind}").items() if k != "prepare.json"}
    assert len(made["text"]) > 6 and all(made[k] == made["text"] for k in made), {k: sorted(v) for k, v in made.items()}
    # and the shards hold what reading the source in memory gives, documents and all
    shards, direct = load_corpus(str(tmp_path / "out_parquet"), BYTE), load_corpus(str(sources["jsonl"]), BYTE, 20)
    assert np.array_equal(np.asarray(shards.train), direct.train) and np.array_equal(shards.train_docs,
                                                                                      direct.train_docs)
    assert sorted(BYTE.decode(direct.train).split("<|endoftext|>")[1:] + BYTE.decode(direct.val).split(
        "<|endoftext|>")[1:]) == sorted(docs)


def _prepare_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "jaxllm", "prepare-data", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.slow
def test_prepare_data_killed_midway_then_rerun_gives_the_same_shards(tmp_path):
    source = write_jsonl(tmp_path / "big.jsonl", texts(6000))
    args = ["--workers", "1", "--unit-bytes", "20000", "--shard-tokens", "100000", "--quiet"]
    whole = _prepare_cli(source, tmp_path / "whole", *args)
    assert whole.returncode == 0, whole.stderr
    proc = subprocess.Popen([sys.executable, "-m", "jaxllm", "prepare-data", str(source), str(tmp_path / "cut"),
                             *args], cwd=REPO, stderr=subprocess.DEVNULL)
    work = prepare.work_dir(tmp_path / "cut")
    deadline = time.monotonic() + 60
    while len(list(work.glob("part_*.npz"))) < 5 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = sorted(p.name for p in work.glob("part_*.npz"))
    assert 5 <= len(kept) and not (tmp_path / "cut").exists(), kept  # killed part-way: nothing in OUT_DIR yet
    again = _prepare_cli(source, tmp_path / "cut", *args)
    assert again.returncode == 0, again.stderr
    assert f"{len(kept)} of " in again.stdout and "parts kept from an interrupted run" in again.stdout
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")
    assert not work.exists()


def _broken_parquet(d: Path) -> Path:
    (d / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    return d / "bad.parquet"


BAD_INPUTS = {  # name -> (make the input under a folder, words the one line must hold)
    "missing_field": (lambda d: write_jsonl(d / "a.jsonl", texts(5), key="body"), "a.jsonl line 1: no string field"),
    "not_json": (lambda d: Path(d / "b.jsonl").write_text('{"text": "ok"}\n{oops\n') and d / "b.jsonl",
                 "b.jsonl line 2: not JSON"),
    "unreadable_parquet": (_broken_parquet, "bad.parquet: not a readable Parquet file"),
    "no_tokens": (lambda d: write_jsonl(d / "e.jsonl", []), "no training document"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_are_one_line_exit_2_and_nothing_written(case, tmp_path, capsys):
    from jaxllm.cli import prepare_data

    make, words = BAD_INPUTS[case]
    (tmp_path / "in").mkdir()
    source = make(tmp_path / "in")
    assert prepare_data.main([str(source), str(tmp_path / "out"), "--workers", "1", "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert sorted(os.listdir(tmp_path)) == ["in"]  # no OUT_DIR, no work folder


# ---------------------------------------------------------------- mixtures

def _mixture(weights, global_batch=8, seq=16, stages=None, n=(5000, 3000, 800), seed=3):
    sources = [mixture.Source(f"s{i}", type("C", (), {"train": np.arange(k) % 250})(), None, None, (k - 1) // seq)
               for i, k in enumerate(n[:len(weights)])]
    data = mixture.MixtureData(sources, [[0, list(weights)]], seed, global_batch, seq, 1, "")
    if stages:
        data.stages = stages
    return data


def test_every_source_stays_within_one_row_of_its_share_at_every_step():
    w, B = [0.5, 0.3, 0.2], 8
    data = _mixture(w, B)
    seen = np.zeros(3)
    for step in range(400):
        which, starts = data.rows(step)
        assert len(which) == len(starts) == B
        seen += np.bincount(which, minlength=3)  # counted from the rows themselves
        assert np.all(np.abs(seen - (step + 1) * B * np.asarray(w)) < 1), (step, seen)
    # a staged change at step 100: the counts of the new weights start there, the earlier rows are kept
    staged = _mixture(w, B, stages=[[0, w], [100, [0.25, 0.25, 0.5]]])
    seen = np.zeros(3)
    for step in range(300):
        which, starts = staged.rows(step)
        if step < 100:
            assert np.array_equal(starts, data.rows(step)[1])
        seen += np.bincount(which, minlength=3)
        base = mixture.consumed([[0, w]], 100, B) if step >= 100 else 0
        want = (step + 1 - 100) * B * np.asarray([0.25, 0.25, 0.5]) + base if step >= 100 else (step + 1) * B * \
            np.asarray(w)
        assert np.all(np.abs(seen - want) < 1), (step, seen, want)


def test_each_source_draws_every_window_once_per_epoch():
    data = _mixture([0.5, 0.5], global_batch=8, seq=16, n=(161, 97))  # 10 and 6 windows
    by_source = {0: [], 1: []}
    for step in range(9):
        which, starts = data.rows(step)
        for i in (0, 1):
            by_source[i] += list(starts[which == i] // 16)
    for i, n in ((0, 10), (1, 6)):
        drawn = by_source[i][:3 * n]  # three epochs
        for e in range(3):
            assert sorted(drawn[e * n:(e + 1) * n]) == list(range(n)), (i, drawn)
        assert drawn[:n] != drawn[n:2 * n]  # a new order each epoch


def test_a_resumed_mixture_keeps_its_sources_and_stages_new_weights():
    from jaxllm.errors import ConfigError

    data = _mixture([0.5, 0.5])
    saved = {"config": {"data": {"sources": [{"path": "p/s0", "weight": 1}, {"path": "p/s1", "weight": 3}]}},
             "data_stages": [[0, [1, 3]]]}
    assert data.resume_stages(saved, 7) and data.stages == [[0, [1, 3]], [7, [0.5, 0.5]]]
    swapped = {"config": {"data": {"sources": [{"path": "p/s1", "weight": 1}, {"path": "p/s0", "weight": 3}]}}}
    with pytest.raises(ConfigError, match=r"trained on \['s1', 's0'\]"):
        _mixture([0.5, 0.5]).resume_stages(swapped, 7)


@pytest.mark.parametrize("sources, words", [
    ('[{path="stdlib", weight=0}]', "data.sources[0].weight: must be a positive number"),
    ('[{path="stdlib", weight=-1}]', "must be a positive number"),
    ('[{path="stdlib"}]', "must be a table with path and weight"),
    ('[{path="stdlib", weight=0.98}, {path="stdlib", weight=0.02, name="b"}]', "at least one row per step"),
    ('[{path="nowhere.jsonl", weight=1}]', "data.sources[0].path: no such file or folder"),
])
def test_bad_mixtures_are_one_line(tmp_path, capsys, sources, words):
    from jaxllm.cli import train as run_cli

    assert run_cli.main([f"data.sources={sources}", f"run.dir={tmp_path / 'run'}", "model.preset=tiny-gpt2",
                         "train.global_batch=8"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- document masking

def test_document_fields_restart_positions_at_each_document():
    docs = np.array([0, 5, 9, 30])
    got = loader.document_fields(np.array([3, 8]), 8, docs)
    assert got["segment_ids"].tolist() == [[1, 1, 2, 2, 2, 2, 3, 3], [1, 2, 2, 2, 2, 2, 2, 2]]
    assert got["positions"].tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_document_masking_keeps_other_documents_bitwise_and_off_is_todays_batch(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", texts(200, seed=1, words=8))
    over = {"data.source": str(tmp_path / "d.jsonl"), "model.preset": "tiny-llama", "model.seq_len": 64,
            "train.global_batch": 4, "data.val_percent": 0}
    plain = dataset.load(build_config(None, over), BYTE)
    masked = dataset.load(build_config(None, {**over, "data.document_mask": True}), BYTE)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    a, b = jax.device_get(plain.train_batch(5, sharding)), jax.device_get(masked.train_batch(5, sharding))
    starts = loader.window_starts(len(plain.corpus.train), plain.seed, 5, 4, 64)
    windows = np.stack([np.asarray(plain.corpus.train[s:s + 65], np.int32) for s in starts])
    today = {"inputs": windows[:, :-1], "targets": windows[:, 1:], "segment_ids": np.ones((4, 64), np.int32),
             "positions": np.tile(np.arange(64, dtype=np.int32), (4, 1)), "loss_mask": np.ones((4, 64), np.float32)}
    chex.assert_trees_all_equal({k: a[k] for k in today}, today, strict=True)  # off: as before (strict: dtypes too)
    chex.assert_trees_all_equal(*({k: x[k] for k in ("inputs", "targets", "loss_mask")} for x in (a, b)))
    row = int(np.argmax(b["segment_ids"].max(1) >= 3))  # a row with three or more documents
    assert b["segment_ids"][row].max() >= 3
    m = equivalence_config("tiny-llama", **{"model.seq_len": 64}).model

    @jax.jit
    def logits(params, batch):
        x = transformer.embed(params, batch["inputs"], batch["positions"], m, jnp.float32)
        x, _ = transformer.blocks(params["blocks"], x, batch["positions"], batch["segment_ids"], m, jnp.float32)
        return transformer.head_logits(params, x, m, jnp.float32)

    params = jax.jit(lambda k: transformer.init_params(m, k))(jax.random.key(0))
    second = b["segment_ids"][row] == 2
    edited = dict(b, inputs=b["inputs"].copy())
    edited["inputs"][row, second] = (edited["inputs"][row, second] + 7) % 256  # same length, other tokens
    before, after = np.asarray(logits(params, b)), np.asarray(logits(params, edited))
    others = np.ones(b["inputs"].shape, bool)
    others[row] = ~second
    assert np.array_equal(before[others], after[others]) and not np.array_equal(before[row, second],
                                                                                 after[row, second])
    # without the mask the edit reaches the documents after it
    unmasked = np.asarray(logits(params, dict(edited, segment_ids=a["segment_ids"], positions=a["positions"])))
    later = np.flatnonzero(b["segment_ids"][row] > 2)
    assert not np.array_equal(np.asarray(logits(params, a))[row, later], unmasked[row, later])


# ---------------------------------------------------------------- runs: staged mixtures and prefetching

def _run(run_dir: Path, steps: int, **over) -> list[dict]:
    """A short tiny-gpt2 run; its metrics.jsonl rows."""
    from jaxllm.trainer.loop import train

    train(build_config(None, {"model.preset": "tiny-gpt2", "train.global_batch": 8, "train.steps": steps,
                              "train.log_every": 1, "train.eval_every": 2, "train.checkpoint_every": 2,
                              "train.schedule_steps": 6, "run.sample_tokens": 0, "run.progress": False,
                              "run.dir": str(run_dir), **over}))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_mixture_run_resumes_with_new_weights_reproducibly(tmp_path):
    import shutil

    from jaxllm.trainer import checkpoint as ckpt

    write_jsonl(tmp_path / "a.jsonl", texts(400, seed=2))
    write_jsonl(tmp_path / "b.jsonl", texts(400, seed=3, words=8))
    run = lambda name, w, steps, resume=False: _run(
        tmp_path / name, steps, **{"data.document_mask": True, "train.resume": resume, "data.sources": [
            {"path": str(tmp_path / "a.jsonl"), "weight": w}, {"path": str(tmp_path / "b.jsonl"), "weight": 1 - w,
                                                               "name": "short"}]})
    run("a", 0.25, 4)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    rows_a, rows_b = run("a", 0.5, 6, resume=True), run("b", 0.5, 6, resume=True)
    assert [r.get("loss") for r in rows_a] == [r.get("loss") for r in rows_b]  # staged weights: reproducible
    for r in rows_a:  # tokens per source: the shares of each stage
        if "loss" in r:
            rows = mixture.consumed([[0, [0.25, 0.75]], [4, [0.5, 0.5]]], r["step"], 8)
            assert [r["tokens/a.jsonl"], r["tokens/short"]] == (rows * 64).tolist() and r["time/data_s"] >= 0
    val = [r for r in rows_a if "val_loss" in r][-1]
    per_source = sorted([val["val_loss/a.jsonl"], val["val_loss/short"]])
    assert per_source[0] < val["val_loss"] < per_source[1]  # the pooled loss lies between the sources'
    mngr = ckpt.open_manager(str(tmp_path / "a"), 3, read_only=True)
    assert ckpt.read_meta(mngr, 6)["data_stages"] == [[0, [0.25, 0.75]], [4, [0.5, 0.5]]]
    mngr.close()


@pytest.mark.slow
def test_prefetching_hides_the_time_spent_building_batches(tmp_path, monkeypatch):
    """A data hook (here only) sleeps half of the time between its calls, so half a step when nothing is built
    ahead: the step then waits about half its time; with prefetching, almost none of it."""
    built = dataset.TextData.train_batch
    last = {}

    def slow(self, step, sharding):
        now = time.perf_counter()
        time.sleep(0.5 * min(now - last.get("t", now), 0.5))  # half the time since the previous call
        last["t"] = now
        return built(self, step, sharding)

    monkeypatch.setattr(dataset.TextData, "train_batch", slow)
    write_jsonl(tmp_path / "d.jsonl", texts(300))
    share = {}
    for depth in (0, 2):
        last.clear()
        rows = [r for r in _run(tmp_path / f"p{depth}", 18, **{
            "data.prefetch": depth, "data.source": str(tmp_path / "d.jsonl"), "train.eval_every": 0,
            "train.schedule_steps": 0, "train.checkpoint_every": 0}) if "loss" in r][6:]
        share[depth] = sum(r["time/data_s"] for r in rows) / sum(r["time/wall_s"] for r in rows)
    assert share[2] < 0.02 and 0.3 < share[0] < 0.7, share
