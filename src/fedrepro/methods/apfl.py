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
own, tracked on vbar's activations. The `reg * alpha` term is PFLlib's / FedTorch's
(0.02), not in the paper. PFLlib trains v on its own loss and then overwrites it with the
mixture; here v follows the paper's gradient at the mixture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import register
from ..registry import Param
from .base import Params, Update, select
from .fedavg import FedAvg


def mixture(v: Params, w: Params, alpha: torch.Tensor | float, names) -> Params:
    """alpha v + (1 - alpha) w on the parameters `names`; the other entries (buffers) are v's."""
    return {**v, **{k: alpha * v[k] + (1 - alpha) * w[k] for k in names}}


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

    def local_update(self, client, payload):
        engine, model = self.engine, self.engine.model
        engine.set_params(payload)  # w lives in the model object
        names = [k for k, _ in model.named_parameters()]
        v = {k: t.clone() for k, t in client.state.get("v", payload).items()}
        for k in names:
            v[k].requires_grad_(True)
        alpha = torch.tensor(float(client.state.get("alpha", self.hp["alpha"])), device=engine.device,
                             requires_grad=self.hp["adaptive_alpha"])
        opt_w = engine.optimizer(model.parameters())
        opt_v = engine.optimizer([v[k] for k in names])
        model.train()
        total, seen = torch.zeros((), device=engine.device), 0
        for x, y in engine.batches(client):
            loss = F.cross_entropy(model(x), y)
            w = {k: p.detach() for k, p in model.named_parameters()}
            mixed_loss = F.cross_entropy(engine.forward_with(mixture(v, w, alpha, names), x), y)
            opt_w.zero_grad(set_to_none=True)
            opt_v.zero_grad(set_to_none=True)
            alpha.grad = None
            loss.backward()
            mixed_loss.backward()  # grads of v (alpha grad f(vbar)) and of alpha (<v - w, grad f(vbar)>)
            opt_w.step()
            opt_v.step()
            if self.hp["adaptive_alpha"]:
                with torch.no_grad():
                    alpha.copy_(next_alpha(alpha, alpha.grad, engine.lr, self.hp["alpha_reg"]))
            total += loss.detach() * len(y)
            seen += len(y)
        client.state["v"] = {k: t.detach() for k, t in v.items()}
        client.state["w"] = engine.get_params()  # the client's own w: the mixture's partner (and the upload)
        client.state["alpha"] = float(alpha.detach())
        return Update(client.id, client.num_train, select(client.state["w"], self.shared), loss=float(total) / max(seen, 1))

    def personal_params(self, client):
        w = client.state.get("w", self.server["global"])  # a client that never trained holds the global model
        names = [k for k, _ in self.engine.model.named_parameters()]
        alpha = float(client.state.get("alpha", self.hp["alpha"]))
        return mixture(client.state.get("v", w), w, alpha, names)
