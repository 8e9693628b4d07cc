"""Tests of the quantity-skew, long-tail, domain, natural-id and label-quantity partitioners and
of Plato's Dirichlet sampler (`dirichlet` with sampler="plato"), on small synthetic data."""

from __future__ import annotations

import numpy as np
import pytest

from fedrepro.data.base import RawDataset
from fedrepro.data.partitioners import (
    PARTITIONERS,
    class_imbalance_factor,
    dirichlet_partition,
    domain_client_counts,
    domain_partition,
    label_quantity_partition,
    long_tail_class_sizes,
    long_tail_partition,
    natural_id_partition,
    quantity_skew_partition,
    size_imbalance_factor,
)
from fedrepro.data.shards import SPLITS, load_partition, make_partition, write_partition
from fedrepro.registry import ConfigError
from conftest import random_images

NUM_CLASSES = 10
NEW = ("quantity_skew", "long_tail", "domain", "natural_id", "label_quantity")


# ----------------------------------------------------------------------- helpers


def balanced_labels(per_class: int, num_classes: int = NUM_CLASSES, seed: int = 0) -> np.ndarray:
    """Exactly `per_class` samples of every class, in a shuffled order."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def domain_ids(n: int, num_domains: int = 5, seed: int = 1) -> np.ndarray:
    """Domains of (almost) equal size in a shuffled order."""
    return np.random.default_rng(seed).permutation(np.arange(n) % num_domains).astype(np.int64)


def patient_ids(n: int, num_patients: int = 12, seed: int = 2) -> np.ndarray:
    """Patients of unequal sizes (patient p has weight p + 1), every patient present, ids not contiguous."""
    g = np.random.default_rng(seed)
    ids = g.choice(num_patients, size=n, p=np.arange(1, num_patients + 1) / np.arange(1, num_patients + 1).sum())
    ids[:num_patients] = np.arange(num_patients)
    return (100 + 7 * ids).astype(np.int64)


def assert_disjoint(parts: list[np.ndarray], n: int, exact: bool = False) -> None:
    allidx = np.concatenate([np.asarray(p) for p in parts])
    assert allidx.dtype.kind == "i"
    assert len(np.unique(allidx)) == len(allidx), "a sample was assigned to two clients (or twice)"
    assert allidx.min(initial=0) >= 0 and allidx.max(initial=0) < n
    if exact:
        assert np.array_equal(np.sort(allidx), np.arange(n))


def counts_of(labels: np.ndarray, part: np.ndarray) -> np.ndarray:
    return np.bincount(labels[part], minlength=NUM_CLASSES)


def entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    ents = []
    for p in parts:
        q = counts_of(labels, p) / len(p)
        q = q[q > 0]
        ents.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(ents))


def with_groups(raw: RawDataset, **groups: np.ndarray) -> RawDataset:
    raw.groups = dict(groups)
    return raw


# ----------------------------------------------------------------------- registry


def test_all_new_partitioners_registered_with_documented_params():
    assert set(NEW) <= set(PARTITIONERS.names())
    for name in NEW:
        entry = PARTITIONERS.entry(name)
        assert entry.summary and "\n" not in entry.summary
        assert entry.params, name
        for key, param in entry.params.items():
            assert param.doc, f"{name}.{key} has no doc"
    assert {"sampler", "partition_size"} <= set(PARTITIONERS.entry("dirichlet").params)
    assert PARTITIONERS.entry("dirichlet").params["sampler"].default == "split"


# ----------------------------------------------------------------------- determinism, all new schemes


def _labels_groups(n: int = 1500):
    labels = balanced_labels(n // NUM_CLASSES)
    return labels, {"domain": domain_ids(n), "patient": patient_ids(n)}


CASES = {
    "quantity_skew_lognormal": ("quantity_skew", 10, {"distribution": "lognormal", "sigma": 1.0}),
    "quantity_skew_powerlaw": ("quantity_skew", 10, {"distribution": "powerlaw", "exponent": 1.5}),
    "long_tail": ("long_tail", 10, {"imbalance_factor": 10.0, "client_imbalance_factor": 10.0}),
    "domain_iid": ("domain", 13, {"dif": 5.0}),
    "domain_dirichlet": ("domain", 13, {"dif": 5.0, "alpha": 0.5}),
    "natural_id": ("natural_id", 12, {"partition_by": "patient"}),
    "label_quantity": ("label_quantity", 20, {"num_classes_per_partition": 2}),
    "dirichlet_plato": ("dirichlet", 10, {"alpha": 0.3, "sampler": "plato", "partition_size": 100}),
}
OVERLAPPING = {"dirichlet_plato"}
SEED_FREE = {"natural_id"}  # the data, not the seed, decides a natural partition


def run_case(case: str, seed: int) -> list[np.ndarray]:
    name, k, params = CASES[case]
    labels, groups = _labels_groups()
    fn = PARTITIONERS.get(name)
    extra = {"groups": groups} if name in ("domain", "natural_id") else {}
    return fn(labels, k, np.random.RandomState(seed), **params, **extra)


@pytest.mark.parametrize("case", list(CASES))
def test_deterministic_by_seed(case):
    a, b, c = run_case(case, 11), run_case(case, 11), run_case(case, 12)
    assert len(a) == len(b) == len(c) == CASES[case][1]
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))
    same = all(np.array_equal(x, y) for x, y in zip(a, c))
    if case in SEED_FREE:
        assert same, "a natural-id partition must not depend on the seed"
    else:
        assert not same, "a different seed gave the same partition"


@pytest.mark.parametrize("case", list(CASES))
def test_no_sample_twice_unless_overlap_is_the_scheme(case):
    parts = run_case(case, 3)
    n = len(_labels_groups()[0])
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts), "client indices are sorted and distinct"
    if case in OVERLAPPING:
        allidx = np.concatenate(parts)
        assert allidx.min() >= 0 and allidx.max() < n
        assert len(np.unique(allidx)) < len(allidx), "Plato's sampler is expected to overlap across clients here"
    else:
        assert_disjoint(parts, n, exact=case in ("quantity_skew_lognormal", "quantity_skew_powerlaw", "domain_iid", "domain_dirichlet",
                                                  "natural_id"))


# ----------------------------------------------------------------------- parameter validation through the registry


def _raw(n: int = 600) -> RawDataset:
    raw = random_images(n, NUM_CLASSES, 0)
    return with_groups(raw, domain=domain_ids(n), patient=patient_ids(n))


@pytest.mark.parametrize(
    "partitioner,params,key",
    [
        ("quantity_skew", {"distribution": "zipf"}, "distribution"),
        ("quantity_skew", {"sigma": -1.0}, "sigma"),
        ("quantity_skew", {"exponent": 1.0}, "exponent"),
        ("quantity_skew", {"min_partition_size": 200}, "min_partition_size"),
        ("long_tail", {"imbalance_factor": 0.5}, "imbalance_factor"),
        ("long_tail", {"imbalance_factor": 10000.0}, "imbalance_factor"),
        ("long_tail", {"client_imbalance_factor": 1000.0, "min_partition_size": 5}, "client_imbalance_factor"),
        ("long_tail", {"unknown": 1}, "unknown"),
        ("domain", {"dif": 0.5}, "dif"),
        ("domain", {"domain_order": "alphabetical"}, "domain_order"),
        ("domain", {"partition_by": "hospital"}, "partition_by"),
        ("domain", {"alpha": -0.1}, "alpha"),
        ("natural_id", {}, "partition_by"),
        ("natural_id", {"partition_by": "patient", "select": "random"}, "select"),
        ("label_quantity", {"num_classes_per_partition": 11}, "num_classes_per_partition"),
        ("label_quantity", {"partition_size": 10**6}, "partition_size"),
        ("label_quantity", {"class_assignment": "random"}, "class_assignment"),
        ("dirichlet", {"sampler": "flgo"}, "sampler"),
        ("dirichlet", {"sampler": "plato", "partition_size": 0}, "partition_size"),
        ("dirichlet", {"sampler": "plato", "partition_size": 601}, "partition_size"),
    ],
    ids=lambda v: str(v),
)
def test_bad_params_give_a_config_error_naming_key_and_allowed(partitioner, params, key):
    num_clients = {"domain": 5, "natural_id": 12}.get(partitioner, 5)
    spec = {"dataset": "t", "partitioner": partitioner, "num_clients": num_clients, "params": params}
    with pytest.raises(ConfigError) as exc:
        make_partition(_raw(), spec)
    msg = str(exc.value)
    assert key in msg and "allowed" in msg, msg


# ----------------------------------------------------------------------- quantity_skew


@pytest.mark.parametrize("distribution,shape", [("lognormal", {"sigma": 1.0}), ("powerlaw", {"exponent": 1.8})])
def test_quantity_skew_covers_every_sample_once_with_skewed_sizes(distribution, shape):
    labels = balanced_labels(300)
    for seed in range(3):
        parts = quantity_skew_partition(labels, 20, np.random.RandomState(seed), distribution=distribution, min_partition_size=15, **shape)
        assert len(parts) == 20
        assert_disjoint(parts, len(labels), exact=True)
        sizes = np.array([len(p) for p in parts])
        assert sizes.min() >= 15
        assert sizes.max() > 2.5 * np.median(sizes), sizes  # quantity skew: a few large clients


def test_quantity_skew_sigma_zero_is_equal_sizes():
    labels = balanced_labels(100)
    parts = quantity_skew_partition(labels, 7, np.random.RandomState(0), sigma=0.0, min_partition_size=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(labels)


def test_quantity_skew_larger_sigma_more_skew():
    labels = balanced_labels(500)
    spread = {s: np.mean([size_imbalance_factor(quantity_skew_partition(labels, 20, np.random.RandomState(r), sigma=s))
                          for r in range(5)]) for s in (0.3, 1.5)}
    assert spread[1.5] > 3 * spread[0.3], spread


def test_quantity_skew_labels_are_iid():
    labels = balanced_labels(2000)
    parts = quantity_skew_partition(labels, 10, np.random.RandomState(0), sigma=1.0, min_partition_size=500)
    for p in parts:  # every client near the pooled 10 % per class (>= 500 samples each)
        share = counts_of(labels, p) / len(p)
        assert np.all(np.abs(share - 0.1) < 0.045), share


# ----------------------------------------------------------------------- long_tail


@pytest.mark.parametrize("per_class,rho", [(5000, 100.0), (600, 10.0), (600, 50.0), (300, 1.0)])
def test_long_tail_achieved_imbalance_factor(per_class, rho):
    labels = balanced_labels(per_class)
    parts = long_tail_partition(labels, 20, np.random.RandomState(0), imbalance_factor=rho, client_imbalance_factor=10.0)
    assert_disjoint(parts, len(labels), exact=rho == 1.0)
    expected = long_tail_class_sizes(np.full(NUM_CLASSES, per_class), rho)
    union = np.concatenate(parts)
    got = np.bincount(labels[union], minlength=NUM_CLASSES)
    assert np.array_equal(got, expected), "the union of the clients is the long-tailed subsample"
    # class c has round(n_max * rho^(-c/(C-1))) samples: exponential decay from class 0 to class C-1
    assert np.all(np.diff(got) <= 0)
    assert np.allclose(got, np.round(per_class * rho ** (-np.arange(NUM_CLASSES) / (NUM_CLASSES - 1))))
    achieved = class_imbalance_factor(labels, parts)
    assert achieved == pytest.approx(rho, rel=0.5 / expected[-1] + 1e-9)  # only the tail class's rounding
    if per_class == 5000:
        assert achieved == 100.0 and len(union) == 12408  # CIFAR-10-LT (rho 100) from 5,000 per class (round vs floor: 12,406)


def test_long_tail_class_sizes_with_unequal_classes_stay_feasible():
    counts = np.array([50, 80, 40, 90, 70])
    sizes = long_tail_class_sizes(counts, 10.0)
    assert np.all(sizes <= counts) and sizes[-1] >= 1
    assert sizes[0] / sizes[-1] == pytest.approx(10.0, rel=0.1)


@pytest.mark.parametrize("num_clients,rho_n", [(50, 100.0), (20, 10.0), (5, 3.0)])
def test_long_tail_client_sizes_geometric(num_clients, rho_n):
    labels = balanced_labels(5000)
    parts = long_tail_partition(labels, num_clients, np.random.RandomState(1), imbalance_factor=100.0, client_imbalance_factor=rho_n)
    sizes = np.array([len(p) for p in parts])
    total = sizes.sum()
    assert np.all(np.diff(sizes) <= 0), "client sizes decrease with the client id"
    w = rho_n ** (-np.arange(num_clients) / (num_clients - 1))
    assert np.all(np.abs(sizes - total * w / w.sum()) <= 1), "sizes are the geometric targets rounded"
    assert size_imbalance_factor(parts) == pytest.approx(rho_n, rel=1.0 / sizes[-1] + 1e-9)


def test_long_tail_each_client_long_tailed_over_its_own_class_order():
    labels = balanced_labels(3000)
    parts = long_tail_partition(labels, 10, np.random.RandomState(0), imbalance_factor=1.0, client_imbalance_factor=2.0,
                                local_imbalance_factor=100.0)
    heads = []
    for p in parts:
        c = np.sort(counts_of(labels, p))[::-1]
        assert c[0] > 15 * max(c[-1], 1), c  # p_{k,c} ∝ 100^(-r/(C-1)): head / tail near 100
        assert c[0] / len(p) > 0.2
        heads.append(int(np.argmax(counts_of(labels, p))))
    assert len(set(heads)) >= 4, f"the head classes of the clients should vary (random class order): {heads}"
    flat = long_tail_partition(labels, 10, np.random.RandomState(0), imbalance_factor=1.0, client_imbalance_factor=2.0,
                               local_imbalance_factor=1.0)
    assert entropy(labels, flat) > entropy(labels, parts) + 0.3


def test_long_tail_grp_fed_cifar10_setting():
    """methods.md §3.5: 50 clients, sizes decreasing with factor 100, per-client long tails (whole CIFAR-10)."""
    labels = balanced_labels(6000)
    parts = long_tail_partition(labels, 50, np.random.RandomState(0), imbalance_factor=1.0)
    assert_disjoint(parts, len(labels), exact=True)
    assert size_imbalance_factor(parts) == pytest.approx(100.0, rel=0.05)
    assert class_imbalance_factor(labels, parts) == 1.0


# ----------------------------------------------------------------------- domain


@pytest.mark.parametrize(
    "num_domains,dif,expected",
    [(5, 5.0, [5, 3, 2, 2, 1]), (6, 5.0, [5, 4, 3, 2, 1, 1]), (5, 10.0, [10, 6, 3, 2, 1]), (6, 10.0, [10, 7, 4, 3, 2, 1]),
     (5, 1.0, [1, 1, 1, 1, 1]), (4, 1.0, [1, 1, 1, 1])],
    ids=["digit5-dif5", "domainnet-dif5", "digit5-dif10", "domainnet-dif10", "digit5-dif1", "pacs-dif1"],
)
def test_domain_client_counts_match_fedgcr(num_domains, dif, expected):
    counts = domain_client_counts(num_domains, dif)
    assert counts == expected  # methods.md §5.6: Digit-Five 13 / 22 clients, DomainNet 16 / 27
    assert max(counts) / min(counts) == dif
    assert all(a >= b for a, b in zip(counts, counts[1:])), "geometric: non-increasing"
    assert domain_client_counts(num_domains, 1.0, min_clients_per_domain=2) == [2] * num_domains  # FedGCR 'even'


@pytest.mark.parametrize("dif,alpha", [(5.0, 0.0), (10.0, 0.0), (1.0, 0.0), (5.0, 0.3)])
def test_domain_one_domain_per_client_geometric_counts(dif, alpha):
    n = 3000
    labels, dom = balanced_labels(n // NUM_CLASSES), domain_ids(n)
    counts = domain_client_counts(5, dif)
    parts = domain_partition(labels, sum(counts), np.random.RandomState(0), dif=dif, alpha=alpha, min_partition_size=5,
                             groups={"domain": dom})
    assert len(parts) == sum(counts)
    assert_disjoint(parts, n, exact=True)
    per_client = [np.unique(dom[p]) for p in parts]
    assert all(len(d) == 1 for d in per_client), "a client holds one domain"
    owner = [int(d[0]) for d in per_client]
    assert owner == sorted(owner), "clients come domain by domain, ascending domain id"
    got = [owner.count(d) for d in range(5)]
    assert got == counts
    assert max(got) / min(got) == dif
    for d in range(5):  # each domain is split entirely among its clients
        mine = [p for p, o in zip(parts, owner) if o == d]
        assert sum(len(p) for p in mine) == int(np.sum(dom == d))
        if alpha == 0:
            assert max(map(len, mine)) - min(map(len, mine)) <= 1
        else:
            assert min(map(len, mine)) >= 5


def test_domain_alpha_adds_label_skew_inside_domains():
    n = 3000
    labels, dom = balanced_labels(n // NUM_CLASSES), domain_ids(n)
    iid = domain_partition(labels, 22, np.random.RandomState(0), dif=10.0, groups={"domain": dom})
    skew = domain_partition(labels, 22, np.random.RandomState(0), dif=10.0, alpha=0.1, min_partition_size=0, groups={"domain": dom})
    assert entropy(labels, skew) < entropy(labels, iid) - 0.5


def test_domain_order_size_and_random():
    n = 1000
    labels = balanced_labels(n // NUM_CLASSES)
    dom = np.concatenate([np.full(100, 0), np.full(400, 1), np.full(200, 2), np.full(300, 3)])
    parts = domain_partition(labels, 10, np.random.RandomState(0), dif=4.0, domain_order="size", groups={"domain": dom})
    owners = [int(np.unique(dom[p])[0]) for p in parts]
    counts = domain_client_counts(4, 4.0)
    assert owners == [1] * counts[0] + [3] * counts[1] + [2] * counts[2] + [0] * counts[3]
    orders = {tuple(dict.fromkeys(int(np.unique(dom[p])[0]) for p in
                                  domain_partition(labels, 10, np.random.RandomState(s), dif=4.0, domain_order="random",
                                                   groups={"domain": dom})))
              for s in range(6)}
    assert len(orders) > 1


def test_domain_missing_groups_is_a_clear_error():
    labels = balanced_labels(50)
    for groups in (None, {}, {"patient": np.zeros(500, np.int64)}):
        with pytest.raises(ConfigError, match="domain") as exc:
            domain_partition(labels, 5, np.random.RandomState(0), groups=groups)
        assert "allowed" in str(exc.value)
    raw = random_images(300, NUM_CLASSES, 0)  # no groups at all
    with pytest.raises(ConfigError, match="groups"):
        make_partition(raw, {"dataset": "t", "partitioner": "domain", "num_clients": 5})


def test_domain_wrong_num_clients_names_the_required_count():
    labels, dom = balanced_labels(100), domain_ids(1000)
    with pytest.raises(ConfigError, match="num_clients") as exc:
        domain_partition(labels, 10, np.random.RandomState(0), dif=5.0, groups={"domain": dom})
    assert "13" in str(exc.value) and "[5, 3, 2, 2, 1]" in str(exc.value)


# ----------------------------------------------------------------------- natural_id


def test_natural_id_one_id_per_client_covering_everything():
    n = 1200
    labels, pid = balanced_labels(n // NUM_CLASSES), patient_ids(n)
    ids = np.unique(pid)
    parts = natural_id_partition(labels, len(ids), np.random.RandomState(0), partition_by="patient", groups={"patient": pid})
    assert_disjoint(parts, n, exact=True)
    assert [np.unique(pid[p]).tolist() for p in parts] == [[int(i)] for i in ids], "client i holds exactly the i-th id"
    assert [len(p) for p in parts] == [int(np.sum(pid == i)) for i in ids]


def test_natural_id_num_clients_must_match_unless_selected():
    n = 1200
    labels, pid = balanced_labels(n // NUM_CLASSES), patient_ids(n)
    with pytest.raises(ConfigError, match="num_clients") as exc:
        natural_id_partition(labels, 5, np.random.RandomState(0), partition_by="patient", groups={"patient": pid})
    assert "12" in str(exc.value) and "allowed" in str(exc.value)
    ids, sizes = np.unique(pid, return_counts=True)
    largest = natural_id_partition(labels, 5, np.random.RandomState(0), partition_by="patient", select="largest", groups={"patient": pid})
    assert sorted(int(np.unique(pid[p])[0]) for p in largest) == sorted(ids[np.argsort(-sizes, kind="stable")[:5]].tolist())
    first = natural_id_partition(labels, 5, np.random.RandomState(0), partition_by="patient", select="first", groups={"patient": pid})
    assert [int(np.unique(pid[p])[0]) for p in first] == ids[:5].tolist()
    assert_disjoint(largest + [], n)
    with pytest.raises(ConfigError, match="num_clients"):
        natural_id_partition(labels, 13, np.random.RandomState(0), partition_by="patient", select="largest", groups={"patient": pid})


def test_natural_id_unknown_column_lists_the_available_ones():
    labels = balanced_labels(10)
    with pytest.raises(ConfigError, match="partition_by") as exc:
        natural_id_partition(labels, 3, np.random.RandomState(0), partition_by="writer", groups={"patient": np.zeros(100, np.int64)})
    assert "patient" in str(exc.value)


# ----------------------------------------------------------------------- label_quantity


@pytest.mark.parametrize("num_clients,s,size,mode", [(20, 2, 150, "deterministic"), (20, 2, 0, "deterministic"), (10, 3, 100, "deterministic"),
                                                     (30, 2, 60, "plato"), (7, 1, 40, "deterministic")])
def test_label_quantity_classes_sizes_disjoint(num_clients, s, size, mode):
    labels = balanced_labels(300)
    parts = label_quantity_partition(labels, num_clients, np.random.RandomState(0), num_classes_per_partition=s, partition_size=size,
                                     class_assignment=mode)
    assert len(parts) == num_clients
    assert_disjoint(parts, len(labels))
    expected_size = size or 150  # 20 clients x 2 classes: 4 holders per class, 300 / 4 = 75 each
    assert {len(p) for p in parts} == {expected_size}, "a fixed number of samples per client"
    for cid, p in enumerate(parts):
        c = counts_of(labels, p)
        held = np.flatnonzero(c)
        assert len(held) == s, f"client {cid} holds classes {held.tolist()}"
        assert c[held].max() - c[held].min() <= 1, "the client's size is split evenly over its classes"
        if mode == "plato":
            assert cid % NUM_CLASSES in held  # Plato's assign_sub_classes: class i mod C first


def test_label_quantity_calibre_2_500():
    """Calibre Table I "(2, 500)": CIFAR-10's 50,000 training images, 100 clients, 2 classes each."""
    labels = balanced_labels(5000)
    parts = label_quantity_partition(labels, 100, np.random.RandomState(0))
    assert {len(p) for p in parts} == {500}
    assert_disjoint(parts, len(labels), exact=True)  # 20 clients share each class's 5,000 images
    holders = np.bincount(np.concatenate([np.flatnonzero(counts_of(labels, p)) for p in parts]), minlength=NUM_CLASSES)
    assert holders.tolist() == [20] * NUM_CLASSES


def test_label_quantity_too_large_size_refused_with_the_maximum():
    labels = balanced_labels(300)
    with pytest.raises(ConfigError, match="partition_size") as exc:
        label_quantity_partition(labels, 20, np.random.RandomState(0), partition_size=151)
    assert "150" in str(exc.value)


# ----------------------------------------------------------------------- dirichlet: Plato's sampler


def test_dirichlet_default_unchanged_by_the_sampler_params():
    labels = balanced_labels(200)
    a = dirichlet_partition(labels, 10, np.random.RandomState(5), alpha=0.5)
    b = dirichlet_partition(labels, 10, np.random.RandomState(5), alpha=0.5, sampler="split", partition_size=17)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))


def test_dirichlet_plato_fixed_size_overlapping_and_skewed():
    labels = balanced_labels(600)
    parts = dirichlet_partition(labels, 30, np.random.RandomState(0), alpha=0.1, sampler="plato", partition_size=300)
    assert len(parts) == 30
    for p in parts:
        assert len(p) == 300 and len(np.unique(p)) == 300, "partition_size distinct samples per client"
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) < len(allidx), "clients sample independently, so their sets overlap"
    flat = dirichlet_partition(labels, 30, np.random.RandomState(0), alpha=100.0, sampler="plato", partition_size=300)
    assert entropy(labels, parts) < entropy(labels, flat) - 0.8


def test_dirichlet_plato_through_make_partition():
    raw = random_images(800, NUM_CLASSES, 0)
    spec = {"dataset": "t", "partitioner": "dirichlet", "num_clients": 6, "seed": 1,
            "params": {"alpha": 0.3, "sampler": "plato", "partition_size": 200}}
    out = make_partition(raw, spec)
    for splits in out:
        rows = np.concatenate([splits[s] for s in SPLITS])
        assert len(rows) == 200 and len(np.unique(rows)) == 200


# ----------------------------------------------------------------------- shards: manifest matches the shards


SHARD_CASES = {
    "quantity_skew": ("quantity_skew", 8, {"distribution": "powerlaw", "exponent": 1.8, "min_partition_size": 20}),
    "long_tail": ("long_tail", 8, {"imbalance_factor": 10.0, "client_imbalance_factor": 5.0}),
    "domain": ("domain", 13, {"dif": 5.0, "alpha": 0.5, "min_partition_size": 10}),
    "natural_id": ("natural_id", 12, {"partition_by": "patient"}),
    "label_quantity": ("label_quantity", 10, {"num_classes_per_partition": 2, "partition_size": 80}),
    "dirichlet_plato": ("dirichlet", 6, {"alpha": 0.3, "sampler": "plato", "partition_size": 150}),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_write_partition_manifest_matches_shards(case, tmp_path):
    name, k, params = SHARD_CASES[case]
    n = 1500
    raw = random_images(n, NUM_CLASSES, 4)
    dom, pid = domain_ids(n), patient_ids(n)
    raw = with_groups(raw, domain=dom, patient=pid)
    spec = {"dataset": "random_images", "partitioner": name, "num_clients": k, "seed": 7, "params": params,
            "split": {"test_fraction": 0.25, "val_fraction": 0.1, "stratify": True}}
    manifest = write_partition(raw, spec, tmp_path / case)
    on_disk, shards = load_partition(tmp_path / case)  # verifies the checksums too
    assert on_disk["partitioner"] == name and {key: on_disk["params"][key] for key in params} == params
    assert len(on_disk["clients"]) == len(shards) == k
    expected = make_partition(raw, spec)
    rows_all = []
    for info, shard, splits in zip(on_disk["clients"], shards, expected):
        rows = np.concatenate([splits[s] for s in SPLITS])
        rows_all.append(rows)
        for s in SPLITS:
            assert info["sizes"][s] == len(shard.y[s]) == len(splits[s])
            assert info["class_counts"][s] == np.bincount(shard.y[s], minlength=NUM_CLASSES).tolist()
            assert np.array_equal(shard.y[s], raw.y[splits[s]]) and np.array_equal(shard.x[s], raw.x[splits[s]])
        assert info["groups"]["domain"] == np.unique(dom[rows]).tolist()
        if name == "domain":
            assert len(info["groups"]["domain"]) == 1, "one domain per client in the manifest"
        if name == "natural_id":
            assert info["groups"]["patient"] == [int(np.unique(pid[rows])[0])]
    assert manifest["clients"] == on_disk["clients"]
    sizes = np.array([sum(c["sizes"].values()) for c in on_disk["clients"]])
    allrows = np.concatenate(rows_all)
    if case == "dirichlet_plato":
        assert set(sizes.tolist()) == {150}
    else:
        assert len(np.unique(allrows)) == len(allrows) == sizes.sum()
    if name == "domain":
        owners = [c["groups"]["domain"][0] for c in on_disk["clients"]]
        assert [owners.count(d) for d in range(5)] == domain_client_counts(5, 5.0)
    if name == "natural_id":
        assert [c["groups"]["patient"][0] for c in on_disk["clients"]] == np.unique(pid).tolist()
    if name == "long_tail":
        total = np.sum([np.sum([c["class_counts"][s] for s in SPLITS], axis=0) for c in on_disk["clients"]], axis=0)
        assert total.max() / total.min() == pytest.approx(10.0, rel=0.1)
        assert np.all(np.diff(sizes) <= 0)
    if name == "label_quantity":
        assert set(sizes.tolist()) == {80}
        assert all(np.count_nonzero(np.sum([c["class_counts"][s] for s in SPLITS], axis=0)) == 2 for c in on_disk["clients"])


def test_domain_geometric_sizes_follow_fedgcr_uneven_volumes():
    """dif 5 over 5 equal domains of 1,000: ratio 1.5, clients [5, 3, 2, 2, 1]; domain i keeps
    1000 / 1.5^i samples and its clients' sizes are geometric with ratio 1.5, largest first."""
    from fedrepro.data.partitioners import domain_partition

    domain = np.repeat(np.arange(5), 1000)
    labels = np.tile(np.arange(10), 500)
    parts = domain_partition(labels, 13, np.random.RandomState(0), dif=5.0, geometric_sizes=True, groups={"domain": domain})
    sizes = [len(p) for p in parts]
    firsts = [0, 5, 8, 10, 12]
    for i, (a, n) in enumerate(zip(firsts, [5, 3, 2, 2, 1])):
        mine = sizes[a : a + n]
        assert sum(mine) == pytest.approx(1000 / 1.5**i, abs=n)  # floor per client
        assert all(domain[parts[a + j]].tolist() == [i] * mine[j] for j in range(n))
        for j in range(n - 1):
            assert mine[j] / mine[j + 1] == pytest.approx(1.5, rel=0.02)
    assert len(np.unique(np.concatenate(parts))) == sum(sizes)  # disjoint
    equal = domain_partition(labels, 13, np.random.RandomState(0), dif=5.0, groups={"domain": domain})
    assert [len(p) for p in equal[:5]] == [200] * 5  # the default: equal shares, every sample used
