"""FedEMA (Zhuang, Wen and Zhang, "Divergence-aware Federated Self-Supervised Learning", ICLR 2022;
Calibre's baseline; reference: Plato examples/ssl/fedema; methods.md §6; docs/parity.md, Plato).

BYOL (online encoder + projector + predictor, EMA target network, symmetric negative cosine) trained
federatedly, with a divergence-aware update of the client's online network when it receives the
global one:
    mu     = min(lambda_c * ||w_c - w_g||, 1)          (online encoder parameters)
    w_c   <- mu * w_c + (1 - mu) * w_g                 (online network: encoder, projector, predictor)
A client that diverged far from the global model keeps more of its own. lambda_c = tau / ||w_g - w_c||
is calibrated once per client (tau = 0.7), so mu starts at tau. Then the family's personalization
stage (a linear probe per client on the frozen global encoder).

What travels (the paper): clients upload the ONLINE network only; the BYOL target network
(target_extractor, target_projector) stays on the client, is never averaged and follows its own
online network by BYOL's momentum update. The divergence ||w_c - w_g|| is over the online encoder's
parameters (BatchNorm running statistics are buffers, not weights).

Choices:
- [RECON] lambda_c is calibrated at the client's first participation that has a previous local
  model (its second one). Plato's server computes it in the first 3 rounds with every client
  taking part; with partial participation a client may not be sampled then.
- [RECON] A client's first participation starts from the global model (nothing local to keep), and
  its target network starts as a copy of that online network (BYOL's initialisation).
- [PAPER≠CODE] `code_compat_share_target`: Plato's FedEMA loads, uploads and averages one model
  state per client, target network included (fedavg_personalized with no local layer), and its
  processor EMA-mixes every entry of it (fedema_processor.py, utils.update_parameters_moving_average).
- [PAPER≠CODE] `code_compat_divergence_buffers`: Plato's divergence sums over the encoder's
  state_dict entries (utils.get_parameters_diff on extract_encoder(state_dict)), BatchNorm running
  means and variances included.
"""

from __future__ import annotations

import torch

from ..registry import Param
from . import register
from ._ssl import SSL_HPARAMS, FederatedSSL

TARGET = ("target_extractor.", "target_projector.")  # BYOL's target network (ssl/objectives.py BYOL.modules)
ONLINE_OF_TARGET = ("extractor.", "projector.")  # the online modules the target copies


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
        "code_compat_share_target": Param(False, "[PAPER≠CODE] the BYOL target network travels, is averaged and EMA-mixed like "
                                                 "the online one (Plato's one model state); false = the paper's client-local "
                                                 "target", bool),
        "code_compat_divergence_buffers": Param(False, "[PAPER≠CODE] the divergence counts the encoder's BatchNorm running "
                                                       "statistics too (Plato's state_dict distance); false = weights only", bool),
    }

    def __init__(self, engine, hp):
        super().__init__(engine, hp)
        if not hp["code_compat_share_target"]:
            self.shared = tuple(p for p in self.shared if p not in TARGET)

    def divergence_keys(self, payload: dict[str, torch.Tensor]) -> list[str]:
        """The entries of the online encoder that the divergence ||w_c - w_g|| sums over."""
        weights = {f"extractor.{n}" for n, _ in self.engine.model.extractor.named_parameters()}
        buffers = self.hp["code_compat_divergence_buffers"]
        return [k for k in payload if k.startswith("extractor.") and payload[k].is_floating_point() and (buffers or k in weights)]

    def start_params(self, client, payload):
        params = self.ema_start(client, payload)
        if not self.hp["code_compat_share_target"]:
            params = {**params, **self.local_target(client, params)}
        return params

    def ema_start(self, client, payload):
        local = client.state.get("local")
        if local is None:
            return payload
        local = {k: v.to(payload[k].device) for k, v in local.items()}
        div = float(torch.sqrt(sum(((local[k] - payload[k]) ** 2).sum() for k in self.divergence_keys(payload))))
        if "lambda" not in client.state and div > 0:
            client.state["lambda"] = self.hp["tau"] / div
        mu = min(client.state.get("lambda", 0.0) * div, 1.0)
        return {k: mu * local[k] + (1 - mu) * v if v.is_floating_point() else v for k, v in payload.items()}

    def local_target(self, client, params):
        """The client's own target network; at its first participation a copy of the online network it starts from."""
        target = client.state.get("target")
        if target is not None:
            return target
        return {f"target_{k}": v.clone() for k, v in params.items() if k.startswith(ONLINE_OF_TARGET)}

    def local_update(self, client, payload):
        update = super().local_update(client, payload)
        client.state["local"] = {k: v.to("cpu", copy=True) for k, v in update.params.items()}  # host memory: one model per client
        if not self.hp["code_compat_share_target"]:
            client.state["target"] = {k: v.to("cpu") for k, v in self.engine.get_params(TARGET).items()}
        return update
