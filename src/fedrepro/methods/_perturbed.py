"""Local training with a perturbed second gradient (one copy, two methods):

* SAM (Foret et al., ICLR 2021), FedSAM's local optimizer (Qu et al., ICML 2022): g = grad L(w);
  e = rho g / ||g||; g' = grad L(w + e); w <- base_step(w, g') (the fedgcr code's utils/sam.py);
* WPOptim (HarmoFL, Jiang, Wang, Dou, AAAI 2022): the same two steps with the radius alpha
  (utils/weight_perturbation.py: delta = alpha g / ||g||, add, re-compute, subtract, base step).

||g|| is the norm over all trainable parameters together (SAM's `_grad_norm`), + 1e-12.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import FitResult

GRAD_NORM_EPS = 1e-12


def perturbed_step(params: list[torch.Tensor], closure, radius: float, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One SAM / WP step. `closure()` computes the loss (a fresh forward) and back-propagates it;
    returns the loss at w (the one reported)."""
    opt.zero_grad(set_to_none=True)
    loss = closure()
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.norm(torch.stack([g.norm(2) for g in grads]), 2) if grads else torch.zeros(())
    scale = radius / (norm + GRAD_NORM_EPS)
    deltas = []
    with torch.no_grad():
        for p in params:
            d = p.grad * scale if p.grad is not None else None
            if d is not None:
                p.add_(d)
            deltas.append(d)
    opt.zero_grad(set_to_none=True)
    closure()  # the gradient at w + e
    with torch.no_grad():
        for p, d in zip(params, deltas):
            if d is not None:
                p.sub_(d)
    opt.step()
    return loss.detach()


def perturbed_fit(engine, client, radius: float) -> FitResult:
    """E local epochs of `perturbed_step` over the client's mini-batches (CE), the engine's
    configured optimizer as the base optimizer."""
    model = engine.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = engine.optimizer(params)
    model.train()
    total, seen, steps = torch.zeros((), device=engine.device), 0, 0
    for x, y in engine.batches(client):
        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        total += perturbed_step(params, closure, radius, opt) * len(y)
        seen += len(y)
        steps += 1
    return FitResult(float(total) / max(seen, 1), steps)
