"""Load per-cell `metrics.json` files and flatten them into long pandas frames.

A *cell* is one training run (method × dataset × partition × seed). A *kind* is the
model evaluated and where: "global" (the server model) or "personal" (per-client models)
on each client's test split, and the kinds of KINDS evaluated after training.
Failed cells are kept as a single row with kind "failed" and NaN metrics, so reports
can show them instead of silently dropping them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from fedrepro.custody import ResultsError, check_unique, parse_token, read_metrics, warn_unchecked
from fedrepro.io import atomic_path, write_json_atomic
from fedrepro.metrics import STATS
from fedrepro.report.stats import seed_stats

# Model kinds: each client's own test split (global, personal); after training, the unseen
# clients and the global test sets (union of client test splits, official test set), where
# <set>_personal is every personalized model on that set and <set>_hm the per-client
# harmonic mean of own-test and global-test scores (GRP-FED's L).
KINDS = ("global", "personal", "unseen_global", "unseen_all_global", "unseen_personal",
         *(f"{where}_{k}" for where in ("union", "official") for k in ("global", "personal", "hm")))
METRICS = ("acc", "f1")
CELL_KEYS = ("experiment", "dataset", "partition", "partition_id", "method", "label", "model", "seed")
METRIC_COLUMNS = [f"{m}_{s}" for m in METRICS for s in STATS]
BESTVAL_COLUMNS = [f"bestval_{m}_weighted_mean" for m in METRICS]
EXTRA_COLUMNS = ["rounds", "bytes_up_total", "bytes_down_total", "wall_time_s", "peak_rss_mb",
                 "num_clients", "untrained_clients", "untrained_rule", "unscored_clients", "finetuned_from"]
#: Distinct client types (metrics.json summary "<kind>_types", FedGCR): Avg over types, σ_type,
#: σ_client; and the method's clustering accuracy against the true types (FedGCR's Table 3).
TYPE_COLUMNS = {"type_avg": "avg", "type_sigma": "sigma_type", "client_sigma": "sigma_client"}
SUMMARY_COLUMNS = [*CELL_KEYS, "status", "failure_reason", "kind", *METRIC_COLUMNS, *BESTVAL_COLUMNS, *EXTRA_COLUMNS,
                   *TYPE_COLUMNS, "cluster_acc"]
#: the summary columns a paper table may map a metric to
TABLE_COLUMNS = [*METRIC_COLUMNS, *BESTVAL_COLUMNS, *TYPE_COLUMNS, "cluster_acc"]
GROUP = ["dataset", "partition", "label", "kind"]
JSON_COLUMNS = ("acc_weighted_mean", "acc_mean", "acc_worst10", "acc_std", "f1_mean")
CURVE_COLUMNS = ["dataset", "partition", "label", "kind", "seed", "round", "metric", "stat", "value"]
DECIMALS = 6


def load_cells(paths: Iterable[str | Path], expect: list[str] | None = None) -> list[dict]:
    """Read metrics files (in the given order) bounded and type-checked (fedrepro.custody.read_metrics);
    `expect`: per file, the cell it must belong to (custody.expected_token). Two files of one cell,
    or files of several experiments, are refused too. Any problem is a ResultsError naming the file."""
    paths = list(paths)
    if expect is not None and len(expect) != len(paths):
        raise ResultsError(f"--expect names {len(expect)} cell(s) for {len(paths)} metrics file(s); allowed: one per file")
    expected = [parse_token(t) for t in expect] if expect is not None else [None] * len(paths)
    cells = [read_metrics(path, e) for path, e in zip(paths, expected)]
    check_unique(cells, paths)
    warn_unchecked([p for p, c in zip(paths, cells) if c.get("identity") is None])
    return cells


def nested_get(d: Any, *keys: str) -> Any:
    """Nested dict lookup that returns None where any level is missing or null."""
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def cell_ident(cell: dict) -> dict:
    """The cell's identifying keys (experiment ... seed); label defaults to the method."""
    c = cell.get("cell") or {}
    ident = {k: c.get(k) for k in CELL_KEYS}
    if ident["label"] is None:
        ident["label"] = ident["method"]
    return ident


def is_ok(cell: dict) -> bool:
    """True for a cell that finished successfully."""
    return cell.get("status") == "ok"


def cell_kinds(cell: dict) -> list[str]:
    """Model kinds present in a successful cell's final summary (global before personal)."""
    summary = cell.get("summary") or {}
    return [k for k in KINDS if isinstance(summary.get(f"{k}_acc"), dict)]


def summary_frame(cells: list[dict]) -> pd.DataFrame:
    """One row per (ok cell, kind) plus one kind="failed" row per failed cell (metrics NaN)."""
    rows = []
    for cell in cells:
        ok = is_ok(cell)
        base = cell_ident(cell) | {
            "status": cell.get("status") or "failed",
            "failure_reason": None if ok else (nested_get(cell, "failure", "reason") or "unknown"),
            "rounds": _num(cell.get("rounds")),
            "bytes_up_total": _num(nested_get(cell, "communication", "bytes_up_total")),
            "bytes_down_total": _num(nested_get(cell, "communication", "bytes_down_total")),
            "wall_time_s": _num(nested_get(cell, "resources", "wall_time_s")),
            "peak_rss_mb": _num(nested_get(cell, "resources", "peak_rss_mb")),
            "num_clients": _num(len(nested_get(cell, "clients", "ids") or [])) if ok else math.nan,
            "untrained_clients": _num(nested_get(cell, "clients", "untrained")),
            "untrained_rule": nested_get(cell, "clients", "untrained_rule"),
            # clients without test data (a partition with allow_empty_clients): left out of every score
            "unscored_clients": _num(sum(1 for n in nested_get(cell, "clients", "test_size") or [] if n == 0)) if ok else math.nan,
            # a fine-tuning row scored from this label's final model, not trained (fedrepro.engine.finetune)
            "finetuned_from": nested_get(cell, "resources", "finetuned_from") if ok else None,
        } | sweep_columns(cell)
        for kind in cell_kinds(cell) if ok else ["failed"]:
            row = dict(base, kind=kind)
            for m in METRICS:
                for s in STATS:
                    row[f"{m}_{s}"] = _num(nested_get(cell, "summary", f"{kind}_{m}", s)) if ok else math.nan
                row[f"bestval_{m}_weighted_mean"] = (
                    _num(nested_get(cell, "best_val", "summary", f"{kind}_{m}", "weighted_mean")) if ok else math.nan
                )
            for column, stat in TYPE_COLUMNS.items():
                row[column] = _num(nested_get(cell, "summary", f"{kind}_types", stat)) if ok else math.nan
            row["cluster_acc"] = _num(nested_get(cell, "method", "cluster_acc")) if ok and kind == "global" else math.nan
            rows.append(row)
    swept = _ordered(k for row in rows for k in row if k.startswith(SWEEP_PREFIX))
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS + swept)


#: summary columns of a swept cell's values (config key methods.<label>.sweep): sweep.hparams.mu, ...
SWEEP_PREFIX = "sweep."


def sweep_columns(cell: dict) -> dict:
    """{sweep.<dotted key>: value} of a swept cell (metrics.json cell.sweep); {} for any other cell."""
    sweep = nested_get(cell, "cell", "sweep")
    return {f"{SWEEP_PREFIX}{k}": v for k, v in sweep.items()} if isinstance(sweep, dict) else {}


def _ordered(values: Iterable) -> list:
    return list(dict.fromkeys(values))


def row_keys(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, kind) rows: labels by first appearance, global before personal.

    A label that never succeeded anywhere gets a single (label, "failed") row.
    """
    keys = []
    for label in _ordered(frame["label"]):
        kinds = set(frame.loc[(frame["label"] == label) & (frame["status"] == "ok"), "kind"])
        keys += [(label, k) for k in KINDS if k in kinds] or [(label, "failed")]
    return keys


def column_keys(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(dataset, partition) columns: datasets by first appearance, then their partitions likewise."""
    keys = _ordered(zip(frame["dataset"], frame["partition"]))
    datasets = _ordered(ds for ds, _ in keys)
    return sorted(keys, key=lambda key: datasets.index(key[0]))


def seed_table(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """`column`'s mean and sample std over seeds (report.stats.seed_stats) per (dataset, partition,
    label, kind): what summary.json and the tables show.

    Returns columns dataset, partition, label, kind, mean, std, n_seeds (successful
    cells), n_failed (failed cells of that label there), in row/column order. Only
    (label, dataset×partition) combinations that have at least one cell are listed.
    """
    ok = frame[frame["status"] == "ok"]
    grouped = ok.groupby(GROUP, sort=False)[column]
    # n_seeds counts the successful cells, one without a score in `column` too (seed_stats leaves it out)
    stats = {key: (seed_stats(g.to_numpy()), len(g)) for key, g in grouped}
    failed = frame[frame["status"] != "ok"].groupby(["dataset", "partition", "label"], sort=False).size().to_dict()
    present = set(zip(frame["dataset"], frame["partition"], frame["label"]))
    rows = []
    for label, kind in row_keys(frame):
        for ds, part in column_keys(frame):
            if (ds, part, label) not in present:
                continue
            s, n = stats.get((ds, part, label, kind), (seed_stats([]), 0))
            rows.append({"dataset": ds, "partition": part, "label": label, "kind": kind,
                         "mean": s.mean, "std": s.std, "n_seeds": n, "n_failed": failed.get((ds, part, label), 0)})
    return pd.DataFrame(rows, columns=[*GROUP, "mean", "std", "n_seeds", "n_failed"])


def _round(x: float) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), DECIMALS)


def metrics_json(frame: pd.DataFrame) -> dict:
    """{dataset: {partition: {label: {kind: {col: mean over seeds, n_seeds, n_failed}}}}}.

    Failed cells are excluded from the means and counted in "n_failed"; metrics with
    no successful seed are omitted (JSON has no NaN).
    """
    out: dict = {}
    for col in JSON_COLUMNS:
        for r in seed_table(frame, col).itertuples(index=False):
            entry = out.setdefault(r.dataset, {}).setdefault(r.partition, {})
            entry = entry.setdefault(r.label, {}).setdefault(r.kind, {})
            if (value := _round(r.mean)) is not None:
                entry[col] = value
            entry["n_seeds"], entry["n_failed"] = int(r.n_seeds), int(r.n_failed)
    swept = [c for c in frame.columns if c.startswith(SWEEP_PREFIX)]
    for r in frame[GROUP + swept].drop_duplicates(GROUP).itertuples(index=False) if swept else ():
        entry = nested_get(out, r[0], r[1], r[2], r[3])
        for col, value in zip(swept, r[4:]):
            if isinstance(entry, dict) and not pd.isna(value):
                entry[col] = value.item() if hasattr(value, "item") else value
    return out


def write_summary(cells: list[dict], csv_path: str | Path, json_path: str | Path) -> pd.DataFrame:
    """Write the long summary CSV and the nested `dvc metrics` JSON; return the frame."""
    frame = summary_frame(cells)
    with atomic_path(csv_path) as tmp:
        frame.round(DECIMALS).to_csv(tmp, index=False)
    write_json_atomic(json_path, metrics_json(frame))
    return frame


def number_series(values: Any, n: int) -> list[float]:
    """The first `n` values of a curve as floats (NaN where not a number)."""
    return [_num(v) for v in (values or [])[:n]]


def curves_frame(cells: list[dict]) -> pd.DataFrame:
    """Long per-round curves of successful cells.

    Columns: dataset, partition, label, kind, seed, round, metric, stat, value. Model
    metrics have kind global/personal, metric acc/f1 and stat as in the summary; the
    training loss has kind "train", metric "train_loss", stat "value", at every round
    (metrics.json `train_loss_per_round`; the evaluated rounds' `curves.train_loss` in files without
    it). A round without a
    value (a column not scored there: `training.personal_eval_every`) has no row, so plots
    join the rounds that have one.
    """
    parts = []
    for cell in cells:
        curves = cell.get("curves") if is_ok(cell) else None
        if not isinstance(curves, dict) or not curves.get("round"):
            continue
        ident = cell_ident(cell)
        rounds = list(curves["round"])

        def add(kind: str, metric: str, stat: str, values: Any, at: list[int] = rounds) -> None:
            scored = [(r, v) for r, v in zip(at, number_series(values, len(at))) if not math.isnan(v)]
            if scored:
                parts.append(pd.DataFrame({
                    "dataset": ident["dataset"], "partition": ident["partition"], "label": ident["label"],
                    "kind": kind, "seed": ident["seed"], "round": [r for r, _ in scored],
                    "metric": metric, "stat": stat, "value": [v for _, v in scored],
                }))

        for kind in KINDS:
            for m in METRICS:
                for s in STATS:
                    add(kind, m, s, nested_get(curves, f"{kind}_{m}", s))
        per_round = cell.get("train_loss_per_round")
        if isinstance(per_round, list) and per_round:
            add("train", "train_loss", "value", per_round, list(range(1, len(per_round) + 1)))
        else:
            add("train", "train_loss", "value", curves.get("train_loss"))
    if not parts:
        return pd.DataFrame(columns=CURVE_COLUMNS)
    return pd.concat(parts, ignore_index=True)[CURVE_COLUMNS]


def write_curves_csv(cells: list[dict], path: str | Path) -> None:
    """Compact `dvc plots` CSV: dataset, partition, label, kind, seed, round, acc_weighted_mean."""
    curves = curves_frame(cells)
    acc = curves[(curves["metric"] == "acc") & (curves["stat"] == "weighted_mean")]
    acc = acc.rename(columns={"value": "acc_weighted_mean"})
    cols = ["dataset", "partition", "label", "kind", "seed", "round", "acc_weighted_mean"]
    with atomic_path(path) as tmp:
        acc[cols].round(DECIMALS).to_csv(tmp, index=False)
