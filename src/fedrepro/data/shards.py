"""Parquet client shards: one file per client plus a manifest with checksums.

Layout of a partition directory `results/shards/<dataset>/<partition_id>/`:
  client_00000.parquet ...  one file per client, one row per sample, columns
      index (int64, row in the source dataset), label (int64), split (int8: 0 train,
      1 test, 2 val), x (fixed_size_binary: the sample's raw bytes; shape and dtype in
      the schema metadata), group_<name> (optional per-sample ids)
  manifest.json             the resolved spec, the source fingerprint, per-client sizes
                            and class counts, the sha256 of every shard, and `manifest_sha256`:
                            the sha256 of the manifest's own canonical JSON (every other field)

Reading trusts nothing in the folder beyond these hashes: the manifest's hash is checked
first (so the normalisation, dtype, shape, client list, unseen flags and the shard of each
client are the ones written), every shard path must be a plain file name listed in `files`
naming a regular file inside the folder (checked before it is opened), its bytes are read
once, hashed and parsed from that same buffer, and the client id and partition id stored
in the shard's own metadata must be the slot it is read for. `PartitionIntegrityError`
(a `ShardChecksumError`) names the file and the field.

The partition id is a short hash of the spec (dataset, its params, partitioner, params,
clients, split, seed), so partitions of one dataset coexist and an unchanged one is
never recomputed. The directory is built under a temporary name and renamed into place,
so a crash never leaves something that looks complete; an existing directory is swapped
with the new one in one step (renameat2 RENAME_EXCHANGE where the kernel has it), so a
reader never finds the partition folder missing.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..version import __version__
from ..io import (FileTooLarge, NotRegularFile, canonical_json, clean_stale, derive_seed, fsync_dir, load_json, read_regular,
                  replace_dir, sha256_file, short_hash, staging_dir, write_json_atomic)
from ..registry import ConfigError, resolve_params, show
from .base import RawDataset
from .partitioners import PARTITIONERS, Infeasible, replayable_draws, split_client

SPLITS = ("train", "test", "val")
UNLABELED = "unlabeled"  # split code 3: rows of RawDataset.unlabeled (label -1), self-supervised data only
FORMAT = "fedrepro.shards/2"  # 2: unseen clients, scarcity, the official test set
MANIFEST = "manifest.json"
OFFICIAL_TEST = "official_test.parquet"
MAX_GROUP_IDS = 64  # a client's group ids are listed in the manifest up to this many
MANIFEST_HASH = "manifest_sha256"  # the manifest's key holding the hash of all its other fields
MAX_MANIFEST_BYTES = 256 << 20  # a manifest is KBs to a few MBs (100,000 clients); never read more
REPARTITION = "delete the folder and rerun: the workflow rebuilds it from the raw data"


class ShardChecksumError(RuntimeError):
    """A partition's files do not match what its manifest recorded (a shard's sha256)."""


class PartitionIntegrityError(ShardChecksumError):
    """A manifest that is edited, unhashed or malformed, or a shard path that is not a regular file
    of the partition, or a shard holding another client's or partition's data."""


class EmptyClientsError(ConfigError):
    """The partition leaves clients without training or test data, and the config does not allow it."""


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
    allow_empty = spec.get("allow_empty_clients", False)
    if not isinstance(allow_empty, bool):
        raise ConfigError(f"{where}: key 'allow_empty_clients' has value {show(allow_empty)}; allowed: true or false")
    dataset_params = spec.get("dataset_params") or {}
    if not isinstance(dataset_params, dict):
        raise ConfigError(f"{where}: key 'dataset_params' has value {show(dataset_params)}; allowed: a mapping of the dataset's parameters")
    return {
        "dataset": spec["dataset"],
        "dataset_params": dict(dataset_params),
        "partitioner": name,
        "params": resolve_params(f"{where}, partitioner '{name}'", entry.params, spec.get("params")),
        "num_clients": num_clients,
        "pool": pool,
        "split": split,
        "seed": seed,
        "unseen_clients": unseen,
        "scarcity": _resolve_scarcity(spec.get("scarcity"), num_clients, where),
        # only when set, so that the ids of partitions made before the key existed stay what they were
        **({"allow_empty_clients": True} if allow_empty else {}),
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


def scarce_client_ids(spec: dict[str, Any]) -> list[int]:
    """The clients `scarcity` thins, in the order their fractions are drawn (none without it)."""
    sc = spec.get("scarcity")
    if sc is None:
        return []
    return list(range(spec["num_clients"])) if sc["clients"] == "all" else list(sc["clients"])


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
        for cid in scarce_client_ids(spec):
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


def _ids(ids: list[int], limit: int = 20) -> str:
    return ", ".join(map(str, ids[:limit])) + (f", ... ({len(ids) - limit} more)" if len(ids) > limit else "")


def check_clients_usable(spec: dict[str, Any], pid: str, assignment: list[dict[str, np.ndarray]]) -> None:
    """EmptyClientsError unless every client has a training and a test sample (or the spec allows
    empty clients): a client without them is neither trained nor scored, and the averages over
    "all clients" would silently be over fewer."""
    if spec.get("allow_empty_clients"):
        return
    no_train = [cid for cid, s in enumerate(assignment) if not len(s["train"])]
    no_test = [cid for cid, s in enumerate(assignment) if not len(s["test"])]
    if not (no_train or no_test):
        return
    k = len(assignment)
    bad = sorted(set(no_train) | set(no_test))
    raise EmptyClientsError(
        f"dataset '{spec['dataset']}', partition {pid} ({spec['partitioner']}, {k} clients): {len(bad)} of {k} clients "
        f"have no training or no test data ({len(no_train)} without training data: [{_ids(no_train)}]; {len(no_test)} "
        f"without test data: [{_ids(no_test)}]), so they would be neither trained nor scored; allowed: every client with "
        "at least 1 training and 1 test sample: raise params.min_partition_size (or partition_size), use fewer clients "
        "or a larger split.test_fraction, or set allow_empty_clients: true in the partition to keep them (left out of "
        "the scores; metrics.json's clients.test_size shows which were scored)")


#: The most labels x clients `check_from_labels` partitions before any job: about a second of the
#: partition step's own work for Plato's sampler (a weighted draw over every sample per client), a
#: fraction of it for the others (Fashion-MNIST's 70,000 labels over 1,428 clients); a larger partition is
#: left to the partition step.
LABELS_CHECK_BUDGET = 100_000_000


def check_from_labels(raw: RawDataset, spec: dict[str, Any]) -> bool:
    """The partition step's verdict (write_partition: `make_partition`, then `check_clients_usable`) on the
    resolved `spec` over `raw`, which need hold only the labels and official split (datasets.known_labels):
    the partition depends on nothing else. Raises what the step would raise (EmptyClientsError, the
    partitioner's Infeasible or own ConfigError); returns whether it decided: not for a partitioner that
    reads per-sample groups `raw` lacks, beyond LABELS_CHECK_BUDGET, or where redraws (`max_retries`) would
    run past the replay budget of `infeasibility` (partitioners.replayable_draws) without a draw that fits."""
    spec = resolve_partition_spec(spec)
    fn = PARTITIONERS.get(spec["partitioner"])
    labels = raw.y if spec["pool"] else raw.y[raw.official_split == 0]
    if ("groups" in inspect.signature(fn).parameters and not raw.groups) or len(labels) * spec["num_clients"] > LABELS_CHECK_BUDGET:
        return False
    params, capped = spec["params"], False
    if "max_retries" in params:  # no more redraws than `infeasibility` replays
        cap = max(1, replayable_draws(len(labels), len(np.unique(labels)), spec["num_clients"]))
        capped = params["max_retries"] > cap
        params = {**params, "max_retries": min(params["max_retries"], cap)}
    try:
        assignment = make_partition(raw, {**spec, "params": params})
    except Infeasible as exc:
        if capped and exc.key == "params.min_partition_size":
            return False
        raise
    check_clients_usable(spec, partition_id(spec), assignment)
    return True


FIELD_HASHES = "field_sha256"  # a short hash of each field (each client's entry apart): names what was edited


def _digest(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:16]


def _field_digests(manifest: dict[str, Any]) -> dict[str, str]:
    out = {}
    for key, value in manifest.items():
        if key in (MANIFEST_HASH, FIELD_HASHES):
            continue
        if key == "clients" and isinstance(value, list):
            out.update({f"clients[{i}]": _digest(c) for i, c in enumerate(value)})
            out["clients.length"] = _digest(len(value))
        else:
            out[key] = _digest(value)
    return out


def manifest_hash(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, every field but `manifest_sha256` itself: what
    metrics and provenance record to name the exact data a cell trained on."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != MANIFEST_HASH}).encode()).hexdigest()


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest as JSON will read it back, with its field hashes and its own hash added."""
    body = json.loads(canonical_json({k: v for k, v in manifest.items() if k not in (MANIFEST_HASH, FIELD_HASHES)}))
    body[FIELD_HASHES] = _field_digests(body)
    return {**body, MANIFEST_HASH: manifest_hash(body)}


def write_partition(raw: RawDataset, spec: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Any]:
    """Partition `raw` and write shards + manifest into `out_dir` atomically; return the manifest.

    Without pooling, the dataset's official test set (where it has one) is written too (`official_test.parquet`),
    for evaluating on global test data."""
    spec = resolve_partition_spec(spec)
    pid = partition_id(spec)
    out_dir = Path(out_dir)
    assignment = make_partition(raw, spec)
    check_clients_usable(spec, pid, assignment)
    unseen = set(unseen_client_ids(spec))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out_dir.parent)  # the staging folders of partition jobs killed with SIGKILL
    tmp_dir = staging_dir(out_dir.parent, out_dir.name)
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
        manifest = seal_manifest(manifest)
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


def _integrity(path: Path, what: str) -> PartitionIntegrityError:
    return PartitionIntegrityError(f"{path}: {what}")


def _read_regular(path: Path, limit: int | None = None) -> bytes:
    """The bytes of `path`, which must be a regular file (a FIFO, a device or a socket is refused
    before it is read: none could hang or flood the job); at most `limit` bytes."""
    try:
        return read_regular(path, limit)
    except FileNotFoundError:
        raise ShardChecksumError(f"{path}: listed in the manifest but missing; {REPARTITION}") from None
    except NotRegularFile:
        raise _integrity(path, "not a regular file (a FIFO, device, socket or folder); a partition holds only "
                         "the files it wrote: refused without reading it") from None
    except FileTooLarge as exc:
        raise _integrity(path, f"{exc.size:,} bytes; allowed: at most {exc.limit:,}") from None


def read_manifest(part_dir: str | os.PathLike) -> dict[str, Any]:
    """The partition's manifest, refused (PartitionIntegrityError naming the field) unless its hash
    matches its content and its fields have the shape the readers rely on."""
    path = Path(part_dir) / MANIFEST
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no partition manifest (was the partition step run?)")
    if os.path.islink(path):
        raise _integrity(path, "a symbolic link; the manifest must be a regular file of the partition folder")
    try:
        manifest = load_json(_read_regular(path, MAX_MANIFEST_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _integrity(path, f"not valid JSON ({exc}); {REPARTITION}") from None
    if not isinstance(manifest, dict):
        raise _integrity(path, f"not a JSON object; {REPARTITION}")
    expected = manifest.get(MANIFEST_HASH)
    if expected is None:
        raise _integrity(path, f"no field '{MANIFEST_HASH}' (written by fedrepro {manifest.get('fedrepro_version', '?')}, "
                         f"before manifests were hashed), so its fields cannot be checked; {REPARTITION}")
    if expected != manifest_hash(manifest):
        stored = manifest.get(FIELD_HASHES)
        now = _field_digests(manifest)
        edited = sorted(k for k in set(now) | set(stored or {}) if (stored or {}).get(k) != now.get(k)) if isinstance(stored, dict) else []
        fields = ", ".join(f"'{k}'" for k in edited[:5]) + (f" and {len(edited) - 5} more" if len(edited) > 5 else "")
        what = f"field {fields} differs from what" if edited else f"field '{MANIFEST_HASH}' or '{FIELD_HASHES}' does not match what"
        raise _integrity(path, f"{what} the partition step wrote (its hash in '{MANIFEST_HASH}' does not match); "
                         f"the manifest was edited or corrupted; {REPARTITION}")
    _check_fields(path, manifest)
    return manifest


def _check_fields(path: Path, m: dict[str, Any]) -> None:
    """The fields the readers and the engine use have the types they expect (a manifest whose hash
    was recomputed by hand is still held to them)."""
    def need(ok: bool, field: str, value: Any, allowed: str) -> None:
        if not ok:
            raise _integrity(path, f"field '{field}' has value {show(value)}; allowed: {allowed}")

    need(m.get("format") == FORMAT, "format", m.get("format"), FORMAT)
    need(isinstance(m.get("partition_id"), str), "partition_id", m.get("partition_id"), "a string")
    files = m.get("files")
    need(isinstance(files, dict) and all(isinstance(v, str) for v in files.values()), "files", files, "{shard file name: sha256}")
    for fname in files:
        need(_plain_name(fname), "files", fname, "plain file names inside the partition folder (no '/', '..' or absolute path)")
    clients = m.get("clients")
    need(isinstance(clients, list) and all(isinstance(c, dict) for c in clients), "clients", clients, "a list of client entries")
    for i, c in enumerate(clients):
        need(c.get("id") == i, f"clients[{i}].id", c.get("id"), f"{i} (entries in client order)")
        need(c.get("file") in files, f"clients[{i}].file", c.get("file"), "a file listed in 'files'")
        need(isinstance(c.get("unseen", False), bool), f"clients[{i}].unseen", c.get("unseen"), "true or false")
    need(m.get("num_clients") == len(clients), "num_clients", m.get("num_clients"), f"the {len(clients)} entries of 'clients'")
    official = m.get("official_test")
    need(official is None or (isinstance(official, dict) and official.get("file") in files), "official_test", official,
         "null or an entry whose file is listed in 'files'")
    shape = m.get("sample_shape")
    need(isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape),
         "sample_shape", shape, "a list of positive integers")
    try:
        kind = np.dtype(m["dtype"]).kind if isinstance(m.get("dtype"), str) else None
    except (TypeError, ValueError):
        kind = None
    need(kind in ("b", "i", "u", "f"), "dtype", m.get("dtype"), "a numeric numpy dtype")
    for key in ("mean", "std"):
        v = m.get(key)
        need(isinstance(v, list) and bool(v) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)
                                                     and (key == "mean" or x > 0) for x in v),
             key, v, "a non-empty list of finite numbers" + (" > 0" if key == "std" else ""))


def _plain_name(fname: Any) -> bool:
    return (isinstance(fname, str) and fname not in ("", ".", "..") and "/" not in fname and "\\" not in fname
            and "\0" not in fname and fname == os.path.basename(fname))


def _shard_bytes(part_dir: Path, manifest: dict[str, Any], fname: str, verify: bool) -> bytes:
    """The bytes of shard `fname`: a plain name listed in the manifest's `files`, a regular file in
    the partition folder (a symbolic link only to one inside it), checked against its sha256."""
    path = part_dir / str(fname)
    if not _plain_name(fname) or fname not in manifest["files"]:
        raise _integrity(path, "not a file the manifest lists in 'files' (a shard path must be a plain file name "
                         "inside the partition folder)")
    if os.path.islink(path):
        root = os.path.realpath(part_dir)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise _integrity(path, f"a symbolic link to {os.path.realpath(path)}, outside the partition folder; refused")
    data = _read_regular(path)
    if verify:
        actual = hashlib.sha256(data).hexdigest()
        expected = manifest["files"][fname]
        if actual != expected:
            raise ShardChecksumError(f"{path}: sha256 {actual} does not match the manifest's {expected}; the shard is "
                                     "corrupted or was modified")
    return data


def verify_partition(part_dir: str | os.PathLike, manifest: dict[str, Any] | None = None) -> None:
    """Raise ShardChecksumError naming the first shard whose sha256 differs from the manifest
    (PartitionIntegrityError for an edited manifest or a shard path that is not one of the partition's files)."""
    part_dir = Path(part_dir)
    manifest = manifest or read_manifest(part_dir)
    for fname in manifest["files"]:
        _shard_bytes(part_dir, manifest, fname, verify=True)


def read_shard(part_dir: str | os.PathLike, manifest: dict[str, Any], fname: str, owner: int | str,
               verify: bool = True) -> ClientShard:
    """One shard's arrays, split by name, parsed from the very bytes whose sha256 was checked;
    the shard's own metadata must name `owner` and the manifest's partition (a shard moved to
    another client's slot, or from another partition, is refused)."""
    path = Path(part_dir) / str(fname)
    # ParquetFile, not read_table: the same table without importing pyarrow.dataset (0.2-0.4 s of a job's start)
    table = pq.ParquetFile(pa.BufferReader(_shard_bytes(Path(part_dir), manifest, fname, verify))).read()
    meta = table.schema.metadata or {}
    shape = tuple(manifest["sample_shape"])
    dtype = np.dtype(manifest["dtype"])
    stored = {"client_id": str(owner), "partition_id": manifest["partition_id"], "sample_shape": str(list(shape)),
              "dtype": dtype.str}
    for key, want in stored.items():
        got = meta.get(f"fedrepro.{key}".encode(), b"").decode(errors="replace")
        if got != want:
            raise _integrity(path, f"the shard's metadata says {key} {got!r}, but the manifest reads it as {want!r}: it "
                             f"holds another {'client' if key == 'client_id' else 'partition'}'s data; {REPARTITION}")
    xcol = table.column("x").combine_chunks()
    width = xcol.type.byte_width
    if width != int(np.prod(shape)) * dtype.itemsize:
        raise _integrity(path, f"samples of {width} bytes, not the {shape} {dtype} the manifest describes")
    buf = np.frombuffer(xcol.buffers()[1], dtype=np.uint8)[xcol.offset * width : (xcol.offset + len(xcol)) * width]
    x = buf.view(dtype).reshape((len(xcol),) + shape)
    y, split = _int_column(path, table, "label", np.int64), _int_column(path, table, "split", np.int8)
    xs, ys = {}, {}
    for code, name in enumerate(SPLITS + (UNLABELED,)):
        mask = split == code
        xs[name], ys[name] = x[mask], y[mask]
    return ClientShard(owner, xs, ys)


def _int_column(path: Path, table: pa.Table, name: str, dtype: type) -> np.ndarray:
    """Column `name` (non-null, of `dtype`) as a read-only numpy view of its buffer: pyarrow's
    to_numpy imports pandas (about 0.3 s of a training job's start)."""
    col = table.column(name).combine_chunks()
    if col.type != pa.from_numpy_dtype(dtype) or col.null_count:
        raise _integrity(path, f"column '{name}' is {col.type} with {col.null_count} nulls; allowed: non-null {np.dtype(dtype)}")
    return np.frombuffer(col.buffers()[1], dtype=dtype)[col.offset : col.offset + len(col)]


def read_client(part_dir: str | os.PathLike, manifest: dict[str, Any], cid: int, verify: bool = True) -> ClientShard:
    return read_shard(part_dir, manifest, manifest["clients"][cid]["file"], cid, verify)


def read_official_test(part_dir: str | os.PathLike, manifest: dict[str, Any], verify: bool = True) -> ClientShard | None:
    """The dataset's official test set, present when the partition did not pool it."""
    info = manifest.get("official_test")
    return read_shard(part_dir, manifest, info["file"], "official_test", verify) if info else None


def load_partition(part_dir: str | os.PathLike, verify: bool = True) -> tuple[dict[str, Any], list[ClientShard]]:
    """The checked manifest (its hash under `manifest_sha256`) and every client's shard, each
    checked against its sha256 as it is read; with `verify`, the other listed files too."""
    manifest, shards, _ = load_partition_with_official(part_dir, verify, official=False)
    return manifest, shards


def load_partition_with_official(part_dir: str | os.PathLike, verify: bool = True, official: bool = True
                                 ) -> tuple[dict[str, Any], list[ClientShard], ClientShard | None]:
    """load_partition, and with `official` the official test set (None where the partition has none),
    parsed from the bytes its check read: every file of the partition is read once."""
    manifest = read_manifest(part_dir)
    shards = [read_client(part_dir, manifest, c["id"], verify) for c in manifest["clients"]]
    test = read_official_test(part_dir, manifest, verify) if official else None
    if verify:
        read = {c["file"] for c in manifest["clients"]} | ({manifest["official_test"]["file"]} if test else set())
        for fname in set(manifest["files"]) - read:
            _shard_bytes(Path(part_dir), manifest, fname, verify=True)
    return manifest, shards, test
