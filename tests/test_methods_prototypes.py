"""Shared representations: FedProto, FedPAC and FedGH (class prototypes, feature-statistics
QP for head combination, a global head trained on prototypes).

Each test fails if the method's distinctive mechanism is removed or wrong; expected values
are computed by hand or by a second, independent route."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedrepro.engine import evaluation, training
from fedrepro.engine.engine import Batch, FitResult
from fedrepro.methods import Update, payload_bytes
from fedrepro.methods._prototypes import aggregate_prototypes, alignment_loss, nearest_prototype_head
from fedrepro.methods.fedgh import train_head
from fedrepro.methods.fedpac import combination_weights, feature_statistics

from conftest import method_engine


def make_engine(tiny_partition, make_cell, name, **hparams):
    eng = method_engine(tiny_partition, make_cell, name, hparams)
    eng.method.setup()
    eng.round = 1
    return eng


def local_update(eng, client):
    eng.streams.start_client()  # as the engine's loop does before every client
    return eng.method.local_update(client, eng.method.broadcast(client))


def part(params, prefix):
    return {k: v for k, v in params.items() if k.startswith(prefix)}


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_checkpointable(eng, tmp_path):
    """Server and client states survive the engine's checkpoint format (weights_only load)."""
    state = {"server": eng.method.server, "clients": {c.id: c.state for c in eng.clients}}
    torch.save(state, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert loaded["server"].keys() == state["server"].keys()


# -- prototypes (FedProto, shared with FedPAC and FedGH) --------------------------------------------


@pytest.mark.parametrize("name", ["fedproto", "fedgh"])
def test_uploads_are_the_per_class_mean_representations_and_nothing_else(tiny_partition, make_cell, name):
    eng = make_engine(tiny_partition, make_cell, name)
    client = eng.clients[0]
    update = local_update(eng, client)
    assert update.params == {} and set(update.extras) == {"classes", "protos"}  # no parameter leaves the client
    # by hand: the trained model's eval-mode representations, averaged per class with a loop
    eng.set_params(client.state["model"])
    feats, y = eng.features(client.train.x), client.train.y
    classes = sorted(set(y.tolist()))
    assert update.extras["classes"].tolist() == classes
    for c, proto in zip(classes, update.extras["protos"]):
        rows = [feats[i] for i in range(len(y)) if int(y[i]) == c]
        assert torch.allclose(proto, sum(rows) / len(rows), atol=1e-6)
    assert payload_bytes(update.extras) == len(classes) * (8 + 4 * eng.model.feature_dim)


def test_server_averages_each_class_over_the_clients_that_have_it():
    a = {"classes": torch.tensor([0, 1]), "protos": torch.tensor([[1.0, 0.0], [0.0, 2.0]]), "counts": torch.tensor([5.0, 1.0])}
    b = {"classes": torch.tensor([1]), "protos": torch.tensor([[0.0, 4.0]]), "counts": torch.tensor([3.0])}
    cpu = torch.device("cpu")
    flat = aggregate_prototypes([a, b], 3, 2, "clients", cpu)
    assert flat["present"].tolist() == [True, True, False]  # class 2: nobody has it
    assert torch.allclose(flat["protos"][:2], torch.tensor([[1.0, 0.0], [0.0, 3.0]]))  # (2 + 4) / 2 clients
    weighted = aggregate_prototypes([a, b], 3, 2, "samples", cpu)
    assert torch.allclose(weighted["protos"][:2], torch.tensor([[1.0, 0.0], [0.0, 3.5]]))  # (1*2 + 3*4) / 4 samples


def test_fedproto_aggregate_replaces_the_global_prototypes_with_the_rounds_average(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell, "fedproto")
    d = eng.model.feature_dim
    p = lambda *v: torch.tensor([list(v) + [0.0] * (d - len(v))])
    eng.method.aggregate([Update(0, 10, extras={"classes": torch.tensor([3]), "protos": p(1.0, 1.0)}),
                          Update(1, 99, extras={"classes": torch.tensor([3]), "protos": p(3.0, -1.0)})])
    server = eng.method.server
    assert server["present"].nonzero().flatten().tolist() == [3]
    assert torch.allclose(server["protos"][3], p(2.0, 0.0)[0])  # unweighted: the 10 vs 99 samples do not matter
    msg = eng.method.broadcast(eng.clients[0])
    assert msg["classes"].tolist() == [3] and payload_bytes(msg) == 8 + 4 * d  # only known prototypes travel


@pytest.mark.parametrize("keep", [True, False])
def test_fedproto_a_class_missing_from_a_round_keeps_its_last_global_prototype(tiny_partition, make_cell, keep):
    """Under partial participation a round can lack a class: its global prototype must survive
    (else it is never predicted again); keep_missing: false is PFLlib's rebuild-every-round."""
    eng = make_engine(tiny_partition, make_cell, "fedproto", keep_missing=keep)
    d = eng.model.feature_dim
    p = lambda *v: torch.tensor([list(v) + [0.0] * (d - len(v))])
    eng.method.aggregate([Update(0, 10, extras={"classes": torch.tensor([3, 4]), "protos": torch.cat([p(1.0), p(0.0, 2.0)])})])
    eng.method.aggregate([Update(1, 10, extras={"classes": torch.tensor([3]), "protos": p(3.0)})])  # no class 4
    server = eng.method.server
    assert torch.allclose(server["protos"][3], p(3.0)[0])  # a class present this round: this round's average
    assert bool(server["present"][4]) == keep
    if keep:
        assert torch.allclose(server["protos"][4], p(0.0, 2.0)[0])
        head = eng.method.personal_params(eng.clients[0])
        assert torch.isfinite(head["head.bias"][4])  # class 4 can still be predicted


def test_alignment_loss_is_ce_plus_lambda_mse_to_the_global_prototype_of_the_label():
    z = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 3.0]])
    logits = torch.tensor([[0.5, -0.5, 0.0], [0.0, 1.0, 2.0], [1.0, 1.0, 1.0]])
    y = torch.tensor([0, 2, 1])
    msg = {"classes": torch.tensor([0, 2]), "protos": torch.tensor([[1.0, 0.0], [2.0, 1.0]])}  # class 1: no prototype
    loss = alignment_loss(msg, 3, lam=0.5)(Batch(None, y, z, logits))
    # squared errors: sample 0 -> (0^2 + 2^2), sample 1 -> (2^2 + 2^2), sample 2 -> 0; mean over 3 x 2 entries
    expected = F.cross_entropy(logits, y) + 0.5 * (4.0 + 8.0) / 6
    assert torch.allclose(loss, expected)
    assert alignment_loss({"classes": torch.tensor([], dtype=torch.long), "protos": torch.zeros(0, 2)}, 3, 0.5) is None


@pytest.mark.parametrize("name", ["fedproto", "fedpac"])
def test_local_training_uses_the_alignment_loss_with_the_global_prototypes(tiny_partition, make_cell, monkeypatch, name):
    eng = make_engine(tiny_partition, make_cell, name, lam=0.7)
    d = eng.model.feature_dim
    present = torch.zeros(eng.num_classes, dtype=torch.bool)
    present[[1, 4]] = True
    eng.method.server.update(protos=torch.arange(eng.num_classes * d, dtype=torch.float32).reshape(-1, d) / 100,
                             present=present)
    fit, calls = training.fit, []  # where every fit runs (engine.fit and fit_many's client loop)
    monkeypatch.setattr(training, "fit", lambda engine, client, **kw: (calls.append(kw), fit(engine, client, **kw))[1])
    local_update(eng, eng.clients[0])
    (loss_fn,) = [kw["loss_fn"] for kw in calls if kw.get("loss_fn") is not None]  # one phase: the representation's
    g = torch.Generator().manual_seed(0)
    z, logits, y = torch.randn(3, d, generator=g), torch.randn(3, eng.num_classes, generator=g), torch.tensor([4, 0, 1])
    target = torch.stack([eng.method.server["protos"][4], z[1], eng.method.server["protos"][1]])  # class 0: none
    expected = F.cross_entropy(logits, y) + 0.7 * ((z - target) ** 2).mean()
    assert torch.allclose(loss_fn(Batch(None, y, z, logits)), expected)


def test_nearest_prototype_head_equals_argmin_distance():
    g = torch.Generator().manual_seed(0)
    protos = torch.randn(6, 5, generator=g)
    present = torch.tensor([True, False, True, True, False, True])
    z = torch.randn(200, 5, generator=g) * 2
    head = nearest_prototype_head({"protos": protos, "present": present})
    pred = F.linear(z, head["head.weight"], head["head.bias"]).argmax(1)
    known = present.nonzero().flatten()
    assert torch.equal(pred, known[torch.cdist(z, protos[known]).argmin(1)])
    assert set(pred.tolist()) <= set(known.tolist())


def test_fedproto_personal_model_predicts_the_nearest_global_prototype(tiny_partition, make_cell, tmp_path):
    eng = make_engine(tiny_partition, make_cell, "fedproto")
    client = eng.clients[1]
    local_update(eng, client)
    g = torch.Generator().manual_seed(1)
    present = torch.zeros(eng.num_classes, dtype=torch.bool)
    present[[0, 2, 3, 5, 7, 8]] = True
    eng.method.server.update(protos=torch.rand(eng.num_classes, eng.model.feature_dim, generator=g), present=present)
    params = eng.method.personal_params(client)
    pred = torch.as_tensor(evaluation.predict(eng, params, client.test.x))
    # directly: the client's own representations, nearest global prototype
    eng.set_params(client.state["model"])
    feats = eng.features(client.test.x)
    known = present.nonzero().flatten()
    assert torch.equal(pred, known[torch.cdist(feats, eng.method.server["protos"][known]).argmin(1)])
    assert equal(part(params, "extractor."), part(client.state["model"], "extractor."))
    assert_checkpointable(eng, tmp_path)


# -- FedPAC ---------------------------------------------------------------------------------------------


def qp_objective(alpha, variances, stats, i):
    diff = sum(a * (stats[i] - s) for a, s in zip(alpha, stats))
    return float(np.sum(alpha**2 * variances) + np.sum(diff**2))


def test_combination_weights_solve_the_qp_on_the_simplex():
    h = np.array([[1.0, 0.0], [0.0, 1.0]])
    same, far = h, h + 5.0
    # identical statistics: alpha minimises 1 a^2 + 3 b^2 on a + b = 1 -> (3/4, 1/4)
    assert np.allclose(combination_weights(np.array([1.0, 3.0]), np.stack([same, same]), 0), [0.75, 0.25], atol=1e-4)
    # client 0 is noisy; client 1 matches its statistics, client 2 is off by 5 in each of 4 entries:
    # 10 a^2 + b^2 + (1 + 100) c^2 on the simplex -> alpha proportional to (1/10, 1, 1/101)
    alpha = combination_weights(np.array([10.0, 1.0, 1.0]), np.stack([same, same, far]), 0)
    expected = np.array([1 / 10, 1, 1 / 101])
    assert np.allclose(alpha, expected / expected.sum(), atol=1e-4)
    # further off (1 + 10000) c^2: its weight ~1e-4 falls below 1e-3 and is zeroed (official code) -> (1/11, 10/11, 0)
    alpha = combination_weights(np.array([10.0, 1.0, 1.0]), np.stack([same, same, h + 50.0]), 0)
    assert np.allclose(alpha, [1 / 11, 10 / 11, 0.0], atol=1e-4) and alpha[2] == 0
    # a mismatched client's own noise cannot be averaged away with the others: it keeps its own head
    assert np.allclose(combination_weights(np.array([1e-3, 1e-3, 1e-3]), np.stack([same, same, far]), 2), [0, 0, 1], atol=1e-4)
    # random statistics: on the simplex, and no simplex grid point does better
    rng = np.random.default_rng(0)
    variances, stats = rng.random(3), rng.normal(size=(3, 4, 2))
    for i in range(3):
        alpha = combination_weights(variances, stats, i)
        assert (alpha >= 0).all() and alpha.sum() == pytest.approx(1.0)
        grid = [np.array([a, b, 1 - a - b]) for a, b in itertools.product(np.linspace(0, 1, 41), repeat=2) if a + b <= 1]
        assert qp_objective(alpha, variances, stats, i) <= min(qp_objective(q, variances, stats, i) for q in grid) + 1e-6


def test_feature_statistics_match_their_definition():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (40,), generator=g)
    y[0] = 3
    v, h = feature_statistics(z, y, 5)
    onehot = F.one_hot(y, 5).double()
    h_direct = (z[:, :, None] * onehot[:, None, :]).mean(0).T  # E[f(x) e_y^T], as (C, d)
    assert torch.allclose(h, h_direct)
    v_direct = ((z[:, :, None] * onehot[:, None, :] - h.T) ** 2).sum((1, 2)).mean()  # E||f(x) e_y^T - h||_F^2
    assert torch.allclose(v, v_direct)
    assert torch.equal(h[4], torch.zeros(3))  # an absent class


def test_fedpac_head_phase_does_not_move_the_extractor_and_vice_versa(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell, "fedpac")
    client = eng.clients[0]
    start = eng.get_params()
    eng.method.train_head(client)
    after_head = eng.get_params()
    assert equal(part(after_head, "extractor."), part(start, "extractor."))
    assert not equal(part(after_head, "head."), part(start, "head."))
    msg = {"classes": torch.tensor([0, 1]), "protos": torch.ones(2, eng.model.feature_dim)}
    eng.method.train_extractor(client, msg)
    after_body = eng.get_params()
    assert equal(part(after_body, "head."), part(after_head, "head."))
    assert not equal(part(after_body, "extractor."), part(after_head, "extractor."))


def test_fedpac_round_averages_extractors_and_gives_each_client_its_qp_combination(tiny_partition, make_cell, tmp_path):
    eng = make_engine(tiny_partition, make_cell, "fedpac")
    updates = [local_update(eng, c) for c in eng.clients]
    assert all(u.params.keys() == eng.get_params().keys() and {"V", "h", "classes", "protos", "counts"} <= set(u.extras)
               for u in updates)
    eng.method.aggregate(updates)
    n = sum(u.num_samples for u in updates)
    for k, v in part(eng.method.server["global"], "extractor.").items():
        assert torch.allclose(v, sum(u.params[k] * u.num_samples / n for u in updates), atol=1e-6)
    variances = np.array([float(u.extras["V"]) / u.num_samples for u in updates])
    stats = np.stack([u.extras["h"].double().numpy() for u in updates])
    mixed = 0
    for i, c in enumerate(eng.clients):
        alpha = combination_weights(variances, stats, i)
        for k in ("head.weight", "head.bias"):
            assert torch.allclose(c.state["head"][k], sum(float(a) * u.params[k] for a, u in zip(alpha, updates)), atol=1e-6)
        mixed += int((alpha > 0).sum() > 1)
        personal = eng.method.personal_params(c)
        assert equal(part(personal, "head."), c.state["head"])
        assert equal(part(personal, "extractor."), part(eng.method.server["global"], "extractor."))
    assert mixed > 0  # the QP does combine heads here (not a copy of each client's own)
    # the global column: global extractor + the sample-weighted average of the personalized heads
    g = eng.method.global_params()
    assert torch.allclose(g["head.weight"], sum(c.state["head"]["head.weight"] * c.num_train / n for c in eng.clients), atol=1e-6)
    assert_checkpointable(eng, tmp_path)


# -- FedGH ----------------------------------------------------------------------------------------------


def test_fedgh_server_step_is_one_sgd_step_of_ce_on_the_prototypes():
    protos = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    labels = torch.tensor([0, 2, 1])
    head = {"head.weight": torch.tensor([[0.1, 0.2], [0.0, -0.3], [0.5, 0.0]]), "head.bias": torch.tensor([0.0, 0.1, -0.1])}
    new = train_head(head, protos, labels, lr=1.0, epochs=1, batch_size=8, generator=torch.Generator().manual_seed(0))
    # by hand: d mean-CE / d logits = (softmax - onehot) / n
    err = (torch.softmax(protos @ head["head.weight"].T + head["head.bias"], 1) - F.one_hot(labels, 3)) / 3
    assert torch.allclose(new["head.weight"], head["head.weight"] - err.T @ protos, atol=1e-6)
    assert torch.allclose(new["head.bias"], head["head.bias"] - err.sum(0), atol=1e-6)


def test_fedgh_aggregate_trains_the_global_head_on_the_rounds_prototype_label_pairs(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell, "fedgh", server_batch_size=64, server_lr=0.5)
    updates = [local_update(eng, c) for c in eng.clients[:2]]
    before = dict(eng.method.server["head"])
    eng.method.aggregate(updates)
    protos = torch.cat([u.extras["protos"] for u in updates])
    labels = torch.cat([u.extras["classes"] for u in updates])
    assert len(labels) <= 64  # one full-batch step
    w = before["head.weight"].clone().requires_grad_(True)
    b = before["head.bias"].clone().requires_grad_(True)
    F.cross_entropy(F.linear(protos, w, b), labels).backward()
    assert torch.allclose(eng.method.server["head"]["head.weight"], before["head.weight"] - 0.5 * w.grad, atol=1e-6)
    assert torch.allclose(eng.method.server["head"]["head.bias"], before["head.bias"] - 0.5 * b.grad, atol=1e-6)


def test_fedgh_extractors_stay_private_and_the_global_head_replaces_the_local_one(tiny_partition, make_cell, monkeypatch,
                                                                                  tmp_path):
    eng = make_engine(tiny_partition, make_cell, "fedgh")
    c0, c1 = eng.clients[:2]
    u0 = local_update(eng, c0)
    mine = {k: v.clone() for k, v in c0.state["model"].items()}
    u1 = local_update(eng, c1)
    assert u0.params == {} and u1.params == {}  # only prototypes go up
    eng.method.aggregate([u0, u1])
    assert_checkpointable(eng, tmp_path)
    assert equal(c0.state["model"], mine)  # neither client 1's training nor the server touched it
    assert not equal(part(c1.state["model"], "extractor."), part(mine, "extractor."))
    payload = eng.method.broadcast(c0)
    assert set(payload["head"]) == {"head.weight", "head.bias"}  # only the global head comes down
    # next round, before its own training, the client's model = its own extractor + the global head
    eng.round = 2
    seen = {}
    monkeypatch.setattr(training, "fit", lambda engine, client, **kw: (seen.update(eng.get_params()), FitResult(0.0, 0))[1])
    eng.method.local_update(c0, payload)
    assert equal(part(seen, "extractor."), part(mine, "extractor."))
    assert equal(part(seen, "head."), eng.method.server["head"])
    assert not equal(eng.method.server["head"], part(mine, "head."))
    # personalized model: the client's model after local training; 'global' swaps in the global head
    assert equal(eng.method.personal_params(c0), c0.state["model"])
    eng.method.hp["personal_head"] = "global"
    assert equal(part(eng.method.personal_params(c0), "head."), eng.method.server["head"])
