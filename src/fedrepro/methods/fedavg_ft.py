"""FedAvg-FT: FedAvg, then each client fine-tunes the global model's head on its own
train split (extractor frozen). Reported as two columns: the FedAvg global model and
the fine-tuned personalized model (the FT baseline of pFL-Bench and Calibre)."""

from __future__ import annotations

from . import register
from ._finetune import with_head_finetuning
from .fedavg import FedAvg

FedAvgFT = register(with_head_finetuning(
    FedAvg,
    name="fedavg_ft",
    summary="FedAvg + per-client fine-tuning of the head on frozen features",
    paper="McMahan et al. 2017 + fine-tuning as in Chen et al. pFL-Bench 2022 and Calibre (Chen et al. 2024)",
))
