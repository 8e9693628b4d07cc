"""Optimizers and the learning-rate schedule of local training.

Owns the optimizer registry (`OPTIMIZERS`: the config's `training.optimizer.name` -> a torch
optimizer over given parameters, LARS included; `lever_options`: torch's options the levers of a vectorized round turn on) and `lr_at`, the learning rate of a round
under `training.lr_schedule` (constant, multistep, cosine). Both are pure functions of the
config: the engine builds a fresh optimizer for every fit at the round's rate.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch


def lars(params, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """lightly's LARS with the trust coefficient 0.02 of Calibre's paper-era config (eta_lars,
    methods.md §2.5); biases and normalisation weights (1-D tensors) are excluded from the layer-wise
    adaptation and the weight decay, as there."""
    from lightly.utils.lars import LARS

    params = list(params)
    groups = [{"params": [p for p in params if p.ndim > 1]}, {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    return LARS([g for g in groups if g["params"]], lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=0.02)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr, momentum, weight_decay, **options: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **options),
    "lars": lars,
    "adam": lambda params, lr, momentum, weight_decay, **options: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, **options),
    "adamw": lambda params, lr, momentum, weight_decay, **options: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **options),
}


def lever_options(name: str, levers: frozenset[str] | set[str], device: torch.device) -> dict[str, bool]:
    """torch's options of optimizer `name` under `training.levers`: its fused step (`fused_step`;
    config.FUSED_OPTIMIZERS have one) and, for a step captured in a CUDA graph (`cuda_graph`), Adam's
    step count on the device (torch refuses to capture it otherwise; SGD keeps no count)."""
    options = {"fused": True} if "fused_step" in levers else {}
    if "cuda_graph" in levers and device.type == "cuda" and name in ("adam", "adamw"):
        options["capturable"] = True
    return options


def lr_at(schedule: dict[str, Any], base_lr: float, round: int) -> float:
    """Learning rate of a (1-based) round: constant, multistep (gamma or explicit values) or cosine."""
    name = schedule["name"]
    if name == "constant":
        return base_lr
    if name == "multistep":
        passed = sum(round > m for m in schedule["milestones"])
        if schedule.get("values"):
            return schedule["values"][passed]
        return base_lr * schedule["gamma"] ** passed
    if name == "cosine":
        total = schedule["total_rounds"]
        return schedule["min_lr"] + 0.5 * (base_lr - schedule["min_lr"]) * (1 + math.cos(math.pi * (round - 1) / max(1, total)))
    raise ValueError(f"unknown lr schedule {name!r}")


def round_lr(training: dict[str, Any], round: int) -> float:
    """The learning rate of a cell's local training in `round` under its `training` settings
    (before the first round, round 1's)."""
    return lr_at(training["lr_schedule"], training["optimizer"]["lr"], max(round, 1))
