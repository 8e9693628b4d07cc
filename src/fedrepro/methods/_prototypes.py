"""Class prototypes as FedProto, FedPAC and FedGH exchange them (one copy of each piece).

* `local_prototypes`       a client's per-class mean representations over its train split
                           (eval mode, after local training), only for the classes it has;
* `aggregate_prototypes`   the server's per-class average over the clients that have the class;
* `alignment_loss`         the local loss CE + lambda * MSE(representation, global prototype of y);
* `nearest_prototype_head` a linear head whose argmax is the nearest global prototype.

A prototype message is a dict of tensors {"classes": (k,) int64, "protos": (k, d)} (plus
"counts": (k,) when the server weights by samples), so only the classes a client has
travel and the engine counts exactly those bytes. The server keeps the dense form
{"protos": (C, d), "present": (C,) bool}.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Param
from ._helpers import class_prototypes
from .base import Batch, Client, Engine

Message = dict[str, torch.Tensor]

WEIGHTINGS = ("clients", "samples")


def weighting_param(default: str, doc: str) -> Param:
    return Param(default, "how the server averages a class's prototypes over the clients that have it: 'clients' = "
                          "unweighted mean, 'samples' = weighted by the clients' counts of the class; " + doc,
                 str, choices=WEIGHTINGS)


def require_linear_head(engine: "Engine", method: str) -> None:
    head = engine.model.head
    if not (isinstance(head, nn.Linear) and head.bias is not None):
        raise ValueError(f"method '{method}' needs a model whose head is a Linear layer with a bias; "
                         f"got {type(head).__name__}")


def local_prototypes(engine: "Engine", client: "Client", with_counts: bool = False) -> Message:
    """Per-class mean representations of the client's train split under the model object's
    current parameters (eval mode, no augmentation), for the classes the client has."""
    protos, counts = class_prototypes(engine.features(client.train.x), client.train.y, engine.num_classes)
    classes = torch.nonzero(counts > 0).flatten()
    out = {"classes": classes, "protos": protos[classes]}
    if with_counts:
        out["counts"] = counts[classes]
    return out


def empty_prototypes(num_classes: int, dim: int, device: torch.device) -> Message:
    """The server's dense prototype state before any upload: no class has a prototype."""
    return {"protos": torch.zeros(num_classes, dim, device=device),
            "present": torch.zeros(num_classes, dtype=torch.bool, device=device)}


def known_prototypes(state: Message) -> Message:
    """The server's message: the global prototypes of the classes that have one."""
    classes = torch.nonzero(state["present"]).flatten()
    return {"classes": classes, "protos": state["protos"][classes]}


def aggregate_prototypes(uploads: list[Message], num_classes: int, dim: int, weighting: str,
                         device: torch.device) -> Message:
    """Global prototype of class c = average of the uploaded prototypes of c, over the
    clients that uploaded one: unweighted ('clients': FedProto's and PFLlib's
    proto_aggregation) or weighted by the clients' counts of c ('samples': FedPAC).
    Classes nobody uploaded this round have no global prototype."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown prototype weighting {weighting!r}; allowed: {WEIGHTINGS}")
    state = empty_prototypes(num_classes, dim, device)
    sums, weights = state["protos"].double(), torch.zeros(num_classes, dtype=torch.float64, device=device)
    for u in uploads:
        w = u["counts"].double() if weighting == "samples" else torch.ones(len(u["classes"]), dtype=torch.float64, device=device)
        # one row per class in an upload: no index collides, so this is deterministic on CUDA too
        sums.index_add_(0, u["classes"], u["protos"].double() * w[:, None])
        weights.index_add_(0, u["classes"], w)
    present = weights > 0
    return {"protos": (sums / weights.clamp(min=1e-300)[:, None]).to(state["protos"].dtype), "present": present}


def keep_missing(old: Message, new: Message) -> Message:
    """The round's global prototypes `new`, with each class that nobody uploaded this round
    keeping its prototype from `old` (dense server states)."""
    return {"protos": torch.where(new["present"][:, None], new["protos"], old["protos"]),
            "present": new["present"] | old["present"]}


def dense(message: Message, num_classes: int, dim: int, device: torch.device) -> Message:
    """The (C, d) table and (C,) mask of a prototype message."""
    state = empty_prototypes(num_classes, dim, device)
    state["protos"][message["classes"]] = message["protos"].to(state["protos"].dtype)
    state["present"][message["classes"]] = True
    return state


def alignment_loss(message: Message, num_classes: int, lam: float) -> Callable[["Batch"], torch.Tensor] | None:
    """`loss_fn` for `engine.fit`: CE(logits, y) + lam * MSE(z, p_y), with z the extractor's
    representation and p_y the global prototype of the label. As in PFLlib (clientproto,
    clientpac), MSE is torch's mean over all batch x d entries, and a sample whose class
    has no global prototype gets its own detached z as target (zero term, still counted in
    the mean). None (plain CE) when no class has a global prototype yet (the first round)."""
    if len(message["classes"]) == 0 or lam == 0:
        return None
    table = dense(message, num_classes, message["protos"].shape[1], message["protos"].device)
    protos, present = table["protos"], table["present"]

    def loss(batch: "Batch") -> torch.Tensor:
        z, y = batch.features, batch.y
        target = torch.where(present[y][:, None], protos[y], z.detach())
        return F.cross_entropy(batch.logits, y) + lam * F.mse_loss(z, target)

    return loss


def nearest_prototype_head(state: Message) -> dict[str, torch.Tensor]:
    """A Linear(d, C) head whose argmax is the nearest global prototype (squared Euclidean).

    -||z - p_c||^2 = 2 z.p_c - ||p_c||^2 - ||z||^2, and ||z||^2 is the same for every class,
    so weight row c = 2 p_c and bias c = -||p_c||^2 give logits that differ from the
    negative squared distances by a per-sample constant: the same argmax, exactly.
    Classes without a global prototype get weight 0 and bias -inf (never predicted).
    """
    protos, present = state["protos"], state["present"]
    weight = torch.where(present[:, None], 2 * protos, torch.zeros_like(protos))
    bias = torch.where(present, -(protos * protos).sum(1), torch.full_like(protos[:, 0], float("-inf")))
    return {"head.weight": weight, "head.bias": bias}
