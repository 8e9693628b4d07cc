"""`shifted_domains`: an offline multi-domain image set, one base dataset (Fashion-MNIST or
scikit-learn's digits) under distinct per-domain transformations, `groups["domain"]`.

A stand-in for Digit-Five where its files cannot be downloaded (FedGCR's CPU variant,
methods.md §5.9): every base image is assigned to at most one domain (a seeded permutation, the
first `per_domain` images to the first domain, ...), and each domain renders its images as
3 x S x S RGB in its own style, like Digit-Five's sources differ:

* gray      the grey image as RGB (MNIST-like);
* invert    255 - grey (dark object on a light ground);
* tint      the object in one colour on a ground of another (SynthDigits-like colour);
* texture   |texture - grey| with a smooth random colour texture per image (MNIST-M's blend);
* lowres    down-sampled by 4 and up again, lower contrast (USPS-like blur);
* rot90     rotated by 90 degrees.

The base images no domain uses are the held-out proxy (`proxy_images`): the union of the domains'
styles on images the federation never sees, on which `fedrepro pretrain-backbone` pre-trains a
tiny ViT once (methods.md §5.9 (a)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from fedrepro.data.base import RawDataset
from fedrepro.data.dataset_registry import DATASETS, DatasetSpec, load_dataset, register_dataset
from fedrepro.data.domains._common import check_name_list
from fedrepro.registry import ConfigError, Param

BASES = ("fmnist", "digits")
TINT_FG, TINT_BG = np.array([255, 210, 40]), np.array([30, 10, 110])


def _gray(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.repeat(x, 3, axis=1)


def _invert(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return 255 - np.repeat(x, 3, axis=1)


def _tint(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    a = x.astype(np.float32) / 255.0
    return a * TINT_FG[None, :, None, None] + (1 - a) * TINT_BG[None, :, None, None]


def _interpolate():
    """torch's (torch.nn.functional), imported when a domain is rendered: importing the dataset
    registry, as every data job does, must not import torch (seconds of a job's start-up)."""
    import torch
    import torch.nn.functional as F

    return torch, F


def _texture(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    torch, F = _interpolate()
    n, _, h, w = x.shape
    coarse = torch.from_numpy(rng.uniform(0, 255, (n, 3, 4, 4)).astype(np.float32))
    texture = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False).numpy()
    return np.abs(texture - x.astype(np.float32))


def _lowres(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    torch, F = _interpolate()
    t = torch.from_numpy(x.astype(np.float32))
    h, w = x.shape[-2:]
    small = F.interpolate(t, size=(max(h // 4, 1), max(w // 4, 1)), mode="area")
    blurred = F.interpolate(small, size=(h, w), mode="bilinear", align_corners=False).numpy()
    return np.repeat(40 + 0.7 * blurred, 3, axis=1)


def _rot90(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.repeat(np.rot90(x, 1, axes=(2, 3)), 3, axis=1)


SHIFTS: dict[str, Callable[[np.ndarray, np.random.Generator], np.ndarray]] = {
    "gray": _gray, "invert": _invert, "tint": _tint, "texture": _texture, "lowres": _lowres, "rot90": _rot90,
}
DEFAULT_DOMAINS = ["gray", "invert", "tint", "texture", "lowres"]


def render(gray: np.ndarray, domain: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Grey uint8 images (n, 1, H, W) in a domain's style as uint8 RGB (n, 3, size, size)."""
    torch, F = _interpolate()
    t = torch.from_numpy(gray.astype(np.float32))
    if tuple(gray.shape[-2:]) != (size, size):
        t = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
    gray = t.clamp(0, 255).round().numpy().astype(np.uint8)
    return np.clip(np.round(SHIFTS[domain](gray, rng)), 0, 255).astype(np.uint8)


def _base(root: Path, params: dict) -> RawDataset:
    raw = load_dataset(params["base"], root)
    x = raw.x
    if x.dtype != np.uint8:  # scikit-learn's digits: float 0..16
        x = np.round(np.asarray(x, dtype=np.float32) * (255.0 / max(float(x.max()), 1.0))).astype(np.uint8)
    return RawDataset(raw.name, x.reshape(len(x), 1, *x.shape[-2:]), raw.y, raw.num_classes, raw.official_split,
                      raw.mean, raw.std, raw.source)


def _assignment(n: int, params: dict) -> tuple[np.ndarray, list[np.ndarray]]:
    """(seeded permutation of the base indices, the indices of each domain)."""
    domains = params["domains"]
    per = params["per_domain"] or n // len(domains)
    if per * len(domains) > n:
        raise ConfigError(f"dataset 'shifted_domains': key 'per_domain' has value {per}; allowed: at most "
                          f"{n // len(domains)} ({n} base images over {len(domains)} domains)")
    perm = np.random.default_rng(params["seed"]).permutation(n)
    return perm, [np.sort(perm[i * per : (i + 1) * per]) for i in range(len(domains))]


def _prepare(root: Path, params: dict) -> None:
    DATASETS.get(params["base"]).prepare(root, {})


def _load(root: Path, params: dict) -> RawDataset:
    domains = check_name_list("dataset 'shifted_domains'", "domains", params["domains"], tuple(SHIFTS))
    base = _base(root, params)
    _, parts = _assignment(len(base.y), params)
    rng = np.random.default_rng([params["seed"], 1])
    xs = [render(base.x[idx], d, params["image_size"], rng) for d, idx in zip(domains, parts)]
    idx = np.concatenate(parts)
    domain = np.concatenate([np.full(len(p), i, np.int64) for i, p in enumerate(parts)])
    return RawDataset("shifted_domains", np.concatenate(xs), base.y[idx], base.num_classes, base.official_split[idx],
                      (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), f"{base.source}; per-domain shifts {domains}",
                      groups={"domain": domain})


def check_styles(where: str, styles: list) -> list[str]:
    """The proxy's style names, checked against SHIFTS (ConfigError naming the key otherwise)."""
    return check_name_list(where, "styles", styles, tuple(SHIFTS))


def proxy_images(root: Path, params: dict, limit: int | None, seed: int,
                 styles: list[str] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The held-out proxy: up to `limit` base images that no domain uses, each rendered in a style
    drawn uniformly (seeded) from `styles` (default: the dataset's domains). Returns (x uint8
    (n, 3, S, S), y, num_classes)."""
    params = _resolve(params)
    styles = params["domains"] if styles is None else check_styles("pretraining", styles)
    base = _base(root, params)
    perm, parts = _assignment(len(base.y), params)
    unused = perm[sum(len(p) for p in parts):]
    if limit is not None:
        unused = unused[:limit]
    if not len(unused):
        raise ConfigError("dataset 'shifted_domains': no held-out base images for the proxy; allowed: a smaller per_domain")
    rng = np.random.default_rng([seed, 2])
    style = rng.integers(0, len(styles), len(unused))
    x = np.zeros((len(unused), 3, params["image_size"], params["image_size"]), np.uint8)
    for i, d in enumerate(styles):
        x[style == i] = render(base.x[unused[style == i]], d, params["image_size"], rng)
    return x, base.y[unused], base.num_classes


def _resolve(params: dict) -> dict:
    from fedrepro.registry import resolve_params

    return resolve_params("dataset 'shifted_domains'", PARAMS, params)


PARAMS = {
    "base": Param("fmnist", "the base dataset rendered in every domain's style (offline)", str, choices=BASES),
    "domains": Param(DEFAULT_DOMAINS, f"the domains, in order (groups['domain'] = index); allowed styles: "
                                      f"{', '.join(SHIFTS)}", list, items=Param("gray", "a style", str, choices=tuple(SHIFTS)),
                     max_items=len(SHIFTS)),
    "per_domain": Param(None, "base images per domain (disjoint); null = all base images split evenly (no proxy left)",
                        int, minimum=1),
    "image_size": Param(28, "side S of the 3 x S x S images", int, minimum=4, maximum=512),
    "seed": Param(0, "seed of the image-to-domain assignment and the random styles (textures)", int, minimum=0),
}

register_dataset(
    DatasetSpec(
        name="shifted_domains",
        summary="offline multi-domain images: Fashion-MNIST (or digits) in distinct per-domain styles, domain id per sample",
        source="rendered from `fmnist` / `digits` (see fedrepro.data.domains.shifted)",
        num_classes=10,
        sample_shape=(3, 28, 28),
        size="per_domain x len(domains) images (default: all 70,000 Fashion-MNIST images split evenly)",
        params=PARAMS,
        prepare=_prepare,
        load=_load,
    )
)
