"""Helpers every image source shares: error messages naming the expected files, RGB conversion,
image reading and split stacking."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.downloads import UnpinnedDownloadError
from fedrepro.registry import ConfigError, show


DIGIT_MEAN = (0.5, 0.5, 0.5)  # FedBN / FedGCR: transforms.Normalize((0.5,)*3, (0.5,)*3)
DIGIT_STD = (0.5, 0.5, 0.5)
NO_NORM_MEAN = (0.0, 0.0, 0.0)  # FedGCR DomainNet / PACS: ToTensor() only
NO_NORM_STD = (1.0, 1.0, 1.0)


def missing_error(title: str, folder: Path, expected: Iterable[str], how: Sequence[str], detail: str = "") -> DataMissingError:
    """A DataMissingError whose message names the files, the folder and how to get them."""
    lines = [f"{title} missing from {folder}:", *(f"  {e}" for e in expected), "To get them:"]
    lines += [f"  - {h}" for h in how]
    if detail:
        lines.append(f"(automatic download failed: {detail})")
    return DataMissingError("\n".join(lines))


def refused_error(title: str, folder: Path, expected: Iterable[str], how: Sequence[str],
                  exc: UnpinnedDownloadError) -> DataMissingError:
    """The files are missing and their download needs the operator's opt-in: say so first."""
    return DataMissingError(f"{exc}\n" + str(missing_error(title, folder, expected, how)))


def check_name_list(where: str, key: str, value: Any, allowed: Sequence[str]) -> list[str]:
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


def domain_images_dataset(
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


def stack_splits(pieces: Iterable[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, labels, split) from (official split, images, labels) pieces, concatenated in order."""
    xs, ys, splits = [], [], []
    for split, x, y in pieces:
        xs.append(x)
        ys.append(y)
        splits.append(np.full(len(y), split, dtype=np.int8))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(splits)


def digit_labels(labels: Any, where: str) -> np.ndarray:
    """Integer 0..9 labels from a (N,), (N,1) or one-hot (N,10) array; SVHN-style 10 -> 0."""
    y = np.asarray(labels)
    if y.ndim == 2 and y.shape[1] == 10:
        y = y.argmax(axis=1)
    y = y.reshape(-1).astype(np.int64)
    y[y == 10] = 0
    if y.size and (y.min() < 0 or y.max() > 9):
        raise DataMissingError(f"{where}: labels outside 0..9 (min {y.min()}, max {y.max()}); the file is not the expected one")
    return y
