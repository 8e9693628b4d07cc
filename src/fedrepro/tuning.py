"""Hyper-parameter tuning on validation data (config block `tuning:`).

Every tuned method label gets a search space (parameter -> list of values; `lr` is
training.optimizer.lr), expanded into trials: the grid, or a seeded random sample of N of
its points. A trial is an ordinary training cell whose clients hold out `val_fraction` of
their TRAINING split as validation (fedrepro.engine.data.carve_validation); the test split
is never read. `select_winner` picks the trial with the best validation score (the mean
over the tuning seeds of one aggregate over clients), and the final cells train with it.

The default spaces (methods/search_spaces.yaml) carry their citations; see
`fedrepro list methods`.
"""

from __future__ import annotations

import copy
import itertools
import math
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np
import yaml

from .io import short_hash
from .registry import ConfigError, Param, cells_over, show

TUNING_DEFAULTS: dict[str, Any] = {
    "val_fraction": 0.2,  # of each client's training split; [RECON] pFL-Bench holds out 20 % of train as validation
    "seeds": None,  # default: the experiment's first seed
    "training": {},  # overrides of the experiment's training for the trials (e.g. fewer rounds)
    "search": "grid",  # grid | random
    "samples": None,  # random: how many points of the grid (required)
    "sample_seed": 0,  # random: the seed of the sample
    "metric": {"model": "auto", "stat": "weighted_mean"},
    "lr": None,  # the shared learning-rate grid; default: search_spaces.yaml's
    "methods": {},  # label -> its own space (replaces the default one; {} = nothing to tune)
}
#: The model whose validation accuracy is compared: auto = personalized where the method has one.
METRIC_MODELS = ("auto", "personal", "global")
#: Aggregates over clients that are "higher is better" (fedrepro.metrics.STATS without std).
METRIC_STATS = ("weighted_mean", "mean", "worst10", "min", "max")
LR_PARAM = Param(0.01, "learning rate (training.optimizer.lr)", type=float, exclusive_minimum=0)


@lru_cache(maxsize=1)
def default_spaces() -> dict[str, Any]:
    """search_spaces.yaml: {"lr": {values, source}, "methods": {method: {params, source}}}."""
    text = resources.files("fedrepro").joinpath("methods/search_spaces.yaml").read_text()
    return yaml.safe_load(text)


#: The citation of a method that declares no search space: tuning tries the shared lr grid only.
NO_SPACE_SOURCE = "no search space declared (search_spaces.yaml or the method's `search_space`): the shared lr grid only"


def method_space(method: str) -> dict[str, Any]:
    """The method's default space {params, source}: its search_spaces.yaml entry, else its class's
    `search_space` (a plugin's own file), else none (params {}: only the shared lr grid is tuned)."""
    entry = default_spaces()["methods"].get(method)
    if entry is not None:
        return entry
    from .methods import METHODS

    cls = METHODS.get(method)
    if cls.search_space is not None:
        return {"params": dict(cls.search_space), "source": cls.search_source or f"declared by {METHODS.entry(method).origin}"}
    return {"params": {}, "source": NO_SPACE_SOURCE}


def default_space_lines(method: str) -> list[str]:
    """`fedrepro list methods`: the method's default search space and its citation."""
    entry = method_space(method)
    lr = default_spaces()["lr"]["values"]
    params = ", ".join(f"{k} in {v}" for k, v in entry["params"].items())
    return [f"tuning space: lr in {lr}" + (f", {params}" if params else ""), f"tuning source: {entry['source']}"]


def _check_space(where: str, space: Any, declared: dict[str, Param]) -> dict[str, list]:
    """A space {param: [values]}: known parameters, non-empty lists, every value of the right type."""
    if not isinstance(space, dict):
        raise ConfigError(f"config key '{where}' has value {show(space)}; allowed: a mapping parameter -> list of values")
    allowed = sorted([*declared, "lr"])
    out = {}
    for key, values in space.items():
        if key not in allowed:
            raise ConfigError(f"config key '{where}.{key}': unknown parameter {key!r}; allowed parameters: {', '.join(allowed)}")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"config key '{where}.{key}' has value {show(values)}; allowed: a non-empty list of values")
        param = LR_PARAM if key == "lr" else declared[key]
        for i, v in enumerate(values):
            if v is None and param.default is None:
                continue  # the parameter's "derive it" default (e.g. FedBABU's finetune_lr)
            if v is None:
                raise ConfigError(f"config key '{where}.{key}[{i}]' has value None; allowed: a value of the parameter's type")
            param.check(f"config key '{where}'", f"{key}[{i}]", v)  # lr too: registry.HARD_NUMBER_MAX, never lifted
        if len({repr(v) for v in values}) != len(values):
            raise ConfigError(f"config key '{where}.{key}' has value {show(values)}; allowed: no duplicates")
        out[key] = list(values)
    return out


def grid_size(space: dict[str, list]) -> int:
    """The number of points of the grid of `space`: the product of its lists' lengths."""
    return math.prod(len(values) for values in space.values())


def trial_count(space: dict[str, list], search: str, samples: int | None) -> int:
    """How many trials `trial_points` makes, known before one is built."""
    size = grid_size(space)
    return min(samples, size) if search == "random" else size


def trial_points(space: dict[str, list], search: str, samples: int | None, sample_seed: int) -> list[dict[str, Any]]:
    """The grid's points in a fixed order (parameters sorted), or a seeded sample of N of them
    (drawn as indices into the grid, so a sample of a huge grid never builds the grid)."""
    keys = sorted(space)
    size = grid_size(space)
    if search == "random" and samples < size:
        rng = np.random.default_rng(sample_seed)

        def point(i: int) -> dict[str, Any]:  # the i-th point of itertools.product: the last key varies fastest
            values = {}
            for k in reversed(keys):
                i, r = divmod(i, len(space[k]))
                values[k] = space[k][r]
            return {k: values[k] for k in keys}

        return [point(i) for i in sorted(rng.choice(size, size=samples, replace=False).tolist())]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(space[k] for k in keys))]


def trial_id(values: dict[str, Any]) -> str:
    """The trial's folder name: a content address of its values, so a trial's results are
    reused whenever a changed space still contains the same point."""
    return "t" + short_hash(values, 8)


def resolve_tuning(config: dict, methods: dict[str, tuple[str, dict, Any]], declared: dict[str, dict[str, Param]],
                   seeds: list[int], cells_budget: int) -> dict[str, Any] | None:
    """The experiment's `tuning` block checked and expanded, or None without one.

    methods: label -> (method, hparams, training overrides); declared: method -> its Params;
    cells_budget: the tuning cells allowed (fedrepro.config.BUDGETS, lifted as `registry.cells_over` says).
    Returns {val_fraction, seeds, training, metric, labels: {label: {method, space, trials}}}
    where trials lists {id, values}; a label with an empty space is absent (nothing to tune).
    """
    block = config.get("tuning")
    if block is None:
        return None
    t = copy.deepcopy(TUNING_DEFAULTS)
    t.update(copy.deepcopy(block))
    t["metric"] = {**TUNING_DEFAULTS["metric"], **(block.get("metric") or {})}
    if t["search"] == "random" and t["samples"] is None:
        raise ConfigError("config key 'tuning.samples' is missing; allowed: an integer >= 1 (the number of grid points "
                          "tuning.search: random draws)")
    unknown = sorted(set(t["methods"]) - set(methods))
    if unknown:
        raise ConfigError(f"config key 'tuning.methods' names {show(unknown)}; allowed: the experiment's method labels "
                          f"{sorted(methods)}")
    tuning_seeds = t["seeds"] if t["seeds"] is not None else seeds[:1]
    lr_grid = t["lr"] if t["lr"] is not None else default_spaces()["lr"]["values"]
    _check_space("tuning", {"lr": lr_grid}, {})  # the shared grid: numbers > 0, non-empty

    labels, trials_so_far = {}, 0
    for label, (method, *_) in methods.items():
        if label in t["methods"]:
            where = f"tuning.methods.{label}"
            space = _check_space(where, t["methods"][label] or {}, declared[method])
        else:
            where = "tuning.lr" if t["lr"] is not None else "tuning"
            space = _check_space(f"search_spaces.yaml:{method}", {"lr": lr_grid, **method_space(method)["params"]},
                                 declared[method])
        if not space:
            continue  # nothing to tune: the final cells run straight away
        # the number of trials from the lists' lengths, before the grid is built (each trial is a cell per tuning seed)
        count = trial_count(space, t["search"], t["samples"])
        cells = (trials_so_far + count) * max(1, len(tuning_seeds))
        allowed = cells_over(cells, cells_budget)
        if allowed:
            sizes = " x ".join(f"{k}: {len(v)}" for k, v in space.items())
            raise ConfigError(f"config key '{where}' makes {count:,} trials for method label '{label}' ({sizes} values"
                              f"{', search: random' if t['search'] == 'random' else ''}); with the other labels' trials and "
                              f"{max(1, len(tuning_seeds))} tuning seed(s) that is {cells:,} tuning cells or more; allowed: "
                              f"{allowed} (or tuning.search: random with fewer samples)")
        trials_so_far += count
        trials = [{"id": trial_id(v), "values": v} for v in trial_points(space, t["search"], t["samples"], t["sample_seed"])]
        labels[label] = {"method": method, "space": space, "trials": trials}
    return {"val_fraction": t["val_fraction"], "seeds": tuning_seeds, "training": t["training"], "metric": t["metric"],
            "search": t["search"], "samples": t["samples"], "sample_seed": t["sample_seed"], "labels": labels}


def apply_values(cell: dict, values: dict[str, Any]) -> dict:
    """`cell` with a trial's values: method hyper-parameters, and `lr` as training.optimizer.lr."""
    out = copy.deepcopy(cell)
    for key, v in values.items():
        if key == "lr":
            out["training"]["optimizer"]["lr"] = v
        else:
            out["hparams"][key] = v
    return out


def metric_kind(model: str, summary: dict) -> str:
    """personal or global: which model's validation accuracy a trial is scored by."""
    if model == "auto":
        return "personal" if "personal_acc" in summary else "global"
    return model


def trial_score(metrics: dict, metric: dict) -> float:
    """A trial run's validation score: `metric.stat` over clients of the last round's validation
    accuracy (`summary_val` in metrics.json). The test split is not read. NaN for a failed run."""
    if metrics.get("status") != "ok":
        return math.nan
    summary = metrics.get("summary_val")
    if not summary:
        raise ConfigError(f"metrics of {show(metrics['cell'])} have no validation scores (summary_val); allowed: the "
                          f"metrics.json of a tuning trial (results/<experiment>/tuning/...)")
    kind = metric_kind(metric["model"], summary)
    key = f"{kind}_acc"
    if key not in summary:
        raise ConfigError(f"tuning metric model {metric['model']!r}: the run of {show(metrics['cell']['method'])} has no "
                          f"{kind} model; allowed: 'auto' or the model the method has")
    v = summary[key][metric["stat"]]
    return math.nan if v is None else float(v)


def select_winner(plan: dict, runs: list[dict], metric: dict) -> dict[str, Any]:
    """The selection record of one (dataset, partition, label): every trial's validation score per
    tuning seed and their mean, and the winner (highest mean; ties: the first trial in grid order).

    plan: {"trials": [{id, values}], ...}; runs: (trial id, seed, metrics.json dict) as dicts
    {"trial", "seed", "metrics"}. Trials whose runs all failed are kept with score None.
    """
    by_trial: dict[str, dict[int, float]] = {t["id"]: {} for t in plan["trials"]}
    for run in runs:
        by_trial[run["trial"]][int(run["seed"])] = trial_score(run["metrics"], metric)
    trials, best = [], None
    for t in plan["trials"]:
        scores = by_trial[t["id"]]
        ok = [s for s in scores.values() if not math.isnan(s)]
        score = float(np.mean(ok)) if ok and len(ok) == len(scores) else None  # a failed seed fails the trial
        trials.append({"id": t["id"], "values": t["values"], "score": score,
                       "scores": {f"seed{k}": (None if math.isnan(v) else v) for k, v in sorted(scores.items())}})
        if score is not None and (best is None or score > best["score"]):
            best = trials[-1]
    if best is None:
        raise ConfigError(f"every tuning trial of {show(plan.get('label'))} failed (diverged); nothing to select: "
                          f"allowed: a search space with at least one trial that trains (lower the learning rates)")
    kinds = {metric_kind(metric["model"], r["metrics"]["summary_val"]) for r in runs if r["metrics"].get("status") == "ok"}
    return {"schema": "fedrepro.tuning/1", "metric": {**metric, "model_used": sorted(kinds), "split": "val"},
            "params": sorted(plan["space"]), "space": plan["space"], "trials": trials,
            "winner": {"id": best["id"], "values": best["values"], "score": best["score"]}}
