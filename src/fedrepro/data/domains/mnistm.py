"""`mnistm`: MNIST-M, 3x28x28 RGB digits, 10 classes (FedBN layout or the original release)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.dataset_registry import DatasetSpec, register_dataset
from fedrepro.data.downloads import contained
from fedrepro.registry import Param, show
from fedrepro.data.domains._common import (DIGIT_MEAN, DIGIT_STD, digit_labels, missing_error, stack_splits, read_images,
                                           to_rgb_chw)
from fedrepro.data.domains.fedbn_digits import (FEDBN_DIGITS_URL, FEDBN_DIGITS_ZIP, FEDBN_HOW, fedbn_expected,
                                                prepare_fedbn_digits, fedbn_present, read_fedbn_digits)


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


def mnistm_orig_present(root: Path) -> bool:
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
        for i, line in enumerate(read_list_lines(listing), 1):
            fname, label = list_entry(listing, i, line)
            names.append(contained(d / f"mnist_m_{name}", fname, f"{listing}, line {i}"))
            labels.append(label)
        missing = [n for n in names if not os.path.isfile(n)]
        if missing:
            raise DataMissingError(f"MNIST-M: {len(missing)} images listed in mnist_m_{name}_labels.txt are missing, e.g. {missing[:3]}")
        x = read_images(names, 28).transpose(0, 2, 3, 1)  # back to NHWC like the other readers
        pieces.append((split, x, digit_labels(labels, str(d / f"mnist_m_{name}_labels.txt"))))
    return stack_splits(pieces)


def read_list_lines(path: Path) -> list[str]:
    """The non-empty lines of a list file (MNIST-M labels, DomainNet splits) as text."""
    try:
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataMissingError(f"cannot read {path} as a UTF-8 list of '<image path> <label>' lines: {exc}") from None


def list_entry(path: Path, lineno: int, line: str) -> tuple[str, int]:
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


def pick_layout(root: Path, layout: str, fedbn_ok: bool, orig_ok: bool) -> str | None:
    if layout == "fedbn":
        return "fedbn" if fedbn_ok else None
    if layout == "original":
        return "original" if orig_ok else None
    return "fedbn" if fedbn_ok else ("original" if orig_ok else None)


def read_layout(root: Path, layout: str, domain: str, title: str, orig_missing: list[str], how: list[str]) -> str:
    """The layout to read a two-release digit domain (mnistm, syn) from; if there is none, a DataMissingError
    naming what each allowed layout lacks."""
    chosen = pick_layout(root, layout, fedbn_present(root, domain), not orig_missing)
    if chosen is None:
        expected = []
        if layout in ("auto", "fedbn"):
            expected += fedbn_expected(root, [domain])
        if layout in ("auto", "original"):
            expected += orig_missing
        raise missing_error(f"{title} files (layout={layout!r}) are", root, expected, how)
    return chosen


def read_mnistm(root: Path, layout: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(NHWC uint8 images, labels, split, layout used); DataMissingError at once if absent."""
    root = Path(root)
    chosen = read_layout(root, layout, "mnistm", "MNIST-M", _mnistm_orig_missing(root), _mnistm_how())
    if chosen == "fedbn":
        x, y, s = read_fedbn_digits(root, "mnistm")
        if x.ndim == 3:  # defensively accept a grayscale variant
            x = np.repeat(x[..., None], 3, axis=-1)
        return x, y, s, chosen
    return (*read_mnistm_original(root), chosen)


def prepare_mnistm(root: Path, params: dict) -> None:
    root = Path(root)
    if pick_layout(root, params["layout"], fedbn_present(root, "mnistm"), mnistm_orig_present(root)):
        return
    if params["layout"] == "original":
        raise missing_error("MNIST-M original files are", root / MNISTM_ORIG_DIR, _mnistm_orig_missing(root),
                            _mnistm_how()[-1:])
    prepare_fedbn_digits(root, ["mnistm"])


def load_layout_digits(name: str, read: Callable[[Path, str], tuple], source: str, root: Path, params: dict) -> RawDataset:
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
    return load_layout_digits("mnistm", read_mnistm, MNISTM_SOURCE, root, params)


LAYOUT_PARAM = Param(
    "auto",
    "which on-disk release to read: 'fedbn' (FedBN's .pkl partitions + test.pkl: what FedBN/FedGCR use), "
    "'original' (the original release), or 'auto' (fedbn if present, else original)",
    str,
    choices=LAYOUT_CHOICES,
)

register_dataset(
    DatasetSpec(
        name="mnistm",
        summary="MNIST-M: MNIST digits blended over BSDS500 colour patches, 3x28x28, 10 classes",
        source=MNISTM_SOURCE,
        num_classes=10,
        sample_shape=(3, 28, 28),
        size="FedBN release: 7,438 train (10 partitions) + 14,000 test; original: 59,001 train + 9,001 test",
        params={"layout": LAYOUT_PARAM},
        prepare=prepare_mnistm,
        load=_load_mnistm,
    )
)
