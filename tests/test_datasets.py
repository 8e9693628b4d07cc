"""Dataset registry tests: offline, with tiny fixtures written in the real formats."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from fedrepro.data import datasets as ds
from fedrepro.data.base import DataMissingError
from fedrepro.data.datasets import DATASETS, DatasetSpec, load_dataset, prepare_dataset
from fedrepro.registry import ConfigError

FMNIST_NAMES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


# ----------------------------------------------------------------------- helpers


def idx_images(images: np.ndarray) -> bytes:
    """IDX3 (MNIST format): magic 0x00000803, big-endian N, 28, 28, then uint8 pixels."""
    n, h, w = images.shape
    return struct.pack(">IIII", 0x00000803, n, h, w) + images.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    """IDX1: magic 0x00000801, big-endian N, then uint8 labels."""
    return struct.pack(">II", 0x00000801, len(labels)) + labels.astype(np.uint8).tobytes()


def make_fmnist_arrays(n_train: int = 7, n_test: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train, dtype=np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test, dtype=np.uint8),
    )


def write_debian_dir(path: Path, tr_x, tr_y, te_x, te_y) -> Path:
    """Gzipped IDX files laid out as Debian's dataset-fashion-mnist installs them."""
    path.mkdir(parents=True, exist_ok=True)
    blobs = [idx_images(tr_x), idx_labels(tr_y), idx_images(te_x), idx_labels(te_y)]
    for name, blob in zip(FMNIST_NAMES, blobs):
        with gzip.open(path / f"{name}.gz", "wb") as fh:
            fh.write(blob)
    return path


@pytest.fixture
def fake_debian(tmp_path, monkeypatch):
    arrays = make_fmnist_arrays()
    deb = write_debian_dir(tmp_path / "debian", *arrays)
    monkeypatch.setenv(ds.DEBIAN_FMNIST_ENV, str(deb))
    return deb, arrays


@pytest.fixture
def no_download(monkeypatch):
    """Make torchvision's download fail as it does without network."""
    import torchvision

    calls = []

    def fail(self):
        calls.append(self.root)
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "download", fail)
    return calls


# ---------------------------------------------------------------------- registry


def test_registry_lists_datasets_with_specs():
    assert {"fmnist", "digits", "synthetic"} <= set(DATASETS.names())
    for name in ("fmnist", "digits", "synthetic"):
        entry = DATASETS.entry(name)
        assert isinstance(entry.obj, DatasetSpec)
        assert entry.obj.name == name
        assert entry.summary == entry.obj.summary and "\n" not in entry.summary
        assert entry.params == entry.obj.params
        assert entry.info["source"] == entry.obj.source
        assert entry.info["size"] == entry.obj.size


def test_unknown_dataset_lists_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_dataset("cifar1000", tmp_path)
    msg = str(err.value)
    assert "cifar1000" in msg and "fmnist" in msg and "digits" in msg and "synthetic" in msg


def test_unknown_param_rejected(tmp_path):
    with pytest.raises(ConfigError, match="bogus"):
        load_dataset("digits", tmp_path, {"bogus": 1})


# ------------------------------------------------------------------------ fmnist


def test_fmnist_prepare_from_debian_and_load(tmp_path, fake_debian, no_download):
    _, (tr_x, tr_y, te_x, te_y) = fake_debian
    root = tmp_path / "data"
    info = prepare_dataset("fmnist", root)

    raw_dir = root / "FashionMNIST" / "raw"
    for name in FMNIST_NAMES:
        assert (raw_dir / name).is_file()
    assert (raw_dir / "train-images-idx3-ubyte").read_bytes() == idx_images(tr_x)
    assert (raw_dir / "t10k-labels-idx1-ubyte").read_bytes() == idx_labels(te_y)
    assert not list(raw_dir.glob(".*tmp")), "temporary files left behind"
    assert no_download == [], "torchvision download must not be attempted"

    raw = load_dataset("fmnist", root)
    assert raw.x.dtype == np.uint8 and raw.x.shape == (10, 1, 28, 28)
    np.testing.assert_array_equal(raw.x[:7, 0], tr_x)
    np.testing.assert_array_equal(raw.x[7:, 0], te_x)
    np.testing.assert_array_equal(raw.y, np.concatenate([tr_y, te_y]).astype(np.int64))
    np.testing.assert_array_equal(raw.official_split, [0] * 7 + [1] * 3)
    assert raw.num_classes == 10 and raw.mean == (0.5,) and raw.std == (0.5,)

    assert info == {
        "dataset": "fmnist",
        "params": {},
        "fingerprint": raw.fingerprint(),
        "num_samples": 10,
        "num_classes": 10,
        "sample_shape": [1, 28, 28],
        "source": raw.source,
        "downloads": [],  # nothing fetched: Debian's files were used
    }
    assert load_dataset("fmnist", root).fingerprint() == raw.fingerprint()


def test_fmnist_prepare_is_idempotent(tmp_path, fake_debian, no_download):
    root = tmp_path / "data"
    prepare_dataset("fmnist", root)
    target = root / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    mtime = target.stat().st_mtime_ns
    # Remove the source: a second prepare must not need it.
    for f in fake_debian[0].iterdir():
        f.unlink()
    prepare_dataset("fmnist", root)
    assert target.stat().st_mtime_ns == mtime
    assert no_download == []


def test_fmnist_fingerprint_changes_with_a_pixel(tmp_path, fake_debian, monkeypatch):
    _, (tr_x, tr_y, te_x, te_y) = fake_debian
    first = prepare_dataset("fmnist", tmp_path / "a")["fingerprint"]

    changed = te_x.copy()
    changed[1, 5, 5] ^= 0xFF
    deb2 = write_debian_dir(tmp_path / "debian2", tr_x, tr_y, changed, te_y)
    monkeypatch.setenv(ds.DEBIAN_FMNIST_ENV, str(deb2))
    second = prepare_dataset("fmnist", tmp_path / "b")["fingerprint"]
    assert first != second


def test_fmnist_missing_without_debian_or_network(tmp_path, monkeypatch, no_download):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(ds.DEBIAN_FMNIST_ENV, str(empty))
    root = tmp_path / "data"
    with pytest.raises(DataMissingError) as err:
        prepare_dataset("fmnist", root)
    msg = str(err.value)
    for name in FMNIST_NAMES:
        assert name in msg
    assert str(root / "FashionMNIST" / "raw") in msg
    assert "dataset-fashion-mnist" in msg and "zalandoresearch/fashion-mnist" in msg
    assert no_download, "the torchvision download should have been tried"


def test_fmnist_load_without_files_raises_data_missing(tmp_path):
    with pytest.raises(DataMissingError) as err:
        load_dataset("fmnist", tmp_path)
    assert "train-images-idx3-ubyte" in str(err.value)


def test_fmnist_rejects_corrupt_debian_file(tmp_path, monkeypatch, no_download):
    deb = tmp_path / "debian"
    deb.mkdir()
    for name in FMNIST_NAMES:
        (deb / f"{name}.gz").write_bytes(b"not gzip at all")
    monkeypatch.setenv(ds.DEBIAN_FMNIST_ENV, str(deb))
    root = tmp_path / "data"
    with pytest.raises(DataMissingError, match="cannot decompress"):
        prepare_dataset("fmnist", root)
    raw_dir = root / "FashionMNIST" / "raw"
    assert not any(raw_dir.iterdir()), "no partial files may be left"


@pytest.mark.skipif(
    not all((ds.DEBIAN_FMNIST_DIR / f"{n}.gz").is_file() for n in FMNIST_NAMES),
    reason=f"real Fashion-MNIST not installed in {ds.DEBIAN_FMNIST_DIR} (apt-get install dataset-fashion-mnist)",
)
def test_fmnist_real_debian_files(tmp_path, monkeypatch, no_download):
    monkeypatch.delenv(ds.DEBIAN_FMNIST_ENV, raising=False)
    info = prepare_dataset("fmnist", tmp_path)
    assert info["num_samples"] == 70_000 and info["num_classes"] == 10
    raw = load_dataset("fmnist", tmp_path)
    assert raw.x.shape == (70_000, 1, 28, 28)
    assert (raw.official_split == 0).sum() == 60_000
    assert set(np.unique(raw.y)) == set(range(10))


# ------------------------------------------------------------------------ digits


def test_digits(tmp_path):
    info = prepare_dataset("digits", tmp_path)
    raw = load_dataset("digits", tmp_path)
    assert raw.x.shape == (1797, 1, 8, 8) and raw.x.dtype == np.uint8
    assert raw.x.min() == 0 and raw.x.max() == 255  # 16 maps to 255
    assert raw.num_classes == 10 and set(np.unique(raw.y)) == set(range(10))
    assert (raw.official_split == 0).all()
    assert raw.mean[0] == pytest.approx((raw.x / 255).mean())
    assert raw.std[0] == pytest.approx((raw.x / 255).std())
    assert info["num_samples"] == 1797 and info["sample_shape"] == [1, 8, 8]
    assert info["fingerprint"] == raw.fingerprint()
    assert not any(tmp_path.iterdir()), "digits must write nothing"


# --------------------------------------------------------------------- synthetic


def small(**kw):
    return {"num_users": 5, "max_samples_per_user": 300, **kw}


def test_synthetic_deterministic_by_seed(tmp_path):
    a = load_dataset("synthetic", tmp_path, small(seed=3))
    b = load_dataset("synthetic", tmp_path, small(seed=3))
    c = load_dataset("synthetic", tmp_path, small(seed=4))
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    np.testing.assert_array_equal(a.groups["user"], b.groups["user"])
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_synthetic_shapes_groups_and_labels(tmp_path):
    raw = load_dataset("synthetic", tmp_path, small(seed=1))
    n = len(raw.y)
    assert raw.x.shape == (n, 60) and raw.x.dtype == np.float32
    assert raw.y.dtype == np.int64 and raw.y.min() >= 0 and raw.y.max() < 10
    assert raw.num_classes == 10 and (raw.official_split == 0).all()
    assert raw.mean == (0.0,) and raw.std == (1.0,)
    users = raw.groups["user"]
    assert users.shape == (n,) and np.all(np.diff(users) >= 0)  # users are contiguous
    # Per-user counts are the script's lognormal(4, 2) + 50 draw, capped.
    rng = np.random.RandomState(1)
    expected = np.minimum(rng.lognormal(4, 2, 5).astype(int) + 50, 300)
    np.testing.assert_array_equal(np.bincount(users, minlength=5), expected)


def test_synthetic_default_matches_uncapped_script_counts(tmp_path):
    raw = load_dataset("synthetic", tmp_path, {"num_users": 3, "seed": 7})
    expected = np.random.RandomState(7).lognormal(4, 2, 3).astype(int) + 50
    np.testing.assert_array_equal(np.bincount(raw.groups["user"]), expected)


def test_synthetic_iid_differs_from_non_iid(tmp_path):
    niid = load_dataset("synthetic", tmp_path, small(seed=2))
    iid = load_dataset("synthetic", tmp_path, small(seed=2, iid=True))
    assert niid.x.shape == iid.x.shape  # same lognormal draw comes first
    assert not np.array_equal(niid.x, iid.x)


def test_synthetic_param_validation(tmp_path):
    with pytest.raises(ConfigError, match="alpha"):
        load_dataset("synthetic", tmp_path, {"alpha": -1})
    with pytest.raises(ConfigError, match="num_users"):
        load_dataset("synthetic", tmp_path, {"num_users": 0})
    with pytest.raises(ConfigError, match="iid"):
        load_dataset("synthetic", tmp_path, {"iid": "yes"})
    with pytest.raises(ConfigError, match="max_samples_per_user"):
        load_dataset("synthetic", tmp_path, {"max_samples_per_user": 0})


def test_synthetic_prepare_info(tmp_path):
    params = small(seed=5)
    info = prepare_dataset("synthetic", tmp_path, params)
    assert info["params"] == {"alpha": 1.0, "beta": 1.0, "iid": False, "seed": 5, **params}
    assert info["sample_shape"] == [60] and info["num_classes"] == 10
    assert info["fingerprint"] == load_dataset("synthetic", tmp_path, params).fingerprint()
    assert not any(tmp_path.iterdir())


def reference_fedprox(alpha, beta, iid, num_users, r):
    """FedProx data/synthetic_0_0/generate_synthetic.py, transcribed with `r` for np.random."""
    dimension, NUM_CLASS = 60, 10
    samples_per_user = r.lognormal(4, 2, (num_users)).astype(int) + 50
    mean_W = r.normal(0, alpha, num_users)
    mean_b = mean_W
    B = r.normal(0, beta, num_users)
    mean_x = np.zeros((num_users, dimension))
    diagonal = np.zeros(dimension)
    for j in range(dimension):
        diagonal[j] = np.power((j + 1), -1.2)
    cov_x = np.diag(diagonal)
    for i in range(num_users):
        if iid == 1:
            mean_x[i] = np.ones(dimension) * B[i]
        else:
            mean_x[i] = r.normal(B[i], 1, dimension)
    if iid == 1:
        W_global = r.normal(0, 1, (dimension, NUM_CLASS))
        b_global = r.normal(0, 1, NUM_CLASS)
    X, Y = [], []
    for i in range(num_users):
        W = r.normal(mean_W[i], 1, (dimension, NUM_CLASS))
        b = r.normal(mean_b[i], 1, NUM_CLASS)
        if iid == 1:
            W, b = W_global, b_global
        xx = r.multivariate_normal(mean_x[i], cov_x, samples_per_user[i])
        for j in range(samples_per_user[i]):
            tmp = np.dot(xx[j], W) + b
            Y.append(np.argmax(np.exp(tmp) / np.sum(np.exp(tmp))))
        X.append(xx)
    return np.concatenate(X), np.array(Y)


@pytest.mark.parametrize("iid", [False, True])
def test_synthetic_matches_fedprox_script(tmp_path, iid):
    params = {"alpha": 0.5, "beta": 0.5, "num_users": 4, "seed": 11, "iid": iid}
    raw = load_dataset("synthetic", tmp_path, params)
    x_ref, y_ref = reference_fedprox(0.5, 0.5, int(iid), 4, np.random.RandomState(11))
    np.testing.assert_array_equal(raw.x, x_ref.astype(np.float32))
    np.testing.assert_array_equal(raw.y, y_ref)
