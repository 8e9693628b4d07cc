"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021).

Algorithm, per round on each sampled client:
  1. load the global extractor (representation) under the client's own head;
  2. train the head for `head_epochs` with the extractor frozen;
  3. train the extractor for `body_epochs` with the head frozen;
  4. keep the head, upload the extractor; the server FedAvg-averages the extractors.
Personalized model = global extractor + the client's own head. No global model exists:
the "(global)" column is the sample-weighted average of the personalized models, heads
included (FedCRC Table II convention, methods.md §1.6).

Defaults: the paper (and its code, lgcollins/FedRep: local_ep 11, local_rep_ep 1) trains
the head for 10 epochs; PFLlib's `plocal_epochs` and FL-bench default to 1 (methods.md §6).
The paper is followed (project rule: paper over library defaults): the head is a single
linear layer on a frozen extractor, so its epochs cost forward passes only, and FedRep's
point is a head fitted close to optimal before the representation step. Frozen means
parameters: BatchNorm running statistics, where a model keeps them, still update in
train mode during the head phase, as in PFLlib `clientrep.py`.
"""

from __future__ import annotations

from ..registry import Param
from . import register
from ._partial import PartialSharing
from .base import FORWARD_SHARE, Passes


@register
class FedRep(PartialSharing):
    name = "fedrep"
    summary = "FedRep: head epochs on the frozen extractor, then extractor epochs on the frozen head; extractor averaged"
    paper = "Collins et al., ICML 2021"
    shared = ("extractor.",)
    hparams = {
        "head_epochs": Param(10, "epochs training the client's head with the extractor frozen, first in every round "
                                 "(paper and its code: 10; PFLlib plocal_epochs and FL-bench: 1)", int, minimum=0),
        "body_epochs": Param(None, "epochs training the extractor with the head frozen, after the head; null = the "
                                   "configured local_epochs (PFLlib; the paper's code uses 1)", (int, type(None)), minimum=0),
    }

    vectorized = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # head epochs on the frozen extractor cost a forward a batch, body epochs a step; per local epoch
        epochs = training["local_epochs"]
        body = epochs if hp["body_epochs"] is None else hp["body_epochs"]
        return Passes((hp["head_epochs"] * FORWARD_SHARE + body) / epochs)

    def train(self, clients, starts):
        heads = self.engine.fit_many(clients, starts, epochs=self.hp["head_epochs"], trainable=("head.",))
        return self.engine.fit_many(clients, [h.params for h in heads], epochs=self.hp["body_epochs"], trainable=self.shared)
