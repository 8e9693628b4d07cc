"""metrics.json: the record of one trained cell.

Owns the layout of metrics.json (schema custody.METRICS_SCHEMA): the cell's identity
(`metrics_cell`), the last round's per-client scores and their aggregates (`summaries`), the
learning curves of the evaluated rounds, best-on-validation, the beyond-protocols' scores,
per-client training rounds and how each client was scored, communication and resources.
Pure functions of what the round loop collected: nothing here trains or evaluates.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..custody import METRICS_SCHEMA
from ..metrics import STATS, beyond_weights, summarize, type_summary
from .beyond import VAL_PREFIX
from .data import Client


def accuracies(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """The evaluated round's test accuracy (weighted over clients) per model kind, of its `summaries`."""
    return {kind: stats[f"{kind}_acc"]["weighted_mean"] for kind in ("global", "personal")
            if f"{kind}_acc" in stats and not math.isnan(stats[f"{kind}_acc"]["weighted_mean"])}


def _clean(values: list[float]) -> list[float | None]:
    return [None if (isinstance(v, float) and math.isnan(v)) else v for v in values]


def _clean_stats(stats: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if math.isnan(v) else v) for k, v in stats.items()}


def summaries(record: dict, split: str, weights: list[int]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in ("global", "personal"):
        key = f"{split}/{kind}"
        if key in record:
            for metric in ("acc", "f1"):
                out[f"{kind}_{metric}"] = summarize(record[key][metric], weights)
    return out


def metrics_cell(cell: dict) -> dict:
    """The cell's identity in metrics.json (what the summary's columns come from): a swept cell
    also carries its swept values (config key methods.<label>.sweep)."""
    return ({k: cell[k] for k in ("experiment", "dataset", "partition", "partition_id", "method", "label", "seed")}
            | {"model": cell["model"]["name"]} | ({"sweep": cell["sweep"]} if "sweep" in cell else {}))


def _add_beyond(final: dict, summary: dict, beyond: dict, unseen_weights: dict[str, list[int]]) -> None:
    """Each evaluate_beyond score ('<where>/<kind>') into `final` as <where>_<kind> and into
    `summary` as <where>_<kind>_<acc|f1>: unseen clients weighted by `unseen_weights[where]` (the
    sizes they are scored on), a global test or validation set's clients equally (each is scored on
    the same set)."""
    for key, values in beyond.items():
        where, kind = key.split("/")
        weights = beyond_weights(where, len(values["acc"]), unseen_weights.get(where))
        final[f"{where}_{kind}"] = {m: _clean(values[m]) for m in ("acc", "f1")}
        for m in ("acc", "f1"):
            summary[f"{where}_{kind}_{m}"] = _clean_stats(summarize(values[m], weights))


def build_metrics(cell: dict, clients: list[Client], history: list[dict], per_round: dict, resources: dict,
                  beyond: dict | None = None, unseen: list[Client] | None = None,
                  trained: list[list[int]] | None = None, untrained_rule: str = "personalize",
                  method_report: dict | None = None) -> dict[str, Any]:
    """metrics.json: the last round's per-client scores and aggregates (never the best
    round on test data), curves every k rounds, best-on-validation as an extra; after
    training, the scores on unseen clients and global test sets (`beyond.evaluate_beyond`);
    per client the rounds it trained in and how its final scores were obtained."""
    test_sizes = [len(c.test) for c in clients]
    val_sizes = [len(c.val) for c in clients]
    unseen = unseen or []
    # the beyond-scores on validation data (a tuning trial's union of validation splits) go to summary_val only
    beyond_val = {k.removeprefix(VAL_PREFIX): v for k, v in (beyond or {}).items() if k.startswith(VAL_PREFIX)}
    beyond = {k: v for k, v in (beyond or {}).items() if not k.startswith(VAL_PREFIX)}
    last = history[-1]
    final = {kind: ({m: _clean(last[f"test/{kind}"][m]) for m in ("acc", "f1")} if f"test/{kind}" in last else None)
             for kind in ("global", "personal")}
    summary = {k: _clean_stats(v) for k, v in summaries(last, "test", test_sizes).items()}
    # Further kinds, summarised over the clients they score: unseen_{global,personal} over the
    # unseen clients (weighted by test size), <test set>_{global,personal,hm} over the
    # federation's clients (weighted equally: each is scored on the same test set).
    _add_beyond(final, summary, beyond, {"unseen": [len(c.test) for c in unseen],
                                         "unseen_all": [len(c.train) + len(c.val) + len(c.test) for c in unseen]})
    # Distinct client types (each client holds one domain): Avg, σ_type, σ_client (FedGCR).
    types = [c.client_type for c in clients]
    if clients and None not in types:
        for kind in ("global", "personal"):
            if final[kind] is not None:
                summary[f"{kind}_types"] = _clean_stats(type_summary(last[f"test/{kind}"]["acc"], test_sizes, types))
    curves: dict[str, Any] = {"round": [h["round"] for h in history], "train_loss": [h["train_loss"] for h in history]}
    for name in summaries(last, "test", test_sizes):
        curves[name] = {s: _clean([summaries(h, "test", test_sizes)[name][s] for h in history]) for s in STATS}
    best_val = None
    summary_val = final_val = None
    if "val/global" in last or "val/personal" in last:
        # the last round on the validation split: what hyper-parameter tuning selects by
        summary_val = {k: _clean_stats(v) for k, v in summaries(last, "val", val_sizes).items()}
        final_val = {kind: ({m: _clean(last[f"val/{kind}"][m]) for m in ("acc", "f1")} if f"val/{kind}" in last else None)
                     for kind in ("global", "personal")}
        # <validation set>_{global,personal,hm} over the federation's clients, weighted equally as their test twins
        _add_beyond(final_val, summary_val, beyond_val, {})
        kind = "personal" if "val/personal" in last else "global"
        val_acc = [summarize(h[f"val/{kind}"]["acc"], val_sizes)["weighted_mean"] for h in history]
        best = int(np.nanargmax(val_acc))
        best_val = {"round": history[best]["round"], "selected_by": f"val {kind} acc weighted_mean",
                    "summary": {k: _clean_stats(v) for k, v in summaries(history[best], "test", test_sizes).items()}}
    return {
        "schema": METRICS_SCHEMA,
        "cell": metrics_cell(cell),
        "status": "ok",
        "failure": None,
        "rounds": history[-1]["round"],
        "clients": {"ids": [c.id for c in clients], "train_size": [len(c.train) for c in clients],
                    "test_size": test_sizes, "val_size": val_sizes,
                    "unseen_ids": [c.id for c in unseen], "unseen_test_size": [len(c.test) for c in unseen],
                    "unseen_size": [len(c.train) + len(c.val) + len(c.test) for c in unseen],
                    "trained_rounds": trained, "untrained": sum(1 for t in trained or [] if not t),
                    "untrained_rule": untrained_rule, "scored_by": last.get("scored_by")},
        "final": final,
        "summary": summary,
        "method": method_report or {},
        "best_val": best_val,
        "summary_val": summary_val,
        "final_val": final_val,
        "curves": curves,
        "train_loss_per_round": per_round["train_loss"],
        "communication": {"bytes_up_per_round": per_round["up"], "bytes_down_per_round": per_round["down"],
                          "bytes_up_total": int(sum(per_round["up"])), "bytes_down_total": int(sum(per_round["down"]))},
        "resources": resources,
    }
