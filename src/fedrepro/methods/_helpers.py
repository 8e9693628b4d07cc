"""Pieces that several methods share (one copy each, never pasted into a method)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .base import Params


def proximal_hook(anchor: Params, mu: float, prefixes: Iterable[str] = ("",)) -> Callable[[torch.nn.Module], None]:
    """A `before_step` hook adding mu * (w - anchor) to the gradients: the gradient of
    (mu / 2) * ||w - anchor||^2, i.e. PFLlib's PerturbedGradientDescent (FedProx's
    proximal term, Ditto's and pFedMe's pull towards the global model)."""
    prefixes = tuple(prefixes)
    diff: dict[str, torch.Tensor] = {}  # w - anchor, in buffers kept across steps (no temporaries per step)

    def hook(model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            if p.grad is not None and name.startswith(prefixes):
                buf = diff.get(name)
                if buf is None or buf.shape != p.shape:  # first step, or a vectorized fit's chunk of another size
                    buf = diff[name] = torch.empty_like(p)
                p.grad.add_(torch.sub(p.detach(), anchor[name], out=buf), alpha=mu)

    return hook


def class_prototypes(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean representations (C, d) and per-class counts (C,); classes the client
    lacks get a zero row and count 0 (FedProto, FedPAC, FedGH)."""
    counts = torch.bincount(labels, minlength=num_classes).to(features.dtype)
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    sums.index_add_(0, labels, features)
    return sums / counts.clamp(min=1)[:, None], counts
