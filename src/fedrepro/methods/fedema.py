"""FedEMA (Zhuang, Wen and Zhang, "Divergence-aware Federated Self-Supervised Learning", ICLR 2022;
Calibre's baseline; reference: Plato examples/ssl/fedema; methods.md §6).

BYOL (online encoder + projector + predictor, EMA target network, symmetric negative cosine) trained
federatedly, with a divergence-aware update of the client's model when it receives the global one:
    mu     = min(lambda_c * ||w_c - w_g||, 1)          (encoder parameters)
    w_c   <- mu * w_c + (1 - mu) * w_g
A client that diverged far from the global model keeps more of its own. lambda_c = tau / ||w_g - w_c||
is calibrated once per client (tau = 0.7), so mu starts at tau. Then the family's personalization
stage (a linear probe per client on the frozen global encoder).

Choices:
- [RECON] lambda_c is calibrated at the client's first participation that has a previous local
  model (its second one). Plato's server computes it in the first 3 rounds with every client
  taking part; with partial participation a client may not be sampled then.
- [RECON] The EMA applies to every communicated floating-point tensor (the whole BYOL state,
  target network included: one model state is loaded per client, as in Plato); the divergence is
  measured on the encoder only, as the paper.
- A client's first participation starts from the global model (nothing local to keep).
"""

from __future__ import annotations

import torch

from ..registry import Param
from . import register
from ._ssl import SSL_HPARAMS, FederatedSSL


@register
class FedEMA(FederatedSSL):
    name = "fedema"
    summary = "FedEMA: federated BYOL with a divergence-aware EMA of the local and global models; linear probe per client"
    paper = "Zhuang, Wen and Zhang, ICLR 2022"
    objective = "byol"
    hparams = {
        **SSL_HPARAMS,
        "proj_hidden": Param(1024, "hidden width of BYOL's projection and prediction heads (Plato fedema config)", int, minimum=1),
        "tau": Param(0.7, "autoscaler: lambda_c = tau / ||w_g - w_c|| at calibration, so mu starts at tau (FedEMA paper, Plato)",
                     float, exclusive_minimum=0),
    }

    def start_params(self, client, payload):
        local = client.state.get("local")
        if local is None:
            return payload
        local = {k: v.to(payload[k].device) for k, v in local.items()}
        enc = [k for k in payload if k.startswith("extractor.") and payload[k].is_floating_point()]
        div = float(torch.sqrt(sum(((local[k] - payload[k]) ** 2).sum() for k in enc)))
        if "lambda" not in client.state and div > 0:
            client.state["lambda"] = self.hp["tau"] / div
        mu = min(client.state.get("lambda", 0.0) * div, 1.0)
        return {k: mu * local[k] + (1 - mu) * v if v.is_floating_point() else v for k, v in payload.items()}

    def local_update(self, client, payload):
        update = super().local_update(client, payload)
        client.state["local"] = {k: v.to("cpu", copy=True) for k, v in update.params.items()}  # host memory: one model per client
        return update
