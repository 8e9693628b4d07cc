"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017).

Algorithm: each sampled client starts from the global model, runs E local epochs of SGD
on cross-entropy, and uploads its model; the server sets
theta <- sum_i (n_i / sum_j n_j) theta_i over the sampled clients.
"""

from __future__ import annotations

from . import register
from .base import Method, Update


@register
class FedAvg(Method):
    name = "fedavg"
    summary = "FedAvg: local SGD from the global model, sample-weighted model averaging"
    paper = "McMahan et al., AISTATS 2017"

    def local_update(self, client, payload):
        self.engine.set_params(self.start_params(client, payload))
        fit = self.engine.fit(client, **self.fit_options(client, payload))
        return Update(client.id, client.num_train, self.engine.get_params(self.shared), loss=fit.loss)

    # Hooks for the many methods that are "FedAvg, but ...": where local training starts,
    # and extra `engine.fit` options (a loss term, a gradient correction).
    def start_params(self, client, payload):
        return payload

    def fit_options(self, client, payload) -> dict:
        return {}
