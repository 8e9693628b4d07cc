"""AFL, agnostic federated learning (Mohri, Sivek, Suresh, "Agnostic Federated Learning",
ICML 2019).

Objective: min_w max_{lambda in simplex} sum_k lambda_k F_k(w): the model is trained for the
worst mixture of the clients' distributions. Stochastic-AFL alternates a descent step on w
under the current mixture with a projected ascent step on lambda along the client losses:

Each round t, every sampled client k receives w^t, computes F_k(w^t) (its loss on its train
split), runs E epochs of local SGD to w_k and uploads w_k and F_k. The server
  1. mixes the uploads with the mixture weights of the sampled clients S_t:
       w^(t+1) = sum_{k in S_t} lambda_k w_k / sum_{k in S_t} lambda_k
     (FedAvg's descent step with lambda in place of n_k / n; unchanged if that sum is 0);
  2. ascends lambda on the reported losses and projects it back onto the simplex:
       lambda <- Proj_simplex(lambda + gamma_lambda * F),  F_k = 0 for k not in S_t.
`lambda_mode` (methods.md §6):
  * 'persistent' (the paper; fair_flearn's and FLGo's code): lambda starts uniform (1/N) and is
    kept across rounds; step 1 uses lambda^t, step 2 gives lambda^(t+1);
  * 'prior_step' (the FedGCR code): every round lambda = Proj_simplex(p + gamma_lambda * F) from
    the data-size prior p_k = n_k / n, used at once in step 1 (FedGCR uses gamma_lambda = 0.1).
`average_iterates`: Stochastic-AFL's output is the average of the iterates (fair_flearn's and
FLGo's `resulting_model`); by default the last model is evaluated, as for every other method.
"""

from __future__ import annotations

import torch

from ..registry import Param
from . import register
from ._fair import LOSS_AT, LossWeighted, mix, project_simplex


def ascend_lambda(base: torch.Tensor, index: list[int], losses: list[float], lr: float) -> torch.Tensor:
    """Proj_simplex(base + lr * F), where F holds the reported losses at `index` and 0 elsewhere."""
    y = base.detach().to("cpu", torch.float64).clone()  # a checkpoint may have mapped it to the GPU
    y[index] += lr * torch.as_tensor(losses, dtype=torch.float64)
    return project_simplex(y)


@register
class AFL(LossWeighted):
    name = "afl"
    summary = "AFL: min-max over client mixtures; model mixed by lambda, lambda ascended on client losses and projected"
    paper = "Mohri, Sivek, Suresh, ICML 2019"
    hparams = {
        "lambda_mode": Param("persistent", "'persistent': lambda kept across rounds from uniform, one projected ascent "
                                           "step per round (Mohri et al.; fair_flearn / FLGo code); 'prior_step': "
                                           "lambda = Proj(p + gamma * F) from the data-size prior each round (FedGCR "
                                           "code; methods.md §6)", str, choices=("persistent", "prior_step")),
        "lambda_lr": Param(0.01, "gamma_lambda, the ascent step on lambda (fair_flearn scripts / FLGo: 0.01; the "
                                 "FedGCR code: 0.1 with lambda_mode 'prior_step')", float, minimum=0),
        "average_iterates": Param(False, "evaluate the running average of the global iterates w^1..w^t "
                                         "(Stochastic-AFL's output, fair_flearn's resulting_model) instead of the last one",
                                  bool),
        "loss_at": LOSS_AT,
    }

    def setup(self):
        super().setup()
        n = len(self.engine.clients)
        self.server["lambda"] = torch.full((n,), 1.0 / n, dtype=torch.float64)
        if self.hp["average_iterates"]:
            self.server["average"] = {k: v.clone() for k, v in self.server["global"].items()}
            self.server["averaged"] = 0

    def prior(self) -> torch.Tensor:
        sizes = torch.tensor([float(c.num_train) for c in self.engine.clients], dtype=torch.float64)
        return sizes / sizes.sum()

    def aggregate(self, updates):
        if not updates:
            return
        position = {c.id: i for i, c in enumerate(self.engine.clients)}
        index = [position[u.client_id] for u in updates]
        losses, lr = self.losses(updates), self.hp["lambda_lr"]
        if self.hp["lambda_mode"] == "persistent":
            mixture = self.server["lambda"]
            self.server["lambda"] = ascend_lambda(mixture, index, losses, lr)
        else:
            mixture = self.server["lambda"] = ascend_lambda(self.prior(), index, losses, lr)
        weights = mixture[index]
        if float(weights.sum()) > 0:
            self.server["global"] = {**self.server["global"], **mix(updates, weights / weights.sum())}
        if self.hp["average_iterates"]:
            t = self.server["averaged"] + 1
            self.server["average"] = {k: (v * (t - 1) + self.server["global"][k]) / t if v.is_floating_point()
                                      else self.server["global"][k].clone() for k, v in self.server["average"].items()}
            self.server["averaged"] = t

    def global_params(self):
        if self.hp["average_iterates"] and self.server.get("averaged", 0) > 0:
            return self.server["average"]
        return self.server["global"]
