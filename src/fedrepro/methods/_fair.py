"""Pieces shared by the loss-reweighting fairness methods: q-FFL, AFL, TERM and GRP-FED.

All four let the server re-weight the clients' uploads by how badly the global model does
on them. What they share, one copy each:

* `global_loss`         F_k(w^t): mean cross-entropy of the received global model on the
                        client's whole train split, before local training (q-FedAvg's
                        `c.get_loss()`, "with respect to the starting point");
* `LOSS_AT`             which loss a client reports: that one, or the running mean of its
                        local training loss (the FedGCR code's `train_losses`);
* `log_weights`         normalised weights from log-scores (a softmax in float64), so that
                        L^q with q = 10 or exp(t L) never overflow;
* `power_weights`       p_k = L_k^q / sum_j L_j^q = softmax(q log L_k) (GRP-FED, methods.md §3.3);
* `tilted_weights`      p_k exp(t L_k), normalised (TERM, client level);
* `project_simplex`     Euclidean projection onto the probability simplex (AFL);
* `qfedavg_step`        the exact q-FedAvg server update (Li et al., ICLR 2020, Algorithm 3);
* `LIPSCHITZ`, `lipschitz`  its L and the one convention for it (null = 1 / the round's lr), shared
                        by q-FFL and GRP-FED so that both run the same step; `check_lipschitz`
                        refuses null under momentum or an adaptive optimizer (Adam, AdamW, LARS),
                        where 1/lr is not plain SGD's estimate and the step all but vanishes;
* `mix`                 sum_k w_k theta_k over the uploads with given weights;
* `LossWeighted`        FedAvg whose clients report F_k and whose server mixes the uploads
                        with loss-based weights (the base of q-FFL, AFL and TERM).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from ..registry import ConfigError, Param
from .base import FORWARD_SHARE, Params, Passes, Update
from .fedavg import FedAvg

LOSS_FLOOR = 1e-10  # q-FedAvg's `loss + 1e-10`: log L and L^(q-1) stay finite for a perfectly fitted client

LOSS_AT = Param("start", "which loss F_k a client reports to the server: 'start' = mean CE of the received global model "
                         "on its whole train split before local training (q-FFL's F_k(w^t), the q-FedAvg and FLGo code); "
                         "'train' = the running mean of its local training loss (the FedGCR code's train_losses)",
                str, choices=("start", "train"))

WEIGHT_BY_SIZE = Param(False, "also multiply each client's weight by its train size n_k (q-FFL's objective sum_k p_k F_k^(q+1) "
                              "with p_k = n_k / n, whose clients are *sampled* proportionally to p_k; the engine samples "
                              "uniformly). False: the weights depend on the losses only, as in methods.md §3.3 and the "
                              "q-FedAvg / FLGo / FedGCR code", bool)

LIPSCHITZ = Param(None, "L, the Lipschitz estimate in q-FedAvg's Δw_k = L (w - w_k) and h_k; null = 1 / the round's local "
                        "learning rate of plain SGD, as in the q-FFL paper and its code (the FedGCR code hard-codes 1/0.001); "
                        "with momentum m, 1 / (lr / (1 - m)) is the plain-SGD equivalent; under Adam / AdamW / LARS null is "
                        "refused (give 1 / the SGD step size tuned for FedAvg, or train the label with plain SGD)",
                  float, exclusive_minimum=0)


def lipschitz(hp, engine) -> float:
    """q-FedAvg's L for this round: the `lipschitz` hyper-parameter, or 1 / the round's learning rate."""
    return hp["lipschitz"] or 1.0 / engine.lr


#: optimizers whose step does not scale with the gradient (Adam's ~lr per coordinate, LARS's trust ratio)
ADAPTIVE_OPTIMIZERS = ("adam", "adamw", "lars")


def check_lipschitz(where: str, hp: dict, training: dict) -> None:
    """Refuse q-FedAvg with L = 1/lr (`lipschitz: null`) where 1/lr is not plain SGD's estimate.

    * Momentum m: the step is 1/(1 - m) times longer, and the step sum_k Δ_k / sum_k h_k then shrinks
      to a few percent of FedAvg's (c ≈ 0.02 on grp_fed_cpu): the model silently freezes.
    * An adaptive optimizer (Adam, AdamW, LARS): q-FedAvg takes L (w - w_k) for the clients' gradients
      (Li et al., ICLR 2020, Algorithm 3: exact for local SGD with step 1/L); an Adam step moves every
      coordinate by about lr whatever the gradient's scale, so ||(w - w_k) / lr||^2 grows with the
      number of parameters and steps, not with ||∇F_k||^2, the q term of h_k dominates and the server
      moves a fraction of FedAvg's step (fedgcr_cpu, AdamW lr 3e-3: q L ||w - w_k||^2 / F_k ≈ 5.5-6.7,
      11-14 % of FedAvg's step every round; Avg 44.4 after 30 rounds against FedAvg's 61.6, 61.8 at q = 0)."""
    opt = training["optimizer"]
    if hp["lipschitz"] is not None:
        return
    name = opt["name"]
    if name in ADAPTIVE_OPTIMIZERS:
        raise ConfigError(f"config key '{where}.lipschitz' has value null (L = 1/lr = {1 / opt['lr']:g}) with {name}, "
                          f"whose steps do not scale with the gradient, so q-FedAvg's L (w - w_k) no longer estimates "
                          f"it and its step shrinks to a fraction of FedAvg's; allowed: an explicit L (q-FFL's estimate: "
                          f"1 / the plain-SGD step size tuned for FedAvg), or plain SGD as this label's optimizer "
                          f"({where.removesuffix('.hparams')}.training.optimizer: {{name: sgd, lr: ...}}), q-FFL's own local solver")
    momentum = opt.get("momentum") or 0.0
    if momentum > 0:
        raise ConfigError(f"config key '{where}.lipschitz' has value null (L = 1/lr = {1 / opt['lr']:g}) with "
                          f"{name} momentum {momentum:g}, under which q-FedAvg's step all but vanishes; allowed: an "
                          f"explicit L, e.g. the momentum-equivalent 1 / (lr / (1 - momentum)) = "
                          f"{(1 - momentum) / opt['lr']:g}, or an optimizer without momentum")


# -- the reported loss --------------------------------------------------------------------

@torch.no_grad()
def global_loss(engine, client, params: Params) -> float:
    """F_k(w): mean cross-entropy of `params` on the client's whole train split, in eval
    mode, without augmentation and without touching any random stream. Leaves `params`
    in the model object."""
    engine.set_params(params)
    model = engine.model
    model.eval()
    x, y = client.train.x, client.train.y
    bs = engine.training["eval_batch_size"]
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    for i in range(0, len(y), bs):
        total += F.cross_entropy(model(x[i : i + bs]), y[i : i + bs], reduction="sum").double()
    return float(total) / max(len(y), 1)


# -- weights --------------------------------------------------------------------------------

def log_weights(scores: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """softmax(scores) in float64: w_k = exp(s_k) / sum_j exp(s_j), stable for any scale."""
    return torch.softmax(torch.as_tensor(scores, dtype=torch.float64), 0)


def _log_losses(losses: Sequence[float]) -> torch.Tensor:
    return torch.as_tensor(losses, dtype=torch.float64).clamp(min=LOSS_FLOOR).log()


def power_weights(losses: Sequence[float], q: float, sizes: Sequence[float] | None = None) -> torch.Tensor:
    """p_k = n_k L_k^q / sum_j n_j L_j^q computed as softmax(q log L_k + log n_k) (n_k = 1 when
    `sizes` is None). q = 0 gives uniform (or size-proportional) weights; q -> inf the max-loss client."""
    scores = q * _log_losses(losses)
    if sizes is not None:
        scores = scores + torch.as_tensor(sizes, dtype=torch.float64).log()
    return log_weights(scores)


def tilted_weights(losses: Sequence[float], t: float, sizes: Sequence[float]) -> torch.Tensor:
    """TERM's client-level tilt: p_k exp(t L_k) / sum_j p_j exp(t L_j), p_k ∝ n_k, as softmax(t L_k + log n_k)."""
    scores = t * torch.as_tensor(losses, dtype=torch.float64) + torch.as_tensor(sizes, dtype=torch.float64).log()
    return log_weights(scores)


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of a vector onto the probability simplex {x >= 0, sum x = 1}
    (sort-based: u = sort(v) descending, rho = max{j : u_j + (1 - sum_{i<=j} u_i) / j > 0},
    theta = (1 - sum_{i<=rho} u_i) / rho, x = max(v + theta, 0); fair_flearn's / FLGo's /
    FedGCR's `project`)."""
    v = torch.as_tensor(v).detach().to("cpu", torch.float64)
    u = torch.sort(v, descending=True).values
    css = torch.cumsum(u, 0)
    j = torch.arange(1, len(v) + 1, dtype=torch.float64)
    rho = int(torch.nonzero(u + (1 - css) / j > 0).max()) + 1
    theta = (1 - css[rho - 1]) / rho
    return (v + theta).clamp(min=0)


def loss_std(losses: Sequence[float]) -> float:
    """Population standard deviation of the reported losses (0 for a single client)."""
    t = torch.as_tensor(losses, dtype=torch.float64)
    return float(t.std(unbiased=False)) if len(t) else 0.0


# -- aggregation ------------------------------------------------------------------------------

def mix(updates: list[Update], weights: Sequence[float] | torch.Tensor) -> Params:
    """sum_k w_k theta_k over the uploads' float tensors (the weights are used as given);
    integer buffers (BatchNorm's num_batches_tracked) keep their maximum, as in FedAvg."""
    weights = [float(w) for w in weights]
    out: Params = {}
    for name, ref in updates[0].params.items():
        if ref.is_floating_point():
            acc = torch.zeros_like(ref)
            for w, u in zip(weights, updates):
                acc.add_(u.params[name], alpha=w)
            out[name] = acc
        else:
            out[name] = torch.stack([u.params[name] for u in updates]).max(0).values
    return out


def qfedavg_step(w: Params, updates: list[Update], losses: Sequence[float], q: float, lipschitz: float,
                 param_names: Iterable[str], sizes: Sequence[float] | None = None) -> Params:
    """The exact q-FedAvg server update (Li, Sanjabi, Beirami, Smith, ICLR 2020, Algorithm 3):

        Δw_k = L (w^t - w_k),   Δ_k = F_k^q Δw_k,   h_k = q F_k^(q-1) ||Δw_k||^2 + L F_k^q,
        w^(t+1) = w^t - sum_k Δ_k / sum_k h_k.

    F_k^q is never formed: numerator and denominator are both divided by max_j F_j^q, i.e.
    s_k = exp(q log F_k - max_j q log F_j) and h_k / max F^q = s_k (q ||Δw_k||^2 / F_k + L).
    ||Δw_k||^2 runs over `param_names` (the trainable parameters, as the reference code's
    norm over the model's variables); the same step is applied to every float entry
    (BatchNorm running statistics follow the weights); integer buffers keep the maximum.
    `sizes` (optional) multiplies Δ_k and h_k by n_k. At q = 0 the step is the plain mean of the w_k.
    """
    param_names = [k for k in param_names if k in w]
    log_f = _log_losses(losses)
    scores = q * log_f
    if sizes is not None:
        scores = scores + torch.as_tensor(sizes, dtype=torch.float64).log()
    s = torch.exp(scores - scores.max())
    f = log_f.exp()
    sq_norms = [lipschitz**2 * sum(float(((w[k].double() - u.params[k].double()) ** 2).sum()) for k in param_names)
                for u in updates]
    h = sum(float(s_k) * (q * n2 / float(f_k) + lipschitz) for s_k, n2, f_k in zip(s, sq_norms, f))
    # w - sum_k s_k L (w - w_k) / h  =  w + sum_k c_k (w_k - w),  c_k = s_k L / h  (sum_k c_k <= 1)
    coef = [float(s_k) * lipschitz / h for s_k in s]
    out: Params = {}
    for name, ref in w.items():
        if name not in updates[0].params:
            continue
        if ref.is_floating_point():
            acc = ref.clone()
            for c, u in zip(coef, updates):
                acc.add_(u.params[name] - ref, alpha=c)
            out[name] = acc
        else:
            out[name] = torch.stack([u.params[name] for u in updates]).max(0).values
    return out


# -- the base method ----------------------------------------------------------------------------

class LossWeighted(FedAvg):
    """FedAvg whose clients also report their loss F_k (Update.extras["loss"]) and whose
    server sets theta <- sum_k w_k theta_k with weights from `aggregation_weights`."""

    @classmethod
    def cost_passes_for(cls, hp, training):
        # loss_at 'start': F_k(w^t), a forward over the train split, before the local epochs
        return Passes(1 + (FORWARD_SHARE / training["local_epochs"] if hp.get("loss_at") == "start" else 0.0))

    def local_update(self, client, payload):
        start = global_loss(self.engine, client, payload) if self.hp["loss_at"] == "start" else None
        update = super().local_update(client, payload)
        update.extras["loss"] = update.loss if start is None else start
        return update

    def aggregate(self, updates):
        if not updates:
            return
        weights = self.aggregation_weights(updates)
        self.server["global"] = {**self.server["global"], **mix(updates, weights)}

    def aggregation_weights(self, updates: list[Update]) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def losses(updates: list[Update]) -> list[float]:
        return [float(u.extras["loss"]) for u in updates]

    @staticmethod
    def sizes(updates: list[Update]) -> list[float]:
        return [float(u.num_samples) for u in updates]

    def trainable_names(self) -> list[str]:
        return [k for k, _ in self.engine.model.named_parameters()]
