"""Training metrics: a JSONL writer mirrored to TensorBoard (and W&B), memory figures, FLOP accounting for MFU,
and loss-curve PNGs.

`metrics.jsonl` in the run directory is the source of truth (plain text, one row per logged step; a
resumed run first drops the rows it will train again); TensorBoard event files and a W&B run
(`trainer/wandb_log.py`) are views of the same rows.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.errors import UserError

METRICS_FILE = "metrics.jsonl"


# ----------------------------------------------------------------------------- writing


def _summary_writer():
    """tensorboardX's SummaryWriter. tensorboardX imports torch wherever it is installed (2.6 s of a run's start on
    a 2-core CPU) only to take torch tensors, which jaxllm never hands it: where nothing imported torch yet, it is
    hidden while tensorboardX is imported (its `import torch` then raises the ImportError it catches). A run opens
    its writer before it starts its threads, so no other import sees torch hidden."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter


def _plain(value):
    """Turn jax/numpy scalars into Python int/float/bool so json and TensorBoard accept them."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise TypeError(f"metric values must be scalars, got shape {arr.shape}")
    if arr.dtype.kind == "b":
        return bool(arr)
    if arr.dtype.kind in "iu":
        return int(arr)
    return float(arr)


def _json_safe(value):
    """NaN/inf are not JSON; write them as null so any JSON reader can load the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MetricsWriter:
    """Appends metric rows to `<run_dir>/metrics.jsonl` and mirrors numbers to TensorBoard.

    Append mode means a resumed run continues the same file (after `keep_rows_through` dropped the
    rows it trains again); every row is flushed so a crash loses at most the row being written.
    TensorBoard's events are written from a queue by a background thread, so a killed run's last
    rows may never reach its event files: a resumed run (`resumed=True`) hides every earlier event
    (`purge_step=1`) and writes metrics.jsonl's rows to TensorBoard again. W&B likewise gets the rows it lacks
    (its mirror knows which: `wandb_log.Mirror`).
    """

    def __init__(self, run_dir: str, tensorboard: bool = True, resumed: bool = False, wandb=None):
        os.makedirs(run_dir, exist_ok=True)
        self._wandb = wandb  # a wandb_log.Mirror: each new row's numbers (not those of earlier runs)
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._file = open(self.path, "a+", encoding="utf-8")
        self._end_torn_line()
        self._tb = None
        if tensorboard:
            self._tb = _summary_writer()(logdir=os.path.join(run_dir, "tensorboard"), purge_step=1 if resumed else None)
            if resumed and os.path.getsize(self.path):
                for row in read_metrics(run_dir):
                    self._add_scalars(row)
        if resumed and wandb is not None and os.path.getsize(self.path):
            for row in read_metrics(run_dir):  # the mirror sends only the steps W&B lacks
                self._send_to_wandb(row)

    def _end_torn_line(self):
        """A crash mid-write can leave a line without '\\n'; terminate it so our first row stays intact."""
        size = self._file.seek(0, os.SEEK_END)
        if size:
            self._file.seek(size - 1)
            if self._file.read(1) != "\n":
                self._file.write("\n")
                self._file.flush()

    def write(self, row: dict) -> None:
        if "step" not in row:
            raise ValueError(f"metric rows need a 'step' key, got keys {sorted(row)}")
        plain = {key: _plain(value) for key, value in row.items()}
        line = json.dumps({k: _json_safe(v) for k, v in plain.items()}, allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()
        if self._tb is not None:
            self._add_scalars(plain)
            self._tb.flush()
        if self._wandb is not None:
            self._send_to_wandb(plain)

    def _send_to_wandb(self, row: dict) -> None:
        self._wandb.log({k: v for k, v in row.items() if k != "step" and _is_number(v)}, step=row["step"])

    def _add_scalars(self, row: dict) -> None:
        for key, value in row.items():
            if key != "step" and _is_number(value):
                self._tb.add_scalar(key, value, global_step=row["step"])

    def close(self, failed: bool = False) -> None:
        """Close the file and the views (`failed`: the run ended on an error, which W&B records)."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close(failed)
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def keep_rows_through(run_dir: str, step: int) -> None:
    """Drop the rows of `<run_dir>/metrics.jsonl` after `step` (and torn lines), atomically: a resumed
    run trains those steps again and logs each once."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return
    kept = [row for row in read_metrics(run_dir) if row.get("step", math.inf) <= step]
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, allow_nan=False) + "\n" for row in kept)
    os.replace(tmp, path)


def read_metrics(run_dir: str) -> list[dict]:
    """All rows of `<run_dir>/metrics.jsonl` in file order (nulls stay None).

    Lines that are not valid JSON (a row torn by a crash) are skipped rather than failing a plot.
    """
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory {run_dir!r} does not exist; pass the run_dir a training run wrote to")
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise UserError(f"no {METRICS_FILE} in {run_dir!r}; train at least one logged step into this run_dir first")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# ----------------------------------------------------------------------------- memory


def memory_columns() -> dict:
    """`memory/host_peak_bytes`, this process's peak resident set; and where the backend reports it (GPU, TPU;
    not the CPU), `memory/device_peak_bytes`, the highest peak of this process's devices since it started."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    row = {"memory/host_peak_bytes": rss if sys.platform == "darwin" else rss * 1024}
    peaks = [stats["peak_bytes_in_use"] for stats in (d.memory_stats() for d in jax.local_devices())
             if stats and "peak_bytes_in_use" in stats]
    if peaks:
        row["memory/device_peak_bytes"] = max(peaks)
    return row


# ----------------------------------------------------------------------------- FLOPs and MFU


def model_flops_per_token(n_params: int, n_layers: int, seq_len: int, attention_width: int) -> float:
    """Training FLOPs per token: 6·N + 6·n_layers·seq_len·attention_width (n_heads · head_dim, which is
    d_model unless `model.head_dim` says otherwise).

    Source: PaLM (Chowdhery et al. 2022), Appendix B: 6N + 12·L·H·Q·T with H·Q the attention width.
    6N is the dense matmuls (2N forward, 4N backward); 12·L·T·(H·Q) is the attention score and
    value matmuls over the full T×T matrix. We halve the attention term because
    a causal mask needs only the lower triangle, so our MFU is slightly conservative vs PaLM's.

    What to pass as n_params (N): every parameter that takes part in a matmul per token, i.e.
    all non-embedding parameters PLUS d_model·vocab for the LM-head matmul (count it even when
    the head is tied to the token embedding). Exclude token and positional embedding lookups:
    they are gathers, not FLOPs. Norm scales and biases may be included; they are negligible.
    """
    return 6.0 * n_params + 6.0 * n_layers * seq_len * attention_width


# Ordered (substring of device_kind, bf16/fp16 dense peak, fp32 non-TF32 peak or None);
# first match wins, so more specific names come first. Numbers are per chip, from vendor specs.
_PEAK_TABLE = [
    ("h100 pcie", 756e12, 51e12),
    ("h100", 989e12, 67e12),  # SXM and NVL report the SXM dense peak
    ("h200", 989e12, 67e12),
    ("a100", 312e12, 19.5e12),
    ("l4", 121e12, 30.3e12),
    ("v6 lite", 918e12, None),
    ("v6e", 918e12, None),
    ("v5 lite", 197e12, None),
    ("v5e", 197e12, None),
    ("v5p", 459e12, None),
    ("tpu v5", 459e12, None),  # v5p reports device_kind "TPU v5"
    ("tpu v4", 275e12, None),
]

_HALF = {"bfloat16", "bf16", "float16", "fp16", "f16", "half"}
_SINGLE = {"float32", "fp32", "f32", "single"}


def peak_flops_per_device(device, dtype_name: str) -> float | None:
    """Vendor dense peak FLOP/s of one chip for this dtype, or None when we don't know it.

    None for CPUs (no meaningful spec number; the caller measures with `measure_matmul_peak`)
    and for unknown chips or dtypes, so MFU is never computed against a made-up peak.
    """
    if getattr(device, "platform", "") == "cpu":
        return None
    name = str(dtype_name).lower()
    kind = str(getattr(device, "device_kind", "")).lower()
    for key, half_peak, single_peak in _PEAK_TABLE:
        if key in kind:
            if name in _HALF:
                return half_peak
            if name in _SINGLE:
                return single_peak
            return None
    return None


def measure_matmul_peak(dtype=jnp.float32, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a jitted n×n×n matmul on the default device: best of `repeats` after a warm-up.

    This is the CPU MFU denominator: CPUs have no trustworthy spec peak, so MFU there means
    "fraction of the matmul throughput this process achieves right now".
    """
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((n, n)), dtype=dtype)
    b = jnp.asarray(rng.standard_normal((n, n)), dtype=dtype)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()  # compile + warm caches
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the peak of all devices used."""
    if not peak_flops_total > 0:
        raise ValueError(f"peak_flops_total must be positive, got {peak_flops_total}")
    return tokens_per_s * flops_per_token / peak_flops_total


# ----------------------------------------------------------------------------- plotting


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) for rows carrying `key`, sorted by step, last row wins for a repeated step.

    A resumed run re-logs the steps after its last checkpoint; the later values are the ones
    that led to the current state, so they replace the earlier ones.
    """
    by_step = {}
    for row in rows:
        if key in row and "step" in row:
            value = row[key]
            by_step[row["step"]] = math.nan if value is None else float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_metrics(run_dir: str, out_path: str | None = None) -> str:
    """Draw train/val loss (top) and learning rate (bottom) against step into a PNG; return its path."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or display needed

    rows = read_metrics(run_dir)
    out_path = out_path or os.path.join(run_dir, "loss.png")

    fig = Figure(figsize=(8, 6), layout="constrained")
    loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    for key, label, style in [("loss", "train", "-"), ("val_loss", "validation", "o-")]:
        steps, values = _series(rows, key)
        if steps:
            loss_ax.plot(steps, values, style, label=label, markersize=4)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(os.path.basename(os.path.normpath(run_dir)))
    loss_ax.grid(alpha=0.3)
    if loss_ax.lines:
        loss_ax.legend()

    steps, values = _series(rows, "lr")
    if steps:
        lr_ax.plot(steps, values, color="tab:green")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    lr_ax.grid(alpha=0.3)

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, format="png", dpi=100)
    return out_path
