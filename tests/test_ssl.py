"""The federated self-supervised family (Calibre, methods.md §2): each mechanism on hand-computed
values, so a removed or wrong mechanism fails here."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedrepro.methods.base import Update
from fedrepro.methods.calibre import (divergence_rate, divergence_weights, prototype_contrastive_loss,
                                      prototype_meta_loss)
from fedrepro.models import SplitModel
from fedrepro.ssl.objectives import OBJECTIVES

from conftest import kill_in_round_3_and_resume, method_engine

HP = {"temperature": 0.5, "proj_hidden": 8, "proj_dim": 4, "target_momentum": None, "queue_size": 8,
      "swav_prototypes": 5, "smog_groups": 3, "smog_reset_every": 0}
E1, E2 = [1.0, 0.0], [0.0, 1.0]


def tiny_ssl_model(objective: str, hp: dict | None = None):
    torch.manual_seed(0)
    model = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU()), nn.Linear(5, 3), 5)
    obj = OBJECTIVES.get(objective)(5, {**HP, **(hp or {})})
    for name, module in obj.modules(model.extractor).items():
        model.add_module(name, module)
    return model, obj


def test_nt_xent_on_a_hand_computed_example():
    """Two orthogonal pairs: each sample's positive has cosine 1, its two negatives 0, so
    NT-Xent = -log(e^{1/t} / (e^{1/t} + 2)) = log(1 + 2 e^{-1/t})."""
    _, obj = tiny_ssl_model("simclr")
    h = torch.tensor([E1, E2])
    assert obj.criterion(h, h.clone()).item() == pytest.approx(math.log(1 + 2 * math.exp(-1 / 0.5)), rel=1e-6)


def test_byol_target_is_an_ema_of_the_online_network_and_gets_no_gradient():
    model, obj = tiny_ssl_model("byol", {"target_momentum": 0.9})
    x = torch.randn(4, 6)
    obj.loss(model, x, x + 0.1).loss.backward()
    target = list(model.target_extractor.parameters()) + list(model.target_projector.parameters())
    assert all(p.grad is None and not p.requires_grad for p in target)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.projector.parameters())
    before = [p.detach().clone() for p in model.target_extractor.parameters()]
    with torch.no_grad():
        for p in model.extractor.parameters():
            p.add_(1.0)  # an online step
    obj.after_step(model, progress=0.0)  # cosine schedule at its start: momentum = the base 0.9
    for old, new, online in zip(before, model.target_extractor.parameters(), model.extractor.parameters()):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * online)
    obj.after_step(model, progress=1.0)  # at the end of training the momentum reaches 1: the target stays
    frozen = [p.detach().clone() for p in model.target_extractor.parameters()]
    with torch.no_grad():
        for p in model.extractor.parameters():
            p.add_(1.0)
    obj.after_step(model, progress=1.0)
    for old, new in zip(frozen, model.target_extractor.parameters()):
        torch.testing.assert_close(new, old)


def test_simsiam_stops_the_gradient_of_the_other_views_projection():
    """With a predictor that ignores its input, the loss only reaches the encoder and projector
    through the target branch, which the stop-gradient cuts: they get zero gradient."""
    model, obj = tiny_ssl_model("simsiam")
    model.predictor = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        model.predictor[0].weight.zero_()
        model.predictor[0].bias.copy_(torch.tensor([1.0, -1.0, 0.5, 2.0]))
    obj.loss(model, torch.randn(4, 6), torch.randn(4, 6)).loss.backward()
    for p in list(model.extractor.parameters()) + list(model.projector.parameters()):
        assert p.grad is None or p.grad.abs().max() == 0
    assert model.predictor[0].bias.grad.abs().sum() > 0


def test_moco_queue_is_fifo_of_normalised_keys_and_client_local():
    model, obj = tiny_ssl_model("mocov2")
    obj.load_local_state(None)
    bank = obj.criterion.memory_bank
    keys = []
    for step in range(3):  # 3 steps x 2 directions x 2 keys = 12 keys into a queue of 8
        xa, xb = torch.randn(2, 6), torch.randn(2, 6)
        with torch.no_grad():
            ka, kb = obj._target_of(model, xa), obj._target_of(model, xb)
        keys += [nn.functional.normalize(kb, dim=1), nn.functional.normalize(ka, dim=1)]
        obj.loss(model, xa, xb)
        if step == 1:  # after 8 keys the queue holds them in arrival order
            torch.testing.assert_close(bank.bank, torch.cat(keys))
    # the 9th to 12th keys replaced the oldest four
    torch.testing.assert_close(bank.bank, torch.cat(keys[4:] + keys[2:4]))
    assert int(bank.bank_ptr) == 4
    saved = obj.local_state()
    obj.load_local_state(None)  # another client: a fresh queue
    assert not torch.equal(bank.bank, saved["bank"])
    obj.load_local_state(saved)
    torch.testing.assert_close(bank.bank, saved["bank"])
    assert int(bank.bank_ptr) == 4


@pytest.mark.parametrize("objective", sorted(OBJECTIVES.names()))
def test_every_objective_returns_the_online_encodings_and_projections_of_both_views(objective):
    model, obj = tiny_ssl_model(objective)
    obj.load_local_state(None)
    xa, xb = torch.randn(4, 6), torch.randn(4, 6)
    out = obj.loss(model, xa, xb)
    assert out.loss.dim() <= 1 and torch.isfinite(out.loss).all()
    torch.testing.assert_close(out.za, model.extractor(xa))
    torch.testing.assert_close(out.hb, model.projector(model.extractor(xb)))


def test_prototype_meta_loss_ln_with_an_empty_cluster():
    """Clusters 0 and 2 (1 is empty): support v0 = e1, v2 = e2; each query sits on its own
    prototype, squared distance 2 to the other, so l_n = log(1 + e^{-2}); a query whose cluster has
    no support prototype (label 1) is left out."""
    za = torch.tensor([E1, E1, E2])
    ya = torch.tensor([0, 0, 2])
    zb = torch.tensor([[3.0, 0.0], E2, [0.7, 0.7]])
    yb = torch.tensor([0, 2, 1])
    assert prototype_meta_loss(za, zb, ya, yb).item() == pytest.approx(math.log(1 + math.exp(-2)), rel=1e-6)


# Two support prototypes v0 = e1, v1 = e2 (view a); three queries of view b: e1 and (0.6, 0.8) in
# cluster 0, e2 in cluster 1. Squared distances of (0.6, 0.8): 0.8 to v0, 0.4 to v1.
LN_ZA, LN_YA = torch.tensor([E1, E2]), torch.tensor([0, 1])
LN_ZB, LN_YB = torch.tensor([E1, [0.6, 0.8], E2]), torch.tensor([0, 0, 1])


def test_ln_forms_code_prose_and_algorithm1_by_hand():
    """`ln_form`: the code's CE of softmax(-d^2) averaged over the queries; the prose's formula
    sum_k -(1/N_k) sum_j softmax(-d)_k (no log, Euclidean d); Algorithm 1 line 21's
    sum_k -(1/N_k) sum_{j in k} log[exp(z_j.v_k/tau) / sum_{a outside k} exp(z_a.v_k/tau)]."""
    code = (2 * math.log(1 + math.exp(-2)) + math.log(1 + math.exp(0.4))) / 3
    assert prototype_meta_loss(LN_ZA, LN_ZB, LN_YA, LN_YB).item() == pytest.approx(code, rel=1e-6)
    own = lambda d_own, d_other: 1 / (1 + math.exp(d_own - d_other))  # noqa: E731  softmax over two prototypes
    prose = -((own(0, math.sqrt(2)) + own(math.sqrt(0.8), math.sqrt(0.4))) / 2 + own(0, math.sqrt(2)))
    assert prototype_meta_loss(LN_ZA, LN_ZB, LN_YA, LN_YB, "prose").item() == pytest.approx(prose, rel=1e-6)
    # tau = 0.5: z.v / tau = (2, 0), (1.2, 1.6), (0, 2). Cluster 0 against e2: log-sum-exp 0; cluster 1
    # against e1 and (0.6, 0.8): log(1 + e^1.6). Cluster 0's mean (2 + 1.2) / 2, cluster 1's 2 - log(1 + e^1.6).
    line21 = -(1.6 + 2 - math.log(1 + math.exp(1.6)))
    assert prototype_meta_loss(LN_ZA, LN_ZB, LN_YA, LN_YB, "algorithm1").item() == pytest.approx(line21, rel=1e-6)
    # tau (`ln_temperature`) scales the dot products of the Algorithm 1 form only
    line21_t1 = -(0.8 + 1 - math.log(1 + math.exp(0.8)))
    assert prototype_meta_loss(LN_ZA, LN_ZB, LN_YA, LN_YB, "algorithm1", tau=1.0).item() == pytest.approx(line21_t1, rel=1e-6)
    assert prototype_meta_loss(LN_ZA, LN_ZB, LN_YA, LN_YB, "code", tau=1.0).item() == pytest.approx(code, rel=1e-6)
    # a cluster with no sample outside it has no denominator: left out
    assert prototype_meta_loss(LN_ZA, LN_ZB[:2], LN_YA, LN_YB[:2], "algorithm1").item() == 0
    zb = LN_ZB.clone().requires_grad_()
    for form in ("code", "prose", "algorithm1"):  # queries exactly on a prototype: finite gradients
        zb.grad = None
        prototype_meta_loss(LN_ZA, zb, LN_YA, LN_YB, form).backward()
        assert torch.isfinite(zb.grad).all() and zb.grad.abs().sum() > 0, form


def test_ln_support_view_a_or_the_codes_clusters_of_both_views():
    """`ln_support`: view a's cluster 2 (v2 = -e1) has no query in view b. 'view_a' keeps it as a
    support prototype, an extra negative of every query; 'both_views' (the code) drops it. The
    Algorithm 1 form contrasts samples, not prototypes, so the support does not change it."""
    za, ya = torch.tensor([E1, E2, [-1.0, 0.0]]), torch.tensor([0, 1, 2])
    # squared distances to v2: e1 4, (0.6, 0.8) 3.2, e2 2
    view_a = (math.log(1 + math.exp(-2) + math.exp(-4)) + math.log(1 + math.exp(0.4) + math.exp(-2.4))
              + math.log(1 + 2 * math.exp(-2))) / 3
    both = prototype_meta_loss(LN_ZA, LN_ZB, LN_YA, LN_YB).item()
    assert prototype_meta_loss(za, LN_ZB, ya, LN_YB).item() == pytest.approx(view_a, rel=1e-6)
    assert prototype_meta_loss(za, LN_ZB, ya, LN_YB, support="both_views").item() == pytest.approx(both, rel=1e-6)
    assert view_a > both
    for form, changes in (("prose", True), ("algorithm1", False)):
        a = prototype_meta_loss(za, LN_ZB, ya, LN_YB, form).item()
        b = prototype_meta_loss(za, LN_ZB, ya, LN_YB, form, support="both_views").item()
        assert (a != pytest.approx(b, rel=1e-6)) is changes, form


def test_calibre_passes_its_ln_readings_to_the_regularizer_and_offers_no_lc(tiny_partition, make_cell):
    """The regularizer computes l_n with `ln_form`, `ln_support` and `ln_temperature`; `lc_weight`
    accepts only 0 (the paper's l_c is undefined)."""
    from fedrepro.methods import METHODS
    from fedrepro.registry import ConfigError
    from fedrepro.ssl.objectives import ViewsOutput

    torch.manual_seed(0)
    z = torch.randn(16, 5)
    out = ViewsOutput(torch.tensor(0.0), z[:8], z[8:], z[:8, :4], z[8:, :4])
    got = {}
    for hp in [{}, {"ln_form": "prose"}, {"ln_form": "algorithm1"}, {"ln_form": "algorithm1", "ln_temperature": 0.1}]:
        eng = method_engine(tiny_partition, make_cell, "calibre", {"use_lp": False, "n_clusters": 3, "proj_hidden": 8,
                                                                   "proj_dim": 4, **hp})
        torch.manual_seed(1)
        got[tuple(hp.items())] = eng.method.regularizer(out).item()
    assert len({round(v, 6) for v in got.values()}) == len(got)
    lc = METHODS.entry("calibre").params["lc_weight"]
    lc.check("calibre", "lc_weight", 0.0)
    with pytest.raises(ConfigError, match="lc_weight"):
        lc.check("calibre", "lc_weight", 1.0)


def test_prototype_contrastive_loss_lp_pairs_the_clusters_of_both_views():
    """Cluster means of h: view a (2, 0), (0, 2); view b (2, 0), (0, 1): orthogonal pairs, so
    NT-Xent gives log(1 + 2 e^{-1/t}); a cluster in one view only (3) takes no part."""
    from lightly.loss import NTXentLoss

    ha = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    ya = torch.tensor([0, 0, 2, 3])
    hb = torch.tensor([[2.0, 0.0], E2])
    yb = torch.tensor([0, 2])
    got = prototype_contrastive_loss(ha, hb, ya, yb, NTXentLoss(temperature=0.5))
    assert got.item() == pytest.approx(math.log(1 + 2 * math.exp(-2)), rel=1e-6)
    assert prototype_contrastive_loss(ha, hb[:1], ya, yb[:1], NTXentLoss()).item() == 0  # one pair: nothing to contrast


def test_divergence_rate_and_aggregation_weights_by_hand():
    # two clusters: (0,0),(2,0) around (1,0) at distance 1; (10,10),(10,14) around (10,12) at distance 2
    z = torch.tensor([[0.0, 0.0], [2.0, 0.0], [10.0, 10.0], [10.0, 14.0]])
    assert divergence_rate(z, 2, seed=0) == pytest.approx(1.5)
    # n = (100, 300), d = (1, 2): n/d = (100, 150) -> (0.4, 0.6); the code's unnormalised form:
    # n/N = (1/4, 3/4) times (1/d)/sum(1/d) = (2/3, 1/3) -> (1/6, 1/4)
    assert divergence_weights([100, 300], [1.0, 2.0]) == pytest.approx([0.4, 0.6])
    assert divergence_weights([100, 300], [1.0, 2.0], unnormalized=True) == pytest.approx([1 / 6, 1 / 4])


def _two_updates(eng):
    glob = eng.method.server["global"]
    k = next(k for k, v in glob.items() if v.is_floating_point())
    ups = []
    for cid, (n, d, value) in enumerate([(100, 1.0, 1.0), (300, 2.0, 3.0)]):
        params = {name: v.clone() for name, v in glob.items()}
        params[k] = torch.full_like(glob[k], value)
        ups.append(Update(cid, n, params, {"divergence": d}))
    return k, glob[k].clone(), ups


@pytest.mark.parametrize("compat", [False, True])
def test_calibre_aggregates_with_divergence_weights(tiny_partition, make_cell, compat):
    eng = method_engine(tiny_partition, make_cell, "calibre", {"code_compat_unnormalized": compat, "proj_hidden": 8, "proj_dim": 4})
    eng.method.setup()
    k, before, ups = _two_updates(eng)
    eng.method.aggregate(ups)
    got = eng.method.server["global"][k]
    want = (1 - 1 / 6 - 1 / 4) * before + 1 / 6 * 1.0 + 1 / 4 * 3.0 if compat else torch.full_like(before, 0.4 * 1.0 + 0.6 * 3.0)
    torch.testing.assert_close(got, want)


def test_calibre_ablation_switches_remove_each_regularizer(tiny_partition, make_cell):
    from fedrepro.ssl.objectives import ViewsOutput

    torch.manual_seed(0)
    z = torch.randn(8, 5)
    out = ViewsOutput(torch.tensor(0.0), z[:4], z[4:], z[:4, :4], z[4:, :4])
    got = {}
    for lp, ln in [(False, False), (True, False), (False, True), (True, True)]:
        eng = method_engine(tiny_partition, make_cell, "calibre", {"use_lp": lp, "use_ln": ln, "n_clusters": 3,
                                                                   "proj_hidden": 8, "proj_dim": 4})
        torch.manual_seed(1)
        reg = eng.method.regularizer(out)
        got[lp, ln] = None if reg is None else reg.item()
    assert got[False, False] is None
    assert got[True, False] > 0 and got[False, True] > 0
    assert got[True, True] == pytest.approx(got[True, False] + got[False, True])


def test_personalization_stage_leaves_the_encoder_bit_identical(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "pfl_simclr", {"proj_hidden": 8, "proj_dim": 4, "ft_epochs": 2})
    eng.method.setup()
    eng.round = 1
    client = eng.clients[0]
    eng.method.local_update(client, eng.method.broadcast(client))  # some SSL training first
    glob = {k: v.clone() for k, v in eng.method.server["global"].items()}
    personal = eng.method.personal_params(client)
    for k, v in glob.items():
        assert torch.equal(personal[k], v), k  # the probe sees the global encoder, unchanged
        assert torch.equal(eng.method.server["global"][k], v), k
    head0 = {k: v for k, v in eng.initial_params.items() if k.startswith("head.")}
    assert any(not torch.equal(personal[k], v) for k, v in head0.items())  # the head is trained ...
    again = eng.method.personal_params(client)
    assert all(torch.equal(again[k], personal[k]) for k in head0)  # ... from the same fresh start
    assert eng.method.personalize_unseen(client).keys() == personal.keys()


def test_fedema_divergence_aware_ema(tiny_partition, make_cell):
    eng = method_engine(tiny_partition, make_cell, "fedema", {"proj_hidden": 8, "proj_dim": 4, "tau": 0.7})
    eng.method.setup()
    glob = eng.method.server["global"]
    client = eng.clients[0]
    first = eng.method.start_params(client, glob)
    assert all(torch.equal(first[k], v) for k, v in glob.items())  # first participation: the global model
    enc = [k for k in glob if k.startswith("extractor.") and glob[k].is_floating_point()]
    local = {k: v + 1.0 if v.is_floating_point() else v for k, v in glob.items()}
    client.state["local"] = local
    div = math.sqrt(sum(v.numel() for k, v in glob.items() if k in enc))  # every encoder entry differs by 1
    start = eng.method.start_params(client, glob)
    assert client.state["lambda"] == pytest.approx(0.7 / div)
    for k in enc:  # calibrated: mu = tau
        torch.testing.assert_close(start[k], 0.7 * local[k] + 0.3 * glob[k])
    client.state["local"] = {k: v + 0.5 if v.is_floating_point() else v for k, v in glob.items()}
    start = eng.method.start_params(client, glob)  # half the divergence: mu = tau / 2
    k = enc[0]
    torch.testing.assert_close(start[k], glob[k] + 0.35 * 0.5)


def test_fedema_keeps_the_target_network_on_the_client(tiny_partition, make_cell):
    """FedEMA's paper: clients upload the online network only; the BYOL target stays local (a copy of
    the online network at the first participation, then the client's own). Plato's one shared model
    state is `code_compat_share_target` [PAPER≠CODE]."""
    hp = {"proj_hidden": 8, "proj_dim": 4}
    eng = method_engine(tiny_partition, make_cell, "fedema", hp)
    eng.method.setup()
    eng.round = 1
    glob = eng.method.server["global"]
    assert glob and not any(k.startswith("target_") for k in glob)  # the server holds no target network
    c0, c1 = eng.clients[0], eng.clients[1]
    start = eng.method.start_params(c0, glob)
    for k in [k for k in start if k.startswith("target_")]:  # first participation: BYOL's init, the online copy
        torch.testing.assert_close(start[k], glob[k[len("target_"):]])
    update = eng.method.local_update(c0, glob)
    assert not any(k.startswith("target_") for k in update.params)  # nothing of the target is uploaded
    mine = c0.state["target"]
    assert any(not torch.equal(mine[k], glob[k[len("target_"):]]) for k in mine)  # it followed the client's online network
    eng.method.local_update(c1, glob)  # another client trains on the one model object in between
    again = eng.method.start_params(c0, glob)
    assert all(torch.equal(again[k], mine[k]) for k in mine)  # c0 gets its own target back
    shared = method_engine(tiny_partition, make_cell, "fedema", {**hp, "code_compat_share_target": True})
    shared.method.setup()
    assert any(k.startswith("target_extractor.") for k in shared.method.server["global"])
    assert "target" not in shared.clients[0].state


def test_fedema_divergence_counts_weights_not_batchnorm_statistics(tiny_partition, make_cell):
    """The paper's ||w_c - w_g|| is over the encoder's weights; Plato's over its state_dict, BN running
    statistics included (`code_compat_divergence_buffers` [PAPER≠CODE])."""
    lam = {}
    for buffers in (False, True):
        eng = method_engine(tiny_partition, make_cell, "fedema", {"proj_hidden": 8, "proj_dim": 4,
                                                                  "code_compat_divergence_buffers": buffers})
        eng.method.setup()
        glob = {**eng.method.server["global"], "extractor.bn.running_var": torch.ones(5)}  # a BN buffer of the encoder
        client = eng.clients[0]
        client.state["local"] = {**glob, "extractor.bn.running_var": torch.ones(5) + 2.0}  # only the statistics moved ...
        weights = [k for k in eng.method.divergence_keys(glob) if k != "extractor.bn.running_var"]
        client.state["local"][weights[0]] = glob[weights[0]] + 1.0  # ... and one weight tensor, each entry by 1
        n = glob[weights[0]].numel()
        eng.method.start_params(client, glob)
        lam[buffers] = client.state["lambda"]
    assert lam[False] == pytest.approx(0.7 / math.sqrt(n))
    assert lam[True] == pytest.approx(0.7 / math.sqrt(n + 5 * 4.0))  # the statistics' 5 x 2^2 counted too


def test_local_linear_trains_alone_and_to_convergence_further(tiny_partition, make_cell):
    import torch.nn.functional as F

    losses = {}
    for epochs in (1, None):
        eng = method_engine(tiny_partition, make_cell, "local_linear", {"epochs": epochs})
        params = eng.method.personal_params(eng.clients[0])
        eng.set_params(params)
        c = eng.clients[0]
        with torch.no_grad():
            losses[epochs] = float(F.cross_entropy(eng.model(c.train.x), c.train.y))
        assert eng.method.local_update(c, {}).params == {}  # nothing travels
    assert losses[None] < losses[1]


def test_embedding_of_chosen_clients_and_its_tsne_plot(tiny_partition, make_cell, tmp_path):
    from fedrepro.report.plots import plot_tsne

    eng = method_engine(tiny_partition, make_cell, "pfl_simclr", {"proj_hidden": 8, "proj_dim": 4, "ft_epochs": 1}, rounds=1)
    eng.cell["evaluation"] = {**(eng.cell.get("evaluation") or {}), "embed_clients": [0, 2]}
    metrics = eng.run()
    emb = metrics["embedding"]
    sizes = [len(eng.client(i).test) for i in (0, 2)]
    assert emb["client"] == [0] * sizes[0] + [2] * sizes[1]
    assert len(emb["x"]) == len(emb["y"]) == len(emb["label"]) == sum(sizes)
    assert emb["label"] == torch.cat([eng.client(i).test.y for i in (0, 2)]).tolist()
    assert "embedding" not in method_engine(tiny_partition, make_cell, "fedavg", rounds=1).run()  # only when asked for
    out = tmp_path / "tsne.png"
    plot_tsne([metrics], metrics["cell"]["dataset"], metrics["cell"]["partition"], out)
    assert out.stat().st_size > 1000


def test_ssl_stage_trains_on_the_unlabeled_share_too(tiny_partition, make_cell):
    from fedrepro.engine.data import Split

    seen = {}
    for use in (True, False):
        eng = method_engine(tiny_partition, make_cell, "pfl_simclr", {"proj_hidden": 8, "proj_dim": 4, "use_unlabeled": use})
        eng.method.setup()
        eng.round = 1
        c = eng.clients[0]
        c.unlabeled = Split(c.train.x[:7].clone(), torch.full((7,), -1))
        eng.set_params(eng.method.server["global"])
        seen[use] = eng.method.ssl_fit(c)[1]
        c.unlabeled, c._ssl_pool = None, None
    assert seen[True] - seen[False] == 7


@pytest.mark.parametrize("name", ["calibre", "pfl_smog", "pfl_mocov2", "fedema"])
def test_ssl_cells_reproduce_and_resume_exactly(tiny_partition, make_cell, tmp_path, monkeypatch, name):
    """Same seed, same metrics; a run killed after round 2 and resumed from its checkpoint ends
    where the uninterrupted run ends (client-local queues, banks and step counts included)."""
    import copy

    from fedrepro.engine.run import train_cell
    from fedrepro.methods import METHODS

    cell = make_cell("fedavg", rounds=4, checkpoint_every=1, eval_every=2)
    cell.update(method=name, label=name, hparams={**{k: p.default for k, p in METHODS.get(name).hparams.items()},
                                                  "proj_hidden": 8, "proj_dim": 4, "queue_size": 16, "smog_groups": 4,
                                                  "smog_reset_every": 3, "ft_epochs": 1})
    strip = lambda m: {k: v for k, v in m.items() if k != "resources"}
    full = train_cell(copy.deepcopy(cell), tiny_partition[0], tmp_path / "a", progress=False)
    again = train_cell(copy.deepcopy(cell), tiny_partition[0], tmp_path / "b", progress=False)
    assert strip(full) == strip(again)
    ckpt = tmp_path / "ckpt.pt"
    run = lambda: train_cell(copy.deepcopy(cell), tiny_partition[0], tmp_path / "c", checkpoint=ckpt, progress=False)
    resumed = kill_in_round_3_and_resume(monkeypatch, name, run, ckpt, tmp_path / "c")
    assert strip(resumed) == strip(full)


def test_embed_clients_beyond_a_partition_is_a_config_error():
    from fedrepro.config import resolve_experiment
    from fedrepro.registry import ConfigError

    from conftest import tiny_config

    with pytest.raises(ConfigError, match=r"evaluation.embed_clients' has value \[1, 4\]; allowed: client ids below 4"):
        resolve_experiment({**tiny_config(), "evaluation": {"embed_clients": [1, 4]}})


def test_lars_adapts_matrices_and_leaves_biases_to_plain_sgd():
    """One step from zero momentum: a bias moves by -lr * grad (no decay, no trust ratio); a weight
    matrix by -lr * 0.02 * ||w|| / (||g|| + wd ||w||) * (g + wd w)."""
    from fedrepro.engine.engine import OPTIMIZERS

    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    opt = OPTIMIZERS["lars"](layer.parameters(), 0.5, 0.9, 0.1)
    layer(torch.randn(4, 3)).pow(2).sum().backward()
    gw, gb = layer.weight.grad.clone(), layer.bias.grad.clone()
    opt.step()
    torch.testing.assert_close(layer.bias.detach(), b0 - 0.5 * gb)
    ratio = 0.02 * w0.norm() / (gw.norm() + 0.1 * w0.norm() + 1e-8)
    torch.testing.assert_close(layer.weight.detach(), w0 - 0.5 * ratio * (gw + 0.1 * w0))


def test_target_momentum_zero_copies_the_online_network():
    """target_momentum 0 is a value, not "unset": after a step the target equals the online network."""
    model, obj = tiny_ssl_model("mocov2", {"target_momentum": 0.0})
    with torch.no_grad():
        for p in model.extractor.parameters():
            p.add_(1.0)
    obj.after_step(model, progress=0.5)
    for t, o in zip(model.target_extractor.parameters(), model.extractor.parameters()):
        torch.testing.assert_close(t, o)


def test_swav_normalises_its_prototypes_every_step():
    model, obj = tiny_ssl_model("swav")
    with torch.no_grad():
        model.prototypes.heads[0].weight.mul_(3.0)
    obj.loss(model, torch.randn(4, 6), torch.randn(4, 6))
    torch.testing.assert_close(model.prototypes.heads[0].weight.norm(dim=1), torch.ones(5))


def test_smog_resets_groups_from_its_bank_and_the_target_to_the_online_network():
    """At the step whose 0-based index is a multiple of smog_reset_every (lightly's global_step), the
    groups become the normalised KMeans centres of the client's memory bank and the momentum encoder
    is reset to the online one; the steps before it are EMA steps."""
    model, obj = tiny_ssl_model("smog", {"smog_reset_every": 2, "target_momentum": 0.5})
    obj.load_local_state(None)
    before = model.prototypes.group_features.detach().clone()
    for _ in range(3):  # steps 0 and 1: EMA; step 2: reset
        obj.loss(model, torch.randn(4, 6), torch.randn(4, 6))
        with torch.no_grad():
            for p in model.extractor.parameters():
                p.add_(1.0)  # an online step
        obj.after_step(model, 0.0)
    for t, o in zip(model.target_extractor.parameters(), model.extractor.parameters()):
        torch.testing.assert_close(t, o)
    groups = model.prototypes.group_features.detach()
    assert not torch.equal(groups, before)
    torch.testing.assert_close(groups.norm(dim=1), torch.ones(3))
