"""q-FFL via q-FedAvg (Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated
Learning", ICLR 2020), Algorithm 3.

Objective: min_w f_q(w) = sum_k p_k F_k(w)^(q+1) / (q+1); q = 0 is FedAvg, larger q puts more
weight on the clients with a large loss.

Each round t, every sampled client k:
  1. receives w^t and computes F_k(w^t), its loss on its whole train split at the starting point;
  2. runs E epochs of local SGD from w^t and obtains w_k;
  3. uploads w_k and F_k(w^t).
The server, with L = 1/lr (the local learning rate as the Lipschitz estimate):
  Δw_k = L (w^t - w_k),  Δ_k = F_k^q Δw_k,  h_k = q F_k^(q-1) ||Δw_k||^2 + L F_k^q,
  w^(t+1) = w^t - sum_k Δ_k / sum_k h_k.

The paper formula is implemented (methods.md §6): the FedGCR code uses the last client's loss
for every Δ_k and sum ||.|| instead of ||.||^2. F_k^q is evaluated in log space (`_fair.qfedavg_step`).
"""

from __future__ import annotations

from ..registry import Param
from . import register
from ._fair import LIPSCHITZ, LOSS_AT, WEIGHT_BY_SIZE, LossWeighted, check_lipschitz, lipschitz, qfedavg_step


@register
class QFFL(LossWeighted):
    name = "qffl"
    summary = "q-FFL (q-FedAvg): server step -sum F_k^q Δw_k / sum h_k that up-weights high-loss clients by the power q"
    paper = "Li, Sanjabi, Beirami, Smith, ICLR 2020"
    hparams = {
        "q": Param(1.0, "fairness power q (q = 0: FedAvg). 1 as in the FedGCR code and the q-FFL paper's Synthetic / "
                        "Sent140 runs; GRP-FED compares against q-FFL with q = 10 (methods.md §3.3, §6)", float, minimum=0),
        "lipschitz": LIPSCHITZ,
        "loss_at": LOSS_AT,
        "weight_by_size": WEIGHT_BY_SIZE,
    }

    @classmethod
    def check_training(cls, where, hp, training):
        check_lipschitz(where, hp, training)

    def aggregate(self, updates):
        if not updates:
            return
        sizes = self.sizes(updates) if self.hp["weight_by_size"] else None
        step = qfedavg_step(self.server["global"], updates, self.losses(updates), self.hp["q"],
                            lipschitz(self.hp, self.engine), self.trainable_names(), sizes)
        self.server["global"] = {**self.server["global"], **step}
