"""Self-supervised objectives as interchangeable parts of one federated SSL method family.

An objective says which modules it adds to the model (projector, predictor, target network,
prototypes: attached beside the split model's `extractor` and `head`, so they are parameters
like any other and travel with it) and computes its loss on a batch's two views. Every objective
returns the ONLINE encodings z (the extractor's output, the representation the personalization
stage probes) and projections h of both views, which is what Calibre's prototype regularizers
read (methods.md §2.2), whatever the objective.

Losses, heads, memory banks and the momentum update are lightly's (the library Calibre's
reference code is built on; lightly 1.6): NTXentLoss, NegativeCosineSimilarity, SwaVLoss,
the projection/prediction heads, SwaVPrototypes, SMoGPrototypes, MemoryBankModule,
update_momentum. Written here, because lightly has it only inside example scripts: the
training-step logic of each method (symmetrisation, stop-gradients, SMoG's group-feature update
and reset), and the momentum schedule.

lightly is imported when an objective is built, not when this module is imported: it takes
seconds, and every `fedrepro` command imports the method registry.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..registry import Registry

OBJECTIVES: Registry = Registry("SSL objective")


@dataclass
class ViewsOutput:
    """One batch of an SSL step: the objective's loss and the online z, h of both views."""

    loss: torch.Tensor
    za: torch.Tensor
    zb: torch.Tensor
    ha: torch.Tensor
    hb: torch.Tensor


def cosine_momentum(base: float, progress: float) -> float:
    """BYOL's target momentum: base -> 1 along a cosine over training (progress in [0, 1])."""
    return 1 - (1 - base) * (math.cos(math.pi * min(max(progress, 0.0), 1.0)) + 1) / 2


class Objective:
    """One SSL objective. `hp` is the method's hyper-parameters (the family's `SSL_HPARAMS`)."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    momentum: ClassVar[float | None] = None  # default target momentum (objectives with a target network)
    momentum_schedule: ClassVar[str] = "constant"  # or "cosine" (to 1 over training)
    target_views: ClassVar[int] = 0  # views the target network encodes per batch (forwards without gradient: cost)

    def __init__(self, feature_dim: int, hp: dict[str, Any]):
        self.feature_dim, self.hp = feature_dim, hp
        self.steps = 0  # local steps so far in the cell (SMoG's periodic reset)

    def modules(self, extractor: nn.Module) -> dict[str, nn.Module]:
        """The modules this objective adds to the model, by attribute name."""
        raise NotImplementedError

    def loss(self, model: nn.Module, xa: torch.Tensor, xb: torch.Tensor) -> ViewsOutput:
        raise NotImplementedError

    def after_step(self, model: nn.Module, progress: float) -> None:
        """After each optimizer step (momentum updates); `progress` = fraction of training done."""
        self.steps += 1
        if self.momentum is None:
            return
        from lightly.models.utils import update_momentum

        m = self.momentum if self.hp.get("target_momentum") is None else self.hp["target_momentum"]
        m = cosine_momentum(m, progress) if self.momentum_schedule == "cosine" else m
        update_momentum(model.extractor, model.target_extractor, m)
        update_momentum(model.projector, model.target_projector, m)

    # Client-local state that is not a model parameter (MoCo's queue, SMoG's memory bank).
    def local_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_local_state(self, state: dict[str, torch.Tensor] | None) -> None:
        pass

    def _online(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = model.extractor(x).flatten(1)
        return z, model.projector(z)

    @staticmethod
    def _target_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.target_projector(model.target_extractor(x).flatten(1))


def kmeans(z: torch.Tensor, k: int, seed: int, max_iter: int = 200) -> tuple[torch.Tensor, np.ndarray]:
    """scikit-learn KMeans (n_init="auto") of the rows of z into at most k clusters: the labels (on
    z's device) and the centroids. Calibre's pseudo-labels and divergence rate, SMoG's group reset."""
    from sklearn.cluster import KMeans

    data = z.detach().float().cpu().numpy()
    km = KMeans(n_clusters=min(k, len(data)), n_init="auto", max_iter=max_iter, random_state=seed).fit(data)
    return torch.as_tensor(km.labels_, dtype=torch.long, device=z.device), km.cluster_centers_


# The client-local memory bank of MoCo's queue and SMoG's encodings (lightly MemoryBankModule).
def bank_state(bank) -> dict[str, torch.Tensor]:
    return {"bank": bank.bank.detach().clone(), "ptr": bank.bank_ptr.detach().clone()}


def load_bank(bank, state: dict[str, torch.Tensor] | None) -> None:
    """Restore a client's bank, or (its first participation) a fresh random one, lightly's initialisation."""
    if state:
        bank.bank, bank.bank_ptr = state["bank"].clone(), state["ptr"].clone()
    else:
        bank._init_memory_bank(bank.size)


def frozen_copy(module: nn.Module) -> nn.Module:
    """A target network: a copy of `module` that gets no gradient (lightly deactivate_requires_grad)."""
    from lightly.models.utils import deactivate_requires_grad

    target = copy.deepcopy(module)
    deactivate_requires_grad(target)
    return target


def _register(cls: type[Objective]) -> type[Objective]:
    OBJECTIVES.add(cls.name, cls, (cls.__doc__ or '').split('\n')[0], paper=cls.paper)
    return cls


@_register
class SimCLR(Objective):
    """NT-Xent between the two views' projections (Calibre's l_s, temperature 0.2)."""

    name, paper = "simclr", "Chen et al., ICML 2020"

    def __init__(self, feature_dim, hp):
        super().__init__(feature_dim, hp)
        from lightly.loss import NTXentLoss

        self.criterion = NTXentLoss(temperature=hp["temperature"])

    def modules(self, extractor):
        from lightly.models.modules import SimCLRProjectionHead

        return {"projector": SimCLRProjectionHead(self.feature_dim, self.hp["proj_hidden"], self.hp["proj_dim"])}

    def loss(self, model, xa, xb):
        za, ha = self._online(model, xa)
        zb, hb = self._online(model, xb)
        return ViewsOutput(self.criterion(ha, hb), za, zb, ha, hb)


@_register
class BYOL(Objective):
    """Predictor on the online branch regresses the EMA target's projection of the other view
    (symmetric negative cosine); the target gets no gradient and follows the online network with
    momentum 0.996 -> 1 on a cosine (BYOL paper; FedEMA's config, methods.md §6)."""

    name, paper = "byol", "Grill et al., NeurIPS 2020"
    target_views = 2
    momentum, momentum_schedule = 0.996, "cosine"

    def __init__(self, feature_dim, hp):
        super().__init__(feature_dim, hp)
        from lightly.loss import NegativeCosineSimilarity

        self.criterion = NegativeCosineSimilarity()

    def modules(self, extractor):
        from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead

        projector = BYOLProjectionHead(self.feature_dim, self.hp["proj_hidden"], self.hp["proj_dim"])
        return {"projector": projector, "predictor": BYOLPredictionHead(self.hp["proj_dim"], self.hp["proj_hidden"], self.hp["proj_dim"]),
                "target_extractor": frozen_copy(extractor), "target_projector": frozen_copy(projector)}

    def loss(self, model, xa, xb):
        za, ha = self._online(model, xa)
        zb, hb = self._online(model, xb)
        ta, tb = self._target_of(model, xa), self._target_of(model, xb)
        loss = 0.5 * (self.criterion(model.predictor(ha), tb) + self.criterion(model.predictor(hb), ta))
        return ViewsOutput(loss, za, zb, ha, hb)


@_register
class SimSiam(Objective):
    """BYOL without a target network: the other view's projection under stop-gradient."""

    name, paper = "simsiam", "Chen and He, CVPR 2021"

    def __init__(self, feature_dim, hp):
        super().__init__(feature_dim, hp)
        from lightly.loss import NegativeCosineSimilarity

        self.criterion = NegativeCosineSimilarity()

    def modules(self, extractor):
        from lightly.models.modules import SimSiamPredictionHead, SimSiamProjectionHead

        d, hidden = self.hp["proj_dim"], self.hp["proj_hidden"]
        # the SimSiam paper's predictor bottleneck is a quarter of the projection width (2048 -> 512)
        return {"projector": SimSiamProjectionHead(self.feature_dim, hidden, d),
                "predictor": SimSiamPredictionHead(d, max(1, d // 4), d)}

    def loss(self, model, xa, xb):
        za, ha = self._online(model, xa)
        zb, hb = self._online(model, xb)
        pa, pb = model.predictor(ha), model.predictor(hb)
        loss = 0.5 * (self.criterion(pa, hb.detach()) + self.criterion(pb, ha.detach()))
        return ViewsOutput(loss, za, zb, ha, hb)


@_register
class MoCoV2(Objective):
    """InfoNCE of the online query against the momentum encoder's key of the other view, the
    negatives a FIFO queue of past keys (lightly NTXentLoss with a memory bank; MoCo v2's
    temperature 0.2 and MLP head). Symmetrised over the two views, so both views' online
    encodings exist for Calibre's regularizers: a reconstruction, as MoCo v2 itself (and Plato's
    MoCoV2 model) is one-directional, with no hyper-parameter for the one-directional loss
    (reported in issue 35; Calibre's Table I runs SimCLR, SwAV and SMoG, calibre_cpu SimCLR). The queue is
    client-local state: it holds keys of the client's own data (its length `queue_size` [RECON])."""

    name, paper = "mocov2", "Chen et al., arXiv:2003.04297 (2020)"
    target_views = 2
    momentum = 0.99

    def __init__(self, feature_dim, hp):
        super().__init__(feature_dim, hp)
        from lightly.loss import NTXentLoss

        self.criterion = NTXentLoss(temperature=hp["temperature"], memory_bank_size=(hp["queue_size"], hp["proj_dim"]))

    def modules(self, extractor):
        from lightly.models.modules import MoCoProjectionHead

        projector = MoCoProjectionHead(self.feature_dim, self.hp["proj_hidden"], self.hp["proj_dim"])
        return {"projector": projector, "target_extractor": frozen_copy(extractor), "target_projector": frozen_copy(projector)}

    def loss(self, model, xa, xb):
        self.criterion.to(xa.device)
        za, ha = self._online(model, xa)
        zb, hb = self._online(model, xb)
        ka, kb = self._target_of(model, xa), self._target_of(model, xb)
        loss = 0.5 * (self.criterion(ha, kb) + self.criterion(hb, ka))
        return ViewsOutput(loss, za, zb, ha, hb)

    def local_state(self):
        return bank_state(self.criterion.memory_bank)

    def load_local_state(self, state):
        load_bank(self.criterion.memory_bank, state)


@_register
class SwAV(Objective):
    """Swapped prediction of Sinkhorn-Knopp codes over learnable prototypes (lightly SwaVLoss,
    two 'high-resolution' views, no multi-crop)."""

    name, paper = "swav", "Caron et al., NeurIPS 2020"

    def __init__(self, feature_dim, hp):
        super().__init__(feature_dim, hp)
        from lightly.loss import SwaVLoss

        self.criterion = SwaVLoss()

    def modules(self, extractor):
        from lightly.models.modules import SwaVProjectionHead, SwaVPrototypes

        return {"projector": SwaVProjectionHead(self.feature_dim, self.hp["proj_hidden"], self.hp["proj_dim"]),
                "prototypes": SwaVPrototypes(self.hp["proj_dim"], self.hp["swav_prototypes"])}

    def loss(self, model, xa, xb):
        model.prototypes.normalize()
        za, ha = self._online(model, xa)
        zb, hb = self._online(model, xb)
        pa = model.prototypes(nn.functional.normalize(ha, dim=1))
        pb = model.prototypes(nn.functional.normalize(hb, dim=1))
        return ViewsOutput(self.criterion([pa, pb], []), za, zb, ha, hb)


@_register
class SMoG(Objective):
    """Synchronous momentum grouping: the online prediction of one view is classified against
    momentum-updated group features into the group the momentum encoder assigns the other view;
    every `smog_reset_every` steps the groups are re-clustered (KMeans) from a memory bank of
    encodings and the momentum encoder is reset to the online one (lightly's SMoG example).
    The views swap roles every second step, as there. The memory bank is client-local state."""

    name, paper = "smog", "Pang et al., ECCV 2022"
    target_views = 1
    momentum = 0.99

    def __init__(self, feature_dim, hp):
        super().__init__(feature_dim, hp)
        from lightly.models.modules.memory_bank import MemoryBankModule

        self.bank = MemoryBankModule(size=(hp["queue_size"], hp["proj_dim"]))

    def modules(self, extractor):
        from lightly.models.modules import SMoGPredictionHead, SMoGProjectionHead, SMoGPrototypes

        d, hidden = self.hp["proj_dim"], self.hp["proj_hidden"]
        projector = SMoGProjectionHead(self.feature_dim, hidden, d)
        groups = nn.functional.normalize(torch.rand(self.hp["smog_groups"], d), dim=1)
        return {"projector": projector, "predictor": SMoGPredictionHead(d, hidden, d),
                "target_extractor": frozen_copy(extractor), "target_projector": frozen_copy(projector),
                "prototypes": SMoGPrototypes(groups, beta=0.99)}

    def loss(self, model, xa, xb):
        self.bank.to(xa.device)
        za, ha = self._online(model, xa)
        zb, hb = self._online(model, xb)
        query, key_view = (ha, xb) if self.steps % 2 == 0 else (hb, xa)  # the views swap roles every second step
        assignments = model.prototypes.assign_groups(self._target_of(model, key_view))
        # as lightly's example: the updated group features keep the query's gradient for this step
        groups = model.prototypes.get_updated_group_features(query)
        logits = model.prototypes(model.predictor(query), groups, temperature=self.hp["temperature"])
        model.prototypes.set_group_features(groups.detach())
        self.bank(query.detach(), update=True)
        return ViewsOutput(nn.functional.cross_entropy(logits, assignments), za, zb, ha, hb)

    def after_step(self, model, progress):
        every = self.hp["smog_reset_every"]  # in the client's own local steps
        if self.steps > 0 and every and self.steps % every == 0:  # the 0-based index of this step, as lightly's global_step
            self._reset(model)
            self.steps += 1
        else:
            super().after_step(model, progress)

    def _reset(self, model):
        # max_iter 300: scikit-learn's default, which lightly's example uses
        _, centres = kmeans(self.bank.bank, self.hp["smog_groups"], int(torch.randint(2**31 - 1, (1,))), max_iter=300)
        k = len(centres)
        groups = model.prototypes.group_features.data.clone()
        groups[:k] = nn.functional.normalize(torch.as_tensor(centres, dtype=groups.dtype, device=groups.device), dim=1)
        model.prototypes.set_group_features(groups)
        model.target_extractor.load_state_dict(model.extractor.state_dict())
        model.target_projector.load_state_dict(model.projector.state_dict())

    # The memory bank and the step count (view swap, reset schedule) are the client's own: they are
    # checkpointed with its state, so a resumed run ends where an uninterrupted one does.
    def local_state(self):
        return {**bank_state(self.bank), "steps": torch.tensor(self.steps)}

    def load_local_state(self, state):
        load_bank(self.bank, state)
        self.steps = int(state["steps"]) if state else 0
