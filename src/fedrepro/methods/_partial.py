"""Partial sharing of a decoupled model: one part travels, the rest stays with the client.

The base of FedPer, FedRep (extractor shared, head local) and LG-FedAvg (head shared,
extractor local):

* the `shared` prefixes are FedAvg-averaged on the server (FedAvg's `aggregate`),
* every other parameter (and buffer) is the client's own, kept in `client.state["local"]`;
  until its first participation a client's own part is the common seeded initialisation,
* the personalized model = the server's shared part + the client's own part,
* these methods have no global model of their own, so the "(global)" column is the
  sample-weighted average of ALL clients' personalized models, own parts included (FedCRC
  Table II: "for purely personalized methods the global model is the average of the
  personalized models, heads included"; methods.md §1.6).

Subclasses set `shared` and, where local training is not one joint fit (FedRep), override
`train` (over the sampled clients, through `engine.fit_many`).
"""

from __future__ import annotations

from .base import ClientFit, Params, Update, select, weighted_average
from .fedavg import FedAvg


class PartialSharing(FedAvg):
    shared = ("extractor.",)
    has_global = True  # the average of the personalized models (see the module docstring)
    has_personal = True

    def own_part(self, params: Params) -> Params:
        """The entries of `params` that never leave the client: the complement of `shared`."""
        return {k: v for k, v in params.items() if not k.startswith(self.shared)}

    # -- client ---------------------------------------------------------------------
    def local_updates(self, clients, payloads):
        # Each client trains its own part under the broadcast shared part, keeps its own part, uploads the shared one.
        fits = self.train(clients, [{**self.personal_params(c), **p} for c, p in zip(clients, payloads)])
        for c, f in zip(clients, fits):
            c.state["local"] = self.own_part(f.params)
        return [Update(c.id, c.num_train, select(f.params, self.shared), loss=f.loss) for c, f in zip(clients, fits)]

    def train(self, clients, starts) -> list[ClientFit]:
        """Joint training of the whole model for the configured local epochs (FedPer, LG-FedAvg),
        each client from its start (engine.fit_many)."""
        return self.engine.fit_many(clients, starts)

    # -- evaluation -------------------------------------------------------------------
    def personal_params(self, client):
        # The server never updates the own part, so its copy there is the common initialisation.
        return {**self.server["global"], **client.state.get("local", {})}

    def global_params(self):
        # Every personalized model holds the same shared part, so only the own parts are averaged.
        own = [Update(c.id, c.num_train, self.own_part(self.personal_params(c))) for c in self.engine.clients]
        return {**self.server["global"], **weighted_average(own)}
