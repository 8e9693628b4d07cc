"""Parity of fedrepro's FedGCR and its fairness baselines with the authors' code
(celinezheng/fedgcr), run unchanged, on fedgcr_cpu's client data.

    .venv/bin/python benchmarks/parity_fedgcr.py --fedgcr /work/ref/fedgcr --python /work/ref/fedgcr-venv/bin/python
    ... --methods FedGCR q-FFL --seeds 0 --rounds 4       # a subset
    ... --rerun ref|fedrepro|both                           # recompute cached runs

What runs on each side. The reference's `federated/train.py` cannot run end to end here: its
models need ImageNet weights (torchvision `vit_b_16(pretrained=True)` for FedGCR,
`../pretrained/imagenet21k_ViT-B_16.npz` for the baselines' VPT), its feature width 768 is
hard-coded in six places (`utils/prompt_vit.py` m2featdim, `utils/util.py` cluster_avg_feat /
agg_feat / get_domain_idx, `utils/doprompt.py` mlp_dim), HarmoFL's amplitude buffer is fixed at
3x224x224 (`utils/prompt_vit.py:77`), and a 768-wide ViT at 224 px over 10 methods x 3 seeds is
hours on 2 CPU cores. What runs unchanged is the part that decides every difference the CPU
tables raised: the server. Each row runs fedrepro's client training on fedrepro's clients and
aggregates either with fedrepro's server ("F") or with the reference's `utils/util.py
communication()` ("R", imported from a copy of the checkout, called with the arguments
`federated/train.py:361` passes it). Per row:

  * F      fedrepro's method with its defaults (the paper; the fedgcr_cpu cells);
  * F/code fedrepro's method with its options set to the reference code's choices
           (loss_at, lambda_mode, lipschitz, group_loss, beta_schedule, loss_form), where they differ;
  * R      the client side of F/code, the reference's server.

R against F/code tests fedrepro's implementation of the code's server; F against F/code shows
what the paper's choices change. FedSAM, HarmoFL and FedMix, whose server in the code is its
FedAvg branch, swap the other half instead: R runs the code's own client functions
(`utils/util.py` train_fedsam / train_harmofl / train_fedmix, with its SAM, WPOptim and
agg_smash_data) on fedrepro's model and client tensors, and fedrepro's FedAvg / HarmoFL server. The clients' training and data are identical in R and F/code by
construction; the export (below) proves the data are the reference's format.

Shims (the smallest that let `communication()` run on fedrepro's models; the reference's files
are copied, never edited):
  1. parameter names: fedrepro's trainable entries are handed over as buffers of a small
     nn.Module named as the reference's filters expect (`extractor.prompts` -> `extractor__prompts`
     contains 'prompt', `head.*` -> `head__*`, `extractor.gc_net.*` -> `extractor__meta_net__*`,
     the GC-Net being the code's `meta_net`, `utils/doprompt.py:123`); the reference writes the
     aggregate into them in place (`.data.copy_`), which is read back;
  2. the client representations h~_k (K, d) are zero-padded to the code's hard-coded 768
     (`utils/util.py:1009`, `torch.zeros((cluster_num, 768))`): the padded coordinates are equal for
     every client, so the GMM's clusters are those of the d-dim data; the returned centres are cut
     back to d;
  3. `args`: a namespace with the fields `communication()` and `write_log()` read (mode, q = 1,
     beta = 0.5, cluster 'gmm', distinct false, ...: train.py's defaults); `write_log` writes to
     ../logs/ relative to the working directory, which is the staged copy's federated/ in --work;
  4. `Eas` (the FedGCR code's per-client 100 / L_k, `federated/train.py:262, 368`): 100 in round 1,
     then int(100 / L_k) with L_k the received model's train loss (= the code's post-aggregation
     train loss of the previous round), i.e. fedrepro's `loss_at: start`; `train_losses` (q-FFL,
     AFL, TERM) = the local training loss (`train.py:337-338`), fedrepro's `loss_at: train`;
  5. the GMM's randomness: the code leaves sklearn's GaussianMixture unseeded (numpy's global
     stream, seeded once by train.py:133); here np.random.seed(seed) once per run.
  6. the client rows: the code's functions get a DataLoader over the client's tensors (batch 32,
     shuffled by a seeded generator), fedgcr_cpu's AdamW (lr 3e-3, wd 1e-4) as SAM's / WPOptim's
     base optimiser and FedMix's optimiser (the code: Adam lr 1e-2 / AdamW lr 1e-3; the same
     hyper-parameters on both sides), train_fedmix under torch's math attention kernel (its input
     gradient is trained through, which the fused CPU kernel cannot), tqdm silenced; HarmoFL's
     amplitude is fedrepro's model's with `amplitude: dc`, the code's AmpNorm.

Data: fedgcr_cpu's `shifted_domains` DIF-5 partition (13 clients of 5 types), read from the
workflow's shards (results/shards/...; `snakemake --configfile config/papers/fedgcr_cpu.yaml
results/shards/...` or a run of fedgcr_cpu makes them). Every client is exported in the
reference's `DigitsDataset` format (`utils/data_utils.py:12-33`: a pickled (images uint8 (N,H,W,C),
labels) tuple in `partitions/train_part0.pkl` and `test.pkl` under one folder per client) with
the manifest's mean/std as its Normalize, and read back through the reference's own DigitsDataset
class (+ ToTensor + Normalize) and compared with fedrepro's client tensors before anything runs
(`tests/test_parity_fedgcr.py` does the same without the reference).

Protocol: fedgcr_cpu's training block (10 rounds, full participation, 1 local epoch, batch 32,
AdamW lr 3e-3 wd 1e-4, the proxy-pretrained tiny ViT), seeds 0 1 2, metrics after the last
round: Avg over types, σ_type, σ_client (fedrepro.metrics.type_summary, the code's
`test_score`), the test-size-weighted accuracy and FedGCR's clustering accuracy. Flag ≠:
|diff| > max(2 x the larger std over seeds, 1 point), as docs/parity.md. Timing: fedrepro's
(train_time_s + eval_time_s) / R on each side (R's includes the reference's server step).
Results are cached per (side, row, seed, config hash) in --work/cache.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import pickle
import shutil
import sys
import time
import types as pytypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_pfllib import client_tensors, key_of, write_json  # noqa: E402  (one definition: the engine's tensors, cache keys, atomic JSON)
from script_inputs import read_json  # noqa: E402  (bounded, never blocking)

os.environ.setdefault("TQDM_DISABLE", "1")  # the code's client loops wrap every batch in tqdm (read when tqdm is imported)
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config" / "papers" / "fedgcr_cpu.yaml"
REF_WIDTH = 768  # the code's hard-coded feature width (utils/util.py:1009)

# --------------------------------------------------------------------------------------------
# Rows. `mode`: the reference's --mode (utils/util.py communication's branch); `f`: fedrepro's
# method and hparams as in fedgcr_cpu; `code`: the hparams that set fedrepro's options to the
# code's choices (None: no option differs); the R side runs fedrepro's client of `f` + `code`.
# --------------------------------------------------------------------------------------------

CODE_FEDGCR = {"group_loss": "size_weighted", "loss_at": "start", "beta_schedule": "code", "loss_form": "code_compat",
               "head": "linear"}


@dataclass(frozen=True)
class Row:
    name: str
    mode: str
    method: str
    hparams: tuple = ()
    code: tuple | None = None


def row(name: str, mode: str, method: str, hparams: dict | None = None, code: dict | None = None) -> Row:
    return Row(name, mode, method, tuple(sorted((hparams or {}).items())),
               None if code is None else tuple(sorted(code.items())))


ROWS = [
    # FedAvg: train.py:288 AdamW, util.py:1177-1191 n_k-weighted mean of the 'prompt'/'head' entries.
    row("FedAvg", "fedavg", "fedavg"),
    # TERM: util.py:1106-1119, w_k ∝ p_k exp(0.01 L_k), L_k = the local training loss (train.py:338).
    row("TERM", "term", "term", code={"loss_at": "train"}),
    # AFL: util.py:1092-1105, lambda = Proj(p + 0.1 L) each round from the size prior.
    row("AFL", "afl", "afl", code={"lambda_mode": "prior_step", "lambda_lr": 0.1, "loss_at": "train"}),
    # q-FFL: util.py:1067-1091, L = 1/0.001 hard-coded, q = args.q = 1.
    row("q-FFL", "q-ffl", "qffl", code={"lipschitz": 1000.0, "loss_at": "train"}),
    # FedGCR: util.py:1120-1176 (clusters h~ = all_pi, FedGR weights), train.py:297-318 client.
    row("FedGCR", "fedgcr", "fedgcr", code=CODE_FEDGCR),
    # FedGR only: the code's mode 'ablation' (GMM on all_feat, the same weights, no GC losses).
    row("FedGR only", "ablation", "fedgcr", {"group_customization": False},
        code={k: v for k, v in CODE_FEDGCR.items() if k not in ("loss_form", "head")}),
    # FedGC only: the code's mode 'only_dcnet' (clusters for l_GC, weights = client_weights).
    row("FedGC only", "only_dcnet", "fedgcr", {"group_reweighting": False}, code={"loss_form": "code_compat", "head": "linear"}),
]

# FedSAM, HarmoFL and FedMix: the code's server is its FedAvg branch (HarmoFL adds its amplitude
# buffer), so what differs is the client step. Their R side runs the code's own client functions
# (utils/util.py train_fedsam / train_harmofl / train_fedmix with utils/sam.py SAM,
# utils/weight_perturbation.py WPOptim, utils/aggregate.py agg_smash_data) on fedrepro's model and
# client tensors, with fedgcr_cpu's optimiser as their base optimiser, and fedrepro's FedAvg /
# HarmoFL server (the FedAvg row shows it equal to the code's).
CLIENT_ROWS = [
    # FedSAM: train.py:286 SAM(base Adam, lr) with rho 0.05, util.py:563-589.
    row("FedSAM", "fedsam", "fedsam"),
    # HarmoFL: train.py:284 WPOptim(base Adam, alpha 0.05, wd 1e-4), util.py:743-776; the code's AmpNorm = amplitude dc.
    row("HarmoFL", "harmo-fl", "harmofl", code={"amplitude": "dc"}),
    # FedMix: train.py:265-266, 330-331 (lamb 0.05, the pooled pair means of agg_smash_data), util.py:813-850.
    row("FedMix", "fedmix", "fedmix"),
]


# --------------------------------------------------------------------------------------------
# Small helpers (as parity_pfllib.py)
# --------------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if len(v) == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def flag(diff: float, sd_a: float, sd_b: float) -> str:
    """'≠' when |diff| > max(2 x the larger std over seeds, 0.01) (docs/parity.md)."""
    if any(math.isnan(v) for v in (diff, sd_a, sd_b)):
        return "?"
    return "≠" if abs(diff) > max(2 * max(sd_a, sd_b), 0.01) else ""


# --------------------------------------------------------------------------------------------
# Data: the reference's DigitsDataset format
# --------------------------------------------------------------------------------------------


def export_reference(manifest: dict, shards: list, out: Path) -> dict:
    """Write every client in the reference's DigitsDataset format (utils/data_utils.py:12-33):
    <out>/client<i>/partitions/train_part0.pkl and <out>/client<i>/test.pkl, each a pickled
    (images uint8 (N, H, W, C) for PIL, labels int64) tuple, and meta.json with the channels and
    the Normalize mean/std (fedrepro's manifest) that reproduce fedrepro's tensors."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    meta = {"partition_id": manifest["partition_id"], "mean": manifest["mean"], "std": manifest["std"], "clients": {}}
    for s in shards:
        x_train = np.asarray(s.x["train"])
        if x_train.dtype != np.uint8 or x_train.ndim != 4:
            raise ValueError(f"client {s.id}: DigitsDataset needs uint8 images (N, C, H, W); got {x_train.dtype} {x_train.shape}")
        folder = tmp / f"client{s.id}"
        (folder / "partitions").mkdir(parents=True)
        for split, path in (("train", folder / "partitions" / "train_part0.pkl"), ("test", folder / "test.pkl")):
            images = np.ascontiguousarray(np.asarray(s.x[split]).transpose(0, 2, 3, 1))  # (N, H, W, C)
            if images.shape[-1] == 1:
                images = images[..., 0]  # mode 'L' wants (N, H, W)
            with open(path, "wb") as fh:
                pickle.dump((images, np.asarray(s.y[split], dtype=np.int64)), fh)
        meta["clients"][str(s.id)] = {"channels": int(x_train.shape[1]), "type": s.client_type if hasattr(s, "client_type") else None}
    (tmp / "meta.json").write_text(json.dumps(meta, default=str))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return meta


def read_reference_client(folder: Path, channels: int, mean, std, train: bool, dataset_cls=None):
    """Read a client back the way the reference does: DigitsDataset(data_path, channels, percent=0.1,
    train) (the reference's class when given, else this re-implementation of its reading:
    np.load(allow_pickle=True) of the pickle, labels astype(longlong).squeeze(), PIL
    Image.fromarray(mode 'L'/'RGB')) + transforms.ToTensor() + Normalize(mean, std), stacked."""
    import torch
    from PIL import Image
    from torchvision import transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    if dataset_cls is not None:
        ds = dataset_cls(data_path=str(folder), channels=channels, percent=0.1, train=train, transform=transform)
        items = [ds[i] for i in range(len(ds))]
    else:
        path = folder / ("partitions/train_part0.pkl" if train else "test.pkl")
        images, labels = np.load(path, allow_pickle=True)
        labels = labels.astype(np.longlong).squeeze()
        mode = {1: "L", 3: "RGB"}[channels]
        items = [(transform(Image.fromarray(images[i], mode=mode)), labels[i]) for i in range(len(labels))]
    x = torch.stack([a for a, _ in items]).numpy()
    y = np.asarray([int(b) for _, b in items], dtype=np.int64)
    return x, y


def check_export(meta: dict, out: Path, tensors: dict, dataset_cls=None) -> None:
    """Every client, both splits: the export read back equals fedrepro's tensors."""
    for cid, info in meta["clients"].items():
        for split in ("train", "test"):
            x, y = read_reference_client(out / f"client{cid}", info["channels"], meta["mean"], meta["std"],
                                         split == "train", dataset_cls)
            fx, fy = tensors[int(cid)][split]
            if not (np.array_equal(y, fy) and x.shape == fx.shape and np.allclose(x, fx, rtol=0, atol=1e-6)):
                raise SystemExit(f"export check failed: client {cid} {split}: max |diff| "
                                 f"{np.abs(x - fx).max() if x.shape == fx.shape else 'shape ' + str(x.shape)}")


# --------------------------------------------------------------------------------------------
# The reference's server inside fedrepro's engine
# --------------------------------------------------------------------------------------------


def ref_name(key: str) -> str:
    """fedrepro parameter name -> a buffer name the reference's key filters select (shim 1)."""
    return key.replace("gc_net", "meta_net").replace(".", "__")


def holder(params: dict):
    """An nn.Module whose state_dict() holds `params` (float entries, renamed; shim 1)."""
    import torch

    m = torch.nn.Module()
    for k, v in params.items():
        if v.is_floating_point():
            m.register_buffer(ref_name(k), v.detach().clone())
    return m


def read_back(m, names: list[str]) -> dict:
    state = m.state_dict()
    return {k: state[ref_name(k)].clone() for k in names}


def ref_args(mode: str, seed: int, num_types: int) -> pytypes.SimpleNamespace:
    """The fields communication() and write_log() read, at train.py's defaults (shim 3)."""
    return pytypes.SimpleNamespace(mode=mode, q=1.0, beta=0.5, cluster="gmm", distinct=False, dataset="digit",
                                   expname="uneven", ratio=1.5, seed=seed, cluster_num=num_types, shuffle=False,
                                   moon=False, split_test=False, w_con=0.1, clscon=False)


def pad(reps, width: int = REF_WIDTH):
    """(K, d) -> (K, 768) with zeros (shim 2)."""
    import torch

    if reps.shape[1] > width:
        raise SystemExit(f"client representations of width {reps.shape[1]} > the code's {width}")
    return torch.cat([reps.float().cpu(), torch.zeros(len(reps), width - reps.shape[1])], 1)


_REGISTERED: list[bool] = []


def register_reference_methods(util) -> None:
    """Register two fedrepro methods whose aggregate() is the reference's communication()."""
    import torch

    from fedrepro.methods import register
    from fedrepro.methods._fair import LOSS_AT, LossWeighted
    from fedrepro.methods._fedgr import cluster_purity
    from fedrepro.methods.fedgcr import FedGCR
    from fedrepro.registry import Param

    if _REGISTERED:
        return
    _REGISTERED.append(True)

    def call(method, updates, all_feat=None, all_pi=None, eas=None):
        engine = method.engine
        r = engine.round
        names = [k for k, v in updates[0].params.items() if v.is_floating_point()]
        server_model = holder({k: method.server["global"][k] for k in names})
        models = [holder(u.params) for u in updates]
        sizes = [float(u.num_samples) for u in updates]
        client_weights = [n / sum(sizes) for n in sizes]
        losses = [float(u.extras["loss"]) for u in updates]
        num_types = len({c.client_type for c in engine.clients})
        args = ref_args(method.hp["ref_mode"], engine.seed, num_types)
        if method.hp["ref_mode"] in ("fedgcr", "ablation", "only_dcnet") and r == 1:
            np.random.seed(engine.seed % 2**32)  # shim 5
        eas = eas if eas is not None else [100] * len(updates)
        out = util.communication(args, 0, server_model, models, client_weights, int(sum(sizes)), len(updates), num_types,
                                 eas, losses, r - 1, [f"client{u.client_id}" for u in updates], all_feat, all_pi, None)
        server_model, _, _, gmap, cluster_pis = out
        method.server["global"] = {**method.server["global"], **read_back(server_model, names)}
        return gmap, cluster_pis

    @register
    class RefServerFair(LossWeighted):
        name = "ref_server_fair"
        summary = "benchmarks/parity_fedgcr.py: fedrepro's local training, the FedGCR code's server (fedavg/term/afl/q-ffl)"
        hparams = {"ref_mode": Param("fedavg", "the reference's --mode", str), "loss_at": LOSS_AT}

        def aggregate(self, updates):
            if updates:
                call(self, updates)

    from torch.utils.data import DataLoader, TensorDataset

    from fedrepro.methods.base import Update
    from fedrepro.methods.harmofl import HarmoFL
    from fedrepro.models.prompted_vit import AMPLITUDE_KEY, mean_amplitude

    def ref_fit(method, client, mode: str) -> float:
        """One local epoch of the code's client function for `mode` on fedrepro's model (shim 6)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from utils.sam import SAM
        from utils.weight_perturbation import WPOptim

        engine = method.engine
        model = engine.model
        cfg = engine.training["optimizer"]
        base, kw = torch.optim.AdamW, {"lr": engine.lr, "weight_decay": cfg["weight_decay"]}
        params = [p for p in model.parameters() if p.requires_grad]
        g = engine.generator("ref-client-batches", engine.round, client.id)
        loader = DataLoader(TensorDataset(client.train.x, client.train.y), batch_size=engine.training["batch_size"],
                            shuffle=True, generator=g)
        loss_fun = torch.nn.CrossEntropyLoss()
        device = engine.device
        if mode == "fedsam":
            loss, _ = util.train_fedsam(model, loader, SAM(params, base_optimizer=base, **kw), loss_fun, device)
        elif mode == "harmo-fl":
            loss, _ = util.train_harmofl(ref_args(mode, engine.seed, 0), model, loader,
                                         WPOptim(params=params, base_optimizer=base, alpha=0.05, **kw), loss_fun, device)
        else:  # fedmix: the double backward through attention needs the math kernel
            xg, yg = method.server["ref_pool"]
            with sdpa_kernel(SDPBackend.MATH):
                loss, _ = util.train_fedmix(model, xg, yg, 0.05, loader, base(params, **kw), loss_fun, device)
        return float(loss)

    @register
    class RefClient(LossWeighted):
        name = "ref_client"
        summary = "benchmarks/parity_fedgcr.py: the FedGCR code's client step (FedSAM / FedMix), fedrepro's FedAvg server"
        hparams = {"ref_mode": Param("fedsam", "the reference's --mode", str), "loss_at": LOSS_AT}

        def setup(self):
            super().setup()
            if self.hp["ref_mode"] == "fedmix":  # train.py:265-266, before round 1, from every client's train loader
                engine = self.engine
                loaders = [DataLoader(TensorDataset(c.train.x, c.train.y), batch_size=engine.training["batch_size"],
                                      shuffle=True, generator=engine.generator("ref-fedmix-pool", c.id))
                           for c in engine.clients]
                args = pytypes.SimpleNamespace(num_classes=engine.num_classes)
                self.server["ref_pool"] = self.ref_smash(args, loaders)

        @staticmethod
        def ref_smash(args, loaders):
            from utils.aggregate import agg_smash_data

            return agg_smash_data(args, None, loaders)

        def local_update(self, client, payload):
            self.engine.set_params(payload)
            loss = ref_fit(self, client, self.hp["ref_mode"])
            return Update(client.id, client.num_train, self.engine.get_params(self.shared), extras={"loss": loss}, loss=loss)

        def aggregate(self, updates):
            from fedrepro.methods.base import weighted_average

            if updates:
                self.server["global"] = {**self.server["global"], **weighted_average(updates)}

    @register
    class RefClientHarmoFL(HarmoFL):
        name = "ref_client_harmofl"
        summary = "benchmarks/parity_fedgcr.py: the FedGCR code's HarmoFL client step (WPOptim), fedrepro's amplitude and server"
        hparams = {**HarmoFL.hparams, "ref_mode": Param("harmo-fl", "the reference's --mode", str)}

        def local_update(self, client, payload):  # HarmoFL.local_update with the code's client step
            engine = self.engine
            engine.set_params(payload)
            first = engine.round <= 1
            if first:
                engine.set_params({AMPLITUDE_KEY: mean_amplitude(client.train.x)})
            else:
                if AMPLITUDE_KEY in payload:
                    client.state["amplitude"] = payload[AMPLITUDE_KEY].clone()
                engine.set_params({AMPLITUDE_KEY: client.state["amplitude"]})
            loss = ref_fit(self, client, "harmo-fl")
            params = engine.get_params(self.shared)
            if not first:
                params.pop(AMPLITUDE_KEY, None)
            return Update(client.id, client.num_train, params, loss=loss)

    @register
    class RefServerGCR(FedGCR):
        name = "ref_server_gcr"
        summary = "benchmarks/parity_fedgcr.py: fedrepro's FedGCR clients, the FedGCR code's server"
        hparams = {**FedGCR.hparams, "ref_mode": Param("fedgcr", "the reference's --mode", str)}

        def aggregate(self, updates):
            if not updates:
                return
            engine = self.engine
            reps = torch.stack([u.extras["rep"] for u in updates])
            # shim 4: Eas = 100 in round 1, then int(100 / L_k) of the received model's train loss
            eas = [100] * len(updates) if engine.round == 1 else [int(100 / float(u.extras["loss"])) for u in updates]
            padded = pad(reps)
            gmap, cluster_pis = call(self, updates, all_feat=padded, all_pi=padded, eas=eas)
            labels = [int(gmap[i]) for i in range(len(updates))]
            if cluster_pis is not None:  # fedgcr / only_dcnet: the centres of l_GC, cut back to d
                self.server["centres"] = cluster_pis[:, : reps.shape[1]].to(reps)
            else:  # ablation (FedGR only): no l_GC; centres unused
                self.server["centres"] = torch.zeros(max(labels) + 1, reps.shape[1])
            self.server["group_of"] = {u.client_id: g for u, g in zip(updates, labels)}
            types = [engine.client(u.client_id).client_type for u in updates]
            if None not in types:
                self.server["cluster_acc"].append([engine.round, cluster_purity(labels, types)])


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def base_config(rounds: int, seeds: list[int]) -> dict:
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg.pop("paper_tables", None)
    cfg["experiment"] = "parity_fedgcr"
    cfg["training"] = {**cfg["training"], "rounds": rounds, "eval_every": rounds, "checkpoint_every": 10**6}
    cfg["seeds"] = seeds
    return cfg


def runs_of(rows: list[Row]) -> list[tuple[str, Row, str, dict]]:
    """(side, row, method, hparams) for every run: F, F/code (where code options exist), R."""
    out = []
    for r in rows:
        out.append(("F", r, r.method, dict(r.hparams)))
        if r.code is not None:
            out.append(("F/code", r, r.method, {**dict(r.hparams), **dict(r.code)}))
        if r.mode in ("fedsam", "harmo-fl", "fedmix"):
            ref_method = "ref_client_harmofl" if r.mode == "harmo-fl" else "ref_client"
            ref_hp = {**({"amplitude": "dc"} if r.mode == "harmo-fl" else {}), "ref_mode": r.mode}
            out.append(("R", r, ref_method, ref_hp))
            continue
        ref_method = "ref_server_gcr" if r.method == "fedgcr" else "ref_server_fair"
        ref_hp = {**dict(r.hparams), **dict(r.code or {}), "ref_mode": r.mode}
        if ref_method == "ref_server_fair":
            ref_hp = {"ref_mode": r.mode, "loss_at": dict(r.code or {}).get("loss_at", "train")}
        out.append(("R", r, ref_method, ref_hp))
    return out


def run_cell(cell: dict, manifest: dict, shards: list) -> dict:
    import torch

    from fedrepro.engine.data import load_clients
    from fedrepro.engine.engine import Engine
    from fedrepro.engine.run import set_determinism

    set_determinism(cell["training"]["deterministic"])
    clients = load_clients(manifest, shards, torch.device("cpu"))
    t0 = time.perf_counter()
    metrics = Engine(cell, manifest, clients, torch.device("cpu"), progress=False).run()
    wall = time.perf_counter() - t0
    res = metrics["resources"]
    types = metrics["summary"].get("global_types", {})
    return {"avg": types.get("avg"), "sigma_type": types.get("sigma_type"), "sigma_client": types.get("sigma_client"),
            "acc": metrics["summary"]["global_acc"]["weighted_mean"],
            "cluster_acc": (metrics.get("method") or {}).get("cluster_acc"),
            "s_per_round": (res["train_time_s"] + res["eval_time_s"]) / cell["training"]["rounds"], "wall_s": wall,
            "status": metrics["status"]}


METRICS = ("avg", "sigma_type", "sigma_client", "acc", "cluster_acc")
LABELS = {"avg": "Avg", "sigma_type": "σ_type", "sigma_client": "σ_client", "acc": "acc", "cluster_acc": "cluster acc"}


def table(rows: list[Row], results: dict, args) -> str:
    lines = [f"fedgcr_cpu data (shifted_domains, DIF 5, 13 clients of 5 types), {args.rounds} rounds, seeds "
             f"{' '.join(map(str, args.seeds))}; % after the last round, mean ± sample std over seeds; F = fedrepro "
             "(paper defaults), F/code = fedrepro with the code's options, R = the reference's server (utils/util.py "
             "communication) on F/code's clients, or for FedSAM, HarmoFL, FedMix the reference's client step "
             "(train_fedsam / train_harmofl / train_fedmix) with fedrepro's FedAvg server; flag ≠ (R vs F/code, on Avg and acc): |diff| > max(2 × larger "
             "std, 1 pp); s/round: fedrepro's clock on each side.\n"]
    head = "| method | side | hparams | Avg | σ_type | σ_client | acc | cluster acc | s/round | R − F/code (Avg, acc) | flag |"
    lines += [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        sides = [(s, m, hp) for s, rr, m, hp in runs_of([r])]
        stats = {}
        for side, method, hp in sides:
            recs = [results.get((side, r.name, s)) for s in args.seeds]
            recs = [x for x in recs if x]
            stats[side] = {m: mean_std([x[m] for x in recs if x.get(m) is not None]) for m in METRICS + ("s_per_round",)}
            stats[side]["n"] = len(recs)
        pair = "F/code" if "F/code" in stats else "F"
        for side, method, hp in sides:
            st = stats[side]
            if st["n"] == 0:
                continue
            cells = []
            for m in METRICS:
                mu, sd = st[m]
                cells.append("–" if math.isnan(mu) else f"{100 * mu:.2f} ± {100 * sd:.2f}")
            hp_txt = " ".join(f"{k}={v}" for k, v in sorted(hp.items()) if k != "ref_mode") or "-"
            if side == "R":
                client_row = r.mode in ("fedsam", "harmo-fl", "fedmix")
                hp_txt = (f"mode={hp['ref_mode']}; the code's client step, server and amplitude as {pair}" if client_row
                          else f"mode={hp['ref_mode']}; clients as {pair}")
            diff_txt, fl = "", ""
            if side == "R":
                d = [st[m][0] - stats[pair][m][0] for m in ("avg", "acc")]
                fl = "".join(sorted({flag(d[i], st[m][1], stats[pair][m][1]) for i, m in enumerate(("avg", "acc"))}))
                diff_txt = ", ".join("n/a" if math.isnan(x) else f"{100 * x:+.2f}" for x in d)
            spr = st["s_per_round"][0]
            lines.append(f"| {r.name} | {side} | {hp_txt} | " + " | ".join(cells)
                         + f" | {'n/a' if math.isnan(spr) else f'{spr:.2f}'} | {diff_txt} | {fl} |")
    return "\n".join(lines) + "\n"


def stage_reference(checkout: Path, work: Path) -> Path:
    """Copy the checkout's utils/, domainbed/, federated/ unchanged to <work>/fedgcr (recopied when
    the sources change); returns the copy's federated/ (the working directory of train.py)."""
    h = hashlib.sha256()
    for p in sorted(checkout.rglob("*.py")):
        h.update(str(p.relative_to(checkout)).encode())
        h.update(p.read_bytes())
    digest = h.hexdigest()[:12]
    dst = work / "fedgcr"
    stamp = work / "fedgcr.sha"
    if not stamp.exists() or stamp.read_text().strip() != digest:
        shutil.rmtree(dst, ignore_errors=True)
        for sub in ("utils", "domainbed", "federated"):
            shutil.copytree(checkout / sub, dst / sub, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.o"))
        stamp.write_text(digest + "\n")
    return dst / "federated"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fedgcr", type=Path, required=True, help="a celinezheng/fedgcr checkout (only read)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fedrepro-parity-fedgcr"))
    ap.add_argument("--methods", nargs="+", default=None, help="rows: " + ", ".join(r.name for r in ROWS + CLIENT_ROWS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sides", nargs="+", default=["F", "F/code", "R"], choices=("F", "F/code", "R"),
                    help="sides to run (F of a row without code options always runs: it is R's pair); F's cells are "
                         "fedgcr_cpu's own cells, so `--sides F/code R` with fedgcr_cpu's results saves a third")
    ap.add_argument("--rerun", action="store_true", help="recompute cached runs")
    args = ap.parse_args(argv)
    args.work = args.work.resolve()
    every = ROWS + CLIENT_ROWS
    rows = [r for r in every if not args.methods or r.name.lower() in {m.lower() for m in args.methods}]
    if args.methods and len(rows) != len(args.methods):
        ap.error(f"unknown --methods; rows: {', '.join(r.name for r in every)}")

    import torch

    torch.set_num_threads(1)
    os.chdir(REPO)  # the config's results/pretrained path is relative to the repository
    fed_dir = stage_reference(args.fedgcr.resolve(), args.work)
    sys.path.insert(0, str(fed_dir.parent))
    import utils.util as util  # the reference, unchanged
    from utils.data_utils import DigitsDataset

    register_reference_methods(util)
    from fedrepro.config import resolve_experiment
    from fedrepro.data.shards import load_partition

    cfg = base_config(args.rounds, args.seeds)
    cfg["methods"] = {}
    labels = {}
    for side, r, method, hp in runs_of(rows):
        if side not in args.sides and not (side == "F" and r.code is None):  # F is FedAvg's only pair
            continue
        label = f"{side}_{r.name}".replace("/", "_").replace(" ", "_").replace("-", "").lower()
        cfg["methods"][label] = {"method": method, "hparams": hp}
        labels[label] = (side, r)
    exp = resolve_experiment(cfg)
    part = exp["partitions"][0]
    shard_dir = REPO / "results" / "shards" / part["dataset"] / part["id"]
    if not (shard_dir / "manifest.json").exists():
        raise SystemExit(f"no shards at {shard_dir}: run fedgcr_cpu's partition first "
                         f"(snakemake --cores 2 --configfile {CONFIG.relative_to(REPO)} {shard_dir.relative_to(REPO)}/manifest.json)")
    manifest, shards = load_partition(shard_dir)
    export = args.work / "data" / part["id"]
    meta = export_reference(manifest, shards, export)
    check_export(meta, export, client_tensors(manifest, shards), DigitsDataset)
    print(f"[parity] export of {len(shards)} clients in {export}: read back through the reference's DigitsDataset, "
          "equal to fedrepro's tensors", file=sys.stderr)

    results = {}
    for cell in exp["cells"]:  # the proxy backbone's path is relative to the repository; the runs work in fed_dir
        w = cell["model"]["params"].get("weights")
        if isinstance(w, str) and w.endswith((".pt", ".pth", ".safetensors")) and not os.path.isabs(w):
            cell["model"]["params"]["weights"] = str(REPO / w)
    os.chdir(fed_dir)  # write_log's ../logs/ lands in the work dir
    for cell in exp["cells"]:
        side, r = labels[cell["label"]]
        c0 = copy.deepcopy(cell)
        c0.pop("seed")
        path = args.work / "cache" / f"{cell['label']}__{key_of(c0)}__seed{cell['seed']}.json"
        if path.exists() and not args.rerun:
            results[(side, r.name, cell["seed"])] = read_json(path, "cached result")
            continue
        print(f"[parity] {side} {r.name} seed {cell['seed']}", file=sys.stderr)
        old = sys.stdout
        sys.stdout = open(os.devnull, "w")  # the reference prints every key it aggregates
        try:
            rec = run_cell(cell, manifest, shards)
        finally:
            sys.stdout.close()
            sys.stdout = old
        rec.update(side=side, row=r.name, seed=cell["seed"], method=cell["method"], hparams=cell["hparams"])
        write_json(path, rec)
        results[(side, r.name, cell["seed"])] = rec
        print(f"[parity]   Avg {rec['avg']:.4f} acc {rec['acc']:.4f} {rec['s_per_round']:.2f} s/round", file=sys.stderr)
    os.chdir(REPO)
    md = table(rows, results, args)
    out = args.work / f"parity_fedgcr_r{args.rounds}.md"
    out.write_text(md)
    write_json(out.with_suffix(".json"), {"rows": [r.name for r in rows], "runs": list(results.values())})
    print(md)
    print(f"[parity] table: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
