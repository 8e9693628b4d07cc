"""Partitioner and per-client split tests on small synthetic datasets (offline, fast)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.model_selection import train_test_split

from fedrepro.data.base import RawDataset
from fedrepro.data.partitioners import (
    PARTITIONERS,
    dirichlet_partition,
    iid_partition,
    pathological_partition,
    split_client,
)
from fedrepro.data.shards import make_partition
from fedrepro.registry import ConfigError
from conftest import random_images

NUM_CLASSES = 10


# ----------------------------------------------------------------------- helpers


def make_raw(n: int = 600, num_classes: int = NUM_CLASSES, seed: int = 0) -> RawDataset:
    return random_images(n, num_classes, seed, test_share=0.17)


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return make_raw().y


def assert_disjoint_cover(parts: list[np.ndarray], n: int, exact: bool = True) -> None:
    allidx = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    assert len(np.unique(allidx)) == len(allidx), "a sample was assigned to two clients (or twice)"
    if exact:
        assert len(allidx) == n
        assert np.array_equal(np.sort(allidx), np.arange(n))
    else:
        assert allidx.min(initial=0) >= 0 and allidx.max(initial=0) < n


def label_entropy(parts: list[np.ndarray], y: np.ndarray) -> float:
    """Mean over non-empty clients of the entropy (nats) of the client's label distribution."""
    ents = []
    for p in parts:
        if len(p) == 0:
            continue
        q = np.bincount(y[p], minlength=NUM_CLASSES) / len(p)
        q = q[q > 0]
        ents.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(ents))


PARTITION_CASES = {
    "iid": (iid_partition, {}),
    "dirichlet": (dirichlet_partition, {"alpha": 0.5, "min_partition_size": 10}),
    "dirichlet_balanced": (dirichlet_partition, {"alpha": 0.5, "min_partition_size": 10, "self_balancing": True}),
    "pathological": (pathological_partition, {"num_classes_per_partition": 2}),
    "pathological_first": (pathological_partition, {"num_classes_per_partition": 3, "class_assignment": "first"}),
}


# ----------------------------------------------------------------------- all partitioners


@pytest.mark.parametrize("num_clients", [7, 20])
@pytest.mark.parametrize("case", list(PARTITION_CASES), ids=list(PARTITION_CASES))
def test_every_sample_assigned_exactly_once(labels, case, num_clients):
    fn, params = PARTITION_CASES[case]
    parts = fn(labels, num_clients, np.random.RandomState(3), **params)
    assert len(parts) == num_clients
    assert all(np.asarray(p).dtype.kind == "i" for p in parts)
    assert_disjoint_cover(parts, len(labels), exact=True)


def test_registry_lists_the_three_partitioners():
    assert {"iid", "dirichlet", "pathological"} <= set(PARTITIONERS.names())
    assert PARTITIONERS.get("dirichlet") is dirichlet_partition
    assert set(PARTITIONERS.entry("dirichlet").params) >= {"alpha", "min_partition_size", "self_balancing"}


@pytest.mark.parametrize("case", list(PARTITION_CASES), ids=list(PARTITION_CASES))
def test_deterministic_by_seed(labels, case):
    fn, params = PARTITION_CASES[case]
    a = fn(labels, 8, np.random.RandomState(11), **params)
    b = fn(labels, 8, np.random.RandomState(11), **params)
    c = fn(labels, 8, np.random.RandomState(12), **params)
    assert len(a) == len(b) == len(c) == 8
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c)), "a different seed gave the same partition"


@pytest.mark.parametrize("fn", [iid_partition, dirichlet_partition, pathological_partition], ids=["iid", "dirichlet", "pathological"])
def test_more_clients_than_samples_is_refused(fn):
    with pytest.raises(ConfigError, match="num_clients"):
        fn(np.zeros(5, dtype=np.int64), 6, np.random.RandomState(0))


# ----------------------------------------------------------------------- iid


@pytest.mark.parametrize("num_clients", [3, 7, 13, 600])
def test_iid_sizes_differ_by_at_most_one(labels, num_clients):
    parts = iid_partition(labels, num_clients, np.random.RandomState(0))
    sizes = [len(p) for p in parts]
    assert len(sizes) == num_clients
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == len(labels)


def test_iid_is_shuffled_not_contiguous(labels):
    parts = iid_partition(labels, 6, np.random.RandomState(0))
    # A contiguous split would give client 0 the indices 0..99.
    assert not np.array_equal(parts[0], np.arange(100))
    # ...and every client sees most classes.
    assert all(len(np.unique(labels[p])) >= 8 for p in parts)


# ----------------------------------------------------------------------- dirichlet


@pytest.mark.parametrize("self_balancing", [False, True], ids=["plain", "balanced"])
@pytest.mark.parametrize("min_size", [20, 40])
def test_dirichlet_min_partition_size_respected(labels, min_size, self_balancing):
    for seed in range(3):
        parts = dirichlet_partition(labels, 10, np.random.RandomState(seed), alpha=0.5,
                                    min_partition_size=min_size, self_balancing=self_balancing)
        assert min(len(p) for p in parts) >= min_size
        assert_disjoint_cover(parts, len(labels))


def test_dirichlet_impossible_min_size_is_refused(labels):
    with pytest.raises(ConfigError, match="min_partition_size"):
        dirichlet_partition(labels, 10, np.random.RandomState(0), min_partition_size=61)


def test_dirichlet_gives_up_after_max_retries(labels):
    # 60 per client on average with alpha tiny: no draw gives every client >= 55.
    with pytest.raises(ConfigError, match="min_partition_size"):
        dirichlet_partition(labels, 10, np.random.RandomState(0), alpha=0.01, min_partition_size=55, max_retries=5)


def test_dirichlet_alpha_controls_label_skew(labels):
    seeds = range(4)
    skewed = np.mean([label_entropy(dirichlet_partition(labels, 10, np.random.RandomState(s), alpha=0.05, min_partition_size=0), labels)
                      for s in seeds])
    flat = np.mean([label_entropy(dirichlet_partition(labels, 10, np.random.RandomState(s), alpha=100.0, min_partition_size=0), labels)
                    for s in seeds])
    # alpha=100 is close to the pooled label entropy (about log 10 = 2.30); alpha=0.05 gives a
    # class or two per client.
    assert flat > 2.1
    assert skewed < flat - 1.0, (skewed, flat)


def test_dirichlet_self_balancing_keeps_sizes_near_n_over_k(labels):
    seeds = range(8)

    def stats(balanced: bool) -> tuple[float, float]:
        stds, maxes = [], []
        for s in seeds:
            parts = dirichlet_partition(labels, 10, np.random.RandomState(s), alpha=0.1, min_partition_size=0,
                                        self_balancing=balanced)
            sizes = np.array([len(p) for p in parts])
            assert sizes.sum() == len(labels)
            stds.append(sizes.std())
            maxes.append(sizes.max())
        return float(np.mean(stds)), float(np.mean(maxes))

    std_plain, max_plain = stats(False)
    std_bal, max_bal = stats(True)
    assert std_bal < 0.8 * std_plain, (std_bal, std_plain)
    assert max_bal < max_plain - 15, (max_bal, max_plain)


def test_dirichlet_keeps_allocation_order(labels):
    """Client lists are not sorted: PFLlib's later train/test split depends on the order."""
    parts = dirichlet_partition(labels, 5, np.random.RandomState(0), alpha=1.0, min_partition_size=0)
    assert any(not np.all(np.diff(p) > 0) for p in parts if len(p) > 1)


# ----------------------------------------------------------------------- pathological


@pytest.mark.parametrize(
    "num_clients,s,assignment",
    [(20, 2, "deterministic"), (7, 3, "deterministic"), (10, 1, "deterministic"), (5, 2, "deterministic"), (12, 4, "first")],
    ids=["20x2", "7x3", "10x1", "5x2", "12x4-first"],
)
def test_pathological_classes_and_equal_shares(labels, num_clients, s, assignment):
    parts = pathological_partition(labels, num_clients, np.random.RandomState(1), num_classes_per_partition=s,
                                   class_assignment=assignment)
    assert len(parts) == num_clients
    assert_disjoint_cover(parts, len(labels), exact=True)
    holders: dict[int, list[int]] = {}
    for cid, p in enumerate(parts):
        present = np.unique(labels[p])
        assert len(present) == s, f"client {cid} holds classes {present.tolist()}, expected exactly {s}"
        for k in present:
            holders.setdefault(int(k), []).append(int(np.sum(labels[p] == k)))
    for k, shares in holders.items():
        assert sum(shares) == int(np.sum(labels == k))  # the class is split entirely among its holders
        assert max(shares) - min(shares) <= 1, f"class {k} shares {shares} are not equal"
    if (num_clients * s) % NUM_CLASSES == 0:  # the documented balance of the deterministic assignment
        assert len({len(v) for v in holders.values()}) == 1


def test_pathological_first_assignment_is_in_class_order(labels):
    parts = pathological_partition(labels, 5, np.random.RandomState(0), num_classes_per_partition=2, class_assignment="first")
    assert [sorted(np.unique(labels[p]).tolist()) for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_pathological_too_few_clients_leaves_classes_out_but_stays_disjoint(labels):
    parts = pathological_partition(labels, 2, np.random.RandomState(0), num_classes_per_partition=2)
    assert_disjoint_cover(parts, len(labels), exact=False)
    assert sum(len(np.unique(labels[p])) for p in parts) == 4
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)


def test_pathological_more_classes_than_dataset_is_refused(labels):
    with pytest.raises(ConfigError, match="num_classes_per_partition") as exc:
        pathological_partition(labels, 10, np.random.RandomState(0), num_classes_per_partition=11)
    assert "11" in str(exc.value) and "allowed" in str(exc.value)


def test_pathological_more_classes_refused_through_make_partition():
    raw = make_raw()
    spec = {"dataset": "t", "partitioner": "pathological", "num_clients": 10, "params": {"num_classes_per_partition": 11}}
    with pytest.raises(ConfigError, match="num_classes_per_partition"):
        make_partition(raw, spec)


# ----------------------------------------------------------------------- PFLlib reproduction


def pfllib_separate_dir(dataset_label: np.ndarray, num_clients: int, num_classes: int, alpha: float, least_samples: int):
    """Transcription of PFLlib dataset/utils/dataset_utils.py separate_data(partition="dir"),
    using numpy's global RNG; returns the client index lists and the number of tries."""
    min_size = 0
    K = num_classes
    N = len(dataset_label)
    try_cnt = 1
    while min_size < least_samples:
        idx_batch = [[] for _ in range(num_clients)]
        for k in range(K):
            idx_k = np.where(dataset_label == k)[0]
            np.random.shuffle(idx_k)
            proportions = np.random.dirichlet(np.repeat(alpha, num_clients))
            proportions = np.array([p * (len(idx_j) < N / num_clients) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
            min_size = min([len(idx_j) for idx_j in idx_batch])
        try_cnt += 1
    return idx_batch, try_cnt - 1


def pfllib_split_data(X: list[np.ndarray], y: list[np.ndarray], train_size: float = 0.75):
    """Transcription of PFLlib split_data: sklearn's shuffled split per client, global RNG."""
    train, test = [], []
    for i in range(len(y)):
        X_train, X_test, y_train, y_test = train_test_split(X[i], y[i], train_size=train_size, shuffle=True)
        train.append(X_train)
        test.append(X_test)
    return train, test


@pytest.mark.parametrize("n,num_clients", [(1200, 10), (2000, 20)], ids=["1200x10", "2000x20"])
def test_dirichlet_reproduces_pfllib_separate_and_split(n, num_clients):
    raw = make_raw(n=n, seed=5)
    state = np.random.get_state()
    try:
        np.random.seed(1)
        idx_batch, tries = pfllib_separate_dir(raw.y, num_clients, NUM_CLASSES, alpha=0.1, least_samples=40)
        # PFLlib's X[client] = dataset_content[idxs]: the client's rows in allocation order;
        # using the indices themselves as X tells which rows land in train and test.
        X = [np.asarray(b, dtype=np.int64) for b in idx_batch]
        y = [raw.y[b] for b in X]
        ref_train, ref_test = pfllib_split_data(X, y)
    finally:
        np.random.set_state(state)
    spec = {
        "dataset": "synthetic_test",
        "partitioner": "dirichlet",
        "params": {"alpha": 0.1, "min_partition_size": 40, "self_balancing": True},
        "num_clients": num_clients,
        "seed": 1,
        "pool": True,
        "split": {"test_fraction": 0.25, "stratify": False},
    }
    ours = make_partition(raw, spec)
    assert len(ours) == num_clients
    for cid, (splits, tr, te) in enumerate(zip(ours, ref_train, ref_test)):
        assert np.array_equal(np.sort(splits["train"]), np.sort(tr)), f"client {cid} train differs from PFLlib"
        assert np.array_equal(np.sort(splits["test"]), np.sort(te)), f"client {cid} test differs from PFLlib"
        assert len(splits["val"]) == 0
    assert tries > 1  # both cases exercise the redraw loop, so its RNG consumption is compared too


def test_pfllib_reproduction_needs_the_balance_cap():
    """Guard: the comparison above is sensitive (without the cap the partition differs)."""
    raw = make_raw(n=1200, seed=5)
    state = np.random.get_state()
    try:
        np.random.seed(1)
        idx_batch, _ = pfllib_separate_dir(raw.y, 10, NUM_CLASSES, alpha=0.1, least_samples=40)
    finally:
        np.random.set_state(state)
    spec = {"dataset": "t", "partitioner": "dirichlet", "params": {"alpha": 0.1, "min_partition_size": 40, "self_balancing": False},
            "num_clients": 10, "seed": 1, "pool": True, "split": {"test_fraction": 0.25, "stratify": False}}
    ours = make_partition(raw, spec)
    same = [np.array_equal(np.sort(np.concatenate([s["train"], s["test"]])), np.sort(b)) for s, b in zip(ours, idx_batch)]
    assert not all(same)


# ----------------------------------------------------------------------- split_client


def test_split_client_stratified_per_class_counts(labels):
    rng = np.random.RandomState(0)
    indices = rng.permutation(len(labels))[:400]
    out = split_client(indices, labels, np.random.RandomState(4), test_fraction=0.25, val_fraction=0.1, stratify=True)
    tr, te, va = out["train"], out["test"], out["val"]
    assert_disjoint_cover([tr, te, va], len(labels), exact=False)
    assert np.array_equal(np.sort(np.concatenate([tr, te, va])), np.sort(indices))
    for k in np.unique(labels[indices]):
        n_k = int(np.sum(labels[indices] == k))
        assert int(np.sum(labels[te] == k)) == int(round(0.25 * n_k)), f"class {k}"
        assert int(np.sum(labels[va] == k)) == int(round(0.1 * n_k)), f"class {k}"
        assert int(np.sum(labels[tr] == k)) == n_k - int(round(0.25 * n_k)) - int(round(0.1 * n_k))


def test_split_client_stratified_is_deterministic_and_seed_dependent(labels):
    idx = np.arange(300)
    a = split_client(idx, labels, np.random.RandomState(1), 0.3, 0.0, True)
    b = split_client(idx, labels, np.random.RandomState(1), 0.3, 0.0, True)
    c = split_client(idx, labels, np.random.RandomState(2), 0.3, 0.0, True)
    assert all(np.array_equal(a[s], b[s]) for s in ("train", "test", "val"))
    assert not np.array_equal(a["test"], c["test"])
    assert len(a["val"]) == 0


@pytest.mark.parametrize("n,tf,vf", [(40, 0.25, 0.0), (41, 0.25, 0.0), (97, 0.2, 0.1), (10, 0.33, 0.33), (55, 0.0, 0.2)])
def test_split_client_unstratified_matches_sklearn(labels, n, tf, vf):
    indices = np.random.RandomState(9).permutation(len(labels))[:n]
    out = split_client(indices, labels, np.random.RandomState(7), tf, vf, stratify=False)
    n_test = math.ceil(tf * n)  # sklearn: a float test_size rounds the test set up
    n_val = math.ceil(vf / (1 - tf) * (n - n_test)) if vf > 0 else 0
    assert len(out["test"]) == n_test
    assert len(out["val"]) == n_val
    assert len(out["train"]) == n - n_test - n_val
    assert_disjoint_cover([out["train"], out["test"], out["val"]], len(labels), exact=False)
    assert np.array_equal(np.sort(np.concatenate(list(out.values()))), np.sort(indices))
    # Same draws as sklearn given the same RandomState.
    ref_rng = np.random.RandomState(7)
    if tf > 0:
        rest, test = train_test_split(indices, test_size=tf, shuffle=True, random_state=ref_rng)
        assert np.array_equal(out["test"], test)
    else:
        rest = indices
    if vf > 0:
        rest, val = train_test_split(rest, test_size=vf / (1 - tf), shuffle=True, random_state=ref_rng)
        assert np.array_equal(out["val"], val)
    assert np.array_equal(out["train"], rest)


@pytest.mark.parametrize(
    "split,keys",
    [
        ({"test_fraction": 0.6, "val_fraction": 0.4}, ["test_fraction", "val_fraction"]),
        ({"test_fraction": 0.7, "val_fraction": 0.5}, ["test_fraction", "val_fraction"]),
        ({"test_fraction": 1.0}, ["test_fraction"]),
        ({"val_fraction": -0.1}, ["val_fraction"]),
        ({"test_fraction": 0.2, "shuffle": True}, ["shuffle"]),
    ],
    ids=["sum-is-1", "sum-above-1", "test-1.0", "val-negative", "unknown-key"],
)
def test_split_fractions_validated(split, keys):
    spec = {"dataset": "t", "partitioner": "iid", "num_clients": 3, "split": split}
    with pytest.raises(ConfigError) as exc:
        make_partition(make_raw(), spec)
    msg = str(exc.value)
    assert all(k in msg for k in keys), msg
    assert "allowed" in msg


def test_make_partition_pool_false_uses_official_train_only():
    raw = make_raw()
    spec = {"dataset": "t", "partitioner": "iid", "num_clients": 4, "pool": False, "seed": 2,
            "split": {"test_fraction": 0.2, "val_fraction": 0.1}}
    parts = make_partition(raw, spec)
    used = np.concatenate([s[k] for s in parts for k in ("train", "test", "val")])
    assert len(np.unique(used)) == len(used)
    assert np.array_equal(np.sort(used), np.where(raw.official_split == 0)[0])
    pooled = make_partition(raw, {**spec, "pool": True})
    used_pooled = np.concatenate([s[k] for s in pooled for k in ("train", "test", "val")])
    assert len(used_pooled) == len(raw.y) > len(used)
