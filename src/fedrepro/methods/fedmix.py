"""FedMix (Yoon, Shin, Hwang, Yang, "FedMix: Approximation of Mixup under Mean Augmented
Federated Learning", ICLR 2021), a domain-FL baseline of FedGCR (methods.md §5.5, §6).

Mean-augmented data: each client averages its train samples in groups of `mean_batch` (images
and one-hot labels) and shares these means X̄, Ȳ; the server pools everyone's. Local loss on a
batch (x, y) with a random pooled pair (x̄, ȳ) per sample (the first-order approximation of mixup
with the global means, Eq. 5 of the paper):

    (1 - lam) CE(f((1 - lam) x), y) + lam CE(f((1 - lam) x), ȳ) + lam <d l_i / d x_i, x̄>,

l_i the first CE of sample i and the input gradient taken at (1 - lam) x (create_graph, so it is
trained through). lam = 0.05 (the fedgcr code). The server averages the models as FedAvg.

Choices: the means are uploaded once, in round 1 (extras, so their bytes count), and used from
round 2 on (round 1 trains on CE); `mean_batch` [RECON] (the paper's M_k mean size is a
hyper-parameter; the fedgcr code averages pairs of batches) defaults to 5; a client draws from the
whole pool, its own means included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..registry import Param
from . import register
from .base import Update
from .fedavg import FedAvg


def mean_augmented(x: torch.Tensor, y: torch.Tensor, num_classes: int, mean_batch: int,
                   g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(X̄, Ȳ): means of consecutive groups of `mean_batch` samples in a seeded order (a smaller last group
    is dropped unless it is the only one)."""
    perm = torch.randperm(len(y), generator=g).to(x.device)
    n = max(len(y) // mean_batch, 1) * mean_batch if len(y) >= mean_batch else len(y)
    idx = perm[:n]
    groups = max(n // mean_batch, 1)
    xs = x[idx].reshape(groups, -1, *x.shape[1:]).mean(1)
    ys = F.one_hot(y[idx], num_classes).float().reshape(groups, -1, num_classes).mean(1)
    return xs, ys


def fedmix_loss(model, x: torch.Tensor, y: torch.Tensor, x_mean: torch.Tensor, y_mean: torch.Tensor,
                lam: float) -> torch.Tensor:
    """FedMix's approximated mixup loss (Eq. 5) on one batch."""
    xs = ((1 - lam) * x).detach().requires_grad_(True)
    logits = model(xs)
    per_sample = F.cross_entropy(logits, y, reduction="none")
    grad = torch.autograd.grad(per_sample.sum(), xs, create_graph=True)[0]  # d l_i / d x_i
    soft = -(y_mean * F.log_softmax(logits, 1)).sum(1)
    taylor = (grad.flatten(1) * x_mean.flatten(1)).sum(1)
    return ((1 - lam) * per_sample + lam * soft + lam * taylor).mean()


@register
class FedMix(FedAvg):
    name = "fedmix"
    summary = "FedMix: local loss approximating mixup with the clients' shared mean-augmented data, FedAvg"
    paper = "Yoon, Shin, Hwang, Yang, ICLR 2021"
    hparams = {
        "lam": Param(0.05, "mixup weight lambda (the fedgcr code: 0.05)", float, minimum=0, maximum=1),
        "mean_batch": Param(5, "[RECON] samples averaged into one shared mean (image, label)", int, minimum=1,
                            maximum=100_000),
    }
    cost_passes = 2.0  # about: a second backward through the input gradient (double backward) after round 1

    def local_update(self, client, payload):
        engine = self.engine
        engine.set_params(payload)
        pool = self.server.get("pool")
        if pool is None:  # round 1: CE, and the client's means go up with its model
            fit = engine.fit(client)
            update = Update(client.id, client.num_train, engine.get_params(self.shared), loss=fit.loss)
            update.extras["means"] = mean_augmented(client.train.x, client.train.y, engine.num_classes,
                                                    self.hp["mean_batch"], engine.generator("fedmix-means", client.id))
            return update
        model, lam = engine.model, self.hp["lam"]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = engine.optimizer(params)
        model.train()
        g = engine.generator("fedmix-draw", engine.round, client.id)
        pool_x, pool_y = pool
        total, seen = torch.zeros((), device=engine.device), 0
        for x, y in engine.batches(client):
            pick = torch.randint(len(pool_y), (len(y),), generator=g).to(pool_y.device)
            with sdpa_kernel(SDPBackend.MATH):  # the input gradient is trained through: fused attention has no double backward
                loss = fedmix_loss(model, x, y, pool_x[pick], pool_y[pick], lam)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * len(y)
            seen += len(y)
        return Update(client.id, client.num_train, engine.get_params(self.shared), loss=float(total) / max(seen, 1))

    def aggregate(self, updates):
        means = [u.extras.pop("means") for u in updates if "means" in u.extras]
        if means and self.server.get("pool") is None:
            self.server["pool"] = (torch.cat([m[0] for m in means]), torch.cat([m[1] for m in means]))
        super().aggregate(updates)
