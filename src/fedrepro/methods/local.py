"""Local: every client trains its own model on its own data and never communicates.

The lower bound of collaboration (the "Local"/"Isolated" baseline of PFLlib and
pFL-Bench). All clients start from the same seeded initialisation.
"""

from __future__ import annotations

from . import register
from .base import Method, Update


@register
class Local(Method):
    name = "local"
    summary = "Local: each client trains alone from a common initialisation; no communication"
    paper = "baseline (PFLlib 'Local', pFL-Bench 'Isolated')"
    shared = ()
    has_global = False
    has_personal = True

    def broadcast(self, client):
        return {}

    def local_update(self, client, payload):
        self.engine.set_params(self.personal_params(client))
        fit = self.engine.fit(client)
        client.state["model"] = self.engine.get_params()
        return Update(client.id, client.num_train, loss=fit.loss)

    def aggregate(self, updates):
        pass

    def personal_params(self, client):
        return client.state.get("model", self.server["global"])
