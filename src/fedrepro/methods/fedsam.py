"""FedSAM (Qu, Li, Duan, Liu, Tang, Lu, "Generalized Federated Learning via Sharpness Aware
Minimization", ICML 2022), a domain-FL baseline of FedGCR (methods.md §5.5, §6).

Each sampled client runs E local epochs from the global model with SAM as its local optimizer:
per mini-batch, g = grad L(w), e = rho g / ||g||, then the base optimizer steps from w with the
gradient taken at w + e (`_perturbed.perturbed_step`). The server averages as FedAvg.
rho = 0.05 (the fedgcr code's SAM(Adam, lr 1e-2, rho = 0.05); the base optimizer is the configured
`training.optimizer`).
"""

from __future__ import annotations

from ..registry import Param
from . import register
from ._perturbed import perturbed_fit
from .base import Update
from .fedavg import FedAvg


@register
class FedSAM(FedAvg):
    name = "fedsam"
    summary = "FedSAM: FedAvg whose local optimizer is SAM (gradient at w + rho g/||g||, step from w)"
    paper = "Qu et al., ICML 2022"
    hparams = {
        "rho": Param(0.05, "SAM's neighbourhood radius rho (fedgcr code and the FedSAM paper: 0.05)", float, minimum=0),
    }
    cost_passes = 2.0  # the gradient at w and again at the perturbed w + e: two steps a batch

    def local_update(self, client, payload):
        self.engine.set_params(payload)
        fit = perturbed_fit(self.engine, client, self.hp["rho"])
        return Update(client.id, client.num_train, self.engine.get_params(self.shared), loss=fit.loss)
