"""torchvision image datasets (fedrepro.data.vision): offline, with tiny fixtures in the real on-disk formats.

Every fixture is generated here, in tmp_path, laid out as torchvision expects it:
IDX files (MNIST, EMNIST), CIFAR python pickle batches with their meta file, STL-10
binary files, SVHN .mat files and USPS bz2 LIBSVM text.

MD5: torchvision's download=False path checks the MD5 of the CIFAR-10/100 batch and
meta files, of all five STL-10 .bin files and of the SVHN .mat files against the
official releases, which a generated fixture cannot match. For those three classes
the tests replace the class's checksum lists with the MD5s of the fixture files
(`patch_md5`), so the integrity check still runs (a modified file is rejected).
MNIST, EMNIST and USPS do no checksum on the download=False path: nothing is patched.
"""

from __future__ import annotations

import bz2
import hashlib
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import fedrepro.data.vision as vision  # registers the datasets
from fedrepro.data.base import DataMissingError
from fedrepro.data.datasets import DATASETS, DatasetSpec, load_dataset, prepare_dataset
from fedrepro.registry import ConfigError

NAMES = ["mnist", "emnist", "cifar10", "cifar100", "stl10", "svhn", "usps"]

# ----------------------------------------------------------------------- writers
#
# Each writer puts a tiny copy of the dataset under `root` and returns the rows the
# loader must produce: (x uint8 CHW, y int64, official_split int8), train rows first.


def idx_images(images: np.ndarray) -> bytes:
    n, h, w = images.shape
    return struct.pack(">IIII", 0x00000803, n, h, w) + images.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">II", 0x00000801, len(labels)) + labels.astype(np.uint8).tobytes()


def _expected(x_tr, y_tr, x_te, y_te):
    return (
        np.concatenate([x_tr, x_te]),
        np.concatenate([y_tr, y_te]).astype(np.int64),
        np.array([0] * len(y_tr) + [1] * len(y_te), dtype=np.int8),
    )


def write_mnist(root: Path, rng, n_tr=5, n_te=3):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    x_tr, x_te = rng.integers(0, 256, (n_tr, 28, 28), dtype=np.uint8), rng.integers(0, 256, (n_te, 28, 28), dtype=np.uint8)
    y_tr, y_te = rng.integers(0, 10, n_tr), rng.integers(0, 10, n_te)
    (raw / "train-images-idx3-ubyte").write_bytes(idx_images(x_tr))
    (raw / "train-labels-idx1-ubyte").write_bytes(idx_labels(y_tr))
    (raw / "t10k-images-idx3-ubyte").write_bytes(idx_images(x_te))
    (raw / "t10k-labels-idx1-ubyte").write_bytes(idx_labels(y_te))
    return _expected(x_tr[:, None], y_tr, x_te[:, None], y_te)


def write_emnist(root: Path, rng, split="balanced", upright=True, n_tr=6, n_te=4):
    """EMNIST's raw IDX files (as torchvision leaves them after unzipping gzip.zip and gunzipping)."""
    raw = root / "EMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    lo, hi = (1, 27) if split == "letters" else (0, vision.EMNIST_NUM_CLASSES[split])
    # Non-symmetric stored images, so a missing or extra transpose shows.
    x_tr, x_te = rng.integers(0, 256, (n_tr, 28, 28), dtype=np.uint8), rng.integers(0, 256, (n_te, 28, 28), dtype=np.uint8)
    y_tr, y_te = rng.integers(lo, hi, n_tr), rng.integers(lo, hi, n_te)
    for part, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        (raw / f"emnist-{split}-{part}-images-idx3-ubyte").write_bytes(idx_images(x))
        (raw / f"emnist-{split}-{part}-labels-idx1-ubyte").write_bytes(idx_labels(y))
    shift = 1 if split == "letters" else 0
    orient = (lambda a: a.transpose(0, 2, 1)) if upright else (lambda a: a)
    return _expected(orient(x_tr)[:, None], y_tr - shift, orient(x_te)[:, None], y_te - shift)


def _cifar_batch(path: Path, images: np.ndarray, labels: np.ndarray, label_key: str, extra: dict | None = None):
    """A CIFAR python batch: dict with 'data' (N, 3072) uint8 rows = R, G, B planes, each row-major."""
    entry = {
        "batch_label": path.name,
        label_key: [int(v) for v in labels],
        "data": images.reshape(len(images), 3 * 32 * 32),
        "filenames": [f"img_{i}.png" for i in range(len(images))],
        **(extra or {}),
    }
    with open(path, "wb") as fh:
        pickle.dump(entry, fh, protocol=2)


def write_cifar10(root: Path, rng, per_batch=2, n_te=3):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    for i in range(1, 6):
        x = rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, per_batch)
        _cifar_batch(folder / f"data_batch_{i}", x, y, "labels")
        xs.append(x)
        ys.append(y)
    x_te, y_te = rng.integers(0, 256, (n_te, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, n_te)
    _cifar_batch(folder / "test_batch", x_te, y_te, "labels")
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": per_batch, "num_vis": 3072}, fh, protocol=2)
    return _expected(np.concatenate(xs), np.concatenate(ys), x_te, y_te)


def write_cifar100(root: Path, rng, n_tr=7, n_te=3):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    x_tr, x_te = rng.integers(0, 256, (n_tr, 3, 32, 32), dtype=np.uint8), rng.integers(0, 256, (n_te, 3, 32, 32), dtype=np.uint8)
    y_tr, y_te = rng.integers(0, 100, n_tr), rng.integers(0, 100, n_te)
    y_tr[0] = 99  # the top label is kept
    _cifar_batch(folder / "train", x_tr, y_tr, "fine_labels", {"coarse_labels": [int(v) // 5 for v in y_tr]})
    _cifar_batch(folder / "test", x_te, y_te, "fine_labels", {"coarse_labels": [int(v) // 5 for v in y_te]})
    with open(folder / "meta", "wb") as fh:
        pickle.dump({"fine_label_names": [f"f{i}" for i in range(100)], "coarse_label_names": [f"c{i}" for i in range(20)]}, fh, protocol=2)
    return _expected(x_tr, y_tr, x_te, y_te)


def _stl_images(path: Path, images: np.ndarray):
    """STL-10 binary: uint8, per image 3 channels of 96x96 in column-major order."""
    path.write_bytes(np.ascontiguousarray(images.transpose(0, 1, 3, 2)).tobytes())


def write_stl10(root: Path, rng, n_tr=3, n_te=2, n_unl=2):
    folder = root / "stl10_binary"
    folder.mkdir(parents=True, exist_ok=True)
    x_tr, x_te = rng.integers(0, 256, (n_tr, 3, 96, 96), dtype=np.uint8), rng.integers(0, 256, (n_te, 3, 96, 96), dtype=np.uint8)
    y_tr, y_te = rng.integers(0, 10, n_tr), rng.integers(0, 10, n_te)
    _stl_images(folder / "train_X.bin", x_tr)
    (folder / "train_y.bin").write_bytes((y_tr + 1).astype(np.uint8).tobytes())  # file labels are 1..10
    _stl_images(folder / "test_X.bin", x_te)
    (folder / "test_y.bin").write_bytes((y_te + 1).astype(np.uint8).tobytes())
    unl = rng.integers(0, 256, (n_unl, 3, 96, 96), dtype=np.uint8)
    _stl_images(folder / "unlabeled_X.bin", unl)
    (folder / "class_names.txt").write_text("\n".join(f"c{i}" for i in range(10)) + "\n")
    write_stl10.unlabeled = unl
    return _expected(x_tr, y_tr, x_te, y_te)


def _svhn_mat(path: Path, images: np.ndarray, digits: np.ndarray):
    """SVHN .mat: X is (32, 32, 3, N) uint8, y is (N, 1) with 10 for the digit 0."""
    from scipy.io import savemat

    y = np.where(digits == 0, 10, digits).astype(np.uint8)[:, None]
    savemat(path, {"X": images.transpose(2, 3, 1, 0), "y": y})


def write_svhn(root: Path, rng, n_tr=5, n_te=3, n_extra=0):
    root.mkdir(parents=True, exist_ok=True)
    x_tr, x_te = rng.integers(0, 256, (n_tr, 3, 32, 32), dtype=np.uint8), rng.integers(0, 256, (n_te, 3, 32, 32), dtype=np.uint8)
    y_tr, y_te = rng.integers(0, 10, n_tr), rng.integers(0, 10, n_te)
    y_tr[0], y_te[0] = 0, 0  # the digit 0 is stored as 10
    _svhn_mat(root / "train_32x32.mat", x_tr, y_tr)
    _svhn_mat(root / "test_32x32.mat", x_te, y_te)
    if n_extra:
        x_ex, y_ex = rng.integers(0, 256, (n_extra, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, n_extra)
        _svhn_mat(root / "extra_32x32.mat", x_ex, y_ex)
        return _expected(np.concatenate([x_tr, x_ex]), np.concatenate([y_tr, y_ex]), x_te, y_te)
    return _expected(x_tr, y_tr, x_te, y_te)


# USPS file values in [-1, 1] and the uint8 torchvision makes of them: int((v + 1) / 2 * 255).
USPS_VALUES = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])
USPS_PIXELS = np.array([0, 63, 127, 191, 255], dtype=np.uint8)


def _usps_file(path: Path, codes: np.ndarray, labels: np.ndarray):
    """LIBSVM text, bz2: '<label 1..10> 1:v1 2:v2 ... 256:v256' per line."""
    lines = []
    for img, lab in zip(codes.reshape(len(codes), -1), labels):
        feats = " ".join(f"{j + 1}:{USPS_VALUES[c]:g}" for j, c in enumerate(img))
        lines.append(f"{int(lab) + 1} {feats}\n")
    with bz2.open(path, "wt") as fh:
        fh.writelines(lines)


def write_usps(root: Path, rng, n_tr=5, n_te=3):
    root.mkdir(parents=True, exist_ok=True)
    c_tr, c_te = rng.integers(0, 5, (n_tr, 16, 16)), rng.integers(0, 5, (n_te, 16, 16))
    y_tr, y_te = rng.integers(0, 10, n_tr), rng.integers(0, 10, n_te)
    _usps_file(root / "usps.bz2", c_tr, y_tr)
    _usps_file(root / "usps.t.bz2", c_te, y_te)
    return _expected(USPS_PIXELS[c_tr][:, None], y_tr, USPS_PIXELS[c_te][:, None], y_te)


WRITERS = {
    "mnist": write_mnist,
    "emnist": write_emnist,
    "cifar10": write_cifar10,
    "cifar100": write_cifar100,
    "stl10": write_stl10,
    "svhn": write_svhn,
    "usps": write_usps,
}

SHAPES = {
    "mnist": (1, 28, 28), "emnist": (1, 28, 28), "cifar10": (3, 32, 32), "cifar100": (3, 32, 32),
    "stl10": (3, 96, 96), "svhn": (3, 32, 32), "usps": (1, 16, 16),
}
CLASSES = {"mnist": 10, "emnist": 47, "cifar10": 10, "cifar100": 100, "stl10": 10, "svhn": 10, "usps": 10}


# ---------------------------------------------------------------------- MD5 patch


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def patch_md5(monkeypatch, name: str, root: Path) -> None:
    """Point torchvision's checksum lists at the fixture files (CIFAR, STL-10, SVHN only; see module doc)."""
    import torchvision.datasets as tvd

    if name in ("cifar10", "cifar100", "stl10"):
        cls = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "stl10": tvd.STL10}[name]
        folder = root / cls.base_folder
        for attr in ("train_list", "test_list"):
            monkeypatch.setattr(cls, attr, [[f, md5(folder / f)] for f, _ in getattr(cls, attr)])
        if name != "stl10":
            monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5(folder / cls.meta["filename"])})
    elif name == "svhn":
        patched = {s: [url, f, md5(root / f) if (root / f).is_file() else h] for s, (url, f, h) in tvd.SVHN.split_list.items()}
        monkeypatch.setattr(tvd.SVHN, "split_list", patched)


def make(name: str, root: Path, monkeypatch, seed: int = 0, **kw):
    expected = WRITERS[name](root, np.random.default_rng(seed), **kw)
    patch_md5(monkeypatch, name, root)
    return expected


# -------------------------------------------------------------------- no network


def _tv_classes():
    import torchvision.datasets as tvd

    return [tvd.MNIST, tvd.EMNIST, tvd.CIFAR10, tvd.CIFAR100, tvd.STL10, tvd.SVHN]


@pytest.fixture
def no_network(monkeypatch):
    """Every torchvision download of these classes fails as it does offline; records the attempts."""
    import torchvision.datasets.usps as usps_mod

    calls = []

    def fail(self, *a, **k):
        calls.append(type(self).__name__)
        raise OSError("network unreachable (test)")

    for cls in _tv_classes():
        monkeypatch.setattr(cls, "download", fail)

    def fail_url(url, *a, **k):
        calls.append("USPS")
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(usps_mod, "download_url", fail_url)
    return calls


@pytest.fixture
def fake_download(monkeypatch, tmp_path):
    """fake_download(name) -> calls: the download (torchvision's path) copies a fixture "mirror" into root."""
    import torchvision.datasets.usps as usps_mod

    calls = []

    def install(name: str, **kw):
        mirror = tmp_path / f"mirror_{name}"
        expected = make(name, mirror, monkeypatch, **kw)

        def copy(self, *a, **k):
            calls.append(type(self).__name__)
            shutil.copytree(mirror, self.root, dirs_exist_ok=True)

        def copy_url(url, root, *a, **k):
            calls.append("USPS")
            shutil.copytree(mirror, root, dirs_exist_ok=True)

        for cls in _tv_classes():
            monkeypatch.setattr(cls, "download", copy)
        monkeypatch.setattr(usps_mod, "download_url", copy_url)
        return expected, calls

    return install


# ---------------------------------------------------------------------- registry


def test_registered_with_specs():
    assert set(NAMES) <= set(DATASETS.names())
    for name in NAMES:
        entry = DATASETS.entry(name)
        spec = entry.obj
        assert isinstance(spec, DatasetSpec) and spec.name == name
        assert entry.summary == spec.summary and "\n" not in spec.summary
        assert entry.info["source"] == spec.source and spec.source.startswith("http")
        assert f"torchvision.datasets.{vision.SOURCES[name].tv_class}" in spec.source
        assert entry.info["size"] == spec.size and spec.size
        assert spec.sample_shape == SHAPES[name] and spec.num_classes == CLASSES[name]
        assert entry.params == spec.params
    assert set(DATASETS.entry("emnist").params) == {"split", "upright"}
    assert DATASETS.entry("emnist").params["split"].default == "balanced"
    assert set(DATASETS.entry("emnist").params["split"].choices) == set(vision.EMNIST_SPLITS)
    assert set(DATASETS.entry("svhn").params) == {"include_extra"}


def test_param_validation(tmp_path):
    with pytest.raises(ConfigError, match="split"):
        load_dataset("emnist", tmp_path, {"split": "bogus"})
    with pytest.raises(ConfigError, match="upright"):
        load_dataset("emnist", tmp_path, {"upright": "yes"})
    with pytest.raises(ConfigError, match="include_unlabeled"):
        load_dataset("stl10", tmp_path, {"include_unlabeled": True})


# ------------------------------------------------------------------------- loads


@pytest.mark.parametrize("name", NAMES)
def test_load_round_trip(name, tmp_path, monkeypatch, no_network):
    x, y, split = make(name, tmp_path, monkeypatch)
    raw = load_dataset(name, tmp_path)
    assert raw.name == name
    assert raw.x.dtype == np.uint8 and raw.x.shape == (len(y), *SHAPES[name])
    assert raw.x.flags.c_contiguous
    assert raw.sample_shape == SHAPES[name]
    np.testing.assert_array_equal(raw.x, x)  # every pixel, in CHW layout
    assert raw.y.dtype == np.int64
    np.testing.assert_array_equal(raw.y, y)
    assert raw.y.min() >= 0 and raw.y.max() < raw.num_classes == CLASSES[name]
    assert raw.official_split.dtype == np.int8
    np.testing.assert_array_equal(raw.official_split, split)
    c = SHAPES[name][0]
    assert len(raw.mean) == len(raw.std) == c and all(s > 0 for s in raw.std)
    assert raw.source == DATASETS.get(name).source and raw.groups == {}
    assert load_dataset(name, tmp_path).fingerprint() == raw.fingerprint()
    assert no_network == [], "load must never download"


@pytest.mark.parametrize(
    "name, mean, std",
    [
        ("mnist", (0.1307,), (0.3081,)),
        ("emnist", (0.175,), (0.333,)),
        ("cifar10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
        ("cifar100", (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
        ("stl10", (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)),
        ("svhn", (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    ],
)
def test_published_normalisation(name, mean, std, tmp_path, monkeypatch):
    make(name, tmp_path, monkeypatch)
    raw = load_dataset(name, tmp_path)
    assert raw.mean == mean and raw.std == std


def test_usps_normalisation_computed_from_train(tmp_path, monkeypatch):
    make("usps", tmp_path, monkeypatch)
    raw = load_dataset("usps", tmp_path)
    train = raw.x[raw.official_split == 0] / 255.0
    assert raw.mean[0] == pytest.approx(train.mean()) and raw.std[0] == pytest.approx(train.std())


def test_prepare_info_and_fingerprint_change(tmp_path, monkeypatch, no_network):
    make("cifar10", tmp_path / "a", monkeypatch, seed=1)
    info = prepare_dataset("cifar10", tmp_path / "a")
    raw = load_dataset("cifar10", tmp_path / "a")
    assert info == {
        "dataset": "cifar10", "params": {}, "fingerprint": raw.fingerprint(), "num_samples": 13,
        "num_classes": 10, "sample_shape": [3, 32, 32], "source": raw.source, "downloads": [],
    }
    make("cifar10", tmp_path / "b", monkeypatch, seed=2)
    assert prepare_dataset("cifar10", tmp_path / "b")["fingerprint"] != info["fingerprint"]
    assert no_network == []


# ------------------------------------------------------------------- EMNIST notes


def test_emnist_upright_transposes_torchvision_images(tmp_path, monkeypatch):
    x, _, _ = make("emnist", tmp_path, monkeypatch, upright=True)
    up = load_dataset("emnist", tmp_path)
    raw = load_dataset("emnist", tmp_path, {"upright": False})
    np.testing.assert_array_equal(up.x, x)
    np.testing.assert_array_equal(raw.x, x.transpose(0, 1, 3, 2))  # torchvision's orientation: the IDX as stored
    import torchvision

    tv = torchvision.datasets.EMNIST(str(tmp_path), split="balanced", train=True, download=False)
    np.testing.assert_array_equal(up.x[0, 0], tv.data[0].numpy().T)
    assert up.x.flags.c_contiguous and up.fingerprint() != raw.fingerprint()


@pytest.mark.parametrize("split", ["letters", "byclass", "digits"])
def test_emnist_splits(split, tmp_path, monkeypatch):
    x, y, official = make("emnist", tmp_path, monkeypatch, split=split)
    raw = load_dataset("emnist", tmp_path, {"split": split})
    assert raw.num_classes == vision.EMNIST_NUM_CLASSES[split]
    np.testing.assert_array_equal(raw.x, x)
    np.testing.assert_array_equal(raw.y, y)  # letters: 1..26 in the file -> 0..25
    assert raw.y.min() >= 0 and raw.y.max() < raw.num_classes
    assert raw.mean == (vision.EMNIST_STATS[split][0],)
    # Only the requested split's files are needed.
    with pytest.raises(DataMissingError, match="emnist-balanced-train-images-idx3-ubyte"):
        load_dataset("emnist", tmp_path)


# ---------------------------------------------------------------- STL-10 and SVHN


def test_stl10_unlabeled_accessor(tmp_path, monkeypatch):
    make("stl10", tmp_path, monkeypatch)
    unl = vision.load_stl10_unlabeled(tmp_path)
    assert unl.dtype == np.uint8 and unl.shape == (2, 3, 96, 96) and unl.flags.c_contiguous
    np.testing.assert_array_equal(unl, write_stl10.unlabeled)
    raw = load_dataset("stl10", tmp_path)
    assert len(raw.y) == 5 and raw.y.min() >= 0  # the unlabelled images are not rows of the dataset


def test_stl10_unlabeled_missing(tmp_path):
    with pytest.raises(DataMissingError) as err:
        vision.load_stl10_unlabeled(tmp_path)
    assert "unlabeled_X.bin" in str(err.value) and str(tmp_path / "stl10_binary") in str(err.value)


def test_svhn_include_extra(tmp_path, monkeypatch):
    x, y, split = make("svhn", tmp_path, monkeypatch, n_extra=4)
    raw = load_dataset("svhn", tmp_path, {"include_extra": True})
    assert len(raw.y) == 5 + 4 + 3
    np.testing.assert_array_equal(raw.x, x)
    np.testing.assert_array_equal(raw.y, y)
    np.testing.assert_array_equal(raw.official_split, split)
    assert len(load_dataset("svhn", tmp_path).y) == 8  # default: no extra


def test_svhn_extra_missing_is_named(tmp_path, monkeypatch):
    make("svhn", tmp_path, monkeypatch)
    with pytest.raises(DataMissingError) as err:
        load_dataset("svhn", tmp_path, {"include_extra": True})
    msg = str(err.value)
    assert "extra_32x32.mat" in msg and """--params '{"include_extra": true}'""" in msg


# --------------------------------------------------------------- missing / corrupt


@pytest.mark.parametrize("name", NAMES)
def test_missing_fails_at_once_naming_files_folder_and_how(name, tmp_path, monkeypatch):
    def no_torchvision(src):
        raise AssertionError("torchvision must not be reached when files are missing")

    monkeypatch.setattr(vision, "_dataset_class", no_torchvision)
    root = tmp_path / "raw" / name
    with pytest.raises(DataMissingError) as err:
        load_dataset(name, root)
    msg = str(err.value)
    src = vision.SOURCES[name]
    params = {k: p.default for k, p in src.params.items()}
    for f in src.files(params):
        assert f in msg
    assert str(vision.raw_folder(src, root, params)) in msg
    assert f"fedrepro prepare {name} --root {root}" in msg
    assert "http" in msg and "copy" in msg


def test_missing_one_file_is_listed(tmp_path, monkeypatch):
    make("mnist", tmp_path, monkeypatch)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataMissingError) as err:
        load_dataset("mnist", tmp_path)
    lines = str(err.value).splitlines()
    assert lines[1].strip() == "t10k-labels-idx1-ubyte"  # only the missing one is listed as missing
    assert lines[2].startswith("Expected all of: train-images-idx3-ubyte")


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "stl10", "svhn"])
def test_md5_mismatch_is_data_missing(name, tmp_path, monkeypatch):
    make(name, tmp_path, monkeypatch)
    src = vision.SOURCES[name]
    victim = vision.raw_folder(src, tmp_path, {"include_extra": False}) / src.files({"include_extra": False})[-1]
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(DataMissingError, match="corrupt"):
        load_dataset(name, tmp_path)


def test_truncated_idx_is_data_missing(tmp_path, monkeypatch):
    make("mnist", tmp_path, monkeypatch)
    f = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(DataMissingError, match="truncated"):
        load_dataset("mnist", tmp_path)


def test_corrupt_usps_is_data_missing(tmp_path, monkeypatch):
    make("usps", tmp_path, monkeypatch)
    (tmp_path / "usps.t.bz2").write_bytes(b"not bz2")
    with pytest.raises(DataMissingError, match="usps.bz2|corrupt"):
        load_dataset("usps", tmp_path)


def test_out_of_range_labels_rejected(tmp_path, monkeypatch):
    make("mnist", tmp_path, monkeypatch)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").write_bytes(idx_labels(np.array([1, 2, 10])))
    with pytest.raises(DataMissingError, match="labels outside"):
        load_dataset("mnist", tmp_path)


# ----------------------------------------------------------------------- prepare


@pytest.mark.parametrize("name", NAMES)
def test_prepare_offline_names_files(name, tmp_path, no_network):
    root = tmp_path / name
    with pytest.raises(DataMissingError) as err:
        prepare_dataset(name, root)
    msg = str(err.value)
    src = vision.SOURCES[name]
    params = {k: p.default for k, p in src.params.items()}
    for f in src.files(params):
        assert f in msg
    assert "automatic download failed" in msg and "network unreachable" in msg
    assert no_network, "torchvision's download should have been tried"


@pytest.mark.parametrize("name", NAMES)
def test_prepare_downloads_through_torchvision_then_is_idempotent(name, tmp_path, fake_download):
    (x, y, split), calls = fake_download(name)
    root = tmp_path / "raw" / name
    info = prepare_dataset(name, root)
    assert calls, "prepare must use torchvision's download path"
    assert info["num_samples"] == len(y) and info["sample_shape"] == list(SHAPES[name])
    raw = load_dataset(name, root)
    np.testing.assert_array_equal(raw.x, x)
    np.testing.assert_array_equal(raw.official_split, split)
    assert info["fingerprint"] == raw.fingerprint()
    calls.clear()
    prepare_dataset(name, root)
    assert calls == [], "files present: no download"


def test_prepare_present_files_needs_no_torchvision_download(tmp_path, monkeypatch, no_network):
    for name in NAMES:
        make(name, tmp_path / name, monkeypatch)
        prepare_dataset(name, tmp_path / name)
    assert no_network == []


def test_stl10_unlabeled_pool_reaches_the_training_clients_ssl_data(tmp_path, monkeypatch):
    """dataset param `unlabeled`: the images join as a pool that the partition spreads over the
    training clients (not the novel ones) as split 'unlabeled', label -1; the SSL stage's data
    (`Client.ssl_pool`) is train + that share."""
    import torch

    from fedrepro.data.shards import load_partition, write_partition
    from fedrepro.engine.data import load_clients

    make("stl10", tmp_path, monkeypatch, n_tr=6, n_te=4, n_unl=5)
    raw = load_dataset("stl10", tmp_path, {"unlabeled": 5})
    np.testing.assert_array_equal(raw.unlabeled, write_stl10.unlabeled)
    assert load_dataset("stl10", tmp_path).unlabeled is None and raw.fingerprint() != load_dataset("stl10", tmp_path).fingerprint()
    spec = {"dataset": "stl10", "dataset_params": {"unlabeled": 5}, "partitioner": "iid", "num_clients": 3,
            "unseen_clients": 1, "split": {"test_fraction": 0.25},
            "allow_empty_clients": True}  # 10 images, one per class: no client keeps a test sample (not what is tested here)
    manifest = write_partition(raw, spec, tmp_path / "part")
    novel = [c["id"] for c in manifest["clients"] if c["unseen"]]
    shares = {c["id"]: c["sizes"]["unlabeled"] for c in manifest["clients"]}
    assert sum(shares.values()) == 5 and all(shares[i] == 0 for i in novel) and all(v >= 2 for i, v in shares.items() if i not in novel)
    clients = load_clients(*load_partition(tmp_path / "part"), torch.device("cpu"))
    got = torch.cat([c.unlabeled.x for c in clients if c.unlabeled is not None])
    assert len(got) == 5 and all((c.unlabeled.y == -1).all() for c in clients if c.unlabeled is not None)
    mean = torch.tensor(raw.mean).view(1, 3, 1, 1)
    std = torch.tensor(raw.std).view(1, 3, 1, 1)
    want = (torch.from_numpy(write_stl10.unlabeled).float() / 255 - mean) / std
    assert sorted(got.sum((1, 2, 3)).tolist()) == pytest.approx(sorted(want.sum((1, 2, 3)).tolist()), rel=1e-5)
    for c in clients:  # the labelled splits are untouched; the SSL data adds the share
        assert len(c.ssl_pool) == len(c.train) + (len(c.unlabeled) if c.unlabeled is not None else 0)
        assert (c.train.y >= 0).all()
