"""FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated
Learning", AAAI 2023).

Algorithm (client i receiving the global model Theta, holding its local model theta_i):
  1. ALA: theta_hat = theta_i + (Theta - theta_i) ⊙ W on the last p parameter tensors; the lower
     layers take Theta. The element-wise weights W ∈ [0, 1] (kept by the client, init ones) are
     learned on a random s% of the local data: W <- clip(W - eta * dL(theta_hat)/dW, 0, 1), with
     theta_i and Theta fixed; to convergence in the start phase, one epoch per round afterwards.
  2. Local training from theta_hat (CE, E epochs); theta_i <- the result, uploaded in full.
  3. Server: FedAvg.

Choices (methods.md §6 FedALA; PFLlib `system/utils/ALA.py`, `clientala.py`, `serverala.py`):
* Start phase: the first time ALA is active for a client, W is trained until the population std
  of the last `num_pre_loss` epoch losses (the loss of each epoch's last batch, as ALA.py) is
  below `threshold`, with more than `num_pre_loss` epochs done. [PAPER≠CODE] threshold 0.01 is the
  paper's value (default); ALA.py's default is 0.1. ALA.py loops without a bound; the cap
  `max_start_epochs` is [RECON].
* ALA is skipped (and the start phase kept for later) while the mixed tensors of Theta and theta_i
  are equal, e.g. in round 1 (ALA.py: "deactivate ALA at the 1st communication iteration").
* Before its first local training a client's theta_i is the common seeded initialisation Theta^0
  (the paper's theta_i^0 = Theta^0; PFLlib's clients start as copies of the initial model).
* "Lower layers take Theta" covers the buffers too (BatchNorm statistics), which FedAvg averages.
* The s% sample is a seeded random subset (paper: "randomly sample s%"); [PAPER≠CODE] ALA.py takes
  a contiguous slice at a random offset. Batches of the training batch size over a fixed order,
  the last incomplete one dropped (ALA.py's drop_last; a sample smaller than one batch is one
  batch, where ALA.py would fail), no augmentation, the model in eval mode (nothing written to
  buffers, no dropout).
* ALA runs on the clients sampled in a round, when they receive the model. PFLlib's server sends
  the model (and runs ALA) on every client every round; the two agree under full participation.
* Personalized model = ALA's mix of the current global model with the client's local model
  (after its last local training): the model the client holds when it receives the global model,
  which is what FedALA's code (PFLlib: send_models runs ALA, then evaluate) scores. W is learned
  for it as at a real receipt (one epoch, or the start phase), on a copy with a sample stream of its
  own, so evaluating leaves the client's W and training unchanged. Global model = the server's
  FedAvg model.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from . import register
from .base import Params, Passes, Update
from .fedavg import FedAvg
from ..registry import Param


def mix(global_p: Params, local_p: Params, weights: Params) -> Params:
    """theta_local + (theta_global - theta_local) ⊙ W on the entries of `weights`; every other entry from theta_global."""
    return {**global_p, **{k: local_p[k] + (global_p[k] - local_p[k]) * w for k, w in weights.items()}}


def weight_step(forward: Callable[[Params, torch.Tensor], torch.Tensor], global_p: Params, local_p: Params,
                weights: Params, x: torch.Tensor, y: torch.Tensor, eta: float) -> torch.Tensor:
    """One ALA step on a batch, in place: W <- clip(W - eta * dL/dW, 0, 1), where
    dL/dW = dL/dtheta_hat ⊙ (theta_global - theta_local) (ALA.py's update). Returns the batch loss."""
    leaves = {k: w.detach().clone().requires_grad_(True) for k, w in weights.items()}
    loss = F.cross_entropy(forward(mix(global_p, local_p, leaves), x), y)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    with torch.no_grad():
        for w, g in zip(weights.values(), grads):
            w.sub_(g, alpha=eta).clamp_(0.0, 1.0)
    return loss.detach()


@register
class FedALA(FedAvg):
    name = "fedala"
    summary = "FedALA: learned element-wise mix of global and local model (upper layers) before local training; FedAvg"
    paper = "Zhang et al., AAAI 2023"
    hparams = {
        # Defaults: FedALA run_me.sh (-et 1 -p 2 -s 80) and ALA.py; methods.md §6.
        "eta": Param(1.0, "weight learning rate of W (FedALA run_me.sh -et 1)", float, exclusive_minimum=0),
        "rand_percent": Param(80, "s: percent of the local training data sampled to learn W (run_me.sh -s 80)",
                              int, minimum=1, maximum=100),
        "layer_idx": Param(2, "p: number of final parameter tensors mixed element-wise (2 = the head's weight and "
                              "bias; 0 = all, as ALA.py); the others take the global model (run_me.sh -p 2)", int, minimum=0),
        "threshold": Param(0.01, "start phase: stop when the std of the last num_pre_loss losses is below this "
                                 "(FedALA paper 0.01; PFLlib ALA.py default 0.1)", float, exclusive_minimum=0),
        "num_pre_loss": Param(10, "number of recent weight-learning losses in the convergence test (ALA.py)", int, minimum=2),
        "max_start_epochs": Param(50, "[RECON] cap on the start phase's weight-learning epochs (ALA.py has none; "
                                      "methods.md §6)", int, minimum=1),
    }
    has_global = True
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # one ALA epoch a round over rand_percent of the train split (forward and backward to W); the start
        # phase (up to max_start_epochs at a client's first ALA) is not modelled
        return Passes(1 + hp["rand_percent"] / 100 / training["local_epochs"])

    def setup(self):
        super().setup()
        self.server["init"] = self.engine.get_params()  # theta_i^0 of every client

    # -- client ---------------------------------------------------------------------
    def local_update(self, client, payload):
        global_p = {**self.server["global"], **payload}
        local_p = client.state.get("model", self.server["init"])
        self.engine.set_params(self.adaptive_local_aggregation(client, global_p, local_p))
        fit = self.engine.fit(client)
        client.state["model"] = self.engine.get_params()
        return Update(client.id, client.num_train, self.engine.get_params(self.shared), loss=fit.loss)

    def mixed_names(self) -> list[str]:
        names = [k for k, _ in self.engine.model.named_parameters()]
        p = self.hp["layer_idx"]
        return names[-p:] if p else names

    def adaptive_local_aggregation(self, client, global_p: Params, local_p: Params, purpose: str = "fedala-sample",
                                   keep: bool = True) -> Params:
        """ALA's mix of `global_p` and `local_p`; `keep=False` learns W on a copy and leaves the client's W as it was."""
        top = self.mixed_names()
        if all(torch.equal(global_p[k], local_p[k]) for k in top):
            return dict(global_p)  # nothing to mix (round 1): ALA off, start phase kept for later
        stored = client.state.get("ala_weights")
        start = stored is None
        if stored is None:
            weights = {k: torch.ones_like(global_p[k]) for k in top}
        else:
            weights = stored if keep else {k: w.clone() for k, w in stored.items()}
        forward, batches = self.weight_forward(top, global_p, self.weight_batches(client, purpose))
        losses: list[float] = []
        for _ in range(self.hp["max_start_epochs"] if start else 1):
            for x, y in batches:
                loss = weight_step(forward, global_p, local_p, weights, x, y, self.hp["eta"])
            losses.append(float(loss))
            n = self.hp["num_pre_loss"]
            if len(losses) > n and np.std(losses[-n:]) < self.hp["threshold"]:
                break
        if keep:
            client.state["ala_weights"] = weights
        return mix(global_p, local_p, weights)

    def weight_batches(self, client, purpose: str = "fedala-sample") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed mini-batches of a seeded random s% sample of the client's training data."""
        n = client.num_train
        m = max(1, int(self.hp["rand_percent"] / 100 * n))
        g = self.engine.generator(purpose, self.engine.round, client.id)
        idx = torch.randperm(n, generator=g)[:m].to(client.train.x.device)
        x, y = client.train.x[idx], client.train.y[idx]
        bs = self.engine.training["batch_size"]
        stop = m - m % bs if m >= bs else m
        return [(x[i : i + bs], y[i : i + bs]) for i in range(0, stop, bs)]

    def weight_forward(self, top: list[str], global_p: Params, batches: list) -> tuple[Callable, list]:
        """The temporary model's forward (eval mode) and the batches it runs on. When only head
        tensors are mixed, the lower layers are Theta's throughout, so each batch's representation
        is computed once and only the head runs at every step (same values, far less work)."""
        self.engine.model.eval()
        if not all(k.startswith("head.") for k in top):
            return self.engine.forward_with, batches
        self.engine.set_params(global_p)
        with torch.no_grad():
            feats = [(self.engine.model.extractor(x), y) for x, y in batches]
        head = self.engine.model.head

        def forward(params: Params, z: torch.Tensor) -> torch.Tensor:
            return functional_call(head, {k[len("head."):]: v for k, v in params.items() if k.startswith("head.")}, (z,))

        return forward, feats

    # -- evaluation -------------------------------------------------------------------
    def personal_params(self, client):
        if "model" not in client.state:  # never trained: the engine's untrained rule decides how it is scored
            return self.server["global"]
        # W is learned as at a real receipt, on a copy: the client's own W only changes when it trains
        return self.adaptive_local_aggregation(client, self.server["global"], client.state["model"], "fedala-eval", keep=False)
