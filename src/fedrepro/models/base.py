"""What every model is, apart from the models: `SplitModel`, the registry `MODELS` and the size limits.

The model modules (this package's `__init__` and `prompted_vit`) import this one and register
their builders in `MODELS`; this one imports none of them, so there is no import circle.
"""

from __future__ import annotations

import torch
from torch import nn

from ..registry import Registry

MODELS: Registry = Registry("model", plugin_group="fedrepro.models")

#: Largest layer width / channel count a config may ask for (a 65,536-wide layer is already
#: far beyond every model of the benchmark; larger ones only exhaust memory).
MAX_WIDTH = 65_536
#: Most hidden layers an `mlp` may have.
MAX_LAYERS = 64


class SplitModel(nn.Module):
    """`forward(x) = head(extractor(x))`; `features(x)` is the representation.

    `frozen_prefixes` name a part that never trains nor travels (a frozen pretrained backbone):
    `Engine.get_params` leaves it out, so no method sends or averages it."""

    def __init__(self, extractor: nn.Module, head: nn.Module, feature_dim: int, frozen_prefixes: tuple[str, ...] = ()):
        super().__init__()
        self.extractor = extractor
        self.head = head
        self.feature_dim = feature_dim
        self.frozen_prefixes = tuple(frozen_prefixes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.extractor(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extractor(x))
