"""The lever `batched_eval` (`training.levers`, issue 36): every client's personalized model scored
in one vmapped pass (engine/evaluation.py, `personal_scores_batched`) gives the per-client path's
scores, takes the batched path, and falls back to the per-client path where the model's eval
forward cannot be vmapped.

Tolerance: the vmapped forward computes the same logits as the per-client forward up to float32
summation order (batched matrix products; vmapped convolutions are grouped convolutions), so a
prediction can differ only where two logits tie to ~1e-6: each client's accuracy on each split
within one of its samples (1/n), at every evaluated round.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedrepro.engine import evaluation
from fedrepro.engine.data import load_clients
from fedrepro.engine.engine import Engine
from fedrepro.methods import METHODS
from fedrepro.models import MODELS, build_model

from conftest import TINY_MODELS, fit_cell_to_method
from test_engine import engine_for
from test_throughput import conv_partition  # noqa: F401  (fixture)

PERSONAL = [name for name in METHODS.names() if METHODS.get(name).has_personal]
LEVER = {"levers": ["batched_eval"]}

#: A small instance of every registered model and a sample shape it takes.
MODEL_CASES = {
    "fedavg_cnn": ((1, 16, 16), {"hidden": 16}),
    "cnn4": ((1, 16, 16), {"channels": 8}),
    "resnet18_cifar": ((3, 8, 8), None),
    "mlp": ((1, 8, 8), {"hidden": [32]}),
    "resnet1d": ((1, 64), {"width": 8}),
    "resnet32_cifar": ((3, 8, 8), None),
    "prompted_vit": ((1, 8, 8), TINY_MODELS["prompted_vit"]["params"]),
}


def recorded(monkeypatch, engine: Engine) -> list[dict]:
    """`engine` run to the end; the record of each of its evaluations."""
    records = []
    evaluate = evaluation.evaluate

    def keep(*args, **kw):
        records.append(evaluate(*args, **kw))
        return records[-1]

    monkeypatch.setattr(evaluation, "evaluate", keep)
    engine.run()
    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    return records


def assert_same_personal_scores(engine: Engine, per_client: list[dict], batched: list[dict]) -> None:
    """Every evaluated round: the same clients scored the same way, and each client's personal
    accuracy on each split within one of its samples (docstring above)."""
    assert [r["round"] for r in per_client] == [r["round"] for r in batched]
    for a, b in zip(per_client, batched):
        assert a["scored_by"] == b["scored_by"]
        for split in ("test", "val"):
            if f"{split}/personal" not in a:
                continue
            sizes = [len(getattr(c, split)) for c in engine.clients]
            for n, x, y in zip(sizes, a[f"{split}/personal"]["acc"], b[f"{split}/personal"]["acc"]):
                assert (math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1 / n + 1e-12, (split, a["round"], x, y, n)


def run_pair(monkeypatch, make_cell, shards, name: str, rule: str = "personalize", **training) -> tuple[Engine, list, list]:
    """Method `name` on the tiny digits cell for 2 rounds, one client trained per round (the others
    scored by the untrained rule `rule`), without and with the lever: its evaluation records."""
    records = []
    for levers in ({}, LEVER):
        cell = make_cell("fedavg", participation=1, rounds=2, **training, **levers)
        cell.update(method=name, label=name, hparams={k: p.default for k, p in METHODS.get(name).hparams.items()},
                    evaluation={"untrained": rule})
        engine = engine_for(fit_cell_to_method(cell, name), shards)
        records.append(recorded(monkeypatch, engine))
    return engine, *records


@pytest.mark.parametrize("name", PERSONAL)
def test_batched_eval_scores_every_personal_method_as_the_per_client_path(tiny_partition, make_cell, monkeypatch, name):
    """Every method with personalized models: trained clients and new-client personalization
    (rule 'personalize') score alike with and without the lever, and training is unchanged
    (the personalized models draw the same seeded streams in the same order)."""
    engine, per_client, batched = run_pair(monkeypatch, make_cell, tiny_partition[0], name)
    assert {"trained", "personalize"} <= set(batched[-1]["scored_by"])
    assert [r["train_loss"] for r in per_client] == [r["train_loss"] for r in batched]
    assert_same_personal_scores(engine, per_client, batched)


@pytest.mark.parametrize("name", ["fedper", "ditto"])
def test_batched_eval_leaves_excluded_clients_unscored(tiny_partition, make_cell, monkeypatch, name):
    engine, per_client, batched = run_pair(monkeypatch, make_cell, tiny_partition[0], name, rule="exclude")
    excluded = [i for i, how in enumerate(batched[-1]["scored_by"]) if how == "excluded"]
    assert excluded and all(math.isnan(batched[-1]["test/personal"]["acc"][i]) for i in excluded)
    assert_same_personal_scores(engine, per_client, batched)


def test_batched_eval_takes_the_batched_path(tiny_partition, make_cell, monkeypatch):
    """With the lever the personalized models are scored by vmapped forwards, and `predict` runs
    for the global model only (one pooled call per split); without it, once per client and split."""
    calls = {"predict": 0, "vmapped": 0}
    predict, vmapped = evaluation.predict, evaluation.vmapped_predictions

    def count(key, f):
        def counted(*args, **kw):
            calls[key] += 1
            return f(*args, **kw)
        return counted

    monkeypatch.setattr(evaluation, "predict", count("predict", predict))
    monkeypatch.setattr(evaluation, "vmapped_predictions", count("vmapped", vmapped))
    seen = {}
    for levers in ({}, LEVER):
        calls.update(predict=0, vmapped=0)
        cell = make_cell("fedavg", rounds=2, **levers)
        cell.update(method="fedper", label="fedper", hparams={k: p.default for k, p in METHODS.get("fedper").hparams.items()})
        engine_for(cell, tiny_partition[0]).run()
        seen[bool(levers)] = dict(calls)
    splits, rounds, clients = 2, 2, 4  # test and val
    assert seen[False] == {"predict": rounds * splits * (1 + clients), "vmapped": 0}
    assert seen[True]["predict"] == rounds * splits and seen[True]["vmapped"] == rounds * splits + 1  # + the probe


def test_batched_eval_chunks_samples_and_clients(tiny_partition, make_cell, monkeypatch):
    """Chunks of 16 samples and 2 clients per vmapped forward (the digits' 64 pixels): the
    clients whose samples are over drop out of the later chunks, and the scores stay the same."""
    monkeypatch.setattr(evaluation, "BATCHED_ELEMENTS", 16 * 64 * 2)
    shapes = []
    vmapped = evaluation.vmapped_predictions

    def spy(model, stacked, x):
        shapes.append(tuple(x.shape[:2]))
        return vmapped(model, stacked, x)

    monkeypatch.setattr(evaluation, "vmapped_predictions", spy)
    engine, per_client, batched = run_pair(monkeypatch, make_cell, tiny_partition[0], "fedper", eval_batch_size=16)
    assert max(k for k, _ in shapes) == 2 and max(n for _, n in shapes) == 16
    assert {k for k, _ in shapes} == {1, 2}  # a last client alone once the others' samples are over
    assert_same_personal_scores(engine, per_client, batched)


def conv_method_engine(conv_partition, name: str, model: dict | None = None, device: str = "cpu", **training) -> Engine:
    """Method `name` on the tiny random-image partition of test_throughput (fedavg_cnn, or `model`),
    2 rounds, on `device`."""
    base, manifest, shards = conv_partition
    cell = {**base, "method": name, "label": name, "hparams": {k: p.default for k, p in METHODS.get(name).hparams.items()},
            "model": model or base["model"], "training": {**base["training"], "rounds": 2, **training}}
    dev = torch.device(device)
    return Engine(cell, manifest, load_clients(manifest, shards, dev), dev, progress=False)


@pytest.mark.parametrize("name", ["fedper", "ditto"])
def test_batched_eval_of_a_conv_model_equals_the_per_client_path(conv_partition, monkeypatch, name):
    """fedavg_cnn: the vmapped convolutions are grouped convolutions (channels-last weights on the
    CPU against the stacked contiguous ones)."""
    per_client = recorded(monkeypatch, conv_method_engine(conv_partition, name))
    engine = conv_method_engine(conv_partition, name, **LEVER)
    batched = recorded(monkeypatch, engine)
    assert engine.scoring.blocker_checked and engine.scoring.blocker is None
    assert_same_personal_scores(engine, per_client, batched)


def test_batched_eval_falls_back_where_the_model_cannot_be_vmapped(conv_partition, monkeypatch, capsys):
    """cnn4's BatchNorm normalises by each chunk's statistics (no running ones), which padding would
    change: the per-client path runs, said once on stderr, with its own scores exactly."""
    cnn4 = {"name": "cnn4", "params": {"channels": 8}}
    per_client = recorded(monkeypatch, conv_method_engine(conv_partition, "fedper", cnn4))
    monkeypatch.setattr(evaluation, "vmapped_predictions", None)  # never called on the fallback
    batched = recorded(monkeypatch, conv_method_engine(conv_partition, "fedper", cnn4, **LEVER))
    assert capsys.readouterr().err.count("batched_eval: BatchNorm without running statistics") == 1
    assert [r["test/personal"] for r in per_client] == [r["test/personal"] for r in batched]


def test_every_model_has_a_case():
    assert set(MODEL_CASES) == set(MODELS.names())


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_every_model_scores_stacked_clients_in_one_vmapped_eval_forward(name):
    """Each registered model's eval forward vmapped over three clients' parameters (perturbed
    copies, BatchNorm statistics included) gives each client's own predictions; cnn4 is the one
    model it refuses (`batched_blocker`)."""
    shape, params = MODEL_CASES[name]
    torch.manual_seed(0)
    model = build_model(name, shape, 5, params).eval()
    x = torch.randn(3, 12, *shape)
    blocker = evaluation.batched_blocker(model, x[0, :1])
    if name == "cnn4":
        assert blocker is not None and "BatchNorm without running statistics" in blocker
        return
    assert blocker is None
    state = model.state_dict()
    clients = [{n: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v for n, v in state.items()
                if not n.startswith(model.frozen_prefixes)} for _ in range(3)]
    clients = [{n: v.abs() if "running_var" in n else v for n, v in c.items()} for c in clients]
    got = evaluation.vmapped_predictions(model, {n: torch.stack([c[n] for c in clients]) for n in clients[0]}, x)
    with torch.no_grad():
        for i, c in enumerate(clients):
            evaluation.load_for_eval(model, c)
            assert torch.equal(got[i], model(x[i]).argmax(1)), i


def test_the_benchmark_script_runs_its_quick_mode(tmp_path):
    """benchmarks/batched_eval.py on digits (no download): a row per method and lever, the lever's
    personal accuracies equal to the per-client ones."""
    from conftest import load_script

    rows = load_script("benchmarks/batched_eval.py").main(
        ["--dataset", "digits", "--repeats", "1", "--clients", "4", "--work", str(tmp_path)])
    assert [(r["method"], r["levers"]) for r in rows] == [
        ("fedper", "-"), ("fedper", "batched_eval"), ("ditto", "-"), ("ditto", "batched_eval")]
    assert all(r["max_acc_diff"] == 0 and r["speedup"] > 0 for r in rows[1::2])
