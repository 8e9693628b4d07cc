"""Personalized aggregation: FedAMP's attentive cloud models and FedALA's adaptive local
aggregation. Each test fails when the method's distinctive mechanism is removed or wrong."""

from __future__ import annotations

import math

import pytest
import torch

from fedrepro.engine import training
from fedrepro.methods import METHODS
from fedrepro.methods import fedala as fedala_mod
from fedrepro.methods.fedala import mix, weight_step
from fedrepro.methods.fedamp import cloud_weights, combine

from test_engine import engine_for


def method_engine(tiny_partition, make_cell, label, **hparams):
    """An engine on the tiny cell running `label` with its defaults overridden by `hparams`; setup() done."""
    cell = make_cell("fedavg")
    defaults = {k: p.default for k, p in METHODS.get(label).hparams.items()}
    cell.update(method=label, label=label, hparams={**defaults, **hparams})
    engine = engine_for(cell, tiny_partition[0])
    engine.method.setup()
    return engine


def distance(a, b):
    return math.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in a if a[k].is_floating_point()))


# -- FedAMP -----------------------------------------------------------------------------

def test_fedamp_cloud_weights_hand_computed():
    # Three clients; "w" is the only parameter, "stat" a float buffer, "count" an integer buffer.
    def model(w, stat, count):
        return {"w": torch.tensor(w), "stat": torch.tensor([stat]), "count": torch.tensor(count)}

    models = {0: model([0.0, 0.0], 100.0, 1), 1: model([1.0, 0.0], 0.0, 5), 2: model([0.0, 2.0], 0.0, 7)}
    xi = cloud_weights(0, models, ["w"], alpha_k=0.5, sigma=2.0)
    # ||w0 - w1||^2 = 1, ||w0 - w2||^2 = 4 (buffers do not count); e(x) = exp(-x / sigma) / sigma
    x1, x2 = 0.5 * math.exp(-1 / 2) / 2, 0.5 * math.exp(-4 / 2) / 2
    assert xi[1] == pytest.approx(x1) and xi[2] == pytest.approx(x2)
    assert xi[0] == pytest.approx(1 - x1 - x2)
    assert sum(xi.values()) == pytest.approx(1.0)
    assert xi[1] > xi[2]  # the closer client gets more weight
    u = combine(models, xi, 0)
    assert torch.allclose(u["w"], torch.tensor([x1, 2 * x2]))
    assert torch.allclose(u["stat"], torch.tensor([100.0 * (1 - x1 - x2)]))
    assert u["count"].item() == 1  # integer buffers stay the client's own
    # The weights are not normalised over the others: far clients barely count, the self-weight keeps the rest.
    far = cloud_weights(0, {**models, 2: model([0.0, 30.0], 0.0, 0)}, ["w"], alpha_k=0.5, sigma=2.0)
    assert far[2] < 1e-100 and far[0] == pytest.approx(1 - x1)
    assert cloud_weights(0, {0: models[0]}, ["w"], 1.0, 1.0) == {0: 1.0}


def test_fedamp_broadcast_mixes_the_stored_models(tiny_partition, make_cell):
    engine = method_engine(tiny_partition, make_cell, "fedamp", alphaK=0.5, sigma=1.0)
    amp, init = engine.method, engine.method.server["init"]
    c0 = engine.clients[0]
    assert torch.equal(amp.broadcast(c0)["head.bias"], init["head.bias"])  # round 1: nobody uploaded, u_i = w^0
    w1 = {k: v + 0.01 for k, v in init.items()}
    w2 = {k: v - 0.02 for k, v in init.items()}
    amp.server["models"] = {1: w1, 2: w2}
    n = sum(v.numel() for v in init.values())  # the MLP has parameters only
    x1, x2 = 0.5 * math.exp(-n * 0.01**2), 0.5 * math.exp(-n * 0.02**2)
    u0 = amp.broadcast(c0)  # client 0 has not trained: its w_0 is the initialisation
    expected = {k: x1 * w1[k] + x2 * w2[k] + (1 - x1 - x2) * init[k] for k in init}
    assert all(torch.allclose(u0[k], expected[k], atol=1e-6) for k in init)
    assert not torch.allclose(u0["head.bias"], init["head.bias"])


def test_fedamp_proximal_term_pulls_towards_the_cloud_model(tiny_partition, make_cell, monkeypatch):
    results = {}
    for lamda in (0.0, 10.0):
        engine = method_engine(tiny_partition, make_cell, "fedamp", lamda=lamda, alphaK=1.0)
        client = engine.clients[0]
        u = {k: v + 0.05 for k, v in engine.method.server["init"].items()}
        results[lamda] = distance(engine.method.local_update(client, u).params, u)
    assert results[10.0] < 0.5 * results[0.0]

    # The hook the client trains with adds (lambda / alpha_K) * (w - u_i) to every gradient.
    engine = method_engine(tiny_partition, make_cell, "fedamp", lamda=3.0, alphaK=2.0)
    hooks = []
    monkeypatch.setattr(training, "fit", lambda engine, client, **kw: hooks.append(kw.get("before_step")) or type("R", (), {"loss": 0.0})())
    u = {k: torch.zeros_like(v) for k, v in engine.method.server["init"].items()}
    engine.method.local_update(engine.clients[0], u)
    model = engine.model
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    hooks[0](model)
    assert all(torch.allclose(p.grad, 1.5 * p.detach()) for p in model.parameters())
    # and the local training started from u_i
    assert all(torch.equal(p, torch.zeros_like(p)) for p in model.parameters())


def test_fedamp_code_compat_trains_the_own_model_without_pull(tiny_partition, make_cell):
    outs = []
    for shift in (0.05, -0.3):
        engine = method_engine(tiny_partition, make_cell, "fedamp", code_compat=True)
        u = {k: v + shift for k, v in engine.method.server["init"].items()}
        outs.append(engine.method.local_update(engine.clients[0], u).params)
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])  # the cloud model plays no part in training


# -- FedALA -----------------------------------------------------------------------------

def test_fedala_mix_takes_global_lower_layers_and_interpolates_the_top():
    g = {"low": torch.tensor([1.0, 2.0]), "top": torch.tensor([4.0, 8.0])}
    loc = {"low": torch.tensor([-1.0, -2.0]), "top": torch.tensor([0.0, 0.0])}
    assert torch.equal(mix(g, loc, {"top": torch.ones(2)})["top"], g["top"])  # W = 1: the global model
    assert torch.equal(mix(g, loc, {"top": torch.zeros(2)})["top"], loc["top"])  # W = 0: the local model
    half = mix(g, loc, {"top": torch.tensor([0.25, 0.5])})
    assert torch.equal(half["top"], torch.tensor([1.0, 4.0]))
    for w in (torch.ones(2), torch.zeros(2), torch.tensor([0.25, 0.5])):
        assert torch.equal(mix(g, loc, {"top": w})["low"], g["low"])  # lower layers always take the global model


def test_fedala_weight_step_hand_checked():
    # A linear model without bias, 1 input, 2 classes, one sample of class 0.
    forward = lambda p, x: x @ p["w"].T
    g = {"w": torch.tensor([[0.0], [0.0]])}
    loc = {"w": torch.tensor([[1.0], [-1.0]])}
    g0, loc0 = {k: v.clone() for k, v in g.items()}, {k: v.clone() for k, v in loc.items()}
    W = {"w": torch.ones(2, 1)}
    x, y = torch.tensor([[1.0]]), torch.tensor([0])
    # W = 1: theta_hat = global, logits (0, 0), dL/dlogits = (-1/2, 1/2), dL/dtheta = (-1/2, 1/2) x,
    # dL/dW = dL/dtheta * (g - l) = (-1/2 * -1, 1/2 * 1) = (1/2, 1/2); W <- 1 - 0.2 * 1/2 = 0.9.
    loss = weight_step(forward, g, loc, W, x, y, eta=0.2)
    assert float(loss) == pytest.approx(math.log(2))
    assert torch.allclose(W["w"], torch.full((2, 1), 0.9))
    # W = 0.9: theta_hat = (0.1, -0.1), p0 = sigmoid(0.2), dL/dW = (1 - p0, 1 - p0); W <- 0.9 - 0.2 (1 - p0).
    p0 = 1 / (1 + math.exp(-0.2))
    weight_step(forward, g, loc, W, x, y, eta=0.2)
    assert torch.allclose(W["w"], torch.full((2, 1), 0.9 - 0.2 * (1 - p0)))
    # the temporary model's parameters (global and local) are never updated
    assert torch.equal(g["w"], g0["w"]) and torch.equal(loc["w"], loc0["w"])


def test_fedala_weights_stay_in_unit_interval_with_a_huge_eta():
    torch.manual_seed(0)
    forward = lambda p, x: x @ p["w"].T + p["b"]
    g = {"w": torch.randn(5, 3), "b": torch.randn(5)}
    loc = {"w": torch.randn(5, 3), "b": torch.randn(5)}
    W = {"w": torch.full((5, 3), 0.5), "b": torch.full((5,), 0.5)}
    x, y = torch.randn(8, 3), torch.randint(0, 5, (8,))
    for _ in range(3):
        weight_step(forward, g, loc, W, x, y, eta=1e6)
        for w in W.values():
            assert w.min() >= 0 and w.max() <= 1
    flat = torch.cat([w.flatten() for w in W.values()])
    assert (flat == 0).any() and (flat == 1).any()  # the clip was needed on both sides


def _ala_engine(tiny_partition, make_cell, **hp):
    engine = method_engine(tiny_partition, make_cell, "fedala", **{"rand_percent": 25, "max_start_epochs": 3, **hp})
    ala, client = engine.method, engine.clients[0]
    # a "global" model that differs from the client's (initial) local model
    global_p = {k: v + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in ala.server["global"].items()}
    return engine, ala, client, global_p


def test_fedala_start_phase_then_one_epoch_per_round(tiny_partition, make_cell, monkeypatch):
    engine, ala, client, global_p = _ala_engine(tiny_partition, make_cell, num_pre_loss=2, threshold=1e-12, max_start_epochs=4)
    steps = []
    real = fedala_mod.weight_step
    monkeypatch.setattr(fedala_mod, "weight_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    nb = len(ala.weight_batches(client))
    local = ala.server["init"]
    # global == local (round 1): ALA is off and the start phase is kept for later
    assert ala.adaptive_local_aggregation(client, local, local) == local and not steps
    assert "ala_weights" not in client.state
    out = ala.adaptive_local_aggregation(client, global_p, local)
    assert len(steps) == 4 * nb  # start phase: not converged (tiny threshold) -> the epoch cap
    top = ala.mixed_names()
    assert top == ["head.weight", "head.bias"]
    for k in global_p:
        if k not in top:
            assert torch.equal(out[k], global_p[k])  # lower layers take the global model
    W = client.state["ala_weights"]
    assert all(torch.allclose(out[k], local[k] + (global_p[k] - local[k]) * W[k]) for k in top)
    assert not all(torch.equal(W[k], torch.ones_like(W[k])) for k in top)  # the weights were learned
    steps.clear()
    ala.adaptive_local_aggregation(client, global_p, local)
    assert len(steps) == nb  # afterwards: one epoch per round

    # a loose threshold stops the start phase as soon as more than num_pre_loss losses are recorded
    engine, ala, client, global_p = _ala_engine(tiny_partition, make_cell, num_pre_loss=2, threshold=1e9, max_start_epochs=50)
    steps.clear()
    ala.adaptive_local_aggregation(client, global_p, ala.server["init"])
    assert len(steps) == 3 * nb


def test_fedala_cached_head_features_match_the_full_forward(tiny_partition, make_cell):
    engine, ala, client, global_p = _ala_engine(tiny_partition, make_cell)
    local = ala.server["init"]
    top = ala.mixed_names()
    raw = ala.weight_batches(client)
    forward, batches = ala.weight_forward(top, global_p, raw)
    assert forward is not engine.forward_with  # the cached path is the one under test
    W_fast = {k: torch.ones_like(global_p[k]) for k in top}
    W_full = {k: torch.ones_like(global_p[k]) for k in top}
    for (z, y), (x, _) in zip(batches, raw):
        weight_step(forward, global_p, local, W_fast, z, y, eta=1.0)
        weight_step(engine.forward_with, global_p, local, W_full, x, y, eta=1.0)
    assert all(torch.allclose(W_fast[k], W_full[k], atol=1e-6) for k in top)
    assert not all(torch.equal(W_fast[k], torch.ones_like(W_fast[k])) for k in top)


def test_fedala_local_update_keeps_the_personal_model(tiny_partition, make_cell):
    engine, ala, client, global_p = _ala_engine(tiny_partition, make_cell)
    update = ala.local_update(client, global_p)
    assert set(update.params) == set(global_p)  # the full model is uploaded
    assert all(torch.equal(update.params[k], client.state["model"][k]) for k in global_p)
    assert "ala_weights" in client.state
    ala.aggregate([update])
    assert all(torch.equal(ala.global_params()[k], update.params[k]) for k in global_p)


def test_fedala_personal_model_is_the_ala_mix_with_the_current_global_model(tiny_partition, make_cell):
    """The evaluated model is what the client would hold on receiving the current global model:
    ALA's mix of that global model with its local model (FedALA's code evaluates after ALA), not
    its model from the last participation; learning W for it leaves the client's W unchanged."""
    engine, ala, client, global_p = _ala_engine(tiny_partition, make_cell)
    ala.local_update(client, global_p)
    local, W_before = client.state["model"], {k: w.clone() for k, w in client.state["ala_weights"].items()}
    # the server's model moves on after the client trained
    ala.server["global"] = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2))
                            for k, v in global_p.items()}
    personal = ala.personal_params(client)
    top = ala.mixed_names()
    for k in global_p:
        if k not in top:
            assert torch.equal(personal[k], ala.server["global"][k])  # lower layers: the current global model
    assert not all(torch.equal(personal[k], local[k]) for k in top)  # not the stale local model
    assert all(torch.equal(client.state["ala_weights"][k], W_before[k]) for k in top)  # W untouched
    assert ala.personal_params(client).keys() == personal.keys()
    assert all(torch.equal(ala.personal_params(client)[k], personal[k]) for k in personal)  # deterministic


def test_fedamp_default_weights_visibly_mix_clients(tiny_partition, make_cell):
    """With the defaults, FedAMP is not Local under another name: after two rounds the attention
    puts a visible share of each cloud model on the other clients, closer clients get more, and
    the pull towards the cloud model is not negligible. PFLlib's run-script values (alphaK 5e-3,
    sigma 0.1, lamda 5e-7) give the others almost nothing and a pull of 1e-4."""
    engine = method_engine(tiny_partition, make_cell, "fedamp", rounds=2)
    engine.run()
    amp = engine.method
    models, names = amp.server["models"], [k for k, _ in engine.model.named_parameters()]
    assert len(models) == len(engine.clients)
    xi = cloud_weights(0, models, names, amp.hp["alphaK"], amp.hp["sigma"])
    others = {j: w for j, w in xi.items() if j != 0}
    assert sum(others.values()) > 0.02 and xi[0] > 0  # visibly mixed (at most 3 x 0.05 here), still convex
    dist = {j: sum(((models[0][k] - models[j][k]) ** 2).sum() for k in names) for j in others}
    nearest, farthest = min(dist, key=dist.get), max(dist, key=dist.get)
    assert others[nearest] > others[farthest]  # attention: the closer client gets more weight
    assert amp.hp["lamda"] / amp.hp["alphaK"] >= 0.5
    old = cloud_weights(0, models, names, 5e-3, 0.1)
    assert sum(w for j, w in old.items() if j != 0) < 1e-3
