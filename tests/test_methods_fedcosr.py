"""FedCoSR: shared representation layers + class-count-weighted label centroids, loss-wise
local aggregation tau = exp(-gamma L_Reg), CE + alpha * InfoNCE against the global centroids.

Each test fails if the mechanism it names is removed or wrong; expected values are computed by
hand or by a second, independent route."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedrepro.engine import training
from fedrepro.engine.engine import Batch
from fedrepro.methods import Update, payload_bytes
from fedrepro.methods import fedcosr
from fedrepro.methods.fedcosr import info_nce

from conftest import method_engine


def make_engine(tiny_partition, make_cell, training=None, **hparams):
    eng = method_engine(tiny_partition, make_cell, "fedcosr", hparams, **(training or {}))
    eng.method.setup()
    eng.round = 1
    return eng


def local_update(eng, client):
    eng.streams.start_client()  # as the engine's loop does before every client
    return eng.method.local_update(client, eng.method.broadcast(client))


def spy_fit(eng, monkeypatch):
    """Record the parameters local training starts from and the options it gets."""
    fit, calls = training.fit, []  # where every fit runs (engine.fit and fit_many's client loop)
    monkeypatch.setattr(training, "fit", lambda engine, client, **kw: (calls.append({"start": eng.get_params(), **kw}), fit(engine, client, **kw))[1])
    return calls


def part(params, prefix):
    return {k: v for k, v in params.items() if k.startswith(prefix)}


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def set_centroids(eng, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    present = torch.zeros(eng.num_classes, dtype=torch.bool)
    present[classes] = True
    eng.method.server.update(protos=torch.randn(eng.num_classes, eng.model.feature_dim, generator=g), present=present)


def test_info_nce_by_hand():
    centroids = torch.tensor([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    present = torch.tensor([True, True, False])  # class 2 has no global centroid: neither positive nor negative
    z = torch.tensor([[3.0, 0.0], [1.0, 1.0], [2.0, -1.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])  # the class-2 sample has no positive: skipped
    loss, n = info_nce(z, y, centroids, present, tau_cl=0.5)
    # sample 0: cos = (1, 0) -> -log(e^2 / (e^2 + e^0)); sample 1: cos = (1/sqrt2, 1/sqrt2) -> log 2
    expected = (math.log(1 + math.exp(-2)) + math.log(2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6) and int(n) == 2
    loss.backward()
    assert torch.isfinite(z.grad).all() and torch.equal(z.grad[2], torch.zeros(2))
    none, n = info_nce(z, torch.tensor([2, 2, 2]), centroids, present, 0.5)  # no sample has a positive
    assert float(none.detach()) == 0.0 and int(n) == 0


def test_info_nce_with_batch_negatives_by_hand():
    """`negatives: with_batch`: the batch's samples of another class join the other classes' centroids
    in the denominator (a class without a centroid too); same-class samples and the sample itself do not."""
    centroids = torch.tensor([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    present = torch.tensor([True, True, False])
    z = torch.tensor([[3.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]], requires_grad=True)
    y = torch.tensor([0, 1, 0, 2])  # sample 3: no positive, but a negative of the others
    e = math.exp
    default, n = info_nce(z, y, centroids, present, tau_cl=0.5)
    assert default.item() == pytest.approx(math.log(1 + e(-2)), rel=1e-6) and int(n) == 3
    loss, n = info_nce(z, y, centroids, present, tau_cl=0.5, batch_negatives=True)
    r = 2 * math.sqrt(0.5)  # cos 1/sqrt2 over tau_CL = 0.5
    # sample 0: centroid 1 (cos 0), sample 1 (cos 0), sample 3 (cos 1/sqrt2); sample 2 (its class) left out
    s0 = math.log((e(2) + 1 + 1 + e(r)) / e(2))
    s1 = math.log((e(2) + 1 + 1 + 1 + e(r)) / e(2))  # centroid 0, samples 0 and 2 (cos 0), sample 3
    expected = (2 * s0 + s1) / 3  # sample 2 as sample 0
    assert loss.item() == pytest.approx(expected, rel=1e-6) and int(n) == 3
    loss.backward()
    assert z.grad[3].abs().sum() > 0  # the in-batch negative gets a gradient (it has no positive itself)
    one_class = torch.tensor([0, 0, 0, 0])  # no other-class sample: the same as the default
    assert info_nce(z, one_class, centroids, present, 0.5, True)[0].item() == pytest.approx(
        info_nce(z, one_class, centroids, present, 0.5)[0].item(), rel=1e-6)


@pytest.mark.parametrize("negatives", ["centroids", "with_batch"])
def test_local_training_contrasts_with_the_configured_negatives(tiny_partition, make_cell, monkeypatch, negatives):
    eng = make_engine(tiny_partition, make_cell, alpha=0.7, negatives=negatives)
    assert fedcosr.FedCoSR.hparams["negatives"].default == "centroids"
    set_centroids(eng, [0, 1, 2, 4, 7])
    client = eng.clients[1]
    calls = spy_fit(eng, monkeypatch)
    local_update(eng, client)  # first participation: CE only
    local_update(eng, client)
    g = torch.Generator().manual_seed(5)
    z, logits = torch.randn(5, eng.model.feature_dim, generator=g), torch.randn(5, eng.num_classes, generator=g)
    y = torch.tensor([0, 4, 3, 0, 2])
    server = eng.method.server
    with_batch, _ = info_nce(z, y, server["protos"], server["present"], 0.5, batch_negatives=True)
    centroids_only, _ = info_nce(z, y, server["protos"], server["present"], 0.5)
    assert with_batch > centroids_only  # more terms in the denominator
    nce = with_batch if negatives == "with_batch" else centroids_only
    assert torch.allclose(calls[1]["loss_fn"](Batch(None, y, z, logits)), F.cross_entropy(logits, y) + 0.7 * nce)


def test_server_averages_extractors_by_samples_and_centroids_by_class_counts(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    d, init = eng.model.feature_dim, eng.get_params()
    ext = part(init, "extractor.")
    p = lambda *rows: torch.tensor([list(r) + [0.0] * (d - len(r)) for r in rows])
    a = Update(0, 10, {k: torch.zeros_like(v) for k, v in ext.items()},
               extras={"classes": torch.tensor([0, 3]), "protos": p((1.0, 0.0), (0.0, 2.0)), "counts": torch.tensor([9.0, 1.0])})
    b = Update(1, 30, {k: torch.ones_like(v) for k, v in ext.items()},
               extras={"classes": torch.tensor([3]), "protos": p((0.0, 6.0)), "counts": torch.tensor([3.0])})
    eng.method.aggregate([a, b])
    server = eng.method.server
    assert server["present"].nonzero().flatten().tolist() == [0, 3]
    assert torch.allclose(server["protos"][0], p((1.0, 0.0))[0])  # only client a has class 0
    assert torch.allclose(server["protos"][3], p((0.0, 5.0))[0])  # (1*2 + 3*6) / 4, not (2 + 6) / 2 nor by |D^i|
    assert all(torch.allclose(server["global"][k], torch.full_like(v, 0.75)) for k, v in ext.items())  # 30 / 40
    assert equal(part(server["global"], "head."), part(init, "head."))  # no head reaches the server
    msg = eng.method.broadcast(eng.clients[0])
    assert msg["model"].keys() == ext.keys() and msg["centroids"]["classes"].tolist() == [0, 3]


def test_upload_is_the_extractor_and_per_class_centroids_with_counts_never_the_head(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    init, client = eng.get_params(), eng.clients[0]
    update = local_update(eng, client)
    assert update.params.keys() == part(init, "extractor.").keys()  # pi never leaves the client
    assert not equal(part(client.state["model"], "head."), part(init, "head."))  # ... but it was trained and kept
    # by hand: eval-mode representations of the trained model, averaged per class with a loop
    eng.set_params(client.state["model"])
    feats, y = eng.features(client.train.x), client.train.y
    classes = sorted(set(y.tolist()))
    assert update.extras["classes"].tolist() == classes
    for c, proto, n in zip(classes, update.extras["protos"], update.extras["counts"]):
        rows = [feats[i] for i in range(len(y)) if int(y[i]) == c]
        assert int(n) == len(rows) and torch.allclose(proto, sum(rows) / len(rows), atol=1e-6)
    assert payload_bytes(update.extras) == len(classes) * (8 + 4 * eng.model.feature_dim + 4)


@pytest.mark.parametrize("local_aggregation", [True, False])
def test_local_aggregation_mixes_by_tau_exp_minus_gamma_reg_loss(tiny_partition, make_cell, monkeypatch, local_aggregation):
    eng = make_engine(tiny_partition, make_cell, gamma=2.0, local_aggregation=local_aggregation)
    client = eng.clients[0]
    local_update(eng, client)
    own = client.state["model"]
    glob = {k: v * 0.5 + 1.0 for k, v in part(own, "extractor.").items()}
    eng.method.server["global"].update(glob)
    client.state["reg_loss"] = 0.7
    tau = math.exp(-2.0 * 0.7) if local_aggregation else 0.0
    expected = {**own, **{k: tau * own[k] + (1 - tau) * glob[k] for k in glob}}
    assert equal(eng.method.personal_params(client), expected)  # evaluated model = theta_hat
    calls = spy_fit(eng, monkeypatch)
    local_update(eng, client)
    assert equal(calls[0]["start"], expected)
    if not local_aggregation:  # w/o LA: the global representation layers, own head
        assert equal(part(calls[0]["start"], "extractor."), glob)


def test_first_participation_takes_the_global_extractor_and_trains_on_ce_only(tiny_partition, make_cell, monkeypatch):
    eng = make_engine(tiny_partition, make_cell, alpha=0.7)
    set_centroids(eng, [0, 1, 2, 4, 7])
    glob = {k: v + 0.01 for k, v in eng.method.server["global"].items()}
    eng.method.server["global"] = glob
    client = eng.clients[1]
    calls = spy_fit(eng, monkeypatch)
    local_update(eng, client)  # first participation
    local_update(eng, client)  # second: alpha = 0.7
    assert equal(calls[0]["start"], glob)  # global extractor + the initial head (server copy)
    g = torch.Generator().manual_seed(3)
    z, logits = torch.randn(5, eng.model.feature_dim, generator=g), torch.randn(5, eng.num_classes, generator=g)
    y = torch.tensor([0, 4, 3, 7, 2])
    batch = Batch(None, y, z, logits)
    ce = F.cross_entropy(logits, y)
    server = eng.method.server
    nce, _ = info_nce(z, y, server["protos"], server["present"], 0.5)
    assert torch.equal(calls[0]["loss_fn"](batch), ce)
    assert torch.allclose(calls[1]["loss_fn"](batch), ce + 0.7 * nce)
    assert nce > 0 and client.state["reg_loss"] > 0


def test_contrastive_off_trains_on_ce_but_still_measures_the_reg_loss(tiny_partition, make_cell, monkeypatch):
    eng = make_engine(tiny_partition, make_cell, contrastive=False)
    client = eng.clients[0]
    local_update(eng, client)
    assert client.state["reg_loss"] is None  # no global centroid existed: nothing to contrast with
    set_centroids(eng, list(range(eng.num_classes)))
    calls = spy_fit(eng, monkeypatch)
    local_update(eng, client)
    g = torch.Generator().manual_seed(4)
    z, logits, y = torch.randn(4, eng.model.feature_dim, generator=g), torch.randn(4, eng.num_classes, generator=g), torch.tensor([1, 0, 5, 5])
    assert torch.equal(calls[0]["loss_fn"](Batch(None, y, z, logits)), F.cross_entropy(logits, y))
    assert client.state["reg_loss"] > 0  # the loss-wise aggregation still has its L_Reg (w/o CRL keeps LA)


@pytest.mark.parametrize("over", ["last_epoch", "all_epochs"])
def test_reg_loss_is_the_mean_infonce_of_the_local_training(tiny_partition, make_cell, monkeypatch, over):
    eng = make_engine(tiny_partition, make_cell, training={"local_epochs": 2}, reg_loss_over=over)
    client = eng.clients[2]
    local_update(eng, client)
    set_centroids(eng, [0, 1, 3, 5, 6, 8, 9])
    seen, real = [], fedcosr.info_nce
    monkeypatch.setattr(fedcosr, "info_nce", lambda *a: (lambda v: (seen.append(v), v)[1])(real(*a)))
    local_update(eng, client)
    steps = len(seen) // 2 if over == "last_epoch" else 0
    values = [float(v.detach()) for v, n in seen[steps:] if n > 0]
    assert len(seen) % 2 == 0 and client.state["reg_loss"] == pytest.approx(sum(values) / len(values), rel=1e-5)
    tau = eng.method.tau(client)
    assert 0 < tau < 1 and tau == pytest.approx(math.exp(-client.state["reg_loss"]))


def test_split_off_shares_and_mixes_the_whole_model(tiny_partition, make_cell, monkeypatch, tmp_path):
    eng = make_engine(tiny_partition, make_cell, split=False)
    init, client = eng.get_params(), eng.clients[0]
    update = local_update(eng, client)
    assert update.params.keys() == init.keys()  # w/o Sep: the head travels too
    eng.method.aggregate([update])
    assert equal(part(eng.method.server["global"], "head."), part(update.params, "head."))
    glob = {k: v - 0.02 for k, v in eng.method.server["global"].items()}
    eng.method.server["global"] = glob
    client.state["reg_loss"] = 1.0
    calls = spy_fit(eng, monkeypatch)
    local_update(eng, client)
    tau, own = math.exp(-1.0), update.params
    assert equal(calls[0]["start"], {k: tau * own[k] + (1 - tau) * glob[k] for k in glob})
    # server and client states survive the engine's checkpoint format
    torch.save({"server": eng.method.server, "clients": {c.id: c.state for c in eng.clients}}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["clients"][client.id]["reg_loss"] == client.state["reg_loss"]


def test_personal_model_trained_and_literal_clipping(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell, personal_model="trained", clip_params=True)
    client = eng.clients[0]
    local_update(eng, client)
    client.state["reg_loss"] = 0.3
    eng.method.server["global"] = {k: v + 5.0 for k, v in eng.method.server["global"].items()}
    assert equal(eng.method.personal_params(client), client.state["model"])  # no mixing with phi^G
    assert all(((v >= 0) & (v <= 1)).all() for v in client.state["model"].values() if v.is_floating_point())


def test_train_mode_centroids_average_the_representations_seen_in_training(tiny_partition, make_cell):
    # lr ~ 0: the representations seen in training equal the eval-mode ones (MLP: no dropout, no BatchNorm)
    eng = make_engine(tiny_partition, make_cell, training={"local_epochs": 2, "optimizer": {"name": "sgd", "lr": 1e-12}},
                      centroids="train")
    client = eng.clients[0]
    update = local_update(eng, client)
    eng.set_params(client.state["model"])
    feats, y = eng.features(client.train.x), client.train.y
    classes = update.extras["classes"].tolist()
    assert classes == sorted(set(y.tolist()))
    assert update.extras["counts"].tolist() == [2.0 * int((y == c).sum()) for c in classes]  # every sample, each epoch
    assert torch.allclose(update.extras["protos"], torch.stack([feats[y == c].mean(0) for c in classes]), atol=1e-5)
