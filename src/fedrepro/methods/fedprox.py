"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020).

Algorithm: each sampled client starts from the global model w_g and minimises
    CE(w) + (mu / 2) * ||w - w_g||^2
with E local epochs of SGD, i.e. every step uses the perturbed gradient
    d = grad CE(w) + mu * (w - w_g)        (PFLlib's PerturbedGradientDescent);
the server averages the uploaded models as FedAvg does (sample-weighted).

Default mu = 0.1 (methods.md §6): PFLlib's default (0) disables the method and FL-bench's
(1.0) is the top of the FedProx paper's grid {0.001, 0.01, 0.1, 1}; 0.1 is on that grid
and is the value FedCRC, whose FedProx numbers this benchmark reproduces, uses.
"""

from __future__ import annotations

from ..registry import Param
from . import register
from ._helpers import proximal_hook
from .fedavg import FedAvg


@register
class FedProx(FedAvg):
    name = "fedprox"
    summary = "FedProx: FedAvg whose local steps add the proximal gradient mu * (w - w_global)"
    paper = "Li et al., MLSys 2020"
    vectorized = True  # FedAvg's vectorized update; the proximal hook broadcasts the shared anchor
    hparams = {
        "mu": Param(0.1, "proximal weight; 0.1 as in FedCRC, on the FedProx paper's grid {0.001, 0.01, 0.1, 1} "
                         "(PFLlib default 0 = FedAvg, FL-bench 1.0; methods.md §6)", float, minimum=0),
    }

    def fit_options(self, client, payload):
        # The anchor is the received global model: payload is the server's copy, never the model's.
        return {"before_step": proximal_hook(payload, self.hp["mu"], self.shared)}
