"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020), Algorithm 1.

Each sampled client starts from the global model w and, per group of independent batches
D1, D2 (, D3), takes the MAML step on F(w) = f(w - alpha grad f(w)):
  temporary   w' = w - alpha * grad f(w; D1)
  FO          w <- w - beta * grad f(w'; D2)
  HF          w <- w - beta * (I - alpha * H(w; D3)) grad f(w'; D2)
and uploads w; the server averages (FedAvg). The personalized model (personal column) is
the global model after one adaptation step w - alpha * grad f(w; D) on a batch of the
client's own train split; the global column is the global model itself.

Choices: H(w; D3) v is the exact Hessian-vector product by double back-propagation (the
paper's HF variant estimates it by finite differences, which approximate the same
quantity). Like PFLlib, each group of batches is one drawn batch of 2 (FO) or 3 (HF) times
the configured batch size, split into equal parts. The steps are plain SGD with alpha and
beta (the paper's updates): the configured optimizer is not used.

Step sizes: alpha and beta default to the round's learning rate, as PFLlib
(clientperavg.py: `self.beta = self.learning_rate` and PerAvgOptimizer(lr=learning_rate), so
alpha = beta = lr). A fixed small beta (Plato / FL-bench 1e-3) is far below the learning
rates the benchmark's cells use (0.005-0.05), and the global model then barely moves: the
personalized score becomes each client's majority class after one alpha step. Like PFLlib
(serverperavg.evaluate_one_step -> clientperavg.train_one_step), the evaluated model is
adapted on a batch of the client's *training* data. PFLlib's server also trains every selected client twice
per round (serverperavg.py: client.train() then a second pass); here a round is the configured
local_epochs (set local_epochs: 2 to match it, as benchmarks/parity_pfllib.py does).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from . import register
from ..registry import Param
from .base import Passes, Update
from .fedavg import FedAvg

Batch = tuple[torch.Tensor, torch.Tensor]


def loss_and_grads(model: torch.nn.Module, params: list[torch.Tensor], batch: Batch, create_graph: bool = False):
    loss = F.cross_entropy(model(batch[0]), batch[1])
    return loss, torch.autograd.grad(loss, params, create_graph=create_graph)


def sgd_step(model: torch.nn.Module, params: list[torch.Tensor], batch: Batch, lr: float,
             scratch: list[torch.Tensor] | None = None) -> torch.Tensor:
    """w <- w - lr * grad f(w; batch) in place; returns f(w; batch). `scratch`: buffers like
    `params` for lr * grad (no parameter-sized temporary per step; docs/throughput.md)."""
    loss, grads = loss_and_grads(model, params, batch)
    with torch.no_grad():
        for p, g, d in zip(params, grads, scratch if scratch is not None else map(torch.empty_like, params)):
            p.sub_(torch.mul(g, lr, out=d))
    return loss.detach()


def hessian_vector_product(model: torch.nn.Module, params: list[torch.Tensor], batch: Batch,
                           vector: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """H(w; batch) @ vector by double back-propagation (exact, no finite-difference step)."""
    _, grads = loss_and_grads(model, params, batch, create_graph=True)
    return torch.autograd.grad(grads, params, grad_outputs=list(vector))


def meta_step(model: torch.nn.Module, batches: Sequence[Batch], alpha: float, beta: float, hessian_free: bool,
              scratch: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> torch.Tensor:
    """One Per-FedAvg update of the model's parameters in place (FO: 2 batches, HF: 3).
    Returns the loss of w on D1. `scratch` (`meta_scratch`): two lists of buffers like the
    parameters (w's copy, the step), made once per local update instead of every step."""
    params = [p for p in model.parameters() if p.requires_grad]
    w, step = scratch if scratch is not None else meta_scratch(params)
    with torch.no_grad():
        torch._foreach_copy_(w, params)
    loss = sgd_step(model, params, batches[0], alpha, step)  # the temporary model w' = w - alpha grad f(w; D1)
    _, meta_grads = loss_and_grads(model, params, batches[1])  # grad f(w'; D2)
    with torch.no_grad():
        torch._foreach_copy_(params, w)
    if hessian_free:  # the second-order correction at w: (I - alpha H(w; D3)) grad f(w'; D2)
        hv = hessian_vector_product(model, params, batches[2], meta_grads)
        meta_grads = [g - alpha * h for g, h in zip(meta_grads, hv)]
    with torch.no_grad():
        for p, g, d in zip(params, meta_grads, step):
            p.sub_(torch.mul(g, beta, out=d))
    return loss


def meta_scratch(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The buffers of `meta_step`: a copy of w and the step, one of each per parameter."""
    return [torch.empty_like(p) for p in params], [torch.empty_like(p) for p in params]


@register
class PerFedAvg(FedAvg):
    name = "perfedavg"
    summary = "Per-FedAvg: MAML-style local steps (FO or Hessian-free); personalized = global + one alpha step"
    paper = "Fallah, Mokhtari, Ozdaglar, NeurIPS 2020"
    hparams = {
        "alpha": Param(None, "alpha: step size of the temporary / adaptation step; null = the round's learning rate "
                             "(PFLlib clientperavg.py; Plato uses 0.01)", (float, type(None)), exclusive_minimum=0),
        "beta": Param(None, "beta: meta step size applied to w; null = the round's learning rate (PFLlib "
                            "clientperavg.py: beta = learning_rate; Plato, FL-bench 1e-3)", (float, type(None)),
                      exclusive_minimum=0),
        "variant": Param("fo", "'fo': first-order MAML gradient; 'hf': Hessian-free with the exact Hessian-vector product",
                         str, choices=("fo", "hf")),
    }
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # 'fo': two half-batches, a step each (FedAvg's samples per step); 'hf': three thirds and a
        # Hessian-vector product on the last (about one step more). The one-step personalization is left out.
        return Passes(4 / 3 if hp["variant"] == "hf" else 1.0)

    def local_update(self, client, payload):
        engine, model = self.engine, self.engine.model
        engine.set_params(payload)
        model.train()
        parts = 3 if self.hp["variant"] == "hf" else 2
        total, seen = torch.zeros((), device=engine.device), 0
        scratch = meta_scratch([p for p in model.parameters() if p.requires_grad])
        for x, y in engine.batches(client, batch_size=parts * engine.training["batch_size"]):
            if len(y) < parts:  # a last batch too small to split
                continue
            batches = list(zip(x.tensor_split(parts), y.tensor_split(parts)))
            loss = meta_step(model, batches, self.step("alpha"), self.step("beta"), self.hp["variant"] == "hf", scratch)
            total += loss * len(batches[0][1])
            seen += len(batches[0][1])
        return Update(client.id, client.num_train, engine.get_params(self.shared), loss=float(total) / max(seen, 1))

    def personal_params(self, client):
        """The global model after one alpha step on a batch of the client's train split,
        drawn from its own seeded stream (evaluation never changes training)."""
        engine, model = self.engine, self.engine.model
        data = client.train
        g = engine.generator("perfedavg-adapt", engine.round, client.id)
        idx = torch.randperm(len(data), generator=g)[: engine.training["batch_size"]].to(engine.device)
        x = data.x[idx] if engine.augment is None else engine.augment(data.x[idx], g)
        engine.set_params(self.server["global"])
        model.train()
        sgd_step(model, [p for p in model.parameters() if p.requires_grad], (x, data.y[idx]), self.step("alpha"))
        return engine.get_params()

    def step(self, name: str) -> float:
        """alpha or beta: the configured value, or the round's learning rate where it is null."""
        return self.engine.lr if self.hp[name] is None else self.hp[name]
