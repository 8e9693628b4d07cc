"""Multi-domain image datasets and the MIT-BIH ECG beats, registered in `DATASETS`.

Datasets (each `prepare` may download; each `load` is offline and raises
`DataMissingError` at once, naming the expected files, their folder and how to get
them):

* `mnistm`: MNIST-M, 3x28x28 RGB digits, 10 classes.
* `syn`: SynthDigits (Ganin's SynNumbers), 3x32x32 RGB digits, 10 classes.
* `digit5`: Digit-Five = MNIST, MNIST-M, SVHN, SynthDigits, USPS, all as 3 x S x S
  (S = `image_size`, default 32), `groups["domain"]` = index in the `domains` param.
* `pacs`: PACS, photo / art_painting / cartoon / sketch, 7 classes, `groups["domain"]`.
* `domainnet`: DomainNet, 6 domains, a class subset (default FedBN's / FedGCR's 10
  classes), `groups["domain"]`.
* `mitbih`: MIT-BIH Arrhythmia beats: one window of `window` samples (360 Hz) around
  each annotated beat, 12 beat classes (GRP-FED), x float32 (1, window),
  `groups["patient"]` (0..P-1) and `groups["record"]` (the MIT-BIH record number).

On-disk layout under the data root `root` (what `prepare` produces; the paths are
also module constants):

    root/fedbn_digits/{MNIST,SVHN,USPS,SynthDigits,MNIST_M}/partitions/train_part<k>.pkl
                                                           /test.pkl
        FedBN's pre-processed Digit-Five (`digit_dataset.zip`, med-air/FedBN README),
        exactly what FedBN and FedGCR train on. Each .pkl is a pickled
        (images uint8 (N,H,W[,3]), labels int (N,)) tuple. The `train_part<k>.pkl`
        files (k = 0..9, 743 or 744 images each) are FedBN's training pool (FedBN's
        `--percent p` reads the first 10p of them); `test.pkl` is the test split (20 %
        of the whole set, stratified). A `train.pkl` there is ignored.
    root/mnist_m/mnist_m_{train,test}/*.png + mnist_m_{train,test}_labels.txt
        the original MNIST-M release (`mnist_m.tar.gz`, lines "00000000.png 5").
    root/SynthDigits/synth_{train,test}_32x32.mat
        the original SynthDigits .mat files (X: 32x32x3xN uint8, y: N x 1), as in
        FedBN's raw `data.zip`.
    root/MNIST/raw/*-ubyte           torchvision.datasets.MNIST(root)
    root/SVHN/{train,test}_32x32.mat torchvision.datasets.SVHN(root / "SVHN") layout
    root/USPS/usps.bz2, usps.t.bz2   torchvision.datasets.USPS(root / "USPS")
    root/PACS/<domain>/<class>/*.jpg|png  (+ optional <domain>_{train,crossval}_kfold.txt)
    root/DomainNet/<domain>/<class>/*.jpg + root/DomainNet/<domain>_{train,test}.txt
    root/mitdb/<record>.{hea,dat,atr}    wfdb.dl_database("mitdb", root / "mitdb")

Normalisation (`RawDataset.mean/std`): the digit sets use FedBN's / FedGCR's
Normalize((0.5,)*3, (0.5,)*3); PACS and DomainNet use none (mean 0, std 1), as
FedGCR's `prepare_domainnet_uneven` (ToTensor only); MIT-BIH uses the loaded beats'
own mean / std (population).

Pickle note: FedBN's .pkl files are Python pickles (or .npy files holding a pickled object
array). They are read by a restricted unpickler that builds numpy arrays and nothing else
(`safe_unpickle`): a planted pickle that names any other Python object is refused, never run.

Downloads (`fedrepro prepare`) go through fedrepro.data.downloads: DomainNet's archives and
split files are verified against their published md5 and size before use; FedBN's
digit_dataset.zip, DomainBed's PACS.zip and the MIT-BIH records have no published checksum
and are downloaded only with FEDREPRO_ALLOW_UNPINNED_DOWNLOADS=1 (their sha256 is then
recorded in the dataset's provenance). Archives are unpacked into a temporary folder that is
renamed into place, and every path read from a list file (DomainNet's and MNIST-M's) must
stay inside its data folder.
"""

from __future__ import annotations

import codecs
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.datasets import DatasetSpec, _register
from fedrepro.data.downloads import (Download, UnpinnedDownloadError, contained, extract_zip, fetch, file_digests, record,
                                     require_unpinned_ok)
from fedrepro.io import replace_dir
from fedrepro.registry import ConfigError, Param, show

# ===================================================================== shared helpers

DIGIT_MEAN = (0.5, 0.5, 0.5)  # FedBN / FedGCR: transforms.Normalize((0.5,)*3, (0.5,)*3)
DIGIT_STD = (0.5, 0.5, 0.5)
NO_NORM_MEAN = (0.0, 0.0, 0.0)  # FedGCR DomainNet / PACS: ToTensor() only
NO_NORM_STD = (1.0, 1.0, 1.0)


def _missing(title: str, folder: Path, expected: Iterable[str], how: Sequence[str], detail: str = "") -> DataMissingError:
    """A DataMissingError whose message names the files, the folder and how to get them."""
    lines = [f"{title} missing from {folder}:", *(f"  {e}" for e in expected), "To get them:"]
    lines += [f"  - {h}" for h in how]
    if detail:
        lines.append(f"(automatic download failed: {detail})")
    return DataMissingError("\n".join(lines))


def _refused(title: str, folder: Path, expected: Iterable[str], how: Sequence[str], exc: UnpinnedDownloadError) -> DataMissingError:
    """The files are missing and their download needs the operator's opt-in: say so first."""
    return DataMissingError(f"{exc}\n" + str(_missing(title, folder, expected, how)))


def _check_list(where: str, key: str, value: Any, allowed: Sequence[str]) -> list[str]:
    """A non-empty list of distinct names drawn from `allowed` (ConfigError otherwise)."""
    items = list(value)
    bad = [v for v in items if v not in allowed]
    if not items or bad or len(set(items)) != len(items):
        raise ConfigError(
            f"{where}: key '{key}' has value {show(value)}; allowed: a non-empty list of distinct names from {list(allowed)}"
        )
    return items


def evenly_spaced(n: int, k: int | None) -> np.ndarray:
    """Indices of k rows spread evenly over n (all n when k is None or >= n); deterministic."""
    if k is None or k >= n:
        return np.arange(n)
    return np.unique(np.round(np.linspace(0, n - 1, k)).astype(np.int64))


def to_rgb_chw(images: np.ndarray, size: int | None = None) -> np.ndarray:
    """(N,H,W) grayscale or (N,H,W,3) RGB uint8 -> (N,3,S,S) uint8.

    Grayscale is replicated to 3 channels (torchvision Grayscale(num_output_channels=3));
    resizing uses PIL bilinear, which is what transforms.Resize([S, S]) does on PIL images.
    """
    from PIL import Image

    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images, got {images.dtype}")
    gray = images.ndim == 3
    if not gray and not (images.ndim == 4 and images.shape[-1] == 3):
        raise ValueError(f"expected (N,H,W) or (N,H,W,3) images, got shape {images.shape}")
    n, h, w = images.shape[:3]
    if size is not None and (h, w) != (size, size):
        out = np.empty((n, size, size) if gray else (n, size, size, 3), dtype=np.uint8)
        for i in range(n):
            out[i] = np.asarray(Image.fromarray(images[i]).resize((size, size), Image.Resampling.BILINEAR))
        images = out
    if gray:
        return np.ascontiguousarray(np.repeat(images[:, None, :, :], 3, axis=1))
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2))


def _load_rgb_file(path: str, size: int) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")  # L / P / RGBA -> RGB (alpha dropped), as FedBN's loaders
            if im.size != (size, size):
                im = im.resize((size, size), Image.Resampling.BILINEAR)
            return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
    except OSError as exc:
        raise DataMissingError(f"cannot read image {path}: {exc}") from None


def read_images(paths: Sequence[str], size: int) -> np.ndarray:
    """Decode image files to (N,3,size,size) uint8 (RGB, PIL bilinear resize), threaded, in order."""
    out = np.empty((len(paths), 3, size, size), dtype=np.uint8)
    if not paths:
        return out
    workers = max(1, min(8, os.cpu_count() or 1, len(paths)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, arr in enumerate(pool.map(lambda p: _load_rgb_file(p, size), paths, chunksize=64)):
            out[i] = arr
    return out


def _domain_images_dataset(
    name: str, paths: list[str], labels: list[int], splits: list[int], dom: list[int], image_size: int, num_classes: int, source: str
) -> RawDataset:
    """Image files of several domains as one RawDataset, unnormalised like FedGCR's ToTensor-only loaders (PACS, DomainNet)."""
    return RawDataset(
        name=name,
        x=read_images(paths, image_size),
        y=np.asarray(labels, dtype=np.int64),
        num_classes=num_classes,
        official_split=np.asarray(splits, dtype=np.int8),
        mean=NO_NORM_MEAN,
        std=NO_NORM_STD,
        source=source,
        groups={"domain": np.asarray(dom, dtype=np.int64)},
    )


def _stack_splits(pieces: Iterable[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, labels, split) from (official split, images, labels) pieces, concatenated in order."""
    xs, ys, splits = [], [], []
    for split, x, y in pieces:
        xs.append(x)
        ys.append(y)
        splits.append(np.full(len(y), split, dtype=np.int8))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(splits)


def _digit_labels(labels: Any, where: str) -> np.ndarray:
    """Integer 0..9 labels from a (N,), (N,1) or one-hot (N,10) array; SVHN-style 10 -> 0."""
    y = np.asarray(labels)
    if y.ndim == 2 and y.shape[1] == 10:
        y = y.argmax(axis=1)
    y = y.reshape(-1).astype(np.int64)
    y[y == 10] = 0
    if y.size and (y.min() < 0 or y.max() > 9):
        raise DataMissingError(f"{where}: labels outside 0..9 (min {y.min()}, max {y.max()}); the file is not the expected one")
    return y


# ============================================================= FedBN digit release

FEDBN_DIGITS_DIR = "fedbn_digits"
FEDBN_DIGITS_GDRIVE_ID = "1moBE_ASD5vIOaU8ZHm_Nsj0KAfX5T0Sf"
FEDBN_DIGITS_URL = f"https://drive.google.com/file/d/{FEDBN_DIGITS_GDRIVE_ID}/view"
FEDBN_DIGITS_ZIP = "digit_dataset.zip"
#: Digit-Five domain name -> folder name in FedBN's release.
FEDBN_DIGIT_FOLDERS = {"mnist": "MNIST", "mnistm": "MNIST_M", "svhn": "SVHN", "syn": "SynthDigits", "usps": "USPS"}
FEDBN_HOW = [
    f"run `fedrepro prepare` with internet access and `gdown` installed (pip install gdown): it downloads FedBN's "
    f"{FEDBN_DIGITS_ZIP} (Google Drive id {FEDBN_DIGITS_GDRIVE_ID}) and unpacks it, or",
    f"download {FEDBN_DIGITS_ZIP} from {FEDBN_DIGITS_URL} (linked from https://github.com/med-air/FedBN), unzip it and "
    "move its folders MNIST, MNIST_M, SVHN, SynthDigits, USPS into the folder above",
]


def fedbn_dir(root: Path, domain: str) -> Path:
    return Path(root) / FEDBN_DIGITS_DIR / FEDBN_DIGIT_FOLDERS[domain]


def _fedbn_parts(folder: Path) -> list[Path]:
    """train_part0.pkl, train_part1.pkl, ... (contiguous from 0)."""
    parts = []
    while (folder / "partitions" / f"train_part{len(parts)}.pkl").is_file():
        parts.append(folder / "partitions" / f"train_part{len(parts)}.pkl")
    return parts


def fedbn_present(root: Path, domain: str) -> bool:
    folder = fedbn_dir(root, domain)
    return bool(_fedbn_parts(folder)) and (folder / "test.pkl").is_file()


def _fedbn_expected(root: Path, domains: Iterable[str]) -> list[str]:
    return [
        f"{FEDBN_DIGITS_DIR}/{FEDBN_DIGIT_FOLDERS[d]}/partitions/train_part0.pkl .. train_part9.pkl and "
        f"{FEDBN_DIGITS_DIR}/{FEDBN_DIGIT_FOLDERS[d]}/test.pkl"
        for d in domains
        if not fedbn_present(root, d)
    ]


def _allowed_pickle_globals() -> dict[tuple[str, str], Any]:
    """The only callables a FedBN pickle may name: what numpy arrays (and their dtypes) pickle to."""
    try:
        from numpy._core import multiarray as ma, numeric as nm
    except ImportError:  # numpy < 2
        from numpy.core import multiarray as ma, numeric as nm
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
                                           ("_codecs", "encode"): codecs.encode}  # protocol 2 stores array bytes through it
    for pkg in ("numpy.core", "numpy._core"):
        allowed[(f"{pkg}.multiarray", "_reconstruct")] = ma._reconstruct
        allowed[(f"{pkg}.multiarray", "scalar")] = ma.scalar
        allowed[(f"{pkg}.numeric", "_frombuffer")] = nm._frombuffer
    return allowed


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Builds tuples, lists, numbers and numpy arrays; refuses every other global (os.system, ...)."""

    _allowed = None

    def find_class(self, module: str, name: str):
        if _NumpyOnlyUnpickler._allowed is None:
            _NumpyOnlyUnpickler._allowed = _allowed_pickle_globals()
        try:
            return _NumpyOnlyUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names the Python object {module}.{name}; only numpy arrays are allowed "
                                         "(the file is not FedBN's and was not run)") from None


def safe_unpickle(fh) -> Any:
    """Unpickle numpy arrays (and tuples/lists of them) from the binary file `fh`, nothing else."""
    return _NumpyOnlyUnpickler(fh).load()


def _load_pkl_file(path: Path) -> Any:
    """A FedBN .pkl: a pickle, or a .npy file (np.save of the pair, an object array), read without running code."""
    with open(path, "rb") as fh:
        if fh.read(6) != b"\x93NUMPY":
            fh.seek(0)
            return safe_unpickle(fh)
        fh.seek(0)
        fmt = np.lib.format
        version = fmt.read_magic(fh)
        readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
        if version not in readers:
            raise ValueError(f"unsupported .npy format version {version}")
        shape, fortran, dtype = readers[version](fh)
        if dtype.hasobject:
            return safe_unpickle(fh)  # np.save writes object arrays as one pickle after the header
        fh.seek(0)
        return fmt.read_array(fh, allow_pickle=False)


def _read_pkl_pair(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        images, labels = _load_pkl_file(path)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            MemoryError, RecursionError) as exc:
        raise DataMissingError(f"cannot read {path} as a pickled (images, labels) pair: {exc}") from None
    return np.asarray(images, dtype=np.uint8), _digit_labels(labels, str(path))


def read_fedbn_digits(root: Path, domain: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images NHW[C] uint8, labels, split) of one domain of FedBN's release: parts then test."""
    folder = fedbn_dir(root, domain)
    pieces = []
    for split, files in ((0, _fedbn_parts(folder)), (1, [folder / "test.pkl"])):
        for f in files:
            x, y = _read_pkl_pair(f)
            if len(x) != len(y):
                raise DataMissingError(f"{f}: {len(x)} images but {len(y)} labels")
            pieces.append((split, x, y))
    return _stack_splits(pieces)


def _find_dir_containing(base: Path, name: str, depth: int = 3) -> Path | None:
    """The shallowest folder under `base` holding a sub-folder `name`."""
    frontier = [base]
    for _ in range(depth + 1):
        nxt = []
        for d in frontier:
            if (d / name).is_dir():
                return d
            nxt += sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("__MACOSX"))
        frontier = nxt
    return None


#: FedBN's digit_dataset.zip: no checksum is published (med-air/FedBN's README links the Google
#: Drive file only), so it is downloaded only with the operator's opt-in (fedrepro.data.downloads).
FEDBN_DIGITS_DOWNLOAD = Download(FEDBN_DIGITS_ZIP, FEDBN_DIGITS_URL, gdrive_id=FEDBN_DIGITS_GDRIVE_ID)


def _prepare_fedbn_digits(root: Path, domains: Iterable[str]) -> None:
    """Download, verify and unpack FedBN's digit_dataset.zip if any requested domain is incomplete."""
    root = Path(root)
    domains = list(domains)
    if all(fedbn_present(root, d) for d in domains):
        return
    target = root / FEDBN_DIGITS_DIR
    staging = None
    try:
        target.mkdir(parents=True, exist_ok=True)
        archive = fetch(FEDBN_DIGITS_DOWNLOAD, target)
        staging = extract_zip(archive, root, FEDBN_DIGITS_DIR)
    except UnpinnedDownloadError as exc:
        raise _refused("FedBN Digit-Five files are", target, _fedbn_expected(root, domains), FEDBN_HOW, exc) from None
    except Exception as exc:  # gdown missing, no network, checksum mismatch, bad or unsafe archive, ...
        raise _missing(
            "FedBN Digit-Five files are", target, _fedbn_expected(root, domains), FEDBN_HOW, f"{type(exc).__name__}: {exc}"
        ) from None
    finally:
        (target / FEDBN_DIGITS_ZIP).unlink(missing_ok=True)
    try:
        base = _find_dir_containing(staging, "MNIST_M") or _find_dir_containing(staging, "SynthDigits")
        if base is not None:
            for folder in FEDBN_DIGIT_FOLDERS.values():
                if (base / folder).is_dir():
                    replace_dir(base / folder, target / folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not all(fedbn_present(root, d) for d in domains):
        raise _missing("FedBN Digit-Five files are", target, _fedbn_expected(root, domains), FEDBN_HOW,
                       f"{FEDBN_DIGITS_ZIP} did not contain them")


# ===================================================================== MNIST-M

MNISTM_ORIG_DIR = "mnist_m"
MNISTM_ORIG_URL = "http://yaroslav.ganin.net/ (mnist_m.tar.gz; Ganin et al., JMLR 2016)"
MNISTM_SOURCE = (
    "MNIST-M (Ganin & Lempitsky, ICML 2015): FedBN's pre-processed release "
    f"{FEDBN_DIGITS_URL} ({FEDBN_DIGITS_ZIP}, https://github.com/med-air/FedBN), "
    f"or the original folder release {MNISTM_ORIG_URL}"
)
LAYOUT_CHOICES = ("auto", "fedbn", "original")


def _mnistm_orig_files(root: Path) -> list[Path]:
    d = Path(root) / MNISTM_ORIG_DIR
    return [d / "mnist_m_train", d / "mnist_m_train_labels.txt", d / "mnist_m_test", d / "mnist_m_test_labels.txt"]


def _mnistm_orig_present(root: Path) -> bool:
    return all(p.exists() for p in _mnistm_orig_files(root))


def _mnistm_orig_missing(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in _mnistm_orig_files(root) if not p.exists()]


def read_mnistm_original(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ganin's folders: mnist_m_<split>/<name>.png listed in mnist_m_<split>_labels.txt."""
    d = Path(root) / MNISTM_ORIG_DIR
    pieces = []
    for split, name in ((0, "train"), (1, "test")):
        names, labels = [], []
        listing = d / f"mnist_m_{name}_labels.txt"
        for i, line in enumerate(_read_list_lines(listing), 1):
            fname, label = _list_entry(listing, i, line)
            names.append(contained(d / f"mnist_m_{name}", fname, f"{listing}, line {i}"))
            labels.append(label)
        missing = [n for n in names if not os.path.isfile(n)]
        if missing:
            raise DataMissingError(f"MNIST-M: {len(missing)} images listed in mnist_m_{name}_labels.txt are missing, e.g. {missing[:3]}")
        x = read_images(names, 28).transpose(0, 2, 3, 1)  # back to NHWC like the other readers
        pieces.append((split, x, _digit_labels(labels, str(d / f"mnist_m_{name}_labels.txt"))))
    return _stack_splits(pieces)


def _read_list_lines(path: Path) -> list[str]:
    """The non-empty lines of a list file (MNIST-M labels, DomainNet splits) as text."""
    try:
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataMissingError(f"cannot read {path} as a UTF-8 list of '<image path> <label>' lines: {exc}") from None


def _list_entry(path: Path, lineno: int, line: str) -> tuple[str, int]:
    """'<relative image path> <integer label>' -> (path, label); DataMissingError naming the line otherwise."""
    parts = line.split()
    if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
        raise DataMissingError(f"{path}, line {lineno}: {show(line)} is not '<image path> <integer label>'; the file is "
                               "not the expected one")
    return parts[0], int(parts[1])


def _mnistm_how() -> list[str]:
    return FEDBN_HOW + [
        f"or use the original release: unpack mnist_m.tar.gz ({MNISTM_ORIG_URL}) so that {MNISTM_ORIG_DIR}/mnist_m_train/, "
        f"{MNISTM_ORIG_DIR}/mnist_m_train_labels.txt, {MNISTM_ORIG_DIR}/mnist_m_test/ and "
        f"{MNISTM_ORIG_DIR}/mnist_m_test_labels.txt lie in the data root (layout='original')"
    ]


def _pick_layout(root: Path, layout: str, fedbn_ok: bool, orig_ok: bool) -> str | None:
    if layout == "fedbn":
        return "fedbn" if fedbn_ok else None
    if layout == "original":
        return "original" if orig_ok else None
    return "fedbn" if fedbn_ok else ("original" if orig_ok else None)


def _read_layout(root: Path, layout: str, domain: str, title: str, orig_missing: list[str], how: list[str]) -> str:
    """The layout to read a two-release digit domain (mnistm, syn) from; if there is none, a DataMissingError
    naming what each allowed layout lacks."""
    chosen = _pick_layout(root, layout, fedbn_present(root, domain), not orig_missing)
    if chosen is None:
        expected = []
        if layout in ("auto", "fedbn"):
            expected += _fedbn_expected(root, [domain])
        if layout in ("auto", "original"):
            expected += orig_missing
        raise _missing(f"{title} files (layout={layout!r}) are", root, expected, how)
    return chosen


def read_mnistm(root: Path, layout: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(NHWC uint8 images, labels, split, layout used); DataMissingError at once if absent."""
    root = Path(root)
    chosen = _read_layout(root, layout, "mnistm", "MNIST-M", _mnistm_orig_missing(root), _mnistm_how())
    if chosen == "fedbn":
        x, y, s = read_fedbn_digits(root, "mnistm")
        if x.ndim == 3:  # defensively accept a grayscale variant
            x = np.repeat(x[..., None], 3, axis=-1)
        return x, y, s, chosen
    return (*read_mnistm_original(root), chosen)


def _prepare_mnistm(root: Path, params: dict) -> None:
    root = Path(root)
    if _pick_layout(root, params["layout"], fedbn_present(root, "mnistm"), _mnistm_orig_present(root)):
        return
    if params["layout"] == "original":
        raise _missing("MNIST-M original files are", root / MNISTM_ORIG_DIR, _mnistm_orig_missing(root), _mnistm_how()[-1:])
    _prepare_fedbn_digits(root, ["mnistm"])


def _load_layout_digits(name: str, read: Callable[[Path, str], tuple], source: str, root: Path, params: dict) -> RawDataset:
    """A single digit domain (mnistm, syn) as 3-channel images, with the layout it was read from in `source`."""
    x, y, split, layout = read(root, params["layout"])
    return RawDataset(
        name=name,
        x=to_rgb_chw(x),
        y=y,
        num_classes=10,
        official_split=split,
        mean=DIGIT_MEAN,
        std=DIGIT_STD,
        source=f"{source} [layout: {layout}]",
    )


def _load_mnistm(root: Path, params: dict) -> RawDataset:
    return _load_layout_digits("mnistm", read_mnistm, MNISTM_SOURCE, root, params)


LAYOUT_PARAM = Param(
    "auto",
    "which on-disk release to read: 'fedbn' (FedBN's .pkl partitions + test.pkl: what FedBN/FedGCR use), "
    "'original' (the original release), or 'auto' (fedbn if present, else original)",
    str,
    choices=LAYOUT_CHOICES,
)

_register(
    DatasetSpec(
        name="mnistm",
        summary="MNIST-M: MNIST digits blended over BSDS500 colour patches, 3x28x28, 10 classes",
        source=MNISTM_SOURCE,
        num_classes=10,
        sample_shape=(3, 28, 28),
        size="FedBN release: 7,438 train (10 partitions) + 14,000 test; original: 59,001 train + 9,001 test",
        params={"layout": LAYOUT_PARAM},
        prepare=_prepare_mnistm,
        load=_load_mnistm,
    )
)


# ================================================================== SynthDigits

SYN_ORIG_DIR = "SynthDigits"
SYN_ORIG_FILES = ("synth_train_32x32.mat", "synth_test_32x32.mat")
SYN_ORIG_URL = "http://yaroslav.ganin.net/ (SynNumbers; Ganin & Lempitsky, ICML 2015)"
SYN_SOURCE = (
    "SynthDigits / SynNumbers (Ganin & Lempitsky, ICML 2015): FedBN's pre-processed release "
    f"{FEDBN_DIGITS_URL} ({FEDBN_DIGITS_ZIP}, https://github.com/med-air/FedBN), "
    f"or the original synth_{{train,test}}_32x32.mat from {SYN_ORIG_URL}"
)


def _syn_orig_present(root: Path) -> bool:
    return all((Path(root) / SYN_ORIG_DIR / f).is_file() for f in SYN_ORIG_FILES)


def _syn_orig_missing(root: Path) -> list[str]:
    return [f"{SYN_ORIG_DIR}/{f}" for f in SYN_ORIG_FILES if not (root / SYN_ORIG_DIR / f).is_file()]


def _read_svhn_style_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """SVHN-format .mat: X (32, 32, 3, N) uint8, y (N, 1) -> (N, 32, 32, 3), labels (10 -> 0)."""
    import scipy.io as sio

    try:
        mat = sio.loadmat(str(path))
    except (OSError, ValueError, NotImplementedError) as exc:  # NotImplementedError: v7.3 (HDF5) files
        raise DataMissingError(f"cannot read {path} as a MATLAB v5 file with X and y: {exc}") from None
    if "X" not in mat or "y" not in mat:
        raise DataMissingError(f"{path}: expected variables X and y, found {sorted(k for k in mat if not k.startswith('__'))}")
    x = np.ascontiguousarray(np.asarray(mat["X"], dtype=np.uint8).transpose(3, 0, 1, 2))
    return x, _digit_labels(mat["y"], str(path))


def _read_mat_splits(folder: Path, files: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SVHN-format train then test .mat files of one folder as (NHWC uint8, labels, split) (SVHN, SynthDigits)."""
    return _stack_splits((split, *_read_svhn_style_mat(folder / f)) for split, f in enumerate(files))


def read_syn(root: Path, layout: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    root = Path(root)
    chosen = _read_layout(root, layout, "syn", "SynthDigits", _syn_orig_missing(root), _syn_how())
    if chosen == "fedbn":
        return (*read_fedbn_digits(root, "syn"), chosen)
    return (*_read_mat_splits(root / SYN_ORIG_DIR, SYN_ORIG_FILES), chosen)


def _syn_how() -> list[str]:
    return FEDBN_HOW + [
        f"or use the original release: put {SYN_ORIG_FILES[0]} and {SYN_ORIG_FILES[1]} ({SYN_ORIG_URL}; also inside "
        f"FedBN's raw data.zip) into {SYN_ORIG_DIR}/ in the data root (layout='original')"
    ]


def _prepare_syn(root: Path, params: dict) -> None:
    root = Path(root)
    if _pick_layout(root, params["layout"], fedbn_present(root, "syn"), _syn_orig_present(root)):
        return
    if params["layout"] == "original":
        raise _missing("SynthDigits original files are", root / SYN_ORIG_DIR, SYN_ORIG_FILES, _syn_how()[-1:])
    _prepare_fedbn_digits(root, ["syn"])


def _load_syn(root: Path, params: dict) -> RawDataset:
    return _load_layout_digits("syn", read_syn, SYN_SOURCE, root, params)


_register(
    DatasetSpec(
        name="syn",
        summary="SynthDigits: synthetic Windows-font digits on varied backgrounds, 3x32x32, 10 classes",
        source=SYN_SOURCE,
        num_classes=10,
        sample_shape=(3, 32, 32),
        size="FedBN release: 7,438 train (10 partitions) + 97,791 test; original: 479,400 train + 9,553 test",
        params={"layout": LAYOUT_PARAM},
        prepare=_prepare_syn,
        load=_load_syn,
    )
)


# ==================================================================== Digit-Five

DIGIT5_DOMAINS = ("mnist", "mnistm", "svhn", "syn", "usps")
#: FedGCR's domain order for the Domain Imbalance Factor (utils/util.py prepare_digit_uneven,
#: decay_order); pass it as `domains` to get these domain ids.
FEDGCR_DIGIT5_ORDER = ("mnist", "usps", "syn", "mnistm", "svhn")
SVHN_DIR = "SVHN"
SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")
USPS_DIR = "USPS"
USPS_FILES = ("usps.bz2", "usps.t.bz2")
MNIST_RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
DIGIT5_SOURCE = (
    "Digit-Five: MNIST (http://yann.lecun.com/exdb/mnist/ via torchvision.datasets.MNIST), "
    "SVHN (http://ufldl.stanford.edu/housenumbers/, torchvision.datasets.SVHN format), "
    "USPS (https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass.html#usps via torchvision.datasets.USPS), "
    f"MNIST-M and SynthDigits (see `mnistm`, `syn`); or all five from FedBN's release {FEDBN_DIGITS_URL}"
)


def _tv_missing(root: Path, domain: str) -> list[str]:
    root = Path(root)
    if domain == "mnist":
        return [f"MNIST/raw/{f}" for f in MNIST_RAW_FILES if not (root / "MNIST" / "raw" / f).is_file()]
    if domain == "svhn":
        return [f"{SVHN_DIR}/{f}" for f in SVHN_FILES if not (root / SVHN_DIR / f).is_file()]
    if domain == "usps":
        return [f"{USPS_DIR}/{f}" for f in USPS_FILES if not (root / USPS_DIR / f).is_file()]
    raise KeyError(domain)


def _read_tv_domain(root: Path, domain: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MNIST / SVHN / USPS with their official train/test splits: (NHW[C] uint8, labels, split)."""
    root = Path(root)
    if domain == "svhn":
        # A small private reader of the torchvision SVHN layout (torchvision's class insists on
        # the MD5 of the full files); same arrays: X (32,32,3,N), y with 10 meaning digit 0.
        return _read_mat_splits(root / SVHN_DIR, SVHN_FILES)
    from torchvision import datasets as tvd

    pieces = []
    for split, train in ((0, True), (1, False)):
        try:
            if domain == "mnist":
                ds = tvd.MNIST(str(root), train=train, download=False)
                x, y = ds.data.numpy(), ds.targets.numpy()
            else:
                ds = tvd.USPS(str(root / USPS_DIR), train=train, download=False)
                x, y = np.asarray(ds.data), np.asarray(ds.targets)
        except (RuntimeError, OSError, ValueError, EOFError) as exc:
            raise DataMissingError(f"cannot read {domain.upper()} under {root}: {exc}") from None
        pieces.append((split, np.asarray(x, dtype=np.uint8), _digit_labels(y, domain)))
    return _stack_splits(pieces)


def _digit5_missing(root: Path, domains: Sequence[str], source: str) -> list[str]:
    root = Path(root)
    if source == "fedbn":
        return _fedbn_expected(root, domains)
    out = []
    for d in domains:
        if d in ("mnist", "svhn", "usps"):
            out += _tv_missing(root, d)
        elif d == "mnistm" and not (fedbn_present(root, d) or _mnistm_orig_present(root)):
            out += _fedbn_expected(root, [d]) + [f"  (or the original MNIST-M folders in {MNISTM_ORIG_DIR}/)"]
        elif d == "syn" and not (fedbn_present(root, d) or _syn_orig_present(root)):
            out += _fedbn_expected(root, [d]) + [f"  (or {SYN_ORIG_DIR}/{SYN_ORIG_FILES[0]} and {SYN_ORIG_FILES[1]})"]
    return out


def _digit5_how(source: str) -> list[str]:
    if source == "fedbn":
        return FEDBN_HOW
    return [
        "run `fedrepro prepare` with internet access: torchvision downloads MNIST (into MNIST/raw), "
        f"SVHN ({SVHN_DIR}/, http://ufldl.stanford.edu/housenumbers/) and USPS ({USPS_DIR}/), and "
        "MNIST-M / SynthDigits come from FedBN's release (needs `pip install gdown`), or",
        "place the files by hand: MNIST IDX files (gunzipped) in MNIST/raw, SVHN's train_32x32.mat and test_32x32.mat "
        f"in {SVHN_DIR}/, USPS's usps.bz2 and usps.t.bz2 in {USPS_DIR}/, and MNIST-M / SynthDigits as described for the "
        f"`mnistm` / `syn` datasets ({FEDBN_DIGITS_URL})",
    ]


def _digit5_domains(params: dict) -> list[str]:
    return _check_list("dataset 'digit5'", "domains", params["domains"], DIGIT5_DOMAINS)


def _prepare_digit5(root: Path, params: dict) -> None:
    root = Path(root)
    domains = _digit5_domains(params)
    if not _digit5_missing(root, domains, params["source"]):
        return
    if params["source"] == "fedbn":
        _prepare_fedbn_digits(root, domains)
        return
    try:
        from torchvision import datasets as tvd

        for d in domains:
            if d in ("mnist", "svhn", "usps") and _tv_missing(root, d):
                for train in (True, False):
                    if d == "mnist":
                        tvd.MNIST(str(root), train=train, download=True)
                    elif d == "svhn":
                        tvd.SVHN(str(root / SVHN_DIR), split="train" if train else "test", download=True)
                    else:
                        tvd.USPS(str(root / USPS_DIR), train=train, download=True)
    except Exception as exc:
        raise _missing("Digit-Five files are", root, _digit5_missing(root, domains, "torchvision"),
                       _digit5_how("torchvision"), f"{type(exc).__name__}: {exc}") from None
    if "mnistm" in domains:
        _prepare_mnistm(root, {"layout": "auto"})
    if "syn" in domains:
        _prepare_syn(root, {"layout": "auto"})


def _load_digit5(root: Path, params: dict) -> RawDataset:
    root = Path(root)
    domains = _digit5_domains(params)
    source, size, cap = params["source"], int(params["image_size"]), params["max_per_domain"]
    missing = _digit5_missing(root, domains, source)
    if missing:
        raise _missing(f"Digit-Five files (source={source!r}) are", root, missing, _digit5_how(source))
    xs, ys, splits, dom = [], [], [], []
    used = []
    for i, d in enumerate(domains):
        if source == "fedbn":
            x, y, s = read_fedbn_digits(root, d)
            used.append(f"{d}: fedbn")
        elif d == "mnistm":
            x, y, s, layout = read_mnistm(root)
            used.append(f"mnistm: {layout}")
        elif d == "syn":
            x, y, s, layout = read_syn(root)
            used.append(f"syn: {layout}")
        else:
            x, y, s = _read_tv_domain(root, d)
            used.append(f"{d}: official")
        keep = np.concatenate([np.flatnonzero(s == k)[evenly_spaced(int((s == k).sum()), cap)] for k in (0, 1)])
        xs.append(to_rgb_chw(x[keep], size))
        ys.append(y[keep])
        splits.append(s[keep])
        dom.append(np.full(len(keep), i, dtype=np.int64))
    return RawDataset(
        name="digit5",
        x=np.concatenate(xs),
        y=np.concatenate(ys),
        num_classes=10,
        official_split=np.concatenate(splits),
        mean=DIGIT_MEAN,
        std=DIGIT_STD,
        source=f"{DIGIT5_SOURCE} [domains (id order): {', '.join(used)}]",
        groups={"domain": np.concatenate(dom)},
    )


_register(
    DatasetSpec(
        name="digit5",
        summary="Digit-Five: MNIST, MNIST-M, SVHN, SynthDigits, USPS as 3xSxS RGB, 10 classes, domain id per sample",
        source=DIGIT5_SOURCE,
        num_classes=10,
        sample_shape=(3, 32, 32),
        size="official splits: ~70k + 68k + 99k + 489k + 9.3k images; FedBN release: 7,438 train per domain + 20 % test",
        params={
            "image_size": Param(32, "common side S of the 3xSxS images (PIL bilinear resize; FedGCR resizes to 224)", int, minimum=4),
            "source": Param(
                "torchvision",
                "'torchvision': MNIST/SVHN/USPS official splits read via torchvision's layouts, MNIST-M/SynthDigits as "
                "`mnistm`/`syn` (layout auto); 'fedbn': all five from FedBN's pre-processed release (FedBN/FedGCR's data)",
                str,
                choices=("torchvision", "fedbn"),
            ),
            "domains": Param(
                list(DIGIT5_DOMAINS),
                "the domains to include; groups['domain'] is the index in this list "
                f"(FedGCR's DIF order is {list(FEDGCR_DIGIT5_ORDER)})",
                (list, tuple),
            ),
            "max_per_domain": Param(
                None,
                "optional cap on the images of each (domain, official split); evenly spaced over file order; None = all",
                (int, type(None)),
                minimum=1,
            ),
        },
        prepare=_prepare_digit5,
        load=_load_digit5,
    )
)


# ========================================================================= PACS

PACS_DIR = "PACS"
PACS_DOMAINS = ("photo", "art_painting", "cartoon", "sketch")
PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")  # official label order 1..7
PACS_GDRIVE_ID = "1JFr8f805nMUelQWWmfnJR3y4_SYoN5Pd"  # DomainBed's PACS.zip (folder kfold/)
PACS_SOURCE = (
    "PACS (Li et al., ICCV 2017), https://domaingeneralization.github.io/ ; image folders <domain>/<class>/ as in the "
    f"release's kfold/ folder (DomainBed mirror: https://drive.google.com/uc?id={PACS_GDRIVE_ID})"
)
#: DomainBed's PACS.zip: no checksum is published, so downloaded only with the operator's opt-in.
PACS_DOWNLOAD = Download("PACS.zip", f"https://drive.google.com/uc?id={PACS_GDRIVE_ID}", gdrive_id=PACS_GDRIVE_ID)
PACS_HOW = [
    f"run `fedrepro prepare` with internet access and `gdown` installed (pip install gdown): it downloads DomainBed's "
    f"PACS.zip (Google Drive id {PACS_GDRIVE_ID}) and renames its kfold/ folder to {PACS_DIR}/, or",
    "download PACS from https://domaingeneralization.github.io/ (or the Google Drive link above), unzip it and rename "
    f"the kfold/ folder to {PACS_DIR}/ in the data root",
    f"for split='kfold' also put the official split lists <domain>_train_kfold.txt and <domain>_crossval_kfold.txt "
    f"(from the same site) into {PACS_DIR}/",
]


def _pacs_missing(root: Path, domains: Sequence[str], split: str) -> list[str]:
    base = Path(root) / PACS_DIR
    out = [f"{PACS_DIR}/{d}/{c}/" for d in domains for c in PACS_CLASSES if not (base / d / c).is_dir()]
    if split == "kfold":
        out += [
            f"{PACS_DIR}/{d}_{s}_kfold.txt" for d in domains for s in ("train", "crossval") if not (base / f"{d}_{s}_kfold.txt").is_file()
        ]
    return out


def _last3(path: str) -> str:
    return "/".join(path.strip().replace("\\", "/").strip("/").split("/")[-3:])


def _pacs_samples(root: Path, domain: str, split: str) -> tuple[list[str], list[int], list[int]]:
    """(paths, labels, official split) of one domain, in sorted class / file order."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    base = Path(root) / PACS_DIR
    class_to_idx = {c: i for i, c in enumerate(PACS_CLASSES)}
    try:
        samples = make_dataset(str(base / domain), class_to_idx, extensions=IMG_EXTENSIONS)
    except FileNotFoundError as exc:  # a class folder without any image
        raise DataMissingError(f"PACS: {exc} (under {base / domain})\n" + "\n".join(PACS_HOW)) from None
    paths = [p for p, _ in samples]
    labels = [int(t) for _, t in samples]
    if split == "none":
        return paths, labels, [0] * len(paths)
    listed: dict[str, int] = {}
    for k, s in ((0, "train"), (1, "crossval")):
        for line in (base / f"{domain}_{s}_kfold.txt").read_text().splitlines():
            if line.strip():
                listed[_last3(line.split()[0])] = k
    by_key = {_last3(os.path.relpath(p, base)): (p, t) for p, t in zip(paths, labels)}
    absent = [k for k in listed if k not in by_key]
    if absent:
        raise DataMissingError(f"PACS: {len(absent)} images listed in the {domain} kfold files are missing under {base}, e.g. {absent[:3]}")
    keys = [k for k in by_key if k in listed]  # folder order; unlisted images are dropped
    return [by_key[k][0] for k in keys], [by_key[k][1] for k in keys], [listed[k] for k in keys]


def _prepare_pacs(root: Path, params: dict) -> None:
    root = Path(root)
    domains = _check_list("dataset 'pacs'", "domains", params["domains"], PACS_DOMAINS)
    missing = _pacs_missing(root, domains, "none")
    if missing:
        staging = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging = extract_zip(fetch(PACS_DOWNLOAD, root), root, PACS_DIR)
            src = _find_dir_containing(staging, "art_painting")
            if src is None:
                raise DataMissingError("PACS.zip holds no art_painting/ folder")
            replace_dir(src, root / PACS_DIR)
        except UnpinnedDownloadError as exc:
            raise _refused("PACS image folders are", root / PACS_DIR, _pacs_missing(root, domains, params["split"]),
                           PACS_HOW, exc) from None
        except Exception as exc:
            raise _missing("PACS image folders are", root / PACS_DIR, _pacs_missing(root, domains, params["split"]),
                           PACS_HOW, f"{type(exc).__name__}: {exc}") from None
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            (root / "PACS.zip").unlink(missing_ok=True)
    missing = _pacs_missing(root, domains, params["split"])
    if missing:
        raise _missing("PACS files are", root / PACS_DIR, missing, PACS_HOW)


def _load_pacs(root: Path, params: dict) -> RawDataset:
    root = Path(root)
    domains = _check_list("dataset 'pacs'", "domains", params["domains"], PACS_DOMAINS)
    missing = _pacs_missing(root, domains, params["split"])
    if missing:
        raise _missing("PACS files are", root / PACS_DIR, missing, PACS_HOW)
    paths, labels, splits, dom = [], [], [], []
    for i, d in enumerate(domains):
        p, y, s = _pacs_samples(root, d, params["split"])
        paths += p
        labels += y
        splits += s
        dom += [i] * len(p)
    source = f"{PACS_SOURCE} [domains (id order): {', '.join(domains)}; split: {params['split']}]"
    return _domain_images_dataset("pacs", paths, labels, splits, dom, int(params["image_size"]), len(PACS_CLASSES), source)


_register(
    DatasetSpec(
        name="pacs",
        summary="PACS: photo / art_painting / cartoon / sketch, 7 object classes, 3xSxS, domain id per sample",
        source=PACS_SOURCE,
        num_classes=7,
        sample_shape=(3, 64, 64),
        size="9,991 images (photo 1,670, art_painting 2,048, cartoon 2,344, sketch 3,929)",
        params={
            "image_size": Param(64, "side S of the 3xSxS images (PIL bilinear resize; FedGCR resizes to 224)", int, minimum=4),
            "domains": Param(list(PACS_DOMAINS), "the domains to include; groups['domain'] is the index in this list", (list, tuple)),
            "split": Param(
                "none",
                "'none': every image has official_split 0 (FedGCR splits within each domain); 'kfold': the release's "
                "<domain>_train_kfold.txt -> 0 and <domain>_crossval_kfold.txt -> 1",
                str,
                choices=("none", "kfold"),
            ),
        },
        prepare=_prepare_pacs,
        load=_load_pacs,
    )
)


# ==================================================================== DomainNet

DOMAINNET_DIR = "DomainNet"
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
#: The 10-class subset of FedBN (utils/data_utils.py DomainNetDataset label_dict) that FedGCR
#: reuses (shared/reference/methods.md section 5.6); label = position in this tuple.
FEDBN_DOMAINNET_CLASSES = ("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill", "wine_glass", "zebra")
DOMAINNET_BASE_URL = "http://csr.bu.edu/ftp/visda/2019/multi-source"
#: The cleaned per-domain archives listed on http://ai.bu.edu/M3SDA/.
DOMAINNET_ZIP_URLS = {
    "clipart": f"{DOMAINNET_BASE_URL}/groundtruth/clipart.zip",
    "infograph": f"{DOMAINNET_BASE_URL}/infograph.zip",
    "painting": f"{DOMAINNET_BASE_URL}/groundtruth/painting.zip",
    "quickdraw": f"{DOMAINNET_BASE_URL}/quickdraw.zip",
    "real": f"{DOMAINNET_BASE_URL}/real.zip",
    "sketch": f"{DOMAINNET_BASE_URL}/sketch.zip",
}
DOMAINNET_TXT_URL = f"{DOMAINNET_BASE_URL}/domainnet/txt/{{domain}}_{{split}}.txt"
#: md5 and size of every DomainNet file (no sha256 is published): datasets-mila/datasets--domainnet
#: (`md5sums` and its git-annex keys MD5E-s<size>--<md5>), the same md5s as the DomainNet loaders of
#: the `ddg` (DomainBed-style) code base and shifthappens' ImageNet-D.
DOMAINNET_PIN_SOURCE = "md5 + size from datasets-mila/datasets--domainnet (md5sums, git-annex keys); same md5 in ddg's loader"
DOMAINNET_PINS: dict[str, tuple[str, int]] = {
    "clipart.zip": ("cd0d8f2d77a4e181449b78ed62bccf1e", 1_270_909_081),
    "infograph.zip": ("720380b86f9e6ab4805bb38b6bd135f8", 4_338_659_804),
    "painting.zip": ("1ae32cdb4f98fe7ab5eb0a351768abfd", 3_679_366_174),
    "quickdraw.zip": ("bdc1b6f09f277da1a263389efe0c7a66", 459_920_701),
    "real.zip": ("dcc47055e8935767784b7162e7c7cca6", 6_062_039_589),
    "sketch.zip": ("658d8009644040ff7ce30bb2e820850f", 2_633_992_926),
    "clipart_train.txt": ("b4349693a7f9c05c53955725c47ed6cb", 1_443_819),
    "clipart_test.txt": ("f5ddbcfd657a3acf9d0f7da10db22565", 628_917),
    "infograph_train.txt": ("379b50054f4ac2018dca4f89421b92d9", 1_683_098),
    "infograph_test.txt": ("779626b50869edffe8ea6941c3755c71", 728_028),
    "painting_train.txt": ("7db0e7ca73ad9982f6e1f7f3ef372c0a", 2_241_901),
    "painting_test.txt": ("232b35dc53f26d414686ae579e38d9b5", 971_888),
    "quickdraw_train.txt": ("b732ced3939ac8efdd8c0a889dca56cc", 5_164_600),
    "quickdraw_test.txt": ("c1a828fdfe216fb109f1c0083a252c6f", 2_213_400),
    "real_train.txt": ("8ebf02c2075fadd564705f0dc7cd6291", 4_440_944),
    "real_test.txt": ("6098816791c3ebed543c71ffa11b9054", 1_911_327),
    "sketch_train.txt": ("1233bd18aa9a8a200bf4cecf1c34ef3e", 1_960_222),
    "sketch_test.txt": ("d8a222e4672cfd585298aa14d02ea441", 850_581),
}


def domainnet_download(name: str) -> Download:
    """The pinned Download of a DomainNet file ('<domain>.zip' or '<domain>_<split>.txt')."""
    if name.endswith(".zip"):
        url = DOMAINNET_ZIP_URLS[name.removesuffix(".zip")]
    else:
        domain, split = name.removesuffix(".txt").rsplit("_", 1)
        url = DOMAINNET_TXT_URL.format(domain=domain, split=split)
    md5, size = DOMAINNET_PINS[name]
    return Download(name, url, md5=md5, size=size, pin_source=DOMAINNET_PIN_SOURCE)
DOMAINNET_SOURCE = (
    "DomainNet (Peng et al., ICCV 2019), http://ai.bu.edu/M3SDA/ : cleaned per-domain zips "
    f"({DOMAINNET_BASE_URL}/...) and the official <domain>_train.txt / <domain>_test.txt splits"
)


def _domainnet_how(domains: Sequence[str]) -> list[str]:
    return [
        "run `fedrepro prepare` with internet access (downloads only the listed domains; clipart 1.3 GB, infograph "
        "4.0 GB, painting 3.7 GB, quickdraw 0.4 GB, real 5.6 GB, sketch 2.5 GB), or",
        f"download from http://ai.bu.edu/M3SDA/ and unzip into {DOMAINNET_DIR}/ (giving {DOMAINNET_DIR}/<domain>/<class>/*.jpg), "
        f"and put the split files there too: "
        + "; ".join(f"{DOMAINNET_ZIP_URLS[d]} + " + DOMAINNET_TXT_URL.format(domain=d, split="{train,test}") for d in domains),
    ]


def _domainnet_missing(root: Path, domains: Sequence[str]) -> list[str]:
    base = Path(root) / DOMAINNET_DIR
    out = []
    for d in domains:
        if not (base / d).is_dir():
            out.append(f"{DOMAINNET_DIR}/{d}/ (image folders <class>/*.jpg)")
        out += [f"{DOMAINNET_DIR}/{d}_{s}.txt" for s in ("train", "test") if not (base / f"{d}_{s}.txt").is_file()]
    return out


def _read_domainnet_txt(path: Path) -> list[tuple[str, str, int]]:
    """Lines 'clipart/aircraft_carrier/clipart_001_000018.jpg 0' -> (relpath, class name, official id).

    Every path must stay inside the DomainNet folder (checked again when the images are read)."""
    rows = []
    base = path.parent
    for i, line in enumerate(_read_list_lines(path), 1):
        rel, label = _list_entry(path, i, line)
        rel = rel.replace("\\", "/")
        contained(base, rel, f"{path}, line {i}")
        parts = rel.split("/")
        if len(parts) < 3:
            raise DataMissingError(f"{path}, line {i}: {show(rel)} is not '<domain>/<class>/<file>'; the file is not the expected one")
        rows.append((rel, parts[-2], label))
    return rows


def _prepare_domainnet(root: Path, params: dict) -> None:
    root = Path(root)
    domains = _check_list("dataset 'domainnet'", "domains", params["domains"], DOMAINNET_DOMAINS)
    base = root / DOMAINNET_DIR
    try:
        for d in domains:
            for s in ("train", "test"):
                if not (base / f"{d}_{s}.txt").is_file():
                    fetch(domainnet_download(f"{d}_{s}.txt"), base)
            if not (base / d).is_dir():
                _fetch_domainnet_images(base, d)
    except Exception as exc:
        raise _missing("DomainNet files are", base, _domainnet_missing(root, domains), _domainnet_how(domains),
                       f"{type(exc).__name__}: {exc}") from None
    missing = _domainnet_missing(root, domains)
    if missing:
        raise _missing("DomainNet files are", base, missing, _domainnet_how(domains))


def _fetch_domainnet_images(base: Path, domain: str) -> None:
    """Download and verify <domain>.zip, unpack it beside `base/domain` and rename its folder into
    place (a killed extraction leaves only a hidden temporary folder, never a half-filled domain)."""
    archive = fetch(domainnet_download(f"{domain}.zip"), base)
    staging = extract_zip(archive, base, domain)
    try:
        src = _find_dir_containing(staging, domain, depth=1)
        if src is None:
            raise DataMissingError(f"{archive.name} holds no {domain}/ folder")
        replace_dir(src / domain, base / domain)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    archive.unlink(missing_ok=True)


def _domainnet_classes(params: dict, official: dict[str, int]) -> list[str]:
    spec = params["classes"]
    where = "dataset 'domainnet'"
    if isinstance(spec, int):
        if not 1 <= spec <= len(official):
            raise ConfigError(f"{where}: key 'classes' has value {spec}; allowed: 1..{len(official)} (first k classes by official id)")
        return sorted(official, key=official.get)[:spec]
    names = list(spec)
    unknown = [c for c in names if c not in official]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(
            f"{where}: key 'classes' has value {spec!r}; allowed: distinct DomainNet class names found in the split files "
            f"(unknown: {unknown}), or an int k for the first k classes by official id"
        )
    return names


def _load_domainnet(root: Path, params: dict) -> RawDataset:
    root = Path(root)
    base = root / DOMAINNET_DIR
    domains = _check_list("dataset 'domainnet'", "domains", params["domains"], DOMAINNET_DOMAINS)
    missing = _domainnet_missing(root, domains)
    if missing:
        raise _missing("DomainNet files are", base, missing, _domainnet_how(domains))
    rows = {(d, s): _read_domainnet_txt(base / f"{d}_{s}.txt") for d in domains for s in ("train", "test")}
    official = {name: cid for r in rows.values() for _, name, cid in r}
    classes = _domainnet_classes(params, official)
    index = {c: i for i, c in enumerate(classes)}
    cap = params["max_per_domain"]
    paths, labels, splits, dom = [], [], [], []
    for i, d in enumerate(domains):
        for k, s in enumerate(("train", "test")):
            sel = [(rel, index[name]) for rel, name, _ in rows[(d, s)] if name in index]
            sel = [sel[j] for j in evenly_spaced(len(sel), cap)]
            paths += [contained(base, rel, f"{base / f'{d}_{s}.txt'}") for rel, _ in sel]
            labels += [lab for _, lab in sel]
            splits += [k] * len(sel)
            dom += [i] * len(sel)
    absent = [p for p in paths if not os.path.isfile(p)]
    if absent:
        raise DataMissingError(
            f"DomainNet: {len(absent)} images listed in the split files are missing, e.g. {absent[:3]}\n"
            + "\n".join(_domainnet_how(domains))
        )
    source = f"{DOMAINNET_SOURCE} [domains (id order): {', '.join(domains)}; classes (label order): {', '.join(classes)}]"
    return _domain_images_dataset("domainnet", paths, labels, splits, dom, int(params["image_size"]), len(classes), source)


_register(
    DatasetSpec(
        name="domainnet",
        summary="DomainNet: clipart / infograph / painting / quickdraw / real / sketch, class subset (default FedBN's 10), domain id",
        source=DOMAINNET_SOURCE,
        num_classes=len(FEDBN_DOMAINNET_CLASSES),
        sample_shape=(3, 64, 64),
        size="~586k images over 345 classes; the default 10-class subset is a few thousand per domain",
        params={
            "image_size": Param(64, "side S of the 3xSxS images (PIL bilinear resize; FedBN/FedGCR resize to 224)", int, minimum=4),
            "classes": Param(
                list(FEDBN_DOMAINNET_CLASSES),
                "class names (label = position in the list; default FedBN's / FedGCR's 10 classes), or an int k for the "
                "first k classes by official id (345 = all)",
                (list, tuple, int),
            ),
            "domains": Param(
                list(DOMAINNET_DOMAINS),
                "the domains to include; groups['domain'] is the index in this list (FedGCR's DIF order: "
                "clipart, real, painting, sketch, quickdraw, infograph)",
                (list, tuple),
            ),
            "max_per_domain": Param(
                None,
                "optional cap on the images of each (domain, official split), evenly spaced over the split file; None = all",
                (int, type(None)),
                minimum=1,
            ),
        },
        prepare=_prepare_domainnet,
        load=_load_domainnet,
    )
)


# ====================================================================== MIT-BIH

MITDB_DIR = "mitdb"
MITDB_FS = 360  # Hz, every MIT-BIH record
#: The 48 records of the MIT-BIH Arrhythmia Database (PhysioNet mitdb 1.0.0).
MITDB_RECORDS = (
    "100 101 102 103 104 105 106 107 108 109 111 112 113 114 115 116 117 118 119 121 122 123 124 "
    "200 201 202 203 205 207 208 209 210 212 213 214 215 217 219 220 221 222 223 228 230 231 232 233 234"
).split()
#: PhysioNet beat annotation codes (https://archive.physionet.org/physiobank/annotations.shtml);
#: every other code ('+', '~', '|', '!', 'x', '[', ']', '"', ...) marks no beat and is dropped.
BEAT_SYMBOLS = ("N", "L", "R", "B", "A", "a", "J", "S", "V", "r", "F", "e", "j", "n", "E", "/", "f", "Q", "?")
#: GRP-FED's 12 arrhythmia classes (shared/papers/grp-fed.txt: "one of 12 arrhythmia classes"; the
#: symbols are not listed there). [RECON] the 12 most frequent beat types of mitdb, class id = position
#: (mitdb counts): N normal 75,052; L left bundle branch block 8,075; R right bundle branch block 7,259;
#: V premature ventricular contraction 7,130; / paced 7,028; A atrial premature 2,546; f fusion of paced
#: and normal 982; F fusion of ventricular and normal 803; j nodal (junctional) escape 229; a aberrated
#: atrial premature 150; E ventricular escape 106; J nodal (junctional) premature 83. Dropped beats:
#: Q unclassifiable 33, e atrial escape 16, S supraventricular premature 2 (and B, r, n, ? absent in mitdb).
MITBIH_CLASSES = ("N", "L", "R", "V", "/", "A", "f", "F", "j", "a", "E", "J")
MITBIH_SOURCE = (
    "MIT-BIH Arrhythmia Database (Moody & Mark 2001; PhysioNet, Goldberger et al. 2000), "
    "https://physionet.org/content/mitdb/1.0.0/ via wfdb.dl_database('mitdb')"
)


def _mitdb_present(d: Path) -> list[str]:
    """Records with .hea, .dat and .atr, numerically sorted."""
    if not d.is_dir():
        return []
    recs = [p.stem for p in d.glob("*.hea") if (d / f"{p.stem}.dat").is_file() and (d / f"{p.stem}.atr").is_file()]
    return sorted(recs, key=lambda r: (int(r) if r.isdigit() else 10**9, r))


def _mitbih_records_param(params: dict) -> list[str] | None:
    recs = params["records"]
    if recs is None:
        return None
    out = [str(r) for r in recs]
    if not out or len(set(out)) != len(out):
        raise ConfigError(f"dataset 'mitbih': key 'records' has value {recs!r}; allowed: None or a non-empty list of distinct record names")
    return out


def _mitbih_how() -> list[str]:
    return [
        "run `fedrepro prepare` with internet access: it calls wfdb.dl_database('mitdb', <folder above>), or",
        "download https://physionet.org/static/published-projects/mitdb/mit-bih-arrhythmia-database-1.0.0.zip and put "
        "each record's .hea, .dat and .atr files directly into the folder above",
    ]


def _mitbih_missing_error(d: Path, wanted: Sequence[str], detail: str = "") -> DataMissingError:
    missing = [r for r in wanted if not all((d / f"{r}.{e}").is_file() for e in ("hea", "dat", "atr"))]
    return _missing(
        "MIT-BIH record files are",
        d,
        [f"{r}.hea, {r}.dat, {r}.atr" for r in missing] or [f"<record>.hea/.dat/.atr for records {', '.join(wanted)}"],
        _mitbih_how(),
        detail,
    )


def _prepare_mitbih(root: Path, params: dict) -> None:
    d = Path(root) / MITDB_DIR
    wanted = _mitbih_records_param(params) or list(MITDB_RECORDS)
    present = set(_mitdb_present(d))
    missing = [r for r in wanted if r not in present]
    if not missing:
        return
    try:
        # PhysioNet publishes no per-file checksum that wfdb checks: an unpinned download (opt-in).
        require_unpinned_ok(f"MIT-BIH records {', '.join(missing)}", "https://physionet.org/content/mitdb/1.0.0/")
    except UnpinnedDownloadError as exc:
        raise DataMissingError(f"{exc}\n{_mitbih_missing_error(d, wanted)}") from None
    try:
        import wfdb

        d.mkdir(parents=True, exist_ok=True)
        wfdb.dl_database("mitdb", dl_dir=str(d), records=missing, annotators=["atr"])
    except Exception as exc:
        raise _mitbih_missing_error(d, wanted, f"{type(exc).__name__}: {exc}") from None
    for r in missing:
        for ext in ("hea", "dat", "atr"):
            if (d / f"{r}.{ext}").is_file():
                got = file_digests(d / f"{r}.{ext}")
                record({"file": f"{MITDB_DIR}/{r}.{ext}", "url": "https://physionet.org/files/mitdb/1.0.0/",
                        "sha256": got["sha256"], "size": got["size"], "pinned": False})
    if any(r not in set(_mitdb_present(d)) for r in wanted):
        raise _mitbih_missing_error(d, wanted)


def _load_mitbih(root: Path, params: dict) -> RawDataset:
    d = Path(root) / MITDB_DIR
    requested = _mitbih_records_param(params)
    classes = _check_list("dataset 'mitbih'", "classes", params["classes"], BEAT_SYMBOLS)
    window, lead, normalize = int(params["window"]), str(params["lead"]), params["normalize"]
    present = _mitdb_present(d)
    if requested is None:
        if not present:
            raise _mitbih_missing_error(d, MITDB_RECORDS)
        records = present
    else:
        if any(r not in present for r in requested):
            raise _mitbih_missing_error(d, requested)
        records = requested

    import wfdb

    pre = window // 2  # the R-peak sits at index window // 2: samples [r - window//2, r - window//2 + window)
    cls_id = {s: i for i, s in enumerate(classes)}
    xs, ys, patients, record_ids, used, skipped = [], [], [], [], [], []
    for rec in records:
        path = str(d / rec)
        header = wfdb.rdheader(path)
        if lead not in (header.sig_name or []):
            if requested is not None:
                raise ConfigError(f"dataset 'mitbih': record {rec} has no {lead!r} signal (it has {header.sig_name}); drop it from 'records'")
            skipped.append(rec)
            continue
        sig = wfdb.rdrecord(path, channel_names=[lead]).p_signal[:, 0].astype(np.float32)
        ann = wfdb.rdann(path, "atr")
        samples = np.asarray(ann.sample, dtype=np.int64)
        symbols = np.asarray(ann.symbol, dtype=object)
        keep = np.isin(symbols, classes) & (samples - pre >= 0) & (samples - pre + window <= len(sig))
        starts = samples[keep] - pre
        beats = sig[starts[:, None] + np.arange(window)[None, :]] if len(starts) else np.empty((0, window), np.float32)
        xs.append(beats)
        ys.append(np.asarray([cls_id[s] for s in symbols[keep]], dtype=np.int64))
        patients.append(np.full(len(starts), len(used), dtype=np.int64))
        record_ids.append(np.full(len(starts), int(rec) if rec.isdigit() else -1, dtype=np.int64))
        used.append(rec)
    if not used:
        raise DataMissingError(f"MIT-BIH: none of the records in {d} has a {lead!r} signal (skipped: {skipped})")
    x = np.concatenate(xs)[:, None, :].astype(np.float32)
    if normalize == "beat":
        mu = x.mean(axis=2, keepdims=True)
        sd = x.std(axis=2, keepdims=True)
        x = ((x - mu) / np.maximum(sd, 1e-6)).astype(np.float32)
    y = np.concatenate(ys)
    note = f"; records without {lead} skipped: {', '.join(skipped)}" if skipped else ""
    return RawDataset(
        name="mitbih",
        x=np.ascontiguousarray(x),
        y=y,
        num_classes=len(classes),
        official_split=np.zeros(len(y), dtype=np.int8),  # no official split; GRP-FED splits 80/20 per patient
        mean=(float(x.mean()),) if len(y) else (0.0,),
        std=(float(x.std()) or 1.0,) if len(y) else (1.0,),
        source=f"{MITBIH_SOURCE} [lead {lead}, window {window} samples, classes {''.join(classes)}, "
        f"{len(used)} patients{note}]",
        groups={"patient": np.concatenate(patients), "record": np.concatenate(record_ids)},
    )


_register(
    DatasetSpec(
        name="mitbih",
        summary="MIT-BIH Arrhythmia: R-peak-centred ECG beat windows (360 Hz), 12 beat classes, patient id per beat",
        source=MITBIH_SOURCE,
        num_classes=len(MITBIH_CLASSES),
        sample_shape=(1, 256),
        size="~109k annotated beats in 48 records (47 subjects); default: 46 records with an MLII lead",
        params={
            "window": Param(256, "beat window length in samples at 360 Hz (256 = 0.71 s), R-peak at index window // 2", int, minimum=8),
            "lead": Param(
                "MLII",
                "signal to read; records without it are skipped (with MLII: 102 and 104, leaving 46 patients as in GRP-FED)",
                str,
            ),
            "classes": Param(
                list(MITBIH_CLASSES),
                "beat annotation symbols kept, class id = position; other beats and all non-beat annotations are dropped",
                (list, tuple),
            ),
            "records": Param(None, "record names to read (e.g. ['100', '101']); None = every record present", (list, tuple, type(None))),
            "normalize": Param(
                "none",
                "'none': raw millivolts (normalised later by the dataset mean/std); 'beat': z-score each window",
                str,
                choices=("none", "beat"),
            ),
        },
        prepare=_prepare_mitbih,
        load=_load_mitbih,
    )
)
