"""The protocols after the last round: unseen clients and global test sets.

Owns `evaluate_beyond`: the scores that need the trained federation as a whole, computed
once after training. Unseen (held-out) clients are scored with the global model (or the
average of the personalized models, for a method without one) and with the method's
new-client personalization; global test sets (the union of the clients' test splits, the
dataset's official test set) are scored with the global model, every client's personalized
model (GRP-FED's generalization G) and the harmonic mean of G and the client's own score
(GRP-FED's L). A tuning trial selected by L (tuning.metric.model union_hm) scores the same on
validation data instead: the union of the clients' validation splits and each client's own
validation score (`validation_tests`), never test data. Every function takes the cell
(engine.py's `Engine`).
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


#: evaluate_beyond's key prefix of the scores on validation data: metrics.json files them under
#: summary_val / final_val (record.build_metrics), where tuning reads, never beside the test scores.
VAL_PREFIX = "val:"

#: The validation analogues of the global test sets (cell `validation.global_test`), each from the
#: clients' validation splits alone. The official test set has none: no client holds part of it.
VALIDATION_TESTS = {
    "union": lambda engine: Split(engine.scoring.pooled("val"), torch.cat([c.val.y for c in engine.clients])),
}


def validation_tests(engine) -> dict[str, Split]:
    """The validation sets the cell asks for (a tuning trial scored on the union of the clients'
    validation splits, fedrepro.tuning.trial_validation); none for any other cell."""
    names = (engine.cell.get("validation") or {}).get("global_test") or []
    if names and not any(len(c.val) for c in engine.clients):
        raise ValueError(f"validation.global_test {names} needs validation splits; the clients have none")
    return {name: VALIDATION_TESTS[name](engine) for name in names}


def mean_personal(engine, personal_models: list[Params | None]) -> Params:
    """The train-size-weighted average of the clients' personalized models (None: an excluded
    client): the "global model" of a method that has none (FedCRC's Table II protocol for
    FedPer/FedRep)."""
    return weighted_average([Update(c.id, c.num_train, p) for c, p in zip(engine.clients, personal_models) if p is not None])


def score_clients(engine, params: Params, clients: list[Client]) -> dict[str, list[float]]:
    """Accuracy and macro-F1 of `params` on each of `clients`' test split."""
    got = [scores(c.test.y, predict(engine, params, c.test.x)) for c in clients]
    return {"acc": [s[0] for s in got], "f1": [s[1] for s in got]}


def whole_data(client: Client) -> Split:
    """All of a client's labelled samples (train, validation and test splits): what a client that
    never trained can be scored on (FedCRC's "evaluate on the remaining 40 clients", §IV-B)."""
    parts = [s for s in (client.train, client.val, client.test) if len(s)]
    return Split(torch.cat([s.x for s in parts]), torch.cat([s.y for s in parts]))


def score_test_set(engine, data: Split, own: dict[str, list[float]], personal_models: list[Params | None],
                   hows: list[str]) -> dict[str, dict[str, list[float]]]:
    """One global test set's scores by kind: global (the global model, or for a method without one
    the average of the personalized models' softmax outputs), personal (each client's personalized
    model: GRP-FED's G) and hm (per client, the harmonic mean of `own`, its score on its own split of
    the same kind of data, and G: GRP-FED's L)."""
    method, out = engine.method, {}
    y = data.y.cpu().numpy()
    outputs = [None if p is None else probs(engine, p, data.x) for p in personal_models]
    if method.has_global:
        g_pred = predict(engine, method.global_params(), data.x)
    else:
        g_pred = torch.stack([pr for pr in outputs if pr is not None]).mean(0).argmax(1).cpu().numpy()
    acc, f1 = accuracy(y, g_pred), macro_f1(y, g_pred)
    out["global"] = {"acc": [acc], "f1": [f1]}
    if personal_models:
        gen = [NO_SCORE if pr is None else (accuracy(y, pr.argmax(1).cpu().numpy()), macro_f1(y, pr.argmax(1).cpu().numpy()))
               for pr in outputs]
        out["personal"] = {"acc": [s[0] for s in gen], "f1": [s[1] for s in gen]}
    else:  # a global-only method: every client's model is the global one (GRP-FED's G)
        gen = [NO_SCORE if how == "excluded" else (acc, f1) for how in hows]
    out["hm"] = {m: [harmonic_mean(p, g[i]) for p, g in zip(own[m], gen)] for i, m in enumerate(("acc", "f1"))}
    return out


def evaluate_beyond(engine, record: dict[str, Any]) -> dict[str, Any]:
    """After the last round (`record`: its evaluation): unseen clients and global test data.

    * unseen/global: the global model (or, for a method without one, the average of the
      personalized models) on each unseen client's test split, unseen_all/global the same on all of
      its data (`whole_data`: it never trained on any of it); unseen/personal: the
      method's personalization of the unseen client (`Method.personalize_unseen`).
    * <test set>/global, <test set>/personal, <test set>/hm: `score_test_set` on each global
      test set, the harmonic mean with each client's own-test score P (GRP-FED's L).
    * val:<set>/global, .../personal, .../hm: the same on each validation set the cell asks for
      (`validation_tests`), the harmonic mean with each client's own VALIDATION score: GRP-FED's
      L on validation data, what tuning selects by (tuning.metric.model union_hm).
    """
    method, out = engine.method, {}
    hows = [scored_by(engine, c) for c in engine.clients]  # after the last round, as in its evaluation
    tests, val_tests = global_tests(engine), validation_tests(engine)
    # the clients' personalized models (None: excluded by the untrained rule), computed once, when needed
    personal_models: list[Params | None] = []
    if method.has_personal and ((engine.unseen and not method.has_global) or tests or val_tests):
        personal_models = [personal_model(engine, c, how) for c, how in zip(engine.clients, hows)]
    if engine.unseen:
        g = method.global_params() if method.has_global else mean_personal(engine, personal_models)
        out["unseen/global"] = score_clients(engine, g, engine.unseen)
        # the same model on all of each unseen client's data: about 5x the test split's resolution
        whole = [whole_data(c) for c in engine.unseen]
        got = [scores(d.y, predict(engine, g, d.x)) for d in whole]
        out["unseen_all/global"] = {"acc": [s[0] for s in got], "f1": [s[1] for s in got]}
        if method.has_personal:
            got = [scores(c.test.y, predict(engine, personal(engine, c, "unseen-batches"), c.test.x)) for c in engine.unseen]
            out["unseen/personal"] = {"acc": [s[0] for s in got], "f1": [s[1] for s in got]}
    own_kind = "personal" if method.has_personal else "global"
    for prefix, split, sets in (("", "test", tests), (VAL_PREFIX, "val", val_tests)):
        for name, data in sets.items():
            scored = score_test_set(engine, data, record[f"{split}/{own_kind}"], personal_models, hows)
            out.update({f"{prefix}{name}/{kind}": values for kind, values in scored.items()})
    return out
