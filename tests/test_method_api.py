"""The method API carries the next issues' mechanisms without engine changes.

Each toy method below is written the way a method module would be: a `Method` subclass
with hyper-parameters, `shared`, `local_update` and, where needed, `aggregate` and
`personal_params`. They run through the unchanged engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedrepro.engine import checkpoints
from fedrepro.engine.data import Client
from fedrepro.methods import Method, Update, select, weighted_average
from fedrepro.methods.fedavg import FedAvg
from fedrepro.registry import Param

from test_engine import engine_for


class PartialSharing(Method):
    """FedPer-style: the extractor is averaged, every client keeps its own head."""

    shared = ("extractor.",)
    has_personal = True

    def local_update(self, client: Client, payload):
        self.engine.set_params({**self.server["global"], **client.state.get("head", {}), **payload})
        fit = self.engine.fit(client)
        client.state["head"] = self.engine.get_params(("head.",))
        return Update(client.id, client.num_train, self.engine.get_params(self.shared), loss=fit.loss)

    def personal_params(self, client):
        return {**self.server["global"], **client.state.get("head", {})}


class Proximal(FedAvg):
    """FedProx-style: a loss term pulling towards the received model."""

    hparams = {"mu": Param(0.5, "proximal weight")}

    def local_update(self, client, payload):
        self.engine.set_params(payload)
        anchor = {k: v.clone() for k, v in payload.items()}
        named = dict(self.engine.model.named_parameters())

        def loss_fn(batch):
            prox = sum(((named[k] - anchor[k]) ** 2).sum() for k in named)
            return F.cross_entropy(batch.logits, batch.y) + self.hp["mu"] / 2 * prox

        fit = self.engine.fit(client, loss_fn=loss_fn)
        return Update(client.id, client.num_train, self.engine.get_params(self.shared), loss=fit.loss)


class ControlVariates(FedAvg):
    """SCAFFOLD-style gradient correction with per-client and server state."""

    def setup(self):
        super().setup()
        self.server["c"] = {k: torch.zeros_like(v) for k, v in self.engine.model.named_parameters()}

    def local_update(self, client, payload):
        self.engine.set_params(payload)
        c_i = client.state.setdefault("c", {k: torch.zeros_like(v) for k, v in self.server["c"].items()})

        def correct(model):
            for k, p in model.named_parameters():
                p.grad.add_(self.server["c"][k] - c_i[k])

        fit = self.engine.fit(client, before_step=correct)
        new = self.engine.get_params()
        steps = max(fit.steps, 1)
        delta_c = {k: -self.server["c"][k] + (payload[k] - new[k]) / (steps * self.engine.lr) for k in c_i}
        for k in c_i:
            c_i[k] += delta_c[k]
        return Update(client.id, client.num_train, new, extras={"delta_c": delta_c}, loss=fit.loss)

    def aggregate(self, updates):
        super().aggregate(updates)
        n = len(self.engine.clients)
        for k in self.server["c"]:
            self.server["c"][k] += sum(u.extras["delta_c"][k] for u in updates) / n


class Prototypes(Method):
    """FedProto-style: only per-class mean representations travel; no model averaging."""

    shared = ()
    has_global = False
    has_personal = True

    def broadcast(self, client):
        return {"protos": self.server.get("protos", {})}

    def local_update(self, client, payload):
        self.engine.set_params(client.state.get("model", self.server["global"]))
        fit = self.engine.fit(client)
        client.state["model"] = self.engine.get_params()
        feats = self.engine.features(client.train.x)
        protos = {int(c): feats[client.train.y == c].mean(0) for c in client.train.y.unique()}
        return Update(client.id, client.num_train, extras={"protos": protos}, loss=fit.loss)

    def aggregate(self, updates):
        classes = {c for u in updates for c in u.extras["protos"]}
        self.server["protos"] = {c: torch.stack([u.extras["protos"][c] for u in updates if c in u.extras["protos"]]).mean(0)
                                 for c in classes}

    def personal_params(self, client):
        return client.state.get("model", self.server["global"])


class LearnedWeights(FedAvg):
    """Server-side aggregation weights kept and updated in the server state (AFL-style)."""

    def setup(self):
        super().setup()
        self.server["lambda"] = torch.full((len(self.engine.clients),), 1.0 / len(self.engine.clients))

    def aggregate(self, updates):
        losses = torch.tensor([u.loss for u in updates])
        lam = self.server["lambda"]
        ids = [u.client_id for u in updates]
        lam[ids] = torch.softmax(torch.log(lam[ids]) + 0.1 * losses, 0) * lam[ids].sum()
        w = lam[ids] / lam[ids].sum()
        for u, wi in zip(updates, w):
            u.num_samples = float(wi)
        self.server["global"] = {**self.server["global"], **weighted_average(updates)}


@pytest.mark.parametrize("cls", [PartialSharing, Proximal, ControlVariates, Prototypes, LearnedWeights])
def test_mechanism_runs_through_the_unchanged_engine(tiny_partition, make_cell, cls):
    eng = engine_for(make_cell("fedavg", rounds=2, checkpoint_every=1), tiny_partition[0])
    eng.method = cls(eng, {k: p.default for k, p in cls.hparams.items()})
    metrics = eng.run()
    assert metrics["status"] == "ok" and metrics["rounds"] == 2
    assert ("personal_acc" in metrics["summary"]) == cls.has_personal
    assert ("global_acc" in metrics["summary"]) == cls.has_global


def test_partial_sharing_uploads_only_the_extractor_and_keeps_heads_apart(tiny_partition, make_cell):
    eng = engine_for(make_cell("fedavg", rounds=1), tiny_partition[0])
    eng.method = PartialSharing(eng, {})
    m = eng.run()
    extractor_bytes = sum(v.numel() * v.element_size() for k, v in eng.model.state_dict().items() if k.startswith("extractor."))
    assert m["communication"]["bytes_up_per_round"] == [extractor_bytes * len(eng.clients)]
    heads = [c.state["head"]["head.weight"] for c in eng.clients]
    assert not torch.equal(heads[0], heads[1])


def test_per_client_state_survives_a_checkpoint(tiny_partition, make_cell, tmp_path):
    eng = engine_for(make_cell("fedavg", rounds=2, checkpoint_every=1), tiny_partition[0])
    eng.checkpoint.path = tmp_path / "ck.pt"
    eng.method = ControlVariates(eng, {})
    eng.method.setup()
    eng.round = 1
    for cid in eng.schedule[0]:
        eng.method.local_update(eng.clients[cid], eng.method.broadcast(eng.clients[cid]))
    # records consistent with one finished round, as the checkpoint check requires
    history = [{"round": 1, "train_loss": 0.5}] if eng.training["eval_every"] == 1 else []
    checkpoints.save(eng, history, {"up": [0], "down": [0], "train_loss": [0.5]})
    fresh = engine_for(make_cell("fedavg", rounds=2, checkpoint_every=1), tiny_partition[0])
    fresh.checkpoint.path = eng.checkpoint.path
    fresh.method = ControlVariates(fresh, {})
    assert checkpoints.load(fresh) is not None
    for a, b in zip(eng.clients, fresh.clients):
        assert all(torch.equal(a.state["c"][k], b.state["c"][k]) for k in a.state["c"])
    assert all(torch.equal(eng.method.server["c"][k], fresh.method.server["c"][k]) for k in eng.method.server["c"])


def test_select_filters_by_prefix():
    params = {"extractor.0.weight": torch.zeros(1), "head.weight": torch.ones(1)}
    assert list(select(params, ("head.",))) == ["head.weight"]
    assert select(params, ()) == {}
    assert select(params, ("",)) == params


def test_every_method_writes_its_local_update_once():
    """No class of a registered method defines both forms of the local update (the per-client
    `local_update` and the over-the-clients `local_updates`): the base class derives the other,
    so the two cannot drift apart. Each method has one of them below `Method`."""
    from fedrepro.methods import METHODS

    for name in METHODS.names():
        mro = METHODS.get(name).__mro__
        assert not [k.__name__ for k in mro if k is not Method and {"local_update", "local_updates"} <= k.__dict__.keys()], name
        assert any({"local_update", "local_updates"} & k.__dict__.keys() for k in mro if k is not Method), name

