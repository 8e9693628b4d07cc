"""Experiment config validation and expansion into cells."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

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
    ("bad-experiment-name", _set("experiment", "has space"), ["experiment", "'has space'", "allowed"]),
]


@pytest.mark.parametrize("mutate,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_config_raises_config_error(base, mutate, expected):
    cfg = copy.deepcopy(base)
    mutate(cfg)
    with pytest.raises(ConfigError) as exc:
        resolve_experiment(cfg)
    msg = str(exc.value)
    missing = [s for s in expected if s not in msg]
    assert not missing, f"message {msg!r} lacks {missing}"


def test_malformed_list_is_large_enough():
    assert len(BAD) >= 15
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
