"""What `python -m tools.studies.scaling fit` and `check` print and draw: markdown tables and three PNGs.

- `scaling_loss_vs_tokens.png`: per size, the training loss of its longest run against tokens (thin), the final
  validation loss of each of its runs (dots) and approach 3's L(N, D) along D (dashed);
- `scaling_isoflop.png`: per budget, the validation loss against N (dots), the parabola of approach 2 with its
  minimum (star) and approach 3's L(N, C/6N) (dashed); a check run's prediction (open) and measurement (filled);
- `scaling_frontier.png`: the compute-optimal N against C (approach 2's minima and power law, approach 3's
  N_opt(C) with its bootstrap band), and the loss along approach 3's frontier against C, every run and
  a check's prediction and measurement beside it.
"""

from __future__ import annotations

import os

import numpy as np

from tools.studies import scaling_fit

SMOOTH = 5  # logged rows averaged in the training-loss curves
N_NOTE = "N counts parameters without embeddings (token and position tables, output head); C = 6·N·D"


def _si(x: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _ci(ci: list[float], fmt: str = ".3g") -> str:
    return f"[{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def report(points: list[dict], result: dict, budgets: list[float]) -> str:
    s, ci, n = result["surface"], result["surface_ci"], len(result["surface_boot"])
    lines = [f"{len(points)} runs; {N_NOTE}; losses are validation losses in nats per token.", "",
             f"Approach 3, L(N, D) = E + A/N^α + B/D^β (Huber δ = {scaling_fit.DELTA:g} on log L; 95% intervals "
             f"from {n} bootstrap resamples of the runs):", "", "| | fit | 95% interval |", "|---|---|---|"]
    names = {"E": "E", "A": "A", "B": "B", "alpha": "α", "beta": "β", "a": "a = β/(α+β): N_opt ∝ C^a",
             "b": "b = α/(α+β): D_opt ∝ C^b"}
    lines += [f"| {label} | {s[k]:.3g} | {_ci(ci[k])} |" for k, label in names.items()]
    lines += ["", *isoflop_table(result), "", "Compute-optimal allocation:", "",
              "| C | N_opt (approach 3) | D_opt (approach 3) | D/N | L(N_opt, D_opt) | N_opt (approach 2) |",
              "|---|---|---|---|---|---|"]
    iso = result["isoflop"]
    for c in budgets:
        n_opt, d_opt = (float(v) for v in scaling_fit.compute_optimal(s, c))
        two = _si(float(scaling_fit.isoflop_n_opt(iso, c))) if iso else "–"
        lines.append(f"| {c:.3g} | {_si(n_opt)} | {_si(d_opt)} | {d_opt / n_opt:.1f} | "
                     f"{float(scaling_fit.predict(s, n_opt, d_opt)):.4f} | {two} |")
    lines += ["", "| run | N | D | loss | approach 3 | residual |", "|---|---|---|---|---|---|"]
    for p in points:
        fitted = float(scaling_fit.predict(s, p["n_params"], p["tokens"]))
        lines.append(f"| {p['name']} | {p['n_params']:,} | {p['tokens']:,} | {p['loss']:.4f} | {fitted:.4f} | "
                     f"{100 * (p['loss'] / fitted - 1):+.2f}% |")
    return "\n".join(lines)


def isoflop_table(result: dict) -> list[str]:
    iso = result["isoflop"]
    if iso is None:
        return ["Approach 2: fewer than two budgets have a parabola with a minimum."]
    lines = [f"Approach 2, at each budget a parabola in log N through the lowest-loss size and up to "
             f"{scaling_fit.WINDOW} sizes on each side:", "",
             "| budget C | sizes fitted (N) | N_opt | D_opt | D/N | loss at the minimum | minimum within them |",
             "|---|---|---|---|---|---|---|"]
    for c, m in iso["minima"].items():
        d_opt = c / 6 / m["n_opt"]
        lines.append(f"| {c:.3g} | {', '.join(map(_si, m['sizes']))} | {_si(m['n_opt'])} | {_si(d_opt)} | "
                     f"{d_opt / m['n_opt']:.1f} | {m['loss']:.4f} | {'yes' if m['inside'] else 'no'} |")
    ci = result["isoflop_ci"]
    lines.append(f"| a: N_opt ∝ C^a | {iso['a']:.3g} {_ci(ci['a']) if ci else ''} | | | | | |")
    return lines


def check_report(pr: dict) -> str:
    p, lo_hi = pr["point"], pr["interval"]
    two = f" (approach 2's: {_si(pr['n_opt_isoflop'])})" if pr.get("n_opt_isoflop") else ""
    error = pr["measured"] - pr["predicted"]
    return "\n".join([
        f"Check at C = {pr['budget']:.3g} FLOPs, fitted on the {len(pr['fitted_on'])} runs below it: approach 3's "
        f"N_opt = {_si(pr['n_opt'])}{two}; the run: {p['n_layers']} × {p['d_model']}, N = {p['n_params']:,}, "
        f"D = {p['tokens']:,} tokens ({p['steps']} steps)", "",
        "| | validation loss |", "|---|---|",
        f"| predicted (approach 3; 95% bootstrap interval) | {pr['predicted']:.4f} {_ci(lo_hi, '.4f')} |",
        f"| measured | {pr['measured']:.4f} |",
        f"| measured − predicted | {error:+.4f} ({100 * error / pr['predicted']:+.2f}%) |"])


def summary(result: dict) -> dict:
    """fit.json: the fits and their intervals (not the resamples)."""
    iso = result["isoflop"]
    return {"note": N_NOTE, "surface": {k: v for k, v in result["surface"].items() if k != "theta"},
            "surface_ci": result["surface_ci"], "resamples": len(result["surface_boot"]),
            "isoflop": iso and {"a": iso["a"], "k": float(scaling_fit.isoflop_n_opt(iso, 1.0)),
                                "ci": result["isoflop_ci"],
                                "minima": {f"{c:g}": m for c, m in iso["minima"].items()}}}


# ---------------------------------------------------------------- the plots


def draw(points: list[dict], result: dict, checks: list[dict], out: str) -> list[str]:
    """The three PNGs in `out` (checks: predictions with `measured`); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    paths = []
    for name, plot in (("loss_vs_tokens", _loss_vs_tokens), ("isoflop", _isoflop), ("frontier", _frontier)):
        fig = plot(plt, points, result, checks)
        paths.append(os.path.join(out, f"scaling_{name}.png"))
        for ax in fig.axes:  # labels at the decades only (a log axis also labels minor ticks over short ranges)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths


def _colors(plt, keys) -> dict:
    cmap = plt.get_cmap("viridis")
    keys = sorted(keys)
    return {k: cmap(i / max(len(keys) - 1, 1) * 0.9) for i, k in enumerate(keys)}


def _loss_vs_tokens(plt, points, result, checks):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = {(p["n_layers"], p["d_model"]): p["n_params"] for p in points}
    colors = _colors(plt, sizes.values())
    for (layers, width), n in sorted(sizes.items(), key=lambda kv: kv[1]):
        mine = sorted((p for p in points if p["n_params"] == n), key=lambda p: p["tokens"])
        trained = mine[-1]["curve"][1:]  # the first row is the untrained model's loss
        if len(trained) >= SMOOTH:  # one batch's loss is noisy: a moving mean over SMOOTH logged rows
            tokens, loss = (np.array(v, float) for v in zip(*trained))
            mean = np.convolve(loss, np.ones(SMOOTH) / SMOOTH, mode="valid")
            ax.plot(tokens[SMOOTH - 1:], mean, lw=0.7, alpha=0.6, color=colors[n])
        ax.plot([p["tokens"] for p in mine], [p["loss"] for p in mine], "o", color=colors[n],
                label=f"{layers} × {width}, N = {_si(n)}")
        d = np.geomspace(min(p["tokens"] for p in points) / 2, mine[-1]["tokens"] * 2, 50)
        ax.plot(d, scaling_fit.predict(result["surface"], n, d), "--", color=colors[n], lw=1)
    ax.set_xscale("log")
    ax.set_ylim(top=max(p["loss"] for p in points) + 0.3)
    ax.set_xlabel("tokens D")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"Loss against tokens: training ({SMOOTH}-row mean, thin), final validation (dots), "
                 "L(N, D) fit (dashed)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def _isoflop(plt, points, result, checks):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets = sorted({p["budget"] for p in points})
    colors = _colors(plt, budgets)
    minima = (result["isoflop"] or {}).get("minima", {})
    n_all = [p["n_params"] for p in points]
    for c in budgets:
        mine = [p for p in points if p["budget"] == c]
        ax.plot([p["n_params"] for p in mine], [p["loss"] for p in mine], "o", color=colors[c], label=f"C = {c:.3g}")
        n = np.geomspace(min(n_all) / 1.5, max(n_all) * 1.5, 80)
        ax.plot(n, scaling_fit.predict(result["surface"], n, c / 6 / n), "--", color=colors[c], lw=1)
        if c in minima:  # the parabola over the sizes it was fitted to
            near = np.geomspace(min(minima[c]["sizes"]) / 1.3, max(minima[c]["sizes"]) * 1.3, 40)
            ax.plot(near, np.polyval(minima[c]["coef"], np.log(near)), "-", color=colors[c], lw=1.2, alpha=0.8)
            ax.plot(minima[c]["n_opt"], minima[c]["loss"], "*", ms=12, color=colors[c], mec="k")
    for ch in checks:
        ax.errorbar(ch["point"]["n_params"], ch["predicted"], yerr=_yerr(ch), fmt="o", mfc="none", color="r",
                    label=f"check C = {ch['budget']:.3g}: predicted")
        if ch.get("measured") is not None:
            ax.plot(ch["point"]["n_params"], ch["measured"], "X", ms=9, color="r", label="check: measured")
    ax.set_xscale("log")
    ax.set_ylim(top=max(p["loss"] for p in points) + 0.1)
    ax.set_xlabel("N (parameters without embeddings)")
    ax.set_ylabel("validation loss")
    ax.set_title("Iso-FLOP curves: runs (dots), parabola in log N near the lowest (solid) and its minimum "
                 "(star), L(N, C/6N) fit (dashed)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def _yerr(check: dict) -> list[list[float]]:
    lo, hi = check["interval"]
    return [[check["predicted"] - lo], [hi - check["predicted"]]]


def _frontier(plt, points, result, checks):
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    s, iso = result["surface"], result["isoflop"]
    budgets = [p["budget"] for p in points] + [c["budget"] for c in checks]
    c = np.geomspace(min(budgets) / 2, max(budgets) * 2, 60)
    band = np.array([scaling_fit.compute_optimal(f, c)[0] for f in result["surface_boot"]])
    left.plot(c, scaling_fit.compute_optimal(s, c)[0], "-", color="C0", label=f"approach 3: a = {s['a']:.2f}")
    left.fill_between(c, *scaling_fit.interval(band, axis=0), color="C0", alpha=0.2, label="95% bootstrap")
    if iso:
        cs = list(iso["minima"])
        left.plot(cs, [m["n_opt"] for m in iso["minima"].values()], "s", color="C1", label="approach 2: minima")
        left.plot(c, scaling_fit.isoflop_n_opt(iso, c), "--", color="C1", label=f"approach 2: a = {iso['a']:.2f}")
    for ch in checks:
        left.plot(ch["budget"], ch["point"]["n_params"], "X", ms=9, color="r", label="check run's size")
    left.set(xscale="log", yscale="log", xlabel="C (FLOPs, 6ND)", ylabel="compute-optimal N")
    n_opt, d_opt = scaling_fit.compute_optimal(s, c)
    right.plot([p["flops"] for p in points], [p["loss"] for p in points], "o", color="0.6", ms=4, label="runs")
    right.plot(c, scaling_fit.predict(s, n_opt, d_opt), "-", color="C0", label="L(N_opt, D_opt), approach 3")
    for ch in checks:
        right.errorbar(ch["budget"], ch["predicted"], yerr=_yerr(ch), fmt="o", mfc="none", color="r",
                       label="check: predicted")
        if ch.get("measured") is not None:
            right.plot(ch["budget"], ch["measured"], "X", ms=9, color="r", label="check: measured")
    right.set(xscale="log", xlabel="C (FLOPs, 6ND)", ylabel="validation loss")
    ticks = sorted(set(budgets))
    for ax in (left, right):
        ax.set_xticks(ticks, [f"{t:.2g}".replace("e+", "e") for t in ticks])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("The compute-optimal frontier", fontsize=10)
    return fig
