"""FedProx, SCAFFOLD, MOON and their fine-tuned variants: each distinctive mechanism is
checked against a hand computation on the tiny cell (or on hand-made tensors)."""

from __future__ import annotations

import math

import pytest
import torch

from fedrepro.engine import checkpoints
from fedrepro.engine.engine import Batch
from fedrepro.methods import METHODS, Update, select
from fedrepro.methods._finetune import FINETUNE_HPARAMS
from fedrepro.methods.fedavg import FedAvg
from fedrepro.methods.fedprox import FedProx
from fedrepro.methods.moon import Moon, model_contrastive_loss
from fedrepro.methods.scaffold import Scaffold

from test_engine import engine_for

FULL_BATCH = 10_000  # larger than any client: one step per epoch on the whole train split


def make_engine(tiny_partition, make_cell, **training):
    eng = engine_for(make_cell("fedavg", **training), tiny_partition[0])
    eng.round = 1
    eng.initial = eng.get_params()  # every method of a test starts from this global model
    return eng


def local(eng, method, client, payload=None):
    """One local update as the engine runs it (batch streams restart for every client)."""
    eng.streams.start_client()
    return method.local_update(client, method.broadcast(client) if payload is None else payload)


def with_method(eng, cls, **hp):
    method = cls(eng, {**{k: p.default for k, p in cls.hparams.items()}, **hp})
    method.setup()
    method.server["global"] = {k: v.clone() for k, v in getattr(eng, "initial", method.server["global"]).items()}
    return method


def params_only(eng, tensors):
    names = dict(eng.model.named_parameters())
    return {k: v for k, v in tensors.items() if k in names}


# -- FedProx -------------------------------------------------------------------------------------

def test_fedprox_step_is_sgd_minus_lr_mu_times_distance_to_global(tiny_partition, make_cell):
    """Two full-batch steps from w0 = w_global: the first is plain SGD (w = w_global), the
    second, from w1, must equal plain SGD's step minus lr * mu * (w1 - w0)."""
    eng = make_engine(tiny_partition, make_cell, batch_size=FULL_BATCH, local_epochs=2)
    mu, lr, client = 0.7, eng.lr, eng.clients[0]
    fedavg, fedprox = with_method(eng, FedAvg), with_method(eng, FedProx, mu=mu)
    w0 = fedavg.broadcast(client)
    sgd2 = local(eng, fedavg, client).params
    prox2 = local(eng, fedprox, client).params
    eng.training["local_epochs"] = 1
    w1 = local(eng, fedavg, client).params
    moved = False
    for k in params_only(eng, w0):
        expected = sgd2[k] - lr * mu * (w1[k] - w0[k])
        assert torch.allclose(prox2[k], expected, atol=1e-6), k
        moved |= bool((w1[k] - w0[k]).abs().max() > 1e-4)
    assert moved  # the proximal term was non-zero, so the check above had teeth
    assert any(not torch.allclose(prox2[k], sgd2[k], atol=1e-6) for k in params_only(eng, w0))


def test_fedprox_mu_zero_is_fedavg(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    client = eng.clients[1]
    a = local(eng, with_method(eng, FedAvg), client).params
    b = local(eng, with_method(eng, FedProx, mu=0.0), client).params
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- SCAFFOLD ------------------------------------------------------------------------------------

def test_scaffold_with_zero_control_variates_is_plain_sgd(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    client = eng.clients[0]
    fedavg, scaffold = with_method(eng, FedAvg), with_method(eng, Scaffold)
    x = fedavg.broadcast(client)
    plain = local(eng, fedavg, client).params
    up = local(eng, scaffold, client)  # first participation: c = c_i = 0
    assert all(torch.equal(up.params[k], plain[k] - x[k]) for k in x)  # the upload is dy = y - x


def test_scaffold_step_is_corrected_by_c_minus_c_i(tiny_partition, make_cell):
    """One full-batch step: y = y_sgd - lr * (c - c_i)."""
    eng = make_engine(tiny_partition, make_cell, batch_size=FULL_BATCH, local_epochs=1)
    client, lr = eng.clients[2], eng.lr
    fedavg, scaffold = with_method(eng, FedAvg), with_method(eng, Scaffold)
    g = torch.Generator().manual_seed(0)
    scaffold.server["c"] = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in scaffold.server["c"].items()}
    client.state["c"] = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in scaffold.server["c"].items()}
    c, c_i = scaffold.server["c"], dict(client.state["c"])
    x = fedavg.broadcast(client)
    y_sgd = local(eng, fedavg, client).params
    dy = local(eng, scaffold, client).params
    for k in c:
        assert torch.allclose(x[k] + dy[k], y_sgd[k] - lr * (c[k] - c_i[k]), atol=1e-6), k


def test_scaffold_client_control_variate_is_option_ii(tiny_partition, make_cell):
    """c_i+ = c_i - c + (x - y) / (K lr), K = local steps; the upload carries dc = c_i+ - c_i."""
    eng = make_engine(tiny_partition, make_cell, local_epochs=2)
    client, lr = eng.clients[3], eng.lr
    scaffold = with_method(eng, Scaffold)
    g = torch.Generator().manual_seed(1)
    scaffold.server["c"] = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in scaffold.server["c"].items()}
    client.state["c"] = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in scaffold.server["c"].items()}
    c, c_i = scaffold.server["c"], dict(client.state["c"])
    payload = scaffold.broadcast(client)
    x = {k: v.clone() for k, v in payload["model"].items()}
    up = local(eng, scaffold, client, payload)
    steps = 2 * math.ceil(client.num_train / eng.training["batch_size"])
    assert steps > 2
    for k in c:
        y = x[k] + up.params[k]
        expected = c_i[k] - c[k] + (x[k] - y) / (steps * lr)
        assert torch.allclose(client.state["c"][k], expected, atol=1e-5), k
        assert torch.allclose(up.extras["delta_c"][k], expected - c_i[k], atol=1e-5), k


def test_scaffold_server_update(tiny_partition, make_cell):
    """x += eta_g * unweighted mean(dy); c += sum(dc) / N over all N clients."""
    eng = make_engine(tiny_partition, make_cell)
    scaffold = with_method(eng, Scaffold, server_lr=0.5)
    x = {k: v.clone() for k, v in scaffold.server["global"].items()}
    c0 = {k: torch.full_like(v, 0.25) for k, v in scaffold.server["c"].items()}
    scaffold.server["c"] = {k: v.clone() for k, v in c0.items()}
    updates = [Update(0, 10, {k: torch.full_like(v, 1.0) for k, v in x.items()}, {"delta_c": {k: torch.full_like(v, 2.0) for k, v in c0.items()}}),
               Update(1, 990, {k: torch.full_like(v, 3.0) for k, v in x.items()}, {"delta_c": {k: torch.full_like(v, 6.0) for k, v in c0.items()}})]
    scaffold.aggregate(updates)
    n = len(eng.clients)
    assert n == 4
    for k in x:  # unweighted although the sample counts differ: 0.5 * (1 + 3) / 2 = 1
        assert torch.allclose(scaffold.server["global"][k], x[k] + 1.0), k
    for k in c0:  # 0.25 + (2 + 6) / 4
        assert torch.allclose(scaffold.server["c"][k], torch.full_like(c0[k], 2.25)), k


def test_scaffold_round_trip_through_the_engine(tiny_partition, make_cell, tmp_path):
    """Two rounds with a checkpoint: control variates stay finite and non-zero and the
    state loads back with weights_only=True."""
    eng = engine_for(make_cell("fedavg", rounds=2, checkpoint_every=1), tiny_partition[0])
    eng.method = with_method(eng, Scaffold)
    eng.checkpoint.path = tmp_path / "ck.pt"
    eng.method.setup()
    eng.round = 1
    ups = [local(eng, eng.method, eng.clients[cid]) for cid in eng.schedule[0]]
    eng.method.aggregate(ups)
    checkpoints.save(eng, [], {"up": [], "down": [], "train_loss": []})
    state = torch.load(eng.checkpoint.path, weights_only=True)
    assert all(torch.equal(state["server"]["c"][k], v) for k, v in eng.method.server["c"].items())
    assert any(v.abs().sum() > 0 for v in eng.method.server["c"].values())


# -- MOON ----------------------------------------------------------------------------------------

def test_moon_contrastive_loss_on_hand_made_vectors():
    z = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    z_glob = torch.tensor([[2.0, 0.0], [4.0, 3.0]])  # cos = 1, 24/25
    z_prev = torch.tensor([[0.0, 5.0], [3.0, 4.0]])  # cos = 0, 1
    tau = 0.5
    row0 = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(0 / tau)))
    row1 = -math.log(math.exp(0.96 / tau) / (math.exp(0.96 / tau) + math.exp(1 / tau)))
    assert model_contrastive_loss(z, z_glob, z_prev, tau).item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    # equal references: log 2 whatever z is, and no gradient
    zz = z.clone().requires_grad_(True)
    loss = model_contrastive_loss(zz, z_glob, z_glob, tau)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2)) and zz.grad.abs().max() < 1e-6


def test_moon_zero_representation_gets_no_exploding_gradient():
    z = torch.tensor([[0.0, 0.0], [1.0, 2.0]], requires_grad=True)
    ref_g, ref_p = torch.tensor([[1.0, 0.0], [2.0, 1.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    model_contrastive_loss(z, ref_g, ref_p, 0.5).backward()
    assert torch.equal(z.grad[0], torch.zeros(2)) and z.grad.abs().max() < 10


def test_moon_without_contrastive_term_is_fedavg_and_with_it_is_not(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    client = eng.clients[0]
    fedavg = with_method(eng, FedAvg)
    # a previous local model different from the global one (second participation)
    prev_model = local(eng, fedavg, client).params
    prev = {k: v for k, v in prev_model.items() if k.startswith("extractor.")}
    plain = local(eng, fedavg, client).params
    for mu, equal in ((0.0, True), (5.0, False)):
        moon = with_method(eng, Moon, mu=mu)
        client.state["prev"] = {k: v.clone() for k, v in prev.items()}
        out = local(eng, moon, client).params
        same = all(torch.equal(out[k], plain[k]) for k in plain)
        assert same == equal, mu


def test_moon_first_participation_uses_global_as_prev_and_stores_prev(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    client = eng.clients[1]
    plain = local(eng, with_method(eng, FedAvg), client).params
    moon = with_method(eng, Moon, mu=5.0)
    assert "prev" not in client.state
    up = local(eng, moon, client)
    # w_prev = w_glob: the contrastive term is constant, so the update is FedAvg's
    for k in plain:
        assert torch.allclose(up.params[k], plain[k], atol=1e-6), k
    assert up.loss > 5.0 * math.log(2)  # ... but it is in the loss: CE + mu log 2
    # z_prev for the next participation = this round's trained extractor
    stored = client.state["prev"]
    assert set(stored) == {k for k in up.params if k.startswith("extractor.")}
    assert all(torch.equal(stored[k], up.params[k]) for k in stored)
    # the second participation starts from the same global model but now differs from FedAvg
    again = local(eng, moon, client, moon.broadcast(client))
    assert any(not torch.allclose(again.params[k], plain[k], atol=1e-6) for k in plain)


def test_moon_first_participation_contrasts_with_the_initial_model(tiny_partition, make_cell):
    """A client's previous model before its first participation is the common initial model
    (PFLlib clientmoon's old_model), not the global model it receives in a later round."""
    eng = make_engine(tiny_partition, make_cell)
    moon = with_method(eng, Moon, mu=5.0)
    client = eng.clients[1]
    g = torch.Generator().manual_seed(4)
    moved = {k: v + 0.2 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in moon.server["global"].items()}  # the global model of a later round
    x = client.train.x[:8]
    prev_z = moon._representation(select(eng.initial_params, ("extractor.",)), x)
    seen = []
    real = moon._representation
    moon._representation = lambda params, xb: seen.append(params) or real(params, xb)
    moon.fit_options(client, moved)["loss_fn"](Batch(x, client.train.y[:8], eng.model.extractor(x), eng.model(x)))
    glob_ref, prev_ref = seen
    assert all(torch.equal(glob_ref[k], moved[k]) for k in glob_ref)
    assert all(torch.equal(prev_ref[k], eng.initial_params[k]) for k in prev_ref)
    assert torch.allclose(real(prev_ref, x), prev_z)


def test_moon_reference_models_are_untouched(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    moon = with_method(eng, Moon)
    before = {k: v.clone() for k, v in moon.server["global"].items()}
    local(eng, moon, eng.clients[0])
    assert all(torch.equal(moon.server["global"][k], before[k]) for k in before)
    assert eng.model.training  # the reference passes restore train mode


# -- fine-tuned variants ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, base", [("fedprox_ft", FedProx), ("scaffold_ft", Scaffold)])
def test_finetuned_variants_register_with_both_hyperparameter_sets(name, base):
    cls = METHODS.get(name)
    assert issubclass(cls, base) and cls.has_personal and cls.has_global
    assert set(cls.hparams) == set(base.hparams) | set(FINETUNE_HPARAMS)
    entry = METHODS.entry(name)
    assert set(entry.params) == set(cls.hparams) and entry.summary
    assert cls.local_update is base.local_update and cls.aggregate is base.aggregate


def test_scaffold_ft_personal_model_is_a_finetuned_head(tiny_partition, make_cell):
    eng = make_engine(tiny_partition, make_cell)
    cls = METHODS.get("scaffold_ft")
    method = with_method(eng, cls, ft_epochs=1)
    g = method.global_params()
    p = method.personal_params(eng.clients[0])
    assert all(torch.equal(p[k], g[k]) for k in g if k.startswith("extractor."))
    assert any(not torch.equal(p[k], g[k]) for k in g if k.startswith("head."))
