"""The throughput paths (engine/vectorized.py): vectorized multi-client local updates and
the compiled training step equal the sequential, eager path; fallbacks where they cannot."""

from __future__ import annotations

import pytest
import torch
import yaml

from fedrepro.engine import loop
from fedrepro.engine.vectorized import vectorize_blocker
from fedrepro.methods import METHODS

from conftest import REPO, method_engine

VECTORIZED = ["fedavg", "fedprox", "fedper", "fedrep", "fedbabu", "ditto", "lg_fedavg", "fedavg_ft", "fedprox_ft"]
# Small hparams keep the per-method runs short; FedRep runs both of its phases.
HPARAMS = {"fedrep": {"head_epochs": 1}, "fedbabu": {"finetune_epochs": 1}, "fedavg_ft": {"ft_epochs": 1},
           "fedprox_ft": {"ft_epochs": 1}}


def run_rounds(engine, rounds: int) -> list[list]:
    """The engine's rounds without evaluation: per round the uploads."""
    engine.method.setup()
    out = []
    for r in range(1, rounds + 1):
        engine.round = r
        updates, _, _ = loop.train_round(engine, r)
        engine.method.aggregate(updates)
        out.append(updates)
    return out


def assert_close_params(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("name", VECTORIZED)
def test_vectorized_local_updates_equal_the_sequential_ones(tiny_partition, make_cell, name):
    """Two rounds (clients with different sizes: padded steps and short last batches): the
    uploads, the losses, the server model and every client's kept state agree."""
    hp = HPARAMS.get(name)
    seq = method_engine(tiny_partition, make_cell, name, hp, rounds=2)
    vec = method_engine(tiny_partition, make_cell, name, hp, rounds=2, vectorize=True)
    assert not seq.vectorized and vec.vectorized
    sizes = {c.num_train for c in vec.clients}
    assert len(sizes) > 1  # the padding is exercised
    seq_up, vec_up = run_rounds(seq, 2), run_rounds(vec, 2)
    for r_seq, r_vec in zip(seq_up, vec_up):
        for u, v in zip(r_seq, r_vec):
            assert u.client_id == v.client_id and u.num_samples == v.num_samples
            assert v.loss == pytest.approx(u.loss, rel=1e-5)
            assert_close_params(u.params, v.params)
    assert_close_params(seq.method.server["global"], vec.method.server["global"])
    for cs, cv in zip(seq.clients, vec.clients):
        assert cs.state.keys() == cv.state.keys()
        for key in cs.state:
            assert_close_params(cs.state[key], cv.state[key])
    # Training moved the model: the comparison is not between two untouched initialisations.
    assert any(not torch.equal(v, vec.initial_params[k]) for k, v in vec.method.server["global"].items())


@pytest.mark.parametrize("optimizer", [{"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
                                       {"name": "adam", "lr": 0.01}])
def test_vectorized_fit_matches_with_stateful_optimizers(tiny_partition, make_cell, optimizer):
    """Momentum, weight decay and Adam's step count: each client's update is its own
    optimizer's, even though the clients run different numbers of steps."""
    seq = method_engine(tiny_partition, make_cell, "fedavg", optimizer=optimizer, local_epochs=2)
    vec = method_engine(tiny_partition, make_cell, "fedavg", optimizer=optimizer, local_epochs=2, vectorize=True)
    for u, v in zip(run_rounds(seq, 1)[0], run_rounds(vec, 1)[0]):
        assert_close_params(u.params, v.params, tol=1e-4)


def test_vectorized_run_gives_the_sequential_metrics(tiny_partition, make_cell):
    """Through Engine.run (evaluation, bookkeeping): the same accuracies and losses."""
    seq = method_engine(tiny_partition, make_cell, "ditto", rounds=2).run()
    vec = method_engine(tiny_partition, make_cell, "ditto", rounds=2, vectorize=True).run()
    assert vec["train_loss_per_round"] == pytest.approx(seq["train_loss_per_round"], rel=1e-5)
    assert vec["final"] == seq["final"]  # predictions agree: identical per-client accuracies
    assert vec["communication"] == seq["communication"]


def test_vectorized_run_is_deterministic(tiny_partition, make_cell):
    a = method_engine(tiny_partition, make_cell, "fedper", rounds=2, vectorize=True).run()
    b = method_engine(tiny_partition, make_cell, "fedper", rounds=2, vectorize=True).run()
    assert a["train_loss_per_round"] == b["train_loss_per_round"] and a["final"] == b["final"]


def test_vectorized_opt_in_is_per_class(tiny_partition, make_cell, capfd):
    """A method that changes the local update (SCAFFOLD's corrections, MOON's contrastive
    loss) does not inherit FedAvg's opt-in: it runs sequentially and says so."""
    for name in ("scaffold", "moon"):
        assert not METHODS.get(name).__dict__.get("vectorized", False)
        engine = method_engine(tiny_partition, make_cell, name, vectorize=True)
        assert not engine.vectorized
    assert "has no vectorized local update" in capfd.readouterr().err
    assert all(METHODS.get(name).__dict__.get("vectorized") for name in VECTORIZED)


def test_vectorize_blockers():
    assert vectorize_blocker(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
    assert "dropout" in vectorize_blocker(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)))
    assert "BatchNorm" in vectorize_blocker(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    assert vectorize_blocker(torch.nn.Sequential(torch.nn.BatchNorm1d(2, track_running_stats=False))) is None
    assert "loss_fn" in vectorize_blocker(torch.nn.Linear(2, 2), loss_fn=lambda b: b)


def test_compiled_step_equals_eager(tiny_partition, make_cell):
    """training.compile (backend aot_eager here: the same capture, functionalization and
    compiled backward as inductor, without a C++ build in CI) gives the eager step's result,
    and it is the compiled module that ran."""
    eager = method_engine(tiny_partition, make_cell, "fedavg")
    comp = method_engine(tiny_partition, make_cell, "fedavg", compile="aot_eager")
    u_e, u_c = run_rounds(eager, 1)[0], run_rounds(comp, 1)[0]
    assert comp.compiled.module is not None and eager.compiled.module is None
    for u, v in zip(u_e, u_c):
        assert v.loss == pytest.approx(u.loss, rel=1e-5)
        assert_close_params(u.params, v.params)


def test_compiled_step_equals_eager_for_partly_frozen_fits(tiny_partition, make_cell):
    """FedRep's phases (head, then extractor, each with the rest frozen) compile too where no
    CUDA graphs replay the step: 2 rounds of uploads equal the eager ones."""
    eager = method_engine(tiny_partition, make_cell, "fedrep")
    comp = method_engine(tiny_partition, make_cell, "fedrep", compile="aot_eager")
    for r_e, r_c in zip(run_rounds(eager, 2), run_rounds(comp, 2)):
        for u, v in zip(r_e, r_c):
            assert v.loss == pytest.approx(u.loss, rel=1e-5)
            assert_close_params(u.params, v.params)
    assert comp.compiled.module is not None


def test_cuda_graph_replays_skip_partly_frozen_fits(tiny_partition, make_cell, monkeypatch):
    """Where the step would replay as CUDA graphs, a partly frozen fit runs the eager model
    (on an H100 FedRep's replayed phases gave other uploads, docs/gpu.md); fully trainable
    fits keep the compiled step."""
    import fedrepro.engine.training as training_module  # where `fit` lives

    monkeypatch.setattr(training_module, "replays_cuda_graphs", lambda setting, device: True)
    fedrep = method_engine(tiny_partition, make_cell, "fedrep", compile="aot_eager")
    run_rounds(fedrep, 1)
    assert fedrep.compiled.module is None
    fedavg = method_engine(tiny_partition, make_cell, "fedavg", compile="aot_eager")
    run_rounds(fedavg, 1)
    assert fedavg.compiled.module is not None


def test_compiled_step_falls_back_for_a_custom_loss(tiny_partition, make_cell):
    """MOON's contrastive loss reads the features: its fits run the eager model."""
    engine = method_engine(tiny_partition, make_cell, "moon", compile="aot_eager")
    run_rounds(engine, 1)
    assert engine.compiled.module is None


def test_slurm_packed_profile_groups_training_cells_onto_one_gpu(tmp_path):
    """slurm-packed: the training cells become group jobs (one submission each), and each cell
    asks for no GPU of its own while the group asks for one via the (unsummed) gres string."""
    from test_workflow import TEST_CONFIG, snakemake

    profile = REPO / "workflow" / "profiles" / "slurm-packed"
    cfg = yaml.safe_load((profile / "config.yaml").read_text())
    assert cfg["groups"] == ["train=train_pack"] and cfg["group-components"][0].startswith("train_pack=")
    assert cfg["set-resources"]["train"]["gpu"] == 0 and cfg["set-resources"]["train"]["gres"] == "gpu:1"
    proc = snakemake("-n", "--configfile", str(TEST_CONFIG), "--workflow-profile", str(profile), cwd=tmp_path)
    text = proc.stdout + proc.stderr
    cells = [line for line in text.splitlines() if ": training cell " in line]
    assert len(cells) == 12 and all(line.startswith("    ") for line in cells)  # each listed inside a group job
    assert 2 <= text.count("Group job train_pack") < 12  # fewer submissions than cells


def test_local_profile_limits_training_jobs_by_gpu_slots():
    cfg = yaml.safe_load((REPO / "workflow" / "profiles" / "local" / "config.yaml").read_text())
    assert cfg["resources"] == "?local_plan.resources()"  # sized from the machine: tests/test_local_plan.py
    rule = (REPO / "workflow" / "rules" / "train.smk").read_text()
    assert "gpu_slots=1" in rule
    tuning = (REPO / "workflow" / "rules" / "tuning.smk").read_text()
    assert tuning.count("gpu_slots=1") == 2  # tuning trials and tuned cells train on the GPU too


@pytest.fixture(scope="module")
def conv_partition(tmp_path_factory):
    """A tiny image partition (3 clients, 1x16x16 random images) for the conv model fedavg_cnn."""
    import dataclasses

    import numpy as np

    from fedrepro.config import resolve_experiment
    from fedrepro.data.shards import load_partition, write_partition

    from conftest import random_images

    raw = random_images(240)
    g = np.random.default_rng(0)
    raw = dataclasses.replace(raw, x=g.integers(0, 256, (240, 1, 16, 16), dtype=np.uint8))
    exp = resolve_experiment({
        "experiment": "conv", "datasets": {"fmnist": {"model": {"name": "fedavg_cnn", "params": {"hidden": 16}}}},
        "partitions": {"iid": {"partitioner": "iid", "num_clients": 3, "seed": 0}},
        "methods": {"fedavg": {}}, "seeds": [0], "training": {"rounds": 1, "batch_size": 16}})
    out = tmp_path_factory.mktemp("conv") / exp["partitions"][0]["id"]
    write_partition(raw, exp["partitions"][0]["spec"], out)
    return exp["cells"][0], *load_partition(out)


def test_channels_last_keeps_the_values_and_trains_alike(conv_partition):
    from fedrepro.engine.data import load_clients
    from fedrepro.engine.engine import Engine

    base, manifest, shards = conv_partition
    engines = {}
    for layout in (False, True):
        cell = {**base, "training": {**base["training"], "channels_last": layout}}
        engines[layout] = Engine(cell, manifest, load_clients(manifest, shards, torch.device("cpu")), torch.device("cpu"),
                                 progress=False)
    conv = engines[True].model.extractor[3].weight  # 32 input channels (with 1 the layouts coincide)
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert engines[True].initial_params.keys() == engines[False].initial_params.keys()
    for k, v in engines[False].initial_params.items():
        assert torch.equal(v, engines[True].initial_params[k])  # the same seeded initialisation
    default, nhwc = run_rounds(engines[False], 1)[0], run_rounds(engines[True], 1)[0]
    for u, v in zip(default, nhwc):
        assert v.loss == pytest.approx(u.loss, rel=1e-5)
        assert_close_params(u.params, v.params)
    assert any(not torch.equal(v, engines[True].initial_params[k]) for k, v in engines[True].method.server["global"].items())


def test_channels_last_auto_is_the_default_and_means_the_cpu_only(conv_partition):
    """The default `training.channels_last: auto` puts conv weights in NHWC on the CPU (oneDNN's
    faster kernels) and keeps the default layout on a GPU; `false` keeps it everywhere."""
    from fedrepro.config import TRAINING_DEFAULTS
    from fedrepro.engine.data import load_clients
    from fedrepro.engine.engine import Engine, channels_last

    base, manifest, shards = conv_partition
    assert TRAINING_DEFAULTS["channels_last"] == "auto" and base["training"]["channels_last"] == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert channels_last("auto", cpu) and not channels_last("auto", cuda)
    assert channels_last(True, cuda) and not channels_last(False, cpu)
    for setting, nhwc in (("auto", True), (False, False)):
        cell = {**base, "training": {**base["training"], "channels_last": setting}}
        engine = Engine(cell, manifest, load_clients(manifest, shards, cpu), cpu, progress=False)
        conv = engine.model.extractor[3].weight
        assert conv.is_contiguous(memory_format=torch.channels_last) == nhwc and conv.is_contiguous() != nhwc


def test_deterministic_cells_take_the_math_attention_kernel():
    """set_determinism: memory-efficient attention (nondeterministic backward on CUDA under
    warn_only) is off for deterministic cells and back on for the others."""
    from fedrepro.engine.run import set_determinism

    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    try:
        assert set_determinism(True)["mem_efficient_attention"] is False
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
        set_determinism(False)
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.backends.cuda.enable_mem_efficient_sdp(before[1])
