"""Scaling laws, empirically: a sweep of model sizes × compute budgets, a fit of L(N, D), and a prediction
checked by a run.

    python -m tools.studies.scaling run [--config FILE] [--sizes 2x32 2x48 ...] [--budgets 3e11 1e12 ...]
                                [--out DIR] [--dry-run] [key=value ...]
    python -m tools.studies.scaling fit RUNS_DIR [--plots DIR] [--bootstrap N]
    python -m tools.studies.scaling check RUNS_DIR [--budget C] [--bootstrap N]

`run` trains one ordinary `jaxllm train` run directory per (size, budget) under `--out`, one after
another in this process, smallest budget first: a size LAYERSxWIDTH sets model.n_layers and
model.d_model (and the heads and d_ff, keeping the base config's head width and d_ff/d_model); a budget
C in FLOPs sets train.steps from C = 6·N·D, D = steps · global_batch · seq_len tokens. N counts the
parameters WITHOUT the embeddings (token and position tables, output head), as Kaplan et al. (2020) and
Hoffmann et al. (2022) do, so 6·N·D leaves out the attention scores and the head's matmul. The
learning-rate schedule is each run's own (cosine over its steps, warm-up train.warmup_ratio of them), and
every run is validated at its last step on the same held-out windows (train.eval_batches fixed batches
spread over the validation split). The command can be run again: a finished run is not trained again,
an interrupted one resumes from its newest checkpoint.

`fit` fits approach 3 and approach 2 (`tools/studies/scaling_fit.py`) to the finished runs, prints the exponents
with bootstrap intervals and the compute-optimal N(C) and D(C), and draws three PNGs (tables and plots:
`tools/studies/scaling_report.py`). `check` fits the runs below budget C, predicts the loss at C of the size the
fit calls optimal (written to RUNS_DIR/prediction_<C>.json before the run, and kept if the check is
resumed), trains that run, and prints predicted against measured. Bad input is one line `error: ...`
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass

from jaxllm.config import CONFIG_DIR
from jaxllm.errors import run
from jaxllm.errors import UserError
from tools.studies import scaling_fit, scaling_report
from tools.studies.scaling_report import N_NOTE

CONFIG = os.path.join(CONFIG_DIR, "scaling.toml")
SIZES = ("2x32", "2x48", "3x64", "3x96", "4x128")  # the shipped study: N from 26k to 0.8M
BUDGETS = (3e11, 1e12, 3e12)
CHECK_BUDGET = 6e12


@dataclass(frozen=True)
class Point:
    """One run of the sweep (or the check): its shape, budget and what the budget makes of it."""
    role: str  # sweep | check
    n_layers: int
    d_model: int
    budget: float  # the nominal C, FLOPs
    n_params: int  # N, without embeddings
    steps: int
    tokens: int  # D = steps · global_batch · seq_len
    flops_over_6n: float = 0.0  # the FLOPs of a token as the log's MFU counts them (attention, head) over 6·N

    @property
    def name(self) -> str:
        prefix = "check_" if self.role == "check" else ""
        return f"{prefix}c{self.budget:g}_{self.n_layers}x{self.d_model}".replace("+", "")

    @property
    def flops(self) -> float:
        return 6.0 * self.n_params * self.tokens


def parse_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match or min(map(int, match.groups())) < 1:
        raise UserError(f"--sizes: '{text}' is not LAYERSxWIDTH, e.g. 2x64")
    return int(match[1]), int(match[2])


def parse_budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise UserError(f"a budget: '{text}' is not a positive number of FLOPs, e.g. 1e12")
    return value


# ---------------------------------------------------------------- the points


def size_keys(base, n_layers: int, d_model: int) -> dict:
    """The model keys of one size: the base config's head width and d_ff/d_model kept (and its share of KV
    heads, 0 staying 0)."""
    m = base.model
    head = m.head_dim or m.d_model // m.n_heads
    if d_model % head:
        raise UserError(f"--sizes: width {d_model} is not a multiple of the base config's head width {head}")
    heads = d_model // head
    kv = m.n_kv_heads and max(1, heads * m.n_kv_heads // m.n_heads)
    return {"model.n_layers": n_layers, "model.d_model": d_model, "model.n_heads": heads, "model.n_kv_heads": kv,
            "model.d_ff": round(d_model * m.d_ff / m.d_model)}


def point_config(base_file: str, keys: dict):
    """The base config with `keys`, resolved (vocabulary from the tokenizer) and validated on these devices."""
    from jaxllm.config import build_config
    from jaxllm.trainer.loop import resolve

    cfg = build_config(base_file, keys)
    resolve(cfg)
    return cfg


def plan(base_file: str, size: tuple[int, int], budget: float, role: str = "sweep") -> Point:
    """The point of `size` at `budget`: N without embeddings, steps = round(C / (6·N·tokens per step)), at least 1."""
    from jaxllm.config import build_config
    from jaxllm.models.transformer import count_params
    from jaxllm.trainer.loop import flops_per_token

    cfg = point_config(base_file, size_keys(build_config(base_file), *size))
    n = count_params(cfg.model, embeddings=False)
    per_step = cfg.train.global_batch * cfg.model.seq_len
    steps = max(1, round(budget / (6 * n * per_step)))
    return Point(role, *size, budget, n, steps, steps * per_step, flops_per_token(cfg) / (6 * n))


def run_keys(base_file: str, point: Point, run_dir: str) -> dict:
    """What a point's run sets over the base: its size and steps, a schedule as long as its steps, validation
    at its last step, its run directory, and resume (a run with no checkpoint yet starts at step 0)."""
    from jaxllm.config import build_config

    keys = size_keys(build_config(base_file), point.n_layers, point.d_model)
    return {**keys, "train.steps": point.steps, "train.schedule_steps": 0, "train.eval_every": point.steps,
            "run.dir": run_dir, "train.resume": True}


def final_loss(run_dir: str, steps: int) -> float | None:
    """The validation loss a run logged at step `steps` (None: not finished)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip().endswith("}")]
    except FileNotFoundError:
        return None
    losses = [r["val_loss"] for r in rows if "val_loss" in r and r["step"] == steps]
    return losses[-1] if losses else None


def train_point(base_file: str, point: Point, out: str) -> float:
    """Train a point's run directory unless it is finished; its final validation loss."""
    from jaxllm.trainer.loop import train

    run_dir = os.path.join(out, point.name)
    done = final_loss(run_dir, point.steps)
    if done is not None:
        print(f"{point.name}: finished, val_loss {done:.4f}", flush=True)
        return done
    print(f"{point.name}: N={point.n_params:,} D={point.tokens:,} steps={point.steps} C={point.flops:.3g}", flush=True)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "point.json"), "w") as f:
        json.dump({**asdict(point), "flops": point.flops, "note": N_NOTE}, f, indent=1)
    cfg = point_config(base_file, run_keys(base_file, point, run_dir))
    train(cfg)
    return final_loss(run_dir, point.steps)


# ---------------------------------------------------------------- the sweep


def write_base(out: str, config: str, overrides: list[str]) -> str:
    """RUNS_DIR/base.toml: the resolved base config every point is built from. A sweep continued with another
    base is refused (compared as configs, so keys added to jaxllm since, at their defaults, do not count)."""
    from jaxllm.config import build_config, to_dict, to_toml

    cfg = build_config(config, overrides)
    path = os.path.join(out, "base.toml")
    if os.path.exists(path):
        if to_dict(build_config(path)) != to_dict(cfg):
            raise UserError(f"{out} holds a sweep of another base config (its base.toml); give the same "
                            "--config and key=value overrides, or another --out")
        return path
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        f.write(to_toml(cfg))
    return path


def sweep(args) -> None:
    sizes = [parse_size(s) for arg in args.sizes for s in arg.split(",") if s]
    budgets = sorted(parse_budget(b) for arg in args.budgets for b in arg.split(",") if b)
    if args.dry_run:  # nothing written to --out
        with tempfile.TemporaryDirectory() as tmp:
            points = plan_grid(write_base(tmp, args.config, args.overrides), sizes, budgets)
    else:
        base = write_base(args.out, args.config, args.overrides)
        points = plan_grid(base, sizes, budgets)
    print(f"{len(points)} runs in {args.out}; {N_NOTE}")
    print(table(points, {}))
    if not args.dry_run:
        losses = {p.name: train_point(base, p, args.out) for p in points}
        print(table(points, losses))


def plan_grid(base_file: str, sizes, budgets) -> list[Point]:
    """Every size at every budget, smallest budget first, then smallest N (all validated before any training)."""
    return sorted((plan(base_file, s, b) for b in budgets for s in sizes), key=lambda p: (p.budget, p.n_params))


def table(points: list[Point], losses: dict) -> str:
    rows = ["| run | layers × width | N | budget C | D (tokens) | D/N | steps | model FLOPs / 6N | val loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        loss = losses.get(p.name)
        rows.append(f"| {p.name} | {p.n_layers} × {p.d_model} | {p.n_params:,} | {p.budget:.3g} | {p.tokens:,} | "
                    f"{p.tokens / p.n_params:.1f} | {p.steps} | {p.flops_over_6n:.2f} | "
                    f"{'' if loss is None else f'{loss:.4f}'} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- reading a sweep


def load_points(runs_dir: str) -> list[dict]:
    """The finished runs under `runs_dir`: point.json with `loss` (the final validation loss), `name`, and
    `curve` (tokens and training loss of each logged step)."""
    if not os.path.isdir(runs_dir):
        raise UserError(f"{runs_dir}: no such directory; give the --out of `python -m tools.studies.scaling run`")
    points, unfinished = [], []
    for name in sorted(os.listdir(runs_dir)):
        path = os.path.join(runs_dir, name, "point.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            p = json.load(f)
        loss = final_loss(os.path.dirname(path), p["steps"])
        if loss is None:
            unfinished.append(name)
            continue
        points.append({**p, "name": name, "loss": loss, "curve": curve(os.path.dirname(path), p)})
    points.sort(key=lambda p: (p["budget"], p["n_params"]))
    if not points:
        raise UserError(f"{runs_dir}: no finished runs ({len(unfinished)} unfinished); a run is finished when it "
                        "has logged the validation loss of its last step: "
                        "run `python -m tools.studies.scaling run` first")
    return points


def curve(run_dir: str, point: dict) -> list[tuple[int, float]]:
    """(tokens, training loss) of each logged step of a run."""
    per_step = point["tokens"] // point["steps"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip().endswith("}")]
    return [(r["step"] * per_step, r["loss"]) for r in rows if "loss" in r]


def enough(points: list[dict], where: str) -> None:
    """Both fits need at least 3 sizes at each of at least 2 budgets (approach 3's five unknowns, approach 2's
    parabolas and the line through their minima)."""
    sizes = {b: len({p["n_params"] for p in points if p["budget"] == b}) for b in {p["budget"] for p in points}}
    if sum(k >= 3 for k in sizes.values()) < 2:
        have = ", ".join(f"{k} at {b:.3g}" for b, k in sorted(sizes.items())) or "none"
        raise UserError(f"{where}: too few finished runs to fit (sizes per budget: {have}); the fit needs at "
                        "least 3 sizes at each of at least 2 budgets")


# ---------------------------------------------------------------- fit and check


def _check_bootstrap(n: int) -> None:
    if n < 2:
        raise UserError(f"--bootstrap: {n} resamples cannot make an interval; give at least 2 (200 by default)")


def fit(args) -> None:
    _check_bootstrap(args.bootstrap)
    everything = load_points(args.runs_dir)
    points = [p for p in everything if p["role"] == "sweep"]
    enough(points, args.runs_dir)
    result = scaling_fit.analyse(points, args.bootstrap)
    checks = [p for p in everything if p["role"] == "check"]
    print(scaling_report.report(points, result, sorted({p["budget"] for p in points} | {p["budget"] for p in checks})))
    out = args.plots or args.runs_dir
    os.makedirs(out, exist_ok=True)
    predictions = [_prediction(args.runs_dir, p["budget"]) for p in checks]
    for path in scaling_report.draw(points, result, [p for p in predictions if p], out):
        print(f"plot: {path}")
    with open(os.path.join(args.runs_dir, "fit.json"), "w") as f:
        json.dump(scaling_report.summary(result), f, indent=1)


def check(args) -> None:
    budget = parse_budget(args.budget)
    _check_bootstrap(args.bootstrap)
    base = os.path.join(args.runs_dir, "base.toml")
    if not os.path.isfile(base):
        raise UserError(f"{args.runs_dir}: no base.toml; give the --out of `python -m tools.studies.scaling run`")
    prediction = _prediction(args.runs_dir, budget)
    if prediction is None:  # made once, before the run it predicts
        prediction = predict_run(args.runs_dir, base, budget, args.bootstrap)
        _write_prediction(args.runs_dir, prediction)
    point = Point(**prediction["point"])
    prediction["measured"] = train_point(base, point, args.runs_dir)
    _write_prediction(args.runs_dir, prediction)
    print(scaling_report.check_report(prediction))


def predict_run(runs_dir: str, base: str, budget: float, n_boot: int) -> dict:
    """Fit the sweep's runs below `budget`, pick the shape nearest approach 3's N_opt(budget), and predict its
    final validation loss (with the bootstrap fits' 95% interval)."""
    points = [p for p in load_points(runs_dir) if p["role"] == "sweep" and p["budget"] < budget]
    enough(points, f"{runs_dir} below {budget:.3g} FLOPs")
    result = scaling_fit.analyse(points, n_boot)
    surface, iso = result["surface"], result["isoflop"]
    n_opt = float(scaling_fit.compute_optimal(surface, budget)[0])
    point = plan(base, nearest_shape(base, points, n_opt), budget, "check")
    boot = [float(scaling_fit.predict(f, point.n_params, point.tokens)) for f in result["surface_boot"]]
    return {"budget": budget, "fitted_on": [p["name"] for p in points], "n_opt": n_opt,
            "n_opt_isoflop": iso and float(scaling_fit.isoflop_n_opt(iso, budget)), "point": asdict(point),
            "predicted": float(scaling_fit.predict(surface, point.n_params, point.tokens)),
            "interval": scaling_fit.interval(boot), "fit": {k: surface[k] for k in ("E", "A", "B", "alpha", "beta")}}


def nearest_shape(base: str, points: list[dict], n_opt: float) -> tuple[int, int]:
    """The depth of the sweep's size nearest N_opt (in log N), and the width (a multiple of the head width, up to
    four times the sweep's widest) whose N is nearest N_opt."""
    from jaxllm.config import build_config

    near = min(points, key=lambda p: abs(math.log(p["n_params"] / n_opt)))
    m = build_config(base).model
    head = m.head_dim or m.d_model // m.n_heads
    widths = range(head, 4 * max(p["d_model"] for p in points) + 1, head)
    return min(((near["n_layers"], w) for w in widths),
               key=lambda s: abs(math.log(plan(base, s, 1.0).n_params / n_opt)))


def budget_label(budget: float) -> str:
    return f"c{budget:g}".replace("+", "")


def _prediction(runs_dir: str, budget: float) -> dict | None:
    path = os.path.join(runs_dir, f"prediction_{budget_label(budget)}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_prediction(runs_dir: str, prediction: dict) -> None:
    with open(os.path.join(runs_dir, f"prediction_{budget_label(prediction['budget'])}.json"), "w") as f:
        json.dump(prediction, f, indent=1)


# ---------------------------------------------------------------- the command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.studies.scaling", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the sweep's runs (again: finished ones are kept, others resume)")
    run.add_argument("--config", default=CONFIG, help=f"base config (default {os.path.relpath(CONFIG)})")
    run.add_argument("--sizes", nargs="+", default=list(SIZES), help="LAYERSxWIDTH ... (default: the shipped study)")
    run.add_argument("--budgets", nargs="+", default=[f"{b:g}" for b in BUDGETS], help="FLOPs, C = 6·N·D")
    run.add_argument("--out", default="runs/scaling", help="where the run directories go")
    run.add_argument("--dry-run", action="store_true", help="print the runs' N, D and steps, train nothing")
    for name, text in (("fit", "fit L(N, D) and the iso-FLOP minima to the finished runs"),
                       ("check", "predict the loss of a larger budget's optimal size, train it, compare")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("runs_dir")
        cmd.add_argument("--bootstrap", type=int, default=200, help="resamples for the intervals (at least 2)")
        if name == "fit":
            cmd.add_argument("--plots", default=None, help="where the PNGs go (default RUNS_DIR)")
        else:
            cmd.add_argument("--budget", default=f"{CHECK_BUDGET:g}", help="the larger budget, FLOPs")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    for name in ("sizes", "budgets") if args.command == "run" else ():  # key=value after a list joins the list
        values = getattr(args, name)
        extra += [v for v in values if "=" in v]
        setattr(args, name, [v for v in values if "=" not in v])
    if extra and (args.command != "run" or any("=" not in e or e.startswith("-") for e in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    commands = {"run": sweep, "fit": fit, "check": check}
    return run(lambda: commands[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
