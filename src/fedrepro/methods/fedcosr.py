"""FedCoSR (Huang et al., "Federated Contrastive Shareable Representations", arXiv 2404.17916).

Algorithm 1 (representation layers phi = "extractor.", projection layer pi = "head."):
  Server, round t:
    phi^G = sum_i |D^i|/|D| phi_i                                         (Eq. 5, FedAvg)
    w^G_c = sum_{i in N_c} |D^i_c| w^i_c / sum_{i in N_c} |D^i_c|, per class  (Eq. 6)
  Client i, round t+1 (pi never leaves the client):
    1. tau = exp(-gamma * L^i_Reg,t)                                       (Eq. 7)
       phi_hat = tau * phi_i + (1 - tau) * phi^G;  theta_hat = [phi_hat; pi_i]  (Eq. 8-9)
       first participation: phi_hat = phi^G and alpha = 0                  (lines 4-6)
    2. train theta_hat on CE + alpha * InfoNCE (Eq. 14-15); for a sample of class c,
       InfoNCE = -log softmax_c( cos(w, w^G_k) / tau_CL ) over the classes k with a global
       centroid (positive: its own class; `negatives: centroids` [RECON]: the others, Definition 2;
       'with_batch' adds the batch's samples of other classes; centroids are constants)
    3. upload phi_i and the class centroids w^i_c = mean representation of class c, with |D^i_c|.

Readings (../shared/reference/methods.md §4; each marked one is a hyper-parameter below with an entry
in the readings ledger config/papers/published/readings/fedcosr.yaml, issue 35):
* The paper gives no value for `alpha`, `gamma` or `tau_cl` [RECON] (methods.md §4.4: 1.0, 1.0, 0.5).
* Lines 4-6 (overwrite with theta^G, alpha = 0) are the paper's initial round of all clients;
  here they apply at each client's first participation (the same under full participation).
* L_Reg,t is measured during every local training with global centroids, also when alpha = 0
  (first participation, `contrastive: false`), so the loss-wise aggregation keeps working in the
  w/o-CRL ablation. A client without one (no centroid existed yet) takes phi^G (tau = 0).
  A sample whose class has no global centroid has no positive and adds no InfoNCE term.
* Personalized model: Algorithm 1 outputs theta_hat (the locally aggregated model), and PFLlib
  evaluates right after send_models (where its FedALA runs the local aggregation); so by default a client's
  model is [tau phi_i + (1 - tau) phi^G; pi_i] with the current phi^G and its latest L_Reg
  (phi^G with the initial head before its first training). `personal_model: trained` gives the
  model right after its last local training instead.
* No global model is evaluated (the heads are private; the paper reports personalized
  accuracy only): has_global = False.
* The representation omega is the extractor's output: with `fedavg_cnn` (PFLlib's FedAvgCNN,
  methods.md §4.1) the output of fc1 after its ReLU, so omega >= 0 and every cosine in Eq. 13 is
  >= 0 (InfoNCE >= log(1 + (C - 1) exp(-1 / tau_CL)), 0.80 for C = 10, tau_CL = 0.5). The paper
  says only that the flattened conv output "is passed through a FC layer with k output features,
  where k is the dimension of shareable representations" (§V-A5) and names no activation there.
  This is the model's choice, not a FedCoSR hyper-parameter (reported in issue 35).
* Ablations (paper Fig. 8): `local_aggregation: false` = w/o LA (always phi^G), `split: false` =
  w/o Sep (the whole model travels, is aggregated and locally mixed), `contrastive: false` =
  w/o CRL (alpha = 0).
* The server keeps only the round's centroids (as FedProto/FedPAC here): a class no sampled
  client holds has no global centroid that round (the paper has full participation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..registry import Param
from . import register
from ._prototypes import aggregate_prototypes, dense, empty_prototypes, known_prototypes, local_prototypes
from .base import FORWARD_SHARE, Method, Params, Passes, Update, select, weighted_average


def info_nce(z: torch.Tensor, y: torch.Tensor, centroids: torch.Tensor, present: torch.Tensor,
             tau_cl: float, batch_negatives: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 13: the mean over the samples whose class has a global centroid (the others have no
    positive) of -log exp(cos(z, w_y)/tau_cl) / sum_{k present} exp(cos(z, w_k)/tau_cl), and the
    number of such samples (0: the mean is 0). With `batch_negatives`, the denominator also sums
    exp(cos(z, z_m)/tau_cl) over the batch's samples m of another class (gradient through both).
    Needs a present class; no host sync."""
    keep = present[y]
    u = F.normalize(z, dim=1)
    sim = (u @ F.normalize(centroids, dim=1).T / tau_cl).masked_fill(~present, float("-inf"))
    if batch_negatives:  # columns after the classes: the batch's other-class samples
        sim = torch.cat([sim, (u @ u.T / tau_cl).masked_fill(y[:, None] == y[None, :], float("-inf"))], dim=1)
    nll = F.cross_entropy(sim, torch.where(keep, y, present.int().argmax()), reduction="none")  # finite everywhere
    n = keep.sum()
    return torch.where(keep, nll, 0.0).sum() / n.clamp(min=1), n


def mix(local: Params, glob: Params, tau: float) -> Params:
    """Eq. 8 on the entries of `glob`: tau * local + (1 - tau) * global (integer buffers: global)."""
    return {k: tau * local[k] + (1 - tau) * g if g.is_floating_point() else g for k, g in glob.items()}


@register
class FedCoSR(Method):
    name = "fedcosr"
    summary = "FedCoSR: shared extractor + count-weighted class centroids; loss-wise local mix; CE + InfoNCE"
    paper = "Huang et al., arXiv:2404.17916"
    hparams = {
        "alpha": Param(1.0, "weight of the InfoNCE term (Eq. 14). [RECON] reconstructed: the paper gives no value",
                       float, minimum=0),
        "gamma": Param(1.0, "sensitivity of tau = exp(-gamma L_Reg) (Eq. 7). [RECON] reconstructed: the paper gives "
                            "no value", float, exclusive_minimum=0),
        "tau_cl": Param(0.5, "InfoNCE temperature tau_CL (Eq. 13). [RECON] reconstructed: the paper gives no value",
                        float, exclusive_minimum=0),
        "reg_loss_over": Param("last_epoch", "[RECON] reconstructed: which batches' InfoNCE values are averaged into "
                                             "L_Reg (the paper says 'at iteration t'; methods.md §4.3: the last "
                                             "epoch; equal for R = 1)", str, choices=("last_epoch", "all_epochs")),
        "centroids": Param("eval", "[RECON] reconstructed: Eq. 3 does not say with which model state: 'eval' = after "
                                   "local training, eval mode, no grad, whole train split (methods.md §4.2); 'train' = "
                                   "mean of the representations seen during local training", str, choices=("eval", "train")),
        "clip_params": Param(False, "[RECON] reconstructed: Algorithm 1 line 22 'clip it into [0, 1]' is ambiguous and "
                                    "tau is already in (0, 1]; false = no clipping (methods.md §4.3), true = clamp the "
                                    "trained parameters into [0, 1] literally", bool),
        "personal_model": Param("aggregated", "[RECON] reconstructed: evaluated model: 'aggregated' = theta_hat "
                                              "(Algorithm 1's output; PFLlib evaluates after sending), 'trained' = "
                                              "the model after the last local training", str,
                                choices=("aggregated", "trained")),
        "negatives": Param("centroids", "[RECON] reconstructed: the InfoNCE's negatives (Eq. 13): 'centroids' = the "
                                        "other classes' global label centroids (Definition 2: '|C| - 1 negative pairs'); "
                                        "'with_batch' = those plus the batch's samples of another class (§III-C3: 'a "
                                        "larger b means more negative instances are utilized')", str,
                           choices=("centroids", "with_batch")),
        "local_aggregation": Param(True, "loss-wise local aggregation (Eq. 7-8); false = ablation 'w/o LA' (Fig. 8): "
                                         "start from the global representation layers", bool),
        "split": Param(True, "share only the representation layers (Sec. III-C1); false = ablation 'w/o Sep' "
                             "(Fig. 8): the projection layer travels and is mixed too", bool),
        "contrastive": Param(True, "InfoNCE term in local training; false = ablation 'w/o CRL' (Fig. 8): alpha = 0",
                             bool),
    }
    shared = ("extractor.",)
    has_global = False
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # centroids 'eval': one forward over the train split after training (the InfoNCE on the batch's own
        # features against C centroids is small)
        return Passes(1 + (FORWARD_SHARE / training["local_epochs"] if hp["centroids"] == "eval" else 0.0))

    def __init__(self, engine, hp):
        super().__init__(engine, hp)
        self.shared = ("extractor.",) if hp.get("split", True) else ("",)

    def setup(self):
        super().setup()  # server["global"]: its head (when split) stays the initial head of new clients
        self.server.update(empty_prototypes(self.engine.num_classes, self.engine.model.feature_dim, self.engine.device))

    def broadcast(self, client):
        return {"model": select(self.server["global"], self.shared), "centroids": known_prototypes(self.server)}

    def tau(self, client) -> float:
        reg = client.state.get("reg_loss")
        return 0.0 if reg is None or not self.hp["local_aggregation"] else math.exp(-self.hp["gamma"] * reg)

    # -- client ---------------------------------------------------------------------
    def local_update(self, client, payload):
        eng, hp = self.engine, self.hp
        first = "model" not in client.state
        own = client.state.get("model", self.server["global"])
        eng.set_params({**own, **mix(own, payload["model"], self.tau(client))})
        alpha = 0.0 if first or not hp["contrastive"] else hp["alpha"]
        table = dense(payload["centroids"], eng.num_classes, eng.model.feature_dim, eng.device)
        contrast = bool(table["present"].any())  # no global centroid yet (round 1): CE only, no L_Reg
        regs: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: (batch InfoNCE, samples with a positive)
        sums = torch.zeros(eng.num_classes, eng.model.feature_dim, device=eng.device)
        counts = torch.zeros(eng.num_classes, device=eng.device)

        def loss_fn(batch):
            loss = F.cross_entropy(batch.logits, batch.y)
            if contrast:  # measured also when alpha = 0: it sets the next tau
                z = batch.features if alpha else batch.features.detach()
                reg, n = info_nce(z, batch.y, table["protos"], table["present"], hp["tau_cl"],
                                  hp["negatives"] == "with_batch")
                regs.append((reg.detach(), n))
                loss = loss + alpha * reg if alpha else loss
            if hp["centroids"] == "train":
                sums.index_add_(0, batch.y, batch.features.detach())
                counts.index_add_(0, batch.y, torch.ones_like(batch.y, dtype=counts.dtype))
            return loss

        fit = eng.fit(client, loss_fn=loss_fn)
        if hp["clip_params"]:
            eng.set_params({k: v.clamp(0, 1) for k, v in eng.get_params().items() if v.is_floating_point()})
        client.state["model"] = eng.get_params()
        client.state["reg_loss"] = self.reg_loss(regs, fit.steps)
        if hp["centroids"] == "eval":
            centroids = local_prototypes(eng, client, with_counts=True)
        else:
            classes = torch.nonzero(counts > 0).flatten()
            centroids = {"classes": classes, "protos": sums[classes] / counts[classes, None], "counts": counts[classes]}
        return Update(client.id, client.num_train, eng.get_params(self.shared), extras=centroids, loss=fit.loss)

    def reg_loss(self, regs: list, steps: int) -> float | None:
        """L_Reg: the mean of the batch InfoNCE values over the last epoch (or all steps),
        batches without a sample whose class has a global centroid left out."""
        if self.hp["reg_loss_over"] == "last_epoch":
            regs = regs[len(regs) - steps // self.engine.training["local_epochs"]:]
        if not regs:
            return None
        values, n = (torch.stack(t) for t in zip(*regs))
        return float(values[n > 0].mean()) if bool((n > 0).any()) else None

    # -- server ---------------------------------------------------------------------
    def aggregate(self, updates):
        if not updates:
            return
        eng = self.engine
        self.server["global"] = {**self.server["global"], **weighted_average(updates)}
        self.server.update(aggregate_prototypes([u.extras for u in updates], eng.num_classes, eng.model.feature_dim,
                                                "samples", eng.device))

    # -- evaluation -------------------------------------------------------------------
    def personal_params(self, client):
        own = client.state.get("model", self.server["global"])
        if self.hp["personal_model"] == "trained":
            return own
        return {**own, **mix(own, select(self.server["global"], self.shared), self.tau(client))}
