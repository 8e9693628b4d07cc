"""Evaluation protocols every method gets from the engine: unseen clients, global test data
(union of the client test splits, the official test set), GRP-FED's P/G/L, data scarcity,
and FedCRC's learning-rate schedule."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from fedrepro.config import resolve_experiment
from fedrepro.data.datasets import DATASETS, DatasetSpec
from fedrepro.data.shards import make_partition, read_official_test, resolve_partition_spec, unseen_client_ids, write_partition
from fedrepro.engine.engine import lr_at
from fedrepro.engine.run import train_cell
from fedrepro.metrics import harmonic_mean
from fedrepro.registry import ConfigError

from conftest import random_images, tiny_config


def experiment(partition: dict | None = None, dataset: str = "digits", **training) -> dict:
    cfg = tiny_config(**training)
    cfg["partitions"]["dir"].update(partition or {})
    if dataset != "digits":
        cfg["datasets"] = {dataset: cfg["datasets"]["digits"]}
    return resolve_experiment(cfg)


@pytest.fixture(scope="module")
def images_with_test_set():
    """A tiny registered dataset with an official test set (digits has none), for this module."""
    raw = random_images(900, test_share=0.3)
    spec = DatasetSpec("protocol_images", "random images with an official test split (tests only)", "generated", 10, (1, 4, 4),
                       "900 images", {}, lambda root, params: None, lambda root, params: raw)
    DATASETS.add(spec.name, spec, spec.summary, {})
    yield raw
    DATASETS._entries.pop(spec.name)


@pytest.fixture(scope="module")
def protocol_partition(tmp_path_factory, images_with_test_set):
    """6 clients, 2 of them unseen, the official test set kept apart (pool: false)."""
    exp = experiment({"num_clients": 6, "unseen_clients": 2, "pool": False, "params": {"alpha": 0.5, "min_partition_size": 20}},
                     dataset="protocol_images", global_test=["union", "official"])
    part = exp["partitions"][0]
    out = tmp_path_factory.mktemp("proto") / part["id"]
    manifest = write_partition(images_with_test_set, part["spec"], out)
    return out, exp, manifest, images_with_test_set


def run(protocol_partition, label, tmp_path):
    shards, exp, _, _ = protocol_partition
    cell = copy.deepcopy(next(c for c in exp["cells"] if c["label"] == label))
    return train_cell(cell, shards, tmp_path / label, progress=False)


def test_unseen_clients_are_drawn_from_the_seed_and_marked(protocol_partition):
    _, exp, manifest, _ = protocol_partition
    spec = exp["partitions"][0]["spec"]
    assert manifest["unseen_clients"] == unseen_client_ids(spec) and len(manifest["unseen_clients"]) == 2
    assert [c["id"] for c in manifest["clients"] if c["unseen"]] == manifest["unseen_clients"]
    other = [unseen_client_ids({**spec, "seed": s}) for s in range(8)]
    assert len({tuple(o) for o in other}) > 1


def test_unseen_clients_never_train_and_are_scored_after_training(protocol_partition, tmp_path):
    _, _, manifest, _ = protocol_partition
    m = run(protocol_partition, "fedavg", tmp_path)
    unseen = manifest["unseen_clients"]
    assert m["clients"]["unseen_ids"] == unseen
    assert not set(unseen) & set(m["clients"]["ids"])  # not in the federation's per-client results
    assert len(m["final"]["unseen_global"]["acc"]) == 2
    # FedAvg has no personalized model: no unseen_personal kind
    assert "unseen_personal_acc" not in m["summary"] and "unseen_global_acc" in m["summary"]


def test_unseen_personalization_runs_the_methods_local_update(protocol_partition, tmp_path):
    m = run(protocol_partition, "fedavg_ft", tmp_path)
    assert len(m["final"]["unseen_personal"]["acc"]) == 2
    # the fine-tuned model differs from the global one on at least one unseen client
    assert m["final"]["unseen_personal"]["f1"] != m["final"]["unseen_global"]["f1"]


def test_method_without_global_model_uses_the_average_of_personal_models(protocol_partition, tmp_path):
    from fedrepro.engine.engine import Engine  # noqa: F401  (the engine computes it)

    m = run(protocol_partition, "local", tmp_path)
    assert "global_acc" not in m["summary"]  # no global model on the clients' own test splits
    assert len(m["final"]["unseen_global"]["acc"]) == 2  # ... but the average model for unseen clients
    assert len(m["final"]["union_global"]["acc"]) == 1  # and the softmax ensemble on the union


def test_union_global_accuracy_is_the_test_size_weighted_client_accuracy(protocol_partition, tmp_path):
    m = run(protocol_partition, "fedavg", tmp_path)
    weighted = m["summary"]["global_acc"]["weighted_mean"]
    assert m["final"]["union_global"]["acc"][0] == pytest.approx(weighted, abs=1e-12)


def test_official_test_set_is_the_held_out_official_split(protocol_partition, tmp_path):
    shards, _, manifest, raw = protocol_partition
    official = read_official_test(shards, manifest)
    assert len(official.y["test"]) == int((raw.official_split == 1).sum()) == manifest["official_test"]["sizes"]["test"]
    clients_rows = set()
    import pyarrow.parquet as pq

    for c in manifest["clients"]:
        clients_rows |= set(pq.read_table(shards / c["file"], columns=["index"]).column("index").to_pylist())
    official_rows = set(pq.read_table(shards / "official_test.parquet", columns=["index"]).column("index").to_pylist())
    assert not clients_rows & official_rows  # never in any client's data
    m = run(protocol_partition, "fedavg", tmp_path)
    assert 0 <= m["final"]["official_global"]["acc"][0] <= 1


def test_generalization_and_harmonic_mean_follow_grp_fed(protocol_partition, tmp_path):
    m = run(protocol_partition, "fedavg_ft", tmp_path)
    p = m["final"]["personal"]["f1"]  # P: each personalized model on its own test split
    g = m["final"]["official_personal"]["f1"]  # G: each personalized model on the official test set
    hm = m["final"]["official_hm"]["f1"]
    assert len(p) == len(g) == len(hm) == 4
    assert hm == pytest.approx([harmonic_mean(a, b) for a, b in zip(p, g)])
    assert m["summary"]["official_hm_f1"]["mean"] == pytest.approx(np.mean(hm))
    # a global-only method: G_k is the global model's score for every client
    fa = run(protocol_partition, "fedavg", tmp_path)
    gg = fa["final"]["official_global"]["f1"][0]
    assert fa["final"]["official_hm"]["f1"] == pytest.approx([harmonic_mean(a, gg) for a in fa["final"]["global"]["f1"]])


def test_harmonic_mean():
    assert harmonic_mean(0.933, 0.076) == pytest.approx(2 * 0.933 * 0.076 / 1.009)
    assert harmonic_mean(0.0, 0.0) == 0.0


def test_official_global_test_needs_an_unpooled_partition():
    with pytest.raises(ConfigError, match=r"global_test.*pool: false"):
        experiment(global_test=["official"])
    with pytest.raises(ConfigError, match=r"training.global_test"):
        experiment(global_test=["everything"])


def test_unseen_clients_bounds_and_participation_counts_training_clients():
    with pytest.raises(ConfigError, match=r"unseen_clients.*has value 4"):
        experiment({"unseen_clients": 4})
    with pytest.raises(ConfigError, match=r"participation.*at most the 3 training clients"):
        experiment({"unseen_clients": 1}, participation=4)


def test_scarcity_keeps_a_fraction_of_chosen_clients_class_by_class():
    raw = random_images(2000)
    # scarcity applies before the train/test split: count a client's rows over both splits
    base = {"dataset": "random_images", "partitioner": "iid", "num_clients": 5, "seed": 3, "split": {"test_fraction": 0.2}}
    rows = lambda part: np.sort(np.concatenate([part["train"], part["test"]]))
    full = make_partition(raw, base)
    cut = make_partition(raw, {**base, "scarcity": {"clients": [1, 4], "fraction": 0.1}})
    for cid in range(5):
        before, after = np.bincount(raw.y[rows(full[cid])], minlength=10), np.bincount(raw.y[rows(cut[cid])], minlength=10)
        if cid in (1, 4):
            assert np.array_equal(after, np.maximum(1, np.round(0.1 * before)).astype(int) * (before > 0))
            assert set(rows(cut[cid])) <= set(rows(full[cid]))
        else:  # untouched clients keep exactly their rows (the split's draw may differ)
            assert np.array_equal(rows(cut[cid]), rows(full[cid]))
    ranged = make_partition(raw, {**base, "scarcity": {"clients": "all", "fraction": [0.05, 0.25]}})
    shares = [len(rows(r)) / len(rows(f)) for r, f in zip(ranged, full)]
    assert all(0.04 < s < 0.27 for s in shares) and len(set(np.round(shares, 3))) > 1


@pytest.mark.parametrize("scarcity, key", [
    ({"fraction": 0}, "scarcity.fraction"),
    ({"fraction": [0.3, 0.1]}, "scarcity.fraction"),
    ({"clients": [9], "fraction": 0.5}, "scarcity.clients"),
])
def test_bad_scarcity_is_rejected_naming_the_key(scarcity, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_partition_spec({"dataset": "digits", "partitioner": "iid", "num_clients": 4, "scarcity": scarcity})


def test_fedcrc_learning_rate_schedule():
    schedule = {"name": "multistep", "milestones": [50, 75], "values": [0.05, 0.01, 0.001]}
    assert [lr_at(schedule, 0.05, r) for r in (1, 50, 51, 75, 76, 100)] == [0.05, 0.05, 0.01, 0.01, 0.001, 0.001]


def test_partitions_can_be_restricted_to_datasets_and_datasets_override_training():
    cfg = tiny_config()
    cfg["datasets"]["synthetic"] = {"params": {"num_users": 4, "max_samples_per_user": 60}, "training": {"rounds": 3}}
    cfg["partitions"]["iid_syn"] = {"partitioner": "iid", "num_clients": 4, "datasets": ["synthetic"]}
    cfg["methods"]["fedavg_ft"]["training"] = {"rounds": 5}
    exp = resolve_experiment(cfg)
    assert {(p["dataset"], p["label"]) for p in exp["partitions"]} == {("digits", "dir"), ("synthetic", "dir"), ("synthetic", "iid_syn")}
    rounds = {(c["dataset"], c["label"]): c["training"]["rounds"] for c in exp["cells"]}
    assert rounds[("digits", "fedavg")] == 2  # the experiment's training
    assert rounds[("synthetic", "fedavg")] == 3  # the dataset's override
    assert rounds[("synthetic", "fedavg_ft")] == rounds[("digits", "fedavg_ft")] == 5  # the method's override wins
    cfg["partitions"]["iid_syn"]["datasets"] = ["cifar10"]
    with pytest.raises(ConfigError, match=r"partitions\.iid_syn\.datasets.*unknown \['cifar10'\]"):
        resolve_experiment(cfg)
