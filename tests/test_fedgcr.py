"""FedGCR (methods/fedgcr.py, methods/_fedgr.py), its prompted ViT (models/prompted_vit.py) and the
metrics for distinct client types, on a tiny 3-domain image set and a 1-block ViT with random weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedrepro.data.base import RawDataset
from fedrepro.data.shards import load_partition, write_partition
from fedrepro.engine.data import load_clients
from fedrepro.metrics import type_summary
from fedrepro.methods._fedgr import beta_at, class_balanced_mean, cluster_clients, cluster_purity, fedgr_weights
from fedrepro.methods.fedgcr import group_contrastive_loss
from fedrepro.models import build_model

TINY_VIT = {"backbone": "vit_tiny_patch16_224", "weights": "none", "resize": False, "feature_dropout": 0.0,
            "backbone_args": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}}


def domain_images(n_per_domain: int = 90, seed: int = 0) -> RawDataset:
    """3 domains of 3x8x8 uint8 images, each with its own colour cast (domain d brightens channel d)."""
    g = np.random.default_rng(seed)
    n = 3 * n_per_domain
    domain = np.repeat(np.arange(3), n_per_domain)
    y = g.integers(0, 4, n)
    x = g.integers(0, 100, (n, 3, 8, 8)).astype(np.uint8)
    x[np.arange(n), domain] += 150
    x[np.arange(n), :, y, :] = 255  # the label's row lights up: learnable
    return RawDataset(name="domain_images", x=x, y=y, num_classes=4, official_split=np.zeros(n, np.int8),
                      mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), source="generated in the test", groups={"domain": domain})


@pytest.fixture(scope="module")
def domain_partition(tmp_path_factory):
    spec = {"dataset": "domain_images", "partitioner": "domain", "num_clients": 4, "seed": 0,
            "params": {"dif": 2.0}, "split": {"test_fraction": 0.3}}
    out = tmp_path_factory.mktemp("gcr") / "part"
    write_partition(domain_images(), spec, out)
    return out


def gcr_engine(domain_partition, make_cell, method="fedgcr", hparams=None, model=None, rounds=2, seed=0):
    from fedrepro.engine.engine import Engine
    from fedrepro.methods import METHODS

    cell = copy.deepcopy(make_cell("fedavg", seed=seed))
    cell["training"].update(rounds=rounds, participation=1.0, batch_size=32, eval_every=1,
                            optimizer={**cell["training"]["optimizer"], "name": "adamw", "lr": 1e-2, "weight_decay": 0.0})
    cell["model"] = {"name": "prompted_vit", "params": {**TINY_VIT, **(model or {})}}
    defaults = {k: p.default for k, p in METHODS.get(method).hparams.items()}
    cell.update(method=method, label=method, hparams={**defaults, **(hparams or {})})
    manifest, shards = load_partition(domain_partition)
    return Engine(cell, manifest, load_clients(manifest, shards, torch.device("cpu")), torch.device("cpu"), progress=False)


# -- the prompted ViT ----------------------------------------------------------------------------

def test_backbone_never_changes_and_never_travels(domain_partition, make_cell):
    for method in ("fedgcr", "fedavg"):
        engine = gcr_engine(domain_partition, make_cell, method=method, rounds=2)
        engine.method.setup()  # FedGCR's setup puts its MLP head in place (run() repeats it: no change)
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        metrics = engine.run()
        after = engine.model.state_dict()
        backbone = [k for k in before if k.startswith("extractor.backbone.")]
        assert backbone and all(torch.equal(before[k], after[k]) for k in backbone)
        trainable = {k: v for k, v in engine.model.named_parameters() if v.requires_grad}
        # FedGCR trains prompts, GC-Net and head; a baseline prompts and head (its GC-Net unused)
        assert any(k.startswith("extractor.gc_net.") for k in trainable) == (method == "fedgcr")
        assert all(not torch.equal(before[k], v) for k, v in trainable.items())
        payload = engine.method.broadcast(engine.clients[0])
        assert {k for k in payload if not k.startswith("fedgcr/")} == set(trainable)
        assert set(engine.method.server["global"]) == set(trainable)
        per_client = sum(v.numel() * v.element_size() for v in trainable.values())
        assert metrics["communication"]["bytes_down_per_round"][0] == per_client * len(engine.clients)
        extras = 16 * 4 + 8 if method == "fedgcr" else 0  # h~_k (d = 16 floats) and L_k
        assert metrics["communication"]["bytes_up_per_round"][0] == (per_client + extras) * len(engine.clients)


def test_type_specific_prompt_is_per_sample():
    torch.manual_seed(0)
    model = build_model("prompted_vit", (3, 8, 8), 4, TINY_VIT).eval()
    model.use_type_prompt(True)
    ext = model.extractor
    x = torch.randn(3, 3, 8, 8)
    r = ext.cls(ext.tokens(x))
    p_bar, h = ext.combined_prompts(r)
    assert p_bar.shape == (3, 4, 16)
    for b in range(3):  # p_bar_{b,j} = p_j + GC-Net(r_b): sample b's own h in each of its P slots
        assert torch.allclose(p_bar[b], ext.prompts + ext.gc_net(r[b]), atol=1e-6)
    assert not torch.allclose(h[0], h[1])
    with torch.no_grad():  # a sample's feature does not depend on the other samples of its batch
        z_batch = model.extractor(x)
        z_alone = torch.cat([model.extractor(x[b : b + 1]) for b in range(3)])
        z_other = model.extractor(torch.cat([x[:1], torch.randn(2, 3, 8, 8)]))
    assert torch.allclose(z_batch, z_alone, atol=1e-5)
    assert torch.allclose(z_batch[0], z_other[0], atol=1e-5)
    no_gc = build_model("prompted_vit", (3, 8, 8), 4, {**TINY_VIT, "gc_net": False})
    assert no_gc.extractor.gc_net is None and not any("gc_net" in k for k in no_gc.state_dict())


def test_missing_checkpoint_is_named(tmp_path):
    missing = tmp_path / "vit.pt"
    with pytest.raises(FileNotFoundError, match="vit.pt.*pretrain-backbone"):
        build_model("prompted_vit", (3, 8, 8), 4, {**TINY_VIT, "weights": str(missing)})


def test_local_checkpoint_is_loaded(tmp_path):
    torch.manual_seed(1)
    source = build_model("prompted_vit", (3, 8, 8), 4, TINY_VIT)
    torch.save(source.extractor.backbone.state_dict(), tmp_path / "vit.pt")
    torch.manual_seed(2)
    loaded = build_model("prompted_vit", (3, 8, 8), 4, {**TINY_VIT, "weights": str(tmp_path / "vit.pt")})
    a, b = source.extractor.backbone.state_dict(), loaded.extractor.backbone.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- FedGR ---------------------------------------------------------------------------------------

def test_client_representation_is_class_balanced():
    h = torch.cat([torch.zeros(9, 2), torch.full((1, 2), 10.0)])
    y = torch.tensor([0] * 9 + [1])
    assert torch.allclose(class_balanced_mean(h, y, num_classes=3), torch.full((2,), 5.0))  # not the sample mean 1.0


def test_beta_schedules_on_hand_values():
    assert beta_at(1) == 0.0  # Algorithm 1: 0.5 - 0.5 * 0.5^0
    assert beta_at(2) == pytest.approx(0.25)
    assert beta_at(3) == pytest.approx(0.375)
    assert beta_at(1, "code") == pytest.approx(0.05)  # (1 - 0.5) * (1 - 0.9^1)
    assert beta_at(2, "code") == pytest.approx(0.5 * (1 - 0.81))
    assert beta_at(3, delta=0.4, gamma=0.1) == pytest.approx(0.4 * (1 - 0.01))


def test_fedgr_weights_on_hand_values():
    losses, sizes, groups = [1.0, 2.0, 4.0], [1.0, 3.0, 4.0], [0, 0, 1]
    # p = [1/8, 3/8, 1/2]; group losses (paper Eq. 3, plain mean): g0 = (1 + 2) / 2 = 1.5, g1 = 4
    beta, q = 0.5, 1.0
    p = [1 / 8, 3 / 8, 1 / 2]
    raw = [p[0] * (1.0**0.5 * 1.5**0.5) ** 2, p[1] * (2.0**0.5 * 1.5**0.5) ** 2, p[2] * (4.0**0.5 * 4.0**0.5) ** 2]
    expected = torch.tensor(raw, dtype=torch.float64) / sum(raw)
    assert torch.allclose(fedgr_weights(losses, sizes, groups, beta, q), expected)
    # beta = 0, q = 0: FedAvg's p_k * L_k / normaliser; beta = 1: the group loss only
    assert torch.allclose(fedgr_weights(losses, sizes, groups, 0.0, 0.0),
                          torch.tensor([1 / 8, 6 / 8, 2.0], dtype=torch.float64) / (23 / 8))
    w = fedgr_weights(losses, sizes, groups, 1.0, 0.0)
    assert w[0] / w[1] == pytest.approx(1 / 3)  # same group loss: the size ratio only


def test_fedgr_group_loss_is_the_plain_mean_and_the_codes_size_weighting_is_an_option():
    """Issue 27: Eq. 3's L~_i = (1/N_i) sum_j L_ij (the default); the code's data-size weighted mean
    (utils/util.py communication) is `group_loss: size_weighted`."""
    losses, sizes, groups, beta, q = [1.0, 2.0, 4.0], [1.0, 3.0, 4.0], [0, 0, 1], 1.0, 0.0
    # beta = 1, q = 0: w_k ∝ p_k L~_g(k); plain g0 = 1.5, size-weighted g0 = (1 + 3 * 2) / 4 = 1.75
    plain = torch.tensor([1 / 8 * 1.5, 3 / 8 * 1.5, 1 / 2 * 4.0], dtype=torch.float64)
    weighted = torch.tensor([1 / 8 * 1.75, 3 / 8 * 1.75, 1 / 2 * 4.0], dtype=torch.float64)
    assert torch.allclose(fedgr_weights(losses, sizes, groups, beta, q), plain / plain.sum())
    assert torch.allclose(fedgr_weights(losses, sizes, groups, beta, q, "size_weighted"), weighted / weighted.sum())
    with pytest.raises(ValueError, match="size_weighted"):
        fedgr_weights(losses, sizes, groups, beta, q, "median")


def test_clustering_accuracy_on_separable_representations():
    g = torch.Generator().manual_seed(0)
    types = [0] * 5 + [1] * 3 + [2] * 2
    centres = torch.tensor([[10.0, 0, 0], [0, 10.0, 0], [0, 0, 10.0]])
    reps = centres[types] + 0.1 * torch.randn(len(types), 3, generator=g)
    labels, found = cluster_clients(reps, 3, seed=0)
    assert cluster_purity(labels, types) == 1.0
    assert len(set(labels.tolist())) == 3
    for k in range(3):  # each centre is the plain mean of its members
        assert torch.allclose(found[k], reps[torch.as_tensor(labels == k)].mean(0))
    labels2, _ = cluster_clients(reps, 2, seed=0)  # T' < T: two types share a group
    assert cluster_purity(labels2, types) < 1.0
    assert cluster_purity([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 2]) == pytest.approx(4 / 6)


def test_group_contrastive_loss_on_hand_values():
    h = torch.tensor([[1.0, 0.0]])
    centres = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # own = 1: cos 1; other cos 0
    prev = torch.tensor([-1.0, 0.0])  # cos -1
    tau = 0.5
    logits = torch.tensor([1.0, 0.0, -1.0]) / tau
    expected = -torch.log_softmax(logits, 0)[0]
    assert group_contrastive_loss(h, centres, 1, prev, tau).item() == pytest.approx(expected.item(), rel=1e-5)


# -- the method -----------------------------------------------------------------------------------

def test_fedgcr_clusters_reweights_and_is_deterministic(domain_partition, make_cell):
    runs = [gcr_engine(domain_partition, make_cell, rounds=3).run() for _ in range(2)]
    a, b = runs
    assert a["summary"] == b["summary"] and a["final"] == b["final"]
    assert a["method"]["cluster_acc"] == 1.0  # colour-cast domains: the GMM finds them
    assert len(a["method"]["cluster_acc_per_round"]) == 3
    # the summary's Avg / σ_type / σ_client are those of the final per-client accuracies and domains
    domains = [0, 0, 1, 2]  # dif 2 over 3 domains: 2, 1, 1 clients
    expected = type_summary(a["final"]["global"]["acc"], a["clients"]["test_size"], domains)
    assert a["summary"]["global_types"] == pytest.approx(expected)


def test_reweighting_and_customization_change_training(domain_partition, make_cell):
    def trained(**kw):
        engine = gcr_engine(domain_partition, make_cell, rounds=2, **kw)
        metrics = engine.run()
        return engine.method.server["global"], metrics

    both, _ = trained()
    gc_only, _ = trained(hparams={"group_reweighting": False})
    no_losses, _ = trained(hparams={"group_customization": False})
    gr_only, metrics = trained(hparams={"group_customization": False}, model={"gc_net": False})
    differs = lambda a, b: any(not torch.allclose(a[k], b[k]) for k in a if k in b)
    assert differs(both, gc_only) and differs(both, no_losses)
    assert "extractor.gc_net.0.weight" in both and "extractor.gc_net.0.weight" not in no_losses
    assert "extractor.gc_net.0.weight" not in gr_only
    assert metrics["method"]["cluster_acc"] == 1.0  # the prompt-free embedding separates the colour casts too
    with pytest.raises(Exception, match="gc_net"):
        gcr_engine(domain_partition, make_cell, model={"gc_net": False}).run()


def test_client_representation_model_and_fedgr_only_input_are_named_readings(domain_partition, make_cell):
    """Issue 35: h~_k (Eq. 4) comes from the client's trained model by default (Algorithm 1 line 15, after
    the epochs) and from the received global model with `representation_at: received`; without a GC-Net
    FedGR clusters r by default and the prompted z with `fedgr_representation: prompted`."""
    def rep(**hp):
        engine = gcr_engine(domain_partition, make_cell, rounds=1, hparams=hp)
        engine.method.setup()
        engine.round = 1
        client = engine.clients[0]
        payload = engine.method.broadcast(client)
        update = engine.method.local_update(client, payload)
        trained = engine.method.client_representation(client)  # the uploaded model is in place
        engine.set_params(payload)
        return update.extras["rep"], trained, engine.method.client_representation(client)

    sent, trained, received = rep()
    assert torch.equal(sent, trained) and not torch.allclose(sent, received)
    sent, trained, received = rep(representation_at="received")
    assert torch.equal(sent, received) and not torch.allclose(sent, trained)
    cls, _, _ = rep(group_customization=False)
    prompted, _, _ = rep(group_customization=False, fedgr_representation="prompted")
    assert cls.shape == prompted.shape and not torch.allclose(cls, prompted)


def _round_2(domain_partition, make_cell, **hp):
    """A FedGCR cell's second round, aggregated: (method, its updates, each update's group label)."""
    engine = gcr_engine(domain_partition, make_cell, rounds=2, hparams=hp)
    method = engine.method
    method.setup()
    engine.round = 2
    updates = [method.local_update(c, method.broadcast(c)) for c in engine.clients]
    method.aggregate(updates)
    return method, updates, [method.server["group_of"][u.client_id] for u in updates]


@pytest.mark.parametrize("code", [False, True])
def test_server_mixes_uploads_with_the_fedgr_weights(domain_partition, make_cell, code):
    hp = {"group_loss": "size_weighted", "loss_at": "start"} if code else {}
    method, updates, labels = _round_2(domain_partition, make_cell, **hp)
    w = fedgr_weights([u.extras["loss"] for u in updates], [u.num_samples for u in updates], labels, beta_at(2), 1.0,
                      "size_weighted" if code else "mean")
    for k, v in method.server["global"].items():
        expected = sum(float(wk) * u.params[k] for wk, u in zip(w, updates))
        assert torch.allclose(v, expected, atol=1e-6)


def test_fedgr_weights_unnormalised_as_algorithm1_writes_them():
    """`aggregation: unnormalized`: Algorithm 1's theta^r = sum omega_ij (L'_ij)^(q+1) theta_ij without the
    code's normaliser: the numerators of test_fedgr_weights_on_hand_values themselves."""
    losses, sizes, groups, beta, q = [1.0, 2.0, 4.0], [1.0, 3.0, 4.0], [0, 0, 1], 0.5, 1.0
    p = [1 / 8, 3 / 8, 1 / 2]
    raw = torch.tensor([p[0] * 1.5, p[1] * 2.0 * 1.5, p[2] * 16.0], dtype=torch.float64)
    assert torch.allclose(fedgr_weights(losses, sizes, groups, beta, q, normalized=False), raw)
    assert torch.allclose(fedgr_weights(losses, sizes, groups, beta, q), raw / raw.sum())
    assert float(raw.sum()) == pytest.approx(9.3125)  # the model would be scaled by 9.31


def test_fedgcr_summed_loss_and_unnormalised_aggregation_are_options(domain_partition, make_cell):
    """`loss_reduction: sum` reports n_k times the mean loss (Eq. 2's sum over the client's samples), which
    changes the normalised weights of clients of different sizes; `aggregation: unnormalized` mixes the
    uploads with weights that do not sum to 1 (Algorithm 1 as written)."""
    def round_2(**hp):
        return _round_2(domain_partition, make_cell, **hp)

    _, mean_ups, labels = round_2()
    _, sum_ups, _ = round_2(loss_reduction="sum")
    sizes = [u.num_samples for u in mean_ups]
    assert len(set(sizes)) > 1  # clients of different sizes
    for m, s_ in zip(mean_ups, sum_ups):
        assert m.extras["loss"] == m.loss and s_.extras["loss"] == pytest.approx(m.loss * m.num_samples)
    w_mean = fedgr_weights([u.extras["loss"] for u in mean_ups], sizes, labels, beta_at(2), 1.0)
    w_sum = fedgr_weights([u.extras["loss"] for u in sum_ups], sizes, labels, beta_at(2), 1.0)
    assert not torch.allclose(w_mean, w_sum)
    method, ups, labels = round_2(aggregation="unnormalized")
    w = fedgr_weights([u.extras["loss"] for u in ups], sizes, labels, beta_at(2), 1.0, normalized=False)
    assert abs(float(w.sum()) - 1) > 0.01
    for k, v in method.server["global"].items():
        assert torch.allclose(v, sum(float(wk) * u.params[k] for wk, u in zip(w, ups)), atol=1e-6)


def test_fedgcr_reports_the_local_training_loss_and_the_codes_start_loss_is_an_option(domain_partition, make_cell):
    """Issue 27: Algorithm 1's LocalUpdate returns L, the loss of the local training (default
    `loss_at: train`); the code's loss of the received model on the train split is `loss_at: start`."""
    from fedrepro.methods._fair import global_loss

    for loss_at in ("train", "start"):
        engine = gcr_engine(domain_partition, make_cell, rounds=2, hparams={} if loss_at == "train" else {"loss_at": loss_at})
        assert engine.method.hp["loss_at"] == loss_at
        engine.training["local_epochs"] = 3  # the training loss then moves away from the received model's
        method = engine.method
        method.setup()
        engine.round = 1
        c = engine.clients[0]
        payload = method.broadcast(c)
        start = global_loss(engine, c, {k: v.clone() for k, v in payload.items()})
        up = method.local_update(c, payload)
        if loss_at == "train":
            assert up.extras["loss"] == up.loss and up.extras["loss"] != pytest.approx(start, rel=1e-3)
        else:
            assert up.extras["loss"] == pytest.approx(start, rel=1e-6)


def test_code_compat_loss_weights(domain_partition, make_cell):
    engine = gcr_engine(domain_partition, make_cell, rounds=4, hparams={"loss_form": "code_compat"})
    engine.round = 3
    w_gc, w_ra, tau_ra = engine.method._loss_weights()
    assert w_gc == pytest.approx(0.1 * (0.5 + 0.5 * 2 / 4)) and w_ra == pytest.approx(0.05) and tau_ra == 1.0
    paper = gcr_engine(domain_partition, make_cell).method._loss_weights()
    assert paper == (0.5, 0.1, 0.5)


def test_fedgcr_default_head_is_one_linear_layer_and_the_mlp_is_an_option(domain_partition, make_cell):
    """Issue 35: the paper's "another MLP classification head" is the ViT's fine-tuning head of
    Dosovitskiy et al. (its Fig. 2 footnote), one linear layer, as in the code's default: the default
    head is the model's Linear(d, C); `head: mlp` (d -> d/2 -> d/4 -> C, the code's optional nonlinear
    Classifier; the default of issue 27) is an option; the FedGR-only ablation keeps the linear head."""
    def head_of(**hp):
        engine = gcr_engine(domain_partition, make_cell, rounds=1, hparams=hp)
        engine.run()
        return engine.model.head, engine.method.server["global"]

    linear, params = head_of()
    assert isinstance(linear, torch.nn.Linear) and "head.weight" in params and "head.4.weight" not in params
    mlp, params = head_of(head="mlp")
    d = TINY_VIT["backbone_args"]["embed_dim"]
    widths = [(m.in_features, m.out_features) for m in mlp if isinstance(m, torch.nn.Linear)]
    assert widths == [(d, d // 2), (d // 2, d // 4), (d // 4, 4)]
    assert "head.4.weight" in params  # it trains and travels
    ablation, _ = head_of(group_customization=False, head="mlp")
    assert isinstance(ablation, torch.nn.Linear)


def test_fedgcr_with_its_mlp_head_resumes_to_the_same_metrics(domain_partition, make_cell, tmp_path, monkeypatch):
    """The MLP head is put in place by setup(): a run killed in round 3 and resumed from its
    checkpoint ends with the metrics of an uninterrupted run."""
    from conftest import kill_in_round_3_and_resume
    from fedrepro.engine.run import train_cell

    engine = gcr_engine(domain_partition, make_cell, rounds=3, hparams={"head": "mlp"})
    manifest, _ = load_partition(domain_partition)
    cell = {**engine.cell, "partition_id": manifest["partition_id"],
            "training": {**engine.cell["training"], "checkpoint_every": 1}}
    whole = train_cell(cell, domain_partition, tmp_path / "whole", device="cpu", progress=False)
    ckpt = tmp_path / "ckpt.pt"
    run = lambda: train_cell(cell, domain_partition, tmp_path / "resumed", checkpoint=ckpt, device="cpu", progress=False)
    resumed = kill_in_round_3_and_resume(monkeypatch, "fedgcr", run, ckpt, tmp_path / "resumed")
    strip = lambda m: {k: v for k, v in m.items() if k != "resources"}
    assert strip(resumed) == strip(whole)


# -- metrics for distinct client types ---------------------------------------------------------------

def test_type_summary_on_hand_values():
    acc = [1.0, 0.5, 0.2, 0.4]
    sizes = [10, 30, 10, 10]
    types = [0, 0, 1, 2]
    # type accuracies: t0 = (10 + 15) / 40 = 0.625, t1 = 0.2, t2 = 0.4
    t = np.array([0.625, 0.2, 0.4])
    out = type_summary(acc, sizes, types)
    assert out["avg"] == pytest.approx(t.mean())
    assert out["sigma_type"] == pytest.approx(t.std())
    assert out["sigma_client"] == pytest.approx(np.array([0.625, 0.625, 0.2, 0.4]).std())
    assert out["num_types"] == 3


def test_exploded_client_representations_fail_the_cell_with_a_reason(domain_partition, make_cell):
    """Algorithm 1's unnormalised sum rescales the model every round; on fedgcr_cpu its representations
    exploded by round 3 and scikit-learn's GMM ended the job with a traceback. Now the round's
    aggregate raises TrainingDiverged, which the job records as a failed cell with its reason."""
    from fedrepro.federation import TrainingDiverged

    engine = gcr_engine(domain_partition, make_cell, rounds=2)
    method = engine.method
    method.setup()
    engine.round = 2
    updates = [method.local_update(c, method.broadcast(c)) for c in engine.clients]
    updates[1].extras["rep"] = torch.full_like(updates[1].extras["rep"], float("inf"))
    with pytest.raises(TrainingDiverged) as err:
        method.aggregate(updates)
    assert err.value.round == 2 and err.value.reason.startswith("the GMM cannot cluster round 2's client representations")
