"""GRP-FED (Chou et al., "GRP-FED: Addressing Client Imbalance in Federated Learning via
Global-Regularized Personalization", 2021), Algorithm 1; shared/papers/grp-fed.txt and
methods.md §3. No public code exists and the equations are missing from the paper text: every
reconstructed value is a hyper-parameter marked below, and its ledger entry is in
config/papers/published/readings/grp_fed.yaml (issue 35).

Models: the global model = global feature extractor F_g + classifier C_g (the cell's model;
C a 2-layer FC, e.g. the `head_hidden` option of `resnet1d` / `resnet32_cifar`); per client a
local feature extractor F_l and a discriminator D (2-layer FC, feat -> hidden -> 1), both kept
on the client and never uploaded. F_l^0 := F_g^0 (`local_init` [RECON]); D^0 is one seeded initialisation.

Server (Algorithm 1, lines 1-14), power q_0 = 10:
  for t = 1..T: sample S_t; each k in S_t runs Client(F_g, C_g) and returns (F_g,k, C_g,k, L_k);
    adaptive power (§3.2), `q_update: before`: sigma_t = std_k L_k of this round's losses;
      q_t = q_(t-1) + alpha if sigma_t > sigma_ref, else max(0, q_(t-1) - alpha), with
      `sigma_compare: previous` [RECON] sigma_ref = sigma_(t-1) ('running_mean': the mean of
      sigma_1..sigma_(t-1)); the first round has no sigma_0: q stays q_0; "Finally" the models are
      aggregated with this q_t. `q_update: after` [RECON] applies the adjusted q one round late (before issue 35);
    adaptive aggregation (§3.2: "aggregating all trained global models, weighted by the global
      training loss and the adaptive power q"; §3.4: "p is updated from the adaptive power q and
      the global training loss"), `aggregation: power` [RECON] (the equation is missing from the text):
        p_k = L_k^(q_t) / sum_j L_j^(q_t) = softmax(q_t log L_k),  (F_g, C_g) <- sum_k p_k (F_g,k, C_g,k)
      (methods.md §3.3); `aggregation: qfedavg` is q-FFL's own server step (q-FedAvg,
      `_fair.qfedavg_step`, the one copy q-FFL uses too) with the L of `lipschitz`:
        Δw_k = L (w - w_k),  h_k = q_t L_k^(q_t - 1) ||Δw_k||^2 + L L_k^(q_t),
        w <- w - sum_k L_k^(q_t) Δw_k / sum_k h_k,
      which equals w - c (w - w_power) with w_power the `power` average above and
      c = 1 / (1 + sum_j p_j q_t L ||w - w_j||^2 / L_j): the same clients weighted, the step
      shortened (c = 0.14-0.28 on grp_fed_cpu; the default of issues 26-34).

Client k (lines 16-39), for E epochs (the cell's local_epochs; E is lost in the text), per batch (x, y):
  1. global training:  z_g = F_g(x), L_g = CE(C_g(z_g), y); one SGD step on F_g and C_g;
  2. local training:   z_l = F_l(x), L_l = lam CE(C_g(z_l), y) + (1 - lam) A(D(z_l)) (`lam` [RECON]),
                       A = BCE(., 1), the non-saturating form (`adv_loss: non_saturating` [RECON];
                       'minimax': A = -BCE(., 0), i.e. minimise log(1 - D(z_l)));
                       one SGD step on F_l only (C_g fixed: "we fix the classifier with C_g
                       during the local training"; D fixed: F_l learns to fool D); C_g is the
                       client's current copy, just updated in step 1 (`local_classifier: current` [RECON];
                       'received': the C_g the client received, held for the whole round);
  3. discriminator:    L_D = BCE(D(z_g), 1) + BCE(D(z_l), 0) with z_g, z_l of this batch detached
                       (F_g, F_l fixed); one SGD step on D only.
  L_k = the global training loss: "after returning all trained F_g, C and global training loss"
  (§3.4; Fig. 3 plots it): the mean of L_g over the local epochs' batches (`loss_at: train` [RECON],
  the default); `loss_at: start` (the default before issue 26) = CE of the received global model on
  the client's train split before training (q-FFL's F_k(w^t)).
  Upload (F_g, C_g, L_k); F_l and D stay on the client.

Evaluation: global = F_g + C_g; personal = F_l + the current global C_g (paper §3.4, local test).
All three parts use the cell's optimizer (paper: SGD, lr 5e-3, momentum 0.9), fresh each round.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..io import derive_seed
from ..registry import Param
from . import register
from ._fair import LIPSCHITZ, check_lipschitz, global_loss, lipschitz, loss_std, mix, power_weights, qfedavg_step
from .base import FORWARD_SHARE, Method, Passes, Update, select


def make_discriminator(feature_dim: int, hidden: int) -> nn.Module:
    """D: a 2-layer FC, feat -> hidden -> 1 (a logit; sigmoid + BCE in the loss)."""
    return nn.Sequential(nn.Linear(feature_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 1))


def next_power(q: float, std: float, prev_std: float, alpha: float) -> float:
    """GRP-FED's adaptive power: q + alpha if the losses' std grew above its reference `prev_std`
    (fairness got worse), else max(0, q - alpha); unchanged when there is no reference (the first round)."""
    if prev_std is None or math.isnan(prev_std):
        return q
    return q + alpha if std > prev_std else max(0.0, q - alpha)


def sigma_reference(past: list[float], rule: str) -> float:
    """What sigma_t is compared with: the last of the past rounds' sigmas ('previous') or their mean
    ('running_mean'); nan without a past round."""
    if not past:
        return float("nan")
    return past[-1] if rule == "previous" else sum(past) / len(past)


# F_l's adversarial term A(D(z_l)) on D's logits, D fixed: both push D(z_l) towards 'global' (1).
ADVERSARIAL = {
    "non_saturating": lambda d: F.binary_cross_entropy_with_logits(d, torch.ones_like(d)),  # -log D(z_l)
    "minimax": lambda d: -F.binary_cross_entropy_with_logits(d, torch.zeros_like(d)),  # log(1 - D(z_l))
}


def local_extractor_loss(logits: torch.Tensor, y: torch.Tensor, d_local: torch.Tensor, lam: float,
                         adv: str = "non_saturating") -> torch.Tensor:
    """lam * CE(C_g(z_l), y) + (1 - lam) * A(D(z_l)): classify with the fixed global classifier and
    make D take the local features for global ones (A: `ADVERSARIAL[adv]`)."""
    return lam * F.cross_entropy(logits, y) + (1 - lam) * ADVERSARIAL[adv](d_local)


def discriminator_loss(d_global: torch.Tensor, d_local: torch.Tensor) -> torch.Tensor:
    """BCE(D(z_g), 1) + BCE(D(z_l), 0): global features are 'true', local ones 'false'."""
    return (F.binary_cross_entropy_with_logits(d_global, torch.ones_like(d_global))
            + F.binary_cross_entropy_with_logits(d_local, torch.zeros_like(d_local)))


def _detached(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in module.named_parameters()}


@register
class GRPFed(Method):
    name = "grp_fed"
    summary = ("GRP-FED: loss-power (adaptive q) aggregated global model + per-client local extractor on the fixed "
               "global classifier, regularised by a global/local feature discriminator")
    paper = "Chou et al., GRP-FED (Global-Regularized Personalization), 2021; shared/papers/grp-fed.txt"
    hparams = {
        "q0": Param(10.0, "initial loss power q_0 ('10, the same as q-FFL', paper §4.1)", float, minimum=0),
        "alpha": Param(0.5, "adjusting rate alpha of the power: q +/- alpha per round (paper §4.1, Eq. 2)", float, minimum=0),
        "lam": Param(0.5, "[RECON] reconstructed: lambda, the weight of the local CE against the adversarial BCE in "
                          "lam*CE(C_g(z_l), y) + (1-lam)*BCE(D(z_l), 1); the loss form and the best lambda are missing "
                          "from the paper text (Fig. 4 sweeps 0.1..0.9; larger lambda = more personalization), "
                          "methods.md §3.2, §3.4", float, minimum=0, maximum=1),
        "adv_loss": Param("non_saturating", "[RECON] reconstructed: the form of F_l's adversarial term (the equation "
                                            "is missing; the text says F_l 'is optimized to fool the discriminator', "
                                            "§3.3): 'non_saturating' = BCE(D(z_l), 1) = -log D(z_l) (methods.md §3.2, "
                                            "the field's common GAN generator loss); 'minimax' = -BCE(D(z_l), 0) = "
                                            "log(1 - D(z_l)), the negated discriminator term", str,
                          choices=("non_saturating", "minimax")),
        "local_classifier": Param("current", "[RECON] reconstructed: which C_g the local step classifies z_l with "
                                             "('we fix the classifier with C_g during the local training', §3.3; the "
                                             "symbols are lost): 'current' = the client's copy as step 1 of the same "
                                             "batch left it (Algorithm 1 runs both steps per batch); 'received' = the "
                                             "C_g the client received, held fixed for its whole local training",
                                  str, choices=("current", "received")),
        "aggregation": Param("power", "[RECON] reconstructed: the equation is missing from the paper text; 'power' = "
                                      "normalised weights p_k = L_k^q / sum_j L_j^q (softmax(q log L_k)) of the clients' "
                                      "training losses, the prose's weight from q and the loss alone ('aggregating all trained "
                                      "global models, weighted by the global training loss and the adaptive power q', §3.2; "
                                      "'p is updated from the adaptive power q and the global training loss', §3.4; "
                                      "methods.md §3.3); 'qfedavg' = q-FFL's own server step (q-FedAvg, Li et al. 2020, "
                                      "Algorithm 3) with the L of `lipschitz`, the default of issues 26-34: the same "
                                      "weights with a step shortened to 0.14-0.28 of the power average's at q = 10",
                             str, choices=("power", "qfedavg")),
        "q_update": Param("before", "[RECON] reconstructed: when the adaptive power moves; 'before' = q_t is adjusted "
                                    "from this round's sigma of the training losses and 'Finally' the models are aggregated "
                                    "with it (§3.2, in that order); 'after' = aggregate with the previous q and adjust it "
                                    "for the next round (q applied one round late; before issue 35)",
                          str, choices=("before", "after")),
        "sigma_compare": Param("previous", "[RECON] reconstructed: what this round's sigma_t (std of the training "
                                           "losses) is compared with to move q (Eq. 2 is missing from the text): "
                                           "'previous' = sigma_(t-1), q + alpha if sigma_t > sigma_(t-1) else "
                                           "max(0, q - alpha) ('if the fairness becomes relatively fairer, we should "
                                           "decrease', §3.2; methods.md §3.3); 'running_mean' = the mean of "
                                           "sigma_1..sigma_(t-1), the alternative methods.md §3.3 names",
                               str, choices=("previous", "running_mean")),
        "lipschitz": LIPSCHITZ,
        "loss_at": Param("train", "[RECON] reconstructed: which 'global training loss' L_k a client reports; 'train' = "
                                  "the mean global CE over its local epochs' batches, what the paper's clients return "
                                  "'after' training (§3.4, Fig. 3); 'start' = CE of the received global model on its "
                                  "train split before local training, as q-FFL's F_k(w^t) (the default before issue 26; "
                                  "methods.md §3.2 step 4)", str, choices=("train", "start")),
        "weight_by_size": Param(False, "[RECON] reconstructed: multiply p_k by the train size n_k; the paper's weights "
                                       "depend on the loss and q only (methods.md §3.3), so off by default", bool),
        "disc_hidden": Param(None, "[RECON] reconstructed: hidden width of the 2-layer FC discriminator D, which the "
                                   "paper does not give; null = the feature dimension (methods.md §3.1)", int, minimum=1),
        "local_init": Param("global_init", "[RECON] reconstructed: Algorithm 1 line 2 initialises F_l with the other "
                                           "models, read as F_l^0 := F_g^0 ('global_init', methods.md §3.1); "
                                           "'received' starts F_l from the global extractor a client first receives",
                            str, choices=("global_init", "received")),
    }
    shared = ("",)
    has_global = True
    has_personal = True

    @classmethod
    def cost_passes_for(cls, hp, training):
        # a step of the global model and one of the local extractor per batch (the discriminator, a small
        # FC on detached features, is left out); 'start': a forward over the train split first
        start = FORWARD_SHARE / training["local_epochs"] if hp["loss_at"] == "start" else 0.0
        return Passes(2 + start)

    # -- server ---------------------------------------------------------------------
    def setup(self):
        super().setup()
        eng = self.engine
        self.server["q"] = float(self.hp["q0"])
        self.server["prev_std"] = float("nan")
        self.server["trace"] = []  # (round, q_t used, std of the reported losses): metrics.json `method`
        self.server["init_local"] = select(self.server["global"], ("extractor.",))  # F_l^0 := F_g^0
        # The client-side modules: a second extractor (F_l) and D, loaded per client from client.state.
        self._local = copy.deepcopy(eng.model.extractor)
        dim = eng.model.feature_dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(eng.seed, "grp-fed-discriminator"))
            disc = make_discriminator(dim, self.hp["disc_hidden"] or dim)
        self._disc = disc.to(eng.device)
        self._disc_init = {k: v.detach().clone() for k, v in self._disc.state_dict().items()}

    @classmethod
    def check_training(cls, where, hp, training):
        if hp["aggregation"] == "qfedavg":
            check_lipschitz(where, hp, training)

    def aggregate(self, updates):
        if not updates:
            return
        losses = [float(u.extras["loss"]) for u in updates]
        std = loss_std(losses)
        adjusted = next_power(self.server["q"], std, self.sigma_ref(), self.hp["alpha"])
        q = adjusted if self.hp["q_update"] == "before" else self.server["q"]
        sizes = [float(u.num_samples) for u in updates] if self.hp["weight_by_size"] else None
        new = self.AGGREGATIONS[self.hp["aggregation"]](self, updates, losses, q, sizes)
        self.server["global"] = {**self.server["global"], **new}
        self.server["q"] = adjusted
        self.server["prev_std"] = std
        self.server.setdefault("trace", []).append([self.engine.round, q, std])  # older checkpoints lack it

    def sigma_ref(self) -> float:
        """sigma_t's reference, from the past rounds' sigmas (`sigma_compare`)."""
        if self.hp["sigma_compare"] == "previous":
            return self.server["prev_std"]  # = the trace's last sigma; kept for older checkpoints
        return sigma_reference([s for _, _, s in self.server.get("trace") or []], self.hp["sigma_compare"])

    def report(self):
        """The adaptive power per round: q_t used to aggregate and sigma_t, the std of the losses."""
        trace = self.server.get("trace") or []
        return {"q_per_round": [[r, q] for r, q, _ in trace], "loss_std_per_round": [[r, s] for r, _, s in trace]}

    def qfedavg(self, updates, losses, q, sizes):
        names = [k for k, _ in self.engine.model.named_parameters()]
        return qfedavg_step(self.server["global"], updates, losses, q, lipschitz(self.hp, self.engine), names, sizes)

    def power(self, updates, losses, q, sizes):
        return mix(updates, power_weights(losses, q, sizes))

    AGGREGATIONS = {"qfedavg": qfedavg, "power": power}

    # -- client ---------------------------------------------------------------------
    def initial_local(self, global_params):
        """F_l of a client that has not trained yet."""
        if self.hp["local_init"] == "received":
            return select(global_params, ("extractor.",))
        return self.server["init_local"]

    def local_update(self, client, payload):
        eng, model = self.engine, self.engine.model
        start = global_loss(eng, client, payload) if self.hp["loss_at"] == "start" else None
        eng.set_params(payload)
        local = client.state["local"] if "local" in client.state else self.initial_local(payload)
        self._local.load_state_dict({k[len("extractor."):]: v for k, v in local.items()})
        self._disc.load_state_dict(client.state.get("disc", self._disc_init))
        opt_g = eng.optimizer(model.parameters())
        opt_l = eng.optimizer(self._local.parameters())
        opt_d = eng.optimizer(self._disc.parameters())
        model.train()
        self._local.train()
        self._disc.train()
        total, seen = torch.zeros((), device=eng.device), 0
        received = ({k: v.detach().clone() for k, v in model.head.named_parameters()}
                    if self.hp["local_classifier"] == "received" else None)
        for x, y in eng.batches(client):
            z_g, loss_g = self.global_step(x, y, opt_g)
            z_l = self.local_step(x, y, opt_l, received)
            self.disc_step(z_g, z_l, opt_d)
            total += loss_g * len(y)
            seen += len(y)
        client.state["local"] = {f"extractor.{k}": v.detach().clone() for k, v in self._local.state_dict().items()}
        client.state["disc"] = {k: v.detach().clone() for k, v in self._disc.state_dict().items()}
        train_loss = float(total) / max(seen, 1)
        return Update(client.id, client.num_train, eng.get_params(self.shared),
                      extras={"loss": train_loss if start is None else start}, loss=train_loss)

    def global_step(self, x, y, opt):
        """Step 1: CE of the global model; updates F_g and C_g. Returns z_g (detached) and the loss."""
        model = self.engine.model
        z_g = model.extractor(x)
        loss = F.cross_entropy(model.head(z_g), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return z_g.detach().flatten(1), loss.detach()

    def local_step(self, x, y, opt, classifier=None):
        """Step 2: the local extractor through the fixed global classifier (`classifier`, C_g's
        parameters; None = the client's current copy) and the fixed D; updates F_l only.
        Returns z_l (detached)."""
        head = self.engine.model.head
        z_l = self._local(x)
        logits = functional_call(head, _detached(head) if classifier is None else classifier, (z_l,))
        d_local = functional_call(self._disc, _detached(self._disc), (z_l.flatten(1),))
        loss = local_extractor_loss(logits, y, d_local, self.hp["lam"], self.hp["adv_loss"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return z_l.detach().flatten(1)

    def disc_step(self, z_g, z_l, opt):
        """Step 3: D separates global (true) from local (false) features; updates D only."""
        loss = discriminator_loss(self._disc(z_g), self._disc(z_l))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    # -- evaluation -------------------------------------------------------------------
    def personal_params(self, client):
        # F_l + the current global classifier C_g (and F_l's own BatchNorm statistics).
        glob = self.server["global"]
        return {**glob, **client.state.get("local", self.initial_local(glob))}
