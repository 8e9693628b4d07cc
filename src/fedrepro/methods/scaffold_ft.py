"""SCAFFOLD-FT (a Calibre baseline): SCAFFOLD, then each client fine-tunes the global
model's head on its own train split (extractor frozen). Reported as two columns: the
SCAFFOLD global model and the fine-tuned personalized model."""

from __future__ import annotations

from . import register
from ._finetune import with_head_finetuning
from .scaffold import Scaffold

ScaffoldFT = register(with_head_finetuning(
    Scaffold,
    name="scaffold_ft",
    summary="SCAFFOLD + per-client fine-tuning of the head on frozen features",
    paper="Karimireddy et al. 2020 + fine-tuning as in Calibre (Chen et al. 2024, methods.md §6)",
))
