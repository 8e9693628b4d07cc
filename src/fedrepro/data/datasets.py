"""The datasets: where each raw dataset comes from and how it is read, and what is known about
each before reading it (sample counts, shapes, official test sets, group columns).

Importing this module registers every built-in dataset in `DATASETS` (the registry itself
lives in fedrepro.data.dataset_registry; its names are importable from here too). Each
dataset is a `DatasetSpec` with two steps:

* `prepare(root, params)` makes the raw files present under `root` (copy from a
  local system package, or download). It is idempotent and the only step that
  may touch the network.
* `load(root, params)` reads the raw files into a `RawDataset`. It never touches
  the network; missing files raise `DataMissingError` naming what goes where.

Registered datasets: `fmnist` (Fashion-MNIST), `digits` (scikit-learn's bundled
8x8 digits) and `synthetic` (Synthetic(alpha, beta) of FedProx, generated).
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
# The registry lives apart from its entries (no import circle); its names stay importable from here.
from fedrepro.data.dataset_registry import DATASETS, DatasetSpec, load_dataset, register_dataset, resolve_dataset  # noqa: F401
from fedrepro.io import FileTooLarge, NotRegularFile, atomic_path, canonical_json, read_json, read_regular, short_hash, write_json_atomic
from fedrepro.registry import ConfigError, Param, show


def prepare_dataset(name: str, root: Path, params: dict | None = None) -> dict[str, Any]:
    """Make dataset `name` present under `root`, load it once and describe it.

    Returns {dataset, params, fingerprint, num_samples, num_classes, sample_shape,
    source, downloads}; writes the raw files the dataset's `prepare` puts there and, beside
    them, their class counts (`class_counts_path`) and labels (`labels_path`), from which `fedrepro
    validate` decides partition feasibility before any job (nothing for data shipped with a package or
    generated: `known_labels` loads those).
    `downloads` lists every file fetched in this call with its sha256 and whether it matched a
    pinned checksum (fedrepro.data.downloads).
    """
    from fedrepro.data.downloads import recording
    from fedrepro.io import clean_stale

    spec, resolved = resolve_dataset(name, params)
    root = Path(root)
    clean_stale(root)  # what a prepare job killed with SIGKILL left (its description's *.tmp, staging folders)
    with recording() as downloads:
        spec.prepare(root, resolved)
    raw = spec.load(root, resolved)
    if spec.prepare is not _prepare_nothing:  # data of a package or generated: nothing is written for it
        write_class_counts(root, name, resolved, raw)
        write_labels(root, resolved, raw)
    return {
        "downloads": downloads,
        "dataset": name,
        "params": resolved,
        "fingerprint": raw.fingerprint(),
        "num_samples": int(len(raw.y)),
        "num_classes": int(raw.num_classes),
        "sample_shape": list(raw.sample_shape),
        "source": raw.source,
    }


#: (official train, total) sample counts of the datasets whose size does not depend on their
#: parameters beyond what `sample_bounds` computes; upper bounds where the files vary.
_SIZES: dict[str, tuple[int, int]] = {
    "fmnist": (60_000, 70_000), "digits": (1_797, 1_797), "mnist": (60_000, 70_000), "cifar10": (50_000, 60_000),
    "cifar100": (50_000, 60_000), "stl10": (5_000, 13_000), "usps": (7_291, 9_298),
    "mnistm": (59_001, 68_002),  # the larger of the original (59,001 + 9,001) and FedBN releases
    "syn": (479_400, 488_953),  # the larger of the original (479,400 + 9,553) and FedBN releases
    "mitbih": (110_000, 110_000),  # ~109k annotated beats in all 48 records (all official_split 0)
}
_EMNIST_SIZES = {"byclass": (697_932, 814_255), "bymerge": (697_932, 814_255), "balanced": (112_800, 131_600),
                 "letters": (124_800, 145_600), "digits": (240_000, 280_000), "mnist": (60_000, 70_000)}
_PACS_SIZES = {"photo": 1_670, "art_painting": 2_048, "cartoon": 2_344, "sketch": 3_929}
_DOMAINNET_SIZES = {"clipart": (33_525, 14_604), "infograph": (36_023, 15_582), "painting": (50_426, 21_855),
                    "quickdraw": (120_750, 51_750), "real": (120_906, 52_041), "sketch": (48_212, 20_916)}


#: Where the workflow keeps each dataset's raw files (workflow/rules/data.smk: results/raw/<dataset>),
#: relative to the working directory: `class_counts` looks there for the counts `prepare` cached.
RAW_ROOT = Path("results") / "raw"
CLASS_COUNTS_MAX_BYTES = 1 << 20  # a few numbers per class


def class_counts_path(root: Path, params: dict[str, Any]) -> Path:
    """The class counts cache of a dataset's raw files under `root` with resolved `params`: one per
    parameter set, named by the prepared id (the raw marker's dataset-<id>.json beside it)."""
    return Path(root) / f"class_counts-{short_hash(params, 8)}.json"


def write_class_counts(root: Path, name: str, params: dict[str, Any], raw: RawDataset) -> None:
    """Cache the per-class counts of the loaded raw data beside it: of all rows ("all", what a pooled
    partition splits) and of the official train rows ("train", pool: false), in label order."""
    y = np.asarray(raw.y, np.int64)
    width = max(int(raw.num_classes), int(y.max()) + 1 if len(y) else 0)
    write_json_atomic(class_counts_path(root, params), {
        "dataset": name, "params": params, "fingerprint": raw.fingerprint(),
        "all": np.bincount(y, minlength=width).tolist(),
        "train": np.bincount(y[np.asarray(raw.official_split) == 0], minlength=width).tolist(),
    })


def class_counts(name: str, params: dict[str, Any], pool: bool, root: Path | None = None) -> tuple[np.ndarray, str] | None:
    """(counts, source): the per-class sample counts, in label order, of the rows a partition of dataset
    `name` with resolved `params` splits (all rows with `pool`, else the official train rows), and where
    they come from: the cache `prepare` wrote beside the raw files under `root` (default
    RAW_ROOT/<name>, the workflow's), else what the registry declares; None where neither knows them."""
    path = class_counts_path(Path(root) if root is not None else RAW_ROOT / name, params)
    redo = "delete it (`fedrepro prepare` writes it again)"
    try:
        doc = read_json(path, CLASS_COUNTS_MAX_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        doc = None
    except (OSError, json.JSONDecodeError) as exc:  # a FIFO, device, huge, deep or damaged file: never read past the bound
        why = str(exc).removeprefix(f"{path}: ")
        raise ConfigError(f"{path}: {why} (where `fedrepro prepare` caches the class counts of {name}); {redo}") from None
    if doc is not None:
        key = "all" if pool else "train"
        counts = doc.get(key) if isinstance(doc, dict) else None
        owner = (doc.get("dataset"), doc.get("params")) if isinstance(doc, dict) else (None, None)
        if owner != (name, json.loads(json.dumps(params))):
            raise ConfigError(f"{path}: the class counts of dataset {show(owner[0])} with params {show(owner[1])}; allowed: "
                              f"those of {name!r} with params {show(params)}, which `fedrepro prepare` caches there; {redo}")
        if not (isinstance(counts, list) and counts and all(type(c) is int and c >= 0 for c in counts)):
            raise ConfigError(f"{path}: key {key!r} has value {show(counts)}; allowed: a list of class counts (integers >= 0), "
                              f"as `fedrepro prepare` caches them; {redo}")
        return np.asarray(counts, np.int64), str(path)
    declared = DATASETS.get(name).class_counts
    if declared is None:
        return None
    train, test = (np.asarray(c, np.int64) for c in declared)
    return (train + test if pool else train), f"the class counts the registry declares for {name}"


#: The labels cache (`labels_path`) is 8 bytes a sample: at most 8 million samples are read from it.
LABELS_MAX_BYTES = 64 << 20
#: The most samples `known_labels` generates or reads from a package (digits, synthetic) before any job.
GENERATED_LABELS_MAX = 50_000


def labels_path(root: Path, params: dict[str, Any]) -> Path:
    """The labels cache of a dataset's raw files under `root` with resolved `params`, beside its class
    counts (`class_counts_path`): a .npy int32 array (2, N), row 0 each sample's label, row 1 its official
    split (RawDataset.y and .official_split, in row order)."""
    return Path(root) / f"labels-{short_hash(params, 8)}.npy"


def write_labels(root: Path, params: dict[str, Any], raw: RawDataset) -> None:
    """Cache the loaded raw data's labels and official split beside it (`labels_path`)."""
    with atomic_path(labels_path(root, params)) as tmp, open(tmp, "wb") as fh:
        np.save(fh, np.stack([raw.y, raw.official_split]).astype(np.int32), allow_pickle=False)


def known_labels(name: str, params: dict[str, Any], root: Path | None = None) -> tuple[RawDataset, str] | None:
    """(stand-in, source): dataset `name` with resolved `params` as far as a partition needs it before any
    job (its labels, official split and, where loaded, groups; no samples), and where that comes from: the
    cache `prepare` wrote beside the raw files under `root` (default RAW_ROOT/<name>), else the data itself
    where it ships with a package or is generated and has at most GENERATED_LABELS_MAX samples; None where
    neither (nothing is prepared or downloaded)."""
    spec = DATASETS.get(name)
    if spec.prepare is _prepare_nothing:
        bounds = sample_bounds(name, params)
        if bounds is None or bounds[1] > GENERATED_LABELS_MAX:
            return None
        return _loaded(name, canonical_json(params)), f"the labels of {name}, read without preparing (its data ships with a package or is generated)"
    path = labels_path(Path(root) if root is not None else RAW_ROOT / name, params)
    redo = "delete it (`fedrepro prepare` writes it again)"
    try:
        rows = np.load(io.BytesIO(read_regular(path, LABELS_MAX_BYTES)), allow_pickle=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, EOFError, MemoryError) as exc:  # a FIFO, huge, truncated or foreign file: never read past the bound
        why = str(exc).removeprefix(f"{path}: ") if isinstance(exc, (FileTooLarge, NotRegularFile)) else f"not a labels array ({exc})"
        raise ConfigError(f"{path}: {why} (where `fedrepro prepare` caches the labels of {name}); {redo}") from None
    if not _labels_match(rows, [class_counts(name, params, pool, root) for pool in (True, False)]):
        raise ConfigError(f"{path}: not the labels of {name} with params {show(params)}; allowed: a (2, N) integer array of "
                          f"labels and official splits (0 or 1) whose class counts are those of {name}; {redo}")
    y, split = rows[0].astype(np.int64), rows[1].astype(np.int8)
    stand_in = RawDataset(name=name, x=np.zeros((len(y), 0), np.uint8), y=y, num_classes=spec.num_classes,
                          official_split=split, mean=(0.0,), std=(1.0,), source=str(path))
    return stand_in, f"the labels `fedrepro prepare` cached in {path}"


def _labels_match(rows: Any, counts: list[tuple[np.ndarray, str] | None]) -> bool:
    """Whether `rows` is a labels cache (`labels_path`) whose class counts, of all rows and of the official
    train rows, are `counts` (class_counts' for pool true and false, where known)."""
    if not (isinstance(rows, np.ndarray) and rows.dtype.kind in "iu" and rows.ndim == 2 and rows.shape[0] == 2):
        return False
    y, split = rows
    if (len(y) and y.min() < 0) or not set(np.unique(split).tolist()) <= {0, 1}:
        return False
    return all(known is None or np.array_equal(np.bincount(labels, minlength=len(known[0])), known[0])
               for labels, known in ((y, counts[0]), (y[split == 0], counts[1])))


@functools.lru_cache(maxsize=4)
def _loaded(name: str, params_json: str) -> RawDataset:
    """Dataset `name` loaded with the parameters in `params_json` (data of a package or generated, read
    once per process: validating a config checks each of its partitions)."""
    return DATASETS.get(name).load(RAW_ROOT / name, json.loads(params_json))


def sample_bounds(name: str, params: dict[str, Any]) -> tuple[int, int] | None:
    """(official train samples, all samples) of dataset `name` with resolved `params`: exact or an
    upper bound, computed without reading any file; None where unknown. Used before any job runs
    to refuse more clients than samples."""
    try:
        if name == "synthetic":
            rng = np.random.RandomState(int(params["seed"]))  # the generator's first draw: the users' sizes
            sizes = rng.lognormal(4, 2, int(params["num_users"])).astype(int) + 50
            if params.get("max_samples_per_user") is not None:
                sizes = np.minimum(sizes, int(params["max_samples_per_user"]))
            n = int(sizes.sum())
            return n, n
        if name == "emnist":
            return _EMNIST_SIZES.get(params.get("split"))
        if name == "svhn":
            return (73_257 + 531_131, 99_289 + 531_131) if params.get("include_extra") else (73_257, 99_289)
        if name == "pacs":
            n = sum(_PACS_SIZES.get(d, 0) for d in params["domains"])
            return n, n
        if name == "domainnet":
            cap = params.get("max_per_domain")
            per = [tuple(min(k, cap) if cap else k for k in _DOMAINNET_SIZES.get(d, (0, 0))) for d in params["domains"]]
            return sum(t for t, _ in per), sum(t + u for t, u in per)
    except (KeyError, TypeError, ValueError):
        return None
    return _SIZES.get(name)


#: Facts about a dataset's samples that configs are checked against before any job runs (fedrepro.config),
#: where they differ from the registry's defaults: whether the dataset has an official test set
#: (official_split 1; `training.global_test: [official]` needs one) and its per-sample group columns
#: (RawDataset.groups; partitioners' `partition_by`). A callable takes the resolved parameters.
_NO_OFFICIAL_TEST: dict[str, Any] = {"digits": True, "synthetic": True, "mitbih": True,
                                     "pacs": lambda p: p.get("split") != "kfold",
                                     "shifted_domains": lambda p: p.get("base") == "digits"}
_GROUPS: dict[str, tuple[str, ...]] = {"synthetic": ("user",), "mitbih": ("patient", "record"),
                                       **dict.fromkeys(("pacs", "domainnet", "digit5", "shifted_domains"), ("domain",))}


def sample_shape(name: str, params: dict[str, Any]) -> tuple[int, ...]:
    """The shape of one sample of dataset `name` with resolved `params` (an `image_size` or a
    `window` parameter sets the sides), without reading any file."""
    shape = tuple(DATASETS.get(name).sample_shape)
    if isinstance(params.get("image_size"), int):
        return (shape[0], params["image_size"], params["image_size"])
    if isinstance(params.get("window"), int):
        return (shape[0], params["window"])
    return shape


def has_official_test(name: str, params: dict[str, Any]) -> bool:
    """Whether dataset `name` with resolved `params` has official test rows (official_split 1)."""
    rule = _NO_OFFICIAL_TEST.get(name, False)
    return not (rule(params) if callable(rule) else rule)


def group_columns(name: str) -> tuple[str, ...]:
    """The per-sample group columns (RawDataset.groups) that dataset `name` provides."""
    return _GROUPS.get(name, ())


# --------------------------------------------------------------------------- fmnist

#: Where Debian's `dataset-fashion-mnist` package installs the gzipped IDX files.
DEBIAN_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
#: Environment variable overriding `DEBIAN_FMNIST_DIR` (tests point it at fixtures).
DEBIAN_FMNIST_ENV = "FEDREPRO_FMNIST_DEBIAN_DIR"

FMNIST_URL = "https://github.com/zalandoresearch/fashion-mnist"
FMNIST_SPEC_SOURCE = f"{FMNIST_URL} (via torchvision.datasets.FashionMNIST; Debian dataset-fashion-mnist)"
# File name -> (IDX magic number, dims after the count); the order is torchvision's.
FMNIST_FILES: dict[str, tuple[int, tuple[int, ...]]] = {
    "train-images-idx3-ubyte": (0x00000803, (28, 28)),
    "train-labels-idx1-ubyte": (0x00000801, ()),
    "t10k-images-idx3-ubyte": (0x00000803, (28, 28)),
    "t10k-labels-idx1-ubyte": (0x00000801, ()),
}


def debian_fmnist_dir() -> Path:
    """The Debian source directory, read at call time so the env override applies."""
    override = os.environ.get(DEBIAN_FMNIST_ENV)
    return Path(override) if override else DEBIAN_FMNIST_DIR


def fmnist_raw_dir(root: Path) -> Path:
    """Where torchvision's FashionMNIST looks for the decompressed IDX files."""
    return Path(root) / "FashionMNIST" / "raw"


def _fmnist_missing(root: Path) -> list[str]:
    raw = fmnist_raw_dir(root)
    return [f for f in FMNIST_FILES if not (raw / f).is_file()]


def _fmnist_missing_message(root: Path, detail: str = "") -> str:
    raw = fmnist_raw_dir(root)
    missing = _fmnist_missing(root) or list(FMNIST_FILES)
    lines = [
        f"Fashion-MNIST raw files are missing from {raw}:",
        *(f"  {f}" for f in missing),
        f"Expected all of: {', '.join(FMNIST_FILES)} (decompressed IDX files) in {raw}.",
        "To get them, either:",
        f"  - apt-get install dataset-fashion-mnist (installs the .gz files in {DEBIAN_FMNIST_DIR};"
        f" or set {DEBIAN_FMNIST_ENV} to a directory holding them), then run prepare again, or",
        f"  - download the four .gz files from {FMNIST_URL}, gunzip them into {raw}.",
    ]
    if detail:
        lines.append(f"(automatic download failed: {detail})")
    return "\n".join(lines)


def _check_idx_header(path: Path, magic: int, dims: tuple[int, ...]) -> None:
    """Reject a decompressed file whose IDX header is not the expected one."""
    with open(path, "rb") as fh:
        head = fh.read(4 * (2 + len(dims)))
    if len(head) < 4 * (2 + len(dims)):
        raise DataMissingError(f"{path.name}: truncated IDX file")
    got_magic, _count, *got_dims = struct.unpack(f">{2 + len(dims)}I", head)
    if got_magic != magic or tuple(got_dims) != dims:
        raise DataMissingError(
            f"{path.name}: unexpected IDX header (magic {got_magic:#010x}, dims {tuple(got_dims)}); "
            f"expected magic {magic:#010x}, dims {dims}"
        )


def _fmnist_from_debian(src_dir: Path, root: Path) -> None:
    """Decompress Debian's .gz files into the raw dir, each file atomically.

    Debian recompressed the archives, so their MD5 differs from the list torchvision
    checks; decompressing ourselves lets torchvision skip its download entirely.
    """
    raw = fmnist_raw_dir(root)
    for name in _fmnist_missing(root):
        magic, dims = FMNIST_FILES[name]
        src = src_dir / f"{name}.gz"
        try:
            with atomic_path(raw / name) as tmp:
                with gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
                _check_idx_header(tmp, magic, dims)
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
            raise DataMissingError(
                f"cannot decompress {src}: {exc}\n"
                f"Reinstall dataset-fashion-mnist, or point {DEBIAN_FMNIST_ENV} at intact .gz files."
            ) from None


def _prepare_fmnist(root: Path, params: dict) -> None:
    """Raw files present -> nothing; else Debian package -> gunzip; else torchvision download."""
    root = Path(root)
    if not _fmnist_missing(root):
        return
    src_dir = debian_fmnist_dir()
    if all((src_dir / f"{f}.gz").is_file() for f in _fmnist_missing(root)):
        _fmnist_from_debian(src_dir, root)
        return
    import torchvision  # lazy: slow import, only needed for the download

    try:
        # One instance downloads all four files (both splits).
        torchvision.datasets.FashionMNIST(str(root), train=True, download=True)
    except Exception as exc:  # URLError, RuntimeError("Error downloading ..."), OSError, ...
        raise DataMissingError(_fmnist_missing_message(root, f"{type(exc).__name__}: {exc}")) from None
    if _fmnist_missing(root):
        raise DataMissingError(_fmnist_missing_message(root))


def _read_idx(path: Path, magic: int, dims: tuple[int, ...]) -> np.ndarray:
    """An IDX file's array (count, *dims) of uint8, its header checked and its length exact: the
    format torchvision's FashionMNIST reads, read with numpy, since importing torchvision (and with
    it torch) costs the prepare and partition jobs seconds each."""
    _check_idx_header(path, magic, dims)
    header = 4 * (2 + len(dims))
    data = path.read_bytes()
    count = struct.unpack(">I", data[4:8])[0]
    if len(data) != header + count * int(np.prod(dims, dtype=np.int64)):
        raise DataMissingError(f"{path.name}: {len(data)} bytes, not the {count} items its IDX header announces")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(count, *dims)


def _load_fmnist(root: Path, params: dict) -> RawDataset:
    """Both official splits, train rows first then test rows."""
    root = Path(root)
    if _fmnist_missing(root):
        raise DataMissingError(_fmnist_missing_message(root))
    raw = fmnist_raw_dir(root)
    xs, ys, splits = [], [], []
    for split, prefix in ((0, "train"), (1, "t10k")):
        images, labels = f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"
        x = _read_idx(raw / images, *FMNIST_FILES[images])[:, None, :, :]
        y = _read_idx(raw / labels, *FMNIST_FILES[labels]).astype(np.int64)
        if len(y) != len(x):
            raise DataMissingError(f"{raw}: {len(x)} {prefix} images but {len(y)} labels")
        xs.append(x)
        ys.append(y)
        splits.append(np.full(len(x), split, dtype=np.int8))
    return RawDataset(
        name="fmnist",
        x=np.ascontiguousarray(np.concatenate(xs)),
        y=np.concatenate(ys),
        num_classes=10,
        official_split=np.concatenate(splits),
        # PFLlib's dataset/generate_FashionMNIST.py uses
        # transforms.Normalize([0.5], [0.5]) after ToTensor(); we match it.
        mean=(0.5,),
        std=(0.5,),
        source=FMNIST_SPEC_SOURCE,
    )


register_dataset(
    DatasetSpec(
        name="fmnist",
        summary="Fashion-MNIST: 28x28 grayscale images of clothing, 10 classes",
        source=FMNIST_SPEC_SOURCE,
        num_classes=10,
        sample_shape=(1, 28, 28),
        size="70,000 images (60,000 train + 10,000 test)",
        params={},
        prepare=_prepare_fmnist,
        load=_load_fmnist,
        class_counts=((6_000,) * 10, (1_000,) * 10),  # counted in Debian's dataset-fashion-mnist files
    )
)


# --------------------------------------------------------------------------- digits

DIGITS_SOURCE = "scikit-learn sklearn.datasets.load_digits (UCI optical recognition of handwritten digits)"


def _prepare_nothing(root: Path, params: dict) -> None:
    """Nothing to fetch: the data ships with a package or is generated."""


def _load_digits(root: Path, params: dict) -> RawDataset:
    """scikit-learn's 8x8 digits, rescaled from 0..16 to uint8 0..255."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = np.round(bunch.images * 255 / 16).astype(np.uint8)[:, None, :, :]
    # No published normalisation for this set: use the data's own per-channel
    # statistics on the [0, 1] scale (x / 255), population std (ddof=0).
    scaled = x.astype(np.float64) / 255.0
    mean = tuple(float(m) for m in scaled.mean(axis=(0, 2, 3)))
    std = tuple(float(s) for s in scaled.std(axis=(0, 2, 3)))
    return RawDataset(
        name="digits",
        x=np.ascontiguousarray(x),
        y=bunch.target.astype(np.int64),
        num_classes=10,
        official_split=np.zeros(len(x), dtype=np.int8),  # no official test split
        mean=mean,
        std=std,
        source=DIGITS_SOURCE,
    )


register_dataset(
    DatasetSpec(
        name="digits",
        summary="scikit-learn's 8x8 handwritten digits (offline, tiny), 10 classes",
        source=DIGITS_SOURCE,
        num_classes=10,
        sample_shape=(1, 8, 8),
        size="1,797 images (no official test split)",
        params={},
        prepare=_prepare_nothing,
        load=_load_digits,
        class_counts=((178, 182, 177, 183, 181, 182, 181, 179, 174, 180), (0,) * 10),  # np.bincount(load_digits().target)
    )
)


# ------------------------------------------------------------------------ synthetic

SYNTHETIC_SOURCE = (
    "generated: Synthetic(alpha, beta) of FedProx (Li et al., MLSys 2020), "
    "https://github.com/litian96/FedProx data/synthetic_*/generate_synthetic.py"
)
SYNTHETIC_DIM = 60
SYNTHETIC_CLASSES = 10

SYNTHETIC_PARAMS: dict[str, Param] = {
    "alpha": Param(1.0, "std of each user's model mean (mean_W ~ N(0, alpha)): model heterogeneity", float, minimum=0),
    "beta": Param(1.0, "std of each user's feature mean (B ~ N(0, beta)): feature heterogeneity", float, minimum=0),
    "num_users": Param(30, "number of generating users", int, minimum=1),
    "iid": Param(False, "FedProx's iid branch: one shared W, b and mean_x = B[i] * ones", bool),
    "seed": Param(0, "seed of np.random.RandomState driving the generator", int, minimum=0, maximum=2**32 - 1),
    "max_samples_per_user": Param(
        None,
        "optional cap on a user's samples (lognormal(4, 2) + 50 is heavy-tailed); None = uncapped as in FedProx",
        (int, type(None)),
        minimum=1,
    ),
}


def generate_synthetic(
    alpha: float,
    beta: float,
    num_users: int,
    iid: bool,
    seed: int,
    max_samples_per_user: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic(alpha, beta) as in FedProx's `generate_synthetic.py`; returns (x, y, user).

    The random calls are made in the script's order on `RandomState(seed)` (including
    the per-user W, b draws that its iid branch discards), so a seed fixes the data.
    The only deviation: `max_samples_per_user` caps the lognormal draw when set.
    """
    rng = np.random.RandomState(seed)
    samples_per_user = rng.lognormal(4, 2, num_users).astype(int) + 50
    if max_samples_per_user is not None:
        samples_per_user = np.minimum(samples_per_user, max_samples_per_user)

    mean_W = rng.normal(0, alpha, num_users)
    mean_b = mean_W
    B = rng.normal(0, beta, num_users)
    cov_x = np.diag(np.power(np.arange(1, SYNTHETIC_DIM + 1, dtype=np.float64), -1.2))

    mean_x = np.zeros((num_users, SYNTHETIC_DIM))
    for i in range(num_users):
        if iid:
            mean_x[i] = np.ones(SYNTHETIC_DIM) * B[i]
        else:
            mean_x[i] = rng.normal(B[i], 1, SYNTHETIC_DIM)

    if iid:
        W_global = rng.normal(0, 1, (SYNTHETIC_DIM, SYNTHETIC_CLASSES))
        b_global = rng.normal(0, 1, SYNTHETIC_CLASSES)

    xs, ys, users = [], [], []
    for i in range(num_users):
        W = rng.normal(mean_W[i], 1, (SYNTHETIC_DIM, SYNTHETIC_CLASSES))
        b = rng.normal(mean_b[i], 1, SYNTHETIC_CLASSES)
        if iid:
            W, b = W_global, b_global
        xx = rng.multivariate_normal(mean_x[i], cov_x, samples_per_user[i])
        # The script takes argmax(softmax(x W + b)); softmax is monotonic.
        ys.append(np.argmax(xx @ W + b, axis=1))
        xs.append(xx)
        users.append(np.full(samples_per_user[i], i, dtype=np.int64))
    return (
        np.concatenate(xs).astype(np.float32),
        np.concatenate(ys).astype(np.int64),
        np.concatenate(users),
    )


def _load_synthetic(root: Path, params: dict) -> RawDataset:
    """Generate the data (deterministic by params); `root` is unused."""
    x, y, user = generate_synthetic(
        alpha=float(params["alpha"]),
        beta=float(params["beta"]),
        num_users=int(params["num_users"]),
        iid=bool(params["iid"]),
        seed=int(params["seed"]),
        max_samples_per_user=params["max_samples_per_user"],
    )
    return RawDataset(
        name="synthetic",
        x=x,
        y=y,
        num_classes=SYNTHETIC_CLASSES,
        official_split=np.zeros(len(y), dtype=np.int8),
        # Features are used as generated, as in FedProx: identity normalisation.
        mean=(0.0,),
        std=(1.0,),
        source=SYNTHETIC_SOURCE,
        groups={"user": user},
    )


register_dataset(
    DatasetSpec(
        name="synthetic",
        summary="FedProx Synthetic(alpha, beta): 60-d Gaussian features, per-user softmax-regression labels",
        source=SYNTHETIC_SOURCE,
        num_classes=SYNTHETIC_CLASSES,
        sample_shape=(SYNTHETIC_DIM,),
        size="num_users users x (int(lognormal(4, 2)) + 50) samples each (heavy-tailed, seed-dependent)",
        params=SYNTHETIC_PARAMS,
        prepare=_prepare_nothing,
        load=_load_synthetic,
    )
)

# More datasets, registered on import (their modules use fedrepro.data.dataset_registry, not this one).
from fedrepro.data import vision as _vision  # noqa: E402,F401
from fedrepro.data import domains as _domains  # noqa: E402,F401
