"""Ditto, pFedMe, Per-FedAvg and APFL: each test fails if the method's distinctive
mechanism is removed or wrong. Engine tests use one full batch (batch_size larger than any
client), so the hand computations see exactly the data the method saw."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedrepro.methods import METHODS, Update
from fedrepro.methods.apfl import next_alpha
from fedrepro.methods.perfedavg import meta_step
from fedrepro.methods.pfedme import PFedMe, pfedme_batch_step

from test_engine import engine_for

FULL_BATCH = 10_000


def engine_with(make_cell, tiny_partition, method, hp=None, **training):
    cell = make_cell("fedavg", **training)
    defaults = {k: p.default for k, p in METHODS.get(method).hparams.items()}
    cell.update(method=method, label=method, hparams={**defaults, **(hp or {})})
    eng = engine_for(cell, tiny_partition[0])
    eng.method.setup()
    eng.round = 1
    return eng


def param_names(eng):
    return [k for k, _ in eng.model.named_parameters()]


def ce_grad(eng, params, x, y):
    """grad of the mean CE of the engine's model at `params` on (x, y), by name."""
    leaves = {k: params[k].clone().requires_grad_(True) for k in param_names(eng)}
    loss = F.cross_entropy(functional_call(eng.model, {**params, **leaves}, (x,)), y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def perturbed(params, names, scale=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if k in names else v.clone() for k, v in params.items()}


def close(a, b, names, atol=1e-6):
    return all(torch.allclose(a[k], b[k], atol=atol) for k in names)


def dist(a, b, names):
    return sum(((a[k] - b[k]) ** 2).sum() for k in names).sqrt().item()


# -- Ditto --------------------------------------------------------------------------------

def test_ditto_personal_step_is_ce_step_plus_lambda_pull(tiny_partition, make_cell):
    lam = 0.5
    eng = engine_with(make_cell, tiny_partition, "ditto", {"lam": lam}, batch_size=FULL_BATCH)
    client, w, names = eng.clients[0], eng.method.server["global"], param_names(eng)
    v0 = perturbed(w, names)
    client.state["v"] = {k: t.clone() for k, t in v0.items()}
    eng.method.train_personal([client], w)  # one personal epoch = one full-batch step
    g = ce_grad(eng, v0, client.train.x, client.train.y)
    expected = {k: v0[k] - eng.lr * (g[k] + lam * (v0[k] - w[k])) for k in names}
    assert close(client.state["v"], expected, names)
    plain = {k: v0[k] - eng.lr * g[k] for k in names}
    assert not close(client.state["v"], plain, names)


def test_ditto_lambda_pulls_the_personal_model_to_the_global_one(tiny_partition, make_cell):
    ends = {}
    for lam in (0.0, 10.0):
        eng = engine_with(make_cell, tiny_partition, "ditto", {"lam": lam, "personal_epochs": 5}, batch_size=FULL_BATCH)
        client, w = eng.clients[0], eng.method.server["global"]
        update = eng.method.local_update(client, eng.method.broadcast(client))
        ends[lam] = dist(client.state["v"], w, param_names(eng))
        # two models, two columns: the upload is the FedAvg model, not v
        assert not close(update.params, client.state["v"], param_names(eng))
        assert eng.method.personal_params(client) is client.state["v"]
    assert 0 < ends[10.0] < 0.5 * ends[0.0]


def test_ditto_first_participation_starts_the_personal_model_from_the_initial_model(tiny_partition, make_cell):
    """PFLlib's clientditto copies the initial model into model_per: a client joining late starts v
    there, not from the current global model (which only anchors the pull)."""
    eng = engine_with(make_cell, tiny_partition, "ditto", {"lam": 0.0}, batch_size=FULL_BATCH)
    client, names = eng.clients[0], param_names(eng)
    w = perturbed(eng.method.server["global"], names, scale=0.5)  # a global model far from the initial one
    eng.method.train_personal([client], w, max_steps=0)  # no step: v is where training starts
    assert close(client.state["v"], eng.initial_params, names, atol=0)
    assert not close(client.state["v"], w, names, atol=1e-3)


# -- pFedMe -------------------------------------------------------------------------------

def tiny_linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def tiny_batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)


def linear_ce(params, batch):
    x, y = batch
    return F.cross_entropy(x @ params["weight"].T + params["bias"], y)


def test_pfedme_inner_steps_then_w_moves_towards_theta():
    model, (x, y) = tiny_linear(), tiny_batch(1)
    K, lam, plr, lr = 3, 2.0, 0.1, 0.05
    theta0 = {k: p.detach().clone() for k, p in model.named_parameters()}
    w0 = {k: t + 0.5 for k, t in theta0.items()}
    w = {k: t.clone() for k, t in w0.items()}
    pfedme_batch_step(model, w, x, y, K=K, lam=lam, personal_lr=plr, lr=lr)
    theta = {k: t.clone().requires_grad_(True) for k, t in theta0.items()}
    for _ in range(K):  # the Moreau-envelope steps by hand
        g = torch.autograd.grad(linear_ce(theta, (x, y)), list(theta.values()))
        theta = {k: (t - plr * (gk + lam * (t - w0[k]))).detach().requires_grad_(True) for (k, t), gk in zip(theta.items(), g)}
    got_theta = dict(model.named_parameters())
    for k in theta:
        assert torch.allclose(got_theta[k], theta[k], atol=1e-6)
        assert torch.allclose(w[k], w0[k] - lr * lam * (w0[k] - theta[k]), atol=1e-6)


@pytest.mark.parametrize("mu", [0.0, 0.1])
def test_pfedme_step_gives_the_formula_bit_for_bit(mu):
    """The in-place step (buffers, no temporaries) performs the formula's operations in its
    order: the same bits, so cells run before the buffers reproduce exactly."""
    model, (x, y) = tiny_linear(), tiny_batch(3)
    by_hand = copy.deepcopy(model)
    K, lam, plr, lr = 3, 2.0, 0.1, 0.05
    theta = dict(by_hand.named_parameters())
    w0 = {k: t.detach() + 0.5 for k, t in theta.items()}
    w = {k: t.clone() for k, t in w0.items()}
    pfedme_batch_step(model, w, x, y, K=K, lam=lam, personal_lr=plr, lr=lr, mu=mu)
    for _ in range(K):  # the formula as written, one temporary per operation
        g = torch.autograd.grad(F.cross_entropy(by_hand(x), y), list(theta.values()))
        with torch.no_grad():
            for (k, t), gk in zip(theta.items(), g):
                t.sub_(plr * (gk + lam * (t - w0[k]) + mu * t))
    got = dict(model.named_parameters())
    for k in theta:
        assert torch.equal(got[k], theta[k])
        assert torch.equal(w[k], w0[k] - lr * lam * (w0[k] - theta[k]))


def test_pfedme_theta_solves_the_moreau_problem():
    model, (x, y) = tiny_linear(), tiny_batch(2)
    lam = 2.0
    w0 = {k: p.detach() + 0.3 for k, p in model.named_parameters()}
    pfedme_batch_step(model, {k: t.clone() for k, t in w0.items()}, x, y, K=100, lam=lam, personal_lr=0.1, lr=0.0)
    theta = dict(model.named_parameters())
    grads = torch.autograd.grad(linear_ce(theta, (x, y)), list(theta.values()))
    stationarity = sum(((g + lam * (theta[k] - w0[k])) ** 2).sum() for k, g in zip(theta, grads))
    assert stationarity.sqrt() < 1e-5


@pytest.mark.parametrize("beta", [1.0, 2.0])
@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_pfedme_server_mixes_with_beta(beta, weighting):
    method = PFedMe(engine=None, hp={"beta": beta, "weighting": weighting})
    method.server["global"] = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    method.aggregate([Update(0, 1, {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(5)}),
                      Update(1, 3, {"w": torch.tensor([5.0, 0.0]), "n": torch.tensor(1)})])
    # the paper's plain mean over the sampled clients, or n_i-weighted: (1*3 + 3*5)/4, (1*4 + 3*0)/4
    avg = torch.tensor([4.0, 2.0]) if weighting == "uniform" else torch.tensor([4.5, 1.0])
    assert torch.allclose(method.server["global"]["w"], (1 - beta) * torch.tensor([1.0, 2.0]) + beta * avg)
    assert int(method.server["global"]["n"]) == 5


def test_pfedme_personal_model_is_theta_not_the_upload(tiny_partition, make_cell):
    eng = engine_with(make_cell, tiny_partition, "pfedme", batch_size=FULL_BATCH)
    client = eng.clients[0]
    update = eng.method.local_update(client, eng.method.broadcast(client))
    personal, names = eng.method.personal_params(client), param_names(eng)
    assert personal is client.state["theta"]
    assert not close(personal, update.params, names) and not close(personal, eng.method.server["global"], names)


# -- Per-FedAvg ---------------------------------------------------------------------------

def grad_of(params, batch):
    leaves = {k: t.clone().requires_grad_(True) for k, t in params.items()}
    return dict(zip(leaves, torch.autograd.grad(linear_ce(leaves, batch), list(leaves.values()))))


def per_fedavg_by_hand(variant, alpha, beta, batches):
    w = {k: p.detach().clone() for k, p in tiny_linear().named_parameters()}
    g1 = grad_of(w, batches[0])
    w_temp = {k: w[k] - alpha * g1[k] for k in w}
    meta = grad_of(w_temp, batches[1])
    if variant == "hf":
        names = list(w)
        _, hv = torch.autograd.functional.hvp(lambda *t: linear_ce(dict(zip(names, t)), batches[2]),
                                              tuple(w[k] for k in names), tuple(meta[k] for k in names))
        meta = {k: meta[k] - alpha * h for k, h in zip(names, hv)}
    return {k: w[k] - beta * meta[k] for k in w}


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_meta_step_matches_the_formula(variant):
    alpha, beta = 0.3, 0.2
    batches = [tiny_batch(s) for s in (1, 2, 3)]
    model = tiny_linear()
    meta_step(model, batches, alpha, beta, hessian_free=variant == "hf")
    expected = per_fedavg_by_hand(variant, alpha, beta, batches)
    for k, p in model.named_parameters():
        assert torch.allclose(p, expected[k], atol=1e-6)


def test_perfedavg_hf_differs_from_fo_by_the_hessian_term():
    batches = [tiny_batch(s) for s in (1, 2, 3)]
    fo, hf = (per_fedavg_by_hand(v, 0.3, 0.2, batches) for v in ("fo", "hf"))
    model = tiny_linear()
    meta_step(model, batches, 0.3, 0.2, hessian_free=True)
    got = dict(model.named_parameters())
    assert all(torch.allclose(got[k], hf[k], atol=1e-6) for k in hf)
    assert not all(torch.allclose(got[k], fo[k], atol=1e-4) for k in fo)


def test_perfedavg_personal_model_is_one_alpha_step_and_leaves_training_alone(tiny_partition, make_cell):
    alpha = 0.2
    eng = engine_with(make_cell, tiny_partition, "perfedavg", {"alpha": alpha}, batch_size=FULL_BATCH)
    client, names = eng.clients[1], param_names(eng)
    w = {k: t.clone() for k, t in eng.method.server["global"].items()}
    personal = eng.method.personal_params(client)
    g = ce_grad(eng, w, client.train.x, client.train.y)
    assert close(personal, {k: w[k] - alpha * g[k] for k in names}, names)
    assert all(torch.equal(eng.method.server["global"][k], w[k]) for k in w)  # the global model is untouched
    assert close(eng.method.personal_params(client), personal, names, atol=0)  # and it is repeatable


def test_perfedavg_local_update_runs_both_variants(tiny_partition, make_cell):
    for variant in ("fo", "hf"):
        eng = engine_with(make_cell, tiny_partition, "perfedavg", {"variant": variant, "beta": 0.05}, batch_size=FULL_BATCH)
        client = eng.clients[0]
        update = eng.method.local_update(client, eng.method.broadcast(client))
        assert update.loss > 0 and not close(update.params, eng.method.server["global"], param_names(eng))


# -- APFL -------------------------------------------------------------------------------------

@pytest.mark.parametrize("adaptive", [True, False])
def test_apfl_step_follows_the_paper(tiny_partition, make_cell, adaptive):
    alpha0, reg = 0.3, 0.02
    eng = engine_with(make_cell, tiny_partition, "apfl", {"adaptive_alpha": adaptive, "alpha_reg": reg}, batch_size=FULL_BATCH)
    client, names = eng.clients[0], param_names(eng)
    w = eng.method.server["global"]
    v = perturbed(w, names, scale=0.3)
    client.state.update(v={k: t.clone() for k, t in v.items()}, alpha=alpha0)
    update = eng.method.local_update(client, eng.method.broadcast(client))  # one full-batch step
    x, y, lr = client.train.x, client.train.y, eng.lr
    mix = {k: alpha0 * v[k] + (1 - alpha0) * w[k] for k in names}
    g_mix, g_w = ce_grad(eng, mix, x, y), ce_grad(eng, w, x, y)
    assert close(update.params, {k: w[k] - lr * g_w[k] for k in names}, names)
    assert close(client.state["v"], {k: v[k] - lr * alpha0 * g_mix[k] for k in names}, names)
    d_alpha = sum((g_mix[k] * (v[k] - w[k])).sum() for k in names).item()  # <grad f(vbar), v - w>
    expected_alpha = min(1.0, max(0.0, alpha0 - lr * (d_alpha + reg * alpha0))) if adaptive else alpha0
    assert client.state["alpha"] == pytest.approx(expected_alpha, abs=1e-6)
    assert (abs(client.state["alpha"] - alpha0) > 1e-4) == adaptive


def test_apfl_alpha_step_is_clipped_to_the_unit_interval():
    step = lambda a, g: float(next_alpha(torch.tensor(a), torch.tensor(g), 0.1, 0.02))
    assert step(0.5, 1.0) == pytest.approx(0.5 - 0.1 * (1.0 + 0.02 * 0.5))
    assert step(0.9, -100.0) == 1.0
    assert step(0.1, 100.0) == 0.0


def test_apfl_personal_model_is_the_mixture_with_the_clients_own_w(tiny_partition, make_cell):
    """vbar = alpha v + (1 - alpha) w with the client's own locally trained w (Algorithm 1, PFLlib
    clientapfl), never with the current global model: alpha was learned against the client's w."""
    eng = engine_with(make_cell, tiny_partition, "apfl", {"alpha": 0.9}, batch_size=FULL_BATCH)
    client, names = eng.clients[2], param_names(eng)
    update = eng.method.local_update(client, eng.method.broadcast(client))
    w_own = client.state["w"]
    assert close(update.params, w_own, names, atol=0)  # the client keeps the w it uploads
    eng.method.aggregate([update, Update(3, 50, perturbed(eng.method.server["global"], names, seed=3))])
    g = eng.method.server["global"]
    assert not close(g, w_own, names, atol=1e-3)  # the server's model has moved away from the client's w
    v, alpha = client.state["v"], client.state["alpha"]
    assert 0.0 <= alpha <= 1.0 and alpha != 0.9  # learned, within [0, 1]
    personal = eng.method.personal_params(client)
    assert close(personal, {k: alpha * v[k] + (1 - alpha) * w_own[k] for k in names}, names)
    assert not close(personal, {k: alpha * v[k] + (1 - alpha) * g[k] for k in names}, names, atol=1e-4)


def test_perfedavg_default_steps_are_the_learning_rate_and_the_global_model_learns(tiny_partition, make_cell):
    """Defaults alpha = beta = the round's learning rate (PFLlib): the global model rises well above
    chance on the small task, where a fixed beta = 1e-3 (the old default) leaves it near chance."""
    from fedrepro.engine.engine import summaries

    def global_acc(hp):
        eng = engine_with(make_cell, tiny_partition, "perfedavg", hp, rounds=4, optimizer={"name": "sgd", "lr": 0.1})
        assert eng.method.step("beta") == (hp.get("beta") or eng.lr)
        metrics = eng.run()
        return metrics["summary"]["global_acc"]["weighted_mean"]

    learned, fixed = global_acc({}), global_acc({"alpha": 0.01, "beta": 0.001})
    assert learned > 0.5  # 10 classes: chance is 0.1
    assert fixed < 0.3 and learned > fixed + 0.3
