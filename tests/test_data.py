"""Tests for jaxllm.data: tokenizers, shards, corpora, mesh-independent batches and jaxllm prepare-data."""

import os
import re

_FLAG = "--xla_force_host_platform_device_count=8"  # must be set before jax is first imported
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxllm.data import (ByteTokenizer, batch_rows, corpus_summary, eval_batch, get_tokenizer, global_batch,
                         list_shards, load_corpus, read_shard, window_starts, write_shard)
from jaxllm.batch import FIELDS, check, from_windows
from jaxllm.errors import DataError

REPO = Path(__file__).resolve().parents[1]
BYTE = ByteTokenizer()
EOT = "<|endoftext|>"


# ---------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    text = "def f(x):\n    return 'héllo, 世界 🙂'\n"
    ids = BYTE.encode(text)
    assert ids.dtype == np.uint16 and len(ids) == len(text.encode()) and ids.max() < 256
    assert BYTE.decode(ids) == text
    assert BYTE.decode(np.concatenate([[256], ids, [256]])) == EOT + text + EOT
    assert BYTE.decode([0xE4, 0xB8]) == "\ufffd"  # a cut UTF-8 character decodes with errors='replace'
    assert (BYTE.name, BYTE.vocab_size, BYTE.eot) == ("byte", 257, 256)


def test_get_tokenizer():
    assert get_tokenizer("byte") == BYTE
    with pytest.raises(DataError, match="byte, gpt2"):
        get_tokenizer("sentencepiece")


def test_gpt2_works_or_fails_fast_in_one_line():
    t0 = time.monotonic()
    try:
        tok = get_tokenizer("gpt2")
    except DataError as e:
        assert "\n" not in str(e) and "data.tokenizer=byte" in str(e)
    else:
        assert (tok.vocab_size, tok.eot) == (50257, 50256)
        assert tok.decode(tok.encode("Hello world")) == "Hello world"
    assert time.monotonic() - t0 < 10


def test_gpt2_without_cached_files_raises_at_once(tmp_path, monkeypatch):
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: tiktoken would download
    t0 = time.monotonic()
    with pytest.raises(DataError, match="not cached") as e:
        get_tokenizer("gpt2")
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 2


# ---------------------------------------------------------------- shards

@pytest.mark.parametrize("top, version, dtype", [(300, 1, np.uint16), (70000, 7, np.uint32)])
def test_shard_round_trip(tmp_path, top, version, dtype):
    tokens = np.random.default_rng(0).integers(0, top, size=1000)
    path = tmp_path / "x_train_000001.bin"
    write_shard(path, tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [20240520, version, 1000] and not header[3:].any()
    back = read_shard(path)
    assert back.dtype == dtype and np.array_equal(back, tokens)
    assert not back.flags.writeable
    assert sorted(os.listdir(tmp_path)) == ["x_train_000001.bin"]  # no temp file left


def test_bad_shards_raise_with_file_name(tmp_path):
    path = tmp_path / "bad_val_000000.bin"
    write_shard(path, np.arange(100))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="bad_val_000000.bin.*truncated"):
        read_shard(path)
    path.write_bytes(b"\0" * 100)
    with pytest.raises(DataError, match="bad_val_000000.bin.*header"):
        read_shard(path)
    header = np.zeros(256, "<i4")
    header[:3] = 12345, 1, 0
    path.write_bytes(header.tobytes())
    with pytest.raises(DataError, match="bad_val_000000.bin.*magic"):
        read_shard(path)
    header[:3] = 20240520, 3, 0
    path.write_bytes(header.tobytes())
    with pytest.raises(DataError, match="bad_val_000000.bin.*version"):
        read_shard(path)


def test_list_shards(tmp_path):
    for name in ["d_train_000002.bin", "d_val_000000.bin", "d_train_000001.bin", "notes.txt"]:
        (tmp_path / name).write_bytes(b"")
    train, val = list_shards(tmp_path)
    assert [Path(p).name for p in train] == ["d_train_000001.bin", "d_train_000002.bin"]
    assert [Path(p).name for p in val] == ["d_val_000000.bin"]
    assert list_shards(str(tmp_path / "d_*.bin")) == (train, val)
    with pytest.raises(DataError, match="no validation shards"):
        list_shards(str(tmp_path / "d_train_*.bin"))


def test_shards_corpus_checks_vocab(tmp_path):
    write_shard(tmp_path / "g_val_000000.bin", np.array([50256, 464, 2068]))
    write_shard(tmp_path / "g_train_000001.bin", np.array([50256, 10, 20, 30]))
    with pytest.raises(DataError, match="data.tokenizer"):
        load_corpus(str(tmp_path), BYTE)
    write_shard(tmp_path / "g_val_000000.bin", np.array([256, 104, 105]))
    write_shard(tmp_path / "g_train_000001.bin", np.array([256, 1, 2, 3]))
    write_shard(tmp_path / "g_train_000002.bin", np.array([256, 4, 5]))
    corpus = load_corpus(str(tmp_path), BYTE)
    assert corpus.train.tolist() == [256, 1, 2, 3, 256, 4, 5] and corpus.val.tolist() == [256, 104, 105]
    assert load_corpus(str(tmp_path / "g_*.bin"), BYTE).train.tolist() == corpus.train.tolist()


# ---------------------------------------------------------------- corpora

@pytest.fixture(scope="module")
def stdlib():
    return load_corpus("stdlib", BYTE)


def test_stdlib_corpus(stdlib):
    assert stdlib.train.dtype == np.uint16
    assert len(stdlib.train) > 1_000_000 and len(stdlib.val) > 10_000
    assert stdlib.train[0] == BYTE.eot and stdlib.val[0] == BYTE.eot
    n_files = (stdlib.train == BYTE.eot).sum() + (stdlib.val == BYTE.eot).sum()
    assert n_files > 100  # split by file: each file is one document
    assert 0.01 < len(stdlib.val) / len(stdlib.train) < 0.2
    assert "stdlib" in corpus_summary(stdlib) and "\n" not in corpus_summary(stdlib)
    assert "site-packages" not in BYTE.decode(stdlib.val[:100_000])  # smoke: text, not binary
    again = load_corpus("stdlib", BYTE)
    assert np.array_equal(again.train, stdlib.train) and np.array_equal(again.val, stdlib.val)
    more_val = load_corpus("stdlib", BYTE, val_percent=20)
    assert len(more_val.val) > 2 * len(stdlib.val)


def test_text_file_corpus(tmp_path):
    text = "".join(f"line {i}: ünïcödé ✓\n" for i in range(200))
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), BYTE, val_percent=10)
    train, val = BYTE.decode(corpus.train), BYTE.decode(corpus.val)
    assert train.startswith(EOT) and val.startswith(EOT)
    assert train[len(EOT):] + val[len(EOT):] == text
    assert val[len(EOT):].startswith("line ")  # cut at a line start
    assert 0.07 < len(corpus.val) / len(text.encode()) < 0.13


def test_folder_corpus(tmp_path):
    texts = {f"sub/f{i:02d}.txt": f"file {i} ✓\n" * 20 for i in range(40)}
    for rel, text in texts.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    (tmp_path / ".hidden").write_text("HIDDEN")
    (tmp_path / "blob.dat").write_bytes(b"BIN\0ARY")
    (tmp_path / "latin1.txt").write_bytes("LATIN caf\xe9".encode("latin-1"))
    corpus = load_corpus(str(tmp_path), BYTE, val_percent=20)
    train, val = BYTE.decode(corpus.train), BYTE.decode(corpus.val)
    docs = train.split(EOT)[1:] + val.split(EOT)[1:]
    assert sorted(docs) == sorted(texts.values())  # every text file once; hidden and binary ones skipped
    assert val and train.count(EOT) > val.count(EOT) > 0
    assert np.array_equal(load_corpus(str(tmp_path), BYTE, val_percent=20).val, corpus.val)


def test_single_file_folder_splits_like_text_file(tmp_path):
    (tmp_path / "only.txt").write_text("abc\n" * 100)
    corpus = load_corpus(str(tmp_path), BYTE)
    assert BYTE.decode(corpus.train)[len(EOT):] + BYTE.decode(corpus.val)[len(EOT):] == "abc\n" * 100


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        load_corpus(str(tmp_path / "missing"), BYTE)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"), BYTE)
    (tmp_path / "tiny.txt").write_text("x")
    with pytest.raises(DataError, match="stream has only"):
        load_corpus(str(tmp_path / "tiny.txt"), BYTE)
    with pytest.raises(DataError, match="val_percent"):
        load_corpus(str(tmp_path / "tiny.txt"), BYTE, val_percent=100)


def test_val_percent_zero_means_no_validation_for_shards_too(tmp_path):
    from jaxllm.config import build_config
    from jaxllm.data import dataset

    write_shard(tmp_path / "s_val_000000.bin", np.arange(100) % 256)
    write_shard(tmp_path / "s_train_000001.bin", np.arange(200) % 256)
    cfg = build_config(None, {"data.source": str(tmp_path), "model.seq_len": 16})
    assert dataset.load(cfg, BYTE).has_validation
    cfg.data.val_percent = 0
    assert not dataset.load(cfg, BYTE).has_validation


def test_val_percent_zero_keeps_every_text_for_training(tmp_path):
    (tmp_path / "a.txt").write_text("abc\n" * 50)
    (tmp_path / "b.txt").write_text("xyz\n" * 50)
    for source in (tmp_path / "a.txt", tmp_path):
        corpus = load_corpus(str(source), BYTE, val_percent=0)
        assert len(corpus.val) == 0 and sorted(BYTE.decode(corpus.train).split(EOT)[1:]) == sorted(
            p.read_text() for p in ([source] if source.is_file() else [tmp_path / "a.txt", tmp_path / "b.txt"]))


# ---------------------------------------------------------------- jaxllm prepare-data

def _prepare(*args):
    return subprocess.run([sys.executable, "-m", "jaxllm", "prepare-data", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_prepare_data_round_trip(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"m{i}.py").write_text(f"x = {i}\n" * 50)
    out = tmp_path / "out" / "shards"
    r = _prepare(src, out, "--name", "toy", "--shard-tokens", "1000", "--val-percent", "10")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and len(r.stdout.strip().splitlines()) == 1
    names = sorted(n for n in os.listdir(out) if n.endswith(".bin"))
    assert sorted(os.listdir(out)) == sorted(names + [n[:-4] + ".docs.npy" for n in names] + ["prepare.json"])
    n_val = sum("_val_" in n for n in names)
    assert names[-n_val] == "toy_val_000000.bin" and names[0] == f"toy_train_{n_val:06d}.bin"
    assert len(names) - n_val > 2  # the train stream was cut into several shards
    assert sorted(os.listdir(out.parent)) == ["shards"]  # no temp folder left behind
    direct = load_corpus(str(src), BYTE, val_percent=10)
    via_shards = load_corpus(str(out), BYTE)
    assert np.array_equal(via_shards.train, direct.train) and np.array_equal(via_shards.val, direct.val)
    assert all(len(read_shard(out / n)) <= 1000 for n in names)


def test_prepare_data_errors_leave_nothing(tmp_path):
    r = _prepare(tmp_path / "missing.txt", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.startswith("error: INPUT: no such file")
    assert os.listdir(tmp_path) == []
    assert _prepare("stdlib", tmp_path / "out", "--tokenizer", "nope").returncode == 2  # argparse


# ---------------------------------------------------------------- loader

def test_window_starts():
    a = window_starts(10_000, seed=1, step=5, global_batch=64, seq_len=32)
    chex.assert_shape(a, (64,))
    assert a.dtype == np.int64
    assert np.array_equal(a, window_starts(10_000, 1, 5, 64, 32))
    assert not np.array_equal(a, window_starts(10_000, 1, 6, 64, 32))
    assert not np.array_equal(a, window_starts(10_000, 2, 5, 64, 32))
    assert a.min() >= 0 and a.max() <= 10_000 - 33
    assert set(window_starts(33, 0, 0, 16, 32)) == {0}  # exactly one window fits
    with pytest.raises(DataError, match="seq_len"):
        window_starts(32, 0, 0, 16, 32)


def _mesh(shape, names):
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices: jax was initialized before this file set XLA_FLAGS")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices[:8])


class _Recorder:
    """A token stream that records the shape of every read, to check each device reads only its block."""

    def __init__(self, tokens):
        self.tokens, self.reads = tokens, []

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        self.reads.append(np.shape(index))
        return self.tokens[index]


def test_global_batch_is_mesh_independent():
    tokens = np.random.default_rng(0).integers(0, 257, size=5000).astype(np.uint16)
    gb, seq = 16, 16
    starts = window_starts(len(tokens), 3, 7, gb, seq)
    expected = np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int32)
    assert np.array_equal(batch_rows(tokens, starts, slice(4, 8), seq), expected[4:8])

    m8 = _mesh((8,), ("dp",))
    m24 = _mesh((2, 4), ("dp", "fsdp"))
    m42 = _mesh((4, 2), ("dp", "tp"))
    shardings = [NamedSharding(m8, P("dp")), NamedSharding(m24, P(("dp", "fsdp"))),
                 NamedSharding(m42, P("dp")), NamedSharding(m24, P("dp", "fsdp"))]  # last: columns split too
    for sharding in shardings:
        rec = _Recorder(tokens)
        x = global_batch(rec, 3, 7, gb, seq, sharding)
        assert {k: (a.shape, a.dtype) for k, a in x.items()} == {k: ((gb, seq), d) for k, d in FIELDS.items()}
        assert all(a.sharding == sharding for a in x.values())
        assert np.array_equal(np.asarray(x["inputs"]), expected[:, :-1])
        assert np.array_equal(np.asarray(x["targets"]), expected[:, 1:])
        assert np.array_equal(np.asarray(x["positions"]), np.broadcast_to(np.arange(seq), (gb, seq)))
        assert np.all(np.asarray(x["segment_ids"]) == 1) and np.all(np.asarray(x["loss_mask"]) == 1)
        # each device's block reads the whole windows of its own rows, once for inputs and targets together
        rows = sharding.shard_shape((gb, seq))[0]
        assert len(rec.reads) == gb // rows and all(shape == (rows, seq + 1) for shape in rec.reads), (sharding, rec.reads)
    other_step = global_batch(tokens, 3, 8, gb, seq, shardings[0])
    assert not np.array_equal(np.asarray(other_step["inputs"]), expected[:, :-1])


def test_eval_batch():
    tokens = np.arange(10_000)  # token == position, so a row's first token is its start
    sharding = NamedSharding(_mesh((8,), ("dp",)), P("dp"))
    windows = lambda b: np.concatenate([np.asarray(b["inputs"]), np.asarray(b["targets"])[:, -1:]], axis=1)
    batches = [windows(eval_batch(tokens, i, 3, 8, 31, sharding)) for i in range(3)]
    rows = np.concatenate(batches)
    chex.assert_shape(batches[0], (8, 32))
    assert batches[0].dtype == np.int32
    assert rows[0, 0] == 0 and rows[-1, -1] == tokens[-1]  # spans the whole stream
    assert set(np.diff(rows[:, 0])) <= {433, 434}  # evenly spaced: (10000-32)/23 = 433.4
    assert all(np.array_equal(r, tokens[r[0]:r[0] + 32]) for r in rows)
    again = windows(eval_batch(tokens, 1, 3, 8, 31, NamedSharding(_mesh((2, 4), ("dp", "fsdp")), P(("dp", "fsdp")))))
    assert np.array_equal(again, batches[1])
    with pytest.raises(ValueError):
        eval_batch(tokens, 3, 3, 8, 31, sharding)


# ---------------------------------------------------------------- bad data through the trainer's command line


def _shards_with(tmp_path, damage):
    """A shard folder whose validation shard `damage` spoils."""
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder / "x_train_000001.bin", np.arange(5000) % 200)
    write_shard(folder / "x_val_000000.bin", np.arange(5000) % 200)
    damage(folder / "x_val_000000.bin")
    return folder


def _header(magic=20240520, version=1, count=5000):
    def write(path):
        data = bytearray(path.read_bytes())
        data[:12] = np.array([magic, version, count], "<i4").tobytes()
        path.write_bytes(bytes(data))
    return write


def _file(path, data: bytes):
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


BAD_DATA = {  # name -> (make the source under a folder, words the one line must hold)
    "empty_file": (lambda d: _file(d / "empty.txt", b""), "empty"),
    "empty_folder": (lambda d: _file(d / "none" / ".hidden", b"x").parent, "no non-empty UTF-8 text"),
    "binary_file": (lambda d: _file(d / "x.txt", bytes(range(256)) * 4), "not a UTF-8 text file"),
    "shorter_than_a_window": (lambda d: _file(d / "short.txt", b"a few words\n" * 20), "model.seq_len"),
    "folder_without_text": (lambda d: _file(d / "bin" / "a.dat", b"\0\1" * 99).parent, "no non-empty UTF-8 text"),
    "shard_magic": (lambda d: _shards_with(d, _header(magic=1234)), "magic"),
    "shard_version": (lambda d: _shards_with(d, _header(version=5)), "version"),
    "shard_length": (lambda d: _shards_with(d, _header(count=6000)), "truncated or corrupt"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_one_line_exit_2_and_nothing_written(case, tmp_path, capsys):
    from jaxllm.cli import train as run_cli

    make, words = BAD_DATA[case]
    source, run_dir = make(tmp_path), tmp_path / "run"
    assert run_cli.main([f"data.source={source}", f"run.dir={run_dir}", "model.preset=tiny-gpt2",
                         "model.seq_len=256"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert str(source) in lines[0]  # names the file
    assert not run_dir.exists()


def test_a_batch_off_the_contract_is_one_line():
    """What the step checks before compiling: fields, one [batch, seq] shape, dtypes."""
    good = from_windows(np.zeros((2, 9), np.int32))
    check(good)
    check({**good, "weights": np.ones((2, 8), np.float32)}, {"weights": "float32"})
    for bad, words in [({k: v for k, v in good.items() if k != "loss_mask"}, "missing ['loss_mask']"),
                       ({**good, "loss_mask": np.ones((2, 7), np.float32)}, "one [batch, seq] shape"),
                       ({**good, "positions": good["positions"].astype(np.int64)}, "wrong dtypes")]:
        with pytest.raises(DataError, match=re.escape(words)):
            check(bad)
