"""APFL (Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv 2003.13461,
2020), Algorithm 1 with adaptive alpha.

Each sampled client holds w (a copy of the global model), its personal model v and its
mixing weight alpha (both kept on the client). Per mini-batch, all at the current point:
  w     <- w - lr * grad f(w)                                        (FedAvg local SGD)
  v     <- v - lr * grad_v f(vbar) = v - lr * alpha * grad f(vbar),  vbar = alpha v + (1 - alpha) w
  alpha <- clip(alpha - lr * (<v - w, grad f(vbar)> + reg * alpha), 0, 1)
The server averages the uploaded w (FedAvg). Personalized model: vbar = alpha v + (1 - alpha) w
with the client's own w after its local update (Algorithm 1's output v̄_i; PFLlib clientapfl
evaluates the same mixture of model_per and the client's trained model); the client keeps w
for that. Mixing with the current global model instead is a different model than the one
alpha was learned for: alpha drifts towards 0 when v is better than w, and the mixture then
collapses to the (weak, non-IID) global model. Global column: the global model.

The mixture is of the two models' parameters, as in the paper's interpolation (the
authors' FedTorch code mixes the outputs instead); buffers (BatchNorm statistics) are v's
own, tracked on vbar's activations. vbar lives in a second model object of the method: per
step it is written in one pass (w + alpha (v - w)) and gets a plain forward/backward, whose
gradient g = grad f(vbar) gives both chain-rule terms (v's alpha g, alpha's <v - w, g>), so a
step costs two standard passes plus a few element-wise ones (docs/throughput.md).
The `reg * alpha` term is PFLlib's / FedTorch's (0.02), not in the paper. PFLlib trains v on its own loss and then overwrites it with the
mixture; here v follows the paper's gradient at the mixture.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from . import register
from ..registry import Param
from .base import Params, Update, select
from .fedavg import FedAvg


def mixture(v: Params, w: Params, alpha: torch.Tensor | float, names) -> Params:
    """alpha v + (1 - alpha) w = w + alpha (v - w) on the parameters `names` (computed as the
    training step computes it); the other entries (buffers) are v's."""
    return {**v, **{k: torch.lerp(w[k], v[k], alpha) for k in names}}


def next_alpha(alpha: torch.Tensor, grad: torch.Tensor, lr: float, reg: float) -> torch.Tensor:
    """One projected gradient step on alpha (the regulariser adds reg * alpha), clipped to [0, 1]."""
    return (alpha - lr * (grad + reg * alpha)).clamp(0.0, 1.0)


@register
class APFL(FedAvg):
    name = "apfl"
    summary = "APFL: FedAvg global model + personal v mixed as alpha v + (1 - alpha) w, alpha learned per client"
    paper = "Deng, Kamani, Mahdavi, arXiv 2003.13461, 2020"
    hparams = {
        "alpha": Param(0.5, "initial mixing weight alpha of the personal model (FedTorch, the authors' code: 0.5; "
                       "FL-bench 0.5; PFLlib 1.0; Plato 0.75)", float, minimum=0, maximum=1),
        "adaptive_alpha": Param(True, "learn alpha per client by gradient (the paper's adaptive APFL); False keeps it fixed",
                                bool),
        "alpha_reg": Param(0.02, "weight of the regulariser gradient reg * alpha in alpha's step (PFLlib, FedTorch)",
                           float, minimum=0),
    }
    has_personal = True
    cost_passes = 2.0  # w and the mixture vbar: a forward and a backward each per batch
    _mixed: torch.nn.Module | None = None  # the second model object holding vbar (made at the first local update)

    def local_update(self, client, payload):
        engine, model = self.engine, self.engine.model
        engine.set_params(payload)  # w lives in the model object
        mixed = self._mixture_model()  # vbar lives in a second model object: a plain forward/backward
        names = [k for k, _ in model.named_parameters()]
        v = {k: t.clone() for k, t in client.state.get("v", payload).items()}
        w_list = [p for _, p in model.named_parameters()]
        v_list = [v[k] for k in names]
        vbar_list = [p for _, p in mixed.named_parameters()]
        with torch.no_grad():  # vbar's buffers (BatchNorm statistics) are v's own, tracked on vbar's activations
            for k, b in mixed.named_buffers():
                if k in v:
                    b.copy_(v[k])
        alpha = torch.tensor(float(client.state.get("alpha", self.hp["alpha"])), device=engine.device)
        opt_w = engine.optimizer(w_list)
        opt_v = engine.optimizer(v_list)
        model.train()
        mixed.train()
        total, seen = torch.zeros((), device=engine.device), 0
        diff = [torch.empty_like(t) for t in v_list]  # v - w at each step
        for x, y in engine.batches(client):
            with torch.no_grad():
                for vbar, w, v_k in zip(vbar_list, w_list, v_list):
                    torch.lerp(w, v_k, alpha, out=vbar)  # vbar = w + alpha (v - w): one pass, no graph
            loss = F.cross_entropy(model(x), y)
            mixed_loss = F.cross_entropy(mixed(x), y)
            opt_w.zero_grad(set_to_none=True)
            mixed.zero_grad(set_to_none=True)
            torch.autograd.backward([loss, mixed_loss])  # grad f(w) into w, g = grad f(vbar) into vbar
            with torch.no_grad():
                g = [p.grad for p in vbar_list]
                if self.hp["adaptive_alpha"]:  # d/d alpha f(vbar) = <v - w, g>, at the point before the steps
                    for d, v_k, w in zip(diff, v_list, w_list):
                        torch.sub(v_k, w, out=d)  # into buffers made once: no allocation per step
                    grad_alpha = sum(torch.vdot(d.reshape(-1), g_k.reshape(-1)) for d, g_k in zip(diff, g))
                torch._foreach_mul_(g, alpha)  # d/dv f(vbar) = alpha g, in vbar's gradient buffers (read above)
                for v_k, g_k in zip(v_list, g):
                    v_k.grad = g_k
            opt_w.step()
            opt_v.step()
            if self.hp["adaptive_alpha"]:
                alpha = next_alpha(alpha, grad_alpha, engine.lr, self.hp["alpha_reg"])
            total += loss.detach() * len(y)
            seen += len(y)
        with torch.no_grad():
            for k, b in mixed.named_buffers():
                if k in v:
                    v[k] = b.clone()
        client.state["v"] = {k: t.detach() for k, t in v.items()}
        client.state["w"] = engine.get_params()  # the client's own w: the mixture's partner (and the upload)
        client.state["alpha"] = float(alpha)
        return Update(client.id, client.num_train, select(client.state["w"], self.shared), loss=float(total) / max(seen, 1))

    def _mixture_model(self) -> torch.nn.Module:
        """The second model object that holds vbar during local training (made once per cell)."""
        if self._mixed is None:
            self._mixed = copy.deepcopy(self.engine.model)
        return self._mixed

    def personal_params(self, client):
        w = client.state.get("w", self.server["global"])  # a client that never trained holds the global model
        names = [k for k, _ in self.engine.model.named_parameters()]
        alpha = float(client.state.get("alpha", self.hp["alpha"]))
        return mixture(client.state.get("v", w), w, alpha, names)
