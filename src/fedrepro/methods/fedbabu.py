"""FedBABU (Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022).

Algorithm: the head is frozen at its shared random initialisation for the whole of
federated training ("Body Aggregation and Body Update"): each sampled client trains only
the extractor for E local epochs on cross-entropy and uploads it; the server FedAvg-averages
the extractors. For evaluation every client fine-tunes the whole global model (extractor
and head) on its own train split for `finetune_epochs`.

Columns: "(global)" = the global model without fine-tuning (FedCRC Table I reports FedBABU
this way, methods.md §1.8); "(personal)" = the global model after the client's fine-tuning,
recomputed from the current global model at every evaluation and never stored, so it does
not feed back into training. Fine-tuning the whole model follows the FedBABU paper and
PFLlib `clientbabu.fine_tune(['base', 'head'])`; Calibre's variant fine-tunes the head only
(that is `fedavg_ft`'s recipe).
"""

from __future__ import annotations

from ..registry import Param
from . import register
from .base import PersonalWork
from .fedavg import FedAvg


@register
class FedBABU(FedAvg):
    name = "fedbabu"
    summary = "FedBABU: head frozen at its random init, extractor trained and averaged; whole-model fine-tuning to personalize"
    paper = "Oh, Kim and Yun, ICLR 2022"
    shared = ("extractor.",)  # the head never changes, so only the extractor travels
    has_personal = True
    vectorized = True  # FedAvg's vectorized update (extractor only)
    hparams = {
        "finetune_epochs": Param(10, "epochs fine-tuning the whole global model on the client's train split before "
                                     "personalized evaluation (PFLlib fine_tuning_epochs, methods.md §6)", int, minimum=0),
        "finetune_lr": Param(None, "fine-tuning learning rate; null = the round's training learning rate (PFLlib "
                                   "fine-tunes with the client's training optimizer)", (float, type(None)), exclusive_minimum=0),
        "finetune_part": Param("all", "what the fine-tuning trains: 'all' (FedBABU paper, PFLlib; with the training "
                                      "optimizer and batch size) or 'head', the head on frozen features with SGD and "
                                      "head_batch_size / head_momentum (Calibre's personalization of its baselines, "
                                      "methods.md §6)", str, choices=("all", "head")),
        "head_batch_size": Param(32, "batch size of the head-only fine-tuning (finetune_part 'head'; Calibre's recipe, "
                                     "methods.md §6)", int, minimum=1),
        "head_momentum": Param(0.9, "SGD momentum of the head-only fine-tuning (finetune_part 'head'); [RECON] from "
                                    "Calibre's paper-era config (methods.md §2.5), as fedavg_ft's ft_momentum", float, minimum=0),
    }

    @classmethod
    def cost_personal_for(cls, hp, training):
        if hp["finetune_part"] == "head":
            return PersonalWork(head_epochs=hp["finetune_epochs"], head_batch_size=hp["head_batch_size"])
        return PersonalWork(train_epochs=hp["finetune_epochs"])  # the whole model, every evaluation

    def start_params(self, client, payload):
        # Full parameters: the model object may still hold a fine-tuned head from evaluation.
        return {**self.server["global"], **payload}

    def fit_options(self, client, payload):
        return {"trainable": self.shared}  # the head stays frozen at its initialisation

    def personal_params(self, client):
        if self.hp["finetune_part"] == "head":
            head = self.engine.finetune_head(self.server["global"], client, epochs=self.hp["finetune_epochs"],
                                             lr=self.hp["finetune_lr"] or self.engine.lr,
                                             batch_size=self.hp["head_batch_size"], momentum=self.hp["head_momentum"])
            return {**self.server["global"], **head}
        self.engine.set_params(self.server["global"])
        self.engine.fit(client, epochs=self.hp["finetune_epochs"], lr=self.hp["finetune_lr"])
        return self.engine.get_params()
