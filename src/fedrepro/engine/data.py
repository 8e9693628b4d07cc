"""A cell's client data as tensors on the device, batched by index slices."""

from __future__ import annotations

import numpy as np
import torch

from ..data.shards import ClientShard
from ..federation import Client, Split  # the shared vocabulary (re-exported here: the engine's names since the split)
from ..io import derive_seed


def to_split(x: np.ndarray, y: np.ndarray, mean: torch.Tensor, std: torch.Tensor, device: torch.device) -> Split:
    t = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    # uint8 images are scaled to [0, 1] first; float features are used as they are.
    t = t.float().div_(255.0) if t.dtype == torch.uint8 else t.float()
    shape = (1, -1) + (1,) * (t.dim() - 2)
    t = (t - mean.view(shape)) / std.view(shape)
    return Split(t.contiguous(), torch.from_numpy(np.asarray(y, dtype=np.int64)).to(device))


def normaliser(manifest: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel (mean, std) of the manifest the data tensors are normalised with, on `device`."""
    return (torch.tensor(manifest["mean"], dtype=torch.float32, device=device),
            torch.tensor(manifest["std"], dtype=torch.float32, device=device))


def carve_validation(x: np.ndarray, y: np.ndarray, fraction: float, seed: int) -> tuple[tuple, tuple]:
    """Hold out `fraction` of a client's TRAINING samples as validation (tuning trials): a seeded
    random subset of round(fraction * n) samples, at least one when n >= 2 and never all of them.
    Returns ((x_train, y_train), (x_val, y_val)); the test split is not touched."""
    n = len(y)
    k = min(n - 1, max(1 if n >= 2 else 0, int(round(fraction * n))))
    order = np.random.default_rng(seed).permutation(n)
    val, train = np.sort(order[:k]), np.sort(order[k:])
    return (x[train], y[train]), (x[val], y[val])


def load_clients(manifest: dict, shards: list[ClientShard], device: torch.device,
                 val_from_train: float | None = None, seed: int = 0) -> list[Client]:
    """The clients' splits as tensors. `val_from_train` (a tuning trial): the client's validation
    split is carved from its training split (`carve_validation`, seeded by (seed, client)), and the
    test split is never loaded: its slot holds the validation data too, so nothing a trial computes
    comes from test data."""
    mean, std = normaliser(manifest, device)
    clients = []
    for s in shards:
        arrays = {name: (s.x[name], s.y[name]) for name in ("train", "test", "val")}
        if val_from_train:
            arrays["train"], arrays["val"] = carve_validation(*arrays["train"], val_from_train,
                                                              derive_seed(seed, "tuning-validation", s.id))
            arrays["test"] = arrays["val"]
        splits = {name: to_split(x, y, mean, std, device) for name, (x, y) in arrays.items()}
        entry = manifest["clients"][s.id]
        free = s.x.get("unlabeled")
        unlabeled = to_split(free, s.y["unlabeled"], mean, std, device) if free is not None and len(free) else None
        clients.append(Client(s.id, splits["train"], splits["test"], splits["val"], unseen=bool(entry.get("unseen", False)),
                              groups=dict(entry.get("groups") or {}), unlabeled=unlabeled))
    return clients


def load_split(manifest: dict, shard: ClientShard, split: str, device: torch.device) -> Split:
    """One split of a shard (the official test set) as a normalised tensor split."""
    mean, std = normaliser(manifest, device)
    return to_split(shard.x[split], shard.y[split], mean, std, device)


#: crop_flip's zero padding in pixels: torchvision's RandomCrop(32, padding=4), as FedBABU and PFL code use on CIFAR.
CROP_PADDING = 4


def _crop_flip(x: torch.Tensor, g: torch.Generator, padding: int = CROP_PADDING) -> torch.Tensor:
    """Random crop with zero padding + horizontal flip of a whole batch, as one gather
    on the batch's device (no per-sample Python loop)."""
    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding,) * 4)
    # non_blocking: a fresh pageable CPU tensor is staged at once, so no stream synchronisation per batch
    offsets = torch.randint(0, 2 * padding + 1, (2, n), generator=g).to(x.device, non_blocking=True)
    rows = (offsets[0][:, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (offsets[1][:, None] + torch.arange(w, device=x.device))[:, None, None, :]
    out = padded[torch.arange(n, device=x.device)[:, None, None, None], torch.arange(c, device=x.device)[None, :, None, None], rows, cols]
    flip = (torch.rand(n, generator=g) < 0.5).to(x.device, non_blocking=True)[:, None, None, None]
    return torch.where(flip, out.flip(-1), out)


AUGMENTATIONS = {
    "none": None,
    "crop_flip": _crop_flip,
}


def augment_problem(name: str, shape: tuple[int, ...]) -> str | None:
    """Why augmentation `name` does not fit samples of `shape`, or None when it does.

    crop_flip needs images (C, H, W) whose sides are at least 4 x CROP_PADDING (16 pixels): its crop shifts
    the image by up to CROP_PADDING pixels each way, so on such sides at least three quarters of each row
    and column stay in view (CIFAR's 32: seven eighths). On 8x8 digits a shift of 4 keeps half of each side
    and a quarter of the image, and training stayed at chance (0.087) with status ok (issue 37).
    """
    if name == "none":
        return None
    if len(shape) != 3:
        return "not images (C, H, W)"
    least = 4 * CROP_PADDING
    if min(shape[1:]) < least:
        return (f"images with sides under {least} pixels: {name}'s random crop shifts by up to {CROP_PADDING} pixels "
                f"each way, which leaves less than three quarters of each side in view")
    return None
