"""Parquet shard tests: round trip, manifest, partition ids, checksums and atomic writes."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from fedrepro.data import shards
from fedrepro.data.base import RawDataset
from conftest import random_images
from fedrepro.data.shards import (
    MANIFEST,
    SPLITS,
    ShardChecksumError,
    load_partition,
    make_partition,
    partition_id,
    resolve_partition_spec,
    verify_partition,
    write_partition,
)

NUM_CLASSES = 10


def make_images(n: int = 600, seed: int = 0) -> RawDataset:
    return random_images(n, NUM_CLASSES, seed)


def make_features(n: int = 300, seed: int = 1) -> RawDataset:
    g = np.random.default_rng(seed)
    return RawDataset(
        name="synthetic_features",
        x=g.standard_normal((n, 60)).astype(np.float32),
        y=g.integers(0, NUM_CLASSES, n),
        num_classes=NUM_CLASSES,
        official_split=np.zeros(n, np.int8),
        mean=(0.0,),
        std=(1.0,),
        source="generated in the test",
    )


SPEC = {
    "dataset": "synthetic_images",
    "partitioner": "dirichlet",
    "params": {"alpha": 0.5, "min_partition_size": 10},
    "num_clients": 5,
    "seed": 3,
    "split": {"test_fraction": 0.25, "val_fraction": 0.1, "stratify": True},
}


@pytest.fixture(scope="module")
def raw() -> RawDataset:
    return make_images()


@pytest.fixture(scope="module")
def written(raw, tmp_path_factory):
    out = tmp_path_factory.mktemp("parts") / "any_name_i_like"
    manifest = write_partition(raw, SPEC, out)
    return out, manifest


# ----------------------------------------------------------------------- round trip


def check_round_trip(raw: RawDataset, spec: dict, part_dir: Path) -> None:
    manifest, clients = load_partition(part_dir)
    expected = make_partition(raw, spec)
    assert len(clients) == len(expected) == spec["num_clients"]
    for shard, splits in zip(clients, expected):
        for s in SPLITS:
            idx = np.asarray(splits[s], dtype=np.int64)
            # Rows come back in the order they were assigned; compare as sets of rows via the index order.
            assert shard.x[s].dtype == raw.x.dtype
            assert shard.x[s].shape == (len(idx),) + raw.sample_shape
            assert shard.y[s].shape == (len(idx),)
            assert np.array_equal(shard.x[s], raw.x[idx]), f"client {shard.id} split {s}: x differs from the source rows"
            assert np.array_equal(shard.y[s], raw.y[idx]), f"client {shard.id} split {s}: y differs from the source rows"


def test_round_trip_uint8_images(raw, written):
    out, _ = written
    check_round_trip(raw, SPEC, out)


def test_round_trip_float32_features(tmp_path):
    raw = make_features()
    spec = {"dataset": "synthetic_features", "partitioner": "iid", "num_clients": 4, "seed": 0,
            "split": {"test_fraction": 0.2, "stratify": False}}
    write_partition(raw, spec, tmp_path / "feat")
    check_round_trip(raw, spec, tmp_path / "feat")
    _, clients = load_partition(tmp_path / "feat")
    assert clients[0].x["train"].dtype == np.float32 and clients[0].x["train"].shape[1:] == (60,)


def test_parquet_index_column_names_source_rows(raw, written):
    out, manifest = written
    expected = make_partition(raw, SPEC)
    table = pq.read_table(out / manifest["clients"][2]["file"])
    index = table.column("index").to_numpy()
    split = table.column("split").to_numpy()
    for code, s in enumerate(SPLITS):
        assert np.array_equal(index[split == code], expected[2][s])
    assert np.array_equal(table.column("label").to_numpy(), raw.y[index])


# ----------------------------------------------------------------------- manifest


def test_manifest_contents(raw, written):
    out, manifest = written
    on_disk = json.loads((out / MANIFEST).read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    resolved = resolve_partition_spec(SPEC)
    assert on_disk["partition_id"] == partition_id(SPEC)
    assert on_disk["params"] == resolved["params"] == {**resolved["params"], "alpha": 0.5, "min_partition_size": 10}
    assert on_disk["seed"] == 3
    assert on_disk["num_clients"] == 5
    assert on_disk["source_fingerprint"] == raw.fingerprint()
    assert on_disk["spec"]["split"] == {"test_fraction": 0.25, "val_fraction": 0.1, "stratify": True}
    assert on_disk["sample_shape"] == [1, 4, 4]
    assert np.dtype(on_disk["dtype"]) == np.uint8
    _, clients = load_partition(out)
    assert len(on_disk["clients"]) == len(clients) == 5
    for info, shard in zip(on_disk["clients"], clients):
        for s in SPLITS:
            assert info["sizes"][s] == len(shard.y[s])
            assert info["class_counts"][s] == np.bincount(shard.y[s], minlength=NUM_CLASSES).tolist()
    files = sorted(p.name for p in out.iterdir() if p.name != MANIFEST)
    assert files == sorted(on_disk["files"]) == sorted(c["file"] for c in on_disk["clients"])
    for fname, digest in on_disk["files"].items():
        assert digest == hashlib.sha256((out / fname).read_bytes()).hexdigest()


def test_output_directory_name_is_free(raw, written):
    out, manifest = written
    assert out.name == "any_name_i_like"
    assert manifest["partition_id"] == partition_id(SPEC)
    assert partition_id(SPEC) not in out.name


def test_fingerprint_depends_on_data(raw):
    other = copy.deepcopy(raw)
    other.x[0, 0, 0, 0] ^= 1
    assert other.fingerprint() != raw.fingerprint()


# ----------------------------------------------------------------------- partition id


def _with(path: str, value):
    spec = copy.deepcopy(SPEC)
    node = spec
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return spec


@pytest.mark.parametrize(
    "path,value",
    [
        ("params.alpha", 0.1),
        ("params.min_partition_size", 11),
        ("params.self_balancing", True),
        ("seed", 4),
        ("num_clients", 6),
        ("split.test_fraction", 0.2),
        ("split.val_fraction", 0.0),
        ("split.stratify", False),
        ("pool", False),
        ("dataset", "other"),
        ("dataset_params", {"seed": 1}),
        ("partitioner", "iid"),
    ],
    ids=lambda v: str(v),
)
def test_partition_id_changes_with_every_field(path, value):
    changed = _with(path, value)
    if path == "partitioner":
        changed.pop("params")
    assert partition_id(changed) != partition_id(SPEC)


def test_partition_id_stable_otherwise():
    pid = partition_id(SPEC)
    assert pid == partition_id(copy.deepcopy(SPEC))
    assert pid == partition_id(dict(reversed(list(SPEC.items()))))
    # Spelling out the defaults does not change the id.
    explicit = _with("params.self_balancing", False)
    explicit["params"]["max_retries"] = 1000
    explicit["pool"] = True
    assert partition_id(explicit) == pid
    assert partition_id(resolve_partition_spec(SPEC)) == pid
    assert isinstance(pid, str) and len(pid) >= 8


# ----------------------------------------------------------------------- checksums


@pytest.fixture
def fresh(raw, tmp_path):
    out = tmp_path / "part"
    manifest = write_partition(raw, SPEC, out)
    return out, manifest


def test_verify_passes_on_untouched_partition(fresh):
    out, manifest = fresh
    verify_partition(out)
    verify_partition(out, manifest)


def test_flipped_byte_is_refused_naming_the_file(fresh):
    out, manifest = fresh
    victim = manifest["clients"][3]["file"]
    path = out / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardChecksumError) as exc:
        load_partition(out)
    assert victim in str(exc.value)
    # The other shards are fine: only the modified one is named.
    others = [c["file"] for c in manifest["clients"] if c["file"] != victim]
    assert not any(o in str(exc.value) for o in others)


def test_deleted_shard_is_refused_naming_the_file(fresh):
    out, manifest = fresh
    victim = manifest["clients"][1]["file"]
    (out / victim).unlink()
    with pytest.raises(ShardChecksumError) as exc:
        load_partition(out)
    assert victim in str(exc.value)


def test_missing_manifest_is_reported(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="manifest"):
        load_partition(tmp_path / "empty")


# ----------------------------------------------------------------------- atomicity


def _fail_on_third_call(monkeypatch):
    real = pq.write_table
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(pq, "write_table", flaky)
    return calls


def test_failed_write_leaves_nothing(raw, tmp_path, monkeypatch):
    parent = tmp_path / "shards"
    out = parent / "p1"
    calls = _fail_on_third_call(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        write_partition(raw, SPEC, out)
    assert calls["n"] == 3
    assert not out.exists()
    assert list(parent.iterdir()) == [], f"left behind: {[p.name for p in parent.iterdir()]}"


def test_existing_partition_replaced_only_on_success(raw, tmp_path, monkeypatch):
    parent = tmp_path / "shards"
    out = parent / "p1"
    first = write_partition(raw, SPEC, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    other_spec = _with("seed", 9)
    with monkeypatch.context() as m:
        _fail_on_third_call(m)
        with pytest.raises(OSError, match="simulated"):
            write_partition(raw, other_spec, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "a failed write changed the existing partition"
    assert [p.name for p in parent.iterdir()] == ["p1"]
    verify_partition(out)

    second = write_partition(raw, other_spec, out)
    assert second["partition_id"] != first["partition_id"]
    manifest, _ = load_partition(out)
    assert manifest["partition_id"] == partition_id(other_spec)
    assert manifest["seed"] == 9
    assert [p.name for p in parent.iterdir()] == ["p1"]
    check_round_trip(raw, other_spec, out)


def test_shards_module_writes_through_pyarrow_parquet():
    """The atomicity tests patch pyarrow.parquet.write_table; make sure that is what is used."""
    assert shards.pq is pq


def test_partition_seed_out_of_randomstate_range_is_a_config_error(raw):
    spec = {**SPEC, "seed": 2**32}
    with pytest.raises(shards.ConfigError, match="seed"):
        resolve_partition_spec(spec)
        make_partition(raw, spec)
