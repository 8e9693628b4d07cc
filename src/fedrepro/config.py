"""Experiment configs: validation (JSON schema + registries) and expansion into cells.

A cell is one training job: dataset x partition x method label x seed, with its model,
hyper-parameters and training setup fully resolved. Every error names the config key,
the value and what is allowed, and is raised before any job runs.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .data.datasets import DATASETS
from .data.shards import partition_id, resolve_partition_spec
from .io import short_hash
from .methods import METHODS
from .models import MODELS
from .registry import ConfigError, resolve_params

TRAINING_DEFAULTS: dict[str, Any] = {
    "rounds": 10,
    "participation": 1.0,
    "local_epochs": 1,
    "batch_size": 10,
    "drop_last": False,
    "optimizer": {"name": "sgd", "lr": 0.005, "momentum": 0.0, "weight_decay": 0.0},
    "lr_schedule": {"name": "constant", "milestones": [], "gamma": 0.1, "values": [], "min_lr": 0.0},
    "eval_every": 1,
    "global_test": [],  # after training, also evaluate on: "union" (of the clients' test splits), "official" (test set)
    "checkpoint_every": 5,
    "eval_batch_size": 1024,
    "augment": "none",
    "deterministic": True,
}

# Experiment-wide evaluation rules (not per method: every row must be scored alike).
EVALUATION_DEFAULTS: dict[str, Any] = {
    "untrained": "personalize",  # how a client that has not trained yet is scored (engine.UNTRAINED_RULES)
}

# The model a dataset gets when the config names none.
DEFAULT_MODELS = {"fmnist": "fedavg_cnn", "digits": "mlp", "synthetic": "mlp",
                  **dict.fromkeys(("mnist", "emnist", "cifar10", "cifar100", "svhn", "usps"), "fedavg_cnn"),  # PFLlib's "cnn"
                  "stl10": "resnet18_cifar", **dict.fromkeys(("mnistm", "syn", "digit5"), "fedavg_cnn"),
                  **dict.fromkeys(("pacs", "domainnet"), "resnet18_cifar"), "mitbih": "resnet1d"}


def schema() -> dict:
    return yaml.safe_load(resources.files("fedrepro").joinpath("schemas/experiment.schema.yaml").read_text())


def _allowed(err: jsonschema.ValidationError) -> str:
    v, val = err.validator, err.validator_value
    return {
        "minimum": f">= {val}", "exclusiveMinimum": f"> {val}", "maximum": f"<= {val}", "exclusiveMaximum": f"< {val}",
        "type": f"type {val}", "enum": f"one of {val}", "pattern": f"a name matching {val}",
        "minItems": f"at least {val} item(s)", "minProperties": f"at least {val} entr(y/ies)", "uniqueItems": "no duplicates",
    }.get(v, err.message)


def _schema_errors(config: dict) -> None:
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if not errors:
        return
    err = errors[0]
    where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        raise ConfigError(f"config key '{where}': unknown key(s) {extra}; allowed keys: {', '.join(allowed)}")
    if err.validator == "required":
        raise ConfigError(f"config key '{where}': {err.message}; required keys: {', '.join(err.validator_value)}")
    if err.validator == "propertyNames":
        raise ConfigError(f"config key '{where}': {err.message}; allowed: names of letters, digits, '_', '.', '-'")
    raise ConfigError(f"config key '{where}' has value {err.instance!r}; allowed: {_allowed(err)}")


def _merge(base: dict, override: dict | None) -> dict:
    out = copy.deepcopy(base)
    for k, v in (override or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def resolve_training(training: dict | None, where: str, num_clients: int | None = None) -> dict:
    t = _merge(TRAINING_DEFAULTS, training)
    p = t["participation"]
    if isinstance(p, float) and p > 1:
        raise ConfigError(f"config key '{where}.participation' has value {p}; allowed: a fraction in (0, 1] or an integer count >= 1")
    if isinstance(p, int) and num_clients is not None and p > num_clients:
        raise ConfigError(f"config key '{where}.participation' has value {p}; allowed: at most the {num_clients} training clients (num_clients - unseen_clients)")
    s = t["lr_schedule"]
    if s["name"] == "multistep":
        if sorted(s["milestones"]) != list(s["milestones"]) or not s["milestones"]:
            raise ConfigError(f"config key '{where}.lr_schedule.milestones' has value {s['milestones']}; allowed: a non-empty increasing list of rounds")
        if s["values"] and len(s["values"]) != len(s["milestones"]) + 1:
            raise ConfigError(f"config key '{where}.lr_schedule.values' has value {s['values']}; allowed: len(milestones) + 1 = {len(s['milestones']) + 1} learning rates")
    if s["name"] == "cosine":
        s["total_rounds"] = t["rounds"]
    return t


def load_config(path: str | Path) -> dict:
    with open(path) as fh:
        return yaml.safe_load(fh)


def resolve_experiment(config: dict) -> dict[str, Any]:
    """Validate `config` and return {"experiment", "datasets", "partitions", "cells"}.

    partitions: list of {dataset, label, id, spec}; cells: list of resolved cell dicts.
    """
    _schema_errors(config)
    name = config["experiment"]
    datasets: dict[str, dict] = {}
    for ds, entry in config["datasets"].items():
        entry = entry or {}
        spec = DATASETS.entry(ds).obj if ds in DATASETS else None
        if spec is None:
            raise ConfigError(f"config key 'datasets.{ds}': unknown dataset {ds!r}; allowed: {', '.join(DATASETS.names())}")
        params = resolve_params(f"config key 'datasets.{ds}.params'", spec.params, entry.get("params"))
        model = entry.get("model") or {"name": DEFAULT_MODELS.get(ds, "mlp")}
        if model["name"] not in MODELS:
            raise ConfigError(f"config key 'datasets.{ds}.model.name' has value {model['name']!r}; allowed: {', '.join(MODELS.names())}")
        model_params = resolve_params(f"config key 'datasets.{ds}.model.params'", MODELS.entry(model["name"]).params, model.get("params"))
        datasets[ds] = {"params": params, "model": {"name": model["name"], "params": model_params},
                        "num_classes": spec.num_classes, "prepared_id": short_hash(params, 8), "training": entry.get("training") or {}}
    partitions = []
    for ds, dsinfo in datasets.items():
        for label, p in config["partitions"].items():
            where = f"config key 'partitions.{label}'"
            only = p.get("datasets")
            unknown = sorted(set(only or []) - set(config["datasets"]))
            if unknown:
                raise ConfigError(f"config key 'partitions.{label}.datasets' has value {only}; unknown {unknown}; allowed: the experiment's datasets {sorted(config['datasets'])}")
            if only and ds not in only:
                continue
            p = {k: v for k, v in p.items() if k != "datasets"}
            if p["partitioner"] not in _partitioner_names():
                raise ConfigError(f"config key 'partitions.{label}.partitioner' has value {p['partitioner']!r}; allowed: {', '.join(_partitioner_names())}")
            spec = {"dataset": ds, "dataset_params": dsinfo["params"], **p}
            try:
                resolved = resolve_partition_spec(spec)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            k = resolved["params"].get("num_classes_per_partition")
            if k is not None and k > dsinfo["num_classes"]:
                raise ConfigError(f"config key 'partitions.{label}.params.num_classes_per_partition' has value {k}; allowed: at most the {dsinfo['num_classes']} classes of {ds}")
            partitions.append({"dataset": ds, "label": label, "id": partition_id(spec), "spec": resolved})
    base_training = config.get("training") or {}
    evaluation = _merge(EVALUATION_DEFAULTS, config.get("evaluation"))
    cells = []
    methods = {}
    for label, m in config["methods"].items():
        m = m or {}
        method = m.get("method", label)
        if method not in METHODS:
            raise ConfigError(f"config key 'methods.{label}': unknown method {method!r}; allowed: {', '.join(METHODS.names())}")
        entry = METHODS.entry(method)
        hp = resolve_params(f"config key 'methods.{label}.hparams' (method '{method}')", entry.params, m.get("hparams"))
        methods[label] = (method, hp, m.get("training"))
    for part in partitions:
        ds = part["dataset"]
        for label, (method, hp, method_training) in methods.items():
            # precedence: experiment < dataset < method; an error names the most specific key given
            training = _merge(_merge(base_training, datasets[ds]["training"]), method_training)
            where = (f"methods.{label}.training" if method_training else f"datasets.{ds}.training" if datasets[ds]["training"] else "training")
            spec = part["spec"]
            t = resolve_training(training, where, spec["num_clients"] - spec["unseen_clients"])
            if "official" in t["global_test"] and spec["pool"]:
                raise ConfigError(f"config key '{where}.global_test' has value {t['global_test']}; allowed: 'official' only with "
                                  f"a partition that keeps the official test set apart (partitions.{part['label']}.pool: false)")
            for seed in config["seeds"]:
                cells.append({
                    "experiment": name, "dataset": ds, "partition": part["label"], "partition_id": part["id"],
                    "method": method, "label": label, "hparams": hp, "model": datasets[ds]["model"],
                    "seed": seed, "training": t, "evaluation": evaluation,
                })
    return {"experiment": name, "datasets": datasets, "partitions": partitions, "cells": cells}


def _partitioner_names() -> list[str]:
    from .data.partitioners import PARTITIONERS

    return PARTITIONERS.names()
