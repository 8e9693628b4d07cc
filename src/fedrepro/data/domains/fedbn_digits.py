"""FedBN's pre-processed Digit-Five release (digit_dataset.zip): layout, safe unpickling, prepare."""

from __future__ import annotations

import codecs
import pickle
import shutil
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from fedrepro.data.base import DataMissingError
from fedrepro.data.downloads import Download, UnpinnedDownloadError, extract_zip, fetch
from fedrepro.io import replace_dir
from fedrepro.data.domains._common import digit_labels, missing_error, refused_error, stack_splits


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


def fedbn_expected(root: Path, domains: Iterable[str]) -> list[str]:
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


def read_pkl_pair(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        images, labels = _load_pkl_file(path)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            MemoryError, RecursionError) as exc:
        raise DataMissingError(f"cannot read {path} as a pickled (images, labels) pair: {exc}") from None
    return np.asarray(images, dtype=np.uint8), digit_labels(labels, str(path))


def read_fedbn_digits(root: Path, domain: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images NHW[C] uint8, labels, split) of one domain of FedBN's release: parts then test."""
    folder = fedbn_dir(root, domain)
    pieces = []
    for split, files in ((0, _fedbn_parts(folder)), (1, [folder / "test.pkl"])):
        for f in files:
            x, y = read_pkl_pair(f)
            if len(x) != len(y):
                raise DataMissingError(f"{f}: {len(x)} images but {len(y)} labels")
            pieces.append((split, x, y))
    return stack_splits(pieces)


def find_dir_containing(base: Path, name: str, depth: int = 3) -> Path | None:
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


def prepare_fedbn_digits(root: Path, domains: Iterable[str]) -> None:
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
        raise refused_error("FedBN Digit-Five files are", target, fedbn_expected(root, domains), FEDBN_HOW, exc) from None
    except Exception as exc:  # gdown missing, no network, checksum mismatch, bad or unsafe archive, ...
        raise missing_error(
            "FedBN Digit-Five files are", target, fedbn_expected(root, domains), FEDBN_HOW, f"{type(exc).__name__}: {exc}"
        ) from None
    finally:
        (target / FEDBN_DIGITS_ZIP).unlink(missing_ok=True)
    try:
        base = find_dir_containing(staging, "MNIST_M") or find_dir_containing(staging, "SynthDigits")
        if base is not None:
            for folder in FEDBN_DIGIT_FOLDERS.values():
                if (base / folder).is_dir():
                    replace_dir(base / folder, target / folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not all(fedbn_present(root, d) for d in domains):
        raise missing_error("FedBN Digit-Five files are", target, fedbn_expected(root, domains), FEDBN_HOW,
                            f"{FEDBN_DIGITS_ZIP} did not contain them")
