"""`syn`: SynthDigits (Ganin's SynNumbers), 3x32x32 RGB digits, 10 classes."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.dataset_registry import DatasetSpec, register_dataset
from fedrepro.data.domains._common import digit_labels, missing_error, stack_splits
from fedrepro.data.domains.fedbn_digits import (FEDBN_DIGITS_URL, FEDBN_DIGITS_ZIP, FEDBN_HOW, prepare_fedbn_digits,
                                                fedbn_present, read_fedbn_digits)
from fedrepro.data.domains.mnistm import LAYOUT_PARAM, load_layout_digits, pick_layout, read_layout


SYN_ORIG_DIR = "SynthDigits"
SYN_ORIG_FILES = ("synth_train_32x32.mat", "synth_test_32x32.mat")
SYN_ORIG_URL = "http://yaroslav.ganin.net/ (SynNumbers; Ganin & Lempitsky, ICML 2015)"
SYN_SOURCE = (
    "SynthDigits / SynNumbers (Ganin & Lempitsky, ICML 2015): FedBN's pre-processed release "
    f"{FEDBN_DIGITS_URL} ({FEDBN_DIGITS_ZIP}, https://github.com/med-air/FedBN), "
    f"or the original synth_{{train,test}}_32x32.mat from {SYN_ORIG_URL}"
)


def syn_orig_present(root: Path) -> bool:
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
    return x, digit_labels(mat["y"], str(path))


def read_mat_splits(folder: Path, files: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SVHN-format train then test .mat files of one folder as (NHWC uint8, labels, split) (SVHN, SynthDigits)."""
    return stack_splits((split, *_read_svhn_style_mat(folder / f)) for split, f in enumerate(files))


def read_syn(root: Path, layout: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    root = Path(root)
    chosen = read_layout(root, layout, "syn", "SynthDigits", _syn_orig_missing(root), _syn_how())
    if chosen == "fedbn":
        return (*read_fedbn_digits(root, "syn"), chosen)
    return (*read_mat_splits(root / SYN_ORIG_DIR, SYN_ORIG_FILES), chosen)


def _syn_how() -> list[str]:
    return FEDBN_HOW + [
        f"or use the original release: put {SYN_ORIG_FILES[0]} and {SYN_ORIG_FILES[1]} ({SYN_ORIG_URL}; also inside "
        f"FedBN's raw data.zip) into {SYN_ORIG_DIR}/ in the data root (layout='original')"
    ]


def prepare_syn(root: Path, params: dict) -> None:
    root = Path(root)
    if pick_layout(root, params["layout"], fedbn_present(root, "syn"), syn_orig_present(root)):
        return
    if params["layout"] == "original":
        raise missing_error("SynthDigits original files are", root / SYN_ORIG_DIR, SYN_ORIG_FILES, _syn_how()[-1:])
    prepare_fedbn_digits(root, ["syn"])


def _load_syn(root: Path, params: dict) -> RawDataset:
    return load_layout_digits("syn", read_syn, SYN_SOURCE, root, params)


register_dataset(
    DatasetSpec(
        name="syn",
        summary="SynthDigits: synthetic Windows-font digits on varied backgrounds, 3x32x32, 10 classes",
        source=SYN_SOURCE,
        num_classes=10,
        sample_shape=(3, 32, 32),
        size="FedBN release: 7,438 train (10 partitions) + 97,791 test; original: 479,400 train + 9,553 test",
        params={"layout": LAYOUT_PARAM},
        prepare=prepare_syn,
        load=_load_syn,
    )
)
