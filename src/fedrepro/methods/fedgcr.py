"""FedGCR (Cheng, Yeh, Chen, Pastor, Chen, "FedGCR: Achieving Performance and Fairness for Federated
Learning with Distinct Client Types via Group Customization and Reweighting", AAAI 2024),
Algorithm 1; methods.md §5. Needs the `prompted_vit` model (frozen ViT, prompts, GC-Net, head).

Round r, every client k (full participation):
  1. receives theta^(r-1) = {prompts p, GC-Net psi, head phi}, the cluster centres H^(r-1) and its
     cluster id i (none in round 1), and reports L_k = CE of theta^(r-1) on its train split;
  2. trains M epochs (AdamW) on
        CE                                        while H is NULL (round 1, Algorithm 1),
        CE + lambda1 l_GC + lambda2 l_RA          afterwards, with
     l_GC (Eq. 7) = CE([cos(h,H_i), cos(h,H_t) t != i, cos(h, h~_prev)] / tau, 0): h = GC-Net(r) is
          pulled to its own cluster centre, away from the others and its previous representation;
     l_RA (Eq. 8) = CE([cos(z,z_0), cos(z,z_prev)] / tau, 0): z pulled to the received global
          model's z_0, away from its own previous model's z_prev (MOON's loss, `moon.py`);
  3. uploads theta_k, L_k and h~_k = class-balanced mean of h over its train split (Eq. 4).
The server clusters the h~_k with a GMM into T' groups (centres H^r = plain means), sets
beta_r = delta (1 - gamma^(r-1)) and theta^r = sum_k w_k theta_k with
w_k ∝ p_k (L_k^(1-beta) L~_g(k)^beta)^(q+1) (FedGR, Eq. 3; `_fedgr.py`), normalised to sum 1.

Choices (methods.md §5; each marked option is a hyper-parameter with a ledger entry in
config/papers/published/readings/fedgcr.yaml):
- Loss values: the paper's lambda1 = 0.5, lambda2 = 0.1, tau = 0.5 with cosine similarity (the paper
  writes a dot product, the code uses cosine). `loss_form: code_compat` gives the code's
  0.1 (mu_r l_GC + 0.5 l_RA) with mu_r = 0.5 + 0.5 (r-1)/R and no temperature on l_RA.
- Round 1 is CE only (Algorithm 1); the code's extra CE of the prompt-only model is not added.
- h~_k is computed with the client's model after local training over its whole train split
  (`representation_at: trained` [RECON]: Eq. 4 does not say with which model; `received` takes the
  received global model, as the code, which uses it on its first 3 batches only).
- GMM: scikit-learn, `covariance: full` [RECON] by default, the code's ('diag' is the robust option with d-dim
  representations and 10-27 clients), reg_covar 1e-6, random_state derived from the seed and round.
- L_k is the client's local training loss, the running mean over its local epochs of the loss it
  minimises (Algorithm 1: LocalUpdate returns L; `loss_at: train`). [PAPER≠CODE] `loss_at: start`
  is the code's: CE of the received global model on the whole train split (the code measures it
  right after aggregation, `federated/train.py:364-368`, Ea_k = int(100 / L_k), and uses it in the
  next aggregation); L_k is not quantised and round 1 uses the measured loss (the code: 1.0).
- L_k is a per-sample mean (`loss_reduction: mean`, the code's mean CE). [PAPER≠CODE]
  `loss_reduction: sum` is Eq. 2's L_k = sum over the client's samples, the L that Algorithm 1
  accumulates over D: n_k times the mean (the last epoch's sum at the paper's M = 1).
- The FedGR weights are normalised to sum 1 (`aggregation: normalized`, the code's, utils/util.py
  communication; Eq. 3's "aggregation weights" generalise Eq. 1's data proportions).
  [PAPER≠CODE] `aggregation: unnormalized` is Algorithm 1's theta^r = sum omega_ij (L'_ij)^(q+1) theta_ij
  as written: the mix then scales the model by sum_k w_k, which need not be 1.
- The group loss L~_i is the plain mean over the group's clients (Eq. 3, Algorithm 1 line 8;
  `group_loss: mean`). [PAPER≠CODE] `group_loss: size_weighted` is the code's data-size weighted
  mean (`utils/util.py:1129-1137`).
- The head phi: `head: linear` [PAPER≠CODE] departs from the paper's words, which say MLP:
  "another MLP classification head" (§Model Design), "then by MLP" (Fig. 2's caption) and
  MLP(phi, z) (Algorithm 1), with no layers given. Linear is supported by the footnote (Fig. 2
  "mirrors Dosovitskiy et al. (2021)", whose "MLP head" is a single linear layer at fine-tuning)
  and by the code's default (`nonlinear_classifier: False`, `domainbed/hparams_registry.py:39`), so
  `head: linear` keeps the model's Linear(d, C) (the default since issue 35). `head: mlp` [RECON]
  takes the paper's word with the code's optional DomainBed `Classifier(d, C, is_nonlinear=True)`
  = Linear(d, d/2) ReLU Linear(d/2, d/4) ReLU Linear(d/4, C) (`utils/networks.py:275-283`), trained
  from scratch. The FedGR-only ablation keeps the baselines' linear head (the code's mode
  'ablation' runs the baselines' VPT model).
- One fresh optimizer per round from `training.optimizer` (paper: AdamW, lr 1e-3); the code keeps a
  per-client AdamW with prompt lr 1e-2 across rounds.
- Ablations (Table 5): `group_customization: false` is FedGR only: no GC-Net (the model's
  type prompt stays off, as for the baselines), no l_GC / l_RA; clustering then uses the class-
  balanced prompt-free CLS embedding r (`fedgr_representation: cls` [RECON]: the paper does not say
  what FedGR-only clusters; `prompted` takes the CLS feature with the global prompts, z);
  `group_reweighting: false` aggregates with p_k (FedGC only).
The clustering accuracy against the clients' true types (their domain) is reported per round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..io import derive_seed
from ..registry import ConfigError, Param
from . import register
from ._fair import LOSS_AT, LossWeighted, global_loss, mix
from ._fedgr import (BETA_SCHEDULES, COVARIANCE_PARAM, GROUP_LOSSES, beta_at, class_balanced_mean, cluster_clients, cluster_purity,
                     fedgr_weights)
from .base import FORWARD_SHARE, Passes, TrainingDiverged, Update, select
from .moon import model_contrastive_loss

MESSAGE = "fedgcr/"  # payload entries that are not model parameters (cluster centres, cluster id)
LOSS_FORMS = ("paper", "code_compat")
HEADS = ("mlp", "linear")
AGGREGATIONS = ("normalized", "unnormalized")
LOSS_REDUCTIONS = ("mean", "sum")
CODE_W_CON, CODE_RA_WEIGHT = 0.1, 0.5  # the code's w_con and its 0.5 on l_RA


def group_contrastive_loss(h: torch.Tensor, centres: torch.Tensor, own: int, rep_prev: torch.Tensor | None,
                           tau: float) -> torch.Tensor:
    """l_GC (Eq. 7, cosine): CE over [cos(h, H_own), cos(h, H_t) for t != own, cos(h, h~_prev)] / tau, label 0."""
    order = [own] + [t for t in range(len(centres)) if t != own]
    refs = centres[order]
    if rep_prev is not None:
        refs = torch.cat([refs, rep_prev.unsqueeze(0)])
    logits = F.cosine_similarity(h.unsqueeze(1), refs.unsqueeze(0).to(h), dim=2, eps=1e-8) / tau
    return F.cross_entropy(logits, torch.zeros(len(h), dtype=torch.long, device=h.device))


def mlp_head(linear: torch.nn.Linear) -> torch.nn.Module:
    """The MLP classification head phi in place of `linear` (d -> C): DomainBed's nonlinear
    Classifier, d -> d/2 -> d/4 -> C with ReLUs (the code's utils/networks.py:275-283)."""
    d, c = linear.in_features, linear.out_features
    return torch.nn.Sequential(torch.nn.Linear(d, d // 2), torch.nn.ReLU(), torch.nn.Linear(d // 2, d // 4), torch.nn.ReLU(),
                               torch.nn.Linear(d // 4, c))


@register
class FedGCR(LossWeighted):
    name = "fedgcr"
    summary = ("FedGCR: prompted ViT with GC-Net type prompts, group-contrastive + alignment losses, GMM client groups "
               "and group-loss reweighted aggregation")
    paper = "Cheng, Yeh, Chen, Pastor, Chen, AAAI 2024"
    hparams = {
        "lambda_gc": Param(0.5, "lambda1, weight of l_GC (paper §Implementation; the code's effective value is 0.05-0.1)",
                           float, minimum=0),
        "lambda_ra": Param(0.1, "lambda2, weight of l_RA (paper; the code's effective value is 0.05)", float, minimum=0),
        "tau": Param(0.5, "temperature tau of l_GC and (paper form) l_RA (paper: 0.5)", float, exclusive_minimum=0),
        "loss_form": Param("paper", "'paper': CE + lambda1 l_GC + lambda2 l_RA; [PAPER≠CODE] 'code_compat': the code's "
                                    "CE + 0.1 (mu_r l_GC + 0.5 l_RA), mu_r = 0.5 + 0.5 (r-1)/R, l_RA without temperature "
                                    "(lambda_gc / lambda_ra unused)", str, choices=LOSS_FORMS),
        "group_customization": Param(True, "FedGC's losses l_GC and l_RA (false: the 'FedGR only' ablation)", bool),
        "group_reweighting": Param(True, "FedGR's group-loss reweighting (false: p_k weights, the 'FedGC only' ablation)",
                                   bool),
        "num_groups": Param(None, "T', the GMM's number of client groups; null = the number of client types (domains) of "
                                  "the federation (paper default)", int, minimum=1, maximum=10_000),
        "q": Param(1.0, "fairness power q in (L_k^(1-beta) L~_g^beta)^(q+1) (paper: 1)", float, minimum=0),
        "delta": Param(0.5, "delta in beta_r = delta (1 - gamma^(r-1)) (Algorithm 1: 0.5)", float, minimum=0, maximum=1),
        "gamma": Param(0.5, "gamma of the paper's beta schedule (paper: 0.5)", float, minimum=0, maximum=1),
        "beta_schedule": Param("paper", "'paper': beta_r = delta (1 - gamma^(r-1)); [PAPER≠CODE] 'code': delta (1 - 0.9^r) (the code's "
                                        "gamma 0.9, beta 0.05 in round 1)", str, choices=BETA_SCHEDULES),
        "covariance": COVARIANCE_PARAM,
        "reg_covar": Param(1e-6, "[RECON] GMM reg_covar (scikit-learn's default 1e-6, kept >= 1e-6 for a stable fit)",
                           float, minimum=1e-6, maximum=1.0),
        "head": Param("linear", "classification head phi with the GC-Net: [PAPER≠CODE] 'linear' = the model's Linear(d, C): "
                                "it departs from the paper's words ('MLP' for the head, in Fig. 2's caption and in Algorithm "
                                "1's MLP(phi, z)); its footnote's ViT of Dosovitskiy et al. (whose fine-tuning 'MLP head' is "
                                "one linear layer) and the code's default (nonlinear_classifier False) support it; [RECON] "
                                "'mlp' = Linear(d, d/2) ReLU Linear(d/2, d/4) ReLU Linear(d/4, C), the code's optional "
                                "DomainBed nonlinear Classifier (the default before issue 35). FedGR only "
                                "(group_customization false) keeps the linear head",
                      str, choices=HEADS),
        "representation_at": Param("trained", "[RECON] reconstructed: the model the client representation h~_k (Eq. 4) "
                                              "is computed with, over the whole train split: 'trained' = the client's model "
                                              "after its local training, the one it uploads; 'received' = the received "
                                              "global model (the code's, which averages its first 3 batches only)",
                                   str, choices=("trained", "received")),
        "fedgr_representation": Param("cls", "[RECON] reconstructed: what the FedGR-only ablation (no GC-Net, so no h) "
                                             "clusters, which the paper does not say: 'cls' = the prompt-free CLS "
                                             "embedding r; 'prompted' = the CLS feature z with the global prompts",
                                      str, choices=("cls", "prompted")),
        "group_loss": Param("mean", "L~_i of Eq. 3: 'mean' = plain mean of L_k over the group's clients (paper Eq. 3, "
                                    "Algorithm 1); [PAPER≠CODE] 'size_weighted' = mean weighted by the clients' data sizes "
                                    "(the code's utils/util.py communication)", str, choices=GROUP_LOSSES),
        "loss_reduction": Param("mean", "[PAPER≠CODE] the scale of the reported L_k: 'mean' = per sample (the code's mean CE); "
                                        "'sum' = summed over the client's train samples, n_k times the mean (Eq. 2's "
                                        "L_k = sum over D_k, the L Algorithm 1 accumulates over D; exact at its M = 1 epoch)",
                                str, choices=LOSS_REDUCTIONS),
        "aggregation": Param("normalized", "[PAPER≠CODE] the FedGR weights of theta^r = sum_k w_k theta_k: 'normalized' = divided "
                                           "by their sum (the code's utils/util.py communication); 'unnormalized' = "
                                           "Algorithm 1's sum omega_ij (L'_ij)^(q+1) theta_ij as written, which scales the "
                                           "model by sum_k w_k (group_reweighting only)", str, choices=AGGREGATIONS),
        "loss_at": Param("train", "which loss L_k a client reports: 'train' = running mean of its local training loss "
                                  "(paper Algorithm 1: LocalUpdate returns L); [PAPER≠CODE] 'start' = CE of the received "
                                  "global model on its whole train split (the code's post-aggregation train loss, "
                                  "federated/train.py Eas)", str, choices=LOSS_AT.choices),
    }

    models = ("prompted_vit",)

    @classmethod
    def cost_passes_for(cls, hp, training):
        # per batch: the prompt-free CLS forward r, and with group customization the received and the previous
        # model's z (forwards); per round: h~ over the train split, and F_k(w^t) with loss_at 'start'
        batch = 1 + FORWARD_SHARE * (1 + (2 if hp["group_customization"] else 0))
        rounds = FORWARD_SHARE * (1 + (hp["loss_at"] == "start")) / training["local_epochs"]
        return Passes(batch + rounds)

    @classmethod
    def check_cell(cls, where, hp, model, partition):
        super().check_cell(where, hp, model, partition)
        if hp["group_customization"] and not model["params"].get("gc_net", True):
            raise ConfigError(f"config key '{where}.hparams.group_customization' is true but the model has gc_net: false; "
                              f"allowed: group_customization: false (FedGR only) or the model's gc_net: true")
        if hp["num_groups"] is None and partition["partitioner"] != "domain":
            raise ConfigError(f"config key '{where}.hparams.num_groups' is null (T' = the number of client types) but the "
                              f"partition {partition['partitioner']!r} gives clients no single type; allowed: an explicit "
                              f"num_groups, or the 'domain' partitioner")

    # -- server ---------------------------------------------------------------------------
    def setup(self):
        model = self.engine.model
        if not hasattr(model, "use_type_prompt"):
            raise ConfigError("method 'fedgcr': needs the model 'prompted_vit' (prompts, GC-Net, frozen ViT); allowed "
                              "model: prompted_vit")
        model.use_type_prompt(self.hp["group_customization"])  # before the server copies the trainable part
        if self.hp["group_customization"] and self.hp["head"] == "mlp" and isinstance(model.head, torch.nn.Linear):
            model.head = mlp_head(model.head).to(next(model.head.parameters()).device)
        super().setup()
        self.server["cluster_acc"] = []  # [round, accuracy] per round (when the clients' types are known)
        types = {c.client_type for c in self.engine.clients}
        if self.hp["num_groups"] is None and None in types:
            raise ConfigError("method 'fedgcr': key 'num_groups' is null (T' = number of client types) but not every "
                              "client holds a single domain; allowed: an explicit num_groups, or a 'domain' partition")

    def num_groups(self) -> int:
        return self.hp["num_groups"] or len({c.client_type for c in self.engine.clients})

    def broadcast(self, client):
        payload = select(self.server["global"], self.shared)
        group = self.server.get("group_of", {}).get(client.id)
        if self.hp["group_customization"] and group is not None:
            payload[MESSAGE + "centres"] = self.server["centres"]
            payload[MESSAGE + "group"] = torch.tensor([group])
        return payload

    def aggregate(self, updates):
        if not updates:
            return
        reps = torch.stack([u.extras["rep"] for u in updates])
        r = self.engine.round
        try:
            labels, centres = cluster_clients(reps, self.num_groups(), derive_seed(self.engine.seed, "fedgr-gmm", r),
                                              self.hp["covariance"], self.hp["reg_covar"])
        except ValueError as exc:  # scikit-learn's GMM on non-finite or collapsed representations
            raise TrainingDiverged(f"the GMM cannot cluster round {r}'s client representations (largest |h~| "
                                   f"{float(reps.abs().max()):.3g}): {exc}", r) from None
        self.server["centres"] = centres
        self.server["group_of"] = {u.client_id: int(g) for u, g in zip(updates, labels)}
        types = [self.engine.client(u.client_id).client_type for u in updates]
        if None not in types:
            self.server["cluster_acc"].append([r, cluster_purity(labels, types)])
        sizes = self.sizes(updates)
        if self.hp["group_reweighting"]:
            beta = beta_at(r, self.hp["beta_schedule"], self.hp["delta"], self.hp["gamma"])
            weights = fedgr_weights(self.losses(updates), sizes, labels, beta, self.hp["q"], self.hp["group_loss"],
                                    normalized=self.hp["aggregation"] == "normalized")
        else:
            weights = torch.as_tensor(sizes, dtype=torch.float64) / sum(sizes)
        self.server["global"] = {**self.server["global"], **mix(updates, weights)}

    def report(self):
        acc = self.server.get("cluster_acc") or []
        return {"cluster_acc": acc[-1][1] if acc else None, "cluster_acc_per_round": acc}

    # -- client ---------------------------------------------------------------------------
    def local_update(self, client, payload):
        engine, hp = self.engine, self.hp
        params = {k: v for k, v in payload.items() if not k.startswith(MESSAGE)}
        start = global_loss(engine, client, params) if hp["loss_at"] == "start" else None
        engine.set_params(params)
        model = engine.model
        ext = model.extractor
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = engine.optimizer(trainable)
        customize = hp["group_customization"] and MESSAGE + "centres" in payload
        if customize:
            centres, own = payload[MESSAGE + "centres"], int(payload[MESSAGE + "group"][0])
            ref0 = self._prompt_params(params)
            prev = self._prompt_params(client.state.get("prev", params))
            rep_prev = client.state.get("rep")
            weight_gc, weight_ra, tau_ra = self._loss_weights()
        received_rep = self.client_representation(client) if hp["representation_at"] == "received" else None
        model.train()
        total, seen = torch.zeros((), device=engine.device), 0
        for x, y in engine.batches(client):
            tokens = ext.tokens(x)
            with torch.no_grad():
                r = ext.cls(tokens)
            p_bar, h = ext.combined_prompts(r)
            z = ext.dropout(ext.cls(tokens, p_bar))
            loss = F.cross_entropy(model.head(z), y)
            if customize:
                with torch.no_grad():
                    z0 = ext.dropout(ext.cls(tokens, ext.combined_prompts(r, *ref0)[0]))
                    zp = ext.dropout(ext.cls(tokens, ext.combined_prompts(r, *prev)[0]))
                loss = (loss + weight_gc * group_contrastive_loss(h, centres, own, rep_prev, hp["tau"])
                        + weight_ra * model_contrastive_loss(z, z0, zp, tau_ra))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * len(y)
            seen += len(y)
        train_loss = float(total) / max(seen, 1)
        rep = self.client_representation(client) if received_rep is None else received_rep
        client.state["rep"] = rep
        client.state["prev"] = engine.get_params(("extractor.",))
        return self._update(client, train_loss, start, rep)

    def _update(self, client, train_loss, start, rep):
        reported = train_loss if start is None else start
        if self.hp["loss_reduction"] == "sum":  # Eq. 2: L_k sums the loss over the client's samples
            reported *= client.num_train
        return Update(client.id, client.num_train, self.engine.get_params(self.shared),
                      extras={"rep": rep, "loss": reported}, loss=train_loss)

    def _loss_weights(self) -> tuple[float, float, float]:
        """(weight of l_GC, weight of l_RA, temperature of l_RA) for this round."""
        hp = self.hp
        if hp["loss_form"] == "paper":
            return hp["lambda_gc"], hp["lambda_ra"], hp["tau"]
        mu_r = 0.5 + 0.5 * (self.engine.round - 1) / self.engine.training["rounds"]
        return CODE_W_CON * mu_r, CODE_W_CON * CODE_RA_WEIGHT, 1.0

    @staticmethod
    def _prompt_params(params):
        """(prompts, GC-Net state) of a parameter dict, the arguments of `combined_prompts`."""
        gc = {k[len("extractor.gc_net."):]: v for k, v in params.items() if k.startswith("extractor.gc_net.")}
        return params["extractor.prompts"], (gc or None)

    @torch.no_grad()
    def client_representation(self, client) -> torch.Tensor:
        """h~_k: class-balanced mean over the train split of h = GC-Net(r) (without a GC-Net: of r, or
        of the prompted z with `fedgr_representation: prompted`), with the model now in place, in eval mode."""
        ext = self.engine.model.extractor
        ext.eval()
        x, y = client.train.x, client.train.y
        bs = self.engine.training["eval_batch_size"]
        prompted = self.hp["fedgr_representation"] == "prompted"
        parts = []
        for i in range(0, len(y), bs):
            tokens = ext.tokens(x[i : i + bs])
            r = ext.cls(tokens)
            p_bar, h = ext.combined_prompts(r)
            parts.append(h if h is not None else ext.cls(tokens, p_bar) if prompted else r)
        return class_balanced_mean(torch.cat(parts), y, self.engine.num_classes)
