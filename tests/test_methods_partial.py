"""Partial sharing of a decoupled model: FedPer, FedRep, LG-FedAvg (one part shared, the
rest kept per client) and FedBABU (head frozen at its random init, whole-model fine-tuning).

Each test fails if the method's distinctive mechanism is removed or wrong."""

from __future__ import annotations

import pytest
import torch

from fedrepro.engine import training

from conftest import method_engine

FAST = {"fedrep": {"head_epochs": 2}, "fedbabu": {"finetune_epochs": 2}}  # keep the tests small


def make_engine(tiny_partition, make_cell, name, hparams=None, **training):
    return method_engine(tiny_partition, make_cell, name, {**FAST.get(name, {}), **(hparams or {})}, **training)


def record_updates(eng):
    """Wrap the method's aggregate to keep every round's uploads."""
    seen, aggregate = [], eng.method.aggregate
    eng.method.aggregate = lambda updates: (seen.extend(updates), aggregate(updates))[1]
    return seen


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def part(params, prefix):
    return {k: v for k, v in params.items() if k.startswith(prefix)}


def nbytes(params):
    return sum(v.numel() * v.element_size() for v in params.values())


@pytest.mark.parametrize("name, shared, own", [
    ("fedper", "extractor.", "head."),
    ("fedrep", "extractor.", "head."),
    ("lg_fedavg", "head.", "extractor."),
])
def test_only_the_shared_part_travels_and_each_client_keeps_its_own(tiny_partition, make_cell, monkeypatch, name, shared, own):
    eng = make_engine(tiny_partition, make_cell, name, rounds=2)
    init = eng.get_params()
    updates = record_updates(eng)
    m = eng.run()
    clients = eng.clients

    # uploads: exactly the shared part, in keys and in bytes
    assert updates and all(u.params.keys() == part(init, shared).keys() for u in updates)
    per_round = [sum(nbytes(part(init, shared)) for _ in eng.schedule[r]) for r in range(2)]
    assert m["communication"]["bytes_up_per_round"] == per_round

    # the server never stores an own-part update; its shared part moved
    server = eng.method.server["global"]
    assert equal(part(server, own), part(init, own))
    assert not equal(part(server, shared), part(init, shared))

    # each client's own part is its own: trained, and different from another client's
    owns = [c.state["local"] for c in clients]
    assert all(o.keys() == part(init, own).keys() for o in owns)
    assert not equal(owns[0], part(init, own)) and not equal(owns[0], owns[1])

    # personalized model = the server's shared part + the client's own part
    for c in clients:
        assert equal(eng.method.personal_params(c), {**part(server, shared), **c.state["local"]})

    # "(global)" = sample-weighted average of the personalized models, own parts included
    glob = eng.method.global_params()
    n = torch.tensor([float(c.num_train) for c in clients])
    for k, v in part(init, own).items():
        expected = sum(w * c.state["local"][k] for w, c in zip(n / n.sum(), clients))
        assert torch.allclose(glob[k], expected, atol=1e-6)
    assert equal(part(glob, shared), part(server, shared))

    # local training starts from the received shared part + the client's own part, whatever
    # model the one model object held before
    starts, fit = [], training.fit  # where every fit runs (engine.fit and fit_many's client loop)
    monkeypatch.setattr(training, "fit", lambda engine, client, **kw: (starts.append(eng.get_params()), fit(engine, client, **kw))[1])
    eng.set_params(eng.method.personal_params(clients[1]))
    expected = eng.method.personal_params(clients[0])
    eng.method.local_update(clients[0], eng.method.broadcast(clients[0]))
    assert equal(starts[0], expected)


def test_fedrep_trains_the_head_first_on_a_frozen_extractor_then_the_extractor_on_a_frozen_head(tiny_partition, make_cell, monkeypatch):
    eng = make_engine(tiny_partition, make_cell, "fedrep", rounds=1)
    eng.method.setup()
    eng.round = 1
    phases, fit = [], training.fit

    def instrumented(engine, client, **kw):
        before = {k: v.detach().clone() for k, v in eng.model.named_parameters()}
        result = fit(engine, client, **kw)
        after = {k: v.detach().clone() for k, v in eng.model.named_parameters()}
        changed = {p for p in ("extractor.", "head.") if not equal(part(before, p), part(after, p))}
        phases.append((tuple(kw.get("trainable", ("",))), kw.get("epochs"), changed))
        return result

    monkeypatch.setattr(training, "fit", instrumented)
    client = eng.clients[0]
    eng.method.local_update(client, eng.method.broadcast(client))
    assert phases == [(("head.",), 2, {"head."}), (("extractor.",), None, {"extractor."})]


def test_fedbabu_never_trains_the_head_and_fine_tunes_the_whole_model_to_personalize(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell, "fedbabu", rounds=3)
    init_head = eng.get_params(("head.",))
    updates = record_updates(eng)
    heads_after_local_training = []
    local_update = eng.method.local_update

    def checked(client, payload):
        update = local_update(client, payload)
        heads_after_local_training.append(eng.get_params(("head.",)))
        return update

    eng.method.local_update = checked
    eng.run()
    assert updates and all(u.params and all(k.startswith("extractor.") for k in u.params) for u in updates)
    assert all(equal(h, init_head) for h in heads_after_local_training)
    glob = eng.method.global_params()  # the global column: no fine-tuning, the initial head
    assert equal(part(glob, "head."), init_head)

    personal = eng.method.personal_params(eng.clients[0])
    assert not equal(part(personal, "head."), init_head)  # fine-tuning trains the head ...
    assert not equal(part(personal, "extractor."), part(glob, "extractor."))  # ... and the extractor
    assert equal(eng.method.global_params(), glob)  # ... on a copy: the server state is untouched


def test_fedbabu_head_fine_tuning_uses_its_named_batch_size_and_momentum(tiny_partition, make_cell):
    """finetune_part 'head' trains the head alone with head_batch_size / head_momentum (Calibre's
    recipe as defaults; the momentum is [RECON]), not with values fixed in the code."""
    eng = make_engine(tiny_partition, make_cell, "fedbabu", rounds=1,
                      hparams={"finetune_part": "head", "head_batch_size": 7, "head_momentum": 0.5, "finetune_lr": 0.05})
    eng.run()
    calls = []
    finetune_head = eng.finetune_head

    def spy(params, client, **kw):
        calls.append(kw)
        return finetune_head(params, client, **kw)

    eng.finetune_head = spy
    glob = eng.method.global_params()
    personal = eng.method.personal_params(eng.clients[0])
    assert calls == [{"epochs": 2, "lr": 0.05, "batch_size": 7, "momentum": 0.5}]
    assert equal(part(personal, "extractor."), part(glob, "extractor."))  # the extractor stays frozen
    assert not equal(part(personal, "head."), part(glob, "head."))
    defaults = {k: p.default for k, p in type(eng.method).hparams.items()}
    assert (defaults["head_batch_size"], defaults["head_momentum"]) == (32, 0.9)


@pytest.mark.parametrize("name", ["fedper", "fedrep", "fedbabu", "lg_fedavg"])
def test_evaluation_does_not_change_training(tiny_partition, make_cell, name):
    """Evaluating every round (personal fine-tuning, averaging) leaves the run identical to
    evaluating only at the end."""
    runs = []
    for every in (1, 2):
        eng = make_engine(tiny_partition, make_cell, name, rounds=2, eval_every=every)
        m = eng.run()
        runs.append((eng.method.server["global"], [c.state for c in eng.clients], m["final"]))
    (server_a, states_a, final_a), (server_b, states_b, final_b) = runs
    assert equal(server_a, server_b)
    assert all(a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a) for a, b in zip(states_a, states_b))
    assert final_a == final_b


def test_personal_eval_every_scores_the_personal_column_only_where_asked(tiny_partition, make_cell):
    """`training.personal_eval_every: 2` over 4 rounds: FedBABU's fine-tuning runs at rounds 2
    and 4 only (half the calls), the personalized curve is null at rounds 1 and 3, and
    everything else (global curve, the scores at rounds 2 and 4, final) equals the default run."""
    runs = []
    for training in ({}, {"personal_eval_every": 2}):
        eng = make_engine(tiny_partition, make_cell, "fedbabu", rounds=4, eval_every=1, **training)
        calls, personal_params = [], eng.method.personal_params
        eng.method.personal_params = lambda client: (calls.append(eng.round), personal_params(client))[1]
        runs.append((eng.run(), calls))
    (full, full_calls), (sparse, sparse_calls) = runs
    n = len(full["clients"]["ids"])
    assert full_calls == [r for r in (1, 2, 3, 4) for _ in range(n)]
    assert sparse_calls == [r for r in (2, 4) for _ in range(n)]
    curve, full_curve = sparse["curves"]["personal_acc"]["weighted_mean"], full["curves"]["personal_acc"]["weighted_mean"]
    assert sparse["curves"]["round"] == [1, 2, 3, 4]
    assert curve[0] is None and curve[2] is None
    assert (curve[1], curve[3]) == (full_curve[1], full_curve[3]) and None not in full_curve
    assert sparse["curves"]["global_acc"] == full["curves"]["global_acc"]
    assert sparse["final"] == full["final"] and sparse["summary"] == full["summary"]
    res = sparse["resources"]
    assert 0 < res["personal_eval_time_s"] <= res["eval_time_s"]  # the fine-tuning's share, recorded apart
