"""Local linear classifier (Calibre's purely local baselines, "Script-Convergent" / "Script-Fair",
methods.md §2.9): every client trains a linear classifier on its own train split alone, with no
federation. `epochs: 10` (default) is the fair version, trained with the personalization recipe
(SGD lr 0.05, momentum 0.9, batch 32); `epochs: null` trains to convergence (until an epoch lowers
the full-batch training loss by less than `tol`, at most `max_epochs`).

[RECON] The classifier reads the raw (normalised, flattened) inputs: a client that trains alone has
no encoder but a random one, and a linear map of random features would measure the initialisation.
So the method runs on `mlp` with no hidden layer (multinomial logistic regression), set as the
label's own model: `methods.<label>.model: {name: mlp, params: {hidden: []}}`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import ConfigError, Param
from . import register
from .base import Method, PersonalWork, Update


@register
class LocalLinear(Method):
    name = "local_linear"
    summary = "each client alone: a linear classifier on its raw inputs (Calibre's local baselines: 10 epochs, or to convergence)"
    paper = "Chen, Su and Li, 2024 (Calibre's Script-Fair / Script-Convergent)"
    shared = ()
    has_global = False
    has_personal = True
    models = ("mlp",)
    cost_passes = 0.0  # nothing trains during the rounds: the classifier is fit when it is scored
    #: The epochs the cost estimate counts for `epochs: null` (at most max_epochs): how long convergence
    #: takes is known only once it is run. Measured on calibre_cpu's clients (2026-11-29): 4.3 and 5.1
    #: epochs on average (q2, d03), 15 at most; counting max_epochs (500) put the job at 13x its time.
    cost_convergence_epochs = 10

    @classmethod
    def cost_personal_for(cls, hp, training):
        epochs = hp["epochs"] if hp["epochs"] is not None else min(cls.cost_convergence_epochs, hp["max_epochs"])
        return PersonalWork(head_epochs=epochs, head_batch_size=hp["batch_size"])
    hparams = {
        "epochs": Param(10, "training epochs (Calibre's personalization recipe); null = to convergence", (int, type(None)), minimum=1),
        "lr": Param(0.05, "SGD learning rate (Calibre's personalization recipe)", float, exclusive_minimum=0),
        "momentum": Param(0.9, "SGD momentum ([RECON], as the personalization stage)", float, minimum=0),
        "batch_size": Param(32, "batch size (Calibre's personalization recipe)", int, minimum=1),
        "tol": Param(1e-4, "to convergence: stop when an epoch lowers the full-batch training loss by less than this", float,
                     exclusive_minimum=0),
        "max_epochs": Param(500, "to convergence: at most this many epochs", int, minimum=1),
    }

    @classmethod
    def check_cell(cls, where, hp, model, partition):
        super().check_cell(where, hp, model, partition)
        if model["params"].get("hidden"):
            raise ConfigError(f"config key '{where}': method 'local_linear' is a linear classifier on the raw inputs; the model "
                              f"mlp has hidden {model['params']['hidden']}; allowed: hidden [] (set methods.<label>.model: "
                              "{name: mlp, params: {hidden: []}})")

    def local_update(self, client, payload):
        return Update(client.id, client.num_train, {}, loss=0.0)  # nothing is trained or sent during the rounds

    def personal_params(self, client):
        hp, eng = self.hp, self.engine
        eng.set_params(eng.initial_params)  # the seeded initial classifier, the same start for every client
        x, y = eng.features(client.train.x), client.train.y  # the flattened inputs (no hidden layer)
        head = eng.model.head
        opt = torch.optim.SGD(head.parameters(), lr=hp["lr"], momentum=hp["momentum"])
        g = eng.generator("local-linear", client.id)
        if hp["epochs"] is not None:
            eng.fit_head(x, y, epochs=hp["epochs"], batch_size=hp["batch_size"], opt=opt, g=g)
            return eng.get_params()
        last = float("inf")
        for _ in range(hp["max_epochs"]):
            eng.fit_head(x, y, epochs=1, batch_size=hp["batch_size"], opt=opt, g=g)
            with torch.no_grad():
                loss = float(F.cross_entropy(head(x), y))
            if last - loss < hp["tol"]:
                break
            last = loss
        return eng.get_params()

    def personalize_unseen(self, client):
        return self.personal_params(client)
