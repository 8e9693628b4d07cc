"""FedGH (Yi, Wang, Liu, Shi, Yu, "FedGH: Heterogeneous Federated Learning with
Generalized Global Header", ACM MM 2023).

Algorithm, per round:
  1. each sampled client replaces its head with the global head (the "generalized global
     header") and trains its whole model (kept in client.state) on CE for `local_epochs`;
  2. it uploads its class prototypes (mean representation of each class it has, eval mode);
  3. the server trains the global head, a Linear(d, C), on the round's (prototype, label)
     pairs by SGD on CE (`server_epochs` passes, lr `server_lr`) and keeps it for the next round.
Extractors never leave the clients; only prototypes go up and only the head comes down.

Choices (../shared/reference/methods.md §6; PFLlib servergh/clientgh):
* Server SGD: lr 1.0 (PFLlib server_learning_rate), plain SGD (no momentum), one pass over
  the pairs in a seeded shuffled order, mini-batches of `server_batch_size` [RECON]: neither
  the spec nor the paper fixes it; PFLlib's DataLoader uses the clients' batch size (the
  default here, null = the cell's batch_size); the paper's update, as we read it, is written
  per (prototype, label) pair, i.e. `server_batch_size: 1`.
* Personalized model = the client's extractor + its head after local training
  (`personal_head: local`); PFLlib evaluates after sending the new global head to every
  client, i.e. the client's extractor + the global head (`personal_head: global`).
* No global model exists (extractors are private and never averaged, and the global head
  has no extractor of its own): has_global = False.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Param
from . import register
from ._prototypes import local_prototypes, require_linear_head
from .base import FORWARD_SHARE, Method, Params, Passes, Update


def train_head(head: Params, protos: torch.Tensor, labels: torch.Tensor, *, lr: float, epochs: int, batch_size: int,
               generator: torch.Generator) -> Params:
    """The server step: plain SGD on mean CE(protos @ W^T + b, labels) over shuffled
    mini-batches; returns the new {"head.weight", "head.bias"}."""
    w = head["head.weight"].detach().clone()
    b = head["head.bias"].detach().clone()
    n = len(labels)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).to(labels.device)
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            with torch.enable_grad():
                w.requires_grad_(True)
                b.requires_grad_(True)
                loss = F.cross_entropy(F.linear(protos[idx], w, b), labels[idx])
                gw, gb = torch.autograd.grad(loss, (w, b))
            w, b = (w.detach() - lr * gw), (b.detach() - lr * gb)
    return {"head.weight": w, "head.bias": b}


@register
class FedGH(Method):
    name = "fedgh"
    summary = "FedGH: private full models; the server trains a global head on the clients' class prototypes"
    paper = "Yi et al., ACM MM 2023"
    hparams = {
        "server_lr": Param(1.0, "SGD learning rate of the server's head training (PFLlib server_learning_rate: 1.0)",
                           float, exclusive_minimum=0),
        "server_epochs": Param(1, "passes over the round's (prototype, label) pairs (PFLlib: 1)", int, minimum=1),
        "server_batch_size": Param(None, "[RECON] mini-batch of the server's head SGD; null = the cell's batch_size "
                                         "(PFLlib); the paper's per-pair update is 1 (fedgh.py docstring)",
                                   (int, type(None)), minimum=1),
        "personal_head": Param("local", "head of the personalized model: 'local' = the client's head after local "
                                        "training; 'global' = the current global head (PFLlib's evaluation)",
                               str, choices=("local", "global")),
    }
    shared = ("head.",)  # the global head comes down; prototypes (not parameters) go up
    has_global = False
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # after the local epochs, one forward over the train split for the uploaded prototypes
        return Passes(1 + FORWARD_SHARE / training["local_epochs"])

    def setup(self):
        require_linear_head(self.engine, self.name)
        self.server["init"] = self.engine.get_params()  # every client's model starts here
        self.server["head"] = self.engine.get_params(("head.",))

    def broadcast(self, client):
        return {"head": self.server["head"]}

    def local_update(self, client, payload):
        eng = self.engine
        eng.set_params({**client.state.get("model", self.server["init"]), **payload["head"]})
        fit = eng.fit(client)
        client.state["model"] = eng.get_params()
        return Update(client.id, client.num_train, extras=local_prototypes(eng, client), loss=fit.loss)

    def aggregate(self, updates):
        if not updates:
            return
        protos = torch.cat([u.extras["protos"] for u in updates])
        labels = torch.cat([u.extras["classes"] for u in updates])
        self.server["head"] = train_head(
            self.server["head"], protos, labels, lr=self.hp["server_lr"], epochs=self.hp["server_epochs"],
            batch_size=self.hp["server_batch_size"] or self.engine.training["batch_size"],
            generator=self.engine.generator("fedgh-server-head", self.engine.round),
        )

    def personal_params(self, client):
        model = client.state.get("model", self.server["init"])
        return {**model, **self.server["head"]} if self.hp["personal_head"] == "global" else model
