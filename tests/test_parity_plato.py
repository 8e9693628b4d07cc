"""benchmarks/parity_plato.py without Plato: fedrepro's clients exported to Plato's
FashionMNIST files read back as Plato's data source reads them equal fedrepro's client tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrepro.data.shards import load_partition
from fedrepro.engine.data import load_clients

from conftest import load_script

parity = load_script("benchmarks/parity_plato.py")


def plato_fashion_mnist_client(data_path: Path, plato_client_id: int, train: bool):
    """Plato's plato/datasources/fashion_mnist.py DataSource, transcribed: torchvision's
    FashionMNIST(root=data_path, train, transform=Compose([ToTensor(), Normalize(mean, std)])), its
    Normalize given fedrepro's mean/std instead of (0.1307, 0.3081); a client's sampler yields its
    rows of clients.json (Plato numbers clients from 1)."""
    from torchvision import datasets, transforms

    meta = json.loads((data_path / "clients.json").read_text())
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(tuple(meta["mean"]), tuple(meta["std"]))])
    ds = datasets.FashionMNIST(root=str(data_path), train=train, download=False, transform=tf)
    start, stop = meta["clients"][str(plato_client_id - 1)]["train" if train else "test"]
    loader = torch.utils.data.DataLoader(ds, batch_size=stop - start, sampler=list(range(start, stop)))
    return next(iter(loader))


def test_export_is_fedrepros_client_tensors_read_the_plato_way(tiny_partition, tmp_path):
    manifest, shards = load_partition(tiny_partition[0])
    meta = parity.export_plato(manifest, shards, tmp_path / "data")
    assert meta["partition_id"] == manifest["partition_id"]
    order, novel = meta["plato_order"], meta["novel"]  # Plato client k = fedrepro client order[k-1]
    assert sorted(order) == sorted(s.id for s in shards) and order[len(order) - len(novel):] == novel
    clients = load_clients(manifest, shards, torch.device("cpu"))  # what fedrepro's engine trains and tests on
    assert len(clients) == len(meta["clients"]) > 1
    for c in clients:
        for split, train in (("train", True), ("test", False)):
            ref = getattr(c, split)
            assert len(ref) > 0
            x, y = plato_fashion_mnist_client(tmp_path / "data", c.id + 1, train)
            assert torch.equal(x, ref.x), f"client {c.id} {split} x differs"
            assert torch.equal(y, ref.y), f"client {c.id} {split} y differs"
    x, y = parity.read_plato_client(tmp_path / "data", clients[-1].id, "test")  # the harness's own reader agrees
    assert torch.equal(x, clients[-1].test.x) and torch.equal(y, clients[-1].test.y)


def test_export_refuses_what_plato_fashion_mnist_cannot_hold(tiny_partition, tmp_path):
    manifest, shards = load_partition(tiny_partition[0])
    shards[1].x["train"] = shards[1].x["train"].astype(np.float32)
    with pytest.raises(ValueError, match=r"one-channel uint8 images .* client 1 train holds float32"):
        parity.export_plato(manifest, shards, tmp_path / "data")
    assert not (tmp_path / "data").exists()  # nothing half-written
