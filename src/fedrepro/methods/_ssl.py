"""The federated self-supervised family: one SSL objective trained with FedAvg, then the
personalization stage (Calibre's protocol, methods.md §2; Plato's pFL-{SimCLR, BYOL, ...}).

Training stage, every round: a sampled client receives the encoder and the objective's modules
(projector, predictor, target network, prototypes), runs E local epochs of the objective on two
augmented views of each batch of its unlabelled train split (`TwoViewAugment`, batched on the
device), and uploads them; the server averages them (FedAvg: the whole SSL model travels, as in
Plato, where no layer is configured local). Labels are never used in this stage.

Personalization stage, at every evaluation and for the novel clients: each client freezes the
global encoder and trains a FRESH linear head (the seeded initial one) on its own train split
(10 epochs, SGD lr 0.05, batch 32, Calibre §V-A; `engine.finetune_head`), scored on its test
split. A novel client runs no SSL step: it only probes the encoder (`personalize_unseen`).

A method of the family is a subclass that names its `objective`; Calibre adds its prototype
regularizers (`regularizer`) and its divergence-weighted aggregation.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..registry import Param
from ..ssl.objectives import OBJECTIVES, Objective
from ._finetune import FINETUNE_HPARAMS, finetune_work, finetuned_personal_params
from .base import FORWARD_SHARE, Method, Passes, Update

SSL_HPARAMS: dict[str, Param] = {
    "temperature": Param(0.2, "temperature of NT-Xent (SimCLR, Calibre's l_s: Calibre config loss_criterion.temperature), MoCo v2's "
                              "InfoNCE (MoCo v2 paper 0.2) and SMoG's group logits", float, exclusive_minimum=0),
    "proj_hidden": Param(2048, "hidden width of the projection/prediction heads (Calibre: lightly SimCLRProjectionHead(512, 2048, 256), "
                               "methods.md §2.1)", int, minimum=1),
    "proj_dim": Param(256, "output width of the projection head (Calibre: 256)", int, minimum=1),
    "target_momentum": Param(None, "EMA momentum of a target network (BYOL, MoCo v2, SMoG); null = the objective's default "
                                   "(BYOL 0.996 -> 1 on a cosine over the rounds; MoCo v2 and SMoG 0.99)",
                             (float, type(None)), minimum=0, maximum=1),
    "queue_size": Param(4096, "[RECON] MoCo v2 queue / SMoG memory bank length, client-local (MoCo v2 uses 65,536 keys of "
                              "ImageNet; a client of Calibre's setting holds 500 samples)", int, minimum=1),
    "swav_prototypes": Param(3000, "SwAV prototypes (SwAV paper's CIFAR value, lightly's default)", int, minimum=1),
    "smog_groups": Param(300, "SMoG groups (lightly's SMoG example)", int, minimum=1),
    "use_unlabeled": Param(True, "train the SSL stage on the client's share of the dataset's unlabeled pool too (STL-10's "
                                 "100,000 images, dataset param `unlabeled`), beside its train split", bool),
    "smog_reset_every": Param(300, "SMoG: re-cluster the groups from the client's memory bank every this many of its local "
                                   "steps, counted over the cell (lightly's SMoG example); 0 = never", int, minimum=0),
    **{**FINETUNE_HPARAMS,
       "ft_fresh_head": Param(True, "the personalization stage trains a fresh linear head (the seeded initial one) on the frozen "
                                    "encoder, as Calibre's personalization (methods.md §2.5)", bool)},
}


class FederatedSSL(Method):
    """FedAvg of an SSL objective's model, then a linear probe per client."""

    objective: ClassVar[str] = "simclr"  # a name in fedrepro.ssl.objectives.OBJECTIVES
    hparams = SSL_HPARAMS
    has_global = False  # the global model is an encoder: every client is scored through its probe
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # two augmented views, a step each, and the target network's forwards (BYOL, MoCo v2, SMoG)
        target = OBJECTIVES.get(hp.get("objective", cls.objective)).target_views
        return Passes(2 + target * FORWARD_SHARE)

    @classmethod
    def cost_personal_for(cls, hp, training):
        return finetune_work(hp)  # the linear probe

    def __init__(self, engine, hp):
        super().__init__(engine, hp)
        self.ssl: Objective = OBJECTIVES.get(hp.get("objective", self.objective))(engine.model.feature_dim, hp)
        self._views = None
        self.modules = self.ssl.modules(engine.model.extractor)
        # What travels: the encoder and the objective's modules; the linear head stays at its init.
        self.shared = ("extractor.",) + tuple(f"{name}." for name in self.modules)

    def extra_modules(self) -> dict[str, torch.nn.Module]:
        return self.modules

    def setup(self) -> None:
        self.server["global"] = self.engine.get_params(self.shared)

    # -- client: the training stage ---------------------------------------------------------
    def start_params(self, client, payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return payload

    def views(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._views is None:
            from ..ssl.augment import TwoViewAugment

            if x.dim() != 4 or x.shape[-1] != x.shape[-2]:
                raise ValueError(f"method {self.name}: the SSL views need square images (N, C, H, H); got a batch of shape "
                                 f"{tuple(x.shape)}")
            mean, std = self.engine.normalisation
            self._views = TwoViewAugment(mean, std, x.shape[-1])
        return self._views(x)

    def regularizer(self, out) -> torch.Tensor | None:
        """A term added to the objective's loss (Calibre's prototype regularizers); None here."""
        return None

    def local_update(self, client, payload):
        eng = self.engine
        eng.set_params(self.start_params(client, payload))
        self.ssl.load_local_state(client.state.get("ssl"))
        loss, seen = self.ssl_fit(client)
        state = self.ssl.local_state()
        if state:
            client.state["ssl"] = state
        return Update(client.id, client.num_train, eng.get_params(self.shared), loss=loss / max(seen, 1),
                      extras=self.upload_extras(client))

    def ssl_fit(self, client) -> tuple[float, int]:
        """E local epochs of the objective (+ regularizer) on two views of every batch."""
        eng = self.engine
        model = eng.model
        model.train()
        params = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith("head.")]
        opt = eng.optimizer(params)
        progress = (eng.round - 1) / max(1, eng.training["rounds"])  # the target momentum's schedule, per round
        total, seen = torch.zeros((), device=eng.device), 0
        split = "ssl_pool" if self.hp["use_unlabeled"] else "train"  # the train split (+ an unlabeled share, STL-10)
        for x, _ in eng.batches(client, split=split):  # labels are not used in the training stage
            if len(x) < 2:  # a contrastive loss and BatchNorm need two samples
                continue
            out = self.ssl.loss(model, *self.views(x))
            extra = self.regularizer(out)
            loss = out.loss if extra is None else out.loss + extra
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            self.ssl.after_step(model, progress)
            total += loss.detach().reshape(()) * len(x)
            seen += len(x)
        return float(total), seen

    def upload_extras(self, client) -> dict[str, Any]:
        return {}

    # -- evaluation: the personalization stage --------------------------------------------------
    def personal_params(self, client):
        return finetuned_personal_params(self, self.server["global"], client)

    def personalize_unseen(self, client):
        return self.personal_params(client)  # a novel client probes the encoder; no SSL step


def pfl_ssl(objective: str, name: str, paper: str) -> type[FederatedSSL]:
    """The family member that trains `objective` (pFL-SimCLR, pFL-BYOL, ...)."""
    return type(f"PFL{objective.capitalize()}", (FederatedSSL,), {
        "name": name,
        "objective": objective,
        "summary": f"federated {objective} (FedAvg), then a linear probe per client on the frozen encoder (Calibre's pFL baseline)",
        "paper": paper,
        "__doc__": f"pFL-{objective}: {FederatedSSL.__doc__}",
        "__module__": f"fedrepro.methods.{name}",
    })


__all__ = ["SSL_HPARAMS", "FederatedSSL", "pfl_ssl"]
