"""pFedMe (T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020), Algorithm 1.

Each sampled client sets its local model w <- w_global and, for every mini-batch D:
  1. K gradient steps (personal lr) approximately solve the Moreau-envelope problem
       theta~ = argmin_theta f(theta; D) + (lambda/2) ||theta - w||^2   (theta~ warm-started);
  2. w <- w - eta * lambda * (w - theta~)                                (eta: the round's lr).
It uploads w; the server mixes w_global <- (1 - beta) w_global + beta * avg_i(w_i)
(beta = 1 is plain averaging; the paper also uses beta = 2). The paper's avg is the plain
mean over the sampled clients, its reference code (and PFLlib, FL-bench) weights by n_i:
`weighting` offers both, the paper's by default. The personalized model is the
client's last theta~ (evaluated as in the paper); the global column is w_global.

Local rounds: the paper runs R local iterations of one mini-batch each; here, as in
PFLlib and FL-bench, `local_epochs` passes over the client's mini-batches. The inner
solver is plain gradient descent (no momentum), as in the paper and the reference code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register
from ..registry import Param
from .base import Passes, Update, weighted_average
from .fedavg import FedAvg


def pfedme_batch_step(model: torch.nn.Module, w: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, *,
                      K: int, lam: float, personal_lr: float, lr: float, mu: float = 0.0,
                      scratch: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None) -> torch.Tensor:
    """One pFedMe local iteration on the batch (x, y); the model's parameters are theta~.

    theta~ <- theta~ - personal_lr * (grad f(theta~) + lam (theta~ - w) + mu theta~), K times;
    then w <- w - lr * lam * (w - theta~), in place. Returns the loss of the first inner step.
    `scratch` (`pfedme_scratch`, made here if not given): buffers, so that the steps
    allocate nothing the size of the model: parameter-sized temporaries cost more than
    the arithmetic on the CPU (docs/throughput.md). Same operations in the same order as the
    formula, so the result is bit for bit the formula's.
    """
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    ws = [w[k] for k, _ in named]
    scratch = scratch if scratch is not None else pfedme_scratch(params, mu)
    first = None
    for _ in range(K):
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, w_k, g, (d, e) in zip(params, ws, grads, scratch):
                torch.sub(p, w_k, out=d).mul_(lam).add_(g)  # g + lam (theta~ - w)
                if mu:
                    d.add_(torch.mul(p, mu, out=e))  # + mu theta~
                p.sub_(d.mul_(personal_lr))
        first = loss.detach() if first is None else first
    with torch.no_grad():
        for p, w_k, (d, _) in zip(params, ws, scratch):
            w_k.sub_(torch.sub(w_k, p, out=d).mul_(lr * lam))
    return first


def pfedme_scratch(params: list[torch.Tensor], mu: float) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The buffers of `pfedme_batch_step`: per parameter, one for the step and (mu > 0) one for mu theta~."""
    return [(torch.empty_like(p), torch.empty_like(p) if mu else None) for p in params]


@register
class PFedMe(FedAvg):
    name = "pfedme"
    summary = "pFedMe: Moreau-envelope personalization theta~ (K inner steps) + beta-mixed server update"
    paper = "T. Dinh, Tran, Nguyen, NeurIPS 2020"
    hparams = {
        "lam": Param(15.0, "lambda: Moreau-envelope regularisation weight (FL-bench 15, the paper's MNIST value; PFLlib 1.0)",
                     float, exclusive_minimum=0),
        "K": Param(5, "inner gradient steps per mini-batch that approximate theta~ (paper, PFLlib, FL-bench)", int, minimum=1),
        "personal_lr": Param(0.01, "learning rate of the inner steps on theta~ (PFLlib, FL-bench)", float, exclusive_minimum=0),
        "beta": Param(1.0, "server mixing w <- (1 - beta) w + beta avg(w_i) (FL-bench 1; the paper uses 1 or 2)",
                      float, exclusive_minimum=0),
        # The reference code's pFedMeOptimizer adds mu * theta (an L2 term) to the inner gradient
        # (FL-bench mu 1e-3); the paper's objective has none, so the default follows the paper.
        "mu": Param(0.0, "L2 weight on theta~ in the inner steps (paper 0; reference code / FL-bench 1e-3)", float, minimum=0),
        "weighting": Param("uniform", "avg(w_i) over the sampled clients: 'uniform' (the paper's 1/S) or 'samples' "
                           "(n_i-weighted, the reference code, PFLlib, FL-bench)", str, choices=("uniform", "samples")),
    }
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        return Passes(hp["K"])  # K forward-backward passes of theta~ per mini-batch (w's step is elementwise)

    def local_update(self, client, payload):
        engine, model = self.engine, self.engine.model
        engine.set_params(payload)  # theta~ starts at the received global model
        w = {k: payload[k].clone() for k, _ in model.named_parameters()}  # the local model
        model.train()
        total, seen = torch.zeros((), device=engine.device), 0
        scratch = pfedme_scratch([p for p in model.parameters() if p.requires_grad], self.hp["mu"])
        for x, y in engine.batches(client):
            loss = pfedme_batch_step(model, w, x, y, K=self.hp["K"], lam=self.hp["lam"], personal_lr=self.hp["personal_lr"],
                                     lr=engine.lr, mu=self.hp["mu"], scratch=scratch)
            total += loss * len(y)
            seen += len(y)
        client.state["theta"] = engine.get_params()
        # Buffers (if any) travel with theta~'s; the parameters uploaded are the local w.
        return Update(client.id, client.num_train, {**engine.get_params(self.shared), **w}, loss=float(total) / max(seen, 1))

    def aggregate(self, updates):
        if self.hp["weighting"] == "uniform":
            updates = [Update(u.client_id, 1, u.params) for u in updates]
        old, avg = self.server["global"], weighted_average(updates)
        beta = self.hp["beta"]
        mixed = {k: (1 - beta) * old[k] + beta * v if v.is_floating_point() else v for k, v in avg.items()}
        self.server["global"] = {**old, **mixed}

    def personal_params(self, client):
        # A client never sampled has no theta~ yet: the global model stands in.
        return client.state.get("theta", self.server["global"])
