"""The models GRP-FED uses: the 1-D ResNet for ECG beats, the CIFAR ResNet-32 and the
2-layer FC head option; each is a SplitModel with extractor./head. parameter names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedrepro.models import MODELS, SplitModel, build_model
from fedrepro.registry import ConfigError


@pytest.mark.parametrize("name,shape,params,feature_dim", [
    ("resnet1d", (1, 187), {}, 128),
    ("resnet1d", (180,), {"width": 8}, 16),
    ("resnet1d", (2, 64), {"width": 4, "kernel_size": 5, "head_hidden": 6}, 8),
    ("resnet32_cifar", (3, 32, 32), {}, 64),
    ("resnet32_cifar", (1, 8, 8), {"head_hidden": 16}, 64),
])
def test_split_shapes(name, shape, params, feature_dim):
    torch.manual_seed(0)
    model = build_model(name, shape, 5, params)
    assert isinstance(model, SplitModel) and model.feature_dim == feature_dim
    model.eval()
    x = torch.randn(3, *shape)
    feats = model.features(x)
    assert feats.shape == (3, feature_dim)
    assert torch.equal(model(x), model.head(feats)) and model(x).shape == (3, 5)
    names = list(model.state_dict())
    assert all(n.startswith(("extractor.", "head.")) for n in names)
    assert any(n.endswith("running_mean") for n in names)  # BatchNorm statistics live in the extractor


def test_resnet32_is_6n_plus_2_with_option_a_shortcuts():
    model = build_model("resnet32_cifar", (3, 32, 32), 10)
    convs = [m for m in model.extractor.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 31 and all(c.kernel_size == (3, 3) for c in convs)  # 1 + 3 stages * 5 blocks * 2, + fc = 32
    # He et al.'s ResNet-32 for CIFAR-10 has 0.46M parameters (parameter-free option-A shortcuts)
    assert sum(p.numel() for p in model.parameters()) == 464_154


def test_resnet1d_has_five_conv_layers():
    model = build_model("resnet1d", (1, 256), 12)
    convs = [m for m in model.extractor.modules() if isinstance(m, nn.Conv1d) and m.kernel_size != (1,)]
    assert len(convs) == 5  # stem + 2 basic blocks x 2 (the 1x1 projection shortcut not counted)


def test_head_hidden_gives_a_two_layer_fc_head():
    linear = build_model("resnet32_cifar", (3, 32, 32), 10)
    assert isinstance(linear.head, nn.Linear)
    fc2 = build_model("resnet32_cifar", (3, 32, 32), 10, {"head_hidden": 32})
    layers = [m for m in fc2.head.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in layers] == [(64, 32), (32, 10)]
    assert any(isinstance(m, nn.ReLU) for m in fc2.head.modules())
    with pytest.raises(ConfigError, match="head_hidden"):
        build_model("resnet1d", (1, 100), 3, {"head_hidden": 0})


def test_registry_lists_the_new_models():
    assert {"resnet1d", "resnet32_cifar"} <= set(MODELS.names())
