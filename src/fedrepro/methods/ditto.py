"""Ditto (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021), Algorithm 1.

Each sampled client k, given the global model w^t:
  1. trains its personal model v_k (kept on the client; first time: the common initial model,
     as PFLlib's clientditto, whose model_per is a copy of the initial model) for
     `personal_epochs` of SGD on CE + (lambda/2)||v_k - w^t||^2, i.e. the gradient step
     v_k <- v_k - lr * (grad F_k(v_k) + lambda (v_k - w^t)) (PFLlib's PerturbedGradientDescent);
  2. trains a copy of w^t by FedAvg local SGD (local_epochs) and uploads it.
The server averages the uploads (FedAvg). Two separate columns are reported: the FedAvg
global model (global) and v_k (personal); they are never mixed (PFLlib mixes them,
../shared/reference/anchors.md §2.1).
"""

from __future__ import annotations

from . import register
from ..registry import Param
from ._helpers import proximal_hook
from .base import Passes
from .fedavg import FedAvg


@register
class Ditto(FedAvg):
    name = "ditto"
    summary = "Ditto: FedAvg global model + per-client personal model pulled towards it by lambda/2 ||v - w||^2"
    paper = "Li, Hu, Beirami, Smith, ICML 2021"
    hparams = {
        # The paper tunes lambda in {0.01, 0.1, 1, 2}; FL-bench lambda 1, Plato ditto_lambda 1.0
        # (PFLlib's mu defaults to 0 and must be set): methods.md §6.
        "lam": Param(1.0, "lambda: weight of the pull (lambda/2)||v - w_global||^2 on the personal model (FL-bench, Plato)",
                     float, minimum=0),
        "personal_epochs": Param(1, "epochs of personal-model training per round (PFLlib plocal_epochs, FL-bench pers_epoch)",
                                 int, minimum=1),
    }
    has_personal = True
    vectorized = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # the personal model's epochs beside the global model's local epochs, batch for batch
        return Passes(1 + hp["personal_epochs"] / training["local_epochs"])

    def local_updates(self, clients, payloads):
        self.train_personal(clients, payloads[0])  # step 1 (the anchor w^t: the broadcast, the same for all)
        return super().local_updates(clients, payloads)  # step 2, the global model: plain FedAvg

    def train_personal(self, clients, global_params, max_steps=None):
        """Personal epochs on CE from each client's previous v (first time: the initial model),
        pulled towards the received global model w^t (the anchor stays fixed all round)."""
        starts = [client.state.get("v", self.engine.initial_params) for client in clients]
        fits = self.engine.fit_many(clients, starts, epochs=self.hp["personal_epochs"], max_steps=max_steps,
                                    before_step=proximal_hook(global_params, self.hp["lam"]))
        for client, fit in zip(clients, fits):
            client.state["v"] = fit.params
        return fits

    def personal_params(self, client):
        # A client never sampled has no v yet (the engine's untrained rule decides how it is scored).
        return client.state.get("v", self.engine.initial_params)
