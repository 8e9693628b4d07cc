"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017).

Algorithm: each sampled client starts from the global model, runs E local epochs of SGD
on cross-entropy, and uploads its model; the server sets
theta <- sum_i (n_i / sum_j n_j) theta_i over the sampled clients.
"""

from __future__ import annotations

from . import register
from .base import Method, Update, select


@register
class FedAvg(Method):
    name = "fedavg"
    summary = "FedAvg: local SGD from the global model, sample-weighted model averaging"
    paper = "McMahan et al., AISTATS 2017"
    vectorized = True

    def local_updates(self, clients, payloads):
        # One fit per client from its start (engine.fit_many: vectorized or client by client);
        # `fit_options` must not depend on the client when vectorized (FedProx's anchor is the
        # broadcast, identical for every client).
        starts = [self.start_params(c, p) for c, p in zip(clients, payloads)]
        fits = self.engine.fit_many(clients, starts, **self.fit_options(clients[0], payloads[0]))
        return [Update(c.id, c.num_train, select(f.params, self.shared), loss=f.loss) for c, f in zip(clients, fits)]

    # Hooks for the many methods that are "FedAvg, but ...": where local training starts,
    # and extra `engine.fit` options (a loss term, a gradient correction).
    def start_params(self, client, payload):
        return payload

    def fit_options(self, client, payload) -> dict:
        return {}
