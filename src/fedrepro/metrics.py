"""The evaluation protocol's arithmetic: per-client scores and their aggregates."""

from __future__ import annotations

import math

import numpy as np

STATS = ("weighted_mean", "mean", "std", "min", "max", "worst10")


def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    return float(np.mean(y_true == y_pred)) if len(y_true) else math.nan


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Macro-F1 over the classes present in the client's labels or predictions: sklearn's
    f1_score(average="macro", zero_division=0), computed as it computes it (per class 2 tp / (true +
    predicted), a division of exact integers, then numpy's nanmean), so the scores are bit-identical;
    without importing sklearn, which with pandas took about a second of every training job's start."""
    if not len(y_true):
        return math.nan
    labels, codes = np.unique(np.concatenate([np.asarray(y_true), np.asarray(y_pred)]), return_inverse=True)
    true, pred = codes[:len(y_true)], codes[len(y_true):]
    k = len(labels)
    tp = np.bincount(true[true == pred], minlength=k)
    return float(np.nanmean(2.0 * tp / (np.bincount(true, minlength=k) + np.bincount(pred, minlength=k))))


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


def beyond_weights(where: str, n: int, unseen_weights) -> list:
    """The weights of the `n` clients of a score after training ('<where>/<kind>', engine/beyond.py)
    in its summary: unseen clients by `unseen_weights` (the sizes they are scored on: their test
    splits, or all their data for unseen_all), a global test or validation set's clients equally
    (each is scored on the same set)."""
    return list(unseen_weights) if where in ("unseen", "unseen_all") else [1] * n


def type_summary(acc, test_sizes, types) -> dict[str, float]:
    """Metrics for distinct client types (FedGCR, methods.md §5.7), from per-client accuracies:

    * a type's accuracy = accuracy on the pooled test samples of its clients (their test-size
      weighted mean: FedGCR tests each domain on its whole test set);
    * avg = mean over types of the type accuracy ("Avg");
    * sigma_type = std (ddof = 0) over types ("σ_type");
    * sigma_client = std over clients of their type's accuracy ("σ_client": types weighted by
      their client counts, as FedGCR's logged values).
    Clients without a score (NaN) are left out."""
    v, w, t = (np.asarray(a, dtype=float) for a in (acc, test_sizes, types))
    ok = ~np.isnan(v) & (w > 0)
    if not ok.any():
        return {"avg": math.nan, "sigma_type": math.nan, "sigma_client": math.nan, "num_types": 0}
    v, w, t = v[ok], w[ok], t[ok]
    ids = np.unique(t)
    type_acc = np.array([np.sum(v[t == i] * w[t == i]) / np.sum(w[t == i]) for i in ids])
    per_client = type_acc[np.searchsorted(ids, t)]
    return {"avg": float(type_acc.mean()), "sigma_type": float(type_acc.std()), "sigma_client": float(per_client.std()),
            "num_types": int(len(ids))}


def harmonic_mean(p: float, g: float) -> float:
    """2pg / (p + g): GRP-FED's per-client combination of personalization P and
    generalization G (its L is the mean of this over clients); 0 where both are 0."""
    if math.isnan(p) or math.isnan(g):
        return math.nan
    return 0.0 if p + g == 0 else 2 * p * g / (p + g)
