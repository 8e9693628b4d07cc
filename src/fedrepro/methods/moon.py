"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021).

Client i receives the global model w_g and keeps its own previous local model w_prev.
Per batch x, with z, z_glob, z_prev the representations of x under the model being
trained, w_g and w_prev:
    l_con = -log( e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}) )
    loss  = CE + mu * mean_batch(l_con)
After E local epochs the client keeps its model as the next w_prev and uploads it; the
server averages the models as FedAvg does.

Choices:
- The representation is the extractor's output (as PFLlib; methods.md §6). The original
  adds a two-layer projection head (out_dim 256) that our split models do not have.
- w_g and w_prev are fixed reference networks, run under no_grad in eval mode (the
  original calls .eval() on both), so they never touch BatchNorm statistics.
- Per client only the previous extractor is kept (all z_prev needs); model buffer size 1,
  the paper's default.
- First participation: w_prev = the common initial model (PFLlib clientmoon keeps a copy of
  the initial model as old_model; the original code's previous-model pool starts from the
  initial nets). In round 1 it equals w_g, so l_con is the constant log 2 and adds no gradient.
- A representation of (numerically) zero norm has no direction: its cosines count as 0
  with no gradient. Our extractors end in a ReLU (the original's projection head does
  not), and F.cosine_similarity alone would return a 1/eps-sized gradient there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Param
from . import register
from .base import FORWARD_SHARE, select
from .fedavg import FedAvg

_ZERO_NORM = 1e-8


def _cosine(z: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    has_direction = (z.norm(dim=1) > _ZERO_NORM) & (ref.norm(dim=1) > _ZERO_NORM)
    cos = F.cosine_similarity(z, ref, dim=1, eps=_ZERO_NORM)
    return torch.where(has_direction, cos, torch.zeros_like(cos))


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Batch mean of -log(e^{cos(z,z_glob)/tau} / (e^{cos(z,z_glob)/tau} + e^{cos(z,z_prev)/tau})),
    computed as a two-way cross-entropy with the global model as the positive (stable log-sum-exp)."""
    z, z_glob, z_prev = (t.flatten(1) for t in (z, z_glob, z_prev))
    logits = torch.stack([_cosine(z, z_glob), _cosine(z, z_prev)], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


@register
class Moon(FedAvg):
    name = "moon"
    summary = "MOON: CE + mu * model-contrastive loss pulling representations to the global model, away from the previous local one"
    paper = "Li, He, Song, CVPR 2021"
    hparams = {
        "mu": Param(1.0, "weight of the model-contrastive loss; 1 is the MOON paper's value for CIFAR-100 and Tiny-ImageNet, "
                         "its CIFAR-10 runs (and FL-bench's default) use 5; PFLlib's default 0 disables it (methods.md §6)",
                    float, minimum=0),
        "tau": Param(0.5, "temperature of the contrastive loss (MOON paper, FL-bench; PFLlib default 1.0; methods.md §6)",
                     float, exclusive_minimum=0),
    }
    cost_passes = 1 + 2 * FORWARD_SHARE  # the global and the previous representation of every batch: forwards

    def fit_options(self, client, payload):
        glob = select(payload, ("extractor.",))
        prev = client.state.get("prev") or select(self.engine.initial_params, ("extractor.",))
        mu, tau = self.hp["mu"], self.hp["tau"]

        def loss_fn(batch):
            contrast = model_contrastive_loss(batch.features, self._representation(glob, batch.x),
                                              self._representation(prev, batch.x), tau)
            return F.cross_entropy(batch.logits, batch.y) + mu * contrast

        return {"loss_fn": loss_fn}

    def local_update(self, client, payload):
        update = super().local_update(client, payload)
        client.state["prev"] = self.engine.get_params(("extractor.",))
        return update

    @torch.no_grad()
    def _representation(self, params, x):
        """z of a fixed reference network (w_g or w_prev) on x, in eval mode."""
        extractor = self.engine.model.extractor
        extractor.eval()
        try:
            return self.engine.forward_with(params, x, features=True)
        finally:
            extractor.train()
