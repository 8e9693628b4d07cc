"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning", ICML 2020), Algorithm 1, option II.

The server holds the model x and a control variate c; client i holds c_i (0 at first).
  client:  y <- x;  K local steps  y <- y - eta * (grad f_i(y) + c - c_i)
           c_i+ <- c_i - c + (x - y) / (K * eta)                       (option II)
           upload dy = y - x and dc = c_i+ - c_i;  keep c_i <- c_i+
  server:  x <- x + eta_g * mean_S(dy);   c <- c + sum_S(dc) / N     (= (|S|/N) mean_S(dc))
The server sends (x, c) and the client returns (dy, dc): twice FedAvg's bytes both ways.

Choices (methods.md §6 leaves them open):
- K is the number of local steps actually taken (E epochs x batches), as in the paper;
  PFLlib's clientscaffold divides by one epoch's batches (the same when E = 1).
- eta is the round's local learning rate. Option II assumes plain SGD; with momentum or
  weight decay configured, the correction is added to the gradient before the optimizer's
  own step (where PFLlib's SCAFFOLDOptimizer adds it for plain SGD).
- mean_S is unweighted, as in the paper, PFLlib and FL-bench (not FedAvg's n_i weights).
- Buffers (BatchNorm statistics) have no control variate; they take the same server step
  (eta_g = 1: their average); integer counters advance by the largest client's count.
"""

from __future__ import annotations

import torch

from ..registry import Param
from . import register
from .base import Update, select
from .fedavg import FedAvg


@register
class Scaffold(FedAvg):
    name = "scaffold"
    summary = "SCAFFOLD: local steps corrected by control variates (c - c_i), option II update of c_i"
    paper = "Karimireddy et al., ICML 2020"
    hparams = {
        "server_lr": Param(1.0, "global step size eta_g: x += eta_g * mean(dy) (PFLlib, FL-bench default 1.0; methods.md §6)",
                           float, exclusive_minimum=0),
    }

    def setup(self):
        super().setup()
        self.server["c"] = {k: torch.zeros_like(p) for k, p in self.engine.model.named_parameters()}

    def broadcast(self, client):
        return {"model": select(self.server["global"], self.shared), "c": self.server["c"]}

    def local_update(self, client, payload):
        x, c = payload["model"], payload["c"]
        c_i = client.state.get("c") or {k: torch.zeros_like(v) for k, v in c.items()}
        correction = {k: c[k] - c_i[k] for k in c}

        def correct(model):
            for name, p in model.named_parameters():
                if p.grad is not None:
                    p.grad.add_(correction[name])

        self.engine.set_params(x)
        fit = self.engine.fit(client, before_step=correct)
        y = self.engine.get_params(self.shared)
        delta_y = {k: y[k] - x[k] for k in y}
        if fit.steps:  # c_i+ - c_i = -c + (x - y) / (K eta)
            scale = 1.0 / (fit.steps * self.engine.lr)
            delta_c = {k: (x[k] - y[k]) * scale - c[k] for k in c}
        else:  # no data, no steps: nothing learned about the client's drift
            delta_c = {k: torch.zeros_like(v) for k, v in c.items()}
        client.state["c"] = {k: c_i[k] + delta_c[k] for k in c}
        return Update(client.id, client.num_train, delta_y, extras={"delta_c": delta_c}, loss=fit.loss)

    def aggregate(self, updates):
        if not updates:
            return
        eta_g, num_clients = self.hp["server_lr"], len(self.engine.clients)
        x = dict(self.server["global"])  # new tensors below: payloads already sent keep their values
        for k in updates[0].params:
            dy = torch.stack([u.params[k] for u in updates])
            x[k] = x[k] + (eta_g * dy.mean(0) if dy.is_floating_point() else dy.max(0).values)
        self.server["global"] = x
        self.server["c"] = {k: c + torch.stack([u.extras["delta_c"][k] for u in updates]).sum(0) / num_clients
                            for k, c in self.server["c"].items()}
