"""The t-SNE picture of chosen clients' representations (`evaluation.embed_clients`).

Owns `embedding`: after training, the representations of the chosen clients' test samples
under the model each is scored with (its personalized model, else the global one), laid out
in 2-D by scikit-learn's seeded t-SNE, for metrics.json's `embedding` entry and the report's
plot. Takes the cell (engine.py's `Engine`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..io import derive_seed
from .evaluation import personal, personal_model, scored_by
from .training import features, set_params


def embedding(engine, ids: list[int]) -> dict[str, Any] | None:
    """The representations of the test samples of clients `ids` under the model each is scored
    with (its personalized model, else the global one), laid out in 2-D by scikit-learn's t-SNE
    (seeded): {client, label, x, y} per sample. None when no client is asked for."""
    known = {c.id: c for c in (*engine.clients, *engine.unseen)}
    clients = [known[i] for i in ids if i in known]
    if not clients:
        return None
    from sklearn.manifold import TSNE

    feats, owner = [], []
    for c in clients:
        if engine.method.has_personal:
            params = personal(engine, c, "unseen-batches") if c.unseen else personal_model(engine, c, scored_by(engine, c))
        else:
            params = engine.method.global_params()
        if params is None:
            continue
        set_params(engine.model, params)
        feats.append(features(engine, c.test.x).flatten(1).cpu())
        owner += [c.id] * len(c.test)
    if not feats:  # every chosen client excluded by the untrained rule
        return None
    z = torch.cat(feats).numpy()
    xy = TSNE(2, perplexity=min(30.0, max(1.0, (len(z) - 1) / 3)), init="pca",
              random_state=derive_seed(engine.seed, "tsne") % 2**31).fit_transform(z)
    labels = torch.cat([known[i].test.y.cpu() for i in dict.fromkeys(owner)]).tolist()
    return {"client": owner, "label": labels, "x": [round(float(v), 4) for v in xy[:, 0]],
            "y": [round(float(v), 4) for v in xy[:, 1]]}
