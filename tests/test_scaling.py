"""The scaling-law study (`tools/studies/scaling.py`, with `scaling_fit.py` and `scaling_report.py` beside it).

- The fits recover known exponents: points drawn from L(N, D) = E + A/N^α + B/D^β with 0.5% noise, for two
  sets of true values, give α, β and the allocation exponent a = β/(α+β) inside their bootstrap intervals
  (approach 3), and a inside its interval from the iso-FLOP parabolas (approach 2); the intervals are narrow
  enough to mean something. The compute-optimal N really minimises L on its budget.
- The sweep's plan: N without embeddings, steps from C = 6·N·D, widths that keep the head width.
- `fit` on a synthetic sweep writes its tables, fit.json and three PNGs; bad input (no such directory, no
  finished runs, too few, a size that is not LAYERSxWIDTH) is one line and exit code 2.
- Slow tier: a real two-run sweep SIGKILLed inside its second run (jaxllm/trainer/faults.py) and started again
  trains nothing finished again and ends with the metrics of a sweep never killed, loss for loss; `check`
  writes its prediction before its run, trains it, and does neither again when repeated.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from harness import CORPUS, REPO, subprocess_env, unmeasured
from jaxllm.config import build_config
from jaxllm.errors import UserError
from jaxllm.models.transformer import count_params
from tools.studies import scaling, scaling_fit

CHINCHILLA = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022's fit
OTHER = dict(E=0.9, A=60.0, B=900.0, alpha=0.5, beta=0.4)


def synthetic(true: dict, budgets, noise: float = 0.005, seed: int = 0) -> list[dict]:
    """Five sizes per budget around the true compute-optimal N (×1/4 ... ×4), losses from the formula times
    log-normal noise."""
    rng = np.random.default_rng(seed)
    points = []
    for c in budgets:
        n_opt = float(scaling_fit.compute_optimal(true, c)[0])
        for n in n_opt * np.array([0.25, 0.5, 1, 2, 4]):
            d = c / 6 / n
            loss = float(scaling_fit.predict(true, n, d)) * float(np.exp(rng.normal(0, noise)))
            points.append({"n_params": n, "tokens": d, "budget": c, "loss": loss})
    return points


@pytest.mark.parametrize("true, budgets", [(CHINCHILLA, [1e18, 3e18, 1e19, 3e19]), (OTHER, [1e12, 1e13, 1e14])],
                         ids=["chinchilla", "other"])
def test_the_fits_recover_known_exponents(true, budgets):
    """In at least two of three independent draws each exponent lies inside its 95% interval (a percentile
    bootstrap on 15-20 points covers about 90%: measured over 12 draws of each case), and every point estimate
    is near it."""
    a_true = true["beta"] / (true["alpha"] + true["beta"])
    inside = {"alpha": 0, "beta": 0, "a": 0, "a (approach 2)": 0}
    for seed in range(3):
        result = scaling_fit.analyse(synthetic(true, budgets, seed=seed), n_boot=30, seed=seed)
        fit, iso = result["surface"], result["isoflop"]
        found = {key: (fit[key], result["surface_ci"][key]) for key in ("alpha", "beta", "a")}
        found["a (approach 2)"] = (iso["a"], result["isoflop_ci"]["a"])
        for key, (estimate, (lo, hi)) in found.items():
            value = true[key] if key in true else a_true
            inside[key] += lo <= value <= hi
            assert abs(estimate - value) < 0.06 and hi - lo < 0.3, (seed, key, value, estimate, (lo, hi))
    assert min(inside.values()) >= 2, inside


def test_the_huber_loss_shrugs_off_an_outlier():
    """One run 15% off (a diverged or mislogged point) barely moves the exponents; least squares would follow it."""
    points = synthetic(CHINCHILLA, [1e18, 3e18, 1e19, 3e19], noise=0.002)
    points[7]["loss"] *= 1.15
    fit = scaling_fit.fit_surface(*(np.array([p[k] for p in points]) for k in ("n_params", "tokens", "loss")))
    assert abs(fit["alpha"] - CHINCHILLA["alpha"]) < 0.03 and abs(fit["beta"] - CHINCHILLA["beta"]) < 0.03, fit


def test_compute_optimal_n_minimises_the_loss_on_its_budget():
    for c in (1e12, 1e20):
        n, d = scaling_fit.compute_optimal(CHINCHILLA, c)
        assert np.isclose(6 * n * d, c)
        around = n * np.array([0.97, 1.0, 1.03])
        losses = scaling_fit.predict(CHINCHILLA, around, c / 6 / around)
        assert losses[1] < losses[0] and losses[1] < losses[2]


def test_the_sweep_counts_n_without_embeddings_and_steps_from_the_budget(capsys):
    assert scaling.main(["run", "--dry-run", "--sizes", "2x32", "3x64", "--budgets", "1e12"]) == 0
    out = capsys.readouterr().out
    assert "without embeddings" in out
    for layers, width in ((2, 32), (3, 64)):
        cfg = build_config(scaling.CONFIG, {"model.n_layers": layers, "model.d_model": width,
                                            "model.n_heads": width // 16, "model.d_ff": 4 * width})
        n = count_params(cfg.model, embeddings=False)
        assert n < count_params(cfg.model)
        steps = round(1e12 / (6 * n * 16 * 128))  # scaling.toml: 16 sequences of 128 tokens a step
        assert f"| c1e12_{layers}x{width} | {layers} × {width} | {n:,} | 1e+12 | {steps * 2048:,} |" in out


# ---------------------------------------------------------------- fit and bad input, on synthetic sweeps


def fake_sweep(runs_dir, true: dict, budgets, sizes, base: str = scaling.CONFIG) -> None:
    """Finished run directories as `run` leaves them (point.json, metrics.jsonl), without training: real
    shapes and steps from the base config, losses from the formula."""
    os.makedirs(runs_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    for c in budgets:
        for size in sizes:
            point = scaling.plan(base, size, c)
            run_dir = os.path.join(runs_dir, point.name)
            os.makedirs(run_dir)
            with open(os.path.join(run_dir, "point.json"), "w") as f:
                json.dump({**dataclasses.asdict(point), "flops": point.flops}, f)
            loss = float(scaling_fit.predict(true, point.n_params, point.tokens)) * float(np.exp(rng.normal(0, 0.005)))
            with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
                for step in sorted({1, max(1, point.steps // 2), point.steps}):
                    f.write(json.dumps({"step": step, "loss": loss + 1 / step}) + "\n")
                f.write(json.dumps({"step": point.steps, "val_loss": loss}) + "\n")


SMALL = dict(E=1.0, A=40.0, B=300.0, alpha=0.4, beta=0.35)
EVEN = dict(E=1.0, A=300.0, B=200.0, alpha=0.4, beta=0.4)
SIZES = [(1, 16), (2, 32), (2, 48), (3, 64)]


def test_fit_prints_the_fits_and_draws_three_plots(tmp_path, capsys):
    runs = tmp_path / "runs"
    fake_sweep(runs, SMALL, [1e11, 1e12], SIZES)
    assert scaling.main(["fit", str(runs), "--bootstrap", "10", "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "without embeddings" in out and "| α |" in out and "Approach 2" in out
    assert sorted(os.listdir(tmp_path / "plots")) == ["scaling_frontier.png", "scaling_isoflop.png",
                                                      "scaling_loss_vs_tokens.png"]
    with open(runs / "fit.json") as f:
        fitted = json.load(f)
    assert abs(fitted["surface"]["alpha"] - SMALL["alpha"]) < 0.1 and fitted["resamples"] == 10


def unfinished(runs_dir) -> None:
    """A run that was killed before its last step."""
    fake_sweep(runs_dir, SMALL, [1e11], SIZES[:1])
    (name,) = os.listdir(runs_dir)
    with open(os.path.join(runs_dir, name, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "loss": 5.0}) + "\n")


BAD = {
    "no such directory": (lambda d: None, ["fit", "{d}/nowhere"], "no such directory"),
    "no finished runs": (unfinished, ["fit", "{d}"], "no finished runs (1 unfinished)"),
    "too few runs": (lambda d: fake_sweep(d, SMALL, [1e11, 1e12], SIZES[:2]), ["fit", "{d}"], "too few finished runs"),
    "check without a sweep": (lambda d: os.makedirs(d), ["check", "{d}"], "no base.toml"),
    "a size that is not LAYERSxWIDTH": (lambda d: None, ["run", "--dry-run", "--sizes", "2y32"], "LAYERSxWIDTH"),
    "a width off the head width": (lambda d: None, ["run", "--dry-run", "--sizes", "2x40"], "head width 16"),
    "a budget that is not FLOPs": (lambda d: None, ["run", "--dry-run", "--budgets", "0"], "positive number"),
    "a check budget that is not FLOPs": (lambda d: None, ["check", "{d}", "--budget", "lots"], "positive number"),
    "no bootstrap": (lambda d: None, ["fit", "{d}", "--bootstrap", "0"], "at least 2"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    make, argv, says = BAD[case]
    runs = str(tmp_path / "runs")
    make(runs)
    assert scaling.main([a.format(d=runs) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_a_sweep_continues_only_on_its_own_base(tmp_path):
    path = scaling.write_base(str(tmp_path), scaling.CONFIG, [])
    with open(path) as f:  # as if written before jaxllm had a key, which now takes its default
        lines = [line for line in f if not line.startswith("keep_checkpoints")]
    with open(path, "w") as f:
        f.writelines(lines)
    assert scaling.write_base(str(tmp_path), scaling.CONFIG, []) == path
    with pytest.raises(UserError, match="another base config"):
        scaling.write_base(str(tmp_path), scaling.CONFIG, ["train.lr=1e-3"])


# ---------------------------------------------------------------- real runs (slow tier)

# A two-run sweep of a one-layer width-16 model on the small fixture corpus, a checkpoint every 2 steps:
# 8e7 FLOPs make 8 steps at N = 3,312 (16 sequences of 32 tokens a step), 1.6e8 make 16.
TINY_KEYS = [f"data.source={CORPUS}", "model.seq_len=32", "train.checkpoint_every=2", "train.log_every=1",
             "train.eval_batches=2"]
TINY = ["--sizes", "1x16", "--budgets", "8e7", "1.6e8", *TINY_KEYS]


def sweep(out, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {**subprocess_env(1), **({"JAXLLM_TEST_KILL": kill} if kill else {})}
    return subprocess.run([sys.executable, "-m", "tools.studies.scaling", "run", "--out", str(out), *TINY], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [unmeasured(json.loads(line)) for line in f]


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_exactly(tmp_path):
    done = sweep(tmp_path / "reference")
    assert done.returncode == 0, done.stderr
    first, second = "c8e07_1x16", "c1.6e08_1x16"
    assert [r["step"] for r in rows(tmp_path / "reference" / second) if "loss" in r] == list(range(1, 17))

    killed = sweep(tmp_path / "sweep", kill="saved:10")  # after step 10's checkpoint of the second run (16 steps)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    finished = (tmp_path / "sweep" / first / "metrics.jsonl").stat().st_mtime_ns
    assert rows(tmp_path / "sweep" / first) == rows(tmp_path / "reference" / first)

    again = sweep(tmp_path / "sweep")
    assert again.returncode == 0, again.stderr
    assert f"{first}: finished" in again.stdout and f"{second}: finished" not in again.stdout
    assert (tmp_path / "sweep" / first / "metrics.jsonl").stat().st_mtime_ns == finished  # not trained again
    assert f"resumed from step 10 in {tmp_path / 'sweep' / second}" in again.stderr
    for name in (first, second):  # every row once, the losses and validation losses bit for bit
        assert rows(tmp_path / "sweep" / name) == rows(tmp_path / "reference" / name)
    assert sweep(tmp_path / "sweep").stdout.count(": finished") == 2  # a third time trains nothing


@pytest.mark.slow
def test_check_predicts_before_it_trains_and_only_once(tmp_path, monkeypatch, capsys):
    """On a synthetic sweep of tiny shapes (base: scaling.toml at 32 tokens on the fixture corpus), `check`
    writes its prediction, then trains the size it picked, then reports; run again, it neither refits nor trains."""
    runs = str(tmp_path / "runs")
    base = scaling.write_base(runs, scaling.CONFIG, TINY_KEYS)
    # EVEN's N_opt at 1.5e9 is 25k, 2x32's N: 19 steps of it
    fake_sweep(runs, EVEN, [3e8, 1e9], [(1, 16), (2, 16), (1, 32), (2, 32)], base)
    prediction = os.path.join(runs, "prediction_c1.5e09.json")
    trained = []

    def train_point(base_file, point, out):
        assert os.path.exists(prediction)  # made before the run it predicts
        trained.append(point)
        return real(base_file, point, out)

    real = scaling.train_point
    monkeypatch.setattr(scaling, "train_point", train_point)
    assert scaling.main(["check", runs, "--budget", "1.5e9", "--bootstrap", "10"]) == 0
    out = capsys.readouterr().out
    with open(prediction) as f:
        made = json.load(f)
    (point,) = trained
    assert point.role == "check" and made["point"] == dataclasses.asdict(point) and len(made["fitted_on"]) == 8
    assert (point.n_layers, point.d_model) == (2, 32) and abs(made["n_opt"] / 25_000 - 1) < 0.2
    assert made["measured"] == scaling.final_loss(os.path.join(runs, point.name), point.steps)
    assert f"| measured | {made['measured']:.4f} |" in out and f"{made['predicted']:.4f}" in out
    ran = os.stat(os.path.join(runs, point.name, "metrics.jsonl")).st_mtime_ns

    assert scaling.main(["check", runs, "--budget", "1.5e9", "--bootstrap", "10"]) == 0
    with open(prediction) as f:
        assert json.load(f) == made  # not fitted again
    assert os.stat(os.path.join(runs, point.name, "metrics.jsonl")).st_mtime_ns == ran  # not trained again
    assert scaling.main(["fit", runs, "--bootstrap", "10"]) == 0  # the check's run is drawn, not fitted
    assert "8 runs;" in capsys.readouterr().out
