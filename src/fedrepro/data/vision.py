"""Image datasets read through torchvision: mnist, emnist, cifar10, cifar100, stl10, svhn, usps.

Each is declared once as a `TorchvisionSource` (which torchvision class, which files
in which folder, which constructor calls give the official train and test sets)
and turned into a `DatasetSpec` by `torchvision_spec`:

* `prepare(root, params)`: the expected files all present -> nothing (no network);
  otherwise the torchvision class is constructed with `download=True`, i.e. the
  download path of torchvision itself (URLs, MD5 checks, archive extraction).
  A failed download raises `DataMissingError` naming the files, the folder and
  how to get them.
* `load(root, params)`: offline. Absent files raise `DataMissingError` at once,
  before torchvision is imported; the class is then constructed with
  `download=False` and its arrays (`.data` and `.targets` / `.labels`) become a
  `RawDataset`: uint8 images in CHW layout (grayscale: one channel), int64
  labels in [0, num_classes), official train rows first, then official test rows.
  torchvision errors on present but unreadable files (its MD5 checks for CIFAR,
  STL-10 and SVHN; truncated archives) become `DataMissingError` too.

`root` is laid out exactly as torchvision expects (the workflow passes
`results/raw/<name>/`):

=========  ==========================================================================
mnist      MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (decompressed IDX)
emnist     EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte
cifar10    cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}
cifar100   cifar-100-python/{train,test,meta}
stl10      stl10_binary/{train_X,train_y,test_X,test_y,unlabeled_X}.bin
svhn       {train,test}_32x32.mat (+ extra_32x32.mat with include_extra)
usps       usps.bz2, usps.t.bz2 (bz2-compressed LIBSVM text, kept compressed)
=========  ==========================================================================

Dataset notes:

* emnist: torchvision returns the IDX arrays as stored, and EMNIST stores every
  image transposed (rows and columns swapped) relative to MNIST, so torchvision's
  EMNIST characters appear mirrored and rotated (pytorch/vision#8783,
  pytorch/pytorch#42012). With `upright=True` (default) the loader transposes each
  image back; `upright=False` keeps torchvision's orientation, as code that uses
  `torchvision.datasets.EMNIST` unchanged (e.g. PFLlib's generate_EMNIST.py) trains on.
  The `letters` split's labels 1..26 are shifted to 0..25 (26 classes; torchvision
  lists an unused "N/A" class 0).
* stl10: the 5,000 + 8,000 labelled images form the dataset; the 100,000 unlabelled
  images are NOT rows of it (a `RawDataset` holds labels in [0, num_classes), which
  partitioners and shard manifests rely on: `np.bincount` of -1 fails). Methods
  that want them (self-supervised pre-training) read them with
  `load_stl10_unlabeled(root)`, from the same prepared files.
* svhn: labels are 0..9 (torchvision maps the file's 10 to digit 0);
  `include_extra=True` adds the 531,131 "extra" images to the official train set.
* usps: torchvision scales the file's [-1, 1] values by (v + 1) / 2 * 255 and
  truncates to uint8.

Normalisation (mean, std on the [0, 1] scale, per channel): the commonly used
published values, cited at each constant; USPS has none in common use, so its
statistics are computed from the loaded official train set (population std).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.dataset_registry import DatasetSpec, register_dataset
from fedrepro.registry import Param

Params = dict[str, Any]


@dataclass(frozen=True)
class TorchvisionSource:
    """One torchvision dataset class, described well enough to prepare and load it.

    Callables take the resolved dataset params.
    """

    name: str  # registry name
    tv_class: str  # attribute of torchvision.datasets
    title: str  # human name used in messages
    summary: str
    url: str  # the dataset's home page
    num_classes: int  # for the default params (DatasetSpec.num_classes)
    sample_shape: tuple[int, ...]
    size: str
    layout: str  # layout of the class's `.data`: "NHW", "NHWC" or "NCHW"
    label_attr: str  # "targets" or "labels"
    folder: Callable[[Params], str]  # where the files live, relative to root
    files: Callable[[Params], tuple[str, ...]]  # file names inside `folder`
    parts: Callable[[Params], list[tuple[int, dict]]]  # (official split, constructor kwargs), train first
    downloads: Callable[[Params], list[dict]]  # constructor kwargs whose download=True fetches every file
    fetch: Callable[[Params], str]  # what the download fetches (for messages)
    manual: Callable[[Params], str]  # how to place the files by hand
    stats: Callable[[Params], tuple[tuple[float, ...], tuple[float, ...]]] | None = None  # None: computed
    params: dict[str, Param] = field(default_factory=dict)
    classes_for: Callable[[Params], int] | None = None  # num_classes as a function of params
    postprocess: Callable[[np.ndarray, np.ndarray, Params], tuple[np.ndarray, np.ndarray]] | None = None
    check_file: Callable[[Path], None] | None = None  # extra validation of a present file (offline, cheap)
    unlabeled: Callable[[Path, Params], np.ndarray | None] | None = None  # images without labels (RawDataset.unlabeled)
    class_counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # DatasetSpec.class_counts: as published

    @property
    def source(self) -> str:
        return f"{self.url} (via torchvision.datasets.{self.tv_class})"


SOURCES: dict[str, TorchvisionSource] = {}


# --------------------------------------------------------------------- the factory


def raw_folder(src: TorchvisionSource, root: Path, params: Params) -> Path:
    folder = src.folder(params)
    return Path(root) / folder if folder else Path(root)


def missing_files(src: TorchvisionSource, root: Path, params: Params) -> list[str]:
    folder = raw_folder(src, root, params)
    return [f for f in src.files(params) if not (folder / f).is_file()]


def _prepare_command(src: TorchvisionSource, root: Path, params: Params) -> str:
    changed = {k: v for k, v in params.items() if k in src.params and v != src.params[k].default}
    cmd = f"fedrepro prepare {src.name} --root {root}"
    if changed:
        import json

        cmd += f" --params '{json.dumps(changed, sort_keys=True)}'"
    return cmd


def missing_message(src: TorchvisionSource, root: Path, params: Params, detail: str = "") -> str:
    """Which files are missing, where they go and the two ways to get them."""
    folder = raw_folder(src, root, params)
    expected = src.files(params)
    missing = missing_files(src, root, params) or list(expected)
    lines = [
        f"{src.title} raw files are missing from {folder}:",
        *(f"  {f}" for f in missing),
        f"Expected all of: {', '.join(expected)} in {folder}.",
        "To get them, either:",
        f"  - run `{_prepare_command(src, root, params)}` on a machine with internet access"
        f" (torchvision.datasets.{src.tv_class}(..., download=True) fetches {src.fetch(params)}), or",
        f"  - copy them from an existing copy: {src.manual(params)}",
    ]
    if detail:
        lines.append(f"(automatic download failed: {detail})")
    return "\n".join(lines)


def _dataset_class(src: TorchvisionSource):
    import torchvision  # lazy: slow import

    return getattr(torchvision.datasets, src.tv_class)


def _construct(src: TorchvisionSource, root: Path, params: Params, kwargs: dict):
    """The torchvision dataset, offline; its refusal of present files -> DataMissingError."""
    cls = _dataset_class(src)
    try:
        return cls(str(root), download=False, **kwargs)
    except Exception as exc:  # RuntimeError("... not found or corrupted"), EOFError, ValueError, ...
        folder = raw_folder(src, root, params)
        raise DataMissingError(
            f"{src.title}: torchvision.datasets.{src.tv_class}({kwargs}) could not read the files in {folder}: "
            f"{type(exc).__name__}: {exc}\n"
            "They are present but corrupt, truncated or not the official release (torchvision checks the MD5 "
            f"of the CIFAR, STL-10 and SVHN files). Delete them and run `{_prepare_command(src, root, params)}` "
            f"again, or copy intact files: {src.manual(params)}"
        ) from None


def _to_chw(data: Any, layout: str) -> np.ndarray:
    """A class's `.data` (torch tensor or array) as a uint8 (N, C, H, W) array (a view where possible)."""
    a = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
    if a.dtype != np.uint8:
        raise DataMissingError(f"image array has dtype {a.dtype}; expected uint8")
    if layout == "NHW":
        return a[:, None, :, :]
    if layout == "NHWC":
        return a.transpose(0, 3, 1, 2)
    if layout == "NCHW":
        return a
    raise ValueError(f"unknown layout {layout!r}")


def _stack_contiguous(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate (possibly transposed) views into one C-contiguous array with a single copy.

    (np.concatenate keeps the inputs' memory order, so transposed views would stay non-contiguous.)
    """
    shape = parts[0].shape[1:]
    if any(p.shape[1:] != shape for p in parts):
        raise DataMissingError(f"official parts have different image shapes: {[p.shape[1:] for p in parts]}")
    out = np.empty((sum(len(p) for p in parts), *shape), dtype=np.uint8)
    start = 0
    for p in parts:
        out[start : start + len(p)] = p
        start += len(p)
    return out


def _labels(ds: Any, attr: str) -> np.ndarray:
    y = getattr(ds, attr)
    y = y.numpy() if hasattr(y, "numpy") else np.asarray(y)
    return y.astype(np.int64, copy=False)


def _computed_stats(x: np.ndarray, rows: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and population std of x / 255 over `rows` (float64 sums, chunked)."""
    c = x.shape[1]
    total = np.zeros(c)
    total_sq = np.zeros(c)
    count = 0
    for start in range(0, len(rows), 4096):
        chunk = x[rows[start : start + 4096]].astype(np.float64) / 255.0
        total += chunk.sum(axis=(0, 2, 3))
        total_sq += (chunk**2).sum(axis=(0, 2, 3))
        count += chunk.shape[0] * chunk.shape[2] * chunk.shape[3]
    if count == 0:
        return (0.0,) * c, (1.0,) * c
    mean = total / count
    var = np.maximum(total_sq / count - mean**2, 0.0)
    return tuple(float(m) for m in mean), tuple(float(math.sqrt(v)) for v in var)


def load_torchvision(src: TorchvisionSource, root: Path, params: Params) -> RawDataset:
    """Read every official part through torchvision (offline) into one RawDataset."""
    root = Path(root)
    if missing_files(src, root, params):
        raise DataMissingError(missing_message(src, root, params))
    if src.check_file is not None:
        folder = raw_folder(src, root, params)
        for f in src.files(params):
            src.check_file(folder / f)
    num_classes = src.classes_for(params) if src.classes_for else src.num_classes
    xs, ys, splits = [], [], []
    for split, kwargs in src.parts(params):
        ds = _construct(src, root, params, kwargs)
        x, y = _to_chw(ds.data, src.layout), _labels(ds, src.label_attr)
        del ds
        if src.postprocess is not None:
            x, y = src.postprocess(x, y, params)
        if len(x) != len(y):
            raise DataMissingError(f"{src.title} ({kwargs}): {len(x)} images but {len(y)} labels")
        xs.append(x)
        ys.append(y)
        splits.append(np.full(len(y), split, dtype=np.int8))
    x = _stack_contiguous(xs)
    del xs
    y = np.concatenate(ys)
    official_split = np.concatenate(splits)
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DataMissingError(
            f"{src.title}: labels outside [0, {num_classes}) (found {int(y.min())}..{int(y.max())}); "
            f"the files in {raw_folder(src, root, params)} are not the expected release"
        )
    if tuple(x.shape[1:]) != tuple(src.sample_shape):
        raise DataMissingError(f"{src.title}: images of shape {tuple(x.shape[1:])}; expected {src.sample_shape}")
    if src.stats is not None:
        mean, std = src.stats(params)
    else:
        mean, std = _computed_stats(x, np.where(official_split == 0)[0])
    return RawDataset(
        name=src.name,
        x=x,
        y=y,
        num_classes=num_classes,
        official_split=official_split,
        mean=tuple(mean),
        std=tuple(std),
        source=src.source,
        unlabeled=src.unlabeled(root, params) if src.unlabeled is not None else None,
    )


def prepare_torchvision(src: TorchvisionSource, root: Path, params: Params) -> None:
    """Files present -> nothing; else torchvision's own download (download=True)."""
    root = Path(root)
    if not missing_files(src, root, params):
        return
    cls = _dataset_class(src)
    root.mkdir(parents=True, exist_ok=True)
    try:
        for kwargs in src.downloads(params):
            cls(str(root), download=True, **kwargs)
    except Exception as exc:  # URLError, RuntimeError("Error downloading ..."), OSError, ...
        raise DataMissingError(missing_message(src, root, params, f"{type(exc).__name__}: {exc}")) from None
    if missing_files(src, root, params):
        raise DataMissingError(missing_message(src, root, params))


def torchvision_spec(src: TorchvisionSource) -> DatasetSpec:
    """The registry entry of a torchvision dataset."""
    return DatasetSpec(
        name=src.name,
        summary=src.summary,
        source=src.source,
        num_classes=src.num_classes,
        sample_shape=src.sample_shape,
        size=src.size,
        params=src.params,
        prepare=lambda root, params: prepare_torchvision(src, root, params),
        load=lambda root, params: load_torchvision(src, root, params),
        class_counts=src.class_counts,
    )


def register(src: TorchvisionSource) -> DatasetSpec:
    SOURCES[src.name] = src
    return register_dataset(torchvision_spec(src))


def _const(value):
    return lambda params: value


def _train_test(train: dict, test: dict):
    return _const([(0, train), (1, test)])


# --------------------------------------------------------------------- MNIST / EMNIST

IDX_UBYTE = 0x08


def check_idx_file(path: Path) -> None:
    """Reject a truncated or padded uint8 IDX file (torchvision does not checksum extracted IDX files)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
        if len(head) < 4:
            raise DataMissingError(f"{path}: truncated IDX file (no header); delete it and prepare again")
        magic = struct.unpack(">I", head)[0]
        nd, ty = magic & 0xFF, (magic >> 8) & 0xFF
        dims_raw = fh.read(4 * nd)
    if magic >> 16 != 0 or ty != IDX_UBYTE or not 1 <= nd <= 3 or len(dims_raw) < 4 * nd:
        raise DataMissingError(f"{path}: not a uint8 IDX file (magic {magic:#010x}); delete it and prepare again")
    dims = struct.unpack(f">{nd}I", dims_raw)
    expected = 4 * (1 + nd) + math.prod(dims)
    actual = path.stat().st_size
    if actual != expected:
        raise DataMissingError(
            f"{path}: {actual} bytes, but its IDX header (dims {dims}) implies {expected}; "
            "the file is truncated or corrupt: delete it and prepare again"
        )


MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

register(
    TorchvisionSource(
        name="mnist",
        tv_class="MNIST",
        title="MNIST",
        summary="MNIST: 28x28 grayscale handwritten digits, 10 classes",
        url="http://yann.lecun.com/exdb/mnist/",
        num_classes=10,
        sample_shape=(1, 28, 28),
        size="70,000 images (60,000 train + 10,000 test)",
        layout="NHW",
        label_attr="targets",
        folder=_const("MNIST/raw"),
        files=_const(MNIST_FILES),
        parts=_train_test({"train": True}, {"train": False}),
        downloads=_const([{"train": True}]),  # one instance fetches all four files
        fetch=_const("the four .gz files (11 MB) from https://ossci-datasets.s3.amazonaws.com/mnist/ and gunzips them"),
        manual=_const(
            "gunzip the four files train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
            "t10k-labels-idx1-ubyte.gz (https://ossci-datasets.s3.amazonaws.com/mnist/) into that folder"
        ),
        # pytorch/examples mnist/main.py: transforms.Normalize((0.1307,), (0.3081,)).
        stats=_const(((0.1307,), (0.3081,))),
        check_file=check_idx_file,
        # the label files' per-digit counts (train + test: 6,903, 7,877, 6,990, 7,141, 6,824, 6,313, 6,876, 7,293, 6,825, 6,958)
        class_counts=((5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
                      (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)),
    )
)


EMNIST_SPLITS = ("byclass", "bymerge", "balanced", "letters", "digits", "mnist")
EMNIST_NUM_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}
#: Lightning-Bolts' `emnist_normalization(split)` (pl_bolts/transforms/dataset_normalizations.py): (mean, std).
EMNIST_STATS = {
    "balanced": (0.175, 0.333),
    "byclass": (0.174, 0.332),
    "bymerge": (0.174, 0.332),
    "digits": (0.173, 0.332),
    "letters": (0.172, 0.331),
    "mnist": (0.173, 0.332),
}


def emnist_files(params: Params) -> tuple[str, ...]:
    s = params["split"]
    return tuple(f"emnist-{s}-{part}-{kind}-ubyte" for part in ("train", "test") for kind in ("images-idx3", "labels-idx1"))


def _emnist_post(x: np.ndarray, y: np.ndarray, params: Params) -> tuple[np.ndarray, np.ndarray]:
    if params["upright"]:
        x = x.transpose(0, 1, 3, 2)  # EMNIST's IDX files store each image transposed
    if params["split"] == "letters":
        y = y - 1  # 1..26 -> 0..25
    return x, y


register(
    TorchvisionSource(
        name="emnist",
        tv_class="EMNIST",
        title="EMNIST",
        summary="EMNIST: 28x28 grayscale handwritten characters; split balanced (default): 47 classes",
        url="https://www.nist.gov/itl/products-and-services/emnist-dataset",
        num_classes=EMNIST_NUM_CLASSES["balanced"],
        sample_shape=(1, 28, 28),
        size=(
            "balanced: 131,600 images (112,800 train + 18,800 test); byclass/bymerge: 814,255 (697,932 + 116,323); "
            "letters: 145,600 (124,800 + 20,800); digits: 280,000 (240,000 + 40,000); mnist: 70,000 (60,000 + 10,000)"
        ),
        layout="NHW",
        label_attr="targets",
        folder=_const("EMNIST/raw"),
        files=emnist_files,
        parts=lambda p: [(0, {"split": p["split"], "train": True}), (1, {"split": p["split"], "train": False})],
        downloads=lambda p: [{"split": p["split"]}],  # gzip.zip holds every split; all are extracted
        fetch=_const("gzip.zip (562 MB) from https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip and extracts every split"),
        manual=lambda p: (
            "unzip gzip.zip (https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip) and gunzip "
            f"gzip/emnist-{p['split']}-*-ubyte.gz into that folder"
        ),
        stats=lambda p: ((EMNIST_STATS[p["split"]][0],), (EMNIST_STATS[p["split"]][1],)),
        params={
            "split": Param("balanced", "EMNIST split (balanced: 47 classes, as FedCoSR uses)", str, choices=EMNIST_SPLITS),
            "upright": Param(
                True,
                "transpose images to upright (the IDX files store them transposed); false keeps torchvision's orientation",
                bool,
            ),
        },
        classes_for=lambda p: EMNIST_NUM_CLASSES[p["split"]],
        postprocess=_emnist_post,
        check_file=check_idx_file,
    )
)


# --------------------------------------------------------------------- CIFAR

CIFAR10_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")

register(
    TorchvisionSource(
        name="cifar10",
        tv_class="CIFAR10",
        title="CIFAR-10",
        summary="CIFAR-10: 32x32 colour images of objects and animals, 10 classes",
        url="https://www.cs.toronto.edu/~kriz/cifar.html",
        num_classes=10,
        sample_shape=(3, 32, 32),
        size="60,000 images (50,000 train + 10,000 test)",
        layout="NHWC",
        label_attr="targets",
        folder=_const("cifar-10-batches-py"),
        files=_const(CIFAR10_FILES),
        parts=_train_test({"train": True}, {"train": False}),
        downloads=_const([{"train": True}]),
        fetch=_const("cifar-10-python.tar.gz (163 MB) from https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"),
        manual=_const(
            "extract cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz) into the root; "
            "it creates cifar-10-batches-py/ (torchvision checks each file's MD5)"
        ),
        # Per-channel mean and population std of the 50,000 training images (np.std(train_data, axis=(0, 1, 2)) / 255,
        # e.g. khakhlyuk/fixedconv utils/data_stats.py "real" values; the often copied std (0.2023, 0.1994, 0.2010)
        # of kuangliu/pytorch-cifar is not the pixel std).
        stats=_const(((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))),
        class_counts=((5_000,) * 10, (1_000,) * 10),  # "exactly 5,000 / 1,000 images per class"
    )
)

register(
    TorchvisionSource(
        name="cifar100",
        tv_class="CIFAR100",
        title="CIFAR-100",
        summary="CIFAR-100: 32x32 colour images, 100 (fine-label) classes",
        url="https://www.cs.toronto.edu/~kriz/cifar.html",
        num_classes=100,
        sample_shape=(3, 32, 32),
        size="60,000 images (50,000 train + 10,000 test)",
        layout="NHWC",
        label_attr="targets",
        folder=_const("cifar-100-python"),
        files=_const(("train", "test", "meta")),
        parts=_train_test({"train": True}, {"train": False}),
        downloads=_const([{"train": True}]),
        fetch=_const("cifar-100-python.tar.gz (161 MB) from https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"),
        manual=_const(
            "extract cifar-100-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz) into the root; "
            "it creates cifar-100-python/ (torchvision checks each file's MD5)"
        ),
        # Per-channel mean and population std of the 50,000 training images, rounded: weiaicunzai/pytorch-cifar100
        # conf/global_settings.py CIFAR100_TRAIN_MEAN = (0.50708, 0.48655, 0.44092), _STD = (0.26733, 0.25644, 0.27615).
        stats=_const(((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))),
        class_counts=((500,) * 100, (100,) * 100),  # "500 training and 100 testing images per class"
    )
)


# --------------------------------------------------------------------- STL-10

STL10_FILES = ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin", "unlabeled_X.bin")
STL10_MANUAL = (
    "extract stl10_binary.tar.gz (http://ai.stanford.edu/~acoates/stl10/stl10_binary.tar.gz) into the root; "
    "it creates stl10_binary/ (torchvision checks the MD5 of all five .bin files, unlabeled_X.bin included, "
    "whichever split is read)"
)

register(
    TorchvisionSource(
        name="stl10",
        tv_class="STL10",
        title="STL-10",
        summary="STL-10: 96x96 colour images, 10 classes (100k unlabelled images via vision.load_stl10_unlabeled)",
        url="https://cs.stanford.edu/~acoates/stl10/",
        num_classes=10,
        sample_shape=(3, 96, 96),
        size="13,000 labelled images (5,000 train + 8,000 test); plus 100,000 unlabelled images (separate accessor)",
        layout="NCHW",  # torchvision already transposes the column-major .bin images to upright CHW
        label_attr="labels",
        folder=_const("stl10_binary"),
        files=_const(STL10_FILES),
        parts=_train_test({"split": "train"}, {"split": "test"}),
        downloads=_const([{"split": "train"}]),
        fetch=_const("stl10_binary.tar.gz (2.6 GB) from http://ai.stanford.edu/~acoates/stl10/stl10_binary.tar.gz"),
        manual=_const(STL10_MANUAL),
        # The per-channel mean and std most widely used for STL-10 (of the labelled training images; found in many
        # public training scripts). Lightning-Bolts' stl10_normalization uses the coarser (0.43, 0.42, 0.39),
        # (0.27, 0.26, 0.27).
        stats=_const(((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713))),
        params={"unlabeled": Param(0, "how many of the 100,000 unlabelled images (the first k in file order) join as an unlabeled "
                                      "pool, spread iid over the training clients for the self-supervised stage (Calibre); "
                                      "0 = none, 100000 = all (2.8 GB as uint8)", int, minimum=0, maximum=100_000)},
        unlabeled=lambda root, params: load_stl10_unlabeled(root)[: params["unlabeled"]] if params["unlabeled"] else None,
    )
)


def load_stl10_unlabeled(root: Path) -> np.ndarray:
    """STL-10's 100,000 unlabelled images as uint8 (N, 3, 96, 96), read offline by torchvision.

    Same files and folder as the `stl10` dataset (`fedrepro prepare stl10` fetches them);
    absent files raise `DataMissingError`. Needs about 2.8 GB of memory.
    """
    src, root, params = SOURCES["stl10"], Path(root), {}
    if missing_files(src, root, params):
        raise DataMissingError(missing_message(src, root, params))
    ds = _construct(src, root, params, {"split": "unlabeled"})
    return np.ascontiguousarray(_to_chw(ds.data, src.layout))


# --------------------------------------------------------------------- SVHN

SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"


def _svhn_splits(params: Params) -> list[str]:
    return ["train", "extra", "test"] if params["include_extra"] else ["train", "test"]


register(
    TorchvisionSource(
        name="svhn",
        tv_class="SVHN",
        title="SVHN",
        summary="SVHN (cropped digits): 32x32 colour house-number digits, 10 classes",
        url=SVHN_URL,
        num_classes=10,
        sample_shape=(3, 32, 32),
        size="99,289 images (73,257 train + 26,032 test); include_extra adds 531,131 train images",
        layout="NCHW",  # torchvision transposes the .mat's (H, W, C, N) to (N, C, H, W)
        label_attr="labels",
        folder=_const(""),
        files=lambda p: tuple(f"{s}_32x32.mat" for s in _svhn_splits(p)),
        parts=lambda p: [(int(s == "test"), {"split": s}) for s in _svhn_splits(p)],
        downloads=lambda p: [{"split": s} for s in _svhn_splits(p)],
        fetch=lambda p: (
            " and ".join(f"{s}_32x32.mat" for s in _svhn_splits(p)) + f" (train 182 MB, test 64 MB, extra 1.3 GB) from {SVHN_URL}"
        ),
        manual=lambda p: (
            f"download {', '.join(f'{s}_32x32.mat' for s in _svhn_splits(p))} from {SVHN_URL} into the root "
            "(torchvision checks each file's MD5)"
        ),
        # Per-channel mean and std of the SVHN training images, as widely used
        # (e.g. PatrickZH/DeepCore deepcore/datasets/svhn.py).
        stats=_const(((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))),
        params={"include_extra": Param(False, "add the 531,131 'extra' images to the official train set", bool)},
    )
)


# --------------------------------------------------------------------- USPS

USPS_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass.html#usps"

register(
    TorchvisionSource(
        name="usps",
        tv_class="USPS",
        title="USPS",
        summary="USPS: 16x16 grayscale handwritten digits, 10 classes",
        url=USPS_URL,
        num_classes=10,
        sample_shape=(1, 16, 16),
        size="9,298 images (7,291 train + 2,007 test)",
        layout="NHW",
        label_attr="targets",
        folder=_const(""),
        files=_const(("usps.bz2", "usps.t.bz2")),
        parts=_train_test({"train": True}, {"train": False}),
        downloads=_const([{"train": True}, {"train": False}]),  # one file per split
        fetch=_const("usps.bz2 and usps.t.bz2 (6 MB) from https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/"),
        manual=_const(
            "download usps.bz2 and usps.t.bz2 from https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/ "
            "into the root (keep them bz2-compressed)"
        ),
        stats=None,  # no commonly used published values: computed from the official train set
    )
)
