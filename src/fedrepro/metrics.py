"""The evaluation protocol's arithmetic: per-client scores and their aggregates."""

from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import f1_score

STATS = ("weighted_mean", "mean", "std", "min", "max", "worst10")


def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    return float(np.mean(y_true == y_pred)) if len(y_true) else math.nan


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Macro-F1 over the classes present in the client's labels or predictions (sklearn's default)."""
    if not len(y_true):
        return math.nan
    return float(f1_score(y_true, y_pred, average="macro", zero_division=0))


def worst_fraction_mean(values: np.ndarray, fraction: float = 0.1) -> float:
    """Mean of the lowest ceil(fraction * n) values (FederatedScope's bottom-10%)."""
    v = np.sort(values[~np.isnan(values)])
    if not len(v):
        return math.nan
    k = max(1, math.ceil(fraction * len(v)))
    return float(v[:k].mean())


def summarize(values, weights) -> dict[str, float]:
    """Aggregates over clients: mean weighted by `weights` (test sizes), unweighted mean,
    population std (ddof=0, as PFLlib's np.std), min, max and mean of the worst 10 %.
    Clients without a score (NaN: empty split) are left out."""
    v = np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    ok = ~np.isnan(v)
    if not ok.any():
        return {s: math.nan for s in STATS}
    v, w = v[ok], w[ok]
    return {
        "weighted_mean": float(np.sum(v * w) / np.sum(w)) if w.sum() > 0 else math.nan,
        "mean": float(v.mean()),
        "std": float(v.std()),
        "min": float(v.min()),
        "max": float(v.max()),
        "worst10": worst_fraction_mean(v),
    }


def harmonic_mean(p: float, g: float) -> float:
    """2pg / (p + g): GRP-FED's per-client combination of personalization P and
    generalization G (its L is the mean of this over clients); 0 where both are 0."""
    if math.isnan(p) or math.isnan(g):
        return math.nan
    return 0.0 if p + g == 0 else 2 * p * g / (p + g)
