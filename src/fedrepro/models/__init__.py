"""Model registry. Every model is a `SplitModel`: an `extractor` and a `head`.

Parameter names start with "extractor." or "head.", which is how methods name the
shared and personal parts (FedPer keeps "head." local, LG-FedAvg shares it, ...).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..registry import Param
from .base import MAX_LAYERS, MAX_WIDTH, MODELS, SplitModel  # noqa: F401  (the registry apart from its entries)


@MODELS.register(
    "fedavg_cnn",
    "PFLlib's FedAvgCNN: 2x[conv5x5 -> ReLU -> maxpool2] -> fc 512 -> ReLU | head: linear (McMahan et al. 2017)",
    params={"hidden": Param(512, "width of the fully connected feature layer", int, minimum=1, maximum=MAX_WIDTH)},
    inputs="images (C, H, W) with H, W >= 16, e.g. 28x28 and 32x32",
    input_dims=(3,), min_side=16,
)
def fedavg_cnn(sample_shape: Sequence[int], num_classes: int, hidden: int = 512) -> SplitModel:
    c, h, w = sample_shape
    # Two unpadded 5x5 convs with 2x2 pooling: 28 -> 24 -> 12 -> 8 -> 4 (1024 = 64*4*4, as PFLlib's dim for MNIST).
    side = lambda s: ((s - 4) // 2 - 4) // 2
    flat = 64 * side(h) * side(w)
    extractor = nn.Sequential(
        nn.Conv2d(c, 32, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(inplace=True),
    )
    return SplitModel(extractor, nn.Linear(hidden, num_classes), hidden)


@MODELS.register(
    "cnn4",
    "FedBABU's 4-conv CNN: 4x[conv3x3(64) -> BN(no running stats) -> ReLU -> maxpool2] | head: linear (Oh et al. 2022)",
    params={"channels": Param(64, "channels of every conv layer", int, minimum=1, maximum=MAX_WIDTH)},
    inputs="images (C, H, W) with H, W >= 16, e.g. 28x28 (64-d features) and 32x32 (256-d)",
    input_dims=(3,), min_side=16,
)
def cnn4(sample_shape: Sequence[int], num_classes: int, channels: int = 64) -> SplitModel:
    c, h, w = sample_shape
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Conv2d(c if i == 0 else channels, channels, 3, padding=1),
                   nn.BatchNorm2d(channels, track_running_stats=False), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        h, w = h // 2, w // 2
    layers.append(nn.Flatten())
    dim = channels * h * w
    return SplitModel(nn.Sequential(*layers), nn.Linear(dim, num_classes), dim)


@MODELS.register(
    "resnet18_cifar",
    "torchvision ResNet-18 with the CIFAR stem (3x3 conv1, stride 1, no max-pool) | head: fc (He et al. 2016)",
    params={"conv1_padding": Param(1, "padding of the 3x3 stem; Calibre's encoder (Plato cnn_encoder.py) uses 2", int, minimum=0,
                                   maximum=3)},
    inputs="images (C, H, W), made for 32x32 (works for any size)",
    input_dims=(3,),
)
def resnet18_cifar(sample_shape: Sequence[int], num_classes: int, conv1_padding: int = 1) -> SplitModel:
    from torchvision.models import resnet18

    net = resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(sample_shape[0], 64, kernel_size=3, stride=1, padding=conv1_padding, bias=False)
    net.maxpool = nn.Identity()
    head = net.fc
    net.fc = nn.Identity()
    return SplitModel(net, head, head.in_features)


@MODELS.register(
    "mlp",
    "multi-layer perceptron on flattened inputs | head: linear",
    params={"hidden": Param([200, 200], "hidden layer widths; [] gives multinomial logistic regression", list,
                            items=Param(1, "a hidden layer width", int, minimum=1, maximum=MAX_WIDTH), max_items=MAX_LAYERS)},
    inputs="any shape (flattened), e.g. 8x8 digits or 60-d Synthetic features",
)
def mlp(sample_shape: Sequence[int], num_classes: int, hidden: list | None = None) -> SplitModel:
    hidden = [200, 200] if hidden is None else list(hidden)
    dim = math.prod(sample_shape)
    layers: list[nn.Module] = [nn.Flatten()]
    for width in hidden:
        layers += [nn.Linear(dim, width), nn.ReLU(inplace=True)]
        dim = width
    return SplitModel(nn.Sequential(*layers), nn.Linear(dim, num_classes), dim)


def fc_head(dim: int, num_classes: int, hidden: int | None = None) -> nn.Module:
    """The classifier: linear (hidden = None) or a 2-layer FC, dim -> hidden -> ReLU -> classes
    (GRP-FED's classifier C, "a 2-layer fully-connected (FC)", paper §4.1)."""
    if hidden is None:
        return nn.Linear(dim, num_classes)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, num_classes))


_HEAD_HIDDEN = Param(None, "hidden width of a 2-layer FC head (dim -> hidden -> ReLU -> classes, GRP-FED's classifier C); "
                           "null = a linear head", int, minimum=1, maximum=MAX_WIDTH)


class _BasicBlock1d(nn.Module):
    """conv(k) -> BN -> ReLU -> conv(k) -> BN, plus the shortcut (1x1 conv + BN where the shape changes), -> ReLU."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int):
        super().__init__()
        pad = kernel_size // 2
        self.conv1 = nn.Conv1d(cin, cout, kernel_size, stride=stride, padding=pad, bias=False)
        self.bn1 = nn.BatchNorm1d(cout)
        self.conv2 = nn.Conv1d(cout, cout, kernel_size, padding=pad, bias=False)
        self.bn2 = nn.BatchNorm1d(cout)
        self.shortcut = (nn.Sequential(nn.Conv1d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm1d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


@MODELS.register(
    "resnet1d",
    "5-layer 1-D ResNet for ECG beats (GRP-FED's MIT-BIH extractor): conv(k) -> BN -> ReLU, 2 basic blocks "
    "(width, 2*width; the second strided), global average pool | head: linear or 2-layer FC",
    params={
        "width": Param(64, "[RECON] reconstructed: channels of the stem and first block (the second has 2x); the paper "
                           "says only '5-layer 1D ResNet' (methods.md §3.1)", int, minimum=1,
                     maximum=MAX_WIDTH),
        "kernel_size": Param(7, "[RECON] reconstructed: odd kernel size of every conv (not given in the paper)", int, minimum=1,
                             maximum=1024),
        "head_hidden": _HEAD_HIDDEN,
    },
    inputs="1-D signals (C, L) or (L,), e.g. R-peak-centred ECG beat windows (1, 256)",
    input_dims=(1, 2),
)
def resnet1d(sample_shape: Sequence[int], num_classes: int, width: int = 64, kernel_size: int = 7,
             head_hidden: int | None = None) -> SplitModel:
    shape = tuple(sample_shape)
    layers: list[nn.Module] = [nn.Unflatten(1, (1, shape[0]))] if len(shape) == 1 else []
    cin = 1 if len(shape) == 1 else shape[0]
    layers += [
        nn.Conv1d(cin, width, kernel_size, padding=kernel_size // 2, bias=False), nn.BatchNorm1d(width), nn.ReLU(inplace=True),
        _BasicBlock1d(width, width, kernel_size, 1),
        _BasicBlock1d(width, 2 * width, kernel_size, 2),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(),
    ]
    return SplitModel(nn.Sequential(*layers), fc_head(2 * width, num_classes, head_hidden), 2 * width)


class _CifarBlock(nn.Module):
    """He et al.'s CIFAR basic block with the parameter-free option-A shortcut: subsample by the
    stride and zero-pad the new channels."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.pad = stride, cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x[:, :, :: self.stride, :: self.stride] if self.stride != 1 else x
        if self.pad:
            short = nn.functional.pad(short, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return torch.relu(out + short)


@MODELS.register(
    "resnet32_cifar",
    "CIFAR ResNet-32 (He et al. 2016, 6n+2 with n = 5): conv3x3(16) -> BN -> ReLU, 3 stages of 5 basic blocks "
    "(16, 32, 64 channels; option-A shortcuts), global average pool | head: linear or 2-layer FC "
    "(GRP-FED's 'ResNet-30', methods.md §3.1)",
    params={"head_hidden": _HEAD_HIDDEN},
    inputs="images (C, H, W), e.g. 3x32x32 (64-d features)",
    input_dims=(3,),
)
def resnet32_cifar(sample_shape: Sequence[int], num_classes: int, head_hidden: int | None = None) -> SplitModel:
    n = 5
    layers: list[nn.Module] = [nn.Conv2d(sample_shape[0], 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
    cin = 16
    for stage, cout in enumerate((16, 32, 64)):
        for i in range(n):
            layers.append(_CifarBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return SplitModel(nn.Sequential(*layers), fc_head(64, num_classes, head_hidden), 64)


def input_problem(name: str, sample_shape: Sequence[int], params: dict | None = None) -> str | None:
    """Why model `name` cannot take samples of `sample_shape` (its registry entry's `input_dims`, the
    sample dimensions it accepts, and `min_side`, the smallest spatial side its layers leave a
    pixel of; with resolved `params`, also its `input_check(sample_shape, params)`); None where it
    can. Decided without training the model (tests/test_config.py checks it against a forward pass)."""
    info = MODELS.entry(name).info
    shape = tuple(sample_shape)
    dims = info.get("input_dims")
    if dims is not None and len(shape) not in dims:
        return f"model '{name}' takes {info['inputs']}, not samples of shape {shape}"
    side = info.get("min_side", 1)
    if len(shape) == 3 and min(shape[1:]) < side:
        return f"model '{name}' takes {info['inputs']}: its layers need sides >= {side}, not samples of shape {shape}"
    check = info.get("input_check")
    return check(shape, params) if check and params is not None else None


def build_model(name: str, sample_shape: Sequence[int], num_classes: int, params: dict | None = None) -> SplitModel:
    from ..registry import resolve_params

    entry = MODELS.entry(name)
    kwargs = resolve_params(f"model '{name}'", entry.params, params)
    return entry.obj(tuple(sample_shape), num_classes, **kwargs)


# More models, registered on import.
from . import prompted_vit as _prompted_vit  # noqa: E402,F401
