"""Partitioners: split a labelled dataset's sample indices among clients.

Each partitioner is `fn(labels, num_clients, rng, **params) -> list[np.ndarray]`, the
client index arrays, registered with its parameters. `rng` is a
`numpy.random.RandomState` seeded with the partition seed: the legacy generator is used
on purpose so that the `dirichlet` partitioner with PFLlib's settings draws exactly the
numbers PFLlib's `separate_data` draws (`np.random.seed(1)` there).
Names follow flwr-datasets where it has an equivalent (`alpha`, `min_partition_size`,
`self_balancing`, `num_classes_per_partition`, `partition_by`). A partitioner with a `groups`
parameter (domain, natural_id) also receives the dataset's per-sample id columns, e.g.
groups["domain"]; `class_imbalance_factor` and `size_imbalance_factor` measure what a
partition achieved.
"""

from __future__ import annotations

import math

import numpy as np

from ..registry import ConfigError, Param, Registry, show

PARTITIONERS: Registry = Registry("partitioner", plugin_group="fedrepro.partitioners")


class Infeasible(ConfigError):
    """A partition the data cannot give. `key` is the spec's key ('num_clients' or 'params.<name>'),
    so that `fedrepro validate`, which decides the same from class counts (`infeasibility`), names
    the config key of the same refusal."""

    def __init__(self, key: str, value, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"partition: key '{key.removeprefix('params.')}' has value {show(value)}; allowed: {allowed}")


def _check_clients(labels: np.ndarray, num_clients: int) -> None:
    if num_clients > len(labels):
        raise Infeasible("num_clients", num_clients, f"at most the {len(labels)} samples of the dataset")


def _check_min_partition_size(n: int, num_clients: int, min_partition_size: int) -> None:
    """Refuse a minimum client size that the n samples cannot give every client."""
    if min_partition_size * num_clients > n:
        raise Infeasible("params.min_partition_size", min_partition_size,
                         f"at most {n // num_clients} for {n} samples over {num_clients} clients")


def _check_classes_per_partition(s: int, c: int) -> None:
    if s > c:
        raise Infeasible("params.num_classes_per_partition", s, f"at most the {c} classes of the dataset")


def _cyclic_classes(num_clients: int, classes: np.ndarray, s: int, order: np.ndarray) -> list[list[int]]:
    """Client i's S classes classes[order[(i*S + j) mod C]]: every class goes to the same number of
    clients when N*S is a multiple of C."""
    c = len(classes)
    return [[int(classes[order[(i * s + j) % c]]) for j in range(s)] for i in range(num_clients)]


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
        "sampler": Param("split", "'split': the per-class split above, a partition of the data; 'plato': Plato's samplers/dirichlet.py "
                         "(Calibre's D-non-iid): each client draws q ~ Dir(alpha) over the classes and samples partition_size "
                         "indices without replacement with weights q[label]; clients may OVERLAP (min_partition_size, "
                         "self_balancing, max_retries unused)", str, choices=("split", "plato")),
        "partition_size": Param(600, "sampler 'plato': samples per client (Calibre paper-era CIFAR-10 config: 600)", int, minimum=1),
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
    sampler: str = "split",
    partition_size: int = 600,
) -> list[np.ndarray]:
    """Class by class, split the class's shuffled indices by proportions ~ Dir(alpha).

    Follows the call order of PFLlib's `separate_data(partition="dir")` (itself from
    IBM's PFNM code): shuffle the class indices, draw the proportions, optionally zero
    the share of clients already at N/num_clients, cut, and redraw everything until the
    smallest client reaches `min_partition_size`. Client index lists keep their
    allocation order, which matters for reproducing PFLlib's later train/test split.

    sampler="plato" is a different scheme, Plato's per-client sampling (see
    `_plato_dirichlet`); the default "split" path is unchanged.
    """
    if sampler == "plato":
        return _plato_dirichlet(labels, num_clients, rng, alpha, partition_size)
    _check_clients(labels, num_clients)
    n = len(labels)
    classes = np.unique(labels)
    _check_min_partition_size(n, num_clients, min_partition_size)
    best = 0  # the largest smallest client of the draws so far: the largest min_partition_size they meet
    for _ in range(max_retries):
        idx_batch: list[list[int]] = [[] for _ in range(num_clients)]
        for k in classes:
            idx_k = np.where(labels == k)[0]
            sizes = np.fromiter(map(len, idx_batch), np.int64, num_clients)
            cuts = _dirichlet_cuts(idx_k, sizes, rng, alpha, self_balancing, n)
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, cuts))]
        smallest = min(len(b) for b in idx_batch)
        if smallest >= min_partition_size:
            return [np.asarray(b, dtype=np.int64) for b in idx_batch]
        best = max(best, smallest)
    raise _no_dirichlet_draw(alpha, min_partition_size, max_retries, best)


def _no_dirichlet_draw(alpha: float, min_partition_size: int, max_retries: int, best: int) -> Infeasible:
    return Infeasible("params.min_partition_size", min_partition_size,
                      f"at most {best}, the largest smallest client of the {max_retries} draws (max_retries) of Dir(alpha={alpha}) "
                      "this seed makes; or a larger alpha or max_retries")


def _dirichlet_cuts(idx_k: np.ndarray, sizes: np.ndarray, rng: np.random.RandomState, alpha: float, self_balancing: bool,
                    n: int) -> np.ndarray:
    """One class of one draw, in PFLlib's call order: shuffle the class's indices in place, draw the
    proportions over the clients (with self_balancing none for a client already holding n/num_clients),
    return np.split's cut points. Of the data it reads only the class's size and the clients' sizes
    so far, so `dirichlet_draws` replays the draws from class counts alone."""
    num_clients = len(sizes)
    rng.shuffle(idx_k)  # RandomState.shuffle draws the same numbers for any 1-d array of this length
    proportions = rng.dirichlet(np.repeat(alpha, num_clients))
    if self_balancing:
        proportions = proportions * (sizes < n / num_clients)
    proportions = proportions / proportions.sum()
    return (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]


def _split_lengths(length: int, cuts: np.ndarray) -> np.ndarray:
    """The lengths of np.split(x, cuts)'s pieces for len(x) == length: slice semantics, so also for
    the cut points a degenerate (NaN) Dirichlet draw casts to large negative integers."""
    bounds = np.concatenate(([0], np.asarray(cuts, np.int64), [length]))
    bounds = np.where(bounds < 0, np.maximum(bounds + length, 0), np.minimum(bounds, length))
    return np.maximum(np.diff(bounds), 0)


def dirichlet_draws(counts: np.ndarray, num_clients: int, seed: int, alpha: float, self_balancing: bool):
    """The smallest client size of each successive draw `dirichlet_partition` (sampler 'split') makes on
    labels with these class counts (classes in label order, none empty) from RandomState(seed), as the
    partition step seeds it: the same random numbers, consumed in the same order, without the indices."""
    counts = np.asarray(counts, np.int64)
    n = int(counts.sum())
    rng = np.random.RandomState(seed)
    scratch = np.empty(int(counts.max()), np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):  # a degenerate draw warns in the partition step, not here
        while True:
            sizes = np.zeros(num_clients, np.int64)
            for c in counts.tolist():
                sizes = sizes + _split_lengths(c, _dirichlet_cuts(scratch[:c], sizes, rng, alpha, self_balancing, n))
            yield int(sizes.min())


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
    _check_classes_per_partition(s, c)
    order = rng.permutation(c) if class_assignment == "deterministic" else np.arange(c)
    holders: dict[int, list[int]] = {int(k): [] for k in classes}
    for i, mine in enumerate(_cyclic_classes(num_clients, classes, s, order)):
        for k in mine:
            holders[k].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, owners in holders.items():
        if not owners:
            continue
        idx_k = np.where(labels == k)[0]
        rng.shuffle(idx_k)
        for owner, share in zip(owners, np.array_split(idx_k, len(owners))):
            parts[owner].append(share)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


# ----------------------------------------------------------------------- helpers of the partitioners below


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers >= 0 proportional to `weights` that sum to `total` exactly (largest remainder;
    ties go to the lower index, so the result is deterministic)."""
    weights = np.asarray(weights, dtype=np.float64)
    if total <= 0 or weights.sum() <= 0:
        return np.zeros(len(weights), np.int64)
    quota = weights / weights.sum() * total
    out = np.floor(quota).astype(np.int64)
    short = int(total - out.sum())
    if short > 0:
        out[np.argsort(-(quota - out), kind="stable")[:short]] += 1
    return out


def _cut(idx: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Consecutive pieces of `idx` of the given sizes (their sum may be below len(idx))."""
    ends = np.cumsum(sizes)
    return [idx[e - s : e] for s, e in zip(sizes, ends)]


def _need_groups(groups: dict[str, np.ndarray] | None, key: str, param: str, partitioner: str, n: int) -> np.ndarray:
    """The per-sample id column `key` the partitioner needs, or a ConfigError naming what the dataset has."""
    have = sorted(groups or {})
    if not key:
        raise ConfigError(f"partition: partitioner '{partitioner}' key '{param}' is required (has value {key!r}); "
                          f"allowed: one of the dataset's per-sample group columns {have}")
    if key not in (groups or {}):
        raise ConfigError(
            f"partition: partitioner '{partitioner}' key '{param}' has value {key!r}, but the dataset has no per-sample "
            f"group column {key!r} (groups: {have or 'none'}); allowed: a dataset with groups[{key!r}] "
            f"(RawDataset.groups) or one of {have}"
        )
    ids = np.asarray(groups[key])
    if len(ids) != n:
        raise ConfigError(f"partition: group column {key!r} has {len(ids)} entries for {n} labels; allowed: one id per sample")
    return ids


def class_imbalance_factor(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Achieved global imbalance factor of a partition: largest / smallest class count over the
    union of the clients' samples (classes with no sample left out). 1.0 for a balanced split."""
    used = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)
    counts = np.unique(np.asarray(labels)[used], return_counts=True)[1]
    return float(counts.max() / counts.min()) if len(counts) else float("nan")


def size_imbalance_factor(parts: list[np.ndarray]) -> float:
    """Largest / smallest client size (inf when a client is empty)."""
    sizes = np.array([len(p) for p in parts], dtype=np.float64)
    return float(sizes.max() / sizes.min()) if sizes.min() > 0 else float("inf")


# ----------------------------------------------------------------------- quantity skew


def quantity_skew_sizes(
    n: int, num_clients: int, rng: np.random.RandomState, distribution: str, sigma: float, exponent: float, min_partition_size: int
) -> np.ndarray:
    """Client sizes: `min_partition_size` each plus the rest of the n samples apportioned by
    weights drawn i.i.d. from a log-normal (sigma) or a Pareto power law (density ∝ w^-exponent, w >= 1)."""
    _check_min_partition_size(n, num_clients, min_partition_size)
    if distribution == "lognormal":
        weights = rng.lognormal(mean=0.0, sigma=sigma, size=num_clients)
    else:
        weights = rng.pareto(exponent - 1.0, size=num_clients) + 1.0  # classical Pareto(x_m=1): p(w) ∝ w^-exponent
    return min_partition_size + _apportion(n - min_partition_size * num_clients, weights)


@PARTITIONERS.register(
    "quantity_skew",
    "client sizes drawn from a log-normal or power law (quantity skew); samples assigned uniformly at random (iid labels), no overlap",
    params={
        "distribution": Param("lognormal", "size law: 'lognormal' (FedLab's unbalanced split, unbalance_sgm = sigma) or 'powerlaw' "
                              "(Pareto: size weights with density ∝ w^-exponent, w >= 1)", str, choices=("lognormal", "powerlaw")),
        "sigma": Param(1.0, "lognormal: std of the log client size; 0 = equal sizes", float, minimum=0),
        "exponent": Param(2.0, "powerlaw: tail exponent of the size density (> 1; smaller = heavier tail, a few huge clients)",
                          float, exclusive_minimum=1),
        "min_partition_size": Param(10, "every client gets at least this many samples; the rest follows the drawn weights", int, minimum=0),
    },
)
def quantity_skew_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.RandomState,
    distribution: str = "lognormal",
    sigma: float = 1.0,
    exponent: float = 2.0,
    min_partition_size: int = 10,
) -> list[np.ndarray]:
    """Every sample goes to exactly one client; sizes are min_partition_size + the rest of the
    data apportioned (largest remainder, total exactly N) by i.i.d. weights from the chosen law.
    The law's scale cancels out, so only its shape matters. Labels are iid (a random permutation)."""
    _check_clients(labels, num_clients)
    sizes = quantity_skew_sizes(len(labels), num_clients, rng, distribution, sigma, exponent, min_partition_size)
    return [np.sort(p) for p in _cut(rng.permutation(len(labels)), sizes)]


# ----------------------------------------------------------------------- long tail (GRP-FED)


def long_tail_class_sizes(counts: np.ndarray, imbalance_factor: float) -> np.ndarray:
    """Per-class sizes of the long-tailed subsample: n_c = round(n_head * rho^(-c/(C-1))) for the
    classes in label order (c = 0 is the head, as CIFAR-10-LT of Cao et al. 2019), n_head the
    largest value every class can supply. rho = 1 keeps every sample."""
    counts = np.asarray(counts, dtype=np.int64)
    c = len(counts)
    if imbalance_factor == 1 or c == 1:
        return counts.copy()
    decay = float(imbalance_factor) ** (-np.arange(c) / (c - 1))
    n_head = int(np.floor(np.min(counts / decay) + 1e-9))
    sizes = np.minimum(counts, np.round(n_head * decay).astype(np.int64))
    if sizes.min() < 1:
        raise Infeasible("params.imbalance_factor", imbalance_factor,
                         f"a smaller factor, below about {2 * n_head} for this dataset (the head class holds {n_head} samples, "
                         f"so the tail class would get round({n_head} / {imbalance_factor}) = 0)")
    return sizes


def long_tail_client_sizes(counts: np.ndarray, num_clients: int, imbalance_factor: float, client_imbalance_factor: float,
                           min_partition_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class sizes, client sizes, client weights) of `long_tail_partition` from the class counts alone
    (no random draw decides them); an `Infeasible` where they leave a client short."""
    sizes_c = long_tail_class_sizes(counts, imbalance_factor)
    total = int(sizes_c.sum())
    if num_clients > total:
        raise Infeasible("num_clients", num_clients,
                         f"at most the {total} samples left after the long-tail subsampling (imbalance_factor={imbalance_factor})")
    k_exp = np.arange(num_clients) / (num_clients - 1) if num_clients > 1 else np.zeros(1)
    client_w = float(client_imbalance_factor) ** (-k_exp)
    sizes_k = _apportion(total, client_w)
    if sizes_k.min() < min_partition_size:
        raise Infeasible("params.client_imbalance_factor", client_imbalance_factor,
                         f"a smaller factor or fewer clients (the smallest client would get {sizes_k.min()} < "
                         f"min_partition_size={min_partition_size} of {total} samples)")
    return sizes_c, sizes_k, client_w


def _ipf(target: np.ndarray, rows: np.ndarray, cols: np.ndarray, iters: int = 10000, tol: float = 1e-10) -> np.ndarray:
    """Iterative proportional fitting: diag(a) @ target @ diag(b) with row sums `rows` and column
    sums `cols` (the KL-closest matrix to `target` with those margins; target > 0)."""
    m = target.astype(np.float64).copy()
    for _ in range(iters):
        m *= (cols / m.sum(axis=0))[None, :]
        m *= (rows / m.sum(axis=1))[:, None]
        if np.max(np.abs(m.sum(axis=0) - cols)) <= tol * max(1.0, cols.max()):
            break
    return m


def _round_matrix(m: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """An integer matrix near `m` (real, >= 0) with the integer margins `rows` and `cols`
    (same total): floor, then hand out the missing units to the cells with the largest
    fractional parts whose row and column still miss some, then any leftover (rare) to the
    first cells whose row and column still miss some."""
    out = np.floor(m).astype(np.int64)
    need_r = rows - out.sum(axis=1)
    need_c = cols - out.sum(axis=0)
    frac = (m - out).ravel()
    for cell in np.argsort(-frac, kind="stable"):
        if frac[cell] <= 0:
            break
        i, j = divmod(int(cell), m.shape[1])
        if need_r[i] > 0 and need_c[j] > 0:
            out[i, j] += 1
            need_r[i] -= 1
            need_c[j] -= 1
    for i in np.flatnonzero(need_r > 0):
        for j in np.flatnonzero(need_c > 0):
            give = min(need_r[i], need_c[j])
            out[i, j] += give
            need_r[i] -= give
            need_c[j] -= give
    return out


@PARTITIONERS.register(
    "long_tail",
    "GRP-FED long-tailed split: class sizes decay exponentially (largest/smallest = imbalance_factor), client sizes geometric, "
    "each client long-tailed over its own random class order; no overlap",
    params={
        "imbalance_factor": Param(100.0, "global largest / smallest class size after subsampling the dataset (CIFAR-10-LT style, "
                                  "class 0 = head); 1 keeps the whole dataset (GRP-FED's synthetic CIFAR-10)", float, minimum=1),
        "client_imbalance_factor": Param(100.0, "largest / smallest client size, sizes geometric over client ids (client 0 largest; "
                                         "methods.md §3.5 [RECON]: 100)", float, minimum=1),
        "local_imbalance_factor": Param(100.0, "rho of each client's class proportions p_{k,c} ∝ rho^(-r_{k,c}/(C-1)), r_k a random class "
                                        "permutation per client (methods.md §3.5 [RECON]: 100)", float, minimum=1),
        "min_partition_size": Param(1, "refuse a split where a client gets fewer samples", int, minimum=0),
    },
)
def long_tail_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.RandomState,
    imbalance_factor: float = 100.0,
    client_imbalance_factor: float = 100.0,
    local_imbalance_factor: float = 100.0,
    min_partition_size: int = 1,
) -> list[np.ndarray]:
    """GRP-FED's long-tailed CIFAR-10 (methods.md §3.5), made consistent as follows.

    1. Subsample the data to global class sizes s_c = round(n_head * rho_g^(-c/(C-1)))
       (`long_tail_class_sizes`; a random subset of each class, rho_g = imbalance_factor).
    2. Client size targets t_k ∝ rho_n^(-k/(K-1)), k = 0..K-1, summing to sum_c s_c
       (rho_n = client_imbalance_factor; client 0 largest).
    3. Target pattern T_{k,c} = t_k * p_{k,c} with p_{k,c} ∝ rho_l^(-r_{k,c}/(C-1)) over a random
       class permutation r_k per client (rho_l = local_imbalance_factor).
    4. The three requirements cannot all hold exactly when rho_g > 1 (the union of the clients'
       random class orders is not long-tailed), so T is fitted by iterative proportional fitting
       to the margins (t_k, s_c): M = diag(a) T diag(b). Each client's proportions are thus its
       long tail times a per-class factor b_c shared by all clients; with rho_g = 1 and many
       clients b ≈ 1 and the per-client long tails hold as specified.
    5. M is rounded to integers with both margins kept (`_round_matrix`): client k gets exactly
       round(t_k) samples (largest remainder) and the global class sizes are exactly s_c, so the
       achieved imbalance factor (`class_imbalance_factor`) is s_0 / s_{C-1}, rho_g up to the
       rounding of the tail class, and `size_imbalance_factor` is rho_n up to the rounding of
       the smallest client.
    """
    _check_clients(labels, num_clients)
    classes, counts = np.unique(labels, return_counts=True)
    c = len(classes)
    sizes_c, sizes_k, client_w = long_tail_client_sizes(counts, num_clients, imbalance_factor, client_imbalance_factor,
                                                        min_partition_size)
    kept = []
    for k, s in zip(classes, sizes_c):
        idx_k = np.where(labels == k)[0]
        kept.append(idx_k[rng.permutation(len(idx_k))[:s]])
    total = int(sizes_c.sum())
    local_w = float(local_imbalance_factor) ** (-(np.arange(c) / (c - 1) if c > 1 else np.zeros(1)))
    p = np.empty((num_clients, c))
    for i in range(num_clients):
        p[i, rng.permutation(c)] = local_w  # class perm[j] has rank j
    p /= p.sum(axis=1, keepdims=True)
    t = total * client_w / client_w.sum()
    m = _round_matrix(_ipf(t[:, None] * p, t, sizes_c.astype(np.float64)), sizes_k, sizes_c)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j, idx in enumerate(kept):
        for i, piece in enumerate(_cut(idx, m[:, j])):
            parts[i].append(piece)
    return [np.sort(np.concatenate(pp)) for pp in parts]


# ----------------------------------------------------------------------- domain skew (FedGCR)


def domain_client_counts(num_domains: int, dif: float, min_clients_per_domain: int = 1) -> list[int]:
    """Clients per domain, FedGCR's `prepare_*_uneven` (methods.md §5.6): domain i (0-based, in
    the domain order) gets round(ratio^(T-1-i)) clients, ratio = dif^(1/(T-1)) rounded to one
    decimal as in FedGCR's configs (Digit-Five 1.5 / 1.8, DomainNet 1.4 / 1.6), so the largest /
    smallest count is dif for those settings: dif 5 -> [5, 3, 2, 2, 1] (T = 5), [5, 4, 3, 2, 1, 1]
    (T = 6); dif 10 -> [10, 6, 3, 2, 1], [10, 7, 4, 3, 2, 1]. Counts are at least min_clients_per_domain."""
    if num_domains == 1:
        return [max(int(round(dif)), min_clients_per_domain)]
    ratio = round(float(dif) ** (1.0 / (num_domains - 1)), 1)
    return [max(int(round(ratio ** (num_domains - 1 - i))), min_clients_per_domain) for i in range(num_domains)]


@PARTITIONERS.register(
    "domain",
    "one domain per client (groups['domain']); clients per domain geometric with largest/smallest = dif (FedGCR); "
    "each domain split iid or Dir(alpha) among its clients",
    params={
        "dif": Param(1.0, "domain imbalance factor: clients of the first / of the last domain (FedGCR: 1, 5, 10); "
                     "num_clients must equal the resulting total (see domain_client_counts)", float, minimum=1),
        "partition_by": Param("domain", "the per-sample group column holding the domain id", str),
        "domain_order": Param("id", "which domain gets the most clients: 'id' = ascending domain id (FedGCR's fixed order), "
                              "'size' = most samples first, 'random' = drawn from the seed", str, choices=("id", "size", "random")),
        "min_clients_per_domain": Param(1, "at least this many clients per domain (2 with dif = 1 is FedGCR's 'even' setting)",
                                        int, minimum=1),
        "alpha": Param(0.0, "0: each domain split iid into equal shares (±1); > 0: Dirichlet label skew Dir(alpha) among "
                       "the domain's clients (the 'dirichlet' partitioner within the domain)", float, minimum=0),
        "min_partition_size": Param(1, "alpha > 0: redraw until every client of the domain has this many samples", int, minimum=0),
        "geometric_sizes": Param(False, "FedGCR's uneven volumes (prepare_*_uneven, methods.md §5.6): domain i keeps 1/ratio^i of "
                                 "the volume the first can hold (len_i = len_(i-1) / ratio) and its clients' sizes form a "
                                 "geometric series with the same ratio, largest first; needs alpha = 0", bool),
    },
)
def domain_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.RandomState,
    dif: float = 1.0,
    partition_by: str = "domain",
    domain_order: str = "id",
    min_clients_per_domain: int = 1,
    alpha: float = 0.0,
    min_partition_size: int = 1,
    geometric_sizes: bool = False,
    groups: dict[str, np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Clients come domain by domain in the domain order (the first domain's clients first).

    By default the domains keep all their data and a domain's clients get equal shares;
    `geometric_sizes` gives FedGCR's uneven volumes: later domains shrink by the DIF ratio and
    client sizes inside a domain are geometric (methods.md §5.6). FedGCR's 'even' setting (DIF 1:
    2 clients per domain split 1:3) is not this: its ratio is 1.
    """
    domain = _need_groups(groups, partition_by, "partition_by", "domain", len(labels))
    ids, sizes = np.unique(domain, return_counts=True)
    if domain_order == "size":
        ids = ids[np.argsort(-sizes, kind="stable")]
    elif domain_order == "random":
        ids = ids[rng.permutation(len(ids))]
    counts = domain_client_counts(len(ids), dif, min_clients_per_domain)
    if num_clients != sum(counts):
        raise ConfigError(
            f"partition: key 'num_clients' has value {num_clients}; allowed: {sum(counts)} = clients per domain {counts} "
            f"for the {len(ids)} domains {ids.tolist()} at dif={dif}, min_clients_per_domain={min_clients_per_domain}"
        )
    ratio = round(float(dif) ** (1.0 / (len(ids) - 1)), 1) if len(ids) > 1 else 1.0  # as domain_client_counts
    if geometric_sizes and alpha > 0:
        raise ConfigError(f"partition: key 'geometric_sizes' has value True with alpha {alpha}; allowed: alpha 0 (iid within a domain)")
    volume = None
    if geometric_sizes:  # the largest first-domain volume every domain can supply at its decayed share
        volume = min(np.sum(domain == d) * ratio**i for i, d in enumerate(ids))
    out: list[np.ndarray] = []
    for i, (d, n_d) in enumerate(zip(ids, counts)):
        idx_d = np.where(domain == d)[0]
        if n_d > len(idx_d):
            raise ConfigError(f"partition: key 'dif' has value {dif}; allowed: a smaller value (domain {d!r} has {len(idx_d)} samples "
                              f"for {n_d} clients)")
        if alpha > 0:
            pieces = dirichlet_partition(labels[idx_d], n_d, rng, alpha=alpha, min_partition_size=min_partition_size)
            out.extend(np.sort(idx_d[p]) for p in pieces)
        elif geometric_sizes:
            share = ratio ** -np.arange(n_d, dtype=float)
            sizes = np.floor(volume / ratio**i * share / share.sum()).astype(np.int64)
            if sizes.min() < 1:
                raise ConfigError(f"partition: key 'geometric_sizes' leaves a client of domain {d!r} without data at dif={dif}; "
                                  "allowed: false, or a dataset with more samples per domain")
            out.extend(np.sort(p) for p in _cut(idx_d[rng.permutation(len(idx_d))], sizes))
        else:
            out.extend(np.sort(p) for p in np.array_split(idx_d[rng.permutation(len(idx_d))], n_d))
    return out


# ----------------------------------------------------------------------- natural ids


@PARTITIONERS.register(
    "natural_id",
    "one client per distinct id of a group column (flwr NaturalIdPartitioner: patient, writer, user); no overlap",
    params={
        "partition_by": Param("", "the per-sample group column whose ids define the clients (e.g. 'patient', 'user'); required", str),
        "select": Param("all", "'all': num_clients must equal the number of distinct ids; 'largest': the num_clients ids with "
                        "the most samples; 'first': the num_clients smallest ids (the other ids' samples are left out)",
                        str, choices=("all", "largest", "first")),
    },
)
def natural_id_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.RandomState,
    partition_by: str = "",
    select: str = "all",
    groups: dict[str, np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Client i holds every sample of the i-th selected id, ids in ascending order. The data
    decides the partition, so the seed does not change it."""
    col = _need_groups(groups, partition_by, "partition_by", "natural_id", len(labels))
    ids, inverse, sizes = np.unique(col, return_inverse=True, return_counts=True)
    if select == "all" and num_clients != len(ids):
        raise ConfigError(
            f"partition: key 'num_clients' has value {num_clients}; allowed: {len(ids)}, the number of distinct "
            f"{partition_by!r} ids (or select: 'largest' / 'first' to keep only num_clients of them)"
        )
    if num_clients > len(ids):
        raise ConfigError(f"partition: key 'num_clients' has value {num_clients}; allowed: at most the {len(ids)} distinct {partition_by!r} ids")
    if select == "largest":
        chosen = np.sort(np.argsort(-sizes, kind="stable")[:num_clients])
    else:
        chosen = np.arange(num_clients)
    order = np.argsort(inverse, kind="stable")  # sample indices grouped by id, ascending within an id
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [order[starts[j] : starts[j + 1]].astype(np.int64) for j in chosen]


# ----------------------------------------------------------------------- label quantity (Calibre's Q-non-iid)


def _per_class(size: int, s: int) -> np.ndarray:
    """A client's samples of each of its S classes: size // S each, the first size % S one more."""
    per = np.full(s, size // s, np.int64)
    per[: size % s] += 1
    return per


def label_quantity_plan(counts: np.ndarray, num_clients: int, s: int, rng: np.random.RandomState, mode: str,
                        partition_size: int) -> tuple[np.ndarray, int]:
    """(owned, largest): the class columns of each client (num_clients x S, columns = the classes in label
    order) and the largest partition_size every class can supply, from the class counts alone; an
    `Infeasible` for a partition_size (0: the largest) the counts cannot give every client."""
    counts = np.asarray(counts, np.int64)
    _check_classes_per_partition(s, len(counts))
    owned = np.array(_label_quantity_classes(num_clients, np.arange(len(counts)), s, rng, mode), np.int64).reshape(num_clients, s)
    holders = np.zeros((len(counts), s), np.int64)  # holders[c, j]: the clients holding class c as their j-th
    np.add.at(holders, (owned, np.broadcast_to(np.arange(s), owned.shape)), 1)
    lo, hi = 0, int(counts.sum()) // num_clients  # the largest feasible size, by bisection (demand grows with size)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if np.all(holders @ _per_class(mid, s) <= counts) else (lo, mid - 1)
    size = partition_size or lo
    if size >= s and size <= lo:
        return owned, lo
    if lo < s:  # no size works; a client's classes do not depend on the clients after it, so fewer clients may
        by_class = np.argsort(owned.ravel(), kind="stable")  # (client, j) slots grouped by class, clients ascending
        starts = np.concatenate(([0], np.cumsum(holders.sum(axis=1))[:-1]))
        short = holders.sum(axis=1) > counts  # classes with more holders than samples; the first holder too many:
        fits = int(min(by_class[starts[c] + counts[c]] // s for c in np.flatnonzero(short)))
        raise Infeasible("num_clients", num_clients, f"at most {fits} for {s} classes per client: with more, a class runs out of "
                         f"samples before every client has one of each of its classes (class sizes {show(counts.tolist())}; "
                         f"partition_size {partition_size})")
    raise Infeasible("params.partition_size", partition_size, f"{s} to {lo} samples per client for {num_clients} clients x {s} "
                     f"classes (class sizes {show(counts.tolist())})")


def _label_quantity_classes(num_clients: int, classes: np.ndarray, s: int, rng: np.random.RandomState, mode: str) -> list[list[int]]:
    c = len(classes)
    if mode == "deterministic":
        return _cyclic_classes(num_clients, classes, s, rng.permutation(c))
    out = []  # Plato's sampler_utils.assign_sub_classes: class i mod C, then S - 1 distinct random ones
    for i in range(num_clients):
        mine = [int(classes[i % c])]
        while len(mine) < s:
            k = int(classes[rng.randint(c)])
            if k not in mine:
                mine.append(k)
        out.append(mine)
    return out


@PARTITIONERS.register(
    "label_quantity",
    "Calibre's Q-non-iid (S, #samples): each client holds S classes and partition_size samples split evenly over them; disjoint",
    params={
        "num_classes_per_partition": Param(2, "classes per client (S)", int, minimum=1),
        "partition_size": Param(0, "samples per client (#samples), split evenly over its S classes; 0 = the largest size every "
                                "client can get", int, minimum=0),
        "class_assignment": Param("deterministic", "'deterministic': client i gets classes perm[(i*S + j) mod C] (as 'pathological'; "
                                  "every class held by N*S/C clients when that divides); 'plato': Plato's assign_sub_classes, class "
                                  "i mod C plus S - 1 distinct random classes", str, choices=("deterministic", "plato")),
    },
)
def label_quantity_partition(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.RandomState,
    num_classes_per_partition: int = 2,
    partition_size: int = 0,
    class_assignment: str = "deterministic",
) -> list[np.ndarray]:
    """Client i takes partition_size // S samples of each of its classes (the first
    partition_size % S of its classes one more) from disjoint slices of the shuffled class.
    CIFAR-10's 50,000 training images, 100 clients, S = 2 give Calibre's "(2, 500)".
    Samples beyond the demand are left out; a demand the data cannot meet is a ConfigError."""
    _check_clients(labels, num_clients)
    classes, counts = np.unique(labels, return_counts=True)
    s = num_classes_per_partition
    owned, lo = label_quantity_plan(counts, num_clients, s, rng, class_assignment, partition_size)
    size = partition_size or lo
    need = np.zeros((num_clients, len(classes)), np.int64)
    need[np.arange(num_clients)[:, None], owned] = _per_class(size, s)[None, :]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j, k in enumerate(classes):
        idx_k = np.where(labels == k)[0]
        rng.shuffle(idx_k)
        for i, piece in enumerate(_cut(idx_k, need[:, j])):
            if len(piece):
                parts[i].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


# ----------------------------------------------------------------------- Plato's Dirichlet sampler (dirichlet, sampler="plato")


def _plato_dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.RandomState, alpha: float, partition_size: int) -> list[np.ndarray]:
    """Plato's samplers/dirichlet.py (Calibre's D-non-iid, methods.md §2.6): client by client,
    q ~ Dir(alpha * 1_C) over the classes, then partition_size distinct indices of the WHOLE
    dataset drawn without replacement with probability ∝ q[label]. Clients are independent, so
    their sets overlap; this is a sampling, not a partition. Plato seeds client k with
    random_seed * k and draws with torch; here one RandomState stream serves all clients, so the
    scheme is Plato's but the numbers are not."""
    n = len(labels)
    if partition_size > n:
        raise Infeasible("params.partition_size", partition_size, f"at most the {n} samples of the dataset")
    classes, inverse = np.unique(labels, return_inverse=True)
    out = []
    for cid in range(num_clients):
        q = rng.dirichlet(np.repeat(alpha, len(classes)))
        if not np.all(np.isfinite(q)) or q.sum() <= 0:  # Plato's fallback for a degenerate draw: one random class
            q = np.zeros(len(classes))
            q[rng.randint(len(classes))] = 1.0
        w = q[inverse]
        if np.count_nonzero(w) < partition_size:  # tiny alpha: the shares of most classes underflow to 0 (torch errors too)
            raise ConfigError(
                f"partition: key 'partition_size' has value {partition_size}; allowed: at most {np.count_nonzero(w)} for client {cid}, "
                f"whose Dir(alpha={alpha}) draw gives only those samples a positive weight (or a larger alpha)"
            )
        out.append(np.sort(rng.choice(n, size=partition_size, replace=False, p=w / w.sum())).astype(np.int64))
    return out


#: The most work `infeasibility` spends replaying one Dirichlet partition's draws, in samples shuffled
#: (about one second): a replay that would take longer is left to the partition step.
DIRICHLET_REPLAY_BUDGET = 100_000_000


def replayable_draws(n: int, num_classes: int, num_clients: int) -> int:
    """How many Dirichlet draws of n samples in `num_classes` classes over `num_clients` clients fit in
    DIRICHLET_REPLAY_BUDGET: a draw costs about a shuffle of every sample plus, per class, 1,500 samples'
    worth of calls and 20 per client."""
    return DIRICHLET_REPLAY_BUDGET // (n + num_classes * (1_500 + 20 * num_clients))


def infeasibility(partitioner: str, counts, num_clients: int, seed: int, params: dict) -> None:
    """Raise the `Infeasible` the partition step would raise for partitioner `partitioner` with the
    resolved `params`, `num_clients` and partition `seed` on labels with these per-class `counts`
    (in label order), where the counts alone decide it: every built-in partitioner's client count
    and minimum size, label_quantity's sizes, long_tail's sizes, and the Dirichlet (sampler 'split')
    draws, replayed exactly (within DIRICHLET_REPLAY_BUDGET). Returns None otherwise, also for what
    only the samples decide (groups, Plato's weighted sampling) and for partitioners from plugins."""
    counts = np.asarray([c for c in counts if c > 0], np.int64)  # np.unique's classes: those with samples
    n = int(counts.sum())
    if partitioner not in {"iid", "dirichlet", "pathological", "quantity_skew", "long_tail", "label_quantity"}:
        return None
    if num_clients > n:
        raise Infeasible("num_clients", num_clients, f"at most the {n} samples of the dataset")
    if partitioner == "dirichlet" and params["sampler"] == "plato":
        if params["partition_size"] > n:
            raise Infeasible("params.partition_size", params["partition_size"], f"at most the {n} samples of the dataset")
    elif partitioner == "dirichlet":
        m, retries = params["min_partition_size"], params["max_retries"]
        _check_min_partition_size(n, num_clients, m)
        if m <= 0:
            return None
        replayable = replayable_draws(n, len(counts), num_clients)
        best = 0
        for _, smallest in zip(range(min(retries, replayable)), dirichlet_draws(counts, num_clients, seed, params["alpha"],
                                                                                 params["self_balancing"])):
            if smallest >= m:
                return None
            best = max(best, smallest)
        if retries <= replayable:
            raise _no_dirichlet_draw(params["alpha"], m, retries, best)
    elif partitioner == "pathological":
        _check_classes_per_partition(params["num_classes_per_partition"], len(counts))
    elif partitioner == "quantity_skew":
        _check_min_partition_size(n, num_clients, params["min_partition_size"])
    elif partitioner == "long_tail":
        long_tail_client_sizes(counts, num_clients, params["imbalance_factor"], params["client_imbalance_factor"],
                               params["min_partition_size"])
    elif partitioner == "label_quantity":
        label_quantity_plan(counts, num_clients, params["num_classes_per_partition"], np.random.RandomState(seed),
                            params["class_assignment"], params["partition_size"])
    return None


def shuffled_split(indices: np.ndarray, test_size: float, rng: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) as sklearn's `train_test_split(indices, test_size=test_size, shuffle=True,
    random_state=rng)` gives them, to the bit and with the same draw from `rng` (one permutation;
    tests/test_startup.py compares them): its ShuffleSplit, without importing scikit-learn, which
    costs the partition job about 3 s."""
    n = len(indices)
    n_test = math.ceil(test_size * n)
    n_train = n - n_test
    if n_train <= 0:
        raise ValueError(f"With n_samples={n}, test_size={test_size} and train_size=None, the resulting train set will be "
                         "empty. Adjust any of the aforementioned parameters.")
    permutation = rng.permutation(n)
    return indices[permutation[n_test:]], indices[permutation[:n_test]]


def _split_off(indices: np.ndarray, test_size: float, rng: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    """`shuffled_split`, except for a client too small for it (sklearn refuses a split that leaves no
    training sample): then all of it goes to the second part, nothing drawn, and the client has no
    training data, which the partition step refuses by name (shards.check_clients_usable)."""
    if len(indices) - math.ceil(test_size * len(indices)) <= 0:
        return indices[:0], indices
    return shuffled_split(indices, test_size, rng)


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
    sklearn's shuffled `train_test_split` (`shuffled_split`), which is what PFLlib does
    (75/25), drawn from the same RandomState so PFLlib's numbers are reproduced.
    """
    if not stratify:
        rest, test = _split_off(indices, test_fraction, rng) if test_fraction > 0 else (indices, indices[:0])
        if val_fraction > 0:
            rest, val = _split_off(rest, val_fraction / (1 - test_fraction), rng)
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
