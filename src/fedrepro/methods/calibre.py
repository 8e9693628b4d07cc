"""Calibre (Chen, Su and Li, "Calibre: Towards Fair and Accurate Personalized Federated Learning
with Self-Supervised Learning", 2024; spec: methods.md §2, reference code Plato examples/ssl/calibre).

Algorithm, per batch of client c (two views x_a, x_b; encodings z = f(x), projections h = g(z)):
    l_s  = the SSL objective (default SimCLR's NT-Xent, temperature 0.2)
    y_a, y_b = KMeans(K = 10) pseudo-labels of the detached [z_a; z_b]
    l_p  = NT-Xent(nu_a, nu_b), nu_{v,k} = mean of h_v over cluster k (lightly's default temperature 0.5)
    l_n  = CE(-||z_b^ - v_k^||^2, y_b), v_k = mean of z_a over cluster k, both L2-normalised (ln_form code)
    L    = l_s + alpha * (l_p + l_n), alpha = 0.3 (the paper's l_c left out: lc_weight 0)
After local training the client encodes its non-augmented train split, clusters it (KMeans, K = 10)
and uploads its divergence rate d_c = mean over clusters of the mean distance to the centroid.
Server: p_c = (n_c / d_c) / sum_j (n_j / d_j), theta = sum_c p_c theta_c (tighter clients weigh more).
Then the family's personalization stage (a linear probe per client, novel clients included).

Readings (methods.md §2.2-2.3; each marked option below is a hyper-parameter with an entry in the
readings ledger config/papers/published/readings/calibre.yaml, issue 35):
- The loss is l_s + alpha (l_p + l_n), as the reference code (calibre_loss.py: the main NT-Xent
  plus the two prototype regularizers). The paper's total is L = l_c + l_s + alpha (l_p + l_n)
  ("Finally the global loss", §IV-B; Algorithm 1 line 23), but it never defines or computes l_c:
  its theorem's classification term is the one that l_p stands for ("Under unsupervised learning,
  we propose a prototype-oriented contrastive regularizer", §IV-B), and its training stage uses no
  labels. So `lc_weight: 0` [PAPER≠CODE] leaves l_c out, with the code; it is the only value
  offered, an undefined term having no form to offer.
- l_n has three forms in the paper and its code, `ln_form` [PAPER≠CODE]:
  `code` (default; methods.md §2.2's instruction): the code's CE of softmax(-||z_b^ - v_k^||^2),
  squared distances of L2-normalised vectors, no temperature, the mean over the queries; the
  prose's "softmax(-d(z, v_k))" (d "such as the Euclidean distance", §IV-B) read as ProtoNet's
  negative log-likelihood (its [23]).
  `prose`: the prose's own formula, sum_k -(1/N_k) sum_j softmax(-d(z_j, v_k)): the probability
  itself (no log), d the Euclidean distance, per-cluster means summed over the clusters.
  `algorithm1`: Algorithm 1 line 21, sum_k -(1/N_k) sum_{j in k} log exp(z_j . v_k / tau) /
  sum_{a outside k} exp(z_a . v_k / tau): the prototype against the samples outside its cluster
  (the positive not in the denominator), tau = `ln_temperature` [RECON] (the paper gives none).
  Every form L2-normalises the encodings and prototypes as the code (the paper does not say).
  Prototypes come from view a (the prose's I_e), queries from view b (I_o); line 18 swaps the
  views, which are alike in distribution.
- Clusters are re-indexed over those present, so an empty cluster never breaks the indexing (the
  code's torch.unique indexing does). l_p pairs the clusters present in BOTH views (as the code).
  l_n's support prototypes: `ln_support: view_a` [PAPER≠CODE] every cluster of view a (the prose's
  prototypes of I_e); `both_views` keeps only the clusters of both views, as the code. Either way
  l_n classifies the queries of view b whose cluster has a support prototype; the support changes
  the negatives of the `code` and `prose` forms only (`algorithm1`'s negatives are samples).
- Pseudo-labels and the divergence rate use K = `n_clusters` [RECON] clusters (the code's 10; the
  paper gives none).
- Aggregation: normalised weights by default, the paper's divergence rate "acts as a weighting
  factor during the server aggregation" (§I); `code_compat_unnormalized` [PAPER≠CODE] reproduces
  Plato's theta += sum_c (n_c/N) w_c (theta_c - theta) with w = (1/d) / sum(1/d), a step about 1/m
  as long. The weight's direction (1/d: tighter clients weigh more) is the code's; the paper does
  not say it.
- Divergence: raw KMeans centroids, the paper's prototype being "the average of encodings assigned
  to this group" (§IV-B); `code_compat_normalized_centroids` [PAPER≠CODE] L2-normalises them (the
  code's kmeans_clustering) while the encodings stay raw.
- KMeans is scikit-learn's, seeded from the client's update stream (deterministic per cell).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..registry import Param
from ..ssl.objectives import OBJECTIVES, kmeans
from . import register
from ._ssl import SSL_HPARAMS, FederatedSSL
from .base import FORWARD_SHARE, Passes, Update, weighted_average


def _cluster_means(x: torch.Tensor, labels: torch.Tensor, clusters: torch.Tensor) -> torch.Tensor:
    """Row k: the mean of x over the samples whose label is clusters[k] (with gradient)."""
    onehot = (labels[None, :] == clusters[:, None]).to(x.dtype)
    return onehot @ x / onehot.sum(1, keepdim=True)


def prototype_contrastive_loss(ha: torch.Tensor, hb: torch.Tensor, ya: torch.Tensor, yb: torch.Tensor, criterion) -> torch.Tensor:
    """l_p: the clusters present in both views give prototype pairs (nu_a,k, nu_b,k), contrasted
    with `criterion` (NT-Xent: the other clusters' prototypes are the negatives)."""
    common = torch.from_numpy(np.intersect1d(ya.cpu().numpy(), yb.cpu().numpy())).to(ya.device)
    if len(common) < 2:  # one pair has no negative: nothing to contrast
        return ha.sum() * 0
    return criterion(_cluster_means(ha, ya, common), _cluster_means(hb, yb, common))


LN_FORMS = ("code", "prose", "algorithm1")
LN_SUPPORTS = ("view_a", "both_views")


def _sum_of_cluster_means(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """sum_k (1/N_k) sum_{j: labels_j = k} values_j over the labels present (the paper's reduction of l_n)."""
    return _cluster_means(values[:, None], labels, torch.unique(labels)).sum()


def prototype_meta_loss(za: torch.Tensor, zb: torch.Tensor, ya: torch.Tensor, yb: torch.Tensor, form: str = "code",
                        support: str = "view_a", tau: float = 0.5) -> torch.Tensor:
    """l_n: view a's cluster means are the support prototypes v_k (every cluster of view a, or with
    `support` 'both_views' those present in both views); view b's encodings z_j are the queries of
    their own cluster (labels re-indexed over the support). Both are L2-normalised. `form`:
      code        mean_j -log softmax_k(-||z_j - v_k||^2)[own]       (the code's CE)
      prose       sum_k -(1/N_k) sum_{j in k} softmax(-||z_j - v||)_k  (the prose: no log, Euclidean d)
      algorithm1  sum_k -(1/N_k) sum_{j in k} log[exp(z_j.v_k/tau) / sum_{a not in k} exp(z_a.v_k/tau)]
                  (Algorithm 1 line 21; a ranges over view b outside cluster k, a cluster with none is left out)."""
    if form not in LN_FORMS or support not in LN_SUPPORTS:
        raise ValueError(f"l_n form {form!r}, support {support!r}; allowed: {', '.join(LN_FORMS)} and {', '.join(LN_SUPPORTS)}")
    clusters = torch.unique(ya)
    if support == "both_views":
        clusters = clusters[torch.isin(clusters, yb)]
    keep = torch.isin(yb, clusters)
    if not keep.any():
        return za.sum() * 0
    protos = F.normalize(_cluster_means(za, ya, clusters), dim=1)
    queries = F.normalize(zb, dim=1)
    target = torch.searchsorted(clusters, yb[keep])  # clusters is sorted: the position of each query's cluster
    if form == "code":
        return F.cross_entropy(-torch.cdist(queries[keep], protos).pow(2), target)
    if form == "prose":
        prob = torch.softmax(-torch.cdist(queries[keep], protos), dim=1).gather(1, target[:, None])[:, 0]
        return -_sum_of_cluster_means(prob, target)
    logits = queries @ protos.T / tau  # (view b samples, support prototypes)
    outside = logits.masked_fill(yb[:, None] == clusters[None, :], float("-inf")).logsumexp(0)
    term = logits[keep].gather(1, target[:, None])[:, 0] - outside[target]
    has_negatives = torch.isfinite(outside[target])
    if not has_negatives.any():
        return za.sum() * 0
    return -_sum_of_cluster_means(term[has_negatives], target[has_negatives])


def divergence_rate(z: torch.Tensor, k: int, seed: int, normalized_centroids: bool = False) -> float:
    """Mean over KMeans clusters of the mean distance of the members to their centroid."""
    labels, centres = kmeans(z, k, seed)
    c = torch.as_tensor(centres, dtype=z.dtype, device=z.device)
    if normalized_centroids:
        c = F.normalize(c, dim=1)
    dist = (z - c[labels]).norm(dim=1)
    return float(torch.stack([dist[labels == j].mean() for j in torch.unique(labels)]).mean())


def divergence_weights(num_samples: list[float], divergences: list[float], unnormalized: bool = False) -> list[float]:
    """Each client's weight in the aggregate: normalised (n/d) / sum(n/d); or, as the code, the
    unnormalised (n/N) * (1/d) / sum(1/d) (the rest of the mass stays on the previous global model)."""
    n, d = np.asarray(num_samples, float), np.maximum(np.asarray(divergences, float), 1e-12)  # a collapsed encoder: d = 0
    if unnormalized:
        return list(n / n.sum() * (1 / d) / (1 / d).sum())
    return list((n / d) / (n / d).sum())


@register
class Calibre(FederatedSSL):
    name = "calibre"
    summary = "Calibre: SSL + prototype regularizers (l_p, l_n from per-batch KMeans), divergence-weighted FedAvg, linear probe per client"
    paper = "Chen, Su and Li, 2024 (Plato examples/ssl/calibre)"
    hparams = {
        **SSL_HPARAMS,
        "objective": Param("simclr", "the SSL objective l_s (Table I: simclr, swav, smog)", str, choices=tuple(OBJECTIVES.names())),
        "alpha": Param(0.3, "weight of l_p + l_n (paper: alpha = 0.3; config prototype_regularizers [0.3, 0.3])", float, minimum=0),
        "use_lp": Param(True, "include l_p, the prototype-oriented contrastive regularizer (Table I ablation)", bool),
        "use_ln": Param(True, "include l_n, the prototype-based meta regularizer (Table I ablation)", bool),
        "n_clusters": Param(10, "[RECON] KMeans clusters K for the pseudo-labels and the divergence rate (code: n_clusters 10, "
                                "also for CIFAR-100; the paper gives none)", int, minimum=1),
        "ln_form": Param("code", "[PAPER≠CODE] the form of l_n: 'code' = the code's CE of softmax(-||z^ - v^_k||^2) over the "
                                 "queries (methods.md §2.2; the prose's softmax(-d(z, v_k)) as a negative log-likelihood); "
                                 "'prose' = the prose's formula sum_k -(1/N_k) sum_j softmax(-d(z_j, v_k)), no log, "
                                 "Euclidean d; 'algorithm1' = Algorithm 1 line 21's dot-product / tau InfoNCE of each "
                                 "prototype against the samples outside its cluster", str, choices=LN_FORMS),
        "ln_temperature": Param(0.5, "[RECON] tau of l_n's Algorithm 1 form (ln_form 'algorithm1' only; the paper names tau "
                                     "but gives no value; l_p's NT-Xent temperature, lightly's default)",
                                float, exclusive_minimum=0),
        "ln_support": Param("view_a", "[PAPER≠CODE] l_n's support prototypes: 'view_a' = every cluster of view a (the prose's "
                                      "prototypes of I_e); 'both_views' = the clusters present in both views (the code's "
                                      "calibre_loss.py)", str, choices=LN_SUPPORTS),
        "lc_weight": Param(0.0, "[PAPER≠CODE] weight of the paper's l_c in L = l_c + l_s + alpha (l_p + l_n) (Algorithm 1 "
                                "line 23); only 0 (left out, as the code): the paper never defines l_c for its label-free "
                                "training stage", float, minimum=0, maximum=0),
        "lp_temperature": Param(0.5, "NT-Xent temperature of l_p (lightly's default, as the code)", float, exclusive_minimum=0),
        "divergence_weighting": Param(True, "weight the aggregate by n/d (Calibre); false = plain FedAvg", bool),
        "code_compat_unnormalized": Param(False, "[PAPER≠CODE] reproduce the code's unnormalised delta weighting "
                                                 "(theta += sum (n/N) w (theta_c - theta))", bool),
        "code_compat_normalized_centroids": Param(False, "[PAPER≠CODE] L2-normalise the KMeans centroids (not the encodings) in "
                                                         "the divergence rate, as the code's kmeans_clustering; the paper's "
                                                         "prototype is 'the average of encodings assigned to this group' "
                                                         "(§IV-B), the raw centroid (methods.md §2.3)", bool),
    }

    @classmethod
    def cost_passes_for(cls, hp, training):
        # the objective's views, and one forward over the train split for the divergence rate after
        # training; the per-batch KMeans (scikit-learn, on the CPU) is not modelled
        return Passes(super().cost_passes_for(hp, training).model + FORWARD_SHARE / training["local_epochs"])

    def __init__(self, engine, hp):
        super().__init__(engine, hp)
        from lightly.loss import NTXentLoss

        self.lp_criterion = NTXentLoss(temperature=hp["lp_temperature"])

    def regularizer(self, out):
        hp = self.hp
        if not (hp["use_lp"] or hp["use_ln"]) or hp["alpha"] == 0:
            return None
        seed = int(torch.randint(2**31 - 1, (1,)))  # from the client's seeded update stream
        labels, _ = kmeans(torch.cat([out.za, out.zb]), hp["n_clusters"], seed)
        ya, yb = labels[: len(out.za)], labels[len(out.za):]
        reg = out.loss.new_zeros(())
        if hp["use_lp"]:
            reg = reg + prototype_contrastive_loss(out.ha, out.hb, ya, yb, self.lp_criterion)
        if hp["use_ln"]:
            reg = reg + prototype_meta_loss(out.za, out.zb, ya, yb, hp["ln_form"], hp["ln_support"], hp["ln_temperature"])
        return hp["alpha"] * reg

    def upload_extras(self, client):
        z = self.engine.features(client.train.x).flatten(1)  # the non-augmented train split, encoder in eval mode
        seed = int(torch.randint(2**31 - 1, (1,)))
        return {"divergence": divergence_rate(z, self.hp["n_clusters"], seed, self.hp["code_compat_normalized_centroids"])}

    def aggregate(self, updates):
        if not self.hp["divergence_weighting"]:
            return super().aggregate(updates)
        w = divergence_weights([u.num_samples for u in updates], [u.extras["divergence"] for u in updates],
                               self.hp["code_compat_unnormalized"])
        weighted = [Update(u.client_id, wi, u.params) for u, wi in zip(updates, w)]
        if self.hp["code_compat_unnormalized"]:  # the mass the weights leave stays on the previous global model
            weighted.append(Update(-1, 1 - sum(w), self.server["global"]))
        self.server["global"] = {**self.server["global"], **weighted_average(weighted)}
