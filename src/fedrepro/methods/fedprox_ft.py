"""FedProx-FT: FedProx, then each client fine-tunes the global model's head on its own
train split (extractor frozen). Reported as two columns: the FedProx global model and the
fine-tuned personalized model."""

from __future__ import annotations

from . import register
from ._finetune import with_head_finetuning
from .fedprox import FedProx

FedProxFT = register(with_head_finetuning(
    FedProx,
    name="fedprox_ft",
    summary="FedProx + per-client fine-tuning of the head on frozen features",
    paper="Li et al. 2020 + fine-tuning as in Chen et al. pFL-Bench 2022 and Calibre (Chen et al. 2024)",
))
