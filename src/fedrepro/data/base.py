"""The in-memory form of a raw dataset, shared by every loader and partitioner."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


class DataMissingError(RuntimeError):
    """Raw data is absent and cannot be fetched; the message says which files go where."""


@dataclass
class RawDataset:
    """A whole dataset as arrays.

    x: (N, *sample_shape); images are uint8 in CHW layout (scaled to [0, 1] by /255
       before `mean`/`std` normalisation), feature vectors are float32 (used as is,
       then normalised).
    y: (N,) int64 class labels in [0, num_classes).
    official_split: (N,) int8, 0 = the dataset's official train set, 1 = official test set.
    mean/std: per-channel normalisation applied when the data is loaded for training.
    groups: optional named per-sample id arrays (e.g. the generating user of Synthetic).
    unlabeled: optional (M, *sample_shape) images without labels, not rows of the dataset (STL-10's
       100,000): the partition spreads them over the training clients for self-supervised training.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    official_split: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str
    groups: dict[str, np.ndarray] = field(default_factory=dict)
    unlabeled: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.y)
        if len(self.x) != n or len(self.official_split) != n:
            raise ValueError(f"{self.name}: x, y and official_split lengths differ")
        self.y = np.asarray(self.y, dtype=np.int64)
        self.official_split = np.asarray(self.official_split, dtype=np.int8)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def fingerprint(self) -> str:
        """sha256 over the arrays' bytes, shapes and dtypes: identifies the source data."""
        h = hashlib.sha256()
        for arr in (self.x, self.y, self.official_split) + (() if self.unlabeled is None else (self.unlabeled,)):
            a = np.ascontiguousarray(arr)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.data)
        return h.hexdigest()
