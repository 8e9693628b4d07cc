"""q-FFL, AFL, TERM and GRP-FED: loss-based aggregation and GRP-FED's local models.

Each test fails if the method's distinctive mechanism is removed or wrong: the weights and
steps are checked against hand computations on 2-4 clients with scalar / vector parameters."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
import torch.nn.functional as F
from torch.func import functional_call

from fedrepro.engine.run import train_cell
from fedrepro.methods import METHODS, Update, weighted_average
from fedrepro.methods._fair import global_loss, loss_std, power_weights, project_simplex, qfedavg_step, tilted_weights
from fedrepro.methods.afl import ascend_lambda
from fedrepro.methods.grp_fed import discriminator_loss, local_extractor_loss, next_power, sigma_reference

from conftest import kill_in_round_3_and_resume
from test_engine import engine_for, strip_timing

REPO = Path(__file__).resolve().parents[1]


def method_engine(tiny_partition, make_cell, label, model=None, **hparams):
    """An engine on the tiny cell running `label` with its defaults overridden; setup() done, round 1."""
    cell = make_cell("fedavg")
    defaults = {k: p.default for k, p in METHODS.get(label).hparams.items()}
    cell.update(method=label, label=label, hparams={**defaults, **hparams})
    if model is not None:
        cell["model"] = model
    eng = engine_for(cell, tiny_partition[0])
    eng.method.setup()
    eng.round = 1
    return eng


def fake_updates(eng, losses, shift=(0.1, -0.2, 0.3, 0.05), sizes=None):
    """Uploads of the first len(losses) clients: the global model shifted by a constant, with a reported loss."""
    glob = eng.method.server["global"]
    out = []
    for i, loss in enumerate(losses):
        c = eng.clients[i]
        params = {k: v + shift[i] if v.is_floating_point() else v.clone() for k, v in glob.items()}
        out.append(Update(c.id, sizes[i] if sizes else c.num_train, params, extras={"loss": loss}, loss=loss))
    return out


def mixed(updates, weights, name):
    return sum(w * u.params[name] for w, u in zip(weights, updates))


# -- shared pieces ----------------------------------------------------------------------------

def test_project_simplex_hand_computed():
    assert torch.allclose(project_simplex(torch.tensor([0.5, 0.4, 0.3])), torch.tensor([0.5, 0.4, 0.3], dtype=torch.float64) - 0.2 / 3)
    # sorted u = (1, .1, -.5): rho = 2, theta = (1 - 1.1) / 2 = -0.05
    assert torch.allclose(project_simplex(torch.tensor([0.1, 1.0, -0.5])), torch.tensor([0.05, 0.95, 0.0], dtype=torch.float64))
    on = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    assert torch.allclose(project_simplex(on), on)  # already on the simplex: unchanged
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        v = torch.randn(5, generator=g, dtype=torch.float64) * 2
        x = project_simplex(v)
        assert (x >= 0).all() and float(x.sum()) == pytest.approx(1.0)
        for _ in range(20):  # the closest point of the simplex
            s = torch.distributions.Dirichlet(torch.ones(5, dtype=torch.float64)).sample()
            assert float((x - v).norm()) <= float((s - v).norm()) + 1e-12


def test_power_weights_are_normalised_loss_powers():
    assert torch.allclose(power_weights([1.0, 2.0], 2.0), torch.tensor([0.2, 0.8], dtype=torch.float64))  # 1 : 4
    assert torch.allclose(power_weights([1.0, 2.0, 4.0], 0.0), torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(power_weights([1.0, 1.0], 3.0, sizes=[1, 3]), torch.tensor([0.25, 0.75], dtype=torch.float64))
    # q = 10 on large losses: L^q overflows float32 (1e40), the log-space softmax does not
    w = power_weights([1e4, 2e4], 10.0)
    assert torch.allclose(w, torch.tensor([1 / 1025, 1024 / 1025], dtype=torch.float64))
    assert torch.isfinite(power_weights([0.0, 1.0], 10.0)).all()


def test_tilted_weights_hand_computed():
    losses, sizes, t = [1.0, 2.0, 3.0], [10.0, 20.0, 30.0], 0.5
    raw = [n * math.exp(t * l) for n, l in zip(sizes, losses)]
    assert torch.allclose(tilted_weights(losses, t, sizes), torch.tensor(raw, dtype=torch.float64) / sum(raw))
    assert torch.allclose(tilted_weights(losses, 0.0, sizes), torch.tensor(sizes, dtype=torch.float64) / 60)
    assert torch.isfinite(tilted_weights([900.0, 1000.0], 1.0, [1.0, 1.0])).all()  # exp(1000) overflows


def test_qfedavg_step_scalar_hand_computed():
    # w = 1; w_1 = 0, F_1 = 2; w_2 = 0.5, F_2 = 1; q = 1, lr = 0.1 -> L = 10
    # Δw = (10, 5); Δ = (2*10, 1*5); h = (1*1*100 + 10*2, 1*1*25 + 10*1) = (120, 35)
    w = {"w": torch.tensor([1.0])}
    ups = [Update(0, 5, {"w": torch.tensor([0.0])}), Update(1, 5, {"w": torch.tensor([0.5])})]
    out = qfedavg_step(w, ups, [2.0, 1.0], q=1.0, lipschitz=10.0, param_names=["w"])
    assert out["w"].item() == pytest.approx(1 - 25 / 155)
    # q = 0: h_k = L, the step is the plain mean of the client models
    assert qfedavg_step(w, ups, [2.0, 1.0], q=0.0, lipschitz=10.0, param_names=["w"])["w"].item() == pytest.approx(0.25)


def test_qfedavg_step_vector_three_clients_with_buffers():
    q, L = 2.0, 4.0
    w = {"a": torch.tensor([1.0, -1.0]), "b": torch.tensor([0.5]), "stat": torch.tensor([2.0]), "n": torch.tensor(3)}
    models = [([0.5, -1.0], [0.0], [1.0], 4), ([1.0, 0.0], [1.0], [3.0], 7), ([2.0, -2.0], [0.5], [2.0], 5)]
    ups = [Update(i, 1, {"a": torch.tensor(a), "b": torch.tensor(b), "stat": torch.tensor(s), "n": torch.tensor(n)})
           for i, (a, b, s, n) in enumerate(models)]
    losses = [0.5, 1.0, 2.0]
    out = qfedavg_step(w, ups, losses, q, L, param_names=["a", "b"])  # "stat" is a buffer: not in the norm
    deltas = [{k: L * (w[k] - u.params[k]) for k in ("a", "b", "stat")} for u in ups]
    norms = [float(sum((d[k] ** 2).sum() for k in ("a", "b"))) for d in deltas]
    h = sum(q * f ** (q - 1) * n2 + L * f**q for f, n2 in zip(losses, norms))
    for k in ("a", "b", "stat"):
        expected = w[k] - sum(f**q * d[k] for f, d in zip(losses, deltas)) / h
        assert torch.allclose(out[k], expected, atol=1e-6), k
    assert out["n"].item() == 7  # integer buffers: the maximum
    # with sizes: Δ_k and h_k are both multiplied by n_k
    sizes = [1.0, 2.0, 3.0]
    out = qfedavg_step(w, ups, losses, q, L, ["a", "b"], sizes=sizes)
    h = sum(n * (q * f ** (q - 1) * n2 + L * f**q) for n, f, n2 in zip(sizes, losses, norms))
    expected = w["a"] - sum(n * f**q * d["a"] for n, f, d in zip(sizes, losses, deltas)) / h
    assert torch.allclose(out["a"], expected, atol=1e-6)


def test_loss_std_is_population_std():
    assert loss_std([1.0, 3.0]) == pytest.approx(1.0)
    assert loss_std([2.0]) == 0.0


# -- q-FFL ----------------------------------------------------------------------------------------

def test_qffl_aggregate_is_the_qfedavg_step_with_L_one_over_lr(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "qffl", q=2.0)
    glob = dict(eng.method.server["global"])
    ups = fake_updates(eng, [0.5, 1.5, 1.0])
    eng.method.aggregate(ups)
    names = [k for k, _ in eng.model.named_parameters()]
    L = 1 / eng.lr
    norms = [L**2 * sum(float(((glob[k] - u.params[k]) ** 2).sum()) for k in names) for u in ups]
    f = [0.5, 1.5, 1.0]
    h = sum(2 * fk * n2 + L * fk**2 for fk, n2 in zip(f, norms))
    for k in names:
        expected = glob[k] - sum(fk**2 * L * (glob[k] - u.params[k]) for fk, u in zip(f, ups)) / h
        assert torch.allclose(eng.method.server["global"][k], expected, atol=1e-6)
    # the high-loss client pulls hardest: its shift (-0.2) dominates the step
    step = (eng.method.server["global"]["head.bias"] - glob["head.bias"]).mean().item()
    assert step < 0


def test_qffl_reports_the_start_loss(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "qffl")
    client, payload = eng.clients[1], eng.method.broadcast(eng.clients[1])
    eng.model.eval()
    with torch.no_grad():
        expected = F.cross_entropy(functional_call(eng.model, payload, (client.train.x,)), client.train.y).item()
    assert global_loss(eng, client, payload) == pytest.approx(expected, rel=1e-5)
    up = eng.method.local_update(client, payload)
    assert up.extras["loss"] == pytest.approx(expected, rel=1e-5) and up.extras["loss"] != up.loss
    eng2 = method_engine(tiny_partition, make_cell, "qffl", loss_at="train")
    up2 = eng2.method.local_update(eng2.clients[1], eng2.method.broadcast(eng2.clients[1]))
    assert up2.extras["loss"] == up2.loss


# -- AFL --------------------------------------------------------------------------------------------

def test_afl_ascent_step_hand_computed():
    lam = torch.full((4,), 0.25, dtype=torch.float64)
    # (.25 + .1*2, .25, .25 + .1*1, .25) = (.45, .25, .35, .25), sum 1.3 -> subtract .075
    new = ascend_lambda(lam, [0, 2], [2.0, 1.0], 0.1)
    assert torch.allclose(new, torch.tensor([0.375, 0.175, 0.275, 0.175], dtype=torch.float64))


def test_afl_persistent_lambda_mixes_then_ascends_and_stays_on_the_simplex(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "afl", lambda_lr=0.1)
    afl = eng.method
    assert torch.allclose(afl.server["lambda"], torch.full((4,), 0.25, dtype=torch.float64))
    ups = fake_updates(eng, [2.0, 1.0])
    afl.aggregate(ups)  # round 1 mixes with lambda^1 (uniform over the sampled clients), then ascends
    assert torch.allclose(afl.server["global"]["head.bias"], mixed(ups, [0.5, 0.5], "head.bias"))
    # (.25 + .1*2, .25 + .1*1, .25, .25) = (.45, .35, .25, .25), sum 1.3 -> subtract .075
    assert torch.allclose(afl.server["lambda"], torch.tensor([0.375, 0.275, 0.175, 0.175], dtype=torch.float64))
    ups = fake_updates(eng, [2.0, 1.0])
    afl.aggregate(ups)  # round 2 mixes with lambda^2: 0.375 : 0.275
    assert torch.allclose(afl.server["global"]["head.bias"], mixed(ups, [0.375 / 0.65, 0.275 / 0.65], "head.bias"), atol=1e-6)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):  # lambda stays a distribution whatever the losses
        losses = (torch.rand(4, generator=g) * 5).tolist()
        afl.aggregate(fake_updates(eng, losses))
        lam = afl.server["lambda"]
        assert (lam >= 0).all() and float(lam.sum()) == pytest.approx(1.0)
    assert afl.server["lambda"].argmax().item() in range(4)


def test_afl_prior_step_and_all_zero_weights(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "afl", lambda_mode="prior_step", lambda_lr=0.1)
    afl = eng.method
    n = torch.tensor([float(c.num_train) for c in eng.clients], dtype=torch.float64)
    ups = fake_updates(eng, [3.0, 0.5])
    afl.aggregate(ups)
    lam = project_simplex(n / n.sum() + 0.1 * torch.tensor([3.0, 0.5, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(afl.server["lambda"], lam)
    w = lam[:2] / lam[:2].sum()
    assert torch.allclose(afl.server["global"]["head.bias"], mixed(ups, w.tolist(), "head.bias"), atol=1e-6)
    # persistent lambda that gives the sampled clients no mass: the global model stays
    eng = method_engine(tiny_partition, make_cell, "afl")
    eng.method.server["lambda"] = torch.tensor([0.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    before = dict(eng.method.server["global"])
    eng.method.aggregate(fake_updates(eng, [1.0, 1.0]))
    assert all(torch.equal(before[k], eng.method.server["global"][k]) for k in before)


def test_afl_average_iterates(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "afl", average_iterates=True)
    afl = eng.method
    iterates = []
    for losses in ([1.0, 2.0], [2.0, 1.0], [1.0, 1.0]):
        afl.aggregate(fake_updates(eng, losses))
        iterates.append(afl.server["global"]["head.bias"].clone())
    assert torch.allclose(afl.global_params()["head.bias"], torch.stack(iterates).mean(0), atol=1e-6)
    assert not torch.allclose(afl.global_params()["head.bias"], afl.server["global"]["head.bias"])


# -- TERM -------------------------------------------------------------------------------------------

def test_term_weights_are_tilted_sample_weights(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "term", t=0.7)
    ups = fake_updates(eng, [0.5, 2.5, 1.0], sizes=[10, 20, 40])
    eng.method.aggregate(ups)
    raw = [n * math.exp(0.7 * l) for n, l in zip([10, 20, 40], [0.5, 2.5, 1.0])]
    w = [r / sum(raw) for r in raw]
    for k in ("head.weight", "head.bias"):
        assert torch.allclose(eng.method.server["global"][k], mixed(ups, w, k), atol=1e-6)
    eng0 = method_engine(tiny_partition, make_cell, "term", t=0.0)  # t = 0 is FedAvg
    ups = fake_updates(eng0, [0.5, 2.5, 1.0], sizes=[10, 20, 40])
    eng0.method.aggregate(ups)
    assert torch.allclose(eng0.method.server["global"]["head.bias"], weighted_average(ups)["head.bias"], atol=1e-6)


# -- GRP-FED --------------------------------------------------------------------------------------

def test_grp_fed_power_update_direction():
    assert next_power(10.0, std=2.0, prev_std=1.0, alpha=0.5) == 10.5  # less fair: q up
    assert next_power(10.0, std=1.0, prev_std=2.0, alpha=0.5) == 9.5  # fairer: q down
    assert next_power(10.0, std=1.0, prev_std=1.0, alpha=0.5) == 9.5  # not worse: down
    assert next_power(0.3, std=1.0, prev_std=2.0, alpha=0.5) == 0.0  # floored at 0
    assert next_power(10.0, std=1.0, prev_std=float("nan"), alpha=0.5) == 10.0  # first round: no sigma_0


def test_grp_fed_default_update_is_the_power_average_of_the_training_losses(tiny_partition, make_cell, monkeypatch):
    """Issue 35: the paper's "aggregating all trained global models, weighted by the global training loss
    and the adaptive power q" (§3.2): the default global model is sum_k p_k w_k with p_k = F_k^q / sum_j
    F_j^q, F_k the clients' training losses (what local_update reports), q = q_0 = 10 in round 1."""
    eng = method_engine(tiny_partition, make_cell, "grp_fed")
    m = eng.method
    assert (m.hp["aggregation"], m.hp["q_update"], m.hp["loss_at"]) == ("power", "before", "train")
    payloads = {c.id: m.broadcast(c) for c in eng.clients[:3]}
    ups = [m.local_update(c, payloads[c.id]) for c in eng.clients[:3]]
    f = [u.extras["loss"] for u in ups]
    assert f == [u.loss for u in ups] and len(set(f)) == 3  # the training losses, three different ones
    m.aggregate(ups)
    raw = [fk**10 for fk in f]
    p = [r / sum(raw) for r in raw]
    for k in ("head.bias", "extractor.1.weight"):
        expected = sum(pk * u.params[k].double() for pk, u in zip(p, ups))
        assert torch.allclose(m.server["global"][k].double(), expected, atol=1e-6), k


def test_grp_fed_adapts_q_before_aggregating_with_it(tiny_partition, make_cell):
    """§3.2: q is adjusted from this round's sigma of the losses, and "Finally" the models are aggregated
    with it (`q_update: before`, the default); `q_update: after` applies it one round late."""
    traces = {}
    for when in ("before", "after"):
        eng = method_engine(tiny_partition, make_cell, "grp_fed", q_update=when)
        m = eng.method
        assert m.server["q"] == 10.0 and m.hp["alpha"] == 0.5
        ups = fake_updates(eng, [1.0, 2.0])  # std 0.5; round 1: no sigma_0, q stays 10
        m.aggregate(ups)
        w = [1 / 1025, 1024 / 1025]  # (1, 2^10) / (1 + 2^10)
        assert torch.allclose(m.server["global"]["head.bias"], mixed(ups, w, "head.bias"), atol=1e-6)
        assert m.server["q"] == 10.0 and m.server["prev_std"] == pytest.approx(0.5)
        ups = fake_updates(eng, [1.0, 3.0])  # std 1 > 0.5: q up to 10.5
        m.aggregate(ups)
        used = 10.5 if when == "before" else 10.0
        w = power_weights([1.0, 3.0], used).tolist()
        assert torch.allclose(m.server["global"]["head.bias"], mixed(ups, w, "head.bias"), atol=1e-6)
        assert m.server["q"] == 10.5
        for losses in ([1.0, 1.5], [1.0, 1.4], [1.0, 1.3], [1.0, 1.2]):  # fairer every round: q down
            m.aggregate(fake_updates(eng, losses))
        assert m.server["q"] == 8.5
        traces[when] = [q for _, q in m.report()["q_per_round"]]  # metrics.json: the power each aggregation used
        assert [s for _, s in m.report()["loss_std_per_round"]][:3] == pytest.approx([0.5, 1.0, 0.25])
    assert traces["before"] == [10.0, 10.5, 10.0, 9.5, 9.0, 8.5]
    assert traces["after"] == [10.0, 10.0, 10.5, 10.0, 9.5, 9.0]


def test_grp_fed_sigma_compare_moves_q_against_the_last_or_the_mean_sigma(tiny_partition, make_cell):
    """`sigma_compare`: sigma_t against sigma_(t-1) (default, 'previous') or against the mean of
    sigma_1..sigma_(t-1) ('running_mean'); the two differ once there are two past rounds."""
    assert sigma_reference([], "previous") != sigma_reference([], "previous")  # nan: no past round
    assert sigma_reference([0.5, 1.0], "previous") == 1.0 and sigma_reference([0.5, 1.0], "running_mean") == 0.75
    assert METHODS.get("grp_fed").hparams["sigma_compare"].default == "previous"
    qs = {}
    for rule in ("previous", "running_mean"):
        eng = method_engine(tiny_partition, make_cell, "grp_fed", sigma_compare=rule)
        m = eng.method
        for losses in ([1.0, 2.0], [1.0, 3.0], [1.0, 2.6]):  # sigma 0.5 (q stays 10), 1.0 (q up), 0.8
            ups = fake_updates(eng, losses)
            m.aggregate(ups)
        qs[rule] = [q for _, q in m.report()["q_per_round"]]
        # the third round aggregated with the q its rule gave
        w = power_weights([1.0, 2.6], qs[rule][-1]).tolist()
        assert torch.allclose(m.server["global"]["head.bias"], mixed(ups, w, "head.bias"), atol=1e-6)
    assert qs["previous"] == [10.0, 10.5, 10.0]  # 0.8 < 1.0: fairer than the last round, q down
    assert qs["running_mean"] == [10.0, 10.5, 11.0]  # 0.8 > (0.5 + 1.0) / 2: less fair than the mean, q up


def test_grp_fed_qfedavg_option_is_the_hand_computed_qfedavg_step(tiny_partition, make_cell):
    """`aggregation: qfedavg` (the default of issues 26-34): q-FedAvg (Li et al. 2020, Algorithm 3) with
    GRP-FED's power q_t = q_0 = 10 and L = 1/lr: Δw_k = L (w - w_k), h_k = q F_k^(q-1) ||Δw_k||^2 + L F_k^q,
    w <- w - sum_k F_k^q Δw_k / sum_k h_k; it equals w - c (w - w_power), a damped power average."""
    eng = method_engine(tiny_partition, make_cell, "grp_fed", aggregation="qfedavg")
    m = eng.method
    glob = {k: v.double() for k, v in m.server["global"].items()}
    f = [0.9, 1.3, 1.1]
    ups = fake_updates(eng, f)
    m.aggregate(ups)
    q, L = 10.0, 1 / eng.lr
    names = [k for k, _ in eng.model.named_parameters()]
    delta = [{k: L * (glob[k] - u.params[k].double()) for k in names} for u in ups]
    h = sum(q * fk ** (q - 1) * sum(float((d[k] ** 2).sum()) for k in names) + L * fk**q for fk, d in zip(f, delta))
    for k in names:
        expected = glob[k] - sum(fk**q * d[k] for fk, d in zip(f, delta)) / h
        assert torch.allclose(m.server["global"][k].double(), expected, atol=1e-6), k
    power = mixed(ups, power_weights(f, q).tolist(), "head.bias").double()
    step, full = m.server["global"]["head.bias"].double() - glob["head.bias"], power - glob["head.bias"]
    c = float(step.norm() / full.norm())
    assert torch.allclose(step, c * full, atol=1e-6) and 0 < c < 0.5  # the same direction, a shorter step


@pytest.mark.parametrize("lipschitz", [None, 20.0])
def test_grp_fed_qfedavg_option_is_qffls_step_with_the_same_L(tiny_partition, make_cell, lipschitz):
    """GRP-FED's qfedavg option versus q-FFL at q = q_0: the same uploads give the same global model."""
    grp = method_engine(tiny_partition, make_cell, "grp_fed", aggregation="qfedavg", lipschitz=lipschitz)
    qffl = method_engine(tiny_partition, make_cell, "qffl", q=10.0, lipschitz=lipschitz)
    f = [0.7, 1.2, 1.0]
    grp.method.aggregate(fake_updates(grp, f))
    qffl.method.aggregate(fake_updates(qffl, f))
    assert all(torch.equal(v, qffl.method.server["global"][k]) for k, v in grp.method.server["global"].items())
    other = method_engine(tiny_partition, make_cell, "grp_fed", aggregation="qfedavg", lipschitz=5.0)
    other.method.aggregate(fake_updates(other, f))
    assert not torch.allclose(other.method.server["global"]["head.bias"], grp.method.server["global"]["head.bias"])


@pytest.mark.parametrize("label,hp", [("qffl", {}), ("grp_fed", {"aggregation": "qfedavg"})])
def test_qfedavg_with_L_one_over_lr_under_momentum_is_refused_before_any_job(label, hp):
    """q-FedAvg with `lipschitz: null` (L = 1/lr) under momentum all but freezes the model (c ≈ 0.02 on
    grp_fed_cpu): `fedrepro validate` refuses it, naming the key and the momentum-equivalent L."""
    from fedrepro.config import resolve_experiment
    from fedrepro.registry import ConfigError

    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    config["methods"] = {label: {"hparams": hp} if hp else {}}
    config["training"]["optimizer"] = {"name": "sgd", "lr": 0.005, "momentum": 0.9}
    with pytest.raises(ConfigError, match=rf"methods\.{label}\.hparams\.lipschitz' has value null.*momentum 0\.9.*= 20"):
        resolve_experiment(config)
    config["methods"][label] = {"hparams": {**hp, "lipschitz": 20.0}}
    resolve_experiment(config)  # an explicit L is the user's choice
    config["methods"][label] = {"hparams": hp} if hp else {}
    config["training"]["optimizer"] = {"name": "sgd", "lr": 0.005}
    resolve_experiment(config)  # plain SGD: 1/lr is q-FFL's own convention
    if label == "grp_fed":
        config["methods"][label] = {}
        config["training"]["optimizer"] = {"name": "sgd", "lr": 0.005, "momentum": 0.9}
        resolve_experiment(config)  # the power average has no L


@pytest.mark.parametrize("epochs", [1, 2])
def test_grp_fed_reports_the_training_loss(tiny_partition, make_cell, monkeypatch, epochs):
    """L_k (paper §3.4: returned with the trained model) = the mean global CE over every batch of the
    local epochs, weighted by batch size; `loss_at: start` keeps the received model's loss before training."""
    eng = method_engine(tiny_partition, make_cell, "grp_fed")
    eng.training["local_epochs"] = epochs
    m, c = eng.method, eng.clients[1]
    seen = []
    step = m.global_step

    def recording(x, y, opt):
        z, loss = step(x, y, opt)
        seen.append((float(loss), len(y)))
        return z, loss

    monkeypatch.setattr(m, "global_step", recording)
    payload = m.broadcast(c)
    start = global_loss(eng, c, payload)
    up = m.local_update(c, payload)
    assert sum(n for _, n in seen) == epochs * c.num_train
    assert up.extras["loss"] == pytest.approx(sum(l * n for l, n in seen) / sum(n for _, n in seen), rel=1e-6)
    assert up.extras["loss"] != pytest.approx(start, rel=1e-3)
    old = method_engine(tiny_partition, make_cell, "grp_fed", loss_at="start")
    c = old.clients[1]
    payload = old.method.broadcast(c)
    assert old.method.local_update(c, payload).extras["loss"] == pytest.approx(global_loss(old, c, payload), rel=1e-6)


def test_grp_fed_cpus_qfedavg_row_differs_from_qffl_only_by_what_grp_fed_adds():
    """Issue 26: grp_fed_qfedavg runs q-FFL's server step (same q = q_0, L, reported loss), so that it
    against q-FFL measures the adaptive q and the personal branch only."""
    methods = yaml.safe_load((REPO / "config" / "papers" / "grp_fed_cpu.yaml").read_text())["methods"]
    resolved = {label: {k: p.default for k, p in METHODS.get(methods[label].get("method", label)).hparams.items()}
                | methods[label].get("hparams", {}) for label in ("qffl", "grp_fed_qfedavg")}
    qffl, grp = resolved["qffl"], resolved["grp_fed_qfedavg"]
    assert grp["aggregation"] == "qfedavg" and qffl["q"] == grp["q0"]
    assert all(qffl[k] == grp[k] for k in ("lipschitz", "loss_at", "weight_by_size"))


def _grad_step(params, loss_of, lr):
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    grads = torch.autograd.grad(loss_of(leaves), list(leaves.values()))
    return {k: v - lr * g for (k, v), g in zip(params.items(), grads)}


@pytest.mark.parametrize("lam,adv", [(0.0, "non_saturating"), (0.3, "non_saturating"), (1.0, "non_saturating"),
                                     (0.0, "minimax"), (0.3, "minimax")])
def test_grp_fed_local_step_trains_only_the_local_extractor(tiny_partition, make_cell, lam, adv):
    eng = method_engine(tiny_partition, make_cell, "grp_fed", lam=lam, adv_loss=adv)
    m = eng.method
    c = eng.clients[0]
    x, y = c.train.x[:16], c.train.y[:16]
    eng.set_params({k: v + 0.05 for k, v in m.server["global"].items()})  # the client's current F_g, C_g
    before_model = eng.get_params()
    before_disc = {k: v.clone() for k, v in m._disc.state_dict().items()}
    before_local = {k: v.clone() for k, v in m._local.state_dict().items()}
    head = {k[len("head."):]: v for k, v in before_model.items() if k.startswith("head.")}

    def loss_of(local):  # lam * CE(C_g(F_l(x)), y) + (1 - lam) * A(D(F_l(x))), C_g and D fixed
        z = functional_call(m._local, local, (x,))
        d = functional_call(m._disc, before_disc, (z,))
        # A: -log D(z_l) (non-saturating) or log(1 - D(z_l)) (minimax)
        adv_term = -F.logsigmoid(d).mean() if adv == "non_saturating" else F.logsigmoid(-d).mean()
        return lam * F.cross_entropy(functional_call(eng.model.head, head, (z,)), y) + (1 - lam) * adv_term

    expected = _grad_step(before_local, loss_of, eng.lr)
    m.local_step(x, y, eng.optimizer(m._local.parameters()))
    after_local = m._local.state_dict()
    assert all(torch.allclose(after_local[k], expected[k], atol=1e-6) for k in expected)
    assert not torch.allclose(after_local["1.weight"], before_local["1.weight"])
    # C_g (and F_g) and D are not changed by the local step
    assert all(torch.equal(before_model[k], v) for k, v in eng.get_params().items())
    assert all(torch.equal(before_disc[k], v) for k, v in m._disc.state_dict().items())


def test_grp_fed_adversarial_forms_both_fool_D_and_differ_where_D_is_sure():
    """`adv_loss`: both forms lower F_l's loss as D takes z_l for global (d up); the minimax form
    log(1 - D) has almost no gradient where D is sure the features are local, the non-saturating
    -log D the most; with lam = 1 the term is gone and the two agree."""
    logits, y = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    grads = {}
    for adv in ("non_saturating", "minimax"):
        d = torch.tensor([[-8.0], [0.0]], requires_grad=True)  # D: sure local, undecided
        local_extractor_loss(logits, y, d, lam=0.0, adv=adv).backward()
        grads[adv] = d.grad.flatten()
        assert (grads[adv] < 0).all()  # raising D(z_l) lowers the loss
        assert local_extractor_loss(logits, y, d, 1.0, adv).item() == pytest.approx(F.cross_entropy(logits, y).item())
    assert grads["non_saturating"][0].item() == pytest.approx(-(1 - torch.sigmoid(torch.tensor(-8.0)).item()) / 2)
    assert grads["minimax"][0].item() == pytest.approx(-torch.sigmoid(torch.tensor(-8.0)).item() / 2)
    assert abs(grads["minimax"][0]) < 1e-3 < abs(grads["non_saturating"][0])
    assert grads["minimax"][1].item() == pytest.approx(grads["non_saturating"][1].item())  # equal at D = 1/2


def test_grp_fed_local_classifier_received_ignores_step_1s_changes_to_C_g(tiny_partition, make_cell, monkeypatch):
    """`local_classifier`: with 'received', F_l trains exactly as if step 1 left C_g as received;
    with 'current' (default), F_l sees C_g as step 1 of each batch left it. D's step is disabled so
    that F_l depends on C_g alone."""
    def run(which, freeze_global):
        eng = method_engine(tiny_partition, make_cell, "grp_fed", local_classifier=which)
        m, c, model = eng.method, eng.clients[0], eng.model
        monkeypatch.setattr(m, "disc_step", lambda z_g, z_l, opt: None)
        if freeze_global:
            def frozen_global(x, y, opt):
                with torch.no_grad():
                    z = model.extractor(x)
                    return z.flatten(1), F.cross_entropy(model.head(z), y)
            monkeypatch.setattr(m, "global_step", frozen_global)
        up = m.local_update(c, m.broadcast(c))
        return c.state["local"], up

    assert METHODS.get("grp_fed").hparams["local_classifier"].default == "current"
    received, up = run("received", False)
    as_received, _ = run("current", True)  # C_g never moves: the received one throughout
    current, up_current = run("current", False)
    assert all(torch.equal(received[k], as_received[k]) for k in received)
    assert not torch.allclose(received["extractor.1.weight"], current["extractor.1.weight"])
    assert all(torch.equal(up.params[k], v) for k, v in up_current.params.items())  # the global model: unchanged


def test_grp_fed_discriminator_step_trains_only_D(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "grp_fed")
    m = eng.method
    g = torch.Generator().manual_seed(0)
    z_g, z_l = torch.randn(8, eng.model.feature_dim, generator=g), torch.randn(8, eng.model.feature_dim, generator=g) + 1
    before_disc = {k: v.clone() for k, v in m._disc.state_dict().items()}
    before_local = {k: v.clone() for k, v in m._local.state_dict().items()}
    before_model = eng.get_params()
    expected = _grad_step(before_disc, lambda d: discriminator_loss(functional_call(m._disc, d, (z_g,)),
                                                                     functional_call(m._disc, d, (z_l,))), eng.lr)
    m.disc_step(z_g, z_l, eng.optimizer(m._disc.parameters()))
    assert all(torch.allclose(m._disc.state_dict()[k], expected[k], atol=1e-6) for k in expected)
    assert not torch.allclose(m._disc.state_dict()["0.weight"], before_disc["0.weight"])
    assert all(torch.equal(before_local[k], v) for k, v in m._local.state_dict().items())
    assert all(torch.equal(before_model[k], v) for k, v in eng.get_params().items())
    # D's loss: BCE(D(z_g), 1) + BCE(D(z_l), 0) -- global features are 'true'
    assert discriminator_loss(torch.tensor([[20.0]]), torch.tensor([[-20.0]])).item() < 1e-6
    assert discriminator_loss(torch.tensor([[-20.0]]), torch.tensor([[20.0]])).item() > 20


def test_grp_fed_each_part_moves_only_in_its_own_step(tiny_partition, make_cell, monkeypatch):
    """Through local_update: with the global and D steps disabled, C_g, F_g and D stay as
    received; with the local and D steps disabled, F_l and D stay; with the global and local
    steps disabled, only D moves."""
    def run(disabled):
        eng = method_engine(tiny_partition, make_cell, "grp_fed")
        m, c = eng.method, eng.clients[0]
        model = eng.model

        def frozen_global(x, y, opt):
            with torch.no_grad():
                z = model.extractor(x)
                return z.flatten(1), F.cross_entropy(model.head(z), y)

        def frozen_local(x, y, opt, classifier=None):
            with torch.no_grad():
                return m._local(x).flatten(1)

        stubs = {"global": frozen_global, "local": frozen_local, "disc": lambda z_g, z_l, opt: None}
        for part in disabled:
            monkeypatch.setattr(m, f"{part}_step", stubs[part])
        payload = m.broadcast(c)
        up = m.local_update(c, payload)
        moved = lambda a, b: any(not torch.equal(a[k], b[k]) for k in a)
        return {"global": moved(payload, up.params), "local": moved(m.server["init_local"], c.state["local"]),
                "disc": moved(m._disc_init, c.state["disc"])}

    assert run(["global", "disc"]) == {"global": False, "local": True, "disc": False}
    assert run(["local", "disc"]) == {"global": True, "local": False, "disc": False}
    assert run(["global", "local"]) == {"global": False, "local": False, "disc": True}


def test_grp_fed_local_update_keeps_F_l_and_D_on_the_client(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "grp_fed")
    m = eng.method
    c = eng.clients[2]
    init_local = dict(m.server["init_local"])
    payload = m.broadcast(c)
    up = m.local_update(c, payload)
    # the upload: exactly the global model (F_g + C_g) as trained here, and the loss L_k
    assert set(up.params) == set(eng.model.state_dict()) and set(up.extras) == {"loss"}
    assert all(torch.equal(up.params[k], v) for k, v in eng.get_params().items())
    assert up.extras["loss"] == up.loss  # the training loss (test_grp_fed_reports_the_training_loss)
    assert not torch.allclose(up.params["head.bias"], payload["head.bias"])  # F_g, C_g trained
    # F_l and D stay on the client, trained, and differ from what was uploaded
    local, disc = c.state["local"], c.state["disc"]
    assert set(local) == {k for k in up.params if k.startswith("extractor.")}
    assert not torch.allclose(local["extractor.1.weight"], init_local["extractor.1.weight"])
    assert not torch.allclose(local["extractor.1.weight"], up.params["extractor.1.weight"])
    assert not torch.allclose(disc["0.weight"], m._disc_init["0.weight"])
    uploaded = [v for v in list(up.params.values()) + list(up.extras.values()) if isinstance(v, torch.Tensor)]
    assert not any(t.shape == v.shape and torch.equal(t, v) for t in uploaded for v in list(local.values()) + list(disc.values()))
    # personal model = F_l + the current global classifier C_g
    m.aggregate([up])
    pers = m.personal_params(c)
    assert all(torch.equal(pers[k], local[k]) for k in local)
    assert torch.equal(pers["head.weight"], m.server["global"]["head.weight"])
    # a client that never trained: F_l^0 = F_g^0 (default), or the received extractor ('received')
    other = eng.clients[3]
    assert torch.equal(m.personal_params(other)["extractor.1.weight"], init_local["extractor.1.weight"])
    m.hp["local_init"] = "received"
    assert torch.equal(m.personal_params(other)["extractor.1.weight"], m.server["global"]["extractor.1.weight"])
    # the next round starts from the client's stored F_l and D (checked with lr 0: nothing moves)
    m.hp["local_init"] = "global_init"
    eng.round = 2
    eng.training["optimizer"]["lr"] = 0.0
    c.state["local"] = {k: v + 1.0 for k, v in local.items()}
    c.state["disc"] = {k: v - 1.0 for k, v in disc.items()}
    m.local_update(c, m.broadcast(c))
    assert all(torch.equal(c.state["local"][k], local[k] + 1.0) for k in local)
    assert all(torch.equal(c.state["disc"][k], disc[k] - 1.0) for k in disc)


def test_grp_fed_keeps_the_local_batchnorm_statistics(tiny_partition, make_cell):
    model = {"name": "resnet32_cifar", "params": {"head_hidden": 8}}
    eng = method_engine(tiny_partition, make_cell, "grp_fed", model=model)
    m, c = eng.method, eng.clients[0]
    up = m.local_update(c, m.broadcast(c))
    key = "extractor.1.running_mean"
    assert key in c.state["local"] and not torch.equal(c.state["local"][key], up.params[key])
    assert "head.2.weight" in up.params  # the 2-layer FC classifier travels with the global model
    assert torch.equal(m.personal_params(c)[key], c.state["local"][key])


@pytest.mark.parametrize("label,hp", [("afl", {"average_iterates": True}), ("grp_fed", {}), ("qffl", {"q": 10.0})])
def test_resume_after_crash_gives_the_uninterrupted_result(tiny_partition, make_cell, tmp_path, monkeypatch, label, hp):
    """Server state (AFL's lambda, GRP-FED's q and previous std) and client state (F_l, D) survive a
    checkpoint loaded with weights_only=True, and the resumed run ends where the uninterrupted one does."""
    cell = make_cell("fedavg", rounds=3, checkpoint_every=1, eval_every=1)
    defaults = {k: p.default for k, p in METHODS.get(label).hparams.items()}
    cell.update(method=label, label=label, hparams={**defaults, **hp})
    full = train_cell(cell, tiny_partition[0], tmp_path / "full", progress=False)
    ckpt = tmp_path / "ckpt.pt"
    run = lambda: train_cell(cell, tiny_partition[0], tmp_path / "resumed", checkpoint=ckpt, progress=False)
    resumed = kill_in_round_3_and_resume(monkeypatch, label, run, ckpt)
    assert strip_timing(resumed) == strip_timing(full)
