"""FedGCR (methods/fedgcr.py, methods/_fedgr.py), its prompted ViT (models/prompted_vit.py) and the
metrics for distinct client types, on a tiny 3-domain image set and a 1-block ViT with random weights."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from conftest import method_engine
from fedrepro.data.base import RawDataset
from fedrepro.data.shards import load_partition, write_partition
from fedrepro.engine.data import load_clients
from fedrepro.metrics import type_summary
from fedrepro.methods import payload_bytes
from fedrepro.methods._fedgr import beta_at, class_balanced_mean, cluster_clients, cluster_purity, fedgr_weights
from fedrepro.methods.fedgcr import group_contrastive_loss
from fedrepro.models import build_model

TINY_VIT = {"backbone": "vit_tiny_patch16_224", "weights": "none", "resize": False, "feature_dropout": 0.0,
            "backbone_args": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}}


def domain_images(n_per_domain: int = 90, seed: int = 0) -> RawDataset:
    """3 domains of 3x8x8 uint8 images, each with its own colour cast (domain d brightens channel d)."""
    g = np.random.default_rng(seed)
    n = 3 * n_per_domain
    domain = np.repeat(np.arange(3), n_per_domain)
    y = g.integers(0, 4, n)
    x = g.integers(0, 100, (n, 3, 8, 8)).astype(np.uint8)
    x[np.arange(n), domain] += 150
    x[np.arange(n), :, y, :] = 255  # the label's row lights up: learnable
    return RawDataset(name="domain_images", x=x, y=y, num_classes=4, official_split=np.zeros(n, np.int8),
                      mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), source="generated in the test", groups={"domain": domain})


@pytest.fixture(scope="module")
def domain_partition(tmp_path_factory):
    spec = {"dataset": "domain_images", "partitioner": "domain", "num_clients": 4, "seed": 0,
            "params": {"dif": 2.0}, "split": {"test_fraction": 0.3}}
    out = tmp_path_factory.mktemp("gcr") / "part"
    write_partition(domain_images(), spec, out)
    return out


def gcr_engine(domain_partition, make_cell, method="fedgcr", hparams=None, model=None, rounds=2, seed=0):
    from fedrepro.engine.engine import Engine
    from fedrepro.methods import METHODS

    cell = copy.deepcopy(make_cell("fedavg", seed=seed))
    cell["training"].update(rounds=rounds, participation=1.0, batch_size=32, eval_every=1,
                            optimizer={**cell["training"]["optimizer"], "name": "adamw", "lr": 1e-2, "weight_decay": 0.0})
    cell["model"] = {"name": "prompted_vit", "params": {**TINY_VIT, **(model or {})}}
    defaults = {k: p.default for k, p in METHODS.get(method).hparams.items()}
    cell.update(method=method, label=method, hparams={**defaults, **(hparams or {})})
    manifest, shards = load_partition(domain_partition)
    return Engine(cell, manifest, load_clients(manifest, shards, torch.device("cpu")), torch.device("cpu"), progress=False)
