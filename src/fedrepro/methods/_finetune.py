"""The fine-tuning wrapper: any global-model method + per-client head fine-tuning.

`with_head_finetuning(Base)` returns a subclass whose personalized model is the
method's global model with its head fine-tuned on the client's train split, the
extractor frozen (a linear probe on frozen features when the head is linear). Used by
fedavg_ft and, later, fedprox_ft and scaffold_ft: one helper, no copies.
Defaults follow Calibre's personalization recipe for FedAvg-FT / SCAFFOLD-FT
(../shared/reference/methods.md §6: 10 epochs, SGD lr 0.05, batch 32);
`ft_momentum` 0.9 is [RECON] from the paper-era Calibre config (methods.md §2.5; ledger entry
calibre.ft_momentum in config/papers/published/readings/calibre.yaml).
"""

from __future__ import annotations

from ..registry import Param
from .base import Method, PersonalWork

FINETUNE_HPARAMS = {
    "ft_epochs": Param(10, "head fine-tuning epochs on the client's train split (Calibre recipe)", int, minimum=0),
    "ft_lr": Param(0.05, "fine-tuning SGD learning rate (Calibre recipe)", float, exclusive_minimum=0),
    "ft_batch_size": Param(32, "fine-tuning batch size (Calibre recipe)", int, minimum=1),
    "ft_momentum": Param(0.9, "fine-tuning SGD momentum; [RECON] from Calibre's paper-era config (methods.md §2.5)", float, minimum=0),
    "ft_fresh_head": Param(False, "fine-tune a fresh head (the seeded initial one) instead of the global model's: Calibre's "
                                  "personalization stage (a new linear classifier on the frozen encoder)", bool),
}


def finetuned_personal_params(method: Method, params: dict, client) -> dict:
    """`params` with its head fine-tuned on the client's frozen train features (`method.hp`'s ft_*)."""
    hp = method.hp
    head = method.engine.finetune_head(params, client, epochs=hp["ft_epochs"], lr=hp["ft_lr"], batch_size=hp["ft_batch_size"],
                                       momentum=hp["ft_momentum"], fresh=hp["ft_fresh_head"])
    return {**params, **head}


def finetune_work(hp: dict) -> PersonalWork:
    """The work of `finetuned_personal_params` per client: the ft_* epochs of head steps on frozen features."""
    return PersonalWork(head_epochs=hp["ft_epochs"], head_batch_size=hp["ft_batch_size"])


def with_head_finetuning(base: type[Method], name: str, summary: str, paper: str) -> type[Method]:
    """A subclass of `base` named `name` whose personalized model is a fine-tuned head."""

    def personal_params(self, client):
        return finetuned_personal_params(self, self.global_params(), client)

    return type(base.__name__ + "FT", (base,), {
        "name": name,
        "summary": summary,
        "paper": paper,
        "hparams": {**base.hparams, **FINETUNE_HPARAMS},
        "has_personal": True,
        "vectorized": base.__dict__.get("vectorized", False),  # fine-tuning changes evaluation, not the local update
        "personal_params": personal_params,
        "cost_personal_for": classmethod(lambda cls, hp, training: finetune_work(hp)),
        "finetune_base": base,  # a derived fine-tuning row re-scores `base`'s final model (engine/finetune.py)
        "__doc__": f"{base.__name__} followed by per-client head fine-tuning.",
        "__module__": base.__module__,
    })
