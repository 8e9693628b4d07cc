"""Experiment configs: validation (JSON schema + registries) and expansion into cells.

A cell is one training job: dataset x partition x method label x seed, with its model,
hyper-parameters and training setup fully resolved. Every error names the config key,
the value and what is allowed, and is raised before any job runs.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

import jsonschema
import yaml

from .configfile import check_plain, plain_copy, read_config_file
from .data.datasets import DATASETS, group_columns, has_official_test, sample_bounds, sample_shape
from .data.shards import partition_id, resolve_partition_spec
from .engine.data import CROP_PADDING, augment_problem
from .io import short_hash
from .methods import METHODS
from .models import MODELS, input_problem
from .models.pretrain import PROXY_WEIGHTS, pretrain_spec
from .plugins import require as require_plugins
from .tracking import TRACKING_DEFAULTS, check_available
from .overrides import blame, key_path, nested, parse_item
from .registry import (HARD_NUMBER_MAX, SANITY_MAX, ConfigError, cells_over, large_budgets_allowed, lift_hint, resolve_params,
                       show)
from .tuning import apply_values, resolve_tuning, trial_validation

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
    # NHWC convolution weights on the CPU (oneDNN: fedavg_cnn steps 1.2x, cnn4 1.5x, evaluation 1.7-2.8x;
    # benchmarks/layouts.py, docs/throughput.md); GPUs keep the default layout (unmeasured there). Cells of older versions
    # lack the key and ran the default layout: the engine reads an absent key as false.
    "channels_last": "auto",
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


# Names that become folders (results/<experiment>/, runs/<dataset>/<partition>/<label>/) and
# Snakemake wildcards: matched in full (re.fullmatch; `$` would also match before a final
# newline), bounded in length, and never one of the shared folders under results/.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
NAME_MAX = 64
RESERVED_NAMES = ("raw", "shards", "logs")  # results/<name>/ folders shared by every experiment
_NAME_RE = re.compile(NAME_PATTERN)
NAME_RULE = (f"a name of 1 to {NAME_MAX} characters from letters, digits, '_', '.', '-', starting with a letter or digit")

# Sanity bounds on the compute a config may ask for (a typo such as rounds: 1000000000000 plans
# jobs that never end). No shipped config comes near them; FEDREPRO_ALLOW_LARGE_BUDGETS=1 lifts them.
BUDGETS = {
    "rounds": 10_000,
    "local_epochs": 1_000,
    "rounds_x_local_epochs": 100_000,
    "batch_size": 65_536,
    "eval_batch_size": 65_536,
    "num_clients": 100_000,
    "cells": 10_000,
}
# The numbers of a training block (optimizer lr, momentum, weight_decay; lr_schedule gamma, values,
# min_lr, milestones; the *_every counts) are bounded like every other numeric parameter
# (registry.SANITY_MAX, lifted with the budgets) and, lifted or not, by TRAINING_NUMBER_MAX: torch
# takes them as float32 scalars (3.4e38 at most; 1e308 is an overflow traceback in the job) and the
# job multiplies up to three of them (lr x gamma^k x weight_decay), which stays in range below 1e12.
TRAINING_NUMBER_MAX = HARD_NUMBER_MAX


@functools.cache
def _parsed_schema() -> dict:
    """The package's config schema, parsed once per process (it is package data: it does not change)."""
    return yaml.safe_load(resources.files("fedrepro").joinpath("schemas/experiment.schema.yaml").read_text())


def schema() -> dict:
    return copy.deepcopy(_parsed_schema())


# JSON Schema's "integer" accepts 3.0; a config's integers must be written as integers.
_VALIDATOR = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, x: isinstance(x, int) and not isinstance(x, bool)),
)


def check_name(where: str, value: Any, reserved: bool = False) -> None:
    """ConfigError unless `value` is a safe name (see NAME_PATTERN); `reserved`: also not a shared folder."""
    if not isinstance(value, str):
        return  # the schema reports the type
    if not _NAME_RE.fullmatch(value) or (reserved and value.lower() in RESERVED_NAMES):
        rule = NAME_RULE + (f", not one of {', '.join(RESERVED_NAMES)}" if reserved else "")
        raise ConfigError(f"config key '{where}' has value {show(value)}; allowed: {rule}")


def _check_names(config: dict) -> None:
    if not isinstance(config, dict):
        return
    check_name("experiment", config.get("experiment"), reserved=True)
    for section in ("partitions", "methods"):
        labels = config.get(section)
        for label in labels if isinstance(labels, dict) else ():
            if not isinstance(label, str) or not _NAME_RE.fullmatch(label):
                raise ConfigError(f"config key '{section}' has the label {show(label)}; allowed: {NAME_RULE}")


# -- sweeps: methods.<label>.sweep: {hparams.mu: [0.01, 0.1]} -> labels <label>-mu0.01, <label>-mu0.1
SWEEP_ROOTS = ("hparams", "training", "model")  # what a sweep may vary: the keys of a methods entry


def _sweep_text(where: str, value: Any) -> str:
    """A swept value as it appears in a label (a name: letters, digits, '_', '.', '-')."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, (int, float)):
        return repr(value).replace("+", "")
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        return value
    raise ConfigError(f"config key '{where}' has the value {show(value)}; allowed: numbers, booleans, null or names of "
                      "letters, digits, '_', '.', '-' (a swept value becomes part of the label; give other values a "
                      "label of their own in `methods`)")


def _sweep_points(label: str, sweep: Any, per_label: int = 1, other_labels: int = 0) -> list[tuple[str, dict]]:
    """[(label, {dotted key: value})] of a methods entry's sweep: every combination of the values.
    ConfigError, before one is built, where they and `other_labels`, `per_label` cells each, would
    make more than the cell budget."""
    where = f"methods.{label}.sweep"
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: dict) -> None:  # {hparams: {mu: [..]}} and {hparams.mu: [..]} alike
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                flat[f"{prefix}{k}"] = v

    if isinstance(sweep, dict):
        walk("", sweep)
    if not flat:
        raise ConfigError(f"config key '{where}' has value {show(sweep)}; allowed: a mapping of keys to lists of values, "
                          "e.g. {hparams.mu: [0.01, 0.1, 1.0]}")
    names = [k.rpartition(".")[2] for k in flat]
    texts = []
    for (key, values), name in zip(flat.items(), names):
        if key.split(".")[0] not in SWEEP_ROOTS or "." not in key:
            raise ConfigError(f"config key '{where}.{key}' is not a key of a methods entry; allowed: keys under "
                              f"{', '.join(SWEEP_ROOTS)} (e.g. hparams.mu, training.optimizer.lr)")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"config key '{where}.{key}' has value {show(values)}; allowed: a non-empty list of values")
        shown = [_sweep_text(f"{where}.{key}", v) for v in values]
        if len(set(shown)) < len(shown):
            raise ConfigError(f"config key '{where}.{key}' has value {show(values)}; allowed: distinct values")
        prefix = key.replace(".", "_") if names.count(name) > 1 else name
        texts.append([f"{prefix}{t}" for t in shown])
    size = 1
    for values in flat.values():
        size *= len(values)
    cells = (size + other_labels) * per_label  # from the list lengths: 10 keys x 10 values are never built
    allowed = cells_over(cells, BUDGETS["cells"])
    if allowed:
        sizes = " x ".join(f"{key}: {len(values)}" for key, values in flat.items())
        raise ConfigError(f"config key '{where}' makes {size:,} labels ({sizes} values); with {other_labels} other label(s) "
                          f"and {per_label} cell(s) per label (datasets x partitions x seeds) that is {cells:,} cells; "
                          f"allowed: {allowed}")
    points = []
    for combo, text in zip(itertools.product(*flat.values()), itertools.product(*texts)):
        new = "-".join((label, *text))
        if not _NAME_RE.fullmatch(new):
            raise ConfigError(f"config key '{where}' makes the label {show(new)}; allowed: {NAME_RULE} (shorten the label "
                              "or the values)")
        points.append((new, dict(zip(flat, combo))))
    return points


def expand_sweeps(config: Any) -> tuple[Any, dict[str, dict]]:
    """(config with every methods entry that has a `sweep` replaced by one entry per point,
    {generated label: {dotted key: value}}). Configs without sweeps come back unchanged."""
    methods = config.get("methods") if isinstance(config, dict) else None
    if not isinstance(methods, dict) or not any(isinstance(m, dict) and "sweep" in m for m in methods.values()):
        return config, {}
    out, sweeps = {}, {}
    # the cells each label makes, so a sweep's size is checked against the cell budget before it is built
    per_label = _cells_per_label(config)
    labels = sum(1 for m in methods.values() if not (isinstance(m, dict) and "sweep" in m))
    for label, entry in methods.items():
        if not (isinstance(entry, dict) and "sweep" in entry):
            out[label] = entry
            continue
        if config.get("tuning") is not None:
            raise ConfigError(f"config key 'methods.{label}.sweep' is set in an experiment with `tuning`; allowed: a sweep "
                              "or tuning, not both (tuning would replace the swept values by its own selection)")
        base = {k: v for k, v in entry.items() if k != "sweep"}
        if "finetune" not in base:  # a "+FT" row takes its method from its base label
            base.setdefault("method", label)
        points = _sweep_points(label, entry["sweep"], per_label, labels)
        varied = [key for key in (points[0][1] if points else {}) if not key.startswith("hparams.")]
        if "finetune" in base and varied:
            raise ConfigError(f"config key 'methods.{label}.sweep.{varied[0]}' is set in a fine-tuning row (beside "
                              "'finetune'); allowed: hparams keys (ft_*) only: the row takes its method, training and "
                              f"model from label {show(base['finetune'])}")
        labels += len(points)
        for new, point in points:
            if new in methods or new in out:
                raise ConfigError(f"config key 'methods.{label}.sweep' makes the label {new!r}, which is already a label; "
                                  "allowed: labels that differ from every other label")
            merged = base
            for key, value in point.items():
                merged = _deep_update(merged, nested(key.split("."), value))
            out[new], sweeps[new] = merged, point
    return {**config, "methods": out}, sweeps


def _cells_per_label(config: dict) -> int:
    """The cells one method label makes, (dataset, partition) pairs x seeds, as far as the config (not
    yet checked by the schema) says; at least 1."""
    datasets, partitions, seeds = config.get("datasets"), config.get("partitions"), config.get("seeds")
    names = list(datasets) if isinstance(datasets, dict) else []
    pairs = 0
    for p in partitions.values() if isinstance(partitions, dict) else ():
        only = p.get("datasets") if isinstance(p, dict) else None
        pairs += len([d for d in names if d in only]) if isinstance(only, list) and only else len(names)
    return max(1, pairs) * max(1, len(seeds) if isinstance(seeds, list) else 1)


def _allowed(err: jsonschema.ValidationError) -> str:
    v, val = err.validator, err.validator_value
    return {
        "minimum": f">= {val}", "exclusiveMinimum": f"> {val}", "maximum": f"<= {val}", "exclusiveMaximum": f"< {val}",
        "type": f"type {val}", "enum": f"one of {val}", "pattern": f"a name matching {val}",
        "minItems": f"at least {val} item(s)", "maxItems": f"at most {val} item(s)", "minProperties": f"at least {val} entr(y/ies)",
        "uniqueItems": "no duplicates", "const": f"{val!r}",
    }.get(v) or err.schema.get("description") or f"{v} {show(val)}"


@functools.cache
def _schema_validator():
    return _VALIDATOR(_parsed_schema())


def _schema_errors(config: dict) -> None:
    validator = _schema_validator()
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if not errors:
        return
    err = errors[0]
    where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        raise ConfigError(f"config key '{where}': unknown key(s) {show(extra)}; allowed keys: {', '.join(allowed)}")
    if err.validator == "required":
        raise ConfigError(f"config key '{where}': {err.message}; required keys: {', '.join(err.validator_value)}")
    if err.validator == "propertyNames":
        raise ConfigError(f"config key '{where}': {err.message}; allowed: names of letters, digits, '_', '.', '-'")
    raise ConfigError(f"config key '{where}' has value {show(err.instance)}; allowed: {_allowed(err)}")


def _merge(base: dict, override: dict | None) -> dict:
    out = copy.deepcopy(base)
    for k, v in (override or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def resolve_training(training: dict | None, where: str, num_clients: int | None = None,
                      blocks: list[tuple[str, dict | None]] | None = None, trial: bool = False) -> dict:
    """The training setup `training` (the user's blocks merged, outer to inner) over the defaults;
    `blocks`: those blocks as (config key, block), for errors naming the block that set an option
    (default: `training` itself at `where`); `trial`: a tuning trial (fewer rounds than the final cells)."""
    t = _merge(TRAINING_DEFAULTS, training)
    _check_unused_options(blocks if blocks is not None else [(where, training)])
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
    _check_schedule_reach(blocks if blocks is not None else [(where, training)], t, where, trial)
    if s["name"] == "cosine":
        s["total_rounds"] = t["rounds"]
    _check_levers(where, t)
    k = t.get("personal_eval_every")
    if k is not None and k % t["eval_every"]:
        raise ConfigError(f"config key '{where}.personal_eval_every' has value {k}; allowed: a multiple of "
                          f"'{where}.eval_every' ({t['eval_every']}): the personalized models are scored at evaluations")
    return t


#: Levers of `training.levers` that act inside a vectorized round (engine/vectorized.py), and the
#: optimizers with a fused step (torch's `fused=True`; lightly's LARS has none).
VECTORIZED_LEVERS = ("resident_batches", "fused_step", "cuda_graph", "device_losses")
FUSED_OPTIMIZERS = ("sgd", "adam", "adamw")


#: What each lever of `training.levers` acts on, as the method classes declare it (methods/base.py): (what
#: it needs, whether a method class has it). The levers of a vectorized round act inside a vectorized local
#: update; batched_eval scores personalized models. A lever that acts on none of the methods its block
#: reaches is a config error (`_check_lever_targets`).
LEVER_TARGETS: dict[str, tuple[str, Callable[[type], bool]]] = {
    **{lever: ("a vectorized local update (its class sets vectorized = True)", lambda cls: cls.has_vectorized_update())
       for lever in VECTORIZED_LEVERS},
    "batched_eval": ("personalized models (has_personal)", lambda cls: cls.has_personal),
}


def _note_lever_reach(reach: dict[str, tuple[list, dict[str, str]]], blocks: list[tuple[str, dict | None]], label: str,
                      method: str) -> None:
    """Note in `reach` that method label `label` (method `method`) takes its levers from the innermost of
    the training `blocks` that sets `levers`: block key -> (its levers, {label: method})."""
    key, block = next(((k, b) for k, b in reversed(blocks) if "levers" in (b or {})), (None, None))
    if key is not None:
        reach.setdefault(key, (block["levers"], {}))[1][label] = method


def _check_lever_targets(reach: dict[str, tuple[list, dict[str, str]]]) -> None:
    """ConfigError for a lever of a training block that can act on none of the method labels taking their
    levers from that block (`_note_lever_reach`; LEVER_TARGETS): set, it would change nothing."""
    for key, (levers, labels) in reach.items():
        acting = [lever for lever in levers if any(LEVER_TARGETS[lever][1](METHODS.get(m)) for m in labels.values())]
        for lever in levers:
            if lever not in acting:
                methods = ", ".join(f"'{m}'" + (f" (label '{lab}')" if lab != m else "") for lab, m in labels.items())
                raise ConfigError(f"config key '{key}.levers' has value {levers}; '{lever}' can act on none of the methods "
                                  f"it reaches ({methods}): it needs {LEVER_TARGETS[lever][0]}; allowed: the levers that "
                                  f"act on {'it' if len(labels) == 1 else 'one of them'}: {acting or 'none'}")


def _check_levers(where: str, t: dict) -> None:
    """`training.levers` only where each lever can act: the vectorized ones need `vectorize: true`,
    the CUDA graph needs the resident batches (its replayed step gathers from static row buffers),
    the resident batches no augmentation, the fused step a fused optimizer."""
    levers = t.get("levers") or []
    inside = [lever for lever in levers if lever in VECTORIZED_LEVERS]
    if inside and not t.get("vectorize"):
        raise ConfigError(f"config key '{where}.levers' has value {levers}; allowed: {inside} only with "
                          f"'{where}.vectorize: true' (they act inside a vectorized round); else only batched_eval")
    if "cuda_graph" in levers and "resident_batches" not in levers:
        raise ConfigError(f"config key '{where}.levers' has value {levers}; allowed: cuda_graph together with "
                          "resident_batches (the replayed step gathers its batches from static row buffers)")
    if "resident_batches" in levers and t["augment"] != "none":
        raise ConfigError(f"config key '{where}.levers' has value {levers}; allowed: resident_batches only with "
                          f"'{where}.augment: none' (it is {t['augment']!r}: the augmentation draws from each batch's "
                          "stream between batches, so the round's batch indices cannot be drawn at once)")
    name = t["optimizer"]["name"]
    if "fused_step" in levers and name not in FUSED_OPTIMIZERS:
        raise ConfigError(f"config key '{where}.levers' has value {levers}; allowed: fused_step only with "
                          f"'{where}.optimizer.name' one of {list(FUSED_OPTIMIZERS)} (it is {name!r}, which has no fused step)")


#: The optimizer keys each optimizer reads and the lr_schedule keys each schedule reads (engine.OPTIMIZERS,
#: engine.lr_at); a key the user sets that the chosen one never reads is an error, never silently ignored.
OPTIMIZER_KEYS = {"sgd": {"name", "lr", "momentum", "weight_decay"}, "lars": {"name", "lr", "momentum", "weight_decay"},
                  "adam": {"name", "lr", "weight_decay"}, "adamw": {"name", "lr", "weight_decay"}}
SCHEDULE_KEYS = {"constant": {"name"}, "multistep": {"name", "milestones", "gamma", "values"}, "cosine": {"name", "min_lr"}}


def _check_unused_options(blocks: list[tuple[str, dict | None]]) -> None:
    """ConfigError for an optimizer or lr_schedule option that a training block sets (as written:
    defaults are not options the user set) and that the optimizer or schedule in force at that block
    (its own `name` or the one it inherits) never reads; and for gamma beside values. A key set under one name and inherited by a block that switches to
    another is not reported (the outer block's cells read it; a block cannot unset a key)."""
    merged: dict = {}
    for key_of_block, block in blocks:
        block = block or {}
        merged = _merge(merged, block)
        for section, keys_of in (("optimizer", OPTIMIZER_KEYS), ("lr_schedule", SCHEDULE_KEYS)):
            name = (merged.get(section) or {}).get("name", TRAINING_DEFAULTS[section]["name"])
            for key in sorted(set(block.get(section) or {}) - keys_of[name]):
                raise ConfigError(f"config key '{key_of_block}.{section}.{key}' has value {show(block[section][key])}, which "
                                  f"{section} '{name}' never reads; allowed keys with '{name}': {', '.join(sorted(keys_of[name]))}")
        s = merged.get("lr_schedule") or {}
        if s.get("name") == "multistep" and "values" in s and "gamma" in s and {"values", "gamma"} & set(block.get("lr_schedule") or {}):
            raise ConfigError(f"config key '{key_of_block}.lr_schedule.gamma' has value {show(s['gamma'])} beside lr_schedule.values "
                              f"{show(s['values'])}, which replace it; allowed: either gamma (lr x gamma at each milestone) or values "
                              "(the lr of each phase)")


def _check_schedule_reach(blocks: list[tuple[str, dict | None]], t: dict, where: str, trial: bool) -> None:
    """A schedule in the resolved training `t` that cannot do what it says: a multistep milestone at or
    after the last round (never applies; a tuning trial's fewer rounds excepted) or a cosine min_lr
    the user set at or above the lr."""
    s, lr = t["lr_schedule"], t["optimizer"]["lr"]
    if s["name"] == "multistep" and s["values"] and s["values"][0] != lr:
        raise ConfigError(f"config key '{where}.lr_schedule.values' has value {show(s['values'])}; allowed: values[0] equal to "
                          f"'{where}.optimizer.lr' ({lr}): the values replace the lr, whose value would otherwise be ignored "
                          "(or gamma, which scales it)")
    late = [m for m in s["milestones"] if m >= t["rounds"]]
    if s["name"] == "multistep" and late and not trial:
        raise ConfigError(f"config key '{where}.lr_schedule.milestones' has value {show(s['milestones'])}; allowed: rounds below "
                          f"'{where}.rounds' ({t['rounds']}): a milestone m changes the lr from round m + 1, so {late} never apply")
    if s["name"] == "cosine" and s["min_lr"] >= lr and any("min_lr" in ((b or {}).get("lr_schedule") or {}) for _, b in blocks):
        raise ConfigError(f"config key '{where}.lr_schedule.min_lr' has value {show(s['min_lr'])}; allowed: below "
                          f"'{where}.optimizer.lr' ({lr}): the cosine schedule decays from lr to min_lr")


def load_config(path: str | Path) -> Any:
    """The experiment config in `path`, read strictly (fedrepro.configfile): data, never code;
    ConfigError for duplicate keys, tags, YTE, aliases beyond a small budget, NaN/inf, ..."""
    return read_config_file(path)


def load_experiment(paths: list[str | Path], overrides: dict | None = None, sets: Sequence[str] = ()) -> Any:
    """The config the Snakefile runs: the strictly read files merged as Snakemake merges several
    --configfile (a later file's keys win, nested mappings merged), then `overrides` (a mapping
    merged as given), then the `--set` items (fedrepro.overrides)."""
    merged: Any = None
    for path in paths:
        obj = load_config(path)
        merged = _deep_update(merged, obj) if isinstance(merged, dict) and isinstance(obj, dict) else obj
    if overrides:
        check_plain(overrides)
        merged = _deep_update(merged if isinstance(merged, dict) else {}, plain_copy(dict(overrides)))
    if sets:
        merged, _ = apply_sets(merged, sets)
    return merged


def apply_sets(config: Any, items: Sequence[str]) -> tuple[dict, list[tuple[str, str]]]:
    """`config` with each `KEY=VALUE` item deep-merged in turn (as one more --configfile holding only
    that key), and [(item, the dotted config key it set)]; ConfigError for a malformed item."""
    config = config if isinstance(config, dict) else {}
    applied = []
    for item in items:
        pieces, value = parse_item(item)
        path = key_path(config, pieces)
        config = _deep_update(config, nested(path, plain_copy(value)))
        applied.append((item, ".".join(path)))
    return config, applied


def load_and_resolve(paths: list[str | Path], sets: Sequence[str] = ()) -> tuple[dict, dict[str, Any]]:
    """(merged config, resolved experiment) of config files and `--set` items: only the merged
    result must be a complete experiment. An error at a key an item set names the item."""
    config, applied = load_experiment(paths), []
    if sets:
        config, applied = apply_sets(config, sets)
    try:
        return config, resolve_experiment(config)
    except ConfigError as exc:
        raise blame(exc, applied) from None


def _deep_update(base: dict, new: dict) -> dict:
    out = dict(base)
    for k, v in new.items():
        out[k] = _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _budget(where: str, value: Any, key: str) -> None:
    limit = BUDGETS[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit and not large_budgets_allowed():
        raise ConfigError(f"config key '{where}' has value {show(value)}; allowed: at most {limit:,} {lift_hint()}")


def _check_training_budget(where: str, t: dict) -> None:
    _budget(f"{where}.rounds", t["rounds"], "rounds")
    _budget(f"{where}.local_epochs", t["local_epochs"], "local_epochs")
    _budget(f"{where}.batch_size", t["batch_size"], "batch_size")
    _budget(f"{where}.eval_batch_size", t["eval_batch_size"], "eval_batch_size")
    total = t["rounds"] * t["local_epochs"]
    if total > BUDGETS["rounds_x_local_epochs"] and not large_budgets_allowed():
        raise ConfigError(f"config key '{where}.rounds' x '{where}.local_epochs' = {total:,}; allowed: at most "
                          f"{BUDGETS['rounds_x_local_epochs']:,} local epochs per client {lift_hint()}")
    for key, value in _numbers(t):
        _number_bound(f"{where}.{key}", value)
    s, lr = t["lr_schedule"], t["optimizer"]["lr"]
    if s["name"] == "multistep" and not s["values"] and s["gamma"] > 1 and s["milestones"]:
        n = len(s["milestones"])  # the lr rises to lr x gamma^n: that must stay in range too
        peak = math.log10(lr) + n * math.log10(s["gamma"])
        if peak > math.log10(TRAINING_NUMBER_MAX if large_budgets_allowed() else SANITY_MAX):
            _number_bound(f"{where}.lr_schedule.gamma", 10 ** min(peak, 300),
                          f"{show(s['gamma'])}, which raises '{where}.optimizer.lr' ({show(lr)}) to about 1e{peak:.0f} "
                          f"after its {n} milestone(s)")


def _numbers(block: Any, prefix: str = "") -> list[tuple[str, int | float]]:
    """[(dotted key, number)] of every int or float (not bool) in a training block, lists included."""
    if isinstance(block, dict):
        return [kv for k, v in block.items() for kv in _numbers(v, f"{prefix}{'.' if prefix else ''}{k}")]
    if isinstance(block, (list, tuple)):
        return [kv for i, v in enumerate(block) for kv in _numbers(v, f"{prefix}[{i}]")]
    return [(prefix, block)] if isinstance(block, (int, float)) and not isinstance(block, bool) else []


def _number_bound(where: str, value: int | float, shown: str | None = None) -> None:
    """ConfigError for a training number beyond the sanity bound (unless lifted) or TRAINING_NUMBER_MAX (always)."""
    shown = shown or show(value)
    if abs(value) > SANITY_MAX and not large_budgets_allowed():
        raise ConfigError(f"config key '{where}' has value {shown}; allowed: at most {SANITY_MAX:,} in magnitude "
                          f"{lift_hint()}")
    if abs(value) > TRAINING_NUMBER_MAX:
        raise ConfigError(f"config key '{where}' has value {shown}; allowed: at most {TRAINING_NUMBER_MAX:g} in magnitude "
                          "(torch's float32 optimizer arithmetic overflows beyond; not lifted by "
                          "FEDREPRO_ALLOW_LARGE_BUDGETS)")


def _check_partition_size(label: str, ds: str, dsinfo: dict, spec: dict) -> None:
    """num_clients, min_partition_size and the split against the dataset's size (where it is known), the
    partitioner's own verdict on the dataset's class counts (where they are known: the counts `prepare`
    cached, else those the registry declares), and the partition step's own verdict on the dataset's
    labels (where they are known: `datasets.known_labels`), which the partition step would reach too."""
    from .data.datasets import class_counts, known_labels
    from .data.partitioners import Infeasible, infeasibility
    from .data.shards import check_from_labels

    known = class_counts(ds, dsinfo["params"], spec["pool"])
    bounds = sample_bounds(ds, dsinfo["params"])
    if bounds is None and known is None:
        return
    n = int(known[0].sum()) if known is not None else bounds[1] if spec["pool"] else bounds[0]
    scope = f"the {n:,} samples of {ds}" + ("" if spec["pool"] else " (its official train set: pool: false)")
    k = spec["num_clients"]
    if k > n:
        raise ConfigError(f"config key 'partitions.{label}.num_clients' has value {k}; allowed: at most {scope}")
    m = spec["params"].get("min_partition_size")
    if isinstance(m, int) and spec["params"].get("sampler", "split") == "split" and m * k > n:
        raise ConfigError(f"config key 'partitions.{label}.params.min_partition_size' has value {m}; allowed: at most "
                          f"{n // k} ({scope} over {k} clients)")
    size = spec["params"].get("partition_size")
    s = spec["params"].get("num_classes_per_partition")
    if spec["partitioner"] == "label_quantity" and size and size < s:
        raise ConfigError(f"config key 'partitions.{label}.params.partition_size' has value {size}; allowed: at least "
                          f"num_classes_per_partition ({s}): one sample of each of a client's classes, or 0 for the largest size")
    if spec["partitioner"] == "label_quantity" and s * k > n:
        raise ConfigError(f"config key 'partitions.{label}.num_clients' has value {k}; allowed: at most {n // s} ({scope} over "
                          f"disjoint clients of at least num_classes_per_partition = {s} samples each)")
    if spec["partitioner"] == "label_quantity" and size and size * k > n:  # disjoint clients of `size` samples each
        raise ConfigError(f"config key 'partitions.{label}.params.partition_size' has value {size}; allowed: at most {n // k} "
                          f"({scope} over {k} disjoint clients), or 0 for the largest size the classes allow")
    if spec["params"].get("sampler") == "plato" and size and size > n:
        raise ConfigError(f"config key 'partitions.{label}.params.partition_size' has value {size}; allowed: at most {scope}")
    if known is not None:
        try:
            infeasibility(spec["partitioner"], known[0], k, spec["seed"], spec["params"])
        except Infeasible as exc:
            raise _infeasible(label, exc, known[1] + ("" if spec["pool"] else ", official train set")) from None
    split = spec["split"]
    train_share = 1 - split["test_fraction"] - split["val_fraction"]
    if n / k * train_share < 1:
        raise ConfigError(f"config key 'partitions.{label}.split' has value {show(split)}; allowed: a split that leaves every "
                          f"client training data ({scope} over {k} clients give {n / k:.2f} samples per client, "
                          f"{n / k * train_share:.2f} of them for training)")
    if 2 * k > n and not spec.get("allow_empty_clients"):  # a training and a test sample each
        raise ConfigError(f"config key 'partitions.{label}.num_clients' has value {k}; allowed: at most {n // 2} ({scope}: "
                          "every client needs a training and a test sample), or allow_empty_clients: true")
    labels = known_labels(ds, dsinfo["params"])
    if labels is None:
        return
    try:
        check_from_labels(labels[0], spec)
    except Infeasible as exc:
        raise _infeasible(label, exc, labels[1]) from None
    except ConfigError as exc:  # the partition step's refusal (a client without training or test data, ...)
        raise ConfigError(f"config key 'partitions.{label}': {exc} (decided from {labels[1]}, as the partition step would)") from None


def _infeasible(label: str, exc: Exception, source: str) -> ConfigError:
    """The config error of the partition step's `Infeasible` refusal of partition `label`, decided from `source`."""
    return ConfigError(f"config key 'partitions.{label}.{exc.key}' has value {show(exc.value)}; allowed: {exc.allowed} "
                       f"(decided from {source}, as the partition step would)")


def _check_model_input(where: str, name: str, ds: str, params: dict, model_params: dict, given: dict | None,
                       default: bool = False) -> None:
    """ConfigError unless model `name` with `model_params` takes the samples of dataset `ds` with `params`
    (rank and sides, then what the model's own check says of its parameters: models.input_problem)."""
    shape = sample_shape(ds, params)
    problem = input_problem(name, shape)
    if problem:
        fits = [m for m in MODELS.names() if input_problem(m, shape) is None]
        raise ConfigError(f"config key '{where}.name' has value {name!r}{f' (the default for {ds})' if default else ''}; "
                          f"allowed: a model that takes {ds}'s samples of shape {shape}: {', '.join(fits)} ({problem})")
    problem = input_problem(name, shape, {**model_params, "weights": "none"})  # the weights are checked by the job that loads them
    if problem:
        raise ConfigError(f"config key '{where}.params' has value {show(given or {})}; allowed: parameters with which "
                          f"'{name}' takes {ds}'s samples of shape {shape} ({problem})")


def _model_params(where: str, model: dict) -> dict:
    """The registry-checked parameters of a configured model {name, params} (`where` names its key)."""
    if model["name"] not in MODELS:
        raise ConfigError(f"config key '{where}.name' has value {model['name']!r}; allowed: {', '.join(MODELS.names())}")
    return resolve_params(f"config key '{where}.params'", MODELS.entry(model["name"]).params, model.get("params"))


#: partitions.<label>.draw: one partition for every seed, or a draw of its own per training seed.
PARTITION_DRAWS = ("fixed", "per_seed")


def partition_draws(label: str, spec: dict, draw: Any, seeds: list[int]) -> list[tuple[list[int], dict]]:
    """The partition draws of `partitions.<label>` as (training seeds served, spec) pairs.

    fixed: one draw, the spec's own `seed`, for every training seed. per_seed: training seed s gets
    the partition drawn with seed `seed + s` (so seed 0 keeps the fixed draw and its cached shards),
    one shard folder per draw: the data sampling varies with the seeds, as Bouthillier et al. (MLSys
    2021) recommend, and a paired test by seed stays paired (both rows of seed s share its draw)."""
    if draw == "fixed":  # (the schema admits PARTITION_DRAWS only)
        return [(list(seeds), spec)]
    base = spec.get("seed", 0)
    if not isinstance(base, int) or isinstance(base, bool):  # resolve_partition_spec words the refusal
        return [(list(seeds), spec)]
    top = base + max(seeds)
    if top >= 2**32:
        raise ConfigError(f"config key 'partitions.{label}.seed' has value {base} with draw: per_seed and seeds up to "
                          f"{max(seeds)}; allowed: seed + the largest seed below 2**32 (numpy RandomState), here {top}")
    return [([s], {**spec, "seed": base + s}) for s in seeds]


def resolve_experiment(config: dict) -> dict[str, Any]:
    """Validate `config` and return {"experiment", "datasets", "partitions", "cells"}.

    partitions: list of {dataset, label, id, spec}; cells: list of resolved cell dicts.
    """
    check_plain(config)
    _check_names(config)
    config, sweeps = expand_sweeps(config)
    _schema_errors(config)
    config = plain_copy(config)
    require_plugins(config.get("plugins") or [])  # installed plugins only: a config never imports a module
    for label, p in config["partitions"].items():
        _budget(f"partitions.{label}.num_clients", p["num_clients"], "num_clients")
    name = config["experiment"]
    datasets: dict[str, dict] = {}
    for ds, entry in config["datasets"].items():
        entry = entry or {}
        spec = DATASETS.entry(ds).obj if ds in DATASETS else None
        if spec is None:
            raise ConfigError(f"config key 'datasets.{ds}': unknown dataset {ds!r}; allowed: {', '.join(DATASETS.names())}")
        params = resolve_params(f"config key 'datasets.{ds}.params'", spec.params, entry.get("params"))
        model = entry.get("model") or {"name": DEFAULT_MODELS.get(ds, "mlp")}
        model_params = _model_params(f"datasets.{ds}.model", model)
        _check_model_input(f"datasets.{ds}.model", model["name"], ds, params, model_params, model.get("params"),
                           default=not entry.get("model"))
        pretrained = None
        if model_params.get("weights") == PROXY_WEIGHTS:  # a backbone pre-trained once on the dataset's proxy (models/pretrain.py)
            pretrained = pretrain_spec(ds, params, {"params": model_params}, model.get("pretrain"), f"datasets.{ds}.model")
            model_params = {**model_params, "weights": pretrained["out"]}
        elif model.get("pretrain") is not None:
            raise ConfigError(f"config key 'datasets.{ds}.model.pretrain' is set but the model's weights is "
                              f"{model_params.get('weights')!r}; allowed: only with weights: {PROXY_WEIGHTS}")
        datasets[ds] = {"params": params, "model": {"name": model["name"], "params": model_params},
                        "num_classes": spec.num_classes, "prepared_id": short_hash(params, 8), "training": entry.get("training") or {},
                        "pretrained": pretrained}
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
            draw = p.get("draw", "fixed")
            p = {k: v for k, v in p.items() if k not in ("datasets", "draw")}
            if p["partitioner"] not in _partitioner_names():
                raise ConfigError(f"config key 'partitions.{label}.partitioner' has value {p['partitioner']!r}; allowed: {', '.join(_partitioner_names())}")
            for seeds, spec in partition_draws(label, {"dataset": ds, "dataset_params": dsinfo["params"], **p}, draw,
                                               config["seeds"]):
                try:
                    resolved = resolve_partition_spec(spec)
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
                k = resolved["params"].get("num_classes_per_partition")
                if k is not None and k > dsinfo["num_classes"]:
                    raise ConfigError(f"config key 'partitions.{label}.params.num_classes_per_partition' has value {k}; allowed: at most the {dsinfo['num_classes']} classes of {ds}")
                _check_partition_size(label, ds, dsinfo, resolved)
                by = resolved["params"].get("partition_by")
                if by is not None and by not in group_columns(ds):
                    raise ConfigError(f"config key 'partitions.{label}.params.partition_by' has value {show(by)}; allowed: a group "
                                      f"column of {ds}: {', '.join(group_columns(ds)) or f'none ({ds} has no per-sample groups)'}")
                partitions.append({"dataset": ds, "label": label, "id": partition_id(spec), "spec": resolved, "seeds": seeds})
    base_training = config.get("training") or {}
    evaluation = _merge(EVALUATION_DEFAULTS, config.get("evaluation"))
    for part in partitions:
        n = part["spec"]["num_clients"]
        if any(i >= n for i in evaluation.get("embed_clients") or []):
            raise ConfigError(f"config key 'evaluation.embed_clients' has value {evaluation['embed_clients']}; allowed: client ids "
                              f"below {n}, the number of clients of partition '{part['label']}' ({part['dataset']})")
    cells = []
    lever_reach: dict[str, tuple[list, dict[str, str]]] = {}
    methods = {}
    finetune_of = {label: m["finetune"] for label, m in config["methods"].items() if isinstance(m, dict) and "finetune" in m}
    for label, m in config["methods"].items():
        m = m or {}
        if label in finetune_of:  # resolved below, from its base label's entry
            continue
        method = m.get("method", label)
        if method not in METHODS:
            raise ConfigError(f"config key 'methods.{label}': unknown method {method!r}; allowed: {', '.join(METHODS.names())}")
        _check_label_shadow(label, method)
        entry = METHODS.entry(method)
        hp = resolve_params(f"config key 'methods.{label}.hparams' (method '{method}')", entry.params, m.get("hparams"))
        # a label's own model replaces every dataset's (Calibre's local linear classifier: mlp with no hidden layer)
        own_model = m.get("model") and {"name": m["model"]["name"], "params": _model_params(f"methods.{label}.model", m["model"])}
        methods[label] = (method, hp, m.get("training"), own_model)
    finetune_rows = {label: _finetune_row(label, config["methods"][label], of, methods) for label, of in finetune_of.items()}
    methods = {label: methods.get(label) or finetune_rows[label] for label in config["methods"]}  # in the config's order
    label_seeds = {label: _label_seeds(label, m or {}, config["seeds"]) for label, m in config["methods"].items()}
    draws: dict[tuple[str, str], dict[int, dict]] = {}  # (dataset, label) -> training seed -> its partition draw
    for part in partitions:
        for seed in part["seeds"]:
            draws.setdefault((part["dataset"], part["label"]), {})[seed] = part
    for (ds, _), by_seed in draws.items():
        part = by_seed[config["seeds"][0]]  # the draws differ only in their seed: one stands for the checks
        for label, (method, hp, method_training, own_model) in methods.items():
            model = own_model or datasets[ds]["model"]
            if own_model:
                given = finetune_of.get(label, label)  # a fine-tuning row's model is its base label's
                _check_model_input(f"methods.{given}.model", own_model["name"], ds, datasets[ds]["params"], own_model["params"],
                                   config["methods"][given]["model"].get("params"))
            METHODS.get(method).check_cell(f"methods.{label}", hp, model, part["spec"])
            # precedence: experiment < dataset < method; an error names the most specific key given
            training = _merge(_merge(base_training, datasets[ds]["training"]), method_training)
            where = (f"methods.{label}.training" if method_training else f"datasets.{ds}.training" if datasets[ds]["training"] else "training")
            spec = part["spec"]
            blocks = [("training", base_training), (f"datasets.{ds}.training", datasets[ds]["training"]),
                      (f"methods.{label}.training", method_training)]
            t = resolve_training(training, where, spec["num_clients"] - spec["unseen_clients"], blocks)
            _check_training_budget(where, t)
            METHODS.get(method).check_training(f"methods.{label}.hparams", hp, t)
            if label not in finetune_of:  # a fine-tuning row takes its base label's training
                _note_lever_reach(lever_reach, blocks, label, method)
            if "official" in t["global_test"] and spec["pool"]:
                raise ConfigError(f"config key '{where}.global_test' has value {t['global_test']}; allowed: 'official' only with "
                                  f"a partition that keeps the official test set apart (partitions.{part['label']}.pool: false)")
            if "official" in t["global_test"] and not has_official_test(ds, datasets[ds]["params"]):
                raise ConfigError(f"config key '{where}.global_test' has value {t['global_test']}; allowed: 'official' only on a "
                                  f"dataset with an official test set, which {ds} (params {show(datasets[ds]['params'])}) has not; "
                                  f"'union' scores the clients' test splits together")
            shape = sample_shape(ds, datasets[ds]["params"])
            problem = augment_problem(t["augment"], shape)
            if problem:
                resizable = "image_size" in datasets[ds]["params"] and len(shape) == 3
                raise ConfigError(f"config key '{where}.augment' has value {t['augment']!r}; allowed: 'none' for {ds}, whose "
                                  f"samples of shape {shape} are {problem}"
                                  + (f" (or datasets.{ds}.params.image_size of at least {4 * CROP_PADDING})" if resizable else ""))
            for seed in label_seeds[finetune_of.get(label, label)]:
                cells.append({
                    "experiment": name, "dataset": ds, "partition": part["label"], "partition_id": by_seed[seed]["id"],
                    "method": method, "label": label, "hparams": hp, "model": model,
                    "seed": seed, "training": t, "evaluation": evaluation,
                    **({"sweep": sweeps[label]} if label in sweeps else {}),  # the swept values: summary.csv's sweep.* columns
                    **({"finetune": finetune_of[label]} if label in finetune_of else {}),  # a "+FT" row: its base label
                })
        allowed = cells_over(len(cells), BUDGETS["cells"])
        if allowed:
            raise ConfigError(f"config key '(top level)' expands to {len(cells):,} cells or more (datasets x partitions "
                              f"x methods x seeds); allowed: {allowed}")
    tuning = resolve_tuning(config, methods, {m: METHODS.entry(m).params for m, *_ in methods.values()}, config["seeds"],
                            BUDGETS["cells"])
    tuning_cells = _tuning_cells(tuning, cells, base_training, datasets, methods, partitions, lever_reach) if tuning else []
    _check_lever_targets(lever_reach)
    for label in tuning["labels"] if tuning else ():
        if (config["methods"][label] or {}).get("seeds") is not None:
            raise ConfigError(f"config key 'methods.{label}.seeds' is set on a label that `tuning` tunes; allowed: a tuned "
                              "label trains every seed of `seeds` (its selection maps final seeds to tuning seeds)")
    for c in cells:
        if tuning and c["label"] in tuning["labels"]:
            c["tuned"] = True  # its hyper-parameters come from the selection (`fedrepro train --tuned`)
            if "finetune" in c or c["label"] in finetune_of.values():
                ft = c["label"] if "finetune" in c else next(k for k, v in finetune_of.items() if v == c["label"])
                raise ConfigError(f"config key 'methods.{ft}.finetune' has value {finetune_of[ft]!r}, a label that `tuning` "
                                  f"tunes (or the row itself is tuned); allowed: a label whose hyper-parameters are given "
                                  "(a tuned cell is trained from its selection, not scored from a kept final model)")
    _check_duplicate_labels(cells, tuning)
    allowed = cells_over(len(cells) + len(tuning_cells), BUDGETS["cells"])
    if allowed:
        raise ConfigError(f"config key 'tuning' expands to {len(tuning_cells):,} tuning cells beside {len(cells):,} final ones; "
                          f"allowed: {allowed} in all")
    tracking = {**TRACKING_DEFAULTS, **(config.get("tracking") or {})}  # a side channel: in no cell, so in no hash
    if tracking["tensorboard"]:
        check_available()
    return {"experiment": name, "datasets": datasets, "partitions": partitions, "cells": cells,
            "tuning": tuning, "tuning_cells": tuning_cells, "tracking": tracking}


def _label_seeds(label: str, entry: dict, seeds: list[int]) -> list[int]:
    """`methods.<label>.seeds` (default: the experiment's `seeds`): some of the experiment's seeds, in
    its order, so that every seed a label trains has its partition draw and its paired rows."""
    own = entry.get("seeds")
    if own is None:
        return list(seeds)
    extra = [s for s in own if s not in seeds]
    if extra:
        raise ConfigError(f"config key 'methods.{label}.seeds' has value {show(own)}; {extra} not among the experiment's "
                          f"seeds; allowed: some of `seeds` {show(seeds)}")
    return [s for s in seeds if s in own]


def _finetune_row(label: str, entry: dict, of: Any, methods: dict[str, tuple]) -> tuple:
    """The (method, hparams, training, model) of a "+FT" row `methods.<label>: {finetune: <of>, hparams:
    {ft_*}}`: label `of`'s cells, each client's head then fine-tuned on its train split after training
    (methods/_finetune.py), scored from `of`'s kept final model (fedrepro.engine.finetune)."""
    from .methods import FINETUNE_HPARAMS

    where = f"config key 'methods.{label}.finetune'"
    extra = sorted(set(entry) - {"finetune", "hparams"})
    if extra:
        raise ConfigError(f"config key 'methods.{label}.{extra[0]}' is set beside 'finetune'; allowed: finetune and hparams "
                          f"(ft_* only): a fine-tuning row takes its method, training and model from label {show(of)}")
    if not isinstance(of, str) or of not in methods:
        raise ConfigError(f"{where} has value {show(of)}; allowed: another label of `methods` that is no fine-tuning row "
                          f"({', '.join(methods) or 'none'})")
    method, hp, training, own_model = methods[of]
    if label in METHODS:  # tables key rows on labels: this one would read as that method
        raise ConfigError(f"config key 'methods.{label}.finetune' makes a row labelled {label!r}, the name of method "
                          f"{label!r}; allowed: a label that is no method's name (e.g. '{of}_plus_ft'), or "
                          f"`{label}: {{hparams: ...}}` for the method itself")
    cls = METHODS.get(method)
    if not cls.has_global or getattr(cls, "finetune_base", None) is not None:
        why = "has no global model" if not cls.has_global else "fine-tunes already"
        raise ConfigError(f"{where} has value {of!r}, whose method {method!r} {why}; allowed: a label whose method has a "
                          "global model and is no fine-tuning method")
    ft = resolve_params(f"config key 'methods.{label}.hparams' (fine-tuning of '{of}')", FINETUNE_HPARAMS, entry.get("hparams"))
    return method, {**hp, **ft}, training, own_model


def _check_label_shadow(label: str, method: str) -> None:
    """ConfigError for a label that is the name of another registered method (`fedavg: {method: local}`):
    tables, plots, select specs and paper readings key rows on labels, so a reader would take that row for
    the method it names. A label equal to its own method is the usual case; no shipped config shadows."""
    if label != method and label in METHODS:
        raise ConfigError(f"config key 'methods.{label}.method' has value {method!r}; allowed: {label!r} (the method the "
                          f"label names) or a label that is no method's name for {method!r} (e.g. '{method}_as_{label}'): "
                          f"tables and readers key rows on labels, and '{label}' reads as method {label!r}")


def _check_duplicate_labels(cells: list[dict], tuning: dict | None) -> None:
    """ConfigError naming both labels when two method labels resolve to identical cells (same method,
    hyper-parameters, model, training, tuning plan) on some dataset, partition and seed: the same job would
    train twice under two names and a table would show one result as two rows. No shipped config has such a
    pair (each config checked, issue 37)."""
    def name(cell: dict) -> str:  # a sweep point's label is no key of the config
        return f"the sweep point '{cell['label']}'" if "sweep" in cell else f"'methods.{cell['label']}'"

    plans = (tuning or {}).get("labels") or {}
    seen: dict[str, dict] = {}
    for c in cells:
        key = short_hash({**{k: v for k, v in c.items() if k not in ("label", "sweep")}, "tuning": plans.get(c["label"])})
        first = seen.setdefault(key, c)
        if first["label"] != c["label"]:
            raise ConfigError(f"{'' if 'sweep' in c else 'config key '}{name(c)} resolves to the same cells as {name(first)} "
                              f"(method {c['method']!r}, the same hyper-parameters, model and training; e.g. {c['dataset']} "
                              f"partition '{c['partition']}' seed {c['seed']}), which would train twice; allowed: labels "
                              "whose resolved settings differ (drop one, or change a setting of one)")


def _tuning_cells(tuning: dict, cells: list[dict], base_training: dict, datasets: dict, methods: dict,
                  partitions: list[dict], lever_reach: dict) -> list[dict]:
    """One cell per (dataset, partition, tuned label, trial, tuning seed): the final cell's setup with
    the trial's values and the tuning training overrides, scored on validation carved from train."""
    specs = {(p["dataset"], p["label"]): p["spec"] for p in partitions}
    firsts = {}
    for c in cells:
        firsts.setdefault((c["dataset"], c["partition"], c["label"]), c)
    out = []
    for (ds, part, label), base in firsts.items():
        plan = tuning["labels"].get(label)
        if plan is None:
            continue
        spec = specs[(ds, part)]
        override = _merge(_merge(_merge(base_training, datasets[ds]["training"]), methods[label][2]), tuning["training"])
        # Only the last round is scored (unless tuning.training says otherwise); test-based extras have no place in a trial.
        if "eval_every" not in tuning["training"]:
            override["eval_every"] = override.get("rounds", TRAINING_DEFAULTS["rounds"])
            if "personal_eval_every" not in tuning["training"]:
                override.pop("personal_eval_every", None)
        override["global_test"] = []
        where = "tuning.training"
        blocks = [("training", base_training), (f"datasets.{ds}.training", datasets[ds]["training"]),
                  (f"methods.{label}.training", methods[label][2]), (where, tuning["training"])]
        t = resolve_training(override, where, spec["num_clients"] - spec["unseen_clients"], blocks, trial=True)
        _check_training_budget(where, t)
        _note_lever_reach(lever_reach, blocks, label, base["method"])
        if len(set(plan["space"].get("lr") or [])) > 1 and t["lr_schedule"]["name"] == "multistep" and t["lr_schedule"]["values"]:
            raise ConfigError(f"config key 'tuning.lr' has value {show(plan['space']['lr'])} for method label '{label}', whose "
                              f"lr_schedule.values {show(t['lr_schedule']['values'])} replace the lr (every trial would train "
                              "alike); allowed: lr_schedule gamma (which scales the tuned lr) or one lr (tuning.lr: "
                              "[values[0]])")
        for trial in plan["trials"]:
            for seed in tuning["seeds"]:
                # (the values were checked against the method's parameters in fedrepro.tuning)
                cell = apply_values({k: v for k, v in base.items() if k != "tuned"} | {"seed": seed, "training": t},
                                    trial["values"])
                out.append({**cell, "trial": trial["id"], "validation": trial_validation(tuning)})
    return out


def _partitioner_names() -> list[str]:
    from .data.partitioners import PARTITIONERS

    return PARTITIONERS.names()


# -- a resolved cell read back from a file (`fedrepro verify`'s provenance.json: issue 57) ---------------

@functools.cache
def _part_validator(pointer: str):
    """A validator of one part of the experiment schema (`pointer`: '$defs/training', 'properties/evaluation')."""
    root = _parsed_schema()
    part = root
    for key in pointer.split("/"):
        part = part[key]
    return _VALIDATOR({**part, "$defs": root["$defs"]})


def _check_part(block: Any, pointer: str, where: str) -> None:
    """ConfigError naming `where`.<key> where `block` is not what the schema's `pointer` allows."""
    errors = sorted(_part_validator(pointer).iter_errors(block),
                    key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if not errors:
        return
    err = errors[0]
    at = ".".join([where, *map(str, err.absolute_path)])
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        raise ConfigError(f"config key '{at}': unknown key(s) {show(sorted(set(err.instance) - set(allowed)))}; "
                          f"allowed keys: {', '.join(allowed)}")
    raise ConfigError(f"config key '{at}' has value {show(err.instance)}; allowed: {_allowed(err)}")


def _check_cell_names(cell: dict, where: str) -> None:
    check_name(f"{where}.experiment", cell.get("experiment"), reserved=True)
    for key in ("dataset", "partition", "label", "method"):
        if not isinstance(cell.get(key), str):
            raise ConfigError(f"config key '{where}.{key}' has value {show(cell.get(key))}; allowed: a name")
        check_name(f"{where}.{key}", cell[key])
    seed = cell.get("seed")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32):
        raise ConfigError(f"config key '{where}.seed' has value {show(seed)}; allowed: an integer from 0 to 4294967295")


def _check_cell_training(training: Any, spec: dict, where: str) -> dict:
    """A resolved training block resolved again as a config's: the schema, resolve_training's checks, the
    budgets and number bounds; the cosine schedule's horizon (the one key resolving adds) must be the rounds."""
    if not isinstance(training, dict):
        raise ConfigError(f"config key '{where}' has value {show(training)}; allowed: a mapping")
    schedule = training.get("lr_schedule")
    horizon = schedule.get("total_rounds") if isinstance(schedule, dict) else None
    given = training if horizon is None else {**training, "lr_schedule": {k: v for k, v in schedule.items() if k != "total_rounds"}}
    _check_part(given, "$defs/training", where)
    clients = spec.get("num_clients", 0) - spec.get("unseen_clients", 0)
    t = resolve_training(given, where, clients if isinstance(clients, int) and clients > 0 else None, blocks=[])
    _check_training_budget(where, t)
    if horizon is not None and horizon != t["rounds"]:
        raise ConfigError(f"config key '{where}.lr_schedule.total_rounds' has value {show(horizon)}; allowed: "
                          f"{where}.rounds ({t['rounds']}), the horizon of the cosine schedule")
    return t


def check_resolved_cell(cell: dict, spec: dict, where: str = "cell") -> None:
    """ConfigError (naming '<where>.<key>') unless `cell`, a resolved cell read back from a file, is within
    the schema and bounds a config's cell is held to: its names and seed, its training block (schema,
    consistency, BUDGETS, number bounds), its evaluation rule, its method's hyper-parameters and own checks,
    and its model's parameters against the samples of its partition `spec` (resolved, as a manifest keeps it)."""
    _check_cell_names(cell, where)
    if cell["method"] not in METHODS:
        raise ConfigError(f"config key '{where}.method' has value {show(cell['method'])}; allowed: {', '.join(METHODS.names())}")
    if spec.get("dataset") != cell["dataset"]:
        raise ConfigError(f"config key '{where}.dataset' has value {show(cell['dataset'])}; allowed: "
                          f"{show(spec.get('dataset'))}, the dataset of its partition")
    t = _check_cell_training(cell.get("training"), spec, f"{where}.training")
    _check_part(cell.get("evaluation"), "properties/evaluation", f"{where}.evaluation")
    hparams = cell.get("hparams")
    hp = resolve_params(f"config key '{where}.hparams' (method '{cell['method']}')", METHODS.entry(cell["method"]).params,
                        hparams if isinstance(hparams, dict) else {"(not a mapping)": hparams})
    model = cell.get("model") if isinstance(cell.get("model"), dict) else {"name": cell.get("model")}
    params = _model_params(f"{where}.model", model)
    _check_model_input(f"{where}.model", model["name"], cell["dataset"], spec.get("dataset_params") or {}, params,
                       model.get("params"))
    method = METHODS.get(cell["method"])
    method.check_cell(where, hp, {"name": model["name"], "params": params}, spec)
    method.check_training(f"{where}.hparams", hp, t)
