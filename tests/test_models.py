"""Every model has a clean extractor/head split for the input sizes it is meant for."""

from __future__ import annotations

import pytest
import torch

from fedrepro.models import MODELS, SplitModel, build_model
from fedrepro.registry import ConfigError

CASES = [
    ("fedavg_cnn", (1, 28, 28), 512),
    ("fedavg_cnn", (3, 32, 32), 512),
    ("cnn4", (1, 28, 28), 64),
    ("cnn4", (3, 32, 32), 256),
    ("resnet18_cifar", (3, 32, 32), 512),
    ("mlp", (1, 8, 8), 200),
    ("mlp", (60,), 200),
]


@pytest.mark.parametrize("name,shape,feature_dim", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s, _ in CASES])
def test_split_model_shapes_and_parameter_names(name, shape, feature_dim):
    torch.manual_seed(0)
    model = build_model(name, shape, 7)
    assert isinstance(model, SplitModel) and model.feature_dim == feature_dim
    model.eval()
    x = torch.randn(3, *shape)
    feats = model.features(x)
    assert feats.shape == (3, feature_dim)
    assert torch.equal(model(x), model.head(feats))
    assert model(x).shape == (3, 7)
    names = list(model.state_dict())
    assert names and all(n.startswith(("extractor.", "head.")) for n in names)
    assert any(n.startswith("head.") for n in names) and any(n.startswith("extractor.") for n in names)


def test_model_params_are_checked():
    assert build_model("mlp", (4,), 2, {"hidden": []}).feature_dim == 4  # logistic regression
    with pytest.raises(ConfigError, match="width"):
        build_model("fedavg_cnn", (1, 28, 28), 10, {"width": 3})
    with pytest.raises(ConfigError, match="allowed"):
        build_model("vgg", (1, 28, 28), 10)


def test_fedavg_cnn_matches_pfllib_size():
    # PFLlib's FedAvgCNN(in_features=1, num_classes=10, dim=1024) has 582,026 parameters.
    assert sum(p.numel() for p in build_model("fedavg_cnn", (1, 28, 28), 10).parameters()) == 582_026


def test_registry_lists_every_model():
    assert {"fedavg_cnn", "cnn4", "resnet18_cifar", "mlp"} <= set(MODELS.names())
