"""Tests for jaxllm.trainer.metrics and tools.dev.plot."""

import glob
import json
import math
import os
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.errors import UserError
from jaxllm.trainer import metrics as M

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _strict_json_lines(path):
    """Parse a jsonl file refusing the non-standard NaN/Infinity tokens."""

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    with open(path) as f:
        return [json.loads(line, parse_constant=reject) for line in f if line.strip()]


def _read_tb_scalars(run_dir):
    """(tag, step, value) from TensorBoard event files, parsed with tensorboardX's protobufs."""
    from tensorboardX.proto.event_pb2 import Event

    files = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    assert files, "no event file under run_dir/tensorboard"
    scalars = []
    for path in files:
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])  # skip length + its crc
            pos += 12 + length + 4  # payload + its crc
            for value in event.summary.value:
                scalars.append((value.tag, event.step, value.simple_value))
    return scalars


def train_row(step, loss, lr=1e-3):
    return dict(step=step, loss=loss, lr=lr, grad_norm=1.0, tokens_per_s=100.0, step_time_s=0.1, mfu=0.2)


# ----------------------------------------------------------------------------- writer


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch wherever it is installed (seconds of every run's start) only to take torch
    tensors: a process that had not imported torch writes its events without it (torch is installed here, for the
    transformers references)."""
    code = ("import sys; from jaxllm.trainer import metrics as M\n"
            f"with M.MetricsWriter({str(tmp_path)!r}) as w: w.write({train_row(1, 2.5)!r})\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("loss", 1, 2.5) in _read_tb_scalars(str(tmp_path))


def test_jsonl_appends_across_writers_and_converts_types(tmp_path):
    run = str(tmp_path / "run")
    with M.MetricsWriter(run, tensorboard=False) as w:
        w.write(dict(step=jnp.int32(1), loss=jnp.float32(2.5), lr=np.float64(1e-3)))
        w.write(dict(step=2, val_loss=np.float32(2.25)))
    with M.MetricsWriter(run, tensorboard=False) as w:  # a resumed run
        w.write(dict(step=3, loss=2.0))
    rows = M.read_metrics(run)
    assert rows == [
        dict(step=1, loss=2.5, lr=1e-3),
        dict(step=2, val_loss=2.25),
        dict(step=3, loss=2.0),
    ]
    assert type(rows[0]["step"]) is int and type(rows[0]["loss"]) is float
    assert not os.path.exists(os.path.join(run, "tensorboard"))


def test_rows_are_flushed_before_close(tmp_path):
    w = M.MetricsWriter(str(tmp_path), tensorboard=False)
    w.write(dict(step=1, loss=1.0))
    assert M.read_metrics(str(tmp_path)) == [dict(step=1, loss=1.0)]
    w.close()


def test_nan_and_inf_written_as_null(tmp_path):
    with M.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.write(dict(step=1, loss=float("nan"), grad_norm=jnp.float32(jnp.inf), lr=-np.inf))
    rows = _strict_json_lines(tmp_path / "metrics.jsonl")
    assert rows == [dict(step=1, loss=None, grad_norm=None, lr=None)]


def test_torn_last_line_does_not_corrupt_next_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')  # crash mid-write
    with M.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.write(dict(step=2, loss=2.0))
    assert M.read_metrics(str(tmp_path)) == [dict(step=1, loss=3.0), dict(step=2, loss=2.0)]


def test_write_requires_step(tmp_path):
    with M.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        with pytest.raises(ValueError, match="step"):
            w.write(dict(loss=1.0))


def test_tensorboard_scalars_readable(tmp_path):
    run = str(tmp_path)
    with M.MetricsWriter(run) as w:
        w.write(train_row(10, 3.5, lr=2e-4))
        w.write(dict(step=10, val_loss=3.75))
        w.write(dict(step=20, loss=float("nan"), note="text is skipped"))
    scalars = _read_tb_scalars(run)
    tags = {tag for tag, _, _ in scalars}
    assert tags == {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "val_loss"}
    assert ("loss", 10, 3.5) in scalars
    assert ("val_loss", 10, 3.75) in scalars
    assert any(t == "lr" and s == 10 and math.isclose(v, 2e-4, rel_tol=1e-6) for t, s, v in scalars)
    assert any(t == "loss" and s == 20 and math.isnan(v) for t, s, v in scalars)


# ----------------------------------------------------------------------------- read errors


def test_read_metrics_errors_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        M.read_metrics(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="metrics.jsonl"):
        M.read_metrics(str(tmp_path))


# ----------------------------------------------------------------------------- FLOPs / MFU


def test_model_flops_per_token_matches_hand_computation():
    # GPT-2 small-ish: N=85M non-embedding (+ head counted by caller), L=12, T=1024, d=768
    # 6*85e6 = 510_000_000; 6*12*1024*768 = 56_623_104
    assert M.model_flops_per_token(85_000_000, 12, 1024, 768) == 566_623_104.0
    assert M.model_flops_per_token(1, 0, 1024, 768) == 6.0


def test_mfu_arithmetic():
    # 1000 tok/s * 1e9 FLOP/tok = 1e12 FLOP/s against 1e13 peak
    assert math.isclose(M.mfu(1000.0, 1e9, 1e13), 0.1)
    assert math.isclose(M.mfu(500.0, 2e9, 8 * 989e12), 1e12 / (8 * 989e12))
    with pytest.raises(ValueError):
        M.mfu(1000.0, 1e9, 0.0)


@pytest.mark.parametrize(
    "kind,dtype,expected",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H100 80GB HBM3", "float32", 67e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "bfloat16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA A100-SXM4-80GB", "float32", 19.5e12),
        ("NVIDIA L4", "bfloat16", 121e12),
        ("TPU v4", "bfloat16", 275e12),
        ("TPU v5 lite", "bfloat16", 197e12),
        ("TPU v5", "bfloat16", 459e12),
        ("TPU v5p", "bfloat16", 459e12),
        ("TPU v6 lite", "bfloat16", 918e12),
        ("TPU v4", "float32", None),
        ("NVIDIA H100 80GB HBM3", "int4", None),
        ("Some Future Chip", "bfloat16", None),
    ],
)
def test_peak_flops_table(kind, dtype, expected):
    device = SimpleNamespace(platform="gpu" if "NVIDIA" in kind else "tpu", device_kind=kind)
    assert M.peak_flops_per_device(device, dtype) == expected


def test_peak_flops_cpu_is_none():
    assert M.peak_flops_per_device(SimpleNamespace(platform="cpu", device_kind="cpu"), "float32") is None
    if jax.devices()[0].platform == "cpu":
        assert M.peak_flops_per_device(jax.devices()[0], "float32") is None


def test_measure_matmul_peak_positive_finite_and_fast():
    start = time.perf_counter()
    peak = M.measure_matmul_peak()
    elapsed = time.perf_counter() - start
    assert math.isfinite(peak) and peak > 1e8  # any real device beats 0.1 GFLOP/s
    assert elapsed < 10.0
    assert M.measure_matmul_peak(n=64, repeats=1) > 0


# ----------------------------------------------------------------------------- plotting


def test_series_keeps_last_value_per_step_and_sorts():
    rows = [
        dict(step=1, loss=4.0),
        dict(step=2, loss=3.0),
        dict(step=2, val_loss=3.5),
        dict(step=3, loss=None),  # NaN written as null
        dict(step=2, loss=2.5),  # resumed run re-logs step 2
        dict(step=0, loss=5.0),
    ]
    steps, values = M._series(rows, "loss")
    assert steps == [0, 1, 2, 3]
    assert values[:3] == [5.0, 4.0, 2.5] and math.isnan(values[3])
    assert M._series(rows, "val_loss") == ([2], [3.5])
    assert M._series(rows, "lr") == ([], [])


def _assert_png(path):
    data = open(path, "rb").read()
    assert len(data) > 1000 and data[:8] == PNG_SIGNATURE


def test_plot_metrics_train_and_val_with_repeated_steps(tmp_path):
    run = str(tmp_path / "run")
    with M.MetricsWriter(run, tensorboard=False) as w:
        for step in range(1, 31):
            w.write(train_row(step, 5.0 / step**0.5, lr=1e-3 * min(1.0, step / 10)))
            if step % 10 == 0:
                w.write(dict(step=step, val_loss=5.2 / step**0.5))
    with M.MetricsWriter(run, tensorboard=False) as w:  # resume from step 20: steps 21..30 again
        for step in range(21, 41):
            w.write(train_row(step, 4.8 / step**0.5, lr=1e-3))
            if step % 10 == 0:
                w.write(dict(step=step, val_loss=float("nan") if step == 40 else 5.0 / step**0.5))
    path = M.plot_metrics(run)
    assert path == os.path.join(run, "loss.png")
    _assert_png(path)


def test_plot_metrics_no_val_rows_custom_out(tmp_path):
    with M.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        for step in range(5):
            w.write(train_row(step, 3.0 - 0.1 * step))
    out = str(tmp_path / "plots" / "curve.png")
    assert M.plot_metrics(str(tmp_path), out) == out
    _assert_png(out)


# ----------------------------------------------------------------------------- CLI


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tools.dev.plot", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_cli_missing_dir_and_missing_file_exit_2(tmp_path):
    for run_dir in [tmp_path / "missing", tmp_path]:
        result = _cli(str(run_dir))
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert result.stdout == ""


def test_cli_writes_png_and_prints_path(tmp_path):
    with M.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.write(train_row(1, 2.0))
        w.write(dict(step=1, val_loss=2.1))
    out = str(tmp_path / "out.png")
    result = _cli(str(tmp_path), "--out", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == out
    _assert_png(out)
