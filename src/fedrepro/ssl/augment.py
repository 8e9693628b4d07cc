"""Batched, on-device two-view SimCLR augmentation for the federated self-supervised methods.

Recipe (methods.md §2.4): Calibre's reference code builds its views with lightly's
`SimCLRTransform(input_size=32, normalize=<dataset stats>)` and lightly's defaults for everything
else, applied in this order:

    RandomResizedCrop(size, scale=(0.08, 1.0), ratio=(3/4, 4/3))
    RandomHorizontalFlip(p=0.5)                      (no vertical flip, no rotation)
    ColorJitter(0.8, 0.8, 0.8, 0.2) with p=0.8       (cj_strength 1.0)
    RandomGrayscale(p=0.2)
    GaussianBlur with p=0.5, sigma ~ U[0.1, 2.0]
    Normalize(mean, std)

Why batched on the device: lightly applies that recipe to one PIL image at a time inside a
DataLoader, which is the slow path: per-sample Python and PIL calls, and then a host-to-device
copy of two views per image. Our client data is already a normalised float tensor (often already
on the GPU), so `TwoViewAugment` un-normalises a whole batch, runs the recipe with kornia on
every sample at once (independent random parameters per sample, `same_on_batch=False`) and
re-normalises, on whatever device the batch lives.

Measured with `nice -n 10 .venv/bin/python benchmarks/ssl_augment.py --n 1024` (32x32 RGB,
batch 256, 0 loader workers) on the 2-core shared development machine, CPU only (no GPU there),
torch with 2 threads:
    TwoViewAugment on the CPU:                                  9,997 views/s
    lightly SimCLRTransform per PIL image through a DataLoader: 1,665 views/s
    ratio: 6.0x (two repeat runs on the shared, busy machine: 4.0x and 5.4x)
The kernels are not the same (kornia's bilinear crop and separable Gaussian convolution, PIL's
box-filter blur), so the views follow the same distribution, not the same pixels.

Randomness comes from torch's global RNG on the input's device (the CPU generator for a CPU
batch, the CUDA generator for a CUDA batch); the caller seeds it with `torch.manual_seed` once
per client update, which seeds both. The same seed on the same device gives identical views; a
CPU and a CUDA run with the same seed draw different parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kornia import augmentation as K
from torch import nn

# lightly's SimCLRTransform leaves RandomResizedCrop's aspect-ratio range at torchvision's default.
CROP_RATIO = (3 / 4, 4 / 3)


def blur_kernel_size(max_sigma: float, image_side: int) -> int:
    """Odd kernel covering about +-3 sigma (6*sigma + 1), at most the (odd) image side."""
    k = int(round(6 * max_sigma)) + 1
    k += 1 - k % 2
    largest = image_side if image_side % 2 else image_side - 1
    return max(1, min(k, largest))


class TwoViewAugment:
    """Two independent SimCLR views of a normalised batch: `view_a, view_b = augment(x)`.

    `x` is a normalised float batch (N, C, H, W) on any device; `mean` and `std` (one value per
    channel) are the normalisation already applied to it. Each view has shape
    (N, C, image_size, image_size), which is the input's shape when `image_size` is the image
    side (the intended use), and the input's dtype and device; computation runs in float32 and
    without autograd.

    C == 3: the full recipe. C == 1: saturation, hue and grayscale conversion are the identity on
    a one-channel image, so only brightness/contrast jitter is applied (with crop, flip and blur).
    Any other channel count raises ValueError.

    Randomness: torch's global RNG on the input's device, so `torch.manual_seed(s)` before the
    call makes the views reproducible (see the module docstring).
    """

    def __init__(
        self,
        mean: torch.Tensor | Sequence[float],
        std: torch.Tensor | Sequence[float],
        image_size: int,
        *,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        hflip_p: float = 0.5,
        jitter: tuple[float, float, float, float] = (0.8, 0.8, 0.8, 0.2),
        jitter_p: float = 0.8,
        gray_p: float = 0.2,
        blur_p: float = 0.5,
        blur_sigma: tuple[float, float] = (0.1, 2.0),
    ) -> None:
        self.mean = torch.as_tensor(mean, dtype=torch.float32).flatten()
        self.std = torch.as_tensor(std, dtype=torch.float32).flatten()
        self.channels = len(self.mean)
        if self.channels not in (1, 3):
            raise ValueError(f"TwoViewAugment supports 1 (grayscale) or 3 (RGB) channels, got {self.channels}")
        if len(self.std) != self.channels:
            raise ValueError(f"mean has {self.channels} values but std has {len(self.std)}")
        self.image_size = int(image_size)

        brightness, contrast, saturation, hue = jitter
        color: list[nn.Module]
        if self.channels == 3:
            color = [
                K.ColorJitter(brightness, contrast, saturation, hue, p=jitter_p, same_on_batch=False),
                K.RandomGrayscale(p=gray_p, same_on_batch=False),
            ]
        else:
            color = [K.ColorJitter(brightness, contrast, 0.0, 0.0, p=jitter_p, same_on_batch=False)]
        self.pipeline = nn.Sequential(
            K.RandomResizedCrop(
                (self.image_size, self.image_size), scale=crop_scale, ratio=CROP_RATIO, same_on_batch=False
            ),
            K.RandomHorizontalFlip(p=hflip_p, same_on_batch=False),
            *color,
            K.RandomGaussianBlur(
                blur_kernel_size(max(blur_sigma), self.image_size), blur_sigma, p=blur_p, same_on_batch=False
            ),
        )
        self._device = torch.device("cpu")

    def _to(self, device: torch.device) -> None:
        # Moving also moves kornia's samplers, so parameters are drawn where the batch lives.
        if device != self._device:
            self.pipeline.to(device)
            self.mean, self.std = self.mean.to(device), self.std.to(device)
            self._device = device

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.ndim != 4 or x.shape[1] != self.channels:
            raise ValueError(
                f"expected a batch (N, {self.channels}, H, W) matching mean/std, got shape {tuple(x.shape)}"
            )
        self._to(x.device)
        mean, std = self.mean.view(1, -1, 1, 1), self.std.view(1, -1, 1, 1)
        # Clamp: the colour ops (HSV for hue) assume [0, 1]; normalisation round-off can leave it slightly.
        images = (x.float() * std + mean).clamp_(0.0, 1.0)
        # One pass over both copies: per-sample parameters make the two halves independent views.
        views = self.pipeline(torch.cat([images, images])).clamp_(0.0, 1.0)
        views = ((views - mean) / std).to(x.dtype)
        view_a, view_b = views.chunk(2)
        return view_a, view_b
