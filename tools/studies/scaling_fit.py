"""The fits of a scaling-law sweep (`tools/studies/scaling.py`): numbers in, numbers out, no files and no JAX.

- Approach 3 of Hoffmann et al. (2022, "Chinchilla"): L(N, D) = E + A/N^α + B/D^β, fitted as they did:
  the Huber loss (δ = 1e-3) between the predicted and measured log-loss, the prediction written as
  log L = LSE(a − α log N, b − β log D, e) with A = e^a, B = e^b, E = e^e, and L-BFGS (here BFGS) from a grid of
  initialisations (theirs: α, β ∈ {0, 0.5, ..., 2}, e ∈ {−1, −0.5, ..., 1}, a, b ∈ {0, 5, ..., 25}). The
  grid's objective is evaluated at all 4,500 points at once and the optimizer runs from the best few (they
  ran it from every one: the same minimum here, in a fraction of the time); a bootstrap resample starts
  from the full data's optimum, and from a grid point only if that is better still. The optimizer is
  BFGS, L-BFGS without the memory limit (five unknowns): scipy's L-BFGS-B calls OpenBLAS, whose threads
  made each fit about 80 times slower on a 2-core machine busy with other work.
- Approach 2: at each budget C, a parabola in log N fitted to the losses, as Chinchilla did, but only of
  the lowest-loss size and up to WINDOW sizes on each side of it; its minimum is N_opt(C); then the power
  law N_opt = k·C^a by least squares in log-log (and D_opt = C/(6·N_opt), so D_opt ∝ C^(1−a)), over the
  budgets whose minimum lies within the sizes fitted.
- Bootstrap intervals: the fits repeated on points resampled with replacement (approach 2 within
  each budget, so every budget keeps its count), the 2.5th and 97.5th percentiles reported.

A point is a dict with `n_params` (N, without embeddings), `tokens` (D), `budget` (the nominal C) and
`loss` (the final validation loss).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.optimize import minimize

DELTA = 1e-3  # Chinchilla's Huber δ, on the log-loss
GRID = np.array(list(itertools.product(
    (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),  # a = log A
    (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),  # b = log B
    (-1.0, -0.5, 0.0, 0.5, 1.0),  # e = log E
    (0.0, 0.5, 1.0, 1.5, 2.0),  # α
    (0.0, 0.5, 1.0, 1.5, 2.0),  # β
)))
STARTS = 4  # BFGS runs from this many of the grid's best points
WINDOW = 2  # approach 2's parabola: the lowest-loss size and up to this many sizes on each side of it
LEVEL = 95  # bootstrap intervals: the central LEVEL %


# ---------------------------------------------------------------- approach 3: L(N, D) = E + A/N^α + B/D^β


def _terms(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """The three terms of LSE, [3, ..., points]; theta [..., 5] = (a, b, e, α, β)."""
    a, b, e, alpha, beta = (theta[..., i, None] for i in range(5))
    return np.stack(np.broadcast_arrays(a - alpha * log_n, b - beta * log_d, e))


def _huber(r: np.ndarray) -> np.ndarray:
    """Huber's loss divided by δ (the same minimum; gradients of order one, as the optimizer's tolerances expect)."""
    small = np.abs(r) <= DELTA
    return np.where(small, 0.5 * r * r / DELTA, np.abs(r) - 0.5 * DELTA)


def _objective(theta: np.ndarray, log_n, log_d, log_l) -> tuple[float, np.ndarray]:
    """The summed Huber loss of the log-loss residuals and its gradient in (a, b, e, α, β)."""
    t = _terms(theta, log_n, log_d)
    top = t.max(axis=0)
    w = np.exp(t - top)
    total = w.sum(axis=0)
    r = top + np.log(total) - log_l
    w /= total  # d LSE / d term
    g = np.clip(r, -DELTA, DELTA) / DELTA  # d huber / d r
    grad = np.array([(g * w[0]).sum(), (g * w[1]).sum(), (g * w[2]).sum(),
                     -(g * w[0] * log_n).sum(), -(g * w[1] * log_d).sum()])
    return float(_huber(r).sum()), grad


def _grid_values(log_n, log_d, log_l) -> np.ndarray:
    """The objective at every grid point at once."""
    t = _terms(GRID, log_n, log_d)  # [3, grid, points]
    top = t.max(axis=0)
    r = top + np.log(np.exp(t - top).sum(axis=0)) - log_l
    return _huber(r).sum(axis=-1)


def fit_surface(n, d, loss, starts: int = STARTS, warm=None) -> dict:
    """Approach 3 on points (N, D, loss): {E, A, B, alpha, beta, objective, theta}, from the grid's `starts` best
    points. With `warm` (a, b, e, α, β: the bootstrap passes the full data's optimum) it starts there, and
    from a grid point only where that point is already better than the minimum found from `warm`."""
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    values = _grid_values(log_n, log_d, log_l)
    best = None
    if warm is not None:
        best = minimize(_objective, np.asarray(warm, float), args=(log_n, log_d, log_l), jac=True, method="BFGS")
    for i in np.argsort(values)[:starts]:
        if best is not None and warm is not None and values[i] >= best.fun:
            break
        res = minimize(_objective, GRID[i], args=(log_n, log_d, log_l), jac=True, method="BFGS")
        if best is None or res.fun < best.fun:
            best = res
    a, b, e, alpha, beta = best.x
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": float(alpha), "beta": float(beta),
            "objective": float(best.fun), "theta": [float(v) for v in best.x]}


def predict(fit: dict, n, d):
    """L(N, D) = E + A/N^α + B/D^β."""
    return fit["E"] + fit["A"] / np.power(n, fit["alpha"]) + fit["B"] / np.power(d, fit["beta"])


def compute_optimal(fit: dict, c):
    """(N_opt, D_opt) minimising L(N, D) subject to 6·N·D = C: N_opt = G·(C/6)^(β/(α+β)), D_opt = (C/6)/N_opt
    with G = (αA / βB)^(1/(α+β)) (Hoffmann et al. 2022, eq. 4)."""
    alpha, beta = fit["alpha"], fit["beta"]
    c = np.asarray(c, float)
    if alpha <= 0 or beta <= 0:  # a loss that does not fall with N or with D has no optimum: NaN
        return np.full_like(c, np.nan), np.full_like(c, np.nan)
    g = (alpha * fit["A"] / (beta * fit["B"])) ** (1 / (alpha + beta))
    n = g * np.power(c / 6, beta / (alpha + beta))
    return n, c / 6 / n


# ---------------------------------------------------------------- approach 2: iso-FLOP minima


def parabola(log_n, loss):
    """(c2, c1, c0) of loss ≈ c2·x² + c1·x + c0 in x = log N, or None where there is no minimum (c2 ≤ 0 or
    fewer than three sizes)."""
    if len(set(np.round(log_n, 9))) < 3:
        return None
    coef = np.polyfit(log_n, loss, 2)
    return coef if coef[0] > 0 else None


def near_minimum(points: list[dict]) -> list[dict]:
    """The points of one budget whose size is the lowest-loss run's or one of the WINDOW sizes on either side
    of it: a parabola describes the curve near its minimum, and runs far out on the arms (a tenth of a
    token per parameter) would tilt it."""
    sizes = sorted({p["n_params"] for p in points})
    at = sizes.index(min(points, key=lambda p: p["loss"])["n_params"])
    keep = set(sizes[max(0, at - WINDOW):at + WINDOW + 1])
    return [p for p in points if p["n_params"] in keep]


def isoflop_minima(points: list[dict]) -> dict[float, dict]:
    """Per budget with a minimum: {budget: {n_opt, loss, coef, sizes (the N fitted), inside (the minimum lies
    within them)}}."""
    out = {}
    for budget in sorted({p["budget"] for p in points}):
        mine = near_minimum([p for p in points if p["budget"] == budget])
        log_n = np.log([p["n_params"] for p in mine])
        coef = parabola(log_n, np.array([p["loss"] for p in mine]))
        if coef is None:
            continue
        x = -coef[1] / (2 * coef[0])
        out[budget] = {"n_opt": math.exp(x), "loss": float(np.polyval(coef, x)), "coef": coef.tolist(),
                       "sizes": sorted({p["n_params"] for p in mine}), "inside": bool(log_n.min() <= x <= log_n.max())}
    return out


def power_law(c, n_opt) -> tuple[float, float] | None:
    """(a, log k) of N_opt = k·C^a by least squares in log-log; None with fewer than two budgets."""
    if len(c) < 2:
        return None
    a, log_k = np.polyfit(np.log(c), np.log(n_opt), 1)
    return float(a), float(log_k)


def fit_isoflop(points: list[dict]) -> dict | None:
    """Approach 2: {minima, a, log_k}, or None when fewer than two budgets have a minimum within their sizes. A
    minimum outside them (an extrapolated parabola) is reported but not used: on a few points it can lie
    anywhere."""
    minima = isoflop_minima(points)
    inside = {c: m for c, m in minima.items() if m["inside"]}
    law = power_law(list(inside), [m["n_opt"] for m in inside.values()])
    return None if law is None else {"minima": minima, "a": law[0], "log_k": law[1]}


def isoflop_n_opt(iso: dict, c):
    """Approach 2's N_opt(C) = k·C^a."""
    return np.exp(iso["log_k"] + iso["a"] * np.log(c))


# ---------------------------------------------------------------- bootstrap


def interval(values, axis=None):
    """The central LEVEL % of `values` (NaN, from a resample whose fit has no optimum, left out)."""
    lo, hi = np.nanpercentile(np.asarray(values, float), [(100 - LEVEL) / 2, (100 + LEVEL) / 2], axis=axis)
    return [float(lo), float(hi)] if axis is None else (lo, hi)


def bootstrap_surface(points: list[dict], fit: dict, n_boot: int, seed: int = 0) -> list[dict]:
    """Approach 3 on `n_boot` resamples of the points (with replacement), each started from `fit`."""
    rng = np.random.default_rng(seed)
    arrays = [np.array([p[k] for p in points], float) for k in ("n_params", "tokens", "loss")]
    fits = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(points), len(points))
        fits.append(fit_surface(*(x[pick] for x in arrays), warm=fit["theta"]))
    return fits


def bootstrap_isoflop(points: list[dict], n_boot: int, seed: int = 0) -> list[dict]:
    """Approach 2 on `n_boot` resamples drawn within each budget; a budget left without a minimum within its
    sizes (too few distinct sizes, a parabola opening downwards or one extrapolated) fits over the others, and
    a resample with fewer than two such budgets is dropped."""
    rng = np.random.default_rng(seed)
    groups = [[p for p in points if p["budget"] == b] for b in sorted({p["budget"] for p in points})]
    fits = []
    for _ in range(n_boot):
        sample = [g[i] for g in groups for i in rng.integers(0, len(g), len(g))]
        fit = fit_isoflop(sample)
        if fit is not None:
            fits.append(fit)
    return fits


def intervals(fits: list[dict], keys: tuple[str, ...]) -> dict[str, list[float]]:
    return {k: interval([f[k] for f in fits]) for k in keys}


# ---------------------------------------------------------------- everything `fit` reports


def analyse(points: list[dict], n_boot: int, seed: int = 0) -> dict:
    """Both approaches on the points, with bootstrap intervals: {surface, surface_boot, surface_ci, isoflop,
    isoflop_boot, isoflop_ci}. The exponents of compute-optimal scaling from approach 3 are
    a = β/(α+β) (N_opt ∝ C^a) and b = α/(α+β) (D_opt ∝ C^b)."""
    arrays = [np.array([p[k] for p in points], float) for k in ("n_params", "tokens", "loss")]
    surface = _with_allocation_exponents(fit_surface(*arrays))
    boots = [_with_allocation_exponents(f) for f in bootstrap_surface(points, surface, n_boot, seed)]
    iso = fit_isoflop(points)
    iso_boots = bootstrap_isoflop(points, n_boot, seed)
    return {"surface": surface, "surface_boot": boots,
            "surface_ci": intervals(boots, ("E", "A", "B", "alpha", "beta", "a", "b")),
            "isoflop": iso, "isoflop_boot": iso_boots,
            "isoflop_ci": intervals(iso_boots, ("a",)) if iso_boots else {}}


def _with_allocation_exponents(fit: dict) -> dict:
    total = fit["alpha"] + fit["beta"]
    return {**fit, "a": fit["beta"] / total, "b": fit["alpha"] / total}
