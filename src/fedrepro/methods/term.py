"""TERM, client-level tilting (Li, Beirami, Sanjabi, Smith, "Tilted Empirical Risk
Minimization", ICLR 2021), as the fairness baseline of the FedGCR code.

Tilted objective over clients: min_w (1/t) log sum_k p_k exp(t F_k(w)); its gradient is
sum_k w_k(t) grad F_k(w) with w_k(t) = p_k exp(t F_k) / sum_j p_j exp(t F_j), so t > 0 up-weights
the clients with a large loss (t -> 0: FedAvg; t -> inf: the worst client).

Each round, every sampled client k runs E epochs of local SGD from w^t and uploads w_k and its
loss F_k; the server sets
  w^(t+1) = sum_k w_k(t) w_k,   w_k(t) ∝ p_k exp(t F_k),  p_k ∝ n_k,
normalised over the sampled clients (in log space: softmax(t F_k + log n_k)).
Default t = 0.01 (FedGCR code, `utils/util.py`, mode term; methods.md §6).
"""

from __future__ import annotations

from ..registry import Param
from . import register
from ._fair import LOSS_AT, LossWeighted, tilted_weights


@register
class TERM(LossWeighted):
    name = "term"
    summary = "TERM (client-level tilt): model average weighted by p_k exp(t F_k), normalised"
    paper = "Li, Beirami, Sanjabi, Smith, ICLR 2021"
    hparams = {
        "t": Param(0.01, "tilt t of the client weights p_k exp(t F_k) (FedGCR code: 0.01; methods.md §6); t = 0 is FedAvg",
                   float),
        "loss_at": LOSS_AT,
    }

    def aggregation_weights(self, updates):
        return tilted_weights(self.losses(updates), self.hp["t"], self.sizes(updates))
