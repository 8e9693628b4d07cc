"""FedPAC (Xu, Tong, Huang, "Personalized Federated Learning with Feature Alignment and
Classifier Collaboration", ICLR 2023).

Algorithm, per round on each sampled client i (extractor f = "extractor.", head g = "head."):
  1. receive the global extractor and the global prototypes c; with the received f compute
     the feature statistics h_i[c] = p_i(c) mu_i[c] and V_i = E||f(x) e_y^T - h_i||^2_F;
  2. train the head for `head_epochs` (1) with f frozen (CE, lr `head_lr`);
  3. train f for `local_epochs` with g frozen on CE + lambda * MSE(f(x), c[y]);
  4. upload f, g, the class prototypes (with class counts) and (V_i, h_i).
Server: f <- FedAvg; c[k] <- sum_i n_ik c_ik / sum_i n_ik; and for each sampled client i
  alpha_i = argmin_{alpha in simplex} sum_j alpha_j^2 V_j / n_j + ||sum_j alpha_j (h_i - h_j)||^2,
  g_i <- sum_j alpha_ij g_j (weights below 1e-3 zeroed and the rest renormalised).

The QP is the paper's estimate of the test loss of a combined linear classifier (the
variance V_j / n_j of client j's head plus the squared bias between client i's and j's
feature-label statistics), written here as the official code builds it (JianXu95/FedPAC
tools.get_head_agg_weight and statistics_extraction; PFLlib serverpac/clientpac copy them):
P_jk = V_j/n_j [j = k] + <h_i - h_j, h_i - h_k>_F, minimise alpha^T P alpha on the simplex.
P is PSD by construction; it is solved with scipy SLSQP from the uniform point (the code
uses cvxpy, not available here; its eigenvalue clipping, which only guards round-off, is
replaced by clipping V at 0 and computing V in float64). V_i and h_i are computed with the
received extractor before local training, over the train split in eval mode (both codes).

Choices (../shared/reference/methods.md §6):
* Prototypes: sample-weighted per class (paper, official tools.protos_aggregation);
  [PAPER≠CODE] PFLlib averages unweighted: `proto_weighting: clients`. As in PFLlib, a
  sample whose class has no global prototype adds no alignment term (the official code
  uses the client's pre-training local prototype there).
* Head phase: 1 epoch at lr 0.1 (official code lr_g = 0.1; FL-bench); PFLlib uses the
  model's lr (`head_lr: null`). The optimizer kind, momentum and weight decay are the cell's.
  BatchNorm running statistics (where a model keeps them) still move in train mode during
  the head phase, as in both codes; the extractor's parameters do not.
* The reported training loss is that of the extractor phase (step 3).
* Personalized model = global extractor + the client's combined head (a client not yet
  sampled keeps the initial head). "Global" column = the sample-weighted average of all
  clients' personalized models = global extractor + sample-weighted average of their heads
  (FedCRC Table II convention, methods.md §1.6, as FedPer/FedRep here).
"""

from __future__ import annotations

import numpy as np
import torch

from ..registry import Param
from . import register
from ._helpers import class_prototypes
from ._prototypes import (aggregate_prototypes, alignment_loss, empty_prototypes, known_prototypes, local_prototypes,
                          weighting_param)
from .base import FORWARD_SHARE, Method, Passes, Update, select, weighted_average

ALPHA_EPS = 1e-3  # combination weights at or below this are zeroed (official code and PFLlib: eps = 1e-3)


def feature_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V, h) of one client: h[c] = p(c) mu[c] (C, d), the feature-label correlation
    E[f(x) e_y^T] with p the client's label distribution and mu[c] its class means, and
    V = E||f(x) e_y^T - h||_F^2 = sum_c p(c) E[||f(x)||^2 | c] - sum_c p(c)^2 ||mu[c]||^2
    (official code: sum_c p_c tr(E[z z^T | c]) - p_c^2 ||mu_c||^2, before its division by n)."""
    z = features.double()  # V is a difference of two close sums: computed in float64
    mu, counts = class_prototypes(z, labels, num_classes)
    h = (counts / counts.sum())[:, None] * mu
    v = ((z * z).sum(1).mean() - (h * h).sum()).clamp(min=0)
    return v, h.to(features.dtype)


def combination_weights(variances: np.ndarray, stats: np.ndarray, i: int) -> np.ndarray:
    """Client i's classifier-combination weights over the m clients of the round:
    argmin_{alpha >= 0, sum alpha = 1} sum_j alpha_j^2 variances[j] + ||sum_j alpha_j (stats[i] - stats[j])||^2,
    with variances[j] = V_j / n_j and stats (m, ...) the h_j. Weights <= ALPHA_EPS are zeroed and
    the rest renormalised; if the solver fails, the client keeps its own head (one-hot i),
    as the official code does when it has no solution."""
    v = np.clip(np.asarray(variances, dtype=np.float64), 0.0, None)
    m = len(v)
    delta = np.asarray(stats, dtype=np.float64).reshape(m, -1)
    delta = delta[i] - delta
    p = np.diag(v) + delta @ delta.T
    p = (p + p.T) / 2
    scale = np.abs(p).max()
    if m == 1 or not np.isfinite(scale):
        return np.eye(m)[i]
    if scale == 0:  # every client identical and noiseless: any alpha is optimal
        return np.full(m, 1.0 / m)
    p = p / scale  # the minimiser is scale-free; this keeps SLSQP's tolerances meaningful
    from scipy.optimize import minimize  # here: scipy.optimize is a costly import that only FedPAC needs

    res = minimize(lambda a: a @ p @ a, np.full(m, 1.0 / m), jac=lambda a: 2 * p @ a, method="SLSQP",
                   bounds=[(0.0, 1.0)] * m,
                   constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones(m)}],
                   options={"ftol": 1e-12, "maxiter": 1000})
    if not res.success:
        return np.eye(m)[i]
    alpha = np.clip(res.x, 0.0, None)
    alpha[alpha <= ALPHA_EPS] = 0.0
    return alpha / alpha.sum()


@register
class FedPAC(Method):
    name = "fedpac"
    summary = "FedPAC: prototype-aligned extractor (FedAvg) + per-client QP-weighted combination of the clients' heads"
    paper = "Xu, Tong, Huang, ICLR 2023"
    hparams = {
        "lam": Param(1.0, "lambda: weight of MSE(representation, global prototype of its label) (PFLlib, FL-bench: 1.0)",
                     float, minimum=0),
        "head_epochs": Param(1, "epochs of head training with the extractor frozen, before the extractor phase "
                                "(paper and official code: 1)", int, minimum=0),
        "head_lr": Param(0.1, "learning rate of the head phase (official code lr_g and FL-bench: 0.1); null = the "
                              "round's learning rate (PFLlib)", (float, type(None)), exclusive_minimum=0),
        "proto_weighting": weighting_param("samples", "default 'samples' (paper, official code); PFLlib: 'clients'"),
    }
    shared = ("",)  # the extractor and the heads go up; the extractor and each client's combined head come down
    has_global = True  # the average of the personalized models (module docstring)
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # head epochs through the frozen extractor (a forward each: the backward stops at the head), and
        # two forwards over the train split (statistics before, prototypes after), beside the local epochs
        return Passes(1 + (hp["head_epochs"] + 2) * FORWARD_SHARE / training["local_epochs"])

    def setup(self):
        super().setup()  # server["global"]: extractor = the global one; its head is unused
        self.server["init_head"] = self.engine.get_params(("head.",))
        self.server.update(empty_prototypes(self.engine.num_classes, self.engine.model.feature_dim, self.engine.device))

    def head(self, client):
        return client.state.get("head", self.server["init_head"])

    def broadcast(self, client):
        return {"model": self.personal_params(client), "protos": known_prototypes(self.server)}

    # -- client ---------------------------------------------------------------------
    def local_update(self, client, payload):
        eng = self.engine
        eng.set_params(payload["model"])
        v, h = feature_statistics(eng.features(client.train.x), client.train.y, eng.num_classes)
        self.train_head(client)
        fit = self.train_extractor(client, payload["protos"])
        extras = {"V": v, "h": h, **local_prototypes(eng, client, with_counts=self.hp["proto_weighting"] == "samples")}
        return Update(client.id, client.num_train, eng.get_params(), extras=extras, loss=fit.loss)

    def train_head(self, client):
        return self.engine.fit(client, epochs=self.hp["head_epochs"], trainable=("head.",), lr=self.hp["head_lr"])

    def train_extractor(self, client, protos):
        loss_fn = alignment_loss(protos, self.engine.num_classes, self.hp["lam"])
        return self.engine.fit(client, trainable=("extractor.",), loss_fn=loss_fn)

    # -- server ---------------------------------------------------------------------
    def aggregate(self, updates):
        if not updates:
            return
        eng = self.engine
        self.server["global"] = {**self.server["global"], **select(weighted_average(updates), ("extractor.",))}
        self.server.update(aggregate_prototypes([u.extras for u in updates], eng.num_classes, eng.model.feature_dim,
                                                self.hp["proto_weighting"], eng.device))
        variances = np.array([float(u.extras["V"]) / u.num_samples for u in updates])
        stats = torch.stack([u.extras["h"] for u in updates]).double().cpu().numpy()
        heads = [select(u.params, ("head.",)) for u in updates]
        for i, u in enumerate(updates):
            alpha = combination_weights(variances, stats, i)
            eng.client(u.client_id).state["head"] = {
                k: sum(float(a) * hd[k] for a, hd in zip(alpha, heads) if a > 0) for k in heads[i]}

    # -- evaluation -------------------------------------------------------------------
    def personal_params(self, client):
        return {**select(self.server["global"], ("extractor.",)), **self.head(client)}

    def global_params(self):
        # the personalized models share the extractor, so their average is it + the average head
        heads = [Update(c.id, c.num_train, self.head(c)) for c in self.engine.clients]
        return {**select(self.server["global"], ("extractor.",)), **weighted_average(heads)}
