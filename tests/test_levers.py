"""Issue 36's launch-limit levers inside a vectorized round (`training.levers`, engine/vectorized.py):
each gives the sequential path's uploads and metrics (within test_throughput.py's tolerances), and
each really takes its own path. The CUDA capture itself is checked by tests/test_cuda.py on a GPU."""

from __future__ import annotations

import pytest
import torch

from fedrepro.config import ConfigError, load_config, resolve_experiment
from fedrepro.engine import loop, training, vectorized

from conftest import REPO, method_engine
from test_throughput import HPARAMS, VECTORIZED, assert_close_params, run_rounds

TRAINING_LEVERS = ["resident_batches", "fused_step", "cuda_graph", "device_losses"]


def lever_engine(tiny_partition, make_cell, name, levers, **training_options):
    return method_engine(tiny_partition, make_cell, name, HPARAMS.get(name), rounds=2, vectorize=True,
                         levers=list(levers), **training_options)


def assert_same_rounds(expected, got, exact: bool) -> None:
    for r_exp, r_got in zip(expected, got):
        for u, v in zip(r_exp, r_got):
            assert u.client_id == v.client_id and u.num_samples == v.num_samples
            assert isinstance(v.loss, float)  # settled by the loop before the divergence check
            if exact:
                assert v.loss == u.loss
                for k in u.params:
                    assert torch.equal(u.params[k], v.params[k]), k
            else:
                assert v.loss == pytest.approx(u.loss, rel=1e-5)
                assert_close_params(u.params, v.params)


@pytest.mark.parametrize("name", VECTORIZED)
def test_every_lever_together_equals_the_sequential_path(tiny_partition, make_cell, name):
    """All four training levers at once, two rounds of clients of different sizes: the uploads,
    losses, server model and kept client state of the sequential path."""
    seq = method_engine(tiny_partition, make_cell, name, HPARAMS.get(name), rounds=2)
    fast = lever_engine(tiny_partition, make_cell, name, TRAINING_LEVERS)
    assert fast.vectorized
    assert_same_rounds(run_rounds(seq, 2), run_rounds(fast, 2), exact=False)
    assert_close_params(seq.method.server["global"], fast.method.server["global"])
    for cs, cf in zip(seq.clients, fast.clients):
        for key in cs.state:
            assert_close_params(cs.state[key], cf.state[key])


@pytest.mark.parametrize("levers", [["resident_batches"], ["device_losses"], ["resident_batches", "device_losses"]])
@pytest.mark.parametrize("name", ["fedavg", "ditto"])
def test_gathers_and_device_losses_are_bit_for_bit_the_vectorized_path(tiny_partition, make_cell, name, levers):
    """The resident gather reads the very samples the staged copy reads, and the losses divided on
    the device in float64 round as the host's division: no tolerance needed (Ditto: its hook too)."""
    vec = method_engine(tiny_partition, make_cell, name, rounds=2, vectorize=True)
    fast = lever_engine(tiny_partition, make_cell, name, levers)
    assert_same_rounds(run_rounds(vec, 2), run_rounds(fast, 2), exact=True)


@pytest.mark.parametrize("levers", [[], ["fused_step"], ["resident_batches", "cuda_graph"]])
@pytest.mark.parametrize("optimizer", [{"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
                                       {"name": "adam", "lr": 0.01}])
def test_masked_read_off_with_stateful_optimizers(tiny_partition, make_cell, optimizer, levers):
    """Momentum and weight decay keep moving a finished client's stacked slice; the masked read-off
    takes it at the client's own last step, on every path (2 epochs: clients end apart)."""
    seq = method_engine(tiny_partition, make_cell, "fedavg", optimizer=optimizer, local_epochs=2)
    fast = method_engine(tiny_partition, make_cell, "fedavg", optimizer=optimizer, local_epochs=2, vectorize=True,
                         levers=levers)
    steps = {c.num_train for c in fast.clients}
    assert len(steps) > 1
    for u, v in zip(run_rounds(seq, 1)[0], run_rounds(fast, 1)[0]):
        assert v.loss == pytest.approx(u.loss, rel=1e-5)
        assert_close_params(u.params, v.params, tol=1e-4)


def test_each_lever_takes_its_own_path(tiny_partition, make_cell, monkeypatch):
    """Which code ran: the resident gather (no staged copy), the fused optimizer, the static-buffer
    body of the CUDA-graph lever, device tensors as the fits' losses; none of it without the levers."""
    seen: dict[str, list] = {"plan": [], "fused": [], "replayed": [], "loss": []}
    fit_many, optimizer, replayed = vectorized.fit_many, training.optimizer, vectorized._replayed_steps

    def spy_fit_many(model, device, clients, starts, plan, *a, **kw):
        seen["plan"].append(type(plan).__name__)
        out = fit_many(model, device, clients, starts, plan, *a, **kw)
        seen["loss"].extend(type(f.loss).__name__ for f in out)
        return out

    def spy_optimizer(engine, params, lr=None, levers=frozenset()):
        opt = optimizer(engine, params, lr, levers)
        seen["fused"].append(bool(opt.defaults.get("fused")))
        return opt

    monkeypatch.setattr(vectorized, "fit_many", spy_fit_many)
    monkeypatch.setattr(training, "optimizer", spy_optimizer)
    monkeypatch.setattr(vectorized, "_replayed_steps", lambda *a: (seen["replayed"].append(True), replayed(*a)))
    run_rounds(lever_engine(tiny_partition, make_cell, "fedavg", TRAINING_LEVERS), 1)
    assert seen == {"plan": ["ResidentBatches"], "fused": [True], "replayed": [True], "loss": ["Tensor"] * len(seen["loss"])}
    assert seen["loss"]
    seen.update(plan=[], fused=[], replayed=[], loss=[])
    run_rounds(method_engine(tiny_partition, make_cell, "fedavg", vectorize=True), 1)
    assert seen["plan"] == ["StagedBatches"] and seen["fused"] == [False] and not seen["replayed"]
    assert set(seen["loss"]) == {"float"}


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of a tensor's value by the host (each one a synchronisation on a GPU)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_device_losses_leave_one_host_read_per_round(tiny_partition, make_cell, monkeypatch):
    """With every training lever, the local updates of a round read nothing back from the device (the
    loop reads the round's losses at once, after them); without, each fit reads its losses."""
    counts = {}
    settled = loop._settled

    def counting_local_updates(engine, key):
        method = engine.method
        original = method.local_updates

        def counted(clients, payloads):
            with HostReads() as mode:
                out = original(clients, payloads)
            counts[key] = mode.count
            return out

        monkeypatch.setattr(method, "local_updates", counted)
        return engine

    run_rounds(counting_local_updates(lever_engine(tiny_partition, make_cell, "ditto", TRAINING_LEVERS), "levers"), 1)
    run_rounds(counting_local_updates(method_engine(tiny_partition, make_cell, "ditto", vectorize=True), "plain"), 1)
    assert counts["levers"] == 0 and counts["plain"] > 0
    assert settled is loop._settled


def test_levers_reproduce_their_metrics_exactly(tiny_partition, make_cell):
    """A cell with the levers is as deterministic as any other: two runs, equal metrics."""
    a = lever_engine(tiny_partition, make_cell, "fedper", TRAINING_LEVERS).run()
    b = lever_engine(tiny_partition, make_cell, "fedper", TRAINING_LEVERS).run()
    assert a["train_loss_per_round"] == b["train_loss_per_round"] and a["final"] == b["final"]


@pytest.mark.parametrize("levers, training_block, message", [
    (["resident_batches"], {}, "only with 'training.vectorize: true'"),
    (["cuda_graph", "fused_step"], {"vectorize": True}, "cuda_graph together with resident_batches"),
    (["fused_step"], {"vectorize": True, "optimizer": {"name": "lars", "lr": 0.1}}, "'lars', which has no fused step"),
    (["warp_speed"], {"vectorize": True}, "'warp_speed'.*batched_eval"),
    (["resident_batches"], {"vectorize": True, "augment": "crop_flip"}, "resident_batches only with 'training.augment: none'"),
])
def test_levers_where_they_cannot_act_are_config_errors(levers, training_block, message):
    """Before any job runs: the key, the value and what is allowed."""
    config = load_config(REPO / "config" / "test.yaml")
    config["training"].update(training_block, levers=levers)
    with pytest.raises(ConfigError, match=message) as err:
        resolve_experiment(config)
    assert "training.levers" in str(err.value)


def test_batched_eval_needs_no_vectorized_round():
    config = load_config(REPO / "config" / "test.yaml")
    config["training"]["levers"] = ["batched_eval"]
    assert all(c["training"]["levers"] == ["batched_eval"] for c in resolve_experiment(config)["cells"])
