"""Two-view SimCLR augmentation throughput: batched `TwoViewAugment` (kornia) vs lightly's per-image PIL path.

Both paths make two views of each of --n random images (--channels x --size x --size) with the
recipe of methods.md §2.4, and the script prints views per second of each, in one run on one machine:

  (a) `fedrepro.ssl.augment.TwoViewAugment` on normalised float batches of --batch images, on
      the CPU, and on CUDA when available (the data already on the GPU, as a client's data is);
  (b) lightly's `SimCLRTransform(input_size=size, ...)` applied to one PIL image at a time by a
      torch DataLoader (--batch, --workers), which collates the two views of each image;
  (c) the ratio (a) / (b).

    .venv/bin/python benchmarks/ssl_augment.py                       # 2048 CIFAR-sized RGB images
    nice -n 10 .venv/bin/python benchmarks/ssl_augment.py --n 1024   # the figure quoted in augment.py
    .venv/bin/python benchmarks/ssl_augment.py --channels 1 --size 28 --workers 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from fedrepro.ssl.augment import TwoViewAugment

# CIFAR statistics (methods.md §2.4); a one-channel run uses their first value.
MEAN = [0.491, 0.482, 0.447]
STD = [0.247, 0.243, 0.262]


class PILTwoViews(Dataset):
    """PIL images, each returned as lightly's two augmented views."""

    def __init__(self, images: np.ndarray, transform) -> None:
        mode = "L" if images.shape[-1] == 1 else "RGB"
        self.images = [Image.fromarray(image.squeeze(-1) if mode == "L" else image, mode) for image in images]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return tuple(self.transform(self.images[i]))


def kornia_views_per_second(x: torch.Tensor, augment: TwoViewAugment, batch: int) -> float:
    def one_pass() -> None:
        for start in range(0, len(x), batch):
            augment(x[start : start + batch])

    augment(x[:batch])  # warm-up: moves the pipeline to the device, CUDA kernels load
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    one_pass()
    if x.is_cuda:
        torch.cuda.synchronize()
    return 2 * len(x) / (time.perf_counter() - start)


def pil_views_per_second(images: np.ndarray, mean: list[float], std: list[float], args) -> float:
    from lightly.transforms import SimCLRTransform  # imported here: it takes seconds

    transform = SimCLRTransform(input_size=args.size, normalize={"mean": mean, "std": std})
    loader = DataLoader(PILTwoViews(images, transform), batch_size=args.batch, num_workers=args.workers)
    start = time.perf_counter()
    for view_a, view_b in loader:
        pass
    return 2 * len(images) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="images (each gives two views)")
    parser.add_argument("--size", type=int, default=32, help="image side")
    parser.add_argument("--channels", type=int, default=3, choices=(1, 3))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers of the PIL path")
    args = parser.parse_args()

    mean, std = MEAN[: args.channels], STD[: args.channels]
    images = np.random.default_rng(0).integers(0, 256, (args.n, args.size, args.size, args.channels), dtype=np.uint8)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255)
    x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    torch.manual_seed(0)

    shape = f"{args.channels}x{args.size}x{args.size}"
    print(f"{args.n} images {shape}, batch {args.batch}, torch threads {torch.get_num_threads()}")
    rates = {"TwoViewAugment, cpu": kornia_views_per_second(x, TwoViewAugment(mean, std, args.size), args.batch)}
    if torch.cuda.is_available():
        name = f"TwoViewAugment, cuda ({torch.cuda.get_device_name()})"
        rates[name] = kornia_views_per_second(x.cuda(), TwoViewAugment(mean, std, args.size), args.batch)
    pil = pil_views_per_second(images, mean, std, args)
    for name, rate in rates.items():
        print(f"{name:<48} {rate:>10.0f} views/s")
    print(f"{f'lightly SimCLRTransform, PIL, {args.workers} workers':<48} {pil:>10.0f} views/s")
    for name, rate in rates.items():
        print(f"ratio {name} / PIL: {rate / pil:.1f}x")


if __name__ == "__main__":
    main()
