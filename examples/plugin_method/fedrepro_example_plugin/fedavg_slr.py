"""FedAvg with a server learning rate (Hsu, Qi and Brown, arXiv:1909.06335; Reddi et al., ICLR 2021):
the server moves the global model a step `server_lr` towards the clients' sample-weighted average,
    theta <- theta + server_lr * (avg_i theta_i - theta);
server_lr = 1 is FedAvg. The whole method is this file: fedrepro finds it through the entry point
in pyproject.toml, checks `server_lr` like any built-in parameter, and tunes it over `search_space`.
"""

from __future__ import annotations

from fedrepro.methods import register, weighted_average
from fedrepro.methods.fedavg import FedAvg
from fedrepro.registry import Param


@register
class FedAvgServerLR(FedAvg):
    name = "fedavg_slr"
    summary = "FedAvg whose server steps server_lr of the way to the clients' average (example plugin)"
    paper = "Hsu, Qi and Brown, arXiv:1909.06335"
    vectorized = True  # FedAvg's local update, unchanged
    hparams = {"server_lr": Param(1.0, "server step towards the average; 1 = FedAvg", float, exclusive_minimum=0, maximum=10)}
    search_space = {"server_lr": [0.5, 1.0, 1.5]}
    search_source = "[example] a grid around FedAvg's server_lr = 1"

    def aggregate(self, updates):
        old, eta = self.server["global"], self.hp["server_lr"]
        avg = weighted_average(updates)  # integer buffers (BN counters) come back as they are
        self.server["global"] = {**old, **{k: old[k] + eta * (v - old[k]) if v.is_floating_point() else v
                                           for k, v in avg.items()}}
