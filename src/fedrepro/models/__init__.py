"""Model registry. Every model is a `SplitModel`: an `extractor` and a `head`.

Parameter names start with "extractor." or "head.", which is how methods name the
shared and personal parts (FedPer keeps "head." local, LG-FedAvg shares it, ...).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..registry import Param, Registry

MODELS: Registry = Registry("model")


class SplitModel(nn.Module):
    """`forward(x) = head(extractor(x))`; `features(x)` is the representation."""

    def __init__(self, extractor: nn.Module, head: nn.Module, feature_dim: int):
        super().__init__()
        self.extractor = extractor
        self.head = head
        self.feature_dim = feature_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.extractor(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extractor(x))


@MODELS.register(
    "fedavg_cnn",
    "PFLlib's FedAvgCNN: 2x[conv5x5 -> ReLU -> maxpool2] -> fc 512 -> ReLU | head: linear (McMahan et al. 2017)",
    params={"hidden": Param(512, "width of the fully connected feature layer", int, minimum=1)},
    inputs="images (C, H, W) with H, W >= 16, e.g. 28x28 and 32x32",
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
    params={"channels": Param(64, "channels of every conv layer", int, minimum=1)},
    inputs="images (C, H, W), e.g. 28x28 (64-d features) and 32x32 (256-d)",
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
    params={},
    inputs="images (C, 32, 32) (works for any size >= 8)",
)
def resnet18_cifar(sample_shape: Sequence[int], num_classes: int) -> SplitModel:
    from torchvision.models import resnet18

    net = resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(sample_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    head = net.fc
    net.fc = nn.Identity()
    return SplitModel(net, head, head.in_features)


@MODELS.register(
    "mlp",
    "multi-layer perceptron on flattened inputs | head: linear",
    params={"hidden": Param([200, 200], "hidden layer widths; [] gives multinomial logistic regression", list)},
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


def build_model(name: str, sample_shape: Sequence[int], num_classes: int, params: dict | None = None) -> SplitModel:
    from ..registry import resolve_params

    entry = MODELS.entry(name)
    kwargs = resolve_params(f"model '{name}'", entry.params, params)
    return entry.obj(tuple(sample_shape), num_classes, **kwargs)
