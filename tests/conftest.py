"""Shared fixtures: a tiny digits partition on disk and cell factories."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrepro.config import resolve_experiment
from fedrepro.data.base import RawDataset
from fedrepro.data.datasets import load_dataset
from fedrepro.data.shards import write_partition

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are collected everywhere (CI too) and skipped where no CUDA GPU is
    visible; benchmarks/gpu_check.sh runs them on one (docs/gpu.md)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by benchmarks/gpu_check.sh, docs/gpu.md)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)

# Tiny models on 2 shared cores: one thread avoids oversubscription (much faster here).
torch.set_num_threads(1)


def random_images(n: int = 600, num_classes: int = 10, seed: int = 0, test_share: float = 0.2) -> RawDataset:
    """uint8 images (N, 1, 4, 4) with random labels; about `test_share` of the rows in the official test set."""
    g = np.random.default_rng(seed)
    return RawDataset(
        name="random_images",
        x=g.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8),
        y=g.integers(0, num_classes, n),
        num_classes=num_classes,
        official_split=(g.random(n) < test_share).astype(np.int8),
        mean=(0.5,),
        std=(0.25,),
        source="generated in the test",
    )


def tiny_config(**training) -> dict:
    return {
        "experiment": "unit",
        "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": [32]}}}},
        "partitions": {"dir": {"partitioner": "dirichlet", "num_clients": 4, "seed": 0,
                               "params": {"alpha": 0.5, "min_partition_size": 30},
                               "split": {"test_fraction": 0.25, "val_fraction": 0.1}}},
        "methods": {"local": {}, "fedavg": {}, "fedavg_ft": {"hparams": {"ft_epochs": 1}}},
        "seeds": [0],
        "training": {"rounds": 2, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.05}, **training},
    }


@pytest.fixture(scope="session")
def tiny_partition(tmp_path_factory) -> tuple[Path, dict]:
    """The digits partition of `tiny_config`, written once per test session."""
    exp = resolve_experiment(tiny_config())
    part = exp["partitions"][0]
    out = tmp_path_factory.mktemp("shards") / part["id"]
    write_partition(load_dataset("digits", tmp_path_factory.mktemp("raw")), part["spec"], out)
    return out, exp


@pytest.fixture
def make_cell(tiny_partition):
    """make_cell(label, **training_overrides) -> a resolved cell on the tiny partition."""
    _, base = tiny_partition

    def make(label: str = "fedavg", seed: int = 0, **training) -> dict:
        exp = resolve_experiment(tiny_config(**training)) if training else base
        cell = next(c for c in exp["cells"] if c["label"] == label)
        cell = copy.deepcopy(cell)
        cell["seed"] = seed
        return cell

    return make


#: A method that needs a particular model (`Method.models`: a model capability it uses) runs the
#: every-method tests on a tiny one of that model; a method's defaults that the tiny digits
#: partition cannot satisfy (FedGCR's T' = number of client types: it has none) are set here.
TINY_MODELS = {
    "mlp": {"name": "mlp", "params": {"hidden": []}},  # local_linear: a linear classifier on the raw inputs
    "prompted_vit": {"name": "prompted_vit", "params": {
        "backbone": "vit_tiny_patch16_224", "weights": "none", "resize": False,
        "backbone_args": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}}},
}
TINY_HPARAMS = {"fedgcr": {"num_groups": 2}, "pfl_swav": {"swav_prototypes": 16}, "pfl_smog": {"smog_groups": 8, "queue_size": 64},
                "pfl_mocov2": {"queue_size": 64}}


def fit_cell_to_method(cell: dict, name: str) -> dict:
    """`cell` (on the tiny partition) with the model and hyper-parameters method `name` needs there."""
    from fedrepro.methods import METHODS

    needs = METHODS.get(name).models
    if needs:
        cell["model"] = copy.deepcopy(TINY_MODELS[needs[0]])
    cell["hparams"] = {**cell["hparams"], **TINY_HPARAMS.get(name, {})}
    return cell


def method_engine(tiny_partition, make_cell, name: str, hparams: dict | None = None, *, device: str = "cpu", **training):
    """An Engine on the tiny partition (its tensors on `device`) running method `name` with its
    defaults overlaid by `hparams` (the method tests' common setup)."""
    from fedrepro.engine.data import load_clients
    from fedrepro.engine.engine import Engine
    from fedrepro.data.shards import load_partition
    from fedrepro.methods import METHODS

    cell = make_cell("fedavg", **training)
    defaults = {k: p.default for k, p in METHODS.get(name).hparams.items()}
    cell.update(method=name, label=name, hparams={**defaults, **(hparams or {})})
    if METHODS.get(name).models:  # the tiny model of the capability the method needs
        cell["model"] = copy.deepcopy(TINY_MODELS[METHODS.get(name).models[0]])
    manifest, shards = load_partition(tiny_partition[0])
    dev = torch.device(device)
    return Engine(cell, manifest, load_clients(manifest, shards, dev), dev, progress=False)


def kill_in_round_3_and_resume(monkeypatch, method: str, train, ckpt: Path, out_dir: Path | None = None) -> dict:
    """`train()` (a checkpointed run into `out_dir`) killed in round 3's aggregation, then rerun:
    the resumed metrics. Between the two, the checkpoint exists and no metrics were written."""
    from fedrepro.methods import METHODS

    cls = METHODS.get(method)
    original = cls.aggregate

    def crash_in_round_3(self, updates):
        if self.engine.round == 3:
            raise KeyboardInterrupt("simulated kill")
        return original(self, updates)

    monkeypatch.setattr(cls, "aggregate", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        train()
    assert ckpt.exists() and not (out_dir and (out_dir / "metrics.json").exists())
    monkeypatch.setattr(cls, "aggregate", original)
    resumed = train()
    assert resumed["resources"]["resumed_from_round"] == 2
    return resumed


def load_script(relative: str):
    """A script of the repository (e.g. "benchmarks/parity_pfllib.py") imported as a module of its
    file's name, registered in sys.modules (dataclasses and pickling look it up there)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
