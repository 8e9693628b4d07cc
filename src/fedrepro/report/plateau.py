"""Has a run reached a plateau? The change of a table cell's learning curve between the last two
evaluations (metrics.json `curves`, one point per `eval_every` rounds). A row that still moves by
more than PLATEAU_TOLERANCE is "not converged", and the ordering of the rows it is compared with is
not judged: the paper tables (report/paper_tables.py) and the readings ledgers (report/readings.py)
say so instead of a verdict.

The curves hold the base kinds only (global, personal): a kind evaluated after training stands in
by its base (union_global, unseen_global, official_global -> global; *_personal -> personal), and
the harmonic mean `hm` by whichever of personal and global moved most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from fedrepro.report.aggregate import METRICS, STATS, cell_ident, is_ok, nested_get, number_series

#: The largest change between the last two evaluations of a plateau: 0.01 of a fraction metric
#: (1 point of accuracy or F1). A convention of this project, not a statistical test.
PLATEAU_TOLERANCE = 0.01
NOT_CONVERGED = "not converged: ordering not judged"
_PREFIXES = ("union_", "unseen_all_", "unseen_", "official_")


def curve_of(kind: str, column: str) -> tuple[list[str], str, str]:
    """(the curves' base kinds, metric, stat) that stand for a table cell of `kind` and summary
    `column`: the column's <metric>_<stat> where it parses so, else acc / mean (type_avg, ...)."""
    base = next((kind[len(p):] for p in _PREFIXES if kind.startswith(p)), kind)
    metric, _, stat = column.partition("_")
    if metric not in METRICS or stat not in STATS:
        metric, stat = "acc", "mean"
    return (["personal", "global"] if base == "hm" else [base]), metric, stat


def last_change(cell_metrics: dict, kind: str, column: str) -> tuple[int, int, float] | None:
    """(round before, last round, change as a raw fraction) of the curve standing for (kind, column)
    between its last two evaluated points; None for a failed cell, no such curve or < 2 points."""
    curves = cell_metrics.get("curves") if is_ok(cell_metrics) else None
    if not isinstance(curves, dict) or not curves.get("round"):
        return None
    bases, metric, stat = curve_of(kind, column)
    rounds = list(curves["round"])
    found = []
    for base in bases:
        points = [(int(r), v) for r, v in zip(rounds, number_series(nested_get(curves, f"{base}_{metric}", stat), len(rounds)))
                  if not math.isnan(v)]
        if len(points) >= 2:
            (a, va), (b, vb) = points[-2:]
            found.append((a, b, vb - va))
    return max(found, key=lambda x: abs(x[2])) if found else None


def by_cell(runs: Iterable[dict]) -> dict[tuple, dict]:
    """The cells' metrics keyed by (dataset, partition, label, seed), as a table target names them."""
    return {tuple(cell_ident(r)[k] for k in ("dataset", "partition", "label", "seed")): r for r in runs}


#: The metrics.json clients field that counts the test samples a kind scores (resolution).
SCORED_SAMPLES = {"global": "test_size", "personal": "test_size", "union_global": "test_size",
                  "union_personal": "test_size", "unseen_global": "unseen_test_size",
                  "unseen_personal": "unseen_test_size", "unseen_all_global": "unseen_size"}


def resolution(runs: dict[tuple, dict], target, kind: str | None, seeds: Iterable[int]) -> float:
    """One scored sample as a fraction of an accuracy column (acc_mean, acc_weighted_mean): 1 / N,
    N the samples the kind scores, the mean over `seeds` of the cells' counts (`runs` from by_cell).
    Exact for the weighted mean; for the unweighted mean over clients, one sample of client i moves
    it by 1 / (K n_i), on average over the samples 1 / N as well. 0 where not known: another
    column (F1, a spread), a kind without a recorded count, or no cell recorded."""
    if kind not in SCORED_SAMPLES or target.column not in ("acc_mean", "acc_weighted_mean"):
        return 0.0
    counts = []
    for s in sorted(seeds):
        run = runs.get((target.dataset, target.partition, target.label, s))
        sizes = ((run or {}).get("clients") or {}).get(SCORED_SAMPLES[kind])
        if isinstance(sizes, list) and sizes and sum(sizes) > 0:
            counts.append(sum(sizes))
    return len(counts) / sum(counts) if counts else 0.0  # 1 / (mean count)


def seed_changes(runs: dict[tuple, dict], target, kind: str, seeds: Iterable[int]) -> dict[int, tuple[int, int, float]]:
    """{seed: last_change} of a table target's cells (`runs` from by_cell), for the seeds with a curve."""
    found = {}
    for s in sorted(seeds):
        run = runs.get((target.dataset, target.partition, target.label, s))
        if run is not None and (x := last_change(run, kind, target.column)) is not None:
            found[s] = x
    return found


@dataclass(frozen=True)
class Movement:
    """The last changes of one cell over its seeds."""

    change: float  # mean over seeds of the change (raw fraction, signed)
    moved: float  # mean over seeds of |change|: what the tolerance is held against
    rounds: tuple[tuple[int, int], ...]  # the distinct (round before, last round)
    n: int  # seeds with a curve

    @property
    def converged(self) -> bool:
        return round(self.moved, 9) <= PLATEAU_TOLERANCE  # round: 0.72 - 0.71 is 0.010000000000000009


def movement(changes: Iterable[tuple[int, int, float] | None]) -> Movement | None:
    """The Movement of a cell from its seeds' last_change (None: no seed has a curve)."""
    found = [c for c in changes if c is not None]
    if not found:
        return None
    return Movement(sum(c for _, _, c in found) / len(found), sum(abs(c) for _, _, c in found) / len(found),
                    tuple(sorted({(a, b) for a, b, _ in found})), len(found))


def rounds_text(rounds: Iterable[tuple[int, int]]) -> str:
    """'rounds 30 and 40' (several pairs: 'rounds 30 and 40, 10 and 20')."""
    return "rounds " + ", ".join(f"{a} and {b}" for a, b in sorted(set(rounds)))
