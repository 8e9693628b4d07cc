"""Experiment config validation and expansion into cells."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Callable

import pytest

from fedrepro.config import TRAINING_DEFAULTS, load_config, resolve_experiment
from fedrepro.data.shards import partition_id
from fedrepro.methods import METHODS
from fedrepro.registry import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "config.yaml"
TEST_CONFIG = ROOT / "config" / "test.yaml"


@pytest.fixture(scope="module")
def base() -> dict:
    """A valid config (config/test.yaml) every malformed case starts from."""
    return load_config(TEST_CONFIG)


def n_cells(cfg: dict) -> int:
    return len(cfg["datasets"]) * len(cfg["partitions"]) * len(cfg["methods"]) * len(cfg["seeds"])


# ----------------------------------------------------------------------- valid configs


@pytest.mark.parametrize("path,expected", [(CONFIG, 1 * 1 * 3 * 1), (TEST_CONFIG, 1 * 2 * 3 * 2)], ids=["config.yaml", "test.yaml"])
def test_example_configs_resolve(path, expected):
    cfg = load_config(path)
    out = resolve_experiment(cfg)
    assert out["experiment"] == cfg["experiment"]
    assert len(out["cells"]) == n_cells(cfg) == expected
    keys = {(c["dataset"], c["partition"], c["label"], c["seed"]) for c in out["cells"]}
    assert keys == set(itertools.product(cfg["datasets"], cfg["partitions"], cfg["methods"], cfg["seeds"]))
    assert len(out["partitions"]) == len(cfg["datasets"]) * len(cfg["partitions"])
    for part in out["partitions"]:
        spec = {"dataset": part["dataset"], "dataset_params": out["datasets"][part["dataset"]]["params"],
                **cfg["partitions"][part["label"]]}
        assert part["id"] == partition_id(spec)
    for cell in out["cells"]:
        assert cell["partition_id"] == next(p["id"] for p in out["partitions"]
                                            if p["dataset"] == cell["dataset"] and p["label"] == cell["partition"])


def test_default_config_cells_carry_resolved_defaults():
    out = resolve_experiment(load_config(CONFIG))
    cells = {c["label"]: c for c in out["cells"]}
    ft = cells["fedavg_ft"]
    assert ft["method"] == "fedavg_ft"
    assert ft["hparams"]["ft_epochs"] == 5  # from the config
    defaults = {k: p.default for k, p in METHODS.entry("fedavg_ft").params.items()}
    assert ft["hparams"]["ft_lr"] == defaults["ft_lr"] == 0.05  # resolved default
    assert set(ft["hparams"]) == set(defaults)
    t = cells["fedavg"]["training"]
    raw = load_config(CONFIG)["training"]
    assert t["rounds"] == raw["rounds"] and t["participation"] == raw["participation"]
    assert t["optimizer"] == {**TRAINING_DEFAULTS["optimizer"], **raw["optimizer"]}  # merged, not replaced
    assert "momentum" not in raw["optimizer"]
    assert t["eval_batch_size"] == TRAINING_DEFAULTS["eval_batch_size"]
    assert cells["fedavg"]["model"] == {"name": "fedavg_cnn", "params": {"hidden": 512}}
    part = out["partitions"][0]["spec"]
    assert part["params"] == {"alpha": 0.1, "min_partition_size": 40, "self_balancing": True, "max_retries": 1000,
                              "sampler": "split", "partition_size": 600}
    assert part["split"] == {"test_fraction": 0.25, "val_fraction": 0.0, "stratify": False}
    assert part["seed"] == 1 and part["pool"] is True


def test_method_label_maps_to_method(base):
    cfg = copy.deepcopy(base)
    cfg["methods"]["fedavg_lr1"] = {"method": "fedavg", "training": {"optimizer": {"lr": 0.1}}}
    cfg["methods"]["ft_long"] = {"method": "fedavg_ft", "hparams": {"ft_epochs": 7}}
    out = resolve_experiment(cfg)
    assert len(out["cells"]) == n_cells(cfg) == 2 * 5 * 2
    by_label = {c["label"]: c for c in out["cells"]}
    assert by_label["fedavg_lr1"]["method"] == "fedavg"
    assert by_label["fedavg_lr1"]["training"]["optimizer"]["lr"] == 0.1
    assert by_label["fedavg_lr1"]["training"]["rounds"] == 3  # the rest from the base training block
    assert by_label["fedavg"]["training"]["optimizer"]["lr"] == 0.05
    assert by_label["ft_long"]["method"] == "fedavg_ft"
    assert by_label["ft_long"]["hparams"]["ft_epochs"] == 7 and by_label["ft_long"]["hparams"]["ft_lr"] == 0.05


def test_cosine_schedule_gets_total_rounds(base):
    cfg = copy.deepcopy(base)
    cfg["training"]["lr_schedule"] = {"name": "cosine"}
    cell = resolve_experiment(cfg)["cells"][0]
    assert cell["training"]["lr_schedule"]["total_rounds"] == cfg["training"]["rounds"]


def test_integer_participation_within_clients_is_a_count(base):
    cfg = copy.deepcopy(base)
    cfg["training"]["participation"] = 6  # == num_clients: allowed
    assert all(c["training"]["participation"] == 6 for c in resolve_experiment(cfg)["cells"])


def test_resolve_does_not_mutate_input(base):
    cfg = copy.deepcopy(base)
    before = copy.deepcopy(cfg)
    resolve_experiment(cfg)
    assert cfg == before


# ----------------------------------------------------------------------- malformed configs


def _set(path: str, value):
    """A mutation setting the '/'-separated `path` (creating dicts on the way)."""

    def mutate(cfg: dict) -> None:
        keys = path.split("/")
        node = cfg
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value

    return mutate


def _pop(key: str):
    return lambda cfg: cfg.pop(key)


def _rename(section: str, old: str, new: str):
    """A mutation renaming the label `old` of `section` (partitions, methods) to `new`."""

    def mutate(cfg: dict) -> None:
        cfg[section] = {(new if k == old else k): v for k, v in cfg[section].items()}

    mutate.change = f"label `{old}` of `{section}` → {new!r}"  # what docs/bad_configs.md shows
    return mutate


def _all(*mutations):
    def mutate(cfg: dict) -> None:
        for m in mutations:
            m(cfg)

    return mutate


class TextCase:
    """A malformed config *file*: what YAML/JSON parsing alone decides (duplicate keys, tags, YTE,
    aliases, encoding, ...). `make` turns the text of config/test.yaml into the bad file's content;
    the file is read with fedrepro.config.load_config as `bad.yaml` in the current folder."""

    def __init__(self, change: str, make: Callable[[str], "str | bytes"]):
        self.change, self.make = change, make

    def content(self, base_text: str) -> bytes:
        out = self.make(base_text)
        return out if isinstance(out, bytes) else out.encode()


def _sub(old: str, new: str, change: str) -> TextCase:
    def make(text: str) -> str:
        assert text.count(old) == 1, old
        return text.replace(old, new)

    return TextCase(change, make)


def _as_json(edit: Callable[[str], str], change: str) -> TextCase:
    """config/test.yaml rewritten as JSON, then edited as text."""
    import yaml

    return TextCase(change, lambda text: edit(json.dumps(yaml.safe_load(text), indent=1)))


def _nested(depth: int) -> str:
    return "[" * depth + "0" + "]" * depth


BOMB = "".join(  # the classic "billion laughs": 9 levels of 9 aliases, under 1 KB
    [f"    params: {{l0: &l0 [{', '.join(['lol'] * 9)}],\n"]
    + [f"      l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}],\n" for i in range(1, 9)]
) + "    }\n"
WIDE = "".join(  # 8 levels of 4 aliases: within the alias budget, but 4^8 = 65,536 lists of 4 values
    [f"    params: {{w0: &w0 [{', '.join(['x'] * 4)}],\n"]
    + [f"      w{i}: &w{i} [{', '.join([f'*w{i - 1}'] * 4)}],\n" for i in range(1, 9)]
) + "    }\n"
DIGITS = "  digits:\n    model: {name: mlp, params: {hidden: [64]}}\n"


# (id, mutation, substrings the message must contain). Paths use '/' because labels contain dots.
BAD = [
    ("unknown-method", _set("methods/fedfoo", {}), ["fedfoo", "method", "allowed", "fedavg"]),
    ("unknown-method-via-label", _set("methods/mine", {"method": "scaffoldx"}), ["methods.mine", "scaffoldx", "allowed"]),
    ("unknown-dataset", _set("datasets/mnistx", {}), ["datasets.mnistx", "'mnistx'", "allowed", "digits"]),
    ("unknown-partitioner", _set("partitions/dir0.5/partitioner", "shards"), ["partitioner", "'shards'", "allowed", "dirichlet"]),
    ("unknown-model", _set("datasets/digits/model/name", "vgg99"), ["model.name", "'vgg99'", "allowed", "mlp"]),
    ("negative-rounds", _set("training/rounds", -3), ["training.rounds", "-3", "allowed", ">= 1"]),
    ("zero-rounds", _set("training/rounds", 0), ["training.rounds", "0", "allowed", ">= 1"]),
    ("alpha-zero", _set("partitions/dir0.5/params/alpha", 0), ["alpha", "value 0", "allowed", "> 0"]),
    ("alpha-negative", _set("partitions/dir0.5/params/alpha", -0.5), ["alpha", "-0.5", "allowed"]),
    ("alpha-wrong-type", _set("partitions/dir0.5/params/alpha", "big"), ["alpha", "'big'", "allowed"]),
    ("participation-fraction-above-1", _set("training/participation", 1.5), ["participation", "1.5", "allowed"]),
    ("participation-float-6", _set("training/participation", 6.0), ["participation", "6.0", "allowed"]),
    ("participation-count-above-clients", _set("training/participation", 7), ["participation", "7", "allowed", "6"]),
    ("participation-zero", _set("training/participation", 0), ["participation", "0", "allowed"]),
    ("method-participation-above-1", _set("methods/fedavg/training", {"participation": 1.5}),
     ["methods.fedavg.training.participation", "1.5", "allowed"]),
    ("classes-per-partition-above-classes", _set("partitions/pat2/params/num_classes_per_partition", 11),
     ["num_classes_per_partition", "11", "allowed", "10"]),
    ("missing-seeds", _pop("seeds"), ["seeds", "required"]),
    ("empty-seeds", _set("seeds", []), ["seeds", "[]", "allowed"]),
    ("duplicate-seeds", _set("seeds", [0, 0]), ["seeds", "[0, 0]", "allowed"]),
    ("negative-seed", _set("seeds", [-1]), ["seeds", "-1", "allowed"]),
    ("rounds-wrong-type", _set("training/rounds", "ten"), ["training.rounds", "'ten'", "allowed", "integer"]),
    ("unknown-hparam", _set("methods/fedavg_ft/hparams/ft_foo", 3),
     ["hparams", "ft_foo", "fedavg_ft", "allowed", "ft_lr", "ft_epochs"]),
    ("hparam-for-hparamless-method", _set("methods/fedavg/hparams", {"mu": 0.01}), ["hparams", "mu", "'fedavg'", "allowed"]),
    ("hparam-bad-value", _set("methods/fedavg_ft/hparams/ft_lr", 0), ["ft_lr", "0", "allowed", "> 0"]),
    ("unknown-partitioner-param", _set("partitions/dir0.5/params/beta", 3),
     ["beta", "partitions.dir0.5", "allowed", "alpha", "min_partition_size"]),
    ("unknown-top-level-key", _set("rounds", 3), ["rounds", "allowed", "training"]),
    ("unknown-training-key", _set("training/epochs", 3), ["epochs", "allowed", "local_epochs"]),
    ("unknown-dataset-param", _set("datasets/digits/params", {"foo": 1}), ["datasets.digits.params", "foo", "allowed"]),
    ("test-fraction-1", _set("partitions/dir0.5/split/test_fraction", 1.0), ["test_fraction", "1.0", "allowed", "< 1"]),
    ("fractions-sum-1", _set("partitions/dir0.5/split", {"test_fraction": 0.6, "val_fraction": 0.4}),
     ["test_fraction", "val_fraction", "allowed"]),
    ("num-clients-zero", _set("partitions/dir0.5/num_clients", 0), ["num_clients", "0", "allowed"]),
    ("lr-zero", _set("training/optimizer/lr", 0), ["optimizer.lr", "0", "allowed", "> 0"]),
    ("optimizer-rmsprop", _set("training/optimizer/name", "rmsprop"), ["optimizer.name", "'rmsprop'", "allowed", "sgd"]),
    ("multistep-values-wrong-length",
     _set("training/lr_schedule", {"name": "multistep", "milestones": [2, 3], "values": [0.1, 0.01]}),
     ["lr_schedule.values", "[0.1, 0.01]", "allowed", "3"]),
    ("multistep-milestones-decreasing", _set("training/lr_schedule", {"name": "multistep", "milestones": [3, 2]}),
     ["lr_schedule.milestones", "[3, 2]", "allowed"]),
    ("personal-eval-not-a-multiple", _set("methods/fedavg/training", {"eval_every": 2, "personal_eval_every": 3}),
     ["methods.fedavg.training.personal_eval_every", "3", "allowed", "multiple", "eval_every", "(2)"]),
    ("personal-eval-zero", _set("training/personal_eval_every", 0), ["training.personal_eval_every", "0", "allowed"]),
    ("bad-experiment-name", _set("experiment", "has space"), ["experiment", "'has space'", "allowed"]),
    # ---- names that would escape results/<experiment>/ or mix into shared folders (issue 15)
    ("experiment-trailing-newline", _set("experiment", "test\n"), ["experiment", "'test\\n'", "allowed", "64 characters"]),
    ("experiment-reserved-raw", _set("experiment", "raw"), ["experiment", "'raw'", "allowed", "not one of raw, shards"]),
    ("experiment-reserved-shards", _set("experiment", "shards"), ["experiment", "'shards'", "allowed", "not one of"]),
    ("experiment-reserved-logs-any-case", _set("experiment", "Logs"), ["experiment", "'Logs'", "allowed", "logs"]),
    ("experiment-too-long", _set("experiment", "x" * 300), ["experiment", "'xxxx", "allowed", "1 to 64 characters"]),
    ("experiment-path-traversal", _set("experiment", "../escape"), ["experiment", "'../escape'", "allowed"]),
    ("experiment-with-slash", _set("experiment", "a/b"), ["experiment", "'a/b'", "allowed"]),
    ("experiment-not-a-string", _set("experiment", 7), ["experiment", "7", "allowed", "string"]),
    ("partition-label-trailing-newline", _rename("partitions", "dir0.5", "dir0.5\n"),
     ["partitions", "'dir0.5\\n'", "allowed", "letters, digits"]),
    ("partition-label-too-long", _rename("partitions", "pat2", "p" * 65), ["partitions", "'pppp", "allowed", "64"]),
    ("method-label-with-slash", _rename("methods", "fedavg", "fed/avg"), ["methods", "'fed/avg'", "allowed"]),
    ("method-label-with-space", _rename("methods", "local", "my local"), ["methods", "'my local'", "allowed"]),
    # ---- non-finite numbers (comparisons with NaN are always false)
    ("lr-nan", _set("training/optimizer/lr", float("nan")), ["training.optimizer.lr", "nan", "allowed", "finite"]),
    ("lr-inf", _set("training/optimizer/lr", float("inf")), ["training.optimizer.lr", "inf", "allowed", "finite"]),
    ("participation-nan", _set("training/participation", float("nan")), ["training.participation", "nan", "finite"]),
    ("alpha-nan", _set("partitions/dir0.5/params/alpha", float("nan")), ["params.alpha", "nan", "allowed", "finite"]),
    ("alpha-inf", _set("partitions/dir0.5/params/alpha", float("inf")), ["params.alpha", "inf", "allowed", "finite"]),
    ("momentum-minus-inf", _set("training/optimizer/momentum", float("-inf")), ["optimizer.momentum", "-inf", "finite"]),
    ("hparam-nan", _set("methods/fedavg_ft/hparams/ft_lr", float("nan")), ["ft_lr", "nan", "allowed", "finite"]),
    ("test-fraction-nan", _set("partitions/dir0.5/split/test_fraction", float("nan")), ["test_fraction", "nan", "finite"]),
    # ---- integers are integers
    ("rounds-float", _set("training/rounds", 3.0), ["training.rounds", "3.0", "allowed", "integer"]),
    ("rounds-bool", _set("training/rounds", True), ["training.rounds", "True", "allowed", "integer"]),
    ("seeds-float", _set("seeds", [0.0]), ["seeds.0", "0.0", "allowed", "integer"]),
    ("batch-size-float", _set("training/batch_size", 16.0), ["training.batch_size", "16.0", "allowed", "integer"]),
    ("num-clients-float", _set("partitions/dir0.5/num_clients", 6.0), ["num_clients", "6.0", "allowed", "integer"]),
    ("partition-seed-float", _set("partitions/dir0.5/seed", 1.0), ["partitions.dir0.5.seed", "1.0", "allowed", "integer"]),
    # ---- mlp.hidden elements
    ("hidden-element-string", _set("datasets/digits/model/params/hidden", ["abc"]), ["hidden[0]", "'abc'", "allowed", "int"]),
    ("hidden-element-negative", _set("datasets/digits/model/params/hidden", [-5]), ["hidden[0]", "-5", "allowed", ">= 1"]),
    ("hidden-element-huge", _set("datasets/digits/model/params/hidden", [1000000000]),
     ["hidden[0]", "1000000000", "allowed", "<= 65536"]),
    ("hidden-too-many-layers", _set("datasets/digits/model/params/hidden", [8] * 65), ["hidden", "65 items", "allowed", "64"]),
    # ---- ranges against the data and untrainable splits
    ("test-fraction-0", _set("partitions/dir0.5/split/test_fraction", 0), ["test_fraction", "0", "allowed", "> 0"]),
    ("num-clients-above-samples", _set("partitions/pat2/num_clients", 5000), ["partitions.pat2.num_clients", "5000", "allowed",
                                                                              "1,797 samples of digits"]),
    ("min-partition-size-above-samples", _set("partitions/dir0.5/num_clients", 100),
     ["partitions.dir0.5.params.min_partition_size", "20", "allowed", "at most 17"]),
    ("untrainable-split", _all(_set("partitions/pat2/num_clients", 1000),
                               _set("partitions/pat2/split", {"test_fraction": 0.5, "val_fraction": 0.45})),
     ["partitions.pat2.split", "allowed", "training data", "0.09"]),
    ("seed-above-range", _set("seeds", [2**32]), ["seeds.0", "4294967296", "allowed", "<= 4294967295"]),
    # ---- absurd budgets (liftable with FEDREPRO_ALLOW_LARGE_BUDGETS=1)
    ("rounds-huge", _set("training/rounds", 10**12), ["training.rounds", "1000000000000", "allowed", "10,000",
                                                      "FEDREPRO_ALLOW_LARGE_BUDGETS"]),
    ("local-epochs-huge", _set("training/local_epochs", 5000), ["training.local_epochs", "5000", "allowed", "1,000"]),
    ("rounds-times-epochs", _all(_set("training/rounds", 10000), _set("training/local_epochs", 100)),
     ["training.rounds", "local_epochs", "1,000,000", "allowed", "100,000"]),
    ("batch-size-huge", _set("training/batch_size", 10**7), ["training.batch_size", "10000000", "allowed", "65,536"]),
    ("num-clients-huge", _set("partitions/dir0.5/num_clients", 10**9), ["num_clients", "1000000000", "allowed", "100,000"]),
    ("too-many-cells", _set("seeds", list(range(2000))), ["cells", "allowed", "10,000", "FEDREPRO_ALLOW_LARGE_BUDGETS"]),
    ("hparam-huge", _set("methods/fedavg_ft/hparams/ft_epochs", 10**9), ["ft_epochs", "1000000000", "allowed", "1,000,000"]),
    ("max-retries-huge", _set("partitions/dir0.5/params/max_retries", 10**9), ["max_retries", "1000000000", "allowed"]),
    # ---- malformed files: what the strict reader (fedrepro.configfile) refuses before any check above
    ("yte-template", _sub("experiment: test", "__use_yte__: true\nexperiment: ?'test'", "`__use_yte__: true` added, "
                          "`experiment: test` → `?'test'` (a YTE expression)"), ["__use_yte__", "allowed", "never executed"]),
    ("yte-definitions", _sub("experiment: test", "experiment: test\n__definitions__: [import os]",
                             "`__definitions__: [import os]` added"), ["__definitions__", "allowed", "never executed"]),
    ("duplicate-method-key", _sub("  fedavg: {}\n", "  fedavg: {}\n  fedavg: {method: local}\n",
                                  "`fedavg: {method: local}` added after `fedavg: {}` in `methods`"),
     ["methods.fedavg", "appears twice", "allowed", "each key once"]),
    ("duplicate-top-level-key", _sub("seeds: [0, 1]", "seeds: [0, 1]\nseeds: [5]", "a second `seeds: [5]` added"),
     ["seeds", "appears twice", "allowed"]),
    ("duplicate-key-json", _as_json(lambda t: t.replace('"fedavg": {}', '"fedavg": {},\n  "fedavg": {"method": "local"}', 1),
                                    "the config as JSON with `\"fedavg\": {\"method\": \"local\"}` repeated in `methods`"),
     ["methods.fedavg", "appears twice", "allowed", "JSON"]),
    ("int-and-string-key", _sub("  fedavg: {}\n", "  1: {method: fedavg}\n  \"1\": {method: local}\n",
                                "`1: {method: fedavg}` and `\"1\": {method: local}` in `methods`"),
     ["methods", "'1'", "integer", "allowed", "string keys"]),
    ("yaml11-on-key", _sub("  pat2:\n", "  on:\n", "partition label `pat2` → `on`"), ["partitions", "'on'", "boolean", "allowed"]),
    ("yaml11-yes-key", _sub("  local: {}\n", "  yes: {}\n", "method label `local` → `yes`"), ["methods", "'yes'", "boolean"]),
    ("yaml11-null-key", _sub("  local: {}\n", "  ~: {}\n", "method label `local` → `~`"), ["methods", "'~'", "null", "allowed"]),
    ("python-tuple-tag", _sub("seeds: [0, 1]", "seeds: !!python/tuple [0, 1]", "`seeds: !!python/tuple [0, 1]`"),
     ["seeds", "tag:yaml.org,2002:python/tuple", "allowed", "without tags"]),
    ("python-object-apply-tag", _sub("experiment: test", "experiment: !!python/object/apply:os.system ['touch MARKER']",
                                     "`experiment: !!python/object/apply:os.system ['touch MARKER']`"),
     ["experiment", "python/object/apply:os.system", "allowed", "never code"]),
    ("custom-tag", _sub("rounds: 3", "rounds: !secret 3", "`rounds: !secret 3`"), ["training.rounds", "'!secret'", "allowed"]),
    ("binary-tag", _sub("experiment: test", "experiment: !!binary dGVzdA==", "`experiment: !!binary dGVzdA==`"),
     ["experiment", "binary", "allowed"]),
    ("alias-bomb", _sub(DIGITS, DIGITS + BOMB, "a 1 KB alias bomb (9 levels of 9 aliases) as `datasets.digits.params`"),
     ["aliases", "allowed", "at most 64"]),
    ("alias-expansion", _sub(DIGITS, DIGITS + WIDE, "8 levels of 4 aliases (65,536 lists) as `datasets.digits.params`"),
     ["datasets.digits.params", "expands to more than 100,000 values", "allowed"]),
    ("recursive-alias", _sub("seeds: [0, 1]", "seeds: &s [0, *s]", "`seeds: &s [0, *s]`"), ["seeds", "itself", "allowed"]),
    ("nested-too-deep", _sub("seeds: [0, 1]", "seeds: " + _nested(40), "`seeds` nested 40 lists deep"),
     ["seeds", "nested more than 32 levels", "allowed"]),
    ("date-value", _sub("experiment: test", "experiment: 2024-01-31", "`experiment: test` → `2024-01-31`"),
     ["experiment", "datetime.date(2024, 1, 31)", "allowed", "quote dates"]),
    ("json-nan", _as_json(lambda t: t.replace('"lr": 0.05', '"lr": NaN', 1), "the config as JSON with `\"lr\": NaN`"),
     ["training.optimizer.lr", "nan", "allowed", "finite"]),
    ("json-overflow-to-inf", _as_json(lambda t: t.replace('"lr": 0.05', '"lr": 1e400', 1), "the config as JSON with `\"lr\": 1e400`"),
     ["training.optimizer.lr", "inf", "allowed", "finite"]),
    ("json-rounds-1e12", _as_json(lambda t: t.replace('"rounds": 3', '"rounds": 1e12', 1), "the config as JSON with `\"rounds\": 1e12`"),
     ["training.rounds", "1000000000000.0", "allowed", "integer"]),
    ("integer-too-long", _sub("rounds: 3", "rounds: " + "9" * 5000, "`rounds:` an integer of 5,000 digits"),
     ["bad.yaml", "cannot be read", "allowed"]),
    ("not-utf8", TextCase("byte 0xff in `experiment: test`", lambda t: t.replace("experiment: test", "experiment: te\xffst").encode("latin-1")),
     ["bad.yaml", "not UTF-8", "0xff", "allowed"]),
    ("yaml-syntax-error", _sub("seeds: [0, 1]", "seeds: [0, 1", "`seeds: [0, 1` (unclosed)"), ["bad.yaml", "not valid YAML", "line", "allowed"]),
    ("two-documents", TextCase("a second YAML document `--- {}` appended", lambda t: t + "--- {}\n"),
     ["bad.yaml", "single document", "allowed"]),
    ("top-level-list", TextCase("the whole file is `[experiment, test]`", lambda t: "[experiment, test]\n"),
     ["(top level)", "['experiment', 'test']", "allowed", "object"]),
    ("empty-file", TextCase("the file is empty", lambda t: ""), ["(top level)", "None", "allowed", "object"]),
    # issue 12: the tuning block's search spaces
    ("tuning-unknown-parameter", _set("tuning", {"methods": {"fedavg": {"mu": [0.1, 1.0]}}}),
     ["tuning.methods.fedavg.mu", "'mu'", "allowed parameters: lr"]),
    ("tuning-empty-grid", _set("tuning", {"methods": {"fedavg_ft": {"ft_lr": []}}}),
     ["tuning.methods.fedavg_ft.ft_lr", "[]", "allowed: a non-empty list"]),
    ("tuning-wrong-type", _set("tuning", {"methods": {"fedavg_ft": {"ft_epochs": [1, 2.5]}}}),
     ["tuning.methods.fedavg_ft", "ft_epochs[1]", "2.5", "allowed: int"]),
    ("tuning-unknown-label", _set("tuning", {"methods": {"ditto": {"lam": [0.1]}}}),
     ["tuning.methods", "['ditto']", "allowed: the experiment's method labels"]),
    ("tuning-random-without-samples", _set("tuning", {"search": "random"}), ["tuning.samples", "missing", "allowed"]),
    # decidable from the config and the registries, once failing only inside a job (issue 24)
    ("conv-model-on-vectors", _set("datasets", {"synthetic": {"model": {"name": "fedavg_cnn"}}}),
     ["datasets.synthetic.model.name", "'fedavg_cnn'", "allowed", "(60,)", "mlp"]),
    ("conv-model-on-small-images", _set("datasets/digits/model", {"name": "cnn4"}),
     ["datasets.digits.model.name", "'cnn4'", "allowed", "(1, 8, 8)", ">= 16"]),
    ("signal-model-on-images", _set("datasets/digits/model", {"name": "resnet1d"}),
     ["datasets.digits.model.name", "'resnet1d'", "allowed", "(1, 8, 8)"]),
    ("method-model-on-small-images", _set("methods/fedavg/model", {"name": "fedavg_cnn"}),
     ["methods.fedavg.model.name", "'fedavg_cnn'", "allowed", "(1, 8, 8)"]),
    ("official-test-without-one", _all(_set("partitions/dir0.5/pool", False), _set("training/global_test", ["official"])),
     ["training.global_test", "['official']", "allowed", "official test set", "digits"]),
    ("augment-on-vectors", _all(_set("datasets", {"synthetic": {}}), _set("training/augment", "crop_flip")),
     ["training.augment", "'crop_flip'", "allowed", "(60,)"]),
    ("partition-by-missing-group", _set("partitions/dir0.5", {"partitioner": "domain", "num_clients": 6}),
     ["partitions.dir0.5.params.partition_by", "'domain'", "allowed", "digits"]),
    ("label-quantity-size-below-classes", _set("partitions/pat2", {"partitioner": "label_quantity", "num_clients": 6, "params": {
        "num_classes_per_partition": 3, "partition_size": 2}}), ["partitions.pat2.params.partition_size", "value 2", "allowed", "3"]),
    ("label-quantity-more-clients-than-samples", _set("partitions/pat2", {"partitioner": "label_quantity", "num_clients": 1000}),
     ["partitions.pat2.num_clients", "1000", "allowed", "at most 898"]),
    ("vit-resize-false-on-other-sides", _set("datasets/digits/model", {"name": "prompted_vit", "params": {
        "backbone": "vit_tiny_patch16_224", "weights": "none", "resize": False, "backbone_args": {
            "img_size": 16, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}}}),
     ["datasets.digits.model.params", "'resize': False", "allowed", "img_size (16, 16)", "(1, 8, 8)"]),
    ("vit-backbone-args-timm-refuses", _set("datasets/digits/model", {"name": "prompted_vit", "params": {
        "backbone": "vit_tiny_patch16_224", "weights": "none", "backbone_args": {"embed_dim": 16, "num_heads": 3}}}),
     ["datasets.digits.model.params", "'num_heads': 3", "allowed", "divisible by num_heads"]),
    # options the chosen optimizer or schedule never reads (issue 24: never silently ignored)
    ("momentum-under-adam", _set("training/optimizer", {"name": "adam", "lr": 0.01, "momentum": 0.9}),
     ["training.optimizer.momentum", "0.9", "'adam'", "allowed", "weight_decay"]),
    ("momentum-under-adamw-in-a-method", _set("methods/fedavg/training", {"optimizer": {"name": "adamw", "momentum": 0.5}}),
     ["methods.fedavg.training.optimizer.momentum", "0.5", "'adamw'", "allowed"]),
    ("milestones-under-constant", _set("training/lr_schedule", {"milestones": [2]}),
     ["training.lr_schedule.milestones", "[2]", "'constant'", "allowed"]),
    ("gamma-under-constant", _set("training/lr_schedule", {"name": "constant", "gamma": 0.5}),
     ["training.lr_schedule.gamma", "0.5", "'constant'", "allowed"]),
    ("values-under-cosine", _set("training/lr_schedule", {"name": "cosine", "values": [0.1]}),
     ["training.lr_schedule.values", "[0.1]", "'cosine'", "allowed", "min_lr"]),
    ("min-lr-under-multistep", _set("training/lr_schedule", {"name": "multistep", "milestones": [1], "min_lr": 0.001}),
     ["training.lr_schedule.min_lr", "0.001", "'multistep'", "allowed"]),
    ("gamma-beside-values", _set("training/lr_schedule", {"name": "multistep", "milestones": [1], "gamma": 0.5,
                                                          "values": [0.05, 0.01]}),
     ["training.lr_schedule.gamma", "0.5", "values", "allowed"]),
    ("milestone-after-last-round", _set("training/lr_schedule", {"name": "multistep", "milestones": [1, 3]}),
     ["training.lr_schedule.milestones", "[1, 3]", "allowed", "below", "(3)"]),
    ("multistep-values-not-from-lr", _set("training/lr_schedule", {"name": "multistep", "milestones": [1], "values": [0.1, 0.01]}),
     ["training.lr_schedule.values", "[0.1, 0.01]", "allowed", "values[0] equal to", "(0.05)"]),
    ("tuning-lr-grid-under-multistep-values", _all(
        _set("training/lr_schedule", {"name": "multistep", "milestones": [1], "values": [0.05, 0.01]}),
        _set("tuning", {"methods": {"fedavg_ft": {"ft_epochs": [1, 2]}}})),
     ["tuning.lr", "method label", "[0.05, 0.01]", "allowed", "gamma"]),
    ("min-lr-above-lr", _set("training/lr_schedule", {"name": "cosine", "min_lr": 0.1}),
     ["training.lr_schedule.min_lr", "0.1", "allowed", "below", "0.05"]),
    # ---- sweeps (methods.<label>.sweep)
    ("sweep-no-values", _set("methods/fedavg_ft/sweep", {"hparams.ft_epochs": []}),
     ["methods.fedavg_ft.sweep.hparams.ft_epochs", "[]", "allowed", "non-empty list"]),
    ("sweep-not-an-entry-key", _set("methods/fedavg_ft/sweep", {"hparam.ft_epochs": [1, 2]}),
     ["methods.fedavg_ft.sweep.hparam.ft_epochs", "allowed", "hparams, training, model"]),
    ("sweep-value-not-a-name", _set("methods/fedavg_ft/sweep", {"training.global_test": [["union"]]}),
     ["methods.fedavg_ft.sweep.training.global_test", "['union']", "allowed", "numbers, booleans, null or names"]),
]


@pytest.mark.parametrize("mutate,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_config_raises_config_error(base, mutate, expected, tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as exc:
        if isinstance(mutate, TextCase):
            monkeypatch.chdir(tmp_path)
            Path("bad.yaml").write_bytes(mutate.content(TEST_CONFIG.read_text()))
            resolve_experiment(load_config("bad.yaml"))
        else:
            cfg = copy.deepcopy(base)
            mutate(cfg)
            resolve_experiment(cfg)
    msg = str(exc.value)
    missing = [s for s in expected if s not in msg]
    assert not missing, f"message {msg!r} lacks {missing}"


def test_malformed_list_is_large_enough():
    assert len(BAD) >= 80
    assert len({b[0] for b in BAD}) == len(BAD)


def test_base_config_is_valid(base):
    # Guard for the malformed cases: each breaks exactly one thing of a config that resolves.
    assert len(resolve_experiment(copy.deepcopy(base))["cells"]) == n_cells(base)


@pytest.mark.parametrize(
    "mutate,key",
    [
        (_set("partitions/dir0.5/partitioner", "shards"), "'partitions.dir0.5.partitioner'"),
        (_set("partitions/pat2/params/num_classes_per_partition", 11), "'partitions.pat2.params.num_classes_per_partition'"),
    ],
    ids=["partitioner", "num_classes_per_partition"],
)
def test_partition_errors_quote_the_full_dotted_key(base, mutate, key):
    cfg = copy.deepcopy(base)
    mutate(cfg)
    with pytest.raises(ConfigError) as exc:
        resolve_experiment(cfg)
    assert key in str(exc.value)


def test_partition_seed_above_randomstate_range_is_refused(base):
    cfg = copy.deepcopy(base)
    cfg["partitions"]["dir0.5"]["seed"] = 2**32
    with pytest.raises(ConfigError, match="seed"):
        resolve_experiment(cfg)


def test_label_quantity_partition_size_beyond_the_dataset_is_refused_before_any_job():
    """Calibre's Q-non-iid: num_clients disjoint clients of partition_size samples must fit the dataset."""
    cfg = {"experiment": "e", "datasets": {"digits": {}}, "seeds": [0], "methods": {"fedavg": {}},
           "partitions": {"q": {"partitioner": "label_quantity", "num_clients": 10,
                                "params": {"num_classes_per_partition": 2, "partition_size": 200}}}}
    with pytest.raises(ConfigError, match=r"partitions.q.params.partition_size' has value 200; allowed: at most 179"):
        resolve_experiment(cfg)
    cfg["partitions"]["q"]["params"]["partition_size"] = 100
    resolve_experiment(cfg)


def test_defaults_never_count_as_options_the_user_set(base):
    """adam with the default momentum (0.0, read by sgd only) and a constant schedule with the default
    milestones/gamma/values/min_lr resolve; the resolved cell still carries the defaults (cell hashes unchanged)."""
    cfg = copy.deepcopy(base)
    cfg["training"]["optimizer"] = {"name": "adam", "lr": 0.001}
    cell = resolve_experiment(cfg)["cells"][0]
    assert cell["training"]["optimizer"] == {"name": "adam", "lr": 0.001, "momentum": 0.0, "weight_decay": 0.0}
    assert cell["training"]["lr_schedule"] == TRAINING_DEFAULTS["lr_schedule"]


def test_an_inner_block_may_switch_the_optimizer_or_schedule(base):
    """Keys an outer block set for its own optimizer/schedule are read by the outer block's cells; a
    method switching to another one cannot unset them, so they are not reported there."""
    cfg = copy.deepcopy(base)
    cfg["training"]["optimizer"] = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
    cfg["training"]["lr_schedule"] = {"name": "multistep", "milestones": [2], "gamma": 0.5}
    cfg["methods"]["fedavg"] = {"training": {"optimizer": {"name": "adam", "lr": 0.001}, "lr_schedule": {"name": "constant"}}}
    cells = resolve_experiment(cfg)["cells"]
    assert {c["training"]["optimizer"]["name"] for c in cells} == {"sgd", "adam"}
    cfg["methods"]["fedavg"]["training"]["optimizer"]["momentum"] = 0.5  # set where adam is in force: an error
    with pytest.raises(ConfigError, match=r"'methods.fedavg.training.optimizer.momentum' has value 0.5"):
        resolve_experiment(cfg)


def test_tuning_trials_may_end_before_a_milestone(base):
    cfg = copy.deepcopy(base)
    cfg["training"]["lr_schedule"] = {"name": "multistep", "milestones": [2], "gamma": 0.5}
    cfg["tuning"] = {"training": {"rounds": 1}, "methods": {"fedavg_ft": {"ft_epochs": [1, 2]}}}
    exp = resolve_experiment(cfg)
    assert exp["tuning_cells"] and all(c["training"]["rounds"] == 1 for c in exp["tuning_cells"])


@pytest.mark.parametrize("name", ["fedavg_cnn", "cnn4", "resnet18_cifar", "resnet32_cifar", "resnet1d", "mlp"])
def test_model_input_rule_agrees_with_a_forward_pass(name):
    """models.input_problem (decided from the registry, before any job) against the model itself."""
    import torch

    from fedrepro.models import build_model, input_problem

    for shape in [(60,), (1, 8), (2, 32), (1, 8, 8), (1, 15, 16), (1, 16, 16), (3, 28, 28), (1, 2, 3, 4)]:
        try:
            with torch.device("meta"), torch.no_grad():  # shapes only: no memory, no compute
                build_model(name, shape, 3).eval()(torch.zeros(2, *shape))
            works = True
        except (RuntimeError, ValueError, TypeError):
            works = False
        assert (input_problem(name, shape) is None) == works, (name, shape)


def test_a_resolved_cell_with_an_unset_optional_model_parameter_builds(base):
    """head_hidden: null (the default: a linear head) is in every resolved resnet1d cell; the job's
    build_model re-checks the cell's parameters and must accept it (it refused None before)."""
    from fedrepro.models import build_model

    cfg = copy.deepcopy(base)
    cfg["datasets"] = {"synthetic": {"model": {"name": "resnet1d", "params": {"width": 4}}}}
    cell = resolve_experiment(cfg)["cells"][0]
    assert cell["model"]["params"]["head_hidden"] is None
    assert build_model("resnet1d", (60,), 10, cell["model"]["params"]).head.out_features == 10


def test_the_schema_itself_passes_the_strict_reader():
    """No duplicate keys in the schema (a second `tuning:` block once shadowed the first unnoticed)."""
    from fedrepro.configfile import read_config_file

    assert "tuning" in read_config_file(ROOT / "src" / "fedrepro" / "schemas" / "experiment.schema.yaml")["properties"]
