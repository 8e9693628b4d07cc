"""The protocols after the last round: unseen clients and global test sets.

Owns `evaluate_beyond`: the scores that need the trained federation as a whole, computed
once after training. Unseen (held-out) clients are scored with the global model (or the
average of the personalized models, for a method without one) and with the method's
new-client personalization; global test sets (the union of the clients' test splits, the
dataset's official test set) are scored with the global model, every client's personalized
model (GRP-FED's generalization G) and the harmonic mean of G and the client's own score
(GRP-FED's L). Every function takes the cell (engine.py's `Engine`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..federation import Client, Split, Update, weighted_average
from ..metrics import accuracy, harmonic_mean, macro_f1
from .evaluation import NO_SCORE, personal, personal_model, predict, probs, scored_by, scores

Params = dict[str, torch.Tensor]


def global_tests(engine) -> dict[str, Split]:
    """The global test sets the cell asked for: the union of the clients' test splits
    and/or the dataset's official test set."""
    out = {}
    for name in engine.training["global_test"]:
        if name == "union":
            out[name] = Split(engine.scoring.pooled("test"), torch.cat([c.test.y for c in engine.clients]))
        elif engine.official_test is None:
            raise ValueError("global_test 'official' needs a partition with pool: false (its official test set)")
        else:
            out[name] = engine.official_test
    return out


def mean_personal(engine, personal_models: list[Params | None]) -> Params:
    """The train-size-weighted average of the clients' personalized models (None: an excluded
    client): the "global model" of a method that has none (FedCRC's Table II protocol for
    FedPer/FedRep)."""
    return weighted_average([Update(c.id, c.num_train, p) for c, p in zip(engine.clients, personal_models) if p is not None])


def score_clients(engine, params: Params, clients: list[Client]) -> dict[str, list[float]]:
    """Accuracy and macro-F1 of `params` on each of `clients`' test split."""
    got = [scores(c.test.y, predict(engine, params, c.test.x)) for c in clients]
    return {"acc": [s[0] for s in got], "f1": [s[1] for s in got]}


def evaluate_beyond(engine, record: dict[str, Any]) -> dict[str, Any]:
    """After the last round (`record`: its evaluation): unseen clients and global test data.

    * unseen/global: the global model (or, for a method without one, the average of the
      personalized models) on each unseen client's test split; unseen/personal: the
      method's personalization of the unseen client (`Method.personalize_unseen`).
    * <test set>/global: the global model on the global test set (for a method without
      one, the average of the personalized models' softmax outputs, GRP-FED's protocol
      for Local and LG-FedAvg); <test set>/personal: every client's personalized model on
      it (GRP-FED's generalization G); <test set>/hm: per client, the harmonic mean of its
      own-test score P and G (GRP-FED's L).
    """
    method, out = engine.method, {}
    hows = [scored_by(engine, c) for c in engine.clients]  # after the last round, as in its evaluation
    # the clients' personalized models (None: excluded by the untrained rule), computed once, when needed
    personal_models: list[Params | None] = []
    if method.has_personal and ((engine.unseen and not method.has_global) or engine.training["global_test"]):
        personal_models = [personal_model(engine, c, how) for c, how in zip(engine.clients, hows)]
    if engine.unseen:
        g = method.global_params() if method.has_global else mean_personal(engine, personal_models)
        out["unseen/global"] = score_clients(engine, g, engine.unseen)
        if method.has_personal:
            got = [scores(c.test.y, predict(engine, personal(engine, c, "unseen-batches"), c.test.x)) for c in engine.unseen]
            out["unseen/personal"] = {"acc": [s[0] for s in got], "f1": [s[1] for s in got]}
    tests = global_tests(engine)
    if not tests:
        return out
    own = record["test/personal" if method.has_personal else "test/global"]
    for name, data in tests.items():
        y = data.y.cpu().numpy()
        outputs = [None if p is None else probs(engine, p, data.x) for p in personal_models]
        if method.has_global:
            g_pred = predict(engine, method.global_params(), data.x)
        else:
            g_pred = torch.stack([pr for pr in outputs if pr is not None]).mean(0).argmax(1).cpu().numpy()
        acc, f1 = accuracy(y, g_pred), macro_f1(y, g_pred)
        out[f"{name}/global"] = {"acc": [acc], "f1": [f1]}
        if personal_models:
            gen = [NO_SCORE if pr is None else (accuracy(y, pr.argmax(1).cpu().numpy()), macro_f1(y, pr.argmax(1).cpu().numpy()))
                   for pr in outputs]
            out[f"{name}/personal"] = {"acc": [s[0] for s in gen], "f1": [s[1] for s in gen]}
        else:  # a global-only method: every client's model is the global one (GRP-FED's G)
            gen = [NO_SCORE if how == "excluded" else (acc, f1) for how in hows]
        out[f"{name}/hm"] = {m: [harmonic_mean(p, g[i]) for p, g in zip(own[m], gen)] for i, m in enumerate(("acc", "f1"))}
    return out
