"""Partitioners: split a labelled dataset's sample indices among clients.

Each partitioner is `fn(labels, num_clients, rng, **params) -> list[np.ndarray]`, the
client index arrays, registered with its parameters. `rng` is a
`numpy.random.RandomState` seeded with the partition seed: the legacy generator is used
on purpose so that the `dirichlet` partitioner with PFLlib's settings draws exactly the
numbers PFLlib's `separate_data` draws (`np.random.seed(1)` there).
Names follow flwr-datasets where it has an equivalent (`alpha`, `min_partition_size`,
`self_balancing`, `num_classes_per_partition`).
"""

from __future__ import annotations

import numpy as np

from ..registry import ConfigError, Param, Registry

PARTITIONERS: Registry = Registry("partitioner")


def _check_clients(labels: np.ndarray, num_clients: int) -> None:
    if num_clients > len(labels):
        raise ConfigError(f"partition: key 'num_clients' has value {num_clients}; allowed: at most the {len(labels)} samples of the dataset")


@PARTITIONERS.register("iid", "uniformly random, equal-size client shards")
def iid_partition(labels: np.ndarray, num_clients: int, rng: np.random.RandomState) -> list[np.ndarray]:
    _check_clients(labels, num_clients)
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


@PARTITIONERS.register(
    "dirichlet",
    "per-class proportions over clients drawn from Dir(alpha) (Hsu et al. 2019); PFLlib/FedLab balance cap optional",
    params={
        "alpha": Param(0.1, "Dirichlet concentration (beta in many papers); smaller = more skew", float, exclusive_minimum=0),
        "min_partition_size": Param(10, "redraw until every client holds at least this many samples (PFLlib: 40 = batch 10 / 0.25 test)", int, minimum=0),
        "self_balancing": Param(False, "PFLlib/FedLab/PFNM cap: a client already holding >= N/num_clients samples gets no more", bool),
        "max_retries": Param(1000, "give up after this many redraws", int, minimum=1),
    },
)
def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.RandomState,
    alpha: float = 0.1,
    min_partition_size: int = 10,
    self_balancing: bool = False,
    max_retries: int = 1000,
) -> list[np.ndarray]:
    """Class by class, split the class's shuffled indices by proportions ~ Dir(alpha).

    Follows the call order of PFLlib's `separate_data(partition="dir")` (itself from
    IBM's PFNM code): shuffle the class indices, draw the proportions, optionally zero
    the share of clients already at N/num_clients, cut, and redraw everything until the
    smallest client reaches `min_partition_size`. Client index lists keep their
    allocation order, which matters for reproducing PFLlib's later train/test split.
    """
    _check_clients(labels, num_clients)
    n = len(labels)
    classes = np.unique(labels)
    if min_partition_size * num_clients > n:
        raise ConfigError(
            f"partition: key 'min_partition_size' has value {min_partition_size}; allowed: at most "
            f"{n // num_clients} for {n} samples over {num_clients} clients"
        )
    for _ in range(max_retries):
        idx_batch: list[list[int]] = [[] for _ in range(num_clients)]
        for k in classes:
            idx_k = np.where(labels == k)[0]
            rng.shuffle(idx_k)
            proportions = rng.dirichlet(np.repeat(alpha, num_clients))
            if self_balancing:
                proportions = np.array([p * (len(idx_j) < n / num_clients) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, cuts))]
        if min(len(b) for b in idx_batch) >= min_partition_size:
            return [np.asarray(b, dtype=np.int64) for b in idx_batch]
    raise ConfigError(
        f"partition: dirichlet with alpha={alpha} found no split with every client >= min_partition_size="
        f"{min_partition_size} in {max_retries} draws; allowed: a smaller min_partition_size or larger alpha"
    )


@PARTITIONERS.register(
    "pathological",
    "each client holds num_classes_per_partition classes; each class split into equal disjoint shares (McMahan et al. 2017)",
    params={
        "num_classes_per_partition": Param(2, "classes per client (S)", int, minimum=1),
        "class_assignment": Param("deterministic", "'deterministic': client i gets classes perm[(i*S + j) mod C], perm drawn from the seed "
                                  "(every class gets the same number of clients when N*S is a multiple of C); 'first': no permutation",
                                  str, choices=("deterministic", "first")),
    },
)
def pathological_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.RandomState,
    num_classes_per_partition: int = 2,
    class_assignment: str = "deterministic",
) -> list[np.ndarray]:
    _check_clients(labels, num_clients)
    classes = np.unique(labels)
    c = len(classes)
    s = num_classes_per_partition
    if s > c:
        raise ConfigError(f"partition: key 'num_classes_per_partition' has value {s}; allowed: at most the {c} classes of the dataset")
    order = rng.permutation(c) if class_assignment == "deterministic" else np.arange(c)
    holders: dict[int, list[int]] = {int(k): [] for k in classes}
    for i in range(num_clients):
        for j in range(s):
            holders[int(classes[order[(i * s + j) % c]])].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, owners in holders.items():
        if not owners:
            continue
        idx_k = np.where(labels == k)[0]
        rng.shuffle(idx_k)
        for owner, share in zip(owners, np.array_split(idx_k, len(owners))):
            parts[owner].append(share)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def split_client(
    indices: np.ndarray,
    labels: np.ndarray,
    rng: np.random.RandomState,
    test_fraction: float,
    val_fraction: float,
    stratify: bool,
) -> dict[str, np.ndarray]:
    """Split one client's indices into train/test(/val).

    stratify=True cuts every class separately (each split keeps the client's label
    distribution, as FederatedScope's consistent_label_distribution); stratify=False is
    sklearn's shuffled `train_test_split`, which is what PFLlib does (75/25), drawn
    from the same RandomState so PFLlib's numbers are reproduced.
    """
    from sklearn.model_selection import train_test_split

    if not stratify:
        rest, test = train_test_split(indices, test_size=test_fraction, shuffle=True, random_state=rng) if test_fraction > 0 else (indices, indices[:0])
        if val_fraction > 0:
            rest, val = train_test_split(rest, test_size=val_fraction / (1 - test_fraction), shuffle=True, random_state=rng)
        else:
            val = indices[:0]
        return {"train": np.asarray(rest), "test": np.asarray(test), "val": np.asarray(val)}
    out: dict[str, list[np.ndarray]] = {"train": [], "test": [], "val": []}
    client_labels = labels[indices]
    for k in np.unique(client_labels):
        idx_k = indices[client_labels == k].copy()
        rng.shuffle(idx_k)
        n_test = int(round(test_fraction * len(idx_k)))
        n_val = int(round(val_fraction * len(idx_k)))
        out["test"].append(idx_k[:n_test])
        out["val"].append(idx_k[n_test : n_test + n_val])
        out["train"].append(idx_k[n_test + n_val :])
    return {k: np.sort(np.concatenate(v)) if v else indices[:0] for k, v in out.items()}
