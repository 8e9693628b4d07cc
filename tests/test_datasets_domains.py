"""Multi-domain and MIT-BIH loaders: tiny fixtures written in the real on-disk formats."""

from __future__ import annotations

import bz2
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fedrepro.data.domains as dom  # registers the datasets
from fedrepro.data.base import DataMissingError
from fedrepro.data.datasets import DATASETS, DatasetSpec, load_dataset, prepare_dataset
from fedrepro.registry import ConfigError

NEW = ("mnistm", "syn", "digit5", "pacs", "domainnet", "mitbih")


# ----------------------------------------------------------------------- writers


def rng(seed=0):
    return np.random.default_rng(seed)


def write_pkl(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        pickle.dump((images, labels), fh, pickle.HIGHEST_PROTOCOL)


FEDBN_SHAPES = {"mnist": (28, 28), "mnistm": (28, 28, 3), "svhn": (32, 32, 3), "syn": (32, 32, 3), "usps": (16, 16)}


def write_fedbn(root: Path, domain: str, parts=(3, 2), n_test=2, seed=0, base: Path | None = None):
    """FedBN layout: <FOLDER>/partitions/train_part<k>.pkl + <FOLDER>/test.pkl; returns (x, y, split)."""
    g = rng(seed)
    folder = (base or root / dom.FEDBN_DIGITS_DIR) / dom.FEDBN_DIGIT_FOLDERS[domain]
    xs, ys, ss = [], [], []
    for k, n in enumerate(parts):
        x = g.integers(0, 256, (n, *FEDBN_SHAPES[domain]), dtype=np.uint8)
        y = g.integers(0, 10, n).astype(np.int64)
        write_pkl(folder / "partitions" / f"train_part{k}.pkl", x, y)
        xs.append(x), ys.append(y), ss.append(np.zeros(n, np.int8))
    x = g.integers(0, 256, (n_test, *FEDBN_SHAPES[domain]), dtype=np.uint8)
    y = g.integers(0, 10, (n_test, 1))  # (N, 1) labels as some FedBN pickles have
    write_pkl(folder / "test.pkl", x, y)
    xs.append(x), ys.append(y.reshape(-1)), ss.append(np.ones(n_test, np.int8))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ss)


def write_svhn_mat(path: Path, n: int, seed=0, labels=None):
    """SVHN / SynthDigits .mat: X (32, 32, 3, N) uint8, y (N, 1) with 10 meaning digit 0."""
    import scipy.io as sio

    g = rng(seed)
    x = g.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    y = np.asarray(labels if labels is not None else g.integers(1, 11, n)).reshape(-1, 1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    sio.savemat(str(path), {"X": x.transpose(1, 2, 3, 0), "y": y})
    return x, np.where(y.reshape(-1) == 10, 0, y.reshape(-1)).astype(np.int64)


def write_mnist_raw(root: Path, n_train=4, n_test=2, seed=0):
    g = rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    out = []
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = g.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        x[0] = 77  # a constant image: must stay constant after the resize
        y = g.integers(0, 10, n).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + x.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + y.tobytes())
        out += [x, y.astype(np.int64)]
    return out


def write_usps(root: Path, n_train=3, n_test=2, seed=0):
    """libsvm format as torchvision's USPS reads it: 'label 1:v ... 256:v', label 1..10, v in [-1, 1]."""
    g = rng(seed)
    d = root / dom.USPS_DIR
    d.mkdir(parents=True, exist_ok=True)
    labels = []
    for fname, n in (("usps.bz2", n_train), ("usps.t.bz2", n_test)):
        lab = g.integers(1, 11, n)
        lines = []
        for lbl in lab:
            vals = g.uniform(-1, 1, 256)
            lines.append(f"{lbl} " + " ".join(f"{i + 1}:{v:.6f}" for i, v in enumerate(vals)))
        (d / fname).write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
        labels.append(lab - 1)
    return labels


def write_mnistm_original(root: Path, n_train=3, n_test=2, seed=0):
    g = rng(seed)
    d = root / dom.MNISTM_ORIG_DIR
    out = []
    for split, n in (("train", n_train), ("test", n_test)):
        (d / f"mnist_m_{split}").mkdir(parents=True, exist_ok=True)
        lines, xs, ys = [], [], []
        for i in range(n):
            x = g.integers(0, 256, (28, 28, 3), dtype=np.uint8)
            Image.fromarray(x).save(d / f"mnist_m_{split}" / f"{i:08d}.png")
            y = int(g.integers(0, 10))
            lines.append(f"{i:08d}.png {y}")
            xs.append(x), ys.append(y)
        (d / f"mnist_m_{split}_labels.txt").write_text("\n".join(lines) + "\n")
        out += [np.stack(xs), np.asarray(ys)]
    return out


def solid(size, color, mode="RGB"):
    return Image.new(mode, size, color)


CLASS_COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255), (128, 128, 128)]


def write_pacs(root: Path, domains=dom.PACS_DOMAINS, base: Path | None = None):
    """<PACS>/<domain>/<class>/<i>.jpg (sketch: grayscale .png); 1 image per class, 2 for 'dog'."""
    base = base or root / dom.PACS_DIR
    listing = {}
    for d in domains:
        rows = []
        for c, cls in enumerate(dom.PACS_CLASSES):
            (base / d / cls).mkdir(parents=True, exist_ok=True)
            for i in range(2 if cls == "dog" else 1):
                if d == "sketch":
                    name = f"{i}.png"
                    solid((20, 16), 60 + 20 * c, "L").save(base / d / cls / name)
                else:
                    name = f"pic_{i:03d}.jpg"
                    solid((20, 16), CLASS_COLORS[c]).save(base / d / cls / name, quality=95)
                rows.append(f"{d}/{cls}/{name}")
        listing[d] = rows
    return listing


DN_CLASSES = ["aircraft_carrier", *dom.FEDBN_DOMAINNET_CLASSES]  # official ids 0..10 in this fixture


def write_domainnet(root: Path, domains=dom.DOMAINNET_DOMAINS, n_train=2, n_test=1):
    base = root / dom.DOMAINNET_DIR
    for d in domains:
        for split, n in (("train", n_train), ("test", n_test)):
            lines = []
            for cid, cls in enumerate(DN_CLASSES):
                (base / d / cls).mkdir(parents=True, exist_ok=True)
                for i in range(n):
                    name = f"{d}_{split}_{cid:03d}_{i}.jpg"
                    solid((12, 10), (cid * 20, 255 - cid * 20, 100)).save(base / d / cls / name, quality=95)
                    lines.append(f"{d}/{cls}/{name} {cid}")
            (base / f"{d}_{split}.txt").write_text("\n".join(lines) + "\n")


# MIT-BIH: (sample, symbol) annotations of the tiny records; signal length 3000 at 360 Hz.
MIT_LEN = 3000
MIT_ANN = {
    "100": [(5, "+"), (50, "N"), (400, "N"), (800, "V"), (1200, "A"), (1600, "L"), (1700, "~"), (1800, "Q"),
            (2000, "R"), (2400, "/"), (2950, "N")],
    "101": [(500, "N"), (1000, "f"), (1500, "F"), (2000, "j"), (2100, "x"), (2200, "a"), (2500, "E"), (2700, "J")],
    "102": [(500, "N"), (1000, "/")],
}
MIT_LEADS = {"100": ["MLII", "V5"], "101": ["MLII", "V1"], "102": ["V5", "V2"]}  # 102: no MLII, as in mitdb


def write_mitdb(d: Path, records=("100", "101", "102")):
    import wfdb

    d.mkdir(parents=True, exist_ok=True)
    t = np.arange(MIT_LEN)
    for k, rec in enumerate(records):
        sig = np.stack([np.sin(t / (15 + k)) + 0.001 * t, np.cos(t / 9.0)], axis=1)
        wfdb.wrsamp(rec, fs=360, units=["mV", "mV"], sig_name=MIT_LEADS[rec], p_signal=sig, fmt=["212", "212"],
                    adc_gain=[200.0, 200.0], baseline=[0, 0], write_dir=str(d))
        samples, symbols = zip(*MIT_ANN[rec])
        wfdb.wrann(rec, "atr", np.asarray(samples), symbol=list(symbols), write_dir=str(d))


# ---------------------------------------------------------------------- registry


def test_registry_has_the_domain_datasets():
    for name in NEW:
        entry = DATASETS.entry(name)
        assert isinstance(entry.obj, DatasetSpec) and entry.obj.name == name
        assert "\n" not in entry.summary and entry.info["source"] == entry.obj.source
    assert DATASETS.get("domainnet").params["classes"].default == list(dom.FEDBN_DOMAINNET_CLASSES)
    assert DATASETS.get("mitbih").num_classes == 12 and len(dom.MITBIH_CLASSES) == 12
    assert set(dom.MITBIH_CLASSES) <= set(dom.BEAT_SYMBOLS) and len(dom.MITDB_RECORDS) == 48


@pytest.mark.parametrize("name", NEW)
def test_missing_data_fails_at_once_with_instructions(tmp_path, name):
    with pytest.raises(DataMissingError) as err:
        load_dataset(name, tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg and "To get them" in msg
    expected = {
        "mnistm": ["MNIST_M/partitions/train_part0.pkl", "mnist_m_train_labels.txt", dom.FEDBN_DIGITS_GDRIVE_ID],
        "syn": ["SynthDigits/partitions/train_part0.pkl", "synth_train_32x32.mat", dom.FEDBN_DIGITS_GDRIVE_ID],
        "digit5": ["MNIST/raw/train-images-idx3-ubyte", "SVHN/train_32x32.mat", "USPS/usps.bz2", "MNIST_M", "SynthDigits"],
        "pacs": ["PACS/photo/dog/", "PACS/sketch/person/", dom.PACS_GDRIVE_ID],
        "domainnet": ["DomainNet/clipart/", "DomainNet/sketch_test.txt", "groundtruth/clipart.zip", "ai.bu.edu"],
        "mitbih": ["100.hea, 100.dat, 100.atr", "234.hea", "dl_database('mitdb'", "physionet.org"],
    }[name]
    for piece in expected:
        assert piece in msg, (piece, msg)


# ------------------------------------------------------------------ mnistm / syn


def test_mnistm_fedbn_layout(tmp_path):
    x, y, s = write_fedbn(tmp_path, "mnistm")
    raw = load_dataset("mnistm", tmp_path)
    assert raw.x.shape == (7, 3, 28, 28) and raw.x.dtype == np.uint8
    np.testing.assert_array_equal(raw.x, x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(raw.y, y)
    assert raw.y.dtype == np.int64
    np.testing.assert_array_equal(raw.official_split, [0] * 5 + [1] * 2)  # parts 0, 1 then test.pkl
    assert raw.mean == (0.5,) * 3 and raw.std == (0.5,) * 3 and "layout: fedbn" in raw.source


def test_mnistm_original_layout_and_layout_choice(tmp_path):
    tr_x, tr_y, te_x, te_y = write_mnistm_original(tmp_path)
    raw = load_dataset("mnistm", tmp_path)  # auto: only the original is present
    assert raw.x.shape == (5, 3, 28, 28) and "layout: original" in raw.source
    np.testing.assert_array_equal(raw.x, np.concatenate([tr_x, te_x]).transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(raw.y, np.concatenate([tr_y, te_y]))
    np.testing.assert_array_equal(raw.official_split, [0, 0, 0, 1, 1])

    write_fedbn(tmp_path, "mnistm")
    assert "layout: fedbn" in load_dataset("mnistm", tmp_path).source  # auto prefers FedBN's release
    assert load_dataset("mnistm", tmp_path, {"layout": "original"}).x.shape[0] == 5
    with pytest.raises(ConfigError, match="layout"):
        load_dataset("mnistm", tmp_path, {"layout": "zip"})


def test_mnistm_explicit_layout_missing(tmp_path):
    write_mnistm_original(tmp_path)
    with pytest.raises(DataMissingError, match="MNIST_M/partitions"):
        load_dataset("mnistm", tmp_path, {"layout": "fedbn"})


def test_syn_fedbn_and_original_layouts(tmp_path):
    x, y, _ = write_fedbn(tmp_path / "a", "syn", parts=(2,), n_test=3)
    raw = load_dataset("syn", tmp_path / "a")
    assert raw.x.shape == (5, 3, 32, 32) and raw.x.dtype == np.uint8
    np.testing.assert_array_equal(raw.x, x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(raw.official_split, [0, 0, 1, 1, 1])

    tr_x, tr_y = write_svhn_mat(tmp_path / "b" / "SynthDigits" / "synth_train_32x32.mat", 4, labels=[0, 3, 9, 5])
    te_x, te_y = write_svhn_mat(tmp_path / "b" / "SynthDigits" / "synth_test_32x32.mat", 2, seed=1, labels=[1, 2])
    raw = load_dataset("syn", tmp_path / "b", {"layout": "original"})
    np.testing.assert_array_equal(raw.x, np.concatenate([tr_x, te_x]).transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(raw.y, [0, 3, 9, 5, 1, 2])
    np.testing.assert_array_equal(raw.official_split, [0] * 4 + [1] * 2)


def fake_gdrive_zip(monkeypatch, build, calls):
    """Replace torchvision's Google Drive download by writing the zip `build(zf)` makes."""
    from torchvision.datasets import utils as tvu

    def fake(file_id, root, filename=None, md5=None):
        calls.append(file_id)
        with zipfile.ZipFile(Path(root) / filename, "w") as zf:
            build(zf)

    monkeypatch.setattr(tvu, "download_file_from_google_drive", fake)
    monkeypatch.setenv("FEDREPRO_ALLOW_UNPINNED_DOWNLOADS", "1")  # FedBN's and PACS's zips have no published checksum


def test_fedbn_prepare_unpacks_the_release_zip(tmp_path, monkeypatch):
    src = tmp_path / "src"
    x, y, _ = write_fedbn(tmp_path, "mnistm", base=src / "digit_dataset")

    def build(zf):
        for f in (src / "digit_dataset").rglob("*.pkl"):
            zf.write(f, f.relative_to(src))

    calls = []
    fake_gdrive_zip(monkeypatch, build, calls)
    root = tmp_path / "data"
    info = prepare_dataset("mnistm", root)
    assert calls == [dom.FEDBN_DIGITS_GDRIVE_ID]
    assert (root / "fedbn_digits" / "MNIST_M" / "test.pkl").is_file()
    assert not (root / "fedbn_digits" / "digit_dataset.zip").exists()
    assert not list(root.glob(".*partial")), "staging folder left behind"
    assert info["num_samples"] == 7 and info["sample_shape"] == [3, 28, 28]
    prepare_dataset("mnistm", root)  # idempotent: no second download
    assert calls == [dom.FEDBN_DIGITS_GDRIVE_ID]


def test_fedbn_prepare_failure_is_data_missing(tmp_path, monkeypatch):
    from torchvision.datasets import utils as tvu

    def fail(*a, **k):
        raise RuntimeError("To download files from GDrive, 'gdown' is required.")

    monkeypatch.setattr(tvu, "download_file_from_google_drive", fail)
    with pytest.raises(DataMissingError) as err:
        prepare_dataset("syn", tmp_path)
    msg = str(err.value)
    assert "gdown" in msg and dom.FEDBN_DIGITS_URL in msg and "SynthDigits/test.pkl" in msg


# ----------------------------------------------------------------------- digit5


def write_digit5_torchvision(root: Path):
    mn = write_mnist_raw(root)
    sv_tr = write_svhn_mat(root / "SVHN" / "train_32x32.mat", 3, labels=[10, 1, 2])
    sv_te = write_svhn_mat(root / "SVHN" / "test_32x32.mat", 2, seed=1, labels=[3, 10])
    us = write_usps(root)
    mm = write_fedbn(root, "mnistm", parts=(2,), n_test=1)
    sy_tr = write_svhn_mat(root / "SynthDigits" / "synth_train_32x32.mat", 2, seed=2, labels=[4, 5])
    sy_te = write_svhn_mat(root / "SynthDigits" / "synth_test_32x32.mat", 1, seed=3, labels=[6])
    return {
        "mnist": (np.concatenate([mn[1], mn[3]]), [0] * 4 + [1] * 2),
        "mnistm": (mm[1], [0, 0, 1]),
        "svhn": ([0, 1, 2, 3, 0], [0, 0, 0, 1, 1]),
        "syn": ([4, 5, 6], [0, 0, 1]),
        "usps": (np.concatenate(us), [0] * 3 + [1] * 2),
    }, mn


def test_digit5_torchvision_source(tmp_path):
    truth, mn = write_digit5_torchvision(tmp_path)
    raw = load_dataset("digit5", tmp_path)
    n = sum(len(v[0]) for v in truth.values())
    assert raw.x.shape == (n, 3, 32, 32) and raw.x.dtype == np.uint8 and raw.num_classes == 10
    assert raw.y.dtype == np.int64 and raw.mean == (0.5,) * 3
    d = raw.groups["domain"]
    assert d.dtype == np.int64 and np.all(np.diff(d) >= 0)
    for i, name in enumerate(dom.DIGIT5_DOMAINS):  # default order: mnist, mnistm, svhn, syn, usps
        labels, split = truth[name]
        np.testing.assert_array_equal(raw.y[d == i], labels, err_msg=name)
        np.testing.assert_array_equal(raw.official_split[d == i], split, err_msg=name)
    mnist = raw.x[d == 0]
    assert (mnist[:, 0] == mnist[:, 1]).all() and (mnist[:, 1] == mnist[:, 2]).all()  # gray -> 3 equal channels
    assert (mnist[0] == 77).all()  # constant image stays constant under the bilinear resize
    svhn = raw.x[d == 2]  # 32x32 already: no resize, exact pixels
    import scipy.io as sio

    np.testing.assert_array_equal(svhn[:3], sio.loadmat(str(tmp_path / "SVHN" / "train_32x32.mat"))["X"].transpose(3, 2, 0, 1))
    assert "mnistm: fedbn" in raw.source and "syn: original" in raw.source
    assert load_dataset("digit5", tmp_path).fingerprint() == raw.fingerprint()


def test_digit5_params(tmp_path):
    write_digit5_torchvision(tmp_path)
    small = load_dataset("digit5", tmp_path, {"image_size": 16})
    assert small.x.shape[1:] == (3, 16, 16)

    order = list(dom.FEDGCR_DIGIT5_ORDER)  # mnist, usps, syn, mnistm, svhn
    raw = load_dataset("digit5", tmp_path, {"domains": order})
    assert np.bincount(raw.groups["domain"]).tolist() == [6, 5, 3, 3, 5]

    capped = load_dataset("digit5", tmp_path, {"max_per_domain": 1})
    assert np.bincount(capped.groups["domain"]).tolist() == [2] * 5
    assert np.bincount(capped.official_split).tolist() == [5, 5]

    only = load_dataset("digit5", tmp_path, {"domains": ["usps"]})
    assert (only.groups["domain"] == 0).all() and len(only.y) == 5

    for bad in (["mnist", "mnist"], ["kmnist"], []):
        with pytest.raises(ConfigError, match="domains"):
            load_dataset("digit5", tmp_path, {"domains": bad})


def test_digit5_subset_needs_only_its_files(tmp_path):
    write_svhn_mat(tmp_path / "SVHN" / "train_32x32.mat", 2)
    write_svhn_mat(tmp_path / "SVHN" / "test_32x32.mat", 1)
    raw = load_dataset("digit5", tmp_path, {"domains": ["svhn"]})
    assert raw.x.shape == (3, 3, 32, 32)
    with pytest.raises(DataMissingError) as err:
        load_dataset("digit5", tmp_path, {"domains": ["svhn", "usps"]})
    assert "USPS/usps.bz2" in str(err.value) and "SVHN/train_32x32.mat" not in str(err.value)


def test_digit5_fedbn_source(tmp_path):
    truth = {d: write_fedbn(tmp_path, d, parts=(2, 1), n_test=1, seed=i) for i, d in enumerate(dom.DIGIT5_DOMAINS)}
    raw = load_dataset("digit5", tmp_path, {"source": "fedbn", "image_size": 28})
    assert raw.x.shape == (20, 3, 28, 28)
    for i, d in enumerate(dom.DIGIT5_DOMAINS):
        x, y, s = truth[d]
        np.testing.assert_array_equal(raw.y[raw.groups["domain"] == i], y)
        np.testing.assert_array_equal(raw.official_split[raw.groups["domain"] == i], s)
    # MNIST is 28x28 already: exact pixels, replicated
    np.testing.assert_array_equal(raw.x[raw.groups["domain"] == 0][:, 1], truth["mnist"][0])
    with pytest.raises(DataMissingError, match="USPS/partitions"):
        load_dataset("digit5", tmp_path / "none", {"source": "fedbn", "domains": ["usps"]})


# ------------------------------------------------------------------------- PACS


def test_pacs_layout_labels_domains(tmp_path):
    write_pacs(tmp_path)
    raw = load_dataset("pacs", tmp_path, {"image_size": 8})
    per_domain = len(dom.PACS_CLASSES) + 1  # 'dog' has two images
    assert raw.x.shape == (4 * per_domain, 3, 8, 8) and raw.x.dtype == np.uint8
    assert raw.num_classes == 7 and raw.mean == (0.0,) * 3 and raw.std == (1.0,) * 3
    assert (raw.official_split == 0).all()
    d = raw.groups["domain"]
    assert np.bincount(d).tolist() == [per_domain] * 4
    expected_y = [0, 0, 1, 2, 3, 4, 5, 6]  # dog, dog, elephant, giraffe, guitar, horse, house, person
    for i in range(4):
        np.testing.assert_array_equal(raw.y[d == i], expected_y)
    photo = raw.x[d == 0].astype(int)
    for row, label in zip(photo, expected_y):  # solid colour per class survives JPEG + resize
        assert np.abs(row.reshape(3, -1).mean(1) - CLASS_COLORS[label]).max() < 6
    sketch = raw.x[d == 3]  # grayscale PNG -> 3 equal channels
    assert (sketch[:, 0] == sketch[:, 2]).all() and sketch[-1, 0, 0, 0] == 60 + 20 * 6


def test_pacs_domains_param_and_kfold_split(tmp_path):
    listing = write_pacs(tmp_path, domains=("cartoon", "sketch"))
    raw = load_dataset("pacs", tmp_path, {"domains": ["sketch", "cartoon"], "image_size": 4})
    assert raw.x.shape == (16, 3, 4, 4) and np.bincount(raw.groups["domain"]).tolist() == [8, 8]
    with pytest.raises(DataMissingError, match="kfold"):
        load_dataset("pacs", tmp_path, {"domains": ["cartoon"], "split": "kfold"})
    base = tmp_path / "PACS"
    for d, rows in listing.items():  # official-style lists: 1-based labels, every 3rd image held out
        lab = {c: i + 1 for i, c in enumerate(dom.PACS_CLASSES)}
        tr = [f"{r} {lab[r.split('/')[1]]}" for k, r in enumerate(rows) if k % 3]
        cv = [f"/{r} {lab[r.split('/')[1]]}" for k, r in enumerate(rows) if not k % 3]
        (base / f"{d}_train_kfold.txt").write_text("\n".join(tr) + "\n")
        (base / f"{d}_crossval_kfold.txt").write_text("\n".join(cv) + "\n")
    raw = load_dataset("pacs", tmp_path, {"domains": ["cartoon", "sketch"], "split": "kfold", "image_size": 4})
    assert raw.official_split.tolist() == [1 if k % 3 == 0 else 0 for k in range(8)] * 2


def test_pacs_prepare_from_zip_and_failure(tmp_path, monkeypatch):
    src = tmp_path / "src"
    write_pacs(tmp_path, base=src / "kfold")

    def build(zf):
        for f in (src / "kfold").rglob("*.*"):
            zf.write(f, f.relative_to(src))

    calls = []
    fake_gdrive_zip(monkeypatch, build, calls)
    info = prepare_dataset("pacs", tmp_path / "data", {"image_size": 4})
    assert calls == [dom.PACS_GDRIVE_ID] and info["num_samples"] == 32 and info["sample_shape"] == [3, 4, 4]
    assert (tmp_path / "data" / "PACS" / "art_painting" / "dog" / "pic_000.jpg").is_file()
    assert not (tmp_path / "data" / "PACS.zip").exists()

    from torchvision.datasets import utils as tvu

    def offline(*a, **k):
        raise OSError("offline")

    monkeypatch.setattr(tvu, "download_file_from_google_drive", offline)
    with pytest.raises(DataMissingError) as err:
        prepare_dataset("pacs", tmp_path / "empty")
    assert "offline" in str(err.value) and "kfold/ folder" in str(err.value)


# -------------------------------------------------------------------- DomainNet


def test_domainnet_default_fedbn_classes(tmp_path):
    write_domainnet(tmp_path)
    raw = load_dataset("domainnet", tmp_path, {"image_size": 6})
    n_dom = 10 * (2 + 1)  # 10 classes x (2 train + 1 test); aircraft_carrier excluded
    assert raw.x.shape == (6 * n_dom, 3, 6, 6) and raw.x.dtype == np.uint8
    assert raw.num_classes == 10 and raw.mean == (0.0,) * 3
    d = raw.groups["domain"]
    assert np.bincount(d).tolist() == [n_dom] * 6
    clip = d == 0
    np.testing.assert_array_equal(raw.y[clip], np.r_[np.repeat(np.arange(10), 2), np.arange(10)])
    np.testing.assert_array_equal(raw.official_split[clip], [0] * 20 + [1] * 10)
    # label k is FedBN's label_dict[k]: pixel colour encodes the official id (= k + 1 here)
    first_bird = raw.x[clip][0].astype(int).reshape(3, -1).mean(1)
    assert np.abs(first_bird - [20, 235, 100]).max() < 6


def test_domainnet_class_and_domain_params(tmp_path):
    write_domainnet(tmp_path, domains=("sketch", "quickdraw"), n_train=1, n_test=1)
    p = {"domains": ["sketch", "quickdraw"], "image_size": 4}
    raw = load_dataset("domainnet", tmp_path, {**p, "classes": ["zebra", "aircraft_carrier"]})
    assert raw.num_classes == 2 and raw.x.shape == (8, 3, 4, 4)
    np.testing.assert_array_equal(raw.y, [1, 0, 1, 0] * 2)  # file order: aircraft_carrier (id 0) then zebra
    np.testing.assert_array_equal(raw.groups["domain"], [0] * 4 + [1] * 4)
    first3 = load_dataset("domainnet", tmp_path, {**p, "classes": 3})  # aircraft_carrier, bird, feather
    assert first3.num_classes == 3 and sorted(set(first3.y.tolist())) == [0, 1, 2]
    capped = load_dataset("domainnet", tmp_path, {**p, "max_per_domain": 2})
    assert len(capped.y) == 2 * 2 * 2
    with pytest.raises(ConfigError, match="unicorn"):
        load_dataset("domainnet", tmp_path, {**p, "classes": ["unicorn"]})
    with pytest.raises(ConfigError, match="domains"):
        load_dataset("domainnet", tmp_path, {**p, "domains": ["photo"]})
    (tmp_path / "DomainNet" / "sketch" / "zebra" / "sketch_train_010_0.jpg").unlink()
    with pytest.raises(DataMissingError, match="sketch_train_010_0.jpg"):
        load_dataset("domainnet", tmp_path, p)


def test_domainnet_prepare_downloads_only_missing(tmp_path, monkeypatch):
    from torchvision.datasets import utils as tvu

    calls = []
    monkeypatch.setattr(tvu, "download_url", lambda url, root, filename=None, md5=None: calls.append(url))
    monkeypatch.setattr(tvu, "download_and_extract_archive", lambda url, *a, **k: calls.append(url))
    write_domainnet(tmp_path, domains=("clipart",), n_train=1, n_test=1)
    prepare_dataset("domainnet", tmp_path, {"domains": ["clipart"], "image_size": 4})
    assert calls == []

    def fail(url, *a, **k):
        raise OSError(f"cannot reach {url}")

    monkeypatch.setattr(tvu, "download_url", fail)
    with pytest.raises(DataMissingError) as err:
        prepare_dataset("domainnet", tmp_path, {"domains": ["clipart", "real"]})
    msg = str(err.value)
    assert "cannot reach http://csr.bu.edu/ftp/visda/2019/multi-source/domainnet/txt/real_train.txt" in msg
    assert "DomainNet/real/" in msg and "DomainNet/clipart/" not in msg


# ---------------------------------------------------------------------- MIT-BIH


def test_mitbih_beats_classes_patients(tmp_path):
    import wfdb

    write_mitdb(tmp_path / "mitdb")
    raw = load_dataset("mitbih", tmp_path)
    # 100: N@400 V A L R / (N@50 and N@2950 cut by the window, '+' '~' non-beats, Q not a class);
    # 101: N f F j a E J ('x' is no beat); 102 has no MLII and is skipped.
    sym = {s: i for i, s in enumerate(dom.MITBIH_CLASSES)}
    exp = ["N", "V", "A", "L", "R", "/"] + ["N", "f", "F", "j", "a", "E", "J"]
    assert raw.x.shape == (13, 1, 256) and raw.x.dtype == np.float32
    np.testing.assert_array_equal(raw.y, [sym[s] for s in exp])
    assert raw.y.dtype == np.int64 and raw.num_classes == 12
    np.testing.assert_array_equal(raw.groups["patient"], [0] * 6 + [1] * 7)
    np.testing.assert_array_equal(raw.groups["record"], [100] * 6 + [101] * 7)
    assert (raw.official_split == 0).all() and "skipped: 102" in raw.source
    sig = wfdb.rdrecord(str(tmp_path / "mitdb" / "100"), channel_names=["MLII"]).p_signal[:, 0]
    np.testing.assert_allclose(raw.x[1, 0], sig[800 - 128 : 800 + 128], rtol=0, atol=1e-6)  # V beat, R at index 128
    assert raw.mean[0] == pytest.approx(float(raw.x.mean()), rel=1e-5)
    assert raw.std[0] == pytest.approx(float(raw.x.std()), rel=1e-5)


def test_mitbih_params(tmp_path):
    write_mitdb(tmp_path / "mitdb")
    short = load_dataset("mitbih", tmp_path, {"window": 64})
    assert short.x.shape == (15, 1, 64)  # N@50 and N@2950 now fit (50 - 32 >= 0, 2950 + 32 <= 3000)
    only = load_dataset("mitbih", tmp_path, {"records": ["101"]})
    assert len(only.y) == 7 and (only.groups["patient"] == 0).all()
    beat = load_dataset("mitbih", tmp_path, {"normalize": "beat"})
    np.testing.assert_allclose(beat.x.mean(axis=2), 0, atol=1e-5)
    np.testing.assert_allclose(beat.x.std(axis=2), 1, atol=1e-3)
    three = load_dataset("mitbih", tmp_path, {"classes": ["V", "N", "Q"]})
    np.testing.assert_array_equal(three.y, [1, 0, 2, 1])  # 100: N@400, V@800, Q@1800; 101: N@500
    with pytest.raises(ConfigError, match="classes"):
        load_dataset("mitbih", tmp_path, {"classes": ["N", "+"]})  # '+' is not a beat
    with pytest.raises(ConfigError, match="no 'MLII'"):
        load_dataset("mitbih", tmp_path, {"records": ["102"]})
    with pytest.raises(DataMissingError, match="999.hea"):
        load_dataset("mitbih", tmp_path, {"records": ["100", "999"]})
    v5 = load_dataset("mitbih", tmp_path, {"lead": "V5"})
    assert set(v5.groups["record"].tolist()) == {100, 102}


def test_mitbih_prepare_with_wfdb_download(tmp_path, monkeypatch):
    import wfdb

    calls = []

    def fake_dl(db_dir, dl_dir, records="all", annotators="all", **kw):
        calls.append((db_dir, list(records)))
        write_mitdb(Path(dl_dir), records=[r for r in records if r in MIT_ANN])

    monkeypatch.setattr(wfdb, "dl_database", fake_dl)
    monkeypatch.setenv("FEDREPRO_ALLOW_UNPINNED_DOWNLOADS", "1")  # PhysioNet's files are not pinned
    info = prepare_dataset("mitbih", tmp_path, {"records": ["100", "101"]})
    assert calls == [("mitdb", ["100", "101"])]
    assert info["num_samples"] == 13 and info["sample_shape"] == [1, 256] and info["num_classes"] == 12
    prepare_dataset("mitbih", tmp_path, {"records": ["100", "101"]})
    assert len(calls) == 1, "prepare must be idempotent"

    def offline(*a, **k):
        raise ConnectionError("no route to physionet.org")

    monkeypatch.setattr(wfdb, "dl_database", offline)
    with pytest.raises(DataMissingError) as err:
        prepare_dataset("mitbih", tmp_path)  # all 48 records wanted
    msg = str(err.value)
    assert "no route" in msg and "234.hea, 234.dat, 234.atr" in msg and "100.hea" not in msg
