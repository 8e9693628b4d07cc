"""Parity of fedrepro's federated SSL family (Calibre, FedEMA, pFL-SimCLR/BYOL/SwAV) with Plato
(TL-System/plato, examples/ssl), run unchanged, on identical client tensors, weights and views.

    .venv/bin/python benchmarks/parity_plato.py --plato /work/ref/plato --plato-python /work/ref/plato-venv/bin/python \\
        --shards results/shards/fmnist/<partition id> --work /work/ref/plato-work --seeds 0 1 2
    .venv/bin/python benchmarks/parity_plato.py ... --rows calibre fedema        # some rows only
    .venv/bin/python benchmarks/parity_plato.py --export-only --shards ... --work ...   # the data export only
    .venv/bin/python benchmarks/parity_plato.py ... --seeds 0 --e2e pfl_simclr fedema calibre --rounds 3 \
        --fedrepro-runs results/<experiment>/runs/fmnist                       # whole Plato runs

What is compared. (1) Every piece of the reference code that defines a method's numbers,
imported from an unchanged copy of `examples/ssl` (and Plato's own `plato/` package), on the
same inputs as fedrepro's piece (the default); (2) with --e2e, whole runs of the example's main()
(Plato's socket.io server, client processes, trainer loop and personalization round) on the
export, beside fedrepro's cells of the same protocol, compared on the clients Plato personalizes
(shims 6-8 at "Whole runs" below). The pieces:
  - the model: Plato's example model class (CalibreNet, SimCLRModel, BYOLModel, SwaV) built as
    Plato builds it (its encoder from `plato.models.cnn_encoder.Model.get`), and fedrepro's
    SplitModel + objective modules; fedrepro's weights are loaded FROM Plato's model by name
    (the name maps below), every tensor covered and of the same shape (architecture parity);
  - the local step: one batch of a client's exported train split (read back the way Plato's
    FashionMNIST data source reads it), two views made once, the example trainer's loss (its
    `get_ssl_criterion`; Calibre's CalibreLoss with its KMeans pseudo-labels) beside fedrepro's
    objective + regularizer, then the gradient of every parameter;
  - the client/server rules: Calibre's divergence rate (calibre_trainer.compute_divergence_rate)
    and divergence-weighted aggregation (calibre_server.aggregate_deltas), FedEMA's
    divergence-aware EMA (fedema_processor.GlobalLocalDivergenceProcessor) and its lambda
    (fedema_server.weights_aggregated's formula), BYOL's momentum schedule (byol_trainer).
Each is a row: the largest absolute difference and a verdict, "=" at float32 round-off
(<= 1e-5 relative), "≠" otherwise with the cause named (docs/parity.md, Plato section), for
fedrepro's default and, where the method has one, its [PAPER≠CODE] code_compat options.

Offline shims (the only changes to how Plato runs; its files are never edited):
  1. `plato.models.cnn_encoder.Model.get` returns fedrepro's encoder (the `--model` extractor,
     calibre_cpu's fedavg_cnn by default) with Plato's `encoding_dim` attribute, instead of a
     ResNet-18 (the models' `encoder_registry.get(model_name=...)` line is the injection point).
  2. The Plato config is the example's config with the CPU-scale values fedrepro's calibre_cpu
     uses (projection widths, temperatures and weights as in the example), written to the work
     dir; Plato's `Config` reads it from the `config_file` environment variable.
  3. Calibre's KMeans (clustering.kmeans_clustering: sklearn, unseeded, numpy's global RNG) is run
     after `np.random.seed(s)`, which draws exactly what fedrepro's `kmeans(z, k, seed=s)`
     (sklearn random_state=s) draws: the same pseudo-labels on both sides.
  4. lightly 1.6 (fedrepro's, used by both sides) no longer has `SymNegCosineSimilarityLoss`, which
     Plato's loss registry (plato/trainers/loss_criterion.py) names when it builds its table; the
     name is set to lightly's NegativeCosineSimilarity so the table builds (no row uses it).
  5. Calibre's l_n (prototype_loss.get_prototype_loss) passes the KMeans labels as int32
     (clustering.py `.int()`) to F.cross_entropy, which torch 2.12 refuses ("expected target dtype
     to be Long or Byte, but got Int"): calibre_loss's reference to get_prototype_loss is wrapped to
     pass the same labels as int64 (values unchanged).

Data export: fedrepro's clients become Plato's FashionMNIST on-disk data set (torchvision's idx
files `<work>/data/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`): the exported
train set is the clients' train splits one after another, the test set their test splits, and
`clients.json` gives each client's [start, stop) rows (what a Plato sampler hands a client; Plato
numbers clients from 1, client k is fedrepro's k-1) and fedrepro's mean/std, the normalisation
Plato's `transforms.Normalize` applies instead of its hard-coded (0.1307, 0.3081).
tests/test_parity_plato.py reads the export back as Plato does (torchvision's FashionMNIST with
ToTensor + Normalize) and checks it equals fedrepro's client tensors, every client and split.

Results are cached per (row, seed, source hash) under --work; outputs parity_plato.md/.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------
# Rows. `example`: the examples/ssl folder; `model`: module.class of the example's model;
# `trainer`: module.class whose get_ssl_criterion gives the loss (None: Plato's SSL trainer);
# `loss`: Plato's trainer.loss_criterion; `objective` and `hparams`: fedrepro's method;
# `weights`: Calibre's losses_weight.prototype_regularizers (l_p, l_n).
# --------------------------------------------------------------------------------------------
ROWS: dict[str, dict[str, Any]] = {
    "calibre": {"example": "calibre", "model": "calibre_model.CalibreNet", "trainer": "calibre_trainer.Trainer",
                "loss": "NTXentLoss", "method": "calibre", "objective": "simclr", "weights": [0.3, 0.3],
                "hparams": {"use_lp": True, "use_ln": True}},
    "calibre_lp": {"example": "calibre", "model": "calibre_model.CalibreNet", "trainer": "calibre_trainer.Trainer",
                   "loss": "NTXentLoss", "method": "calibre", "objective": "simclr", "weights": [0.3, 0.0],
                   "hparams": {"use_lp": True, "use_ln": False}},
    "calibre_ln": {"example": "calibre", "model": "calibre_model.CalibreNet", "trainer": "calibre_trainer.Trainer",
                   "loss": "NTXentLoss", "method": "calibre", "objective": "simclr", "weights": [0.0, 0.3],
                   "hparams": {"use_lp": False, "use_ln": True}},
    "calibre_none": {"example": "calibre", "model": "calibre_model.CalibreNet", "trainer": "calibre_trainer.Trainer",
                     "loss": "NTXentLoss", "method": "calibre", "objective": "simclr", "weights": [0.0, 0.0],
                     "hparams": {"use_lp": False, "use_ln": False}},
    "pfl_simclr": {"example": "simclr", "model": "simclr_model.SimCLRModel", "trainer": None, "loss": "NTXentLoss",
                   "method": "pfl_simclr", "objective": "simclr", "hparams": {}},
    "pfl_byol": {"example": "byol", "model": "byol_model.BYOLModel", "trainer": "byol_trainer.Trainer",
                 "loss": "NegativeCosineSimilarity", "method": "pfl_byol", "objective": "byol", "hparams": {}},
    "fedema": {"example": "fedema", "model": "fedema_model.BYOLModel", "trainer": "fedema_trainer.Trainer",
               "loss": "NegativeCosineSimilarity", "method": "fedema", "objective": "byol", "hparams": {}},
    "pfl_swav": {"example": "swav", "model": "swav_model.SwaV", "trainer": None, "loss": "SwaVLoss",
                 "method": "pfl_swav", "objective": "swav", "hparams": {}},
}

# Plato's parameter names -> fedrepro's (ssl/objectives.py modules; SplitModel's `extractor`).
NAME_MAP = (("momentum_encoder.", "target_extractor."), ("momentum_projector.", "target_projector."),
            ("encoder.", "extractor."))

# calibre_cpu's values (config/papers/calibre_cpu.yaml), used on both sides.
PROTOCOL = {"dataset": "FashionMNIST", "model": "fedavg_cnn", "model_params": {"hidden": 128}, "proj_hidden": 256,
            "proj_dim": 64, "temperature": 0.2, "n_clusters": 10, "batch_size": 64, "swav_prototypes": 3000,
            "rounds": 20, "epochs": 1}
TOL = 1e-5


# --------------------------------------------------------------------------------------------
# Data: fedrepro's partition, exported to Plato's (torchvision's) FashionMNIST files
# --------------------------------------------------------------------------------------------

IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def write_idx(path: Path, array: np.ndarray) -> None:
    """torchvision's MNIST idx format: magic (0, 0, 0x08 = uint8, ndim), big-endian int32 dims, bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    with open(path, "wb") as fh:
        fh.write(struct.pack(">BBBB", 0, 0, 0x08, array.ndim))
        fh.write(struct.pack(f">{array.ndim}i", *array.shape))
        fh.write(array.tobytes())


def export_plato(manifest: dict, shards: list, data_path: Path, name: str = PROTOCOL["dataset"]) -> dict:
    """fedrepro's clients as `<data_path>/<name>/raw/*-ubyte` (one-channel uint8 images) and
    `<data_path>/clients.json` (each client's [start, stop) rows in the train and test files)."""
    ids = sorted(s.id for s in shards)
    by_id = {s.id: s for s in shards}
    for s in shards:
        for split in ("train", "test"):
            x = s.x[split]
            if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1] != 1:
                raise ValueError(f"the Plato export takes one-channel uint8 images (N, 1, H, W); client {s.id} {split} "
                                 f"holds {x.dtype} {x.shape}")
    tmp = data_path.with_name(data_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / name / "raw").mkdir(parents=True)
    clients: dict[str, dict[str, list[int]]] = {str(i): {} for i in ids}
    for split, (images, labels) in IDX_FILES.items():
        start, xs, ys = 0, [], []
        for i in ids:
            x, y = by_id[i].x[split], np.asarray(by_id[i].y[split])
            clients[str(i)][split] = [start, start + len(x)]
            start += len(x)
            xs.append(x[:, 0])
            ys.append(y)
        write_idx(tmp / name / "raw" / images, np.concatenate(xs))
        write_idx(tmp / name / "raw" / labels, np.concatenate(ys).astype(np.uint8))
    novel = sorted(int(i) for i in (manifest.get("unseen_clients") or []))
    meta = {"dataset": name, "partition_id": manifest["partition_id"], "mean": manifest["mean"], "std": manifest["std"],
            "novel": novel, "clients": clients,
            # Plato client k (from 1) is fedrepro client plato_order[k-1]: training clients first, novel ones last
            "plato_order": [i for i in ids if i not in novel] + novel}
    (tmp / "clients.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(data_path, ignore_errors=True)
    os.replace(tmp, data_path)
    return meta


def read_plato_client(data_path: Path, client: int, split: str):
    """A client's (x, y) as Plato's FashionMNIST data source reads them (torchvision's FashionMNIST
    with ToTensor + Normalize(mean, std), fedrepro's mean/std) over its sampler's rows."""
    import torch
    from torchvision import datasets, transforms

    meta = json.loads((data_path / "clients.json").read_text())
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(tuple(meta["mean"]), tuple(meta["std"]))])
    cls = getattr(datasets, meta["dataset"])
    ds = cls(root=str(data_path), train=split == "train", download=False, transform=tf)
    start, stop = meta["clients"][str(client)][split]
    xs, ys = zip(*(ds[i] for i in range(start, stop)))
    return torch.stack(xs), torch.tensor(ys, dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Inside Plato's environment: one row, one seed
# --------------------------------------------------------------------------------------------


def plato_config(row: dict, work: Path) -> Path:
    """The example's config at calibre_cpu's scale (shim 2)."""
    import yaml

    p = PROTOCOL
    trainer = {"type": "self_supervised_learning", "rounds": p["rounds"], "max_concurrency": 1, "epochs": p["epochs"],
               "batch_size": p["batch_size"], "optimizer": "SGD", "loss_criterion": row["loss"], "model_name": row["example"],
               "encoder_name": "fedrepro", "projection_hidden_dim": p["proj_hidden"], "projection_out_dim": p["proj_dim"],
               "prediction_hidden_dim": p["proj_hidden"], "prediction_out_dim": p["proj_dim"],
               "n_prototypes": p["swav_prototypes"]}
    algorithm = {"type": "fedavg_personalized",
                 "data_transforms": {"train_transform": {"name": "SimCLR", "parameters": {"input_size": 28}}},
                 "personalization": {"model_type": "general_multilayer", "model_name": "linear_mlp", "epochs": 10,
                                     "batch_size": 32, "optimizer": "SGD", "lr_scheduler": "StepLR",
                                     "loss_criterion": "CrossEntropyLoss", "participating_client_ratio": 1.0}}
    loss_params: dict = {}
    if row["example"] == "calibre":
        algorithm |= {"auxiliary_loss_criterions": ["prototype_regularizers"],
                      "auxiliary_loss_criterions_param": {"prototype_regularizers": {"n_clusters": p["n_clusters"],
                                                                                     "distance_type": "euclidean"}},
                      "losses_weight": {"NTXentLoss": 1.0, "prototype_regularizers": row["weights"]}}
    if row["loss"] == "NTXentLoss":
        loss_params = {"temperature": p["temperature"]}
    if row["example"] == "fedema":
        algorithm |= {"encoder_layer_names": ["encoder"], "adaptive_divergence_scale": True, "default_divergence_scale": 0.0,
                      "divergence_scale_tau": 0.7, "compute_scale_before_round": 3}
    cfg = {"clients": {"total_clients": 2, "per_round": 2, "do_test": False},
           "server": {"address": "127.0.0.1", "port": 8000, "model_path": "models", "checkpoint_path": "checkpoints"},
           "data": {"datasource": p["dataset"], "data_path": "data", "sampler": "iid", "partition_size": 64},
           "trainer": trainer, "algorithm": algorithm,
           "parameters": {"optimizer": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0001},
                          "loss_criterion": loss_params, "model": {"num_classes": 10},
                          "personalization": {"optimizer": {"lr": 0.05, "momentum": 0.0, "weight_decay": 0.0},
                                              "learning_rate": {"gamma": 1.0, "step_size": 10},
                                              "model": {"num_classes": 10}}},
           "general": {"base_path": str(work)}}
    path = work / "configs" / f"{row['name']}.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def fedrepro_encoder(sample_shape, num_classes):
    """Shim 1: fedrepro's encoder, with the attribute Plato's models read."""
    from fedrepro.models import build_model

    split = build_model(PROTOCOL["model"], sample_shape, num_classes, PROTOCOL["model_params"])
    split.extractor.encoding_dim = split.feature_dim
    return split


def mapped(name: str) -> str:
    for plato_prefix, ours in NAME_MAP:
        if name.startswith(plato_prefix):
            return ours + name[len(plato_prefix):]
    return name


def max_diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def rel(diff: float, ref: float) -> float:
    return diff / max(abs(ref), 1e-12)


def inside(row_name: str, seed: int, work: Path, examples: Path) -> dict:
    """Everything that imports Plato: run in --plato-python with the example folder on sys.path."""
    import importlib

    import torch

    row = {**ROWS[row_name], "name": row_name}
    os.environ["config_file"] = str(plato_config(row, work))
    sys.argv = sys.argv[:1]  # Plato's Config parses sys.argv
    sys.path.insert(0, str(examples / row["example"]))
    import lightly.loss

    if not hasattr(lightly.loss, "SymNegCosineSimilarityLoss"):  # shim 4
        lightly.loss.SymNegCosineSimilarityLoss = lightly.loss.NegativeCosineSimilarity
    from plato.config import Config
    from plato.models import cnn_encoder

    Config()
    meta = json.loads((work / "data" / "clients.json").read_text())
    x, y = read_plato_client(work / "data", int(next(iter(meta["clients"]))), "train")
    x, y = x[: PROTOCOL["batch_size"]], y[: PROTOCOL["batch_size"]]
    torch.manual_seed(seed)  # the encoder's and the heads' initial weights (fedrepro's side gets a copy of them)
    split_model = fedrepro_encoder(tuple(x.shape[1:]), 10)
    cnn_encoder.Model.get = staticmethod(lambda model_name=None, **kw: split_model.extractor)  # shim 1
    mod_name, cls_name = row["model"].split(".")
    plato_model = getattr(importlib.import_module(mod_name), cls_name)()

    from fedrepro.methods import METHODS
    from fedrepro.ssl.augment import TwoViewAugment
    from fedrepro.ssl.objectives import OBJECTIVES

    hp = {**{k: p.default for k, p in METHODS.get(row["method"]).hparams.items()}, **row["hparams"],
          "proj_hidden": PROTOCOL["proj_hidden"], "proj_dim": PROTOCOL["proj_dim"], "temperature": PROTOCOL["temperature"],
          "swav_prototypes": PROTOCOL["swav_prototypes"]}
    ours = fedrepro_encoder(tuple(x.shape[1:]), 10)
    obj = OBJECTIVES.get(row["objective"])(ours.feature_dim, hp)
    for name, module in obj.modules(ours.extractor).items():
        ours.add_module(name, module)
    plato_state = {mapped(k): v for k, v in plato_model.state_dict().items()}
    our_state = {k: v for k, v in ours.state_dict().items() if not k.startswith("head.")}
    out: dict[str, Any] = {"row": row_name, "seed": seed, "checks": []}

    def check(name: str, plato_value, fedrepro_value, *, expect_equal: bool = True, note: str = "") -> None:
        d = max_diff(torch.as_tensor(plato_value), torch.as_tensor(fedrepro_value))
        ref = float(torch.as_tensor(plato_value).double().abs().max()) if torch.as_tensor(plato_value).numel() else 0.0
        same = rel(d, ref) <= TOL or d <= 1e-7
        out["checks"].append({"check": name, "plato": _short(plato_value), "fedrepro": _short(fedrepro_value),
                              "max_abs_diff": d, "equal": same, "expected_equal": expect_equal, "note": note})

    # Architecture: the same tensors by name and shape.
    missing = sorted(set(plato_state) ^ set(our_state))
    shapes = [k for k in plato_state if k in our_state and plato_state[k].shape != our_state[k].shape]
    out["architecture"] = {"names_only_one_side": missing, "shape_mismatch": shapes, "tensors": len(plato_state)}
    ours.load_state_dict({**ours.state_dict(), **{k: v for k, v in plato_state.items() if k in our_state}})

    torch.manual_seed(1000 + seed)
    xa, xb = TwoViewAugment(meta["mean"], meta["std"], x.shape[-1])(x)
    plato_model.train()
    ours.train()
    criterion = plato_criterion(row)
    kseed = seed
    if row["example"] == "calibre":
        kseed, out["kmeans_seeds_with_an_empty_view_cluster"] = kmeans_seed_without_empty_clusters(plato_model, xa, xb, seed)
    t0 = time.perf_counter()
    np.random.seed(kseed)  # shim 3: Calibre's unseeded KMeans draws what fedrepro's kmeans(seed) draws
    plato_loss = criterion(plato_model([xa, xb]), y)
    plato_loss.backward()
    t_plato = time.perf_counter() - t0
    t0 = time.perf_counter()
    our_loss = fedrepro_step_loss(row, obj, ours, xa, xb, kseed, hp)
    our_loss.backward()
    t_ours = time.perf_counter() - t0
    out["seconds_per_step"] = {"plato": t_plato, "fedrepro": t_ours}
    check("local loss (one batch, same views)", plato_loss.detach(), our_loss.detach())
    grads_p = {mapped(k): p.grad for k, p in plato_model.named_parameters() if p.grad is not None}
    grads_o = {k: p.grad for k, p in ours.named_parameters() if p.grad is not None}
    if set(grads_p) != set(grads_o):
        out["checks"].append({"check": "parameters with a gradient", "plato": sorted(set(grads_p) - set(grads_o)),
                              "fedrepro": sorted(set(grads_o) - set(grads_p)), "max_abs_diff": None, "equal": False,
                              "expected_equal": True, "note": ""})
    common = sorted(set(grads_p) & set(grads_o))
    worst = max(common, key=lambda k: rel(max_diff(grads_p[k], grads_o[k]), float(grads_p[k].abs().max())))
    check(f"gradients, worst of {len(common)} tensors", grads_p[worst], grads_o[worst], note=f"worst: {worst}")

    if row["example"] == "calibre":
        calibre_rules(row, plato_model, ours, x, seed, check)
    if row["objective"] == "byol":
        byol_schedule(row, obj, check)
    if row["example"] == "fedema":
        fedema_rules(plato_model, ours, seed, check)
    return out


def _short(v):
    import torch

    t = torch.as_tensor(v)
    return float(t) if t.numel() == 1 else f"tensor{tuple(t.shape)}"


def plato_criterion(row):
    """The example trainer's loss (basic.Trainer: outputs = model(examples); loss =
    self._loss_criterion(outputs, labels), which is get_ssl_criterion() in the SSL rounds)."""
    import importlib

    from plato.trainers import self_supervised_learning as ssl_trainer

    cls = ssl_trainer.Trainer
    if row["example"] == "calibre":  # shim 5
        import calibre_loss

        original = calibre_loss.get_prototype_loss
        calibre_loss.get_prototype_loss = lambda prototypes, queries, query_labels, distance_type="euclidean": original(
            prototypes, queries, query_labels.long(), distance_type)
    if row["trainer"]:
        mod_name, cls_name = row["trainer"].split(".")
        cls = getattr(importlib.import_module(mod_name), cls_name)
    stub = cls.__new__(cls)  # get_ssl_criterion reads only Config and self.device
    stub.device = "cpu"
    return cls.get_ssl_criterion(stub)


def kmeans_seed_without_empty_clusters(model, xa, xb, seed: int, tries: int = 200) -> tuple[int, int]:
    """Plato's l_p averages each view's projections over every cluster of the joint KMeans: a
    cluster with no member in one view gives a NaN prototype and a NaN loss (calibre_loss.py).
    The first KMeans seed from 1000 * seed on whose labels every cluster has members in both views
    (the case where both codes define the same loss), and how many seeds before it did not."""
    import torch
    from clustering import kmeans_clustering

    with torch.no_grad():
        z = torch.cat([model.encoder(xa), model.encoder(xb)]).flatten(1)
    for i in range(tries):
        np.random.seed(1000 * seed + i)
        labels, _ = kmeans_clustering(z, n_clusters=PROTOCOL["n_clusters"])
        a, b = labels[: len(xa)], labels[len(xa):]
        if set(a.tolist()) == set(b.tolist()) == set(labels.tolist()):
            return 1000 * seed + i, i
    raise RuntimeError(f"no KMeans seed in {tries} puts every cluster in both views")


def fedrepro_step_loss(row, obj, model, xa, xb, seed, hp):
    import torch

    out = obj.loss(model, xa, xb)
    if row["example"] != "calibre" or not (hp["use_lp"] or hp["use_ln"]):
        return out.loss
    from lightly.loss import NTXentLoss

    from fedrepro.methods.calibre import prototype_contrastive_loss, prototype_meta_loss
    from fedrepro.ssl.objectives import kmeans

    labels, _ = kmeans(torch.cat([out.za, out.zb]), hp["n_clusters"], seed)  # Calibre.regularizer, seed given
    ya, yb = labels[: len(out.za)], labels[len(out.za):]
    reg = out.loss.new_zeros(())
    if hp["use_lp"]:
        reg = reg + prototype_contrastive_loss(out.ha, out.hb, ya, yb, NTXentLoss(temperature=hp["lp_temperature"]))
    if hp["use_ln"]:
        reg = reg + prototype_meta_loss(out.za, out.zb, ya, yb)
    return out.loss + hp["alpha"] * reg


def calibre_rules(row, plato_model, ours, x, seed, check):
    """Divergence rate and the divergence-weighted aggregation."""
    import asyncio
    from types import SimpleNamespace

    import calibre_server
    import calibre_trainer
    import torch

    from fedrepro.methods.calibre import Calibre, divergence_rate

    with torch.no_grad():
        z = plato_model.encoder(x).flatten(1)
    stub = calibre_trainer.Trainer.__new__(calibre_trainer.Trainer)
    stub.device = "cpu"
    np.random.seed(seed)
    d_plato = float(calibre_trainer.Trainer.compute_divergence_rate(stub, z))
    check("divergence rate, code_compat_normalized_centroids", d_plato, divergence_rate(z, 10, seed, True))
    check("divergence rate, default (raw centroids) [RECON]", d_plato, divergence_rate(z, 10, seed, False),
          expect_equal=False, note="Plato L2-normalises the centroids, not the encodings (clustering.py)")
    if row["name"] != "calibre":
        return
    g = torch.Generator().manual_seed(seed)
    glob = {"w": torch.randn(5, generator=g)}
    clients = [{"w": torch.randn(5, generator=g)} for _ in range(3)]
    n, d = [30.0, 50.0, 20.0], [0.5, 1.0, 2.0]
    server = calibre_server.Server.__new__(calibre_server.Server)
    server.trainer = SimpleNamespace(zeros=torch.zeros)
    server.divergence_rates_received = 1 / torch.tensor(d)
    updates = [SimpleNamespace(report=SimpleNamespace(num_samples=k)) for k in n]
    deltas = [{"w": c["w"] - glob["w"]} for c in clients]
    plato_new = glob["w"] + asyncio.run(server.aggregate_deltas(updates, deltas))["w"]
    for compat in (True, False):
        method = Calibre.__new__(Calibre)
        method.hp = {"divergence_weighting": True, "code_compat_unnormalized": compat}
        method.server = {"global": dict(glob)}
        method.aggregate([SimpleNamespace(client_id=i, num_samples=k, params=c, extras={"divergence": dd})
                          for i, (k, c, dd) in enumerate(zip(n, clients, d))])
        check(f"aggregation, code_compat_unnormalized={compat}", plato_new, method.server["global"]["w"],
              expect_equal=compat, note="" if compat else "[PAPER≠CODE] Plato's weights do not sum to 1 (calibre_server.py)")


def byol_schedule(row, obj, check):
    """BYOL's target momentum at the start of each round: Plato per epoch, cosine_schedule(global
    epoch, epochs * rounds, 0.996, 1); fedrepro per round, cosine_momentum(0.996, (r - 1) / R)."""
    from lightly.utils.scheduler import cosine_schedule

    from fedrepro.ssl.objectives import cosine_momentum

    R, E = PROTOCOL["rounds"], PROTOCOL["epochs"]
    plato = [cosine_schedule((r - 1) * E + 1, E * R, 0.996, 1) for r in range(1, R + 1)]  # epoch counter starts at 1
    ours = [cosine_momentum(0.996, (r - 1) / R) for r in range(1, R + 1)]
    check(f"target momentum, rounds 1..{R}", plato, ours, expect_equal=False,
          note="Plato's schedule counts epochs from 1 and spans max_steps - 1; fedrepro's starts at the base value")


def fedema_rules(plato_model, ours, seed, check):
    """The divergence-aware EMA a client applies to the received global model."""
    from types import SimpleNamespace

    import fedema_processor
    import torch

    from fedrepro.methods.fedema import FedEMA

    g = torch.Generator().manual_seed(seed)
    local = {k: v.clone() for k, v in plato_model.state_dict().items()}
    glob = {k: (v + 0.01 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone()
            for k, v in local.items()}
    encoder = [k for k in glob if k.startswith("encoder.") and glob[k].is_floating_point()]
    dist = float(torch.sqrt(sum(((local[k] - glob[k]) ** 2).sum() for k in encoder)))
    scale = 0.7 / (2 * dist)  # the server's lambda from an earlier round: mu = tau / 2 here
    trainer = SimpleNamespace(model=plato_model, client_id=1)
    plato_new = fedema_processor.GlobalLocalDivergenceProcessor(trainer=trainer, name="p").process(
        [{k: v.clone() for k, v in glob.items()}, scale])
    plato_new = {mapped(k): v for k, v in plato_new.items()}
    for share in (True, False):
        method = FedEMA.__new__(FedEMA)
        method.hp = {"tau": 0.7, "code_compat_share_target": share, "code_compat_divergence_buffers": share}
        method.engine = SimpleNamespace(model=ours)
        payload = {mapped(k): v for k, v in glob.items()}
        if not share:
            payload = {k: v for k, v in payload.items() if not k.startswith("target_")}
        kept = {mapped(k): v for k, v in local.items() if share or not k.startswith("momentum_")}  # what fedrepro stores
        client = SimpleNamespace(state={"local": kept, "lambda": scale,
                                        "target": {mapped(k): v for k, v in local.items() if k.startswith("momentum_")}})
        new = method.start_params(client, payload)
        online = [k for k in new if not k.startswith("target_") and new[k].is_floating_point()]
        target = [k for k in new if k.startswith("target_")]
        tag = "code_compat_share_target" if share else "default"
        check(f"FedEMA EMA of the online network, {tag}", torch.cat([plato_new[k].flatten() for k in online]),
              torch.cat([new[k].flatten() for k in online]))
        check(f"FedEMA target network after the EMA, {tag}", torch.cat([plato_new[k].flatten() for k in target]),
              torch.cat([new[k].float().flatten() for k in target]), expect_equal=share,
              note="" if share else "[PAPER≠CODE] the paper keeps the target local: the client's own target, not an EMA with the global one")


# --------------------------------------------------------------------------------------------
# Whole runs (--e2e): Plato's example main() on the export, beside fedrepro's cells
# --------------------------------------------------------------------------------------------
# Plato starts its clients with multiprocessing's spawn, which re-imports this file as
# __mp_main__: the shims below are applied at import whenever PARITY_PLATO_E2E is set, so the
# client processes get them too. Shims 1, 4 and 5 as above, and:
#   6. a sampler `fedrepro` (plato.samplers.registry) serving each client its rows of
#      clients.json, train or test; Plato client k is fedrepro's `plato_order[k-1]`: the training
#      clients first, the novel ones last, where `participating_client_ratio` (training clients /
#      all) keeps them out of the training rounds (plato/servers/fedavg_personalized.py:40-45);
#   7. fedrepro's mean/std for Fashion-MNIST in Plato's SSL transform table and in the
#      FashionMNIST data source the personalization reads (Plato's are MNIST's, P10);
#   8. the client's test set is the single-view FashionMNIST test set, not the SSL data source's
#      two-view one (P12: without it the first client test raises "'list' object has no
#      attribute 'to'", observed).

E2E_ROWS = {"pfl_simclr": ("simclr", "simclr", {}, {}),
            "calibre": ("calibre", "calibre", {"model_name": "Calibre"},
                        {"auxiliary_loss_criterions": ["prototype_regularizers"],
                         "auxiliary_loss_criterions_param": {"prototype_regularizers": {"n_clusters": 10,
                                                                                        "distance_type": "euclidean"}},
                         "losses_weight": {"NTXentLoss": 1.0, "prototype_regularizers": [0.3, 0.3]}}),
            "fedema": ("fedema", "fedema", {"model_name": "FedEMA", "loss_criterion": "NegativeCosineSimilarity",
                                            "prediction_hidden_dim": PROTOCOL["proj_hidden"],
                                            "prediction_out_dim": PROTOCOL["proj_dim"]},
                       {"encoder_layer_names": ["encoder"], "adaptive_divergence_scale": True,
                        "default_divergence_scale": 0.0, "divergence_scale_tau": 0.7, "compute_scale_before_round": 3})}


def e2e_config(row: str, seed: int, rounds: int, meta: dict, data_path: Path, base: Path, port: int) -> dict:
    """calibre_cpu's protocol in Plato's keys: 5 of the training clients per round, 1 epoch,
    batch 64, SGD 0.01/0.9/1e-4; personalization 10 epochs, SGD 0.05 momentum 0.9, batch 32."""
    _, _, trainer, algorithm = E2E_ROWS[row]
    n, novel = len(meta["clients"]), len(meta["novel"])
    cfg = {"clients": {"total_clients": n, "per_round": 5, "do_test": True, "random_seed": seed},
           "server": {"address": "127.0.0.1", "port": port, "do_test": False, "random_seed": seed, "simulate_wall_time": False},
           "data": {"datasource": PROTOCOL["dataset"], "personalized_datasource": PROTOCOL["dataset"], "data_path": str(data_path),
                    "partition_size": 200, "sampler": "fedrepro", "testset_sampler": "fedrepro", "random_seed": seed},
           "trainer": {"type": "self_supervised_learning", "rounds": rounds, "max_concurrency": 1, "target_accuracy": 1.1,
                       "epochs": PROTOCOL["epochs"], "batch_size": PROTOCOL["batch_size"], "optimizer": "SGD",
                       "loss_criterion": "NTXentLoss", "model_name": "SimCLR", "encoder_name": "fedrepro",
                       "projection_hidden_dim": PROTOCOL["proj_hidden"], "projection_out_dim": PROTOCOL["proj_dim"], **trainer},
           "algorithm": {"type": "fedavg_personalized",
                         "data_transforms": {"train_transform": {"name": "SimCLR", "parameters": {"input_size": 28}}},
                         "personalization": {"epochs": 10, "batch_size": 32, "optimizer": "SGD", "lr_scheduler": "StepLR",
                                             "loss_criterion": "CrossEntropyLoss", "model_type": "general_multilayer",
                                             "model_name": "linear_mlp",
                                             "participating_client_ratio": (n - novel + 0.5) / n},
                         **algorithm},
           "parameters": {"optimizer": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0001},
                          "loss_criterion": {"eps": 1.0e-8} if row == "fedema" else {"temperature": PROTOCOL["temperature"]},
                          "model": {"num_classes": 10},
                          "personalization": {"optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
                                              "learning_rate": {"gamma": 1.0, "step_size": 10}, "model": {"num_classes": 10}}},
           "results": {"types": "round, accuracy, accuracy_std, elapsed_time, round_time", "record_clients_accuracy": True,
                       "result_path": "results"},
           "general": {"base_path": str(base)}}
    return cfg


def e2e_shims() -> None:
    import torch
    import lightly.loss
    from torchvision import transforms

    if not hasattr(lightly.loss, "SymNegCosineSimilarityLoss"):  # shim 4
        lightly.loss.SymNegCosineSimilarityLoss = lightly.loss.NegativeCosineSimilarity
    sys.argv = sys.argv[:1]
    sys.path.insert(0, os.environ["PLATO_EXAMPLE"])
    from plato.clients import self_supervised_learning as ssl_client
    from plato.datasources import fashion_mnist
    from plato.datasources import registry as datasources
    from plato.datasources import self_supervised_learning as ssl_ds
    from plato.models import cnn_encoder
    from plato.samplers import registry as samplers

    meta = json.loads((Path(os.environ["FEDREPRO_DATA"]) / "clients.json").read_text())
    order = meta["plato_order"]
    seed = int(os.environ["FEDREPRO_SEED"])
    cnn_encoder.Model.get = staticmethod(lambda model_name=None, **kw: fedrepro_encoder((1, 28, 28), 10).extractor)  # 1

    class RowsSampler:  # shim 6
        def __init__(self, datasource, client_id, testing=False):
            start, stop = meta["clients"][str(order[max(client_id, 1) - 1])]["test" if testing else "train"]
            self.rows, self.seed = list(range(start, stop)), 1000 * seed + client_id

        def get(self):
            return torch.utils.data.SubsetRandomSampler(self.rows, generator=torch.Generator().manual_seed(self.seed))

        def num_samples(self):
            return len(self.rows)

    samplers.registered_samplers["fedrepro"] = RowsSampler
    norm = transforms.Compose([transforms.ToTensor(), transforms.Normalize(tuple(meta["mean"]), tuple(meta["std"]))])

    class FashionMNIST(fashion_mnist.DataSource):  # shim 7
        def __init__(self, **kwargs):
            kwargs.setdefault("train_transform", norm)
            super().__init__(**kwargs)

    datasources.registered_datasources[PROTOCOL["dataset"]] = type("FashionMNISTModule", (), {"DataSource": FashionMNIST})
    ssl_ds.dataset_normalizations[PROTOCOL["dataset"]] = {"mean": meta["mean"], "std": meta["std"]}
    allocate = ssl_client.Client._allocate_data

    def single_view_testset(self):  # shim 8
        allocate(self)
        if getattr(self, "testset", None) is not None:
            self.testset = datasources.get().get_test_set()

    ssl_client.Client._allocate_data = single_view_testset
    for obj in (RowsSampler, FashionMNIST, single_view_testset):  # picklable for the spawned client processes
        obj.__qualname__ = obj.__name__
        globals()[obj.__name__] = obj
    if "calibre" in os.environ["PLATO_EXAMPLE"]:  # shim 5
        import calibre_loss

        original = calibre_loss.get_prototype_loss
        calibre_loss.get_prototype_loss = lambda p, queries, query_labels, distance_type="euclidean": original(
            p, queries, query_labels.long(), distance_type)


def read_json(path: Path, what: str) -> dict:
    """benchmarks/script_inputs.read_json (bounded, never blocking; a bad file is one line, exit 2),
    imported here only: the --inside and end-to-end runs import this module in Plato's interpreter."""
    from script_inputs import read_json as bounded

    return bounded(path, what)


def run_e2e(args, row: str, seed: int, examples: Path, meta: dict) -> dict:
    """One Plato run of `row`; its per-round and per-client accuracies (Plato's CSVs)."""
    import csv

    import yaml

    base = args.work / "e2e" / f"{row}_r{args.rounds}_s{seed}"
    cache = base / "record.json"
    if cache.exists() and not args.rerun:
        return read_json(cache, "cached record")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    (base / "config.yml").write_text(yaml.safe_dump(e2e_config(row, seed, args.rounds, meta, args.work / "data", base,
                                                               8100 + 10 * list(E2E_ROWS).index(row) + seed)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(args.plato)]), "OMP_NUM_THREADS": "1",
           "PARITY_PLATO_E2E": "1", "PLATO_EXAMPLE": str(examples / E2E_ROWS[row][0]), "PLATO_MAIN": E2E_ROWS[row][1],
           "config_file": str(base / "config.yml"), "FEDREPRO_DATA": str(args.work / "data"), "FEDREPRO_SEED": str(seed)}
    t0 = time.perf_counter()
    with open(base / "log.txt", "w") as log:
        proc = subprocess.run([args.plato_python, str(Path(__file__).resolve())], env=env, cwd=base,
                              stdout=log, stderr=subprocess.STDOUT, timeout=args.e2e_timeout)
    wall = time.perf_counter() - t0
    results = base / "results"
    found = [f for f in results.glob("*.csv") if "_accuracy" not in f.name] if results.exists() else []
    rounds = list(csv.DictReader(open(found[0]))) if found else []
    clients = list(csv.DictReader(open(next(results.glob("*_accuracy.csv"))))) if found else []
    log_text = (base / "log.txt").read_text(errors="replace")
    errors = [line for line in log_text.splitlines() if line.startswith(("ValueError", "RuntimeError", "AttributeError", "TypeError"))]
    order = meta["plato_order"]
    last = max((int(c["round"]) for c in clients), default=0)
    rec = {"row": row, "seed": seed, "rounds": args.rounds, "exit": proc.returncode, "wall_s": wall,
           "completed_rounds": len(rounds), "first_error": errors[0] if errors else None,
           "plato_round_time_s": [float(r["round_time"]) for r in rounds[: args.rounds]],
           "plato_elapsed_s": [float(r["elapsed_time"]) for r in rounds],
           "personalized": {str(order[int(c["client_id"]) - 1]): float(c["accuracy"]) for c in clients
                            if last > args.rounds and int(c["round"]) == last},
           "plato_reported": {"accuracy": float(rounds[-1]["accuracy"]), "accuracy_std": float(rounds[-1]["accuracy_std"])}
           if len(rounds) > args.rounds else None}
    cache.write_text(json.dumps(rec, indent=1))
    return rec


def fedrepro_client_accuracies(metrics_file: Path) -> dict[str, float]:
    """fedrepro's personalized accuracy of every client, training and novel, by client id."""
    m = read_json(metrics_file, "metrics file")
    out = dict(zip(map(str, m["clients"]["ids"]), m["final"]["personal"]["acc"]))
    out.update(zip(map(str, m["clients"]["unseen_ids"]), m["final"]["unseen_personal"]["acc"]))
    return out


def e2e_markdown(recs: list[dict], fedrepro_runs: Path | None) -> str:
    lines = ["| row | seed | R | clients Plato personalized (fedrepro ids) | Plato mean acc | fedrepro mean acc, same clients | "
             "fedrepro mean acc, all training / novel clients | Plato s/round (its round_time) | fedrepro s/round |",
             "|---|---|---|---|---|---|---|---|---|"]
    pairs: dict[str, list[tuple[float, float]]] = {}
    for r in recs:
        if not r["personalized"]:  # the run stopped before its personalization round
            lines.append(f"| {r['row']} | {r['seed']} | {r['rounds']} | Plato stopped after {r['completed_rounds']} of "
                         f"{r['rounds']} rounds: {r['first_error']} | | | | | |")
            continue
        ids = sorted(r["personalized"], key=int)
        plato_mean = 100 * float(np.mean([r["personalized"][i] for i in ids]))
        same = all_ = spr = "n/a"
        if fedrepro_runs is not None:
            f = next(iter(sorted(fedrepro_runs.glob(f"*/{r['row']}/seed{r['seed']}/metrics.json"))), None)
            if f:
                acc = fedrepro_client_accuracies(f)
                m = read_json(f, "metrics file")
                same = f"{100 * np.mean([acc[i] for i in ids]):.2f}"
                all_ = f"{100 * m['summary']['personal_acc']['mean']:.2f} / {100 * m['summary']['unseen_personal_acc']['mean']:.2f}"
                spr = f"{(m['resources']['train_time_s'] + m['resources']['eval_time_s']) / r['rounds']:.2f}"
        lines.append(f"| {r['row']} | {r['seed']} | {r['rounds']} | {', '.join(ids)} | {plato_mean:.2f} | {same} | {all_} | "
                     f"{np.mean(r['plato_round_time_s']):.2f} (wall {r['wall_s'] / (r['rounds'] + 1):.0f}) | {spr} |")
        if same != "n/a":
            pairs.setdefault(r["row"], []).append((plato_mean, float(same)))
    if any(len(v) > 1 for v in pairs.values()):
        lines += ["", "| row | seeds | Plato, its personalized clients | fedrepro, the same clients | diff | flag |", "|---|---|---|---|---|---|"]
        for row, v in pairs.items():
            if len(v) < 2:
                continue
            pl, fr = np.array(v).T
            sd_p, sd_f = pl.std(ddof=1), fr.std(ddof=1)
            diff = fr.mean() - pl.mean()
            mark = "≠" if abs(diff) > max(2 * max(sd_p, sd_f), 1.0) else ""  # docs/parity.md's rule, in points
            lines.append(f"| {row} | {len(v)} | {pl.mean():.2f} ± {sd_p:.2f} | {fr.mean():.2f} ± {sd_f:.2f} | {diff:+.2f} | {mark} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Outside: staging, caching, the table
# --------------------------------------------------------------------------------------------


def source_hash(*folders: Path) -> str:
    h = hashlib.sha256()
    for folder in folders:
        for f in sorted(folder.rglob("*.py")):
            h.update(str(f.relative_to(folder)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def stage(plato: Path, work: Path) -> Path:
    """An unchanged copy of examples/ssl in the work dir (the checkout is only read)."""
    dest = work / "examples_ssl"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(plato / "examples" / "ssl", dest)
    return dest


def run_row(args, row: str, seed: int, examples: Path, src: str) -> dict:
    cache = args.work / "cache" / f"{row}_s{seed}_{src}.json"
    if cache.exists() and not args.rerun:
        return read_json(cache, "cached record")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(args.plato)]), "OMP_NUM_THREADS": "1"}
    cmd = [args.plato_python, str(Path(__file__).resolve()), "--inside", row, "--seed", str(seed), "--work", str(args.work),
           "--examples", str(examples)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=args.work)
    if proc.returncode:
        raise SystemExit(f"parity_plato: row {row} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rec, indent=1))
    return rec


def markdown(records: list[dict]) -> str:
    lines = ["| row | check | seeds | Plato | fedrepro | max abs diff | verdict | note |", "|---|---|---|---|---|---|---|---|"]
    by: dict[tuple[str, str], list[dict]] = {}
    for rec in records:
        for c in rec["checks"]:
            by.setdefault((rec["row"], c["check"].split(" (")[0].split(";")[0]), []).append(c)  # cached names: "gradients (12 tensors; worst ...)"
    for (row, name), cs in by.items():
        diff = max((c["max_abs_diff"] or 0.0) for c in cs)
        equal = all(c["equal"] for c in cs)
        expected = all(c["expected_equal"] == c["equal"] for c in cs)
        verdict = ("=" if equal else "≠") + ("" if expected else " (unexpected)")
        fmt = lambda v: f"{v:.6g}" if isinstance(v, float) else str(v)
        lines.append(f"| {row} | {name} | {len(cs)} | {fmt(cs[0]['plato'])} | {fmt(cs[0]['fedrepro'])} | {diff:.3g} | "
                     f"{verdict} | {cs[0]['note']} |")
    lines += ["", "| row | architecture (tensors, names on one side only, shape mismatches) | s/step Plato | s/step fedrepro |",
              "|---|---|---|---|"]
    seen = set()
    for rec in records:
        if rec["row"] in seen:
            continue
        seen.add(rec["row"])
        a = rec["architecture"]
        sp = [r["seconds_per_step"] for r in records if r["row"] == rec["row"]]
        lines.append(f"| {rec['row']} | {a['tensors']}, {a['names_only_one_side'] or 'none'}, {a['shape_mismatch'] or 'none'} | "
                     f"{np.mean([s['plato'] for s in sp]):.3f} | {np.mean([s['fedrepro'] for s in sp]):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from script_inputs import OneLineParser, existing_dir  # usage errors on one line, exit 2

    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plato", type=Path, help="a checkout of TL-System/plato (read only)")
    ap.add_argument("--plato-python", default=None, help="the interpreter of Plato's environment")
    ap.add_argument("--shards", type=Path, help="a fedrepro partition folder (results/shards/<dataset>/<id>)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/parity_plato"))
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rerun", action="store_true", help="ignore cached results")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--e2e", nargs="*", choices=list(E2E_ROWS), default=None,
                    help="also run these rows end to end in Plato (its main(), its server and client processes)")
    ap.add_argument("--rounds", type=int, default=PROTOCOL["rounds"], help="rounds of the --e2e runs")
    ap.add_argument("--e2e-timeout", type=int, default=3600)
    ap.add_argument("--fedrepro-runs", type=existing_dir, default=None,
                    help="results/<experiment>/runs/<dataset> of fedrepro's cells with the same protocol and rounds")
    ap.add_argument("--inside", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--examples", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inside:
        print(json.dumps(inside(args.inside, args.seed, args.work, args.examples)))
        return
    from fedrepro.data.shards import load_partition

    args.work.mkdir(parents=True, exist_ok=True)
    manifest, shards = load_partition(args.shards)
    export_plato(manifest, shards, args.work / "data")
    if args.export_only:
        print(f"exported {len(shards)} clients to {args.work / 'data'}")
        return
    if not (args.plato and args.plato_python):
        ap.error("--plato and --plato-python are needed to run the comparison")
    examples = stage(args.plato, args.work)
    src = source_hash(examples, args.plato / "plato", ROOT / "src" / "fedrepro")
    if args.e2e is not None:
        meta = read_json(args.work / "data" / "clients.json", "exported clients file")
        recs = [run_e2e(args, row, seed, examples, meta) for row in (args.e2e or list(E2E_ROWS)) for seed in args.seeds]
        table = e2e_markdown(recs, args.fedrepro_runs)
        (args.work / f"parity_plato_e2e_r{args.rounds}.md").write_text(table)
        print(table)
        return
    records = [run_row(args, row, seed, examples, src) for row in args.rows for seed in args.seeds]
    commit = subprocess.run(["git", "-C", str(args.plato), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not commit and (args.plato / ".commit").exists():  # an archive of the fetched repository: its commit beside it
        commit = (args.plato / ".commit").read_text().strip()
    head = (f"Plato {commit or '(not a git checkout)'}; fedrepro {ROOT}; partition {manifest['partition_id']}; "
            f"seeds {args.seeds}; source hash {src}\n\n")
    (args.work / "parity_plato.md").write_text(head + markdown(records))
    (args.work / "parity_plato.json").write_text(json.dumps(records, indent=1))
    print(head + markdown(records))


if os.environ.get("PARITY_PLATO_E2E") and __name__ in ("__main__", "__mp_main__"):
    e2e_shims()  # in the Plato run and in every client process it spawns

def e2e_child() -> None:
    """The Plato run itself (PARITY_PLATO_E2E set): the example's main() with the shims applied."""
    import importlib

    import torch

    torch.manual_seed(int(os.environ["FEDREPRO_SEED"]))  # the server's initial model
    importlib.import_module(os.environ["PLATO_MAIN"]).main()


if __name__ == "__main__":
    e2e_child() if os.environ.get("PARITY_PLATO_E2E") else main()
