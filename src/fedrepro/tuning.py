"""Hyper-parameter tuning on validation data (config block `tuning:`).

Every tuned method label gets a search space (parameter -> list of values; `lr` is
training.optimizer.lr), expanded into trials: the grid, or a seeded random sample of N of
its points. A trial is an ordinary training cell whose clients hold out `val_fraction` of
their TRAINING split as validation (fedrepro.engine.data.carve_validation); the test split
is never read. `select_winner` picks the trial with the best validation score (the mean
over the tuning seeds of one aggregate over clients), and the final cells train with it;
with `select: per_seed` each final seed trains with the winner of its own tuning seed.
The score is a model's accuracy or macro-F1 on each client's own validation split, or, for
GRP-FED's selection rule (its λ is the one with "the best local test (L)"), on the union of
the clients' validation splits and its harmonic mean with the own-split score (`union_hm`:
L on validation data, engine.beyond).

The default spaces (methods/search_spaces.yaml) carry their citations; see
`fedrepro list methods`.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import sys
from functools import lru_cache
from importlib import resources
from pathlib import Path
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
    # measure: acc where not given (not filled in here, so the select specs of existing configs stay as they were)
    "metric": {"model": "auto", "stat": "weighted_mean"},
    "select": "pooled",  # pooled | per_seed (SELECTIONS)
    "lr": None,  # the shared learning-rate grid; default: search_spaces.yaml's
    "methods": {},  # label -> its own space (replaces the default one; {} = nothing to tune)
}
#: The model whose validation score is compared (tuning.metric.model) -> what it is scored on.
METRIC_MODELS = {
    "auto": "the personalized model where the method has one, else the global one, on each client's validation split",
    "personal": "each client's personalized model on its own validation split",
    "global": "the global model on each client's validation split",
    "union_global": "the global model on the union of the clients' validation splits",
    "union_personal": "each client's personalized model on the union of the clients' validation splits (GRP-FED's G)",
    "union_hm": "per client, the harmonic mean of its own validation score and union_personal (GRP-FED's local test L)",
}
#: The models scored on the union of the clients' validation splits: their trials compute it (`trial_validation`).
UNION_MODELS = ("union_global", "union_personal", "union_hm")
#: The models only a method with personalized models has.
PERSONAL_MODELS = ("personal", "union_personal")
#: The per-client score compared (tuning.metric.measure), as metrics.json names it.
METRIC_MEASURES = {"acc": "accuracy", "f1": "macro-F1"}
DEFAULT_MEASURE = "acc"
#: Aggregates over clients that are "higher is better" (fedrepro.metrics.STATS without std).
METRIC_STATS = ("weighted_mean", "mean", "worst10", "min", "max")
#: How the final cells use the trials (tuning.select).
SELECTIONS = {
    "pooled": "one winner for every final seed: the best mean score over the tuning seeds",
    "per_seed": "each final seed trains with the winner of its own tuning seed (tuning.seeds: every seed)",
}
#: The schema id of the record `fedrepro select` writes (select_winner).
SELECTION_SCHEMA = "fedrepro.tuning/1"
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


def _allowed_names(names) -> str:
    return ", ".join(repr(n) for n in names)


def check_metric(metric: Any) -> dict[str, Any]:
    """tuning.metric {model, stat, measure}: known keys and values (ConfigError naming the key, the
    value and what is allowed), the defaults filled in for model and stat only."""
    allowed = {"model": METRIC_MODELS, "stat": METRIC_STATS, "measure": METRIC_MEASURES}
    if not isinstance(metric, dict):
        raise ConfigError(f"config key 'tuning.metric' has value {show(metric)}; allowed: a mapping with keys "
                          f"{', '.join(allowed)}")
    unknown = sorted(set(metric) - set(allowed))
    if unknown:
        raise ConfigError(f"config key 'tuning.metric': unknown key(s) {show(unknown)}; allowed keys: {', '.join(allowed)}")
    for key, names in allowed.items():
        if key in metric and metric[key] not in names:
            raise ConfigError(f"config key 'tuning.metric.{key}' has value {show(metric[key])}; allowed: one of "
                              f"{_allowed_names(names)}")
    return {**TUNING_DEFAULTS["metric"], **metric}


def check_metric_fits(metric: dict[str, Any], label: str, method: str) -> None:
    """ConfigError where the metric's model is one the tuned label's method does not have."""
    from .methods import METHODS

    if metric["model"] in PERSONAL_MODELS and not METHODS.get(method).has_personal:
        raise ConfigError(f"config key 'tuning.metric.model' has value {metric['model']!r}, but method label '{label}' "
                          f"({method}) has no personalized model; allowed: one of "
                          f"{_allowed_names(m for m in METRIC_MODELS if m not in PERSONAL_MODELS)} for it")


def trial_validation(tuning: dict[str, Any]) -> dict[str, Any]:
    """A trial cell's `validation` entry: the fraction of each client's training split held out,
    and, where the metric scores the union of the clients' validation splits, `global_test:
    [union]` (engine.beyond.validation_tests), set only then, so every other trial keeps its hash."""
    union = tuning["metric"]["model"] in UNION_MODELS
    return {"from_train": tuning["val_fraction"], **({"global_test": ["union"]} if union else {})}


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
    t["metric"] = check_metric(block.get("metric") or {})
    if t["select"] not in SELECTIONS:
        raise ConfigError(f"config key 'tuning.select' has value {show(t['select'])}; allowed: one of "
                          f"{_allowed_names(SELECTIONS)}")
    if t["search"] == "random" and t["samples"] is None:
        raise ConfigError("config key 'tuning.samples' is missing; allowed: an integer >= 1 (the number of grid points "
                          "tuning.search: random draws)")
    unknown = sorted(set(t["methods"]) - set(methods))
    if unknown:
        raise ConfigError(f"config key 'tuning.methods' names {show(unknown)}; allowed: the experiment's method labels "
                          f"{sorted(methods)}")
    per_seed = t["select"] == "per_seed"
    tuning_seeds = t["seeds"] if t["seeds"] is not None else (list(seeds) if per_seed else seeds[:1])
    untuned_seeds = [s for s in seeds if s not in tuning_seeds]
    if per_seed and untuned_seeds:
        raise ConfigError(f"config key 'tuning.seeds' has value {show(tuning_seeds)}, without seed(s) {show(untuned_seeds)} "
                          f"of `seeds`; allowed: every seed of `seeds` {show(list(seeds))} with tuning.select: per_seed "
                          "(each final seed trains with the winner of its own tuning seed), or leave tuning.seeds unset")
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
        check_metric_fits(t["metric"], label, method)
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
            "select": t["select"], "search": t["search"], "samples": t["samples"], "sample_seed": t["sample_seed"],
            "labels": labels}


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
    """Which model's validation scores a trial is scored by: auto resolves to personal or global
    (personalized where the method has one); every other model names itself."""
    if model == "auto":
        return "personal" if "personal_acc" in summary else "global"
    return model


def metric_key(metric: dict, summary: dict) -> str:
    """The summary_val entry a trial is scored by, e.g. personal_acc or union_hm_f1."""
    return f"{metric_kind(metric['model'], summary)}_{metric.get('measure', DEFAULT_MEASURE)}"


def trial_score(metrics: dict, metric: dict) -> float:
    """A trial run's validation score: `metric.stat` over clients of the last round's validation
    score (`summary_val` in metrics.json; `metric.measure`, accuracy by default). The test split is
    not read. NaN for a failed run."""
    if metrics.get("status") != "ok":
        return math.nan
    summary = metrics.get("summary_val")
    if not summary:
        raise ConfigError(f"metrics of {show(metrics['cell'])} have no validation scores (summary_val); allowed: the "
                          f"metrics.json of a tuning trial (results/<experiment>/tuning/...)")
    key = metric_key(metric, summary)
    if key not in summary:
        why = ("a trial scores the union of the validation splits only where its experiment's tuning.metric.model asks "
               "for it" if metric["model"] in UNION_MODELS else f"allowed: 'auto' or the model the method has")
        raise ConfigError(f"tuning metric model {metric['model']!r}: the run of {show(metrics['cell']['method'])} has no "
                          f"{key} in summary_val; {why}")
    v = summary[key][metric["stat"]]
    return math.nan if v is None else float(v)


def _best(candidates: list[tuple[dict, float | None]]) -> tuple[dict, float] | None:
    """The (trial, score) with the highest score (ties: the first in grid order); None if none scored."""
    best = None
    for trial, score in candidates:
        if score is not None and (best is None or score > best[1]):
            best = (trial, score)
    return best


def seed_winners(trials: list[dict], label: Any) -> dict[str, dict[str, Any]]:
    """`select: per_seed`: per tuning seed ("seed<k>"), the trial with its best validation score."""
    seeds = sorted({s for t in trials for s in t["scores"]}, key=lambda s: int(s.removeprefix("seed")))
    out = {}
    for seed in seeds:
        best = _best([(t, t["scores"].get(seed)) for t in trials])
        if best is None:
            raise ConfigError(f"every tuning trial of {show(label)} failed (diverged) in tuning {seed}; nothing to select "
                              "for that seed: allowed: a search space with at least one trial that trains there")
        out[seed] = {"id": best[0]["id"], "values": best[0]["values"], "score": best[1]}
    return out


def select_winner(plan: dict, runs: list[dict], metric: dict, select: str = "pooled") -> dict[str, Any]:
    """The selection record of one (dataset, partition, label): every trial's validation score per
    tuning seed and their mean, and the winner (highest mean; ties: the first trial in grid order).
    `select: per_seed` adds each tuning seed's own winner (`winners_by_seed`), what the final cell of
    that seed trains with (`winner_for`).

    plan: {"trials": [{id, values}], ...}; runs: (trial id, seed, metrics.json dict) as dicts
    {"trial", "seed", "metrics"}. Trials whose runs all failed are kept with score None.
    """
    by_trial: dict[str, dict[int, float]] = {t["id"]: {} for t in plan["trials"]}
    for run in runs:
        by_trial[run["trial"]][int(run["seed"])] = trial_score(run["metrics"], metric)
    trials = []
    for t in plan["trials"]:
        scores = by_trial[t["id"]]
        ok = [s for s in scores.values() if not math.isnan(s)]
        score = float(np.mean(ok)) if ok and len(ok) == len(scores) else None  # a failed seed fails the trial
        trials.append({"id": t["id"], "values": t["values"], "score": score,
                       "scores": {f"seed{k}": (None if math.isnan(v) else v) for k, v in sorted(scores.items())}})
    best = _best([(t, t["score"]) for t in trials])
    if best is None:
        raise ConfigError(f"every tuning trial of {show(plan.get('label'))} failed (diverged); nothing to select: "
                          f"allowed: a search space with at least one trial that trains (lower the learning rates)")
    kinds = {metric_kind(metric["model"], r["metrics"]["summary_val"]) for r in runs if r["metrics"].get("status") == "ok"}
    record = {"schema": SELECTION_SCHEMA, "metric": {**metric, "model_used": sorted(kinds), "split": "val"},
              "params": sorted(plan["space"]), "space": plan["space"], "trials": trials,
              "winner": {"id": best[0]["id"], "values": best[0]["values"], "score": best[1]}}
    if select == "per_seed":
        record |= {"select": select, "winners_by_seed": seed_winners(trials, plan.get("label"))}
    return record


def winner_for(selection: dict[str, Any], seed: int, where: str) -> dict[str, Any]:
    """The winner a final cell of `seed` trains with: its own tuning seed's (a per_seed selection),
    else the selection's one winner. `where`: the selection file, for the error."""
    if selection.get("select") != "per_seed":
        return selection["winner"]
    winners = selection.get("winners_by_seed") or {}
    if f"seed{seed}" not in winners:
        raise ConfigError(f"argument --tuned: {where} selects per seed for seeds {show(sorted(winners))}, not this cell's "
                          f"seed {seed}; allowed: a selection whose tuning seeds hold every final seed")
    return winners[f"seed{seed}"]


# -- what `fedrepro select` and `fedrepro train --tuned` read, checked (issue 57) ---------------------

_ABSENT = object()  # a key a document lacks
#: What to do with a trial's files that do not belong where they are.
_REDO_TRIAL = "delete the trial's folder and rerun the workflow (it retrains that trial)"
#: The keys of a record that replays one recorded winner without the trials it was picked from (what
#: `fedrepro verify` writes to retrain a recorded tuned cell): there is nothing to recompute it from.
REPLAY_KEYS = frozenset({"dataset", "partition", "label", "method", "winner", "select", "winners_by_seed"})
#: How closely a recorded trial score must equal the mean recomputed from its seeds' scores (the same
#: float64 mean of the same numbers; the tolerance only absorbs another numpy's summation order).
SCORE_REL_TOL = 1e-12


def _applied(cell: dict, key: str) -> Any:
    """The value tuned parameter `key` has in a trained cell (lr: training.optimizer.lr), or _ABSENT."""
    if key == "lr":
        training = cell.get("training")
        block = training.get("optimizer") if isinstance(training, dict) else None
    else:
        block = cell.get("hparams")
    return block.get(key, _ABSENT) if isinstance(block, dict) else _ABSENT


def _shown(value: Any) -> str:
    return "absent" if value is _ABSENT else show(value)


def _trial_cell(path: Path, doc: dict) -> tuple[Path, dict]:
    """(provenance.json beside the trial metrics `doc` at `path`, the cell it records), refused unless
    that cell hashes to the cell_key the metrics' identity records: a metrics.json copied from another
    trial, or either file edited, no longer pairs with the cell trained there."""
    from .custody import ResultsError, read_bounded_json
    from .io import short_hash

    identity = doc.get("identity")
    if not isinstance(identity, dict):
        raise ResultsError(f"{path}: field 'identity' is {_shown(doc.get('identity', _ABSENT))}; allowed: the identity "
                           f"`fedrepro train` records in a "
                           f"tuning trial's metrics.json; {_REDO_TRIAL}")
    provenance = path.parent / "provenance.json"
    prov = read_bounded_json(provenance, what="provenance file")
    cell = prov.get("cell") if isinstance(prov, dict) else None
    if not isinstance(cell, dict):
        raise ResultsError(f"{provenance}: field 'cell' is {show(cell)}; allowed: the trial's resolved cell, as "
                           f"`fedrepro train` records it; {_REDO_TRIAL}")
    if short_hash(cell) != identity.get("cell_key"):
        raise ResultsError(f"{path}: field 'identity.cell_key' is {show(identity.get('cell_key'))}, but the cell of "
                           f"{provenance} hashes to {short_hash(cell)!r}; allowed: the metrics of the cell trained in "
                           f"this folder (a metrics.json copied from another trial, or one of the files edited); "
                           f"{_REDO_TRIAL}")
    return provenance, cell


def check_trial_run(spec: dict, run: dict) -> None:
    """ResultsError, one line naming the file and the field, unless the trial metrics `run["metrics"]`
    (read from `run["path"]`) are what `spec` (the select rule's --spec) lists there: the cell trained
    there (provenance.json, paired by the metrics' cell_key) is this trial's and seed's, of the spec's
    dataset, partition, label and method, with the trial's values. (Their summaries against their
    per-client scores: verify.check_summaries, which `fedrepro select` calls; verify imports this module.)"""
    from .custody import ResultsError

    path = Path(run["path"])
    provenance, cell = _trial_cell(path, run["metrics"])
    expected = {**{k: spec[k] for k in ("dataset", "partition", "label", "method")}, "trial": run["trial"],
                "seed": run["seed"]}
    for key, want in expected.items():
        if cell.get(key, _ABSENT) != want:
            raise ResultsError(f"{provenance}: field 'cell.{key}' is {_shown(cell.get(key, _ABSENT))}; allowed: "
                               f"{show(want)}, as the select spec lists {path} (trial {run['trial']}, seed {run['seed']}: "
                               f"a trial's folder copied over another's); {_REDO_TRIAL}")
    values = next(t["values"] for t in spec["trials"] if t["id"] == run["trial"])
    for key, want in values.items():
        got = _applied(cell, key)
        if got != want:
            field = "training.optimizer.lr" if key == "lr" else f"hparams.{key}"
            raise ResultsError(f"{provenance}: field 'cell.{field}' is {_shown(got)}; allowed: {show(want)}, the value of "
                               f"{key} of trial {run['trial']}; {_REDO_TRIAL}")


def select_checked(spec: dict, runs: list[dict]) -> dict[str, Any]:
    """`fedrepro select`: the selection record of `spec`'s runs ({trial, seed, metrics, path}), refused unless
    every run passes check_trial_run. (Where every trial failed, select_winner says so first: nothing is
    selected then, whatever the files hold.)"""
    record = select_winner(spec, runs, spec["metric"], spec.get("select", "pooled"))
    for run in runs:
        check_trial_run(spec, run)
    return record


def _refuse(path: str, field: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"argument --tuned: {path}: field '{field}' has value {_shown(value)}; allowed: {allowed}")


def _check_value(path: str, field: str, key: str, value: Any, method: str) -> None:
    """ConfigError unless `value` of tuned parameter `key` (field `field` of the selection at `path`) is one a
    config may give it: a parameter of `method`, or lr, within its bounds (Param.check; lr: LR_PARAM, as
    tuning.lr's values are held to), so that no record trains what no config could (an lr of 1e300)."""
    from .methods import METHODS

    declared = METHODS.get(method).hparams
    param = LR_PARAM if key == "lr" else declared.get(key)
    if param is None:
        raise _refuse(path, field, value, f"a value of a parameter of method {method!r} "
                      f"({', '.join(sorted([*declared, 'lr']))}); {key!r} is none")
    if value is None and param.default is None:
        return  # the parameter's "derive it" default (e.g. FedBABU's finetune_lr)
    param.check(f"argument --tuned: {path}", field, value)


def check_tuned_values(values: Any, method: str, path: str, field: str) -> None:
    """ConfigError unless `values` (field `field` of the selection at `path`) are bounded values of
    parameters of `method` (_check_value)."""
    if not isinstance(values, dict):
        raise _refuse(path, field, values, "a mapping of tuned parameter -> value")
    for key, value in values.items():
        _check_value(path, f"{field}.{key}", key, value, method)


def _same_score(recorded: Any, recomputed: float | None) -> bool:
    if recomputed is None:
        return recorded is None
    return isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and math.isclose(
        recorded, recomputed, rel_tol=SCORE_REL_TOL, abs_tol=SCORE_REL_TOL)


def _check_record_space(path: str, space: Any, method: str) -> None:
    """The record's space {param: [values]}: parameters of `method`, non-empty lists of bounded values."""
    if not isinstance(space, dict) or not space:
        raise _refuse(path, "space", space, "a non-empty mapping of tuned parameter -> list of values")
    for key, values in space.items():
        if not isinstance(values, list) or not values:
            raise _refuse(path, f"space.{key}", values, "a non-empty list of values")
        for i, value in enumerate(values):
            _check_value(path, f"space.{key}[{i}]", key, value, method)


_SEED_KEY = re.compile(r"seed\d{1,9}")


def _recomputed_score(path: str, where: str, scores: Any) -> float | None:
    """A trial's score as select_winner computes it from its seeds' scores: their mean, None where one failed."""
    if not isinstance(scores, dict) or not scores:
        raise _refuse(path, f"{where}.scores", scores, "a mapping 'seed<k>' -> score (null: a failed run)")
    for seed, score in scores.items():
        number = isinstance(score, (int, float)) and not isinstance(score, bool)
        if not _SEED_KEY.fullmatch(seed) or not (score is None or number):
            raise _refuse(path, f"{where}.scores.{seed}", score, "a score (a number, or null for a failed run) per "
                          "tuning seed 'seed<k>'")
    ok = [s for s in scores.values() if s is not None]
    return float(np.mean(ok)) if ok and len(ok) == len(scores) else None


def _check_record_trials(path: str, trials: Any, space: dict[str, list]) -> list[dict]:
    """The record's trials: each a point of `space` named by its content address (trial_id), its score
    the mean of its seeds' scores."""
    if not isinstance(trials, list) or not trials:
        raise _refuse(path, "trials", trials, "a non-empty list of {id, values, score, scores}")
    ids: set[str] = set()
    for i, t in enumerate(trials):
        where = f"trials[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("values"), dict):
            raise _refuse(path, where, t, "{id, values, score, scores}, as `fedrepro select` writes a trial")
        if set(t["values"]) != set(space):
            raise _refuse(path, f"{where}.values", t["values"], f"a value of each parameter of the space "
                          f"({', '.join(sorted(space))})")
        for key, value in t["values"].items():
            if value not in space[key]:
                raise _refuse(path, f"{where}.values.{key}", value, f"one of {show(space[key])}, the space's values")
        if t.get("id", _ABSENT) != trial_id(t["values"]) or t["id"] in ids:
            raise _refuse(path, f"{where}.id", t.get("id", _ABSENT), f"{trial_id(t['values'])!r}, the content address "
                          "of its values, which no other trial has")
        ids.add(t["id"])
        mean = _recomputed_score(path, where, t.get("scores"))
        if not _same_score(t.get("score", _ABSENT), mean):
            raise _refuse(path, f"{where}.score", t.get("score", _ABSENT), f"{show(mean)}, the mean of its seeds' scores")
    return trials


def _same_winner(path: str, field: str, got: Any, want: dict[str, Any]) -> None:
    same = (isinstance(got, dict) and got.get("id") == want["id"] and got.get("values") == want["values"]
            and _same_score(got.get("score", _ABSENT), want["score"]))
    if not same:
        raise _refuse(path, field, got, f"{show(want)}, the winner recomputed from its trials' scores (the record was "
                      "edited: delete it and rerun the workflow, whose select rule writes it again)")


def check_selection(sel: dict, path: str, method: str) -> None:
    """ConfigError, one line naming the file, the field, its value and what is allowed, unless the select
    record `sel` recomputes from its own trials: a record of `method` (schema SELECTION_SCHEMA) whose
    space holds bounded values of the method's parameters, whose every trial is a point of that space
    named by its content address with its score the mean of its seeds' scores, and whose winner (per_seed:
    each seed's) is the best of them. A record of REPLAY_KEYS only (one recorded winner, no trials) has
    nothing to recompute: it is said so in a warning, and its values are bounded by `tuned_winner`."""
    if set(sel) <= REPLAY_KEYS:
        if not isinstance(sel.get("winners_by_seed", {}), dict):
            raise _refuse(path, "winners_by_seed", sel["winners_by_seed"], "a mapping 'seed<k>' -> {id, values}")
        print(f"[fedrepro] warning: --tuned {path} names a winner without the trials it was selected from (as `fedrepro "
              "verify` writes one to retrain a recorded cell): its values are checked against the method's bounds, "
              "not recomputed from trials", file=sys.stderr)
        return
    if sel.get("schema", _ABSENT) != SELECTION_SCHEMA:
        raise _refuse(path, "schema", sel.get("schema", _ABSENT), f"{SELECTION_SCHEMA!r}, the record `fedrepro select` "
                      "writes")
    if sel.get("method", _ABSENT) != method:
        raise _refuse(path, "method", sel.get("method", _ABSENT), f"{method!r}, the method of the cell it tunes")
    space = sel.get("space")
    _check_record_space(path, space, method)
    trials = _check_record_trials(path, sel.get("trials"), space)
    best = _best([(t, t["score"]) for t in trials])
    if best is None:
        raise _refuse(path, "trials", [t["id"] for t in trials], "at least one trial with a score (every one failed: "
                      "`fedrepro select` selects nothing then)")
    _same_winner(path, "winner", sel.get("winner", _ABSENT), {"id": best[0]["id"], "values": best[0]["values"],
                                                               "score": best[1]})
    if sel.get("select") == "per_seed":
        want = seed_winners(trials, sel.get("label"))
        got = sel.get("winners_by_seed", _ABSENT)
        if not isinstance(got, dict) or set(got) != set(want):
            raise _refuse(path, "winners_by_seed", got, f"a winner for each tuning seed of its trials, {sorted(want)}")
        for seed, winner in want.items():
            _same_winner(path, f"winners_by_seed.{seed}", got[seed], winner)


def tuned_winner(sel: dict, path: str, cell: dict) -> dict[str, Any]:
    """The winner {id, values} a final `cell` trains with from the select record `sel` (read from `path`),
    after check_selection; its values bounded as a config's (check_tuned_values): ConfigError otherwise."""
    check_selection(sel, path, cell["method"])
    winner = winner_for(sel, cell["seed"], path)
    field = f"winners_by_seed.seed{cell['seed']}" if sel.get("select") == "per_seed" else "winner"
    if not isinstance(winner, dict) or not isinstance(winner.get("id"), str):
        raise _refuse(path, field, winner, "{id: the trial's id, values: {parameter: value}, score}")
    check_tuned_values(winner.get("values", _ABSENT), cell["method"], path, f"{field}.values")
    return winner
