"""Parquet client shards: one file per client plus a manifest with checksums.

Layout of a partition directory `results/shards/<dataset>/<partition_id>/`:
  client_00000.parquet ...  one file per client, one row per sample, columns
      index (int64, row in the source dataset), label (int64), split (int8: 0 train,
      1 test, 2 val), x (fixed_size_binary: the sample's raw bytes; shape and dtype in
      the schema metadata), group_<name> (optional per-sample ids)
  manifest.json             the resolved spec, the source fingerprint, per-client sizes
                            and class counts, and the sha256 of every shard

The partition id is a short hash of the spec (dataset, its params, partitioner, params,
clients, split, seed), so partitions of one dataset coexist and an unchanged one is
never recomputed. The directory is built under a temporary name and renamed into place,
so a crash never leaves something that looks complete; an existing directory is swapped
with the new one in one step (renameat2 RENAME_EXCHANGE where the kernel has it), so a
reader never finds the partition folder missing.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
from ..io import derive_seed, fsync_dir, read_json, replace_dir, sha256_file, short_hash, write_json_atomic
from ..registry import ConfigError, resolve_params, show
from .base import RawDataset
from .partitioners import PARTITIONERS, split_client

SPLITS = ("train", "test", "val")
UNLABELED = "unlabeled"  # split code 3: rows of RawDataset.unlabeled (label -1), self-supervised data only
FORMAT = "fedrepro.shards/2"  # 2: unseen clients, scarcity, the official test set
MANIFEST = "manifest.json"
OFFICIAL_TEST = "official_test.parquet"
MAX_GROUP_IDS = 64  # a client's group ids are listed in the manifest up to this many


class ShardChecksumError(RuntimeError):
    """A shard's bytes do not match the sha256 its manifest recorded."""


def resolve_partition_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and check a partition spec; the result is what the id hashes."""
    spec = dict(spec)
    if "dataset" not in spec:
        raise ConfigError(f"partition spec {show(spec)}: missing key 'dataset'; allowed: a registered dataset name")
    where = f"partition of dataset '{spec.get('dataset')}'"
    name = spec.get("partitioner")
    entry = PARTITIONERS.entry(name)
    num_clients = spec.get("num_clients")
    if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
        raise ConfigError(f"{where}: key 'num_clients' has value {show(num_clients)}; allowed: an integer >= 1")
    split = {"test_fraction": 0.25, "val_fraction": 0.0, "stratify": True, **(spec.get("split") or {})}
    unknown = sorted(set(split) - {"test_fraction", "val_fraction", "stratify"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} in 'split'; allowed: test_fraction, val_fraction, stratify")
    for key, low in (("test_fraction", 0), ("val_fraction", None)):
        v = split[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1 or v == low:
            interval = "(0, 1): every client needs test data to be scored" if low == 0 else "[0, 1)"
            raise ConfigError(f"{where}: key 'split.{key}' has value {show(v)}; allowed: a number in {interval}")
    if split["test_fraction"] + split["val_fraction"] >= 1:
        raise ConfigError(f"{where}: keys 'split.test_fraction' + 'split.val_fraction' = "
                          f"{split['test_fraction'] + split['val_fraction']}; allowed: < 1 (clients need training data)")
    seed = spec.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ConfigError(f"{where}: key 'seed' has value {show(seed)}; allowed: an integer in [0, 2**32 - 1] (numpy RandomState)")
    pool = spec.get("pool", True)
    if not isinstance(pool, bool):
        raise ConfigError(f"{where}: key 'pool' has value {show(pool)}; allowed: true or false")
    unseen = spec.get("unseen_clients", 0)
    if not isinstance(unseen, int) or isinstance(unseen, bool) or not 0 <= unseen < num_clients:
        raise ConfigError(f"{where}: key 'unseen_clients' has value {show(unseen)}; allowed: an integer in [0, num_clients - 1 = {num_clients - 1}]"
                          " (clients held out of training and evaluated after it)")
    return {
        "dataset": spec["dataset"],
        "dataset_params": dict(spec.get("dataset_params") or {}),
        "partitioner": name,
        "params": resolve_params(f"{where}, partitioner '{name}'", entry.params, spec.get("params")),
        "num_clients": num_clients,
        "pool": pool,
        "split": split,
        "seed": seed,
        "unseen_clients": unseen,
        "scarcity": _resolve_scarcity(spec.get("scarcity"), num_clients, where),
    }


def _resolve_scarcity(scarcity: Any, num_clients: int, where: str) -> dict | None:
    """{clients: "all" | [ids], fraction: f | [lo, hi]}: those clients keep only a fraction
    of their data, class by class (FedCoSR's fairness and scarcity scenarios)."""
    if scarcity is None:
        return None
    if not isinstance(scarcity, dict) or set(scarcity) - {"clients", "fraction"} or "fraction" not in scarcity:
        raise ConfigError(f"{where}: key 'scarcity' has value {show(scarcity)}; allowed: {{clients: all | [client ids], fraction: f or [low, high]}}")
    clients = scarcity.get("clients", "all")
    ok_ids = isinstance(clients, list) and clients and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < num_clients for c in clients)
    if clients != "all" and not ok_ids:
        raise ConfigError(f"{where}: key 'scarcity.clients' has value {show(clients)}; allowed: 'all' or a non-empty list of client ids in [0, {num_clients - 1}]")
    frac = scarcity["fraction"]
    bounds = frac if isinstance(frac, list) else [frac]
    if not (1 <= len(bounds) <= 2 and all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in bounds)
            and bounds == sorted(bounds)):
        raise ConfigError(f"{where}: key 'scarcity.fraction' has value {show(frac)}; allowed: a fraction in (0, 1] or a range [low, high] of them")
    return {"clients": clients if clients == "all" else sorted(set(clients)), "fraction": frac}


def scarce(indices: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Keep `fraction` of a client's samples class by class (at least one of every class it
    has), so its label distribution is unchanged; order of the kept indices preserved."""
    keep = np.zeros(len(indices), bool)
    client_labels = labels[indices]
    for k in np.unique(client_labels):
        pos = np.flatnonzero(client_labels == k)
        keep[rng.choice(pos, max(1, int(round(fraction * len(pos)))), replace=False)] = True
    return indices[keep]


def unseen_client_ids(spec: dict[str, Any]) -> list[int]:
    """The held-out clients, drawn from the partition seed on a stream of their own."""
    k = spec.get("unseen_clients", 0)
    rng = np.random.default_rng(derive_seed(spec["seed"], "unseen-clients"))
    return sorted(rng.choice(spec["num_clients"], size=k, replace=False).tolist()) if k else []


def partition_id(spec: dict[str, Any]) -> str:
    return short_hash({"format": FORMAT, **resolve_partition_spec(spec)})


def make_partition(raw: RawDataset, spec: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """Client -> split -> source row indices, a pure function of (raw data, spec)."""
    spec = resolve_partition_spec(spec)
    rng = np.random.RandomState(spec["seed"])
    pool = np.arange(len(raw.y)) if spec["pool"] else np.where(raw.official_split == 0)[0]
    fn = PARTITIONERS.get(spec["partitioner"])
    extra = {}
    if "groups" in inspect.signature(fn).parameters:  # domain / natural-id partitioners read per-sample ids
        extra["groups"] = {name: np.asarray(ids)[pool] for name, ids in raw.groups.items()}
    clients = [pool[idx] for idx in fn(raw.y[pool], spec["num_clients"], rng, **spec["params"], **extra)]
    if spec["scarcity"] is not None:  # its own stream: the split below draws what it would draw without it
        sc = spec["scarcity"]
        srng = np.random.default_rng(derive_seed(spec["seed"], "scarcity"))
        chosen = range(len(clients)) if sc["clients"] == "all" else sc["clients"]
        for cid in chosen:
            frac = sc["fraction"]
            frac = float(srng.uniform(frac[0], frac[-1])) if isinstance(frac, list) else frac
            clients[cid] = scarce(clients[cid], raw.y, frac, srng)
    split = spec["split"]
    out = [split_client(idx, raw.y, rng, split["test_fraction"], split["val_fraction"], split["stratify"]) for idx in clients]
    if raw.unlabeled is not None and len(raw.unlabeled):
        # the unlabeled pool, iid in equal shares over the training clients (novel clients get none)
        novel = set(unseen_client_ids(spec))
        training = [cid for cid in range(len(out)) if cid not in novel]
        order = np.random.default_rng(derive_seed(spec["seed"], "unlabeled")).permutation(len(raw.unlabeled))
        for cid in range(len(out)):
            out[cid][UNLABELED] = np.zeros(0, np.int64)
        for cid, share in zip(training, np.array_split(order, len(training))):
            out[cid][UNLABELED] = np.sort(share)
    return out


def write_partition(raw: RawDataset, spec: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Any]:
    """Partition `raw` and write shards + manifest into `out_dir` atomically; return the manifest.

    Without pooling, the dataset's official test set (where it has one) is written too (`official_test.parquet`),
    for evaluating on global test data."""
    spec = resolve_partition_spec(spec)
    pid = partition_id(spec)
    out_dir = Path(out_dir)
    assignment = make_partition(raw, spec)
    unseen = set(unseen_client_ids(spec))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        x2d = np.ascontiguousarray(raw.x).reshape(len(raw.x), -1).view(np.uint8)
        u2d = None if raw.unlabeled is None else np.ascontiguousarray(raw.unlabeled).reshape(len(raw.unlabeled), -1).view(np.uint8)
        if u2d is not None and raw.groups:
            raise ValueError(f"{raw.name}: an unlabeled pool and per-sample groups together are not supported")
        meta = {b"fedrepro.sample_shape": str(list(raw.sample_shape)).encode(), b"fedrepro.dtype": raw.x.dtype.str.encode(),
                b"fedrepro.partition_id": pid.encode()}
        files: dict[str, str] = {}

        def write_shard(fname: str, splits: dict[str, np.ndarray], owner: str) -> None:
            rows = np.concatenate([splits[s] for s in SPLITS])
            free = splits.get(UNLABELED, np.zeros(0, np.int64))  # rows of the unlabeled pool, indexed after the dataset's
            split_code = np.concatenate([np.full(len(splits[s]), i, np.int8) for i, s in enumerate(SPLITS)]
                                        + [np.full(len(free), len(SPLITS), np.int8)])
            xbytes = x2d[rows].tobytes() + (u2d[free].tobytes() if len(free) else b"")
            columns = {
                "index": pa.array(np.concatenate([rows, len(raw.y) + free]), pa.int64()),
                "label": pa.array(np.concatenate([raw.y[rows], np.full(len(free), -1)]), pa.int64()),
                "split": pa.array(split_code, pa.int8()),
                "x": pa.FixedSizeBinaryArray.from_buffers(pa.binary(x2d.shape[1]), len(rows) + len(free), [None, pa.py_buffer(xbytes)]),
            }
            for gname, garr in raw.groups.items():
                columns[f"group_{gname}"] = pa.array(np.asarray(garr)[rows], pa.int64())
            table = pa.table(columns).replace_schema_metadata({**meta, b"fedrepro.client_id": owner.encode()})
            pq.write_table(table, tmp_dir / fname, compression="zstd")
            files[fname] = sha256_file(tmp_dir / fname)

        def describe(splits: dict[str, np.ndarray]) -> dict[str, Any]:
            rows = np.concatenate([splits[s] for s in SPLITS])
            return {
                "sizes": {s: int(len(splits[s])) for s in SPLITS} | ({UNLABELED: int(len(splits[UNLABELED]))} if UNLABELED in splits else {}),
                "class_counts": {s: np.bincount(raw.y[splits[s]], minlength=raw.num_classes).tolist() for s in SPLITS},
                # the per-sample ids a client holds (its domain, its patient), where there are few
                "groups": {g: ids.tolist() for g, garr in raw.groups.items()
                           if len(ids := np.unique(np.asarray(garr)[rows])) <= MAX_GROUP_IDS},
            }

        clients = []
        for cid, splits in enumerate(assignment):
            fname = f"client_{cid:05d}.parquet"
            write_shard(fname, splits, str(cid))
            clients.append({"id": cid, "file": fname, "unseen": cid in unseen, **describe(splits)})
        official_test = None
        if not spec["pool"] and (raw.official_split == 1).any():
            empty = np.zeros(0, np.int64)
            splits = {"train": empty, "test": np.flatnonzero(raw.official_split == 1), "val": empty}
            write_shard(OFFICIAL_TEST, splits, "official_test")
            official_test = {"file": OFFICIAL_TEST, **describe(splits)}
        manifest = {
            "format": FORMAT,
            "fedrepro_version": __version__,
            "partition_id": pid,
            "spec": spec,
            "dataset": spec["dataset"],
            "partitioner": spec["partitioner"],
            "params": spec["params"],
            "num_clients": spec["num_clients"],
            "unseen_clients": sorted(unseen),
            "seed": spec["seed"],
            "num_classes": raw.num_classes,
            "sample_shape": list(raw.sample_shape),
            "dtype": raw.x.dtype.str,
            "mean": list(raw.mean),
            "std": list(raw.std),
            "source": raw.source,
            "source_fingerprint": raw.fingerprint(),
            "clients": clients,
            "official_test": official_test,
            "files": files,
        }
        write_json_atomic(tmp_dir / MANIFEST, manifest)
        fsync_dir(tmp_dir)
        replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest


@dataclass
class ClientShard:
    """One client's arrays, split by `split` name into (x, y)."""

    id: int | str
    x: dict[str, np.ndarray]
    y: dict[str, np.ndarray]


def read_manifest(part_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(part_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path}: no partition manifest (was the partition step run?)")
    return read_json(path)


def verify_partition(part_dir: str | os.PathLike, manifest: dict[str, Any] | None = None) -> None:
    """Raise ShardChecksumError naming the first shard whose sha256 differs from the manifest."""
    part_dir = Path(part_dir)
    manifest = manifest or read_manifest(part_dir)
    for fname, expected in manifest["files"].items():
        path = part_dir / fname
        if not path.exists():
            raise ShardChecksumError(f"{path}: shard listed in the manifest is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ShardChecksumError(f"{path}: sha256 {actual} does not match the manifest's {expected}; the shard is corrupted or was modified")


def read_shard(path: str | os.PathLike, manifest: dict[str, Any], owner: int | str) -> ClientShard:
    """One shard file's arrays, split by name; the x bytes are viewed, not copied."""
    table = pq.read_table(path)
    shape = tuple(manifest["sample_shape"])
    dtype = np.dtype(manifest["dtype"])
    xcol = table.column("x").combine_chunks()
    width = xcol.type.byte_width
    buf = np.frombuffer(xcol.buffers()[1], dtype=np.uint8)[xcol.offset * width : (xcol.offset + len(xcol)) * width]
    x = buf.view(dtype).reshape((len(xcol),) + shape)
    y = table.column("label").to_numpy()
    split = table.column("split").to_numpy()
    xs, ys = {}, {}
    for code, name in enumerate(SPLITS + (UNLABELED,)):
        mask = split == code
        xs[name], ys[name] = x[mask], y[mask]
    return ClientShard(owner, xs, ys)


def read_client(part_dir: str | os.PathLike, manifest: dict[str, Any], cid: int) -> ClientShard:
    return read_shard(Path(part_dir) / manifest["clients"][cid]["file"], manifest, cid)


def read_official_test(part_dir: str | os.PathLike, manifest: dict[str, Any]) -> ClientShard | None:
    """The dataset's official test set, present when the partition did not pool it."""
    info = manifest.get("official_test")
    return read_shard(Path(part_dir) / info["file"], manifest, "official_test") if info else None


def load_partition(part_dir: str | os.PathLike, verify: bool = True) -> tuple[dict[str, Any], list[ClientShard]]:
    """Read the manifest and every client's shard, checking checksums first."""
    manifest = read_manifest(part_dir)
    if verify:
        verify_partition(part_dir, manifest)
    return manifest, [read_client(part_dir, manifest, c["id"]) for c in manifest["clients"]]
