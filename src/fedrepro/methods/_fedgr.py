"""FedGR, FedGCR's group reweighting (Cheng et al., AAAI 2024, Eq. 3-4, Algorithm 1; methods.md
§5.3-5.4), one copy of each piece:

* `class_balanced_mean`   h~_k = (1/C_k) sum_c mean_{x in D_c} h_x: every class the client has
                          counts once, however many samples it has (Eq. 4);
* `cluster_clients`       GMM clustering of the h~_k into T' groups (scikit-learn, seeded) and
                          the centres H_t = plain mean of the h~_k assigned to t;
* `cluster_purity`        clustering accuracy: the share of clients whose true type is the
                          majority type of their cluster (Table 3);
* `beta_at`               the beta schedule: paper beta_r = delta (1 - gamma^(r-1)), gamma = 0.5;
                          code beta_r = delta (1 - 0.9^r);
* `fedgr_weights`         w_k ∝ p_k (L_k^(1-beta) L~_g(k)^beta)^(q+1), L~_g the plain mean loss
                          of group g (Eq. 3; the code's data-size weighted mean behind `group_loss`),
                          normalised to sum 1 (the code's) or not (Algorithm 1's sum).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..registry import Param
from ._helpers import class_prototypes

COVARIANCES = ("diag", "full", "spherical", "tied")
BETA_SCHEDULES = ("paper", "code")
GROUP_LOSSES = ("mean", "size_weighted")
#: the code's gamma (utils/util.py `communication`: (1 - 0.5) * (1 - 0.9 ** (a_iter + 1)))
CODE_GAMMA = 0.9

COVARIANCE_PARAM = Param("full", "[RECON] GMM covariance type. The paper names only a 'Gaussian Mixture Model (GMM)', "
                                 "so the code decides: scikit-learn's default 'full' (the default since issue 35); "
                                 "'diag' is methods.md §5.3's robust option for d-dim representations and only 10-27 "
                                 "clients (the default before issue 35; on fedgcr_cpu both give the same clusters and "
                                 "the same scores, 3 seeds)", str,
                         choices=COVARIANCES)


def class_balanced_mean(h: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """h~ = mean over the classes present of the per-class mean of h (Eq. 4)."""
    means, counts = class_prototypes(h, y, num_classes)
    present = counts > 0
    return means[present].mean(0)


def cluster_clients(reps: torch.Tensor, num_groups: int, seed: int, covariance: str = COVARIANCE_PARAM.default,
                    reg_covar: float = 1e-6) -> tuple[np.ndarray, torch.Tensor]:
    """GMM(num_groups) fit_predict on the client representations (K, d): (group id per client,
    centres (G, d)). Empty components are dropped and the ids renumbered 0..G-1 in order of first
    appearance, so every centre is the mean of at least one client. The fit is in float64 with a
    fixed random_state (the code leaves it unseeded)."""
    from sklearn.mixture import GaussianMixture

    x = reps.detach().to("cpu", torch.float64).numpy()
    k = min(num_groups, len(x))
    if k <= 1:
        labels = np.zeros(len(x), dtype=np.int64)
    else:
        gmm = GaussianMixture(n_components=k, covariance_type=covariance, reg_covar=reg_covar, random_state=seed % 2**32)
        labels = gmm.fit_predict(x)
    _, labels = np.unique(labels, return_inverse=True)
    order = list(dict.fromkeys(labels.tolist()))
    labels = np.array([order.index(g) for g in labels], dtype=np.int64)
    centres = torch.stack([reps[torch.as_tensor(labels == g, device=reps.device)].mean(0) for g in range(len(order))])
    return labels, centres


def cluster_purity(groups: Sequence[int], types: Sequence[int]) -> float:
    """Share of clients whose type is the majority type of their group (FedGCR Table 3)."""
    groups, types = np.asarray(groups), np.asarray(types)
    correct = sum(np.bincount(types[groups == g]).max() for g in np.unique(groups))
    return float(correct) / len(groups)


def beta_at(round: int, schedule: str = "paper", delta: float = 0.5, gamma: float = 0.5) -> float:
    """beta of (1-based) round r: paper delta (1 - gamma^(r-1)) (Algorithm 1: 0.5 - 0.5 gamma^(r-1),
    so 0 in round 1); code delta (1 - 0.9^r) (0.05 in round 1; `gamma` is ignored)."""
    if schedule == "paper":
        return delta * (1.0 - gamma ** (round - 1))
    if schedule == "code":
        return delta * (1.0 - CODE_GAMMA**round)
    raise ValueError(f"beta schedule {schedule!r}; allowed: {', '.join(BETA_SCHEDULES)}")


def fedgr_weights(losses: Sequence[float], sizes: Sequence[float], groups: Sequence[int], beta: float,
                  q: float, group_loss: str = "mean", normalized: bool = True) -> torch.Tensor:
    """w_k = p_k (L_k^(1-beta) L~_g(k)^beta)^(q+1) / normaliser, p_k = n_k / n. The group loss
    L~_g is the plain mean over the group's clients, (1/N_g) sum_{k in g} L_k (`group_loss: mean`,
    the paper's Eq. 3 and Algorithm 1 line 8); `size_weighted` is the code's
    sum_{k in g} p_k L_k / sum_{k in g} p_k (utils/util.py `communication`: gloss += loss * client_weights).
    The normaliser is sum_k of the numerators (the code's); `normalized` False leaves it out, as
    Algorithm 1 writes theta^r = sum omega_ij (L'_ij)^(q+1) theta_ij. Computed in log space (float64)."""
    if group_loss not in GROUP_LOSSES:
        raise ValueError(f"group_loss {group_loss!r}; allowed: {', '.join(GROUP_LOSSES)}")
    loss = torch.as_tensor(losses, dtype=torch.float64).clamp(min=1e-10)
    p = torch.as_tensor(sizes, dtype=torch.float64)
    p = p / p.sum()
    g = torch.as_tensor(np.asarray(groups), dtype=torch.long)
    within = p if group_loss == "size_weighted" else torch.ones_like(p)  # each client's weight inside its group
    group_mean = torch.zeros(int(g.max()) + 1, dtype=torch.float64).index_add_(0, g, within * loss)
    group_mean = group_mean / torch.zeros_like(group_mean).index_add_(0, g, within)
    scores = p.log() + (q + 1) * ((1 - beta) * loss.log() + beta * group_mean[g].log())
    return torch.softmax(scores, 0) if normalized else scores.exp()
