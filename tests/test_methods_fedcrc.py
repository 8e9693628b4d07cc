"""FedCRC: the three local steps (extractor under a frozen global predictor, persistent local
predictor, KL-guided global predictor), the upload without h_i, the EMA of the global
predictor and the personalized model f_g + h_i.

Each test fails if the mechanism it names is removed or wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedrepro.methods import METHODS, Update

from conftest import method_engine


def make_engine(tiny_partition, make_cell, hparams=None, **training):
    return method_engine(tiny_partition, make_cell, "fedcrc", hparams, **training)


def ready(eng, round=1):
    eng.method.setup()
    eng.round = round
    return eng


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def part(params, prefix):
    return {k: v for k, v in params.items() if k.startswith(prefix)}


def record_steps(eng):
    """Wrap the two training steps to keep (step, model before, model after, result)."""
    steps, method = [], eng.method
    train_extractor, train_head = method.train_extractor, method.train_head

    def extractor(client):
        before = eng.get_params()
        result = train_extractor(client)
        steps.append(("extractor", before, eng.get_params(), result))
        return result

    def head(client, which, start, z, loss):
        before = {**eng.get_params(), **start}  # the model the step trains: start is loaded first
        result = train_head(client, which, start, z, loss)
        steps.append((which, before, eng.get_params(), result))
        return result

    method.train_extractor = extractor
    method.train_head = head
    return steps


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("head_extractor", ["received", "updated"])
def test_each_step_trains_only_its_part(tiny_partition, make_cell, cache, head_extractor):
    eng = ready(make_engine(tiny_partition, make_cell, {"cache_features": cache, "head_extractor": head_extractor}))
    steps = record_steps(eng)
    client = eng.clients[0]
    payload = eng.method.broadcast(client)
    update = eng.method.local_update(client, payload)
    assert [s[0] for s in steps] == ["extractor", "local", "global"]
    (_, b1, a1, _), (_, b2, a2, h_i), (_, b3, a3, h_g) = steps
    f_g, h_g_t = part(a1, "extractor."), part(payload, "head.")
    # the extractor the heads train on: eq. 5's received f_g^t by default, f_g' as the option
    frozen = part(payload, "extractor.") if head_extractor == "received" else f_g

    # step 1: from the received model; the extractor trains under the frozen h_g^t
    assert equal(b1, payload)
    assert not equal(f_g, part(payload, "extractor.")) and equal(part(a1, "head."), h_g_t)
    # step 2: h_i (first participation: a copy of h_g^t) trains on the frozen extractor; it is kept
    assert equal(part(b2, "extractor."), frozen) and equal(part(b2, "head."), h_g_t)
    assert equal(part(a2, "extractor."), frozen) and not equal(h_i, h_g_t)
    assert equal(client.state["head"], h_i) and equal(part(a2, "head."), h_i)
    # step 3: h_g restarts from h_g^t (not from h_i) and trains on the same frozen extractor
    assert equal(part(b3, "head."), h_g_t) and equal(part(b3, "extractor."), frozen)
    assert equal(part(a3, "extractor."), frozen) and not equal(h_g, h_g_t) and not equal(h_g, h_i)
    # upload: f_g' (step 1's extractor, whichever the heads saw) + the step-3 h_g, nothing else
    assert equal(update.params, {**f_g, **h_g}) and update.extras == {} and update.num_samples == client.num_train


def test_heads_see_the_received_extractors_features_by_default(tiny_partition, make_cell):
    """Issue 35: eq. 5 (h_i' = argmin L_i(f_g, h_i)) and §III-B2 ("using the fixed global representation
    extractor"): the inputs of steps 2-3 are f_g^t(x) of the received model, not f_g'(x) of step 1."""
    for reading in ("received", "updated"):
        eng = ready(make_engine(tiny_partition, make_cell, {"head_extractor": "updated"} if reading == "updated" else None))
        assert eng.method.hp["head_extractor"] == reading  # "received" is the default
        client = eng.clients[0]
        payload = eng.method.broadcast(client)
        inputs, fit_head = [], eng.fit_head
        eng.fit_head = lambda z, y, **kw: (inputs.append(z.clone()), fit_head(z, y, **kw))[1]
        eng.method.local_update(client, payload)
        updated = eng.features(client.train.x)  # the model now holds the upload: f_g' + h_gi
        eng.set_params(payload)
        received = eng.features(client.train.x)
        expected = received if reading == "received" else updated
        assert len(inputs) == 2 and all(torch.equal(z, expected) for z in inputs), reading
        assert not torch.allclose(received, updated)


@pytest.mark.parametrize("init", ["global", "init"])
def test_local_predictor_persists_across_rounds_and_starts_as_configured(tiny_partition, make_cell, init):
    eng = ready(make_engine(tiny_partition, make_cell, {"local_head_init": init}))
    initial_head = eng.get_params(("head.",))
    steps = record_steps(eng)
    client = eng.clients[0]
    # make h_g^t differ from the seeded init so the two initialisations are distinguishable
    eng.method.server["global"] = {**eng.method.server["global"],
                                   **{k: v + 0.5 for k, v in initial_head.items()}}
    payload = eng.method.broadcast(client)
    eng.method.local_update(client, payload)
    first = client.state["head"]
    expected_start = part(payload, "head.") if init == "global" else initial_head
    assert equal(part(steps[1][1], "head."), expected_start)

    eng.method.aggregate([Update(client.id, client.num_train, eng.get_params())])
    eng.round = 2
    eng.method.local_update(client, eng.method.broadcast(client))
    assert equal(part(steps[4][1], "head."), first)  # round 2 continues the client's own h_i
    assert not equal(client.state["head"], first)


@pytest.mark.parametrize("T, w", [(1.0, 1.0), (2.0, 0.5)])
def test_step3_loss_is_ce_plus_kl_towards_the_detached_local_predictor(tiny_partition, make_cell, T, w):
    eng = make_engine(tiny_partition, make_cell, {"kl_temperature": T, "kl_weight": w})
    d, C, B = eng.model.feature_dim, eng.num_classes, 7
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(B, d, generator=g), torch.randint(0, C, (B,), generator=g)
    W = torch.randn(C, d, generator=g).requires_grad_(True)
    b = torch.randn(C, generator=g).requires_grad_(True)
    logits = torch.randn(B, C, generator=g).requires_grad_(True)
    loss = eng.method.global_head_loss({"head.weight": W, "head.bias": b})(logits, z, y)
    grad_logits, grad_W = torch.autograd.grad(loss, [logits, W], allow_unused=True)

    t = (z @ W.T + b).detach()
    p_g, p_t = F.softmax(logits.detach() / T, 1), F.softmax(t / T, 1)
    kl = (p_t * (p_t.log() - p_g.log())).sum() / B
    ce = F.cross_entropy(logits.detach(), y)
    assert loss.item() == pytest.approx((ce + w * T * T * kl).item(), rel=1e-5)
    # d/dlogits: (softmax - onehot)/B from CE, w T (p_g - p_t)/B from T^2 KL(p_t || p_g)
    expected = (F.softmax(logits.detach(), 1) - F.one_hot(y, C)) / B + w * T * (p_g - p_t) / B
    assert torch.allclose(grad_logits, expected, atol=1e-6)
    assert grad_W is None  # the local predictor is a fixed teacher


def test_kl_guidance_changes_only_the_global_predictor_and_pulls_it_towards_h_i(tiny_partition, make_cell):
    """A client whose h_i is a fixed random head (E2 = 0 keeps it): with the KL on, the step-3
    global predictor imitates h_i more closely than with the KL off; steps 1-2 are unaffected."""
    results = {}
    for w in (0.0, 1.0):
        eng = ready(make_engine(tiny_partition, make_cell, {"kl_weight": w, "local_head_epochs": 0}))
        client = eng.clients[0]
        g = torch.Generator().manual_seed(2)
        client.state["head"] = {k: 3 * torch.randn(v.shape, generator=g) for k, v in eng.get_params(("head.",)).items()}
        payload = eng.method.broadcast(client)
        update = eng.method.local_update(client, payload)
        eng.set_params(payload)  # the heads train on the received extractor's features (eq. 5)
        results[w] = (update.params, client.state["head"], eng.features(client.train.x))
    (up0, h_i0, z), (up1, h_i1, _) = results[0.0], results[1.0]
    assert equal(part(up0, "extractor."), part(up1, "extractor.")) and equal(h_i0, h_i1)
    assert not equal(part(up0, "head."), part(up1, "head."))

    def kl_to_h_i(head):
        p_t = F.softmax(F.linear(z, h_i0["head.weight"], h_i0["head.bias"]), 1)
        log_p_g = F.log_softmax(F.linear(z, head["head.weight"], head["head.bias"]), 1)
        return F.kl_div(log_p_g, p_t, reduction="batchmean").item()

    assert kl_to_h_i(up1) < 0.9 * kl_to_h_i(up0)


def test_h_i_never_travels(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell, rounds=2)
    init = eng.get_params()
    seen, local_update = [], eng.method.local_update

    def checked(client, payload):
        update = local_update(client, payload)
        seen.append((update, dict(client.state["head"])))
        return update

    eng.method.local_update = checked
    m = eng.run()
    assert seen
    for update, h_i in seen:
        assert update.params.keys() == init.keys() and update.extras == {}
        assert not equal(part(update.params, "head."), h_i)
    model_bytes = sum(v.numel() * v.element_size() for v in init.values())
    assert m["communication"]["bytes_up_per_round"] == [model_bytes * len(eng.schedule[r]) for r in range(2)]


@pytest.mark.parametrize("tau", [None, 0.5])
def test_server_extractor_fedavg_and_predictor_ema(tiny_partition, make_cell, tau):
    eng = ready(make_engine(tiny_partition, make_cell, {} if tau is None else {"tau": tau}))
    tau = 0.99 if tau is None else tau  # the paper's default
    assert eng.method.hp["tau"] == tau
    g = torch.Generator().manual_seed(1)
    rand = lambda: {k: torch.randn(v.shape, generator=g) for k, v in eng.method.server["global"].items()}
    old, a, b = rand(), rand(), rand()
    eng.method.server["global"] = old
    eng.method.aggregate([Update(0, 1, a), Update(1, 3, b)])
    new = eng.method.server["global"]
    for k in old:
        avg = (1 * a[k] + 3 * b[k]) / 4
        expected = tau * old[k] + (1 - tau) * avg if k.startswith("head.") else avg
        assert torch.allclose(new[k], expected, atol=1e-6, rtol=0), k


@pytest.mark.parametrize("norm", ["sampled", "all_clients"])
def test_weight_norm_divides_by_the_sampled_or_all_clients_samples(tiny_partition, make_cell, norm):
    """`weight_norm`: eqs. 3 and 8 weight |D_i| / N; 'sampled' (default) = N over the aggregated
    clients (weights sum to 1), 'all_clients' = N over the whole federation (the rest is dropped)."""
    eng = ready(make_engine(tiny_partition, make_cell, {"weight_norm": norm, "tau": 0.5}))
    assert METHODS.get("fedcrc").hparams["weight_norm"].default == "sampled"
    clients = eng.clients[:2]
    big_n = sum(c.num_train for c in eng.clients)
    n = [c.num_train for c in clients]
    assert len(eng.clients) > 2 and big_n > sum(n)
    g = torch.Generator().manual_seed(2)
    rand = lambda: {k: torch.randn(v.shape, generator=g) for k, v in eng.method.server["global"].items()}
    old, a, b = rand(), rand(), rand()
    eng.method.server["global"] = old
    eng.method.aggregate([Update(clients[0].id, n[0], a), Update(clients[1].id, n[1], b)])
    total = sum(n) if norm == "sampled" else big_n
    for k, v in eng.method.server["global"].items():
        avg = (n[0] * a[k] + n[1] * b[k]) / total
        expected = 0.5 * old[k] + 0.5 * avg if k.startswith("head.") else avg
        assert torch.allclose(v, expected, atol=1e-6, rtol=0), k


def test_personalized_model_is_the_global_extractor_with_the_clients_own_predictor(tiny_partition, make_cell):
    method = METHODS.get("fedcrc")
    assert method.has_global and method.has_personal
    eng = make_engine(tiny_partition, make_cell, rounds=1, participation=2)
    eng.run()
    server = eng.method.server["global"]
    assert equal(eng.method.global_params(), server)
    trained = {cid for r in eng.schedule for cid in r}
    assert trained and len(trained) < len(eng.clients)
    for c in eng.clients:
        personal = eng.method.personal_params(c)
        if c.id in trained:  # current f_g + the client's own h_i
            assert equal(personal, {**part(server, "extractor."), **c.state["head"]})
            assert not equal(part(personal, "head."), part(server, "head."))
        else:  # [RECON] never trained: h_i would start as h_g, so FedCRC-Per = FedCRC
            assert "head" not in c.state and equal(personal, server)
