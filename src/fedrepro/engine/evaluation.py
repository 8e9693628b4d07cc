"""Per-round evaluation and the untrained-client rule.

Owns how the federation's clients are scored at an evaluated round: the global model on every
client's own test (and validation) split in one pooled pass, each client's personalized model
on its own splits, and how a client that has not trained yet is scored (`evaluation.untrained`:
personalize, initial or exclude; `scored_by`). Personalized models are computed on batch
streams of their own (per purpose, round and client: training.Streams.personal), so evaluating
never changes training. What it keeps across a cell's evaluations is its own (`Scoring`). Every
function takes the cell (engine.py's `Engine`).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..federation import Client
from ..io import derive_seed
from ..metrics import accuracy, macro_f1
from .training import set_params

Params = dict[str, torch.Tensor]

# How a client that has not trained yet is scored (config `evaluation.untrained`):
#   personalize  the method's new-client personalization (`Method.personalize_unseen`: one local
#                update from the broadcast, then its personal model), as for held-out clients;
#   initial      the common seeded initial model (PFLlib's clients before their first round);
#   exclude      left out of every aggregate (its scores are None in metrics.json).
# The rule applies to every method alike: the personal column of a method with personalized
# models, and (exclude only) the global column, so every row is computed on the same clients.
UNTRAINED_RULES = ("personalize", "initial", "exclude")

NO_SCORE = (math.nan, math.nan)  # accuracy and F1 of a client left out (excluded by the untrained rule)


class Scoring:
    """What evaluation keeps across a cell's evaluations: every split's inputs of all `clients`
    concatenated once (`pooled`), and the seconds spent making and scoring personalized models
    (`personal_seconds`: metrics.json's resources)."""

    def __init__(self, clients: list[Client]):
        self.clients = clients
        self.inputs: dict[str, torch.Tensor] = {}
        self.personal_seconds = 0.0

    def pooled(self, split: str) -> torch.Tensor:
        """All clients' inputs of one split in client order, concatenated once and cached:
        the global model is scored on every client in a single batched pass."""
        if split not in self.inputs:
            self.inputs[split] = torch.cat([getattr(c, split).x for c in self.clients])
        return self.inputs[split]


def scores(y: torch.Tensor, pred: np.ndarray) -> tuple[float, float]:
    """Accuracy and macro-F1 of predictions `pred` of labels `y`."""
    yt = y.cpu().numpy()
    return accuracy(yt, pred), macro_f1(yt, pred)


@torch.no_grad()
def predict(engine, params: Params, x: torch.Tensor) -> np.ndarray:
    """The predicted classes of `x` under `params` (copied into the model object), in chunks."""
    set_params(engine.model, params)
    engine.model.eval()
    bs = engine.training["eval_batch_size"]
    out = [engine.model(x[i : i + bs]).argmax(1) for i in range(0, len(x), bs)]
    return torch.cat(out).cpu().numpy() if out else np.zeros(0, dtype=np.int64)


@torch.no_grad()
def probs(engine, params: Params, x: torch.Tensor) -> torch.Tensor:
    """The softmax outputs on `x` under `params`, in chunks."""
    set_params(engine.model, params)
    engine.model.eval()
    bs = engine.training["eval_batch_size"]
    return torch.cat([F.softmax(engine.model(x[i : i + bs]), 1) for i in range(0, len(x), bs)])


def has_trained(engine, client: Client) -> bool:
    """Whether `client` has taken part in a round up to the current one."""
    rounds = engine.trained_in.get(client.id, [])
    return bool(rounds) and rounds[0] <= engine.round


def scored_by(engine, client: Client) -> str:
    """How `client` is scored now: 'trained', or for a client that has not trained yet the
    untrained rule ('personalize', 'initial', 'excluded'; 'global' for a method whose
    only model is the global one, which scores every client)."""
    if has_trained(engine, client):
        return "trained"
    if engine.untrained_rule == "exclude":
        return "excluded"
    return engine.untrained_rule if engine.method.has_personal else "global"


def evaluate(engine, personal: bool = True) -> dict[str, Any]:
    """Per-client accuracy and macro-F1 of the global and personalized models on each
    client's own test split (and validation split, where there is one). Clients that have
    not trained yet are scored by the untrained rule (`scored_by`); excluded ones get NaN.
    `personal=False` (a round `training.personal_eval_every` skips): the personalized
    column is NaN for every client, and no personalized model is computed."""
    clients = engine.clients
    splits = ["test"] + (["val"] if any(len(c.val) for c in clients) else [])
    record: dict[str, Any] = {"round": engine.round, "scored_by": [scored_by(engine, c) for c in clients]}
    keep = [how != "excluded" for how in record["scored_by"]]
    method = engine.method
    global_params = method.global_params() if method.has_global else None
    for split in splits:
        if global_params is not None:
            pred = predict(engine, global_params, engine.scoring.pooled(split))
            bounds = np.cumsum([0] + [len(getattr(c, split)) for c in clients])
            got = [scores(getattr(c, split).y, pred[a:b]) if k else NO_SCORE
                   for c, a, b, k in zip(clients, bounds[:-1], bounds[1:], keep)]
            record[f"{split}/global"] = {"acc": [s[0] for s in got], "f1": [s[1] for s in got]}
    if method.has_personal and not personal:
        for split in splits:
            record[f"{split}/personal"] = {"acc": [math.nan] * len(clients), "f1": [math.nan] * len(clients)}
    elif method.has_personal:
        t0 = time.perf_counter()
        per = {s: [] for s in splits}
        for c, how in zip(clients, record["scored_by"]):
            params = personal_model(engine, c, how)
            for split in splits:
                data = getattr(c, split)
                per[split].append(NO_SCORE if params is None else scores(data.y, predict(engine, params, data.x)))
        for split in splits:
            record[f"{split}/personal"] = {"acc": [s[0] for s in per[split]], "f1": [s[1] for s in per[split]]}
        engine.scoring.personal_seconds += time.perf_counter() - t0
    return record


def personal_model(engine, client: Client, how: str) -> Params | None:
    """The personalized model that scores `client` (`how` = `scored_by(client)`); None if excluded."""
    if how == "trained":
        return personal(engine, client)
    if how == "initial":
        return engine.initial_params
    if how == "personalize":
        # The new-client personalization must leave no trace: the client's state is restored
        # and the batches come from a stream of their own, so training is unchanged.
        saved = copy.deepcopy(client.state)
        torch.manual_seed(derive_seed(engine.seed, "untrained-personalize", engine.round, client.id))
        try:
            return personal(engine, client, "untrained-batches")
        finally:
            client.state = saved
    return None


def personal(engine, client: Client, purpose: str = "eval-batches") -> Params:
    """A client's personalized model: the method's (`purpose` "eval-batches"), or its new-client
    personalization (`Method.personalize_unseen`). Fine-tuning draws its batches from a stream of
    its own per (purpose, round, client): independent of training and of evaluation order."""
    with engine.streams.personal(purpose):
        return engine.method.personal_params(client) if purpose == "eval-batches" else engine.method.personalize_unseen(client)
