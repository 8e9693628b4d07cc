"""TwoViewAugment: shape/dtype kept, randomness per sample and per seed, the normalisation round trip."""

from __future__ import annotations

import pytest
import torch

from fedrepro.ssl.augment import TwoViewAugment, blur_kernel_size

MEAN = torch.tensor([0.491, 0.482, 0.447])
STD = torch.tensor([0.247, 0.243, 0.262])
SIDE = 16
NO_AUGMENTATION = dict(crop_scale=(1.0, 1.0), hflip_p=0.0, jitter_p=0.0, gray_p=0.0, blur_p=0.0)


def normalised_batch(n: int = 8, mean: torch.Tensor = MEAN, std: torch.Tensor = STD, seed: int = 0) -> torch.Tensor:
    images = torch.rand(n, len(mean), SIDE, SIDE, generator=torch.Generator().manual_seed(seed))
    return (images - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def unnormalise(x: torch.Tensor, mean: torch.Tensor = MEAN, std: torch.Tensor = STD) -> torch.Tensor:
    return x * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_views_keep_shape_dtype_and_device(dtype):
    x = normalised_batch().to(dtype)
    view_a, view_b = TwoViewAugment(MEAN, STD, SIDE)(x)
    for view in (view_a, view_b):
        assert view.shape == x.shape and view.dtype == dtype and view.device == x.device


def test_views_differ_between_views_and_between_identical_samples():
    x = normalised_batch(2)
    x[1] = x[0]  # same image twice: only the per-sample random parameters can tell them apart
    torch.manual_seed(0)
    view_a, view_b = TwoViewAugment(MEAN, STD, SIDE)(x)
    assert not torch.allclose(view_a, view_b)
    assert not torch.allclose(view_a[0], view_a[1])
    assert not torch.allclose(view_b[0], view_b[1])


def test_same_seed_same_views_other_seed_other_views():
    x, augment = normalised_batch(), TwoViewAugment(MEAN, STD, SIDE)

    def views(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return torch.stack(augment(x))

    first = views(1)
    assert torch.equal(first, views(1))
    assert not torch.allclose(first, views(2))


@pytest.mark.parametrize("mean, std", [([0.5], [0.25]), (MEAN, STD)], ids=["gray", "rgb"])
def test_one_and_three_channels_work(mean, std):
    mean, std = torch.as_tensor(mean), torch.as_tensor(std)
    x = normalised_batch(mean=mean, std=std)
    torch.manual_seed(0)
    view_a, view_b = TwoViewAugment(mean, std, SIDE)(x)
    assert view_a.shape == view_b.shape == x.shape
    assert torch.isfinite(view_a).all() and torch.isfinite(view_b).all()


def test_other_channel_counts_raise():
    with pytest.raises(ValueError, match="1 .*or 3 .*channels, got 2"):
        TwoViewAugment([0.5, 0.5], [0.25, 0.25], SIDE)
    with pytest.raises(ValueError, match="shape"):
        TwoViewAugment(MEAN, STD, SIDE)(normalised_batch(mean=MEAN[:1], std=STD[:1]))


def test_no_augmentation_is_the_identity():
    # Every probability 0 and a full-image crop: what is left is un-normalise -> clamp -> re-normalise.
    x = normalised_batch()
    view_a, view_b = TwoViewAugment(MEAN, STD, SIDE, **NO_AUGMENTATION)(x)
    torch.testing.assert_close(view_a, x, rtol=0, atol=1e-5)
    torch.testing.assert_close(view_b, x, rtol=0, atol=1e-5)


def test_unnormalised_views_stay_in_unit_range():
    torch.manual_seed(0)
    for view in TwoViewAugment(MEAN, STD, SIDE)(normalised_batch(32)):
        pixels = unnormalise(view)
        assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5


def test_blur_kernel_is_odd_and_fits_the_image():
    assert blur_kernel_size(2.0, 32) == 13  # 6 * 2 + 1
    assert blur_kernel_size(2.0, 8) == 7  # capped at the largest odd side
    assert blur_kernel_size(0.5, 32) == 5
