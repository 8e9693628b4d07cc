"""CUDA: every method, determinism and resume, CPU agreement, and the vectorized and compiled
paths on a GPU (issue 29).

Tests marked `cuda` are collected everywhere and skipped without a GPU (conftest.py);
benchmarks/gpu_check.sh runs them on a device machine. The device-agnostic check
(determinism and resume) is parametrized over "cpu" and "cuda", so CI runs its code on the
CPU. Tolerances and why: docs/gpu.md.
"""

from __future__ import annotations

import json
import math
import os
import warnings

# Deterministic cuBLAS needs its workspace setting before CUDA initialises (set_determinism sets
# it too, but a test running earlier in this process may have initialised CUDA already).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fedrepro.data.shards import load_partition  # noqa: E402
from fedrepro.engine.data import load_clients  # noqa: E402
from fedrepro.engine.engine import Engine  # noqa: E402
from fedrepro.engine.run import set_determinism, train_cell  # noqa: E402
from fedrepro.methods import METHODS  # noqa: E402

from conftest import fit_cell_to_method, kill_in_round_3_and_resume, method_engine  # noqa: E402
from test_engine import strip_timing  # noqa: E402
from test_throughput import HPARAMS, VECTORIZED, assert_close_params, conv_partition, run_rounds  # noqa: E402,F401
from test_batched_eval import assert_same_personal_scores, conv_method_engine, recorded  # noqa: E402

cuda = pytest.mark.cuda
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
#: CUDA against another path or the CPU: float32 results that differ only in the order of
#: summation (cuBLAS/cuDNN kernels against MKL/oneDNN, batched against single GEMMs, fused
#: inductor kernels) after some tens of SGD steps: parameters within 1e-4 (the CPU-only
#: equality tests use 1e-5). docs/gpu.md.
TOL = 1e-4


def nondeterminism_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "deterministic" in str(w.message)]


def conv_engine(conv_partition, device: str, **training) -> Engine:
    """fedavg with fedavg_cnn on the tiny random-image partition of test_throughput, on `device`."""
    base, manifest, shards = conv_partition
    cell = {**base, "training": {**base["training"], "rounds": 2, **training}}
    dev = torch.device(device)
    return Engine(cell, manifest, load_clients(manifest, shards, dev), dev, progress=False)


@cuda
@pytest.mark.parametrize("label", METHODS.names())
def test_every_method_trains_two_rounds_on_cuda(tiny_partition, make_cell, tmp_path, label):
    """Every registered method (the SSL family through kornia and lightly too) trains 2 rounds on
    the GPU with finite losses and accuracies in [0, 1], and says it ran there."""
    cell = make_cell("fedavg")
    method = METHODS.get(label)
    cell.update(method=label, label=label, hparams={k: p.default for k, p in method.hparams.items()})
    fit_cell_to_method(cell, label)
    m = train_cell(cell, tiny_partition[0], tmp_path, device="cuda", progress=False)
    assert m["status"] == "ok" and m["rounds"] == 2, m.get("failure")
    assert m["resources"]["device"] == "cuda" and m["resources"]["peak_gpu_mb"] > 0
    assert all(math.isfinite(v) for v in m["train_loss_per_round"])
    for kind in ("global", "personal"):
        if getattr(method, f"has_{kind}"):
            acc = np.array(m["final"][kind]["acc"], dtype=float)
            assert len(acc) == len(m["clients"]["ids"]) and np.isfinite(acc).all()
            assert ((acc >= 0) & (acc <= 1)).all()
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["device"]["type"] == "cuda" and prov["determinism"]["use_deterministic_algorithms"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("label, training", [("fedavg_ft", {}), ("scaffold", {}), ("fedavg", {"vectorize": True})],
                         ids=["fedavg_ft", "scaffold", "fedavg-vectorized"])
def test_cell_is_deterministic_and_a_killed_run_resumes_to_it(tiny_partition, make_cell, tmp_path, monkeypatch,
                                                               device, label, training):
    """With deterministic algorithms on (the cell default; CUBLAS_WORKSPACE_CONFIG=:4096:8), a
    cell run twice gives identical metrics, no operator warns that it is nondeterministic, and a
    run killed in round 3 and resumed from its checkpoint after round 2 (server and client state,
    SCAFFOLD's control variates included, loaded onto the device) ends with the same metrics."""
    cell = make_cell("fedavg", rounds=3, checkpoint_every=1, eval_every=1, **training)
    method = METHODS.get(label)
    cell.update(method=label, label=label, hparams={k: p.default for k, p in method.hparams.items()})
    shards = tiny_partition[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [train_cell(cell, shards, tmp_path / f"run{i}", device=device, progress=False) for i in range(2)]
    assert not nondeterminism_warnings(caught), nondeterminism_warnings(caught)
    assert runs[0]["resources"]["device"] == device and runs[0]["status"] == "ok"
    assert strip_timing(runs[0]) == strip_timing(runs[1])
    ckpt = tmp_path / "ckpt.pt"
    run = lambda: train_cell(cell, shards, tmp_path / "resumed", checkpoint=ckpt, device=device, progress=False)
    resumed = kill_in_round_3_and_resume(monkeypatch, label, run, ckpt, tmp_path / "resumed")
    assert strip_timing(resumed) == strip_timing(runs[0])


@cuda
def test_attention_cell_is_deterministic_on_cuda(tiny_partition, make_cell, tmp_path):
    """FedGCR's prompted ViT: attention's backward warned that it was nondeterministic on an H100
    (memory-efficient kernel, 2026-11-26); deterministic cells take the math kernel
    (set_determinism), so two runs are identical and nothing warns."""
    cell = make_cell("fedavg")
    method = METHODS.get("fedgcr")
    cell.update(method="fedgcr", label="fedgcr", hparams={k: p.default for k, p in method.hparams.items()})
    fit_cell_to_method(cell, "fedgcr")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [train_cell(cell, tiny_partition[0], tmp_path / f"run{i}", device="cuda", progress=False) for i in range(2)]
    assert not nondeterminism_warnings(caught), nondeterminism_warnings(caught)
    assert runs[0]["status"] == "ok" and strip_timing(runs[0]) == strip_timing(runs[1])


@cuda
def test_cuda_agrees_with_the_cpu(tiny_partition, make_cell):
    """fedavg, MLP on digits, 2 rounds: the same seeded initialisation and batches on both
    devices (the batch order is drawn on the CPU), so only float32 summation order differs:
    losses within 1e-4 relative, the global model within TOL, and the final global accuracy
    (about 450 test samples; one flipped prediction = 0.22 pp) within 0.5 pp."""
    set_determinism(True)  # TF32 off: cuBLAS computes in full float32, as the CPU does
    engines = {d: method_engine(tiny_partition, make_cell, "fedavg", device=d, rounds=2) for d in ("cpu", "cuda")}
    runs = {d: e.run() for d, e in engines.items()}
    assert runs["cuda"]["train_loss_per_round"] == pytest.approx(runs["cpu"]["train_loss_per_round"], rel=TOL)
    cpu_params = engines["cpu"].method.server["global"]
    cuda_params = {k: v.cpu() for k, v in engines["cuda"].method.server["global"].items()}
    assert_close_params(cpu_params, cuda_params, tol=TOL)
    acc = {d: r["summary"]["global_acc"]["weighted_mean"] for d, r in runs.items()}
    assert abs(acc["cuda"] - acc["cpu"]) <= 0.005, acc


def assert_same_round_updates(seq: Engine, other: Engine, rounds: int = 2) -> None:
    for r_seq, r_other in zip(run_rounds(seq, rounds), run_rounds(other, rounds)):
        for u, v in zip(r_seq, r_other):
            assert u.client_id == v.client_id
            assert v.loss == pytest.approx(u.loss, rel=TOL)
            assert_close_params(u.params, v.params, tol=TOL)
    assert_close_params(seq.method.server["global"], other.method.server["global"], tol=TOL)
    for cs, co in zip(seq.clients, other.clients):
        assert cs.state.keys() == co.state.keys()
        for key in cs.state:
            assert_close_params(cs.state[key], co.state[key], tol=TOL)


@cuda
@pytest.mark.parametrize("name", VECTORIZED)
def test_vectorized_equals_sequential_on_cuda(tiny_partition, make_cell, name):
    """training.vectorize on the GPU: every vectorized method's uploads, losses, server model
    and client state after 2 rounds equal the sequential path's (clients of different sizes:
    padded steps and short last batches)."""
    set_determinism(True)
    hp = HPARAMS.get(name)
    seq = method_engine(tiny_partition, make_cell, name, hp, device="cuda", rounds=2)
    vec = method_engine(tiny_partition, make_cell, name, hp, device="cuda", rounds=2, vectorize=True)
    assert not seq.vectorized and vec.vectorized
    assert_same_round_updates(seq, vec)


@cuda
def test_vectorized_convolutions_equal_sequential_on_cuda(conv_partition):
    """fedavg_cnn's vmapped convolutions (grouped cuDNN convolutions) against the plain ones."""
    set_determinism(True)
    seq, vec = conv_engine(conv_partition, "cuda"), conv_engine(conv_partition, "cuda", vectorize=True)
    assert vec.vectorized
    assert_same_round_updates(seq, vec)


@cuda
@pytest.mark.parametrize("name", ["fedavg", "fedper", "fedrep"])
def test_compiled_step_equals_eager_on_cuda(tiny_partition, make_cell, name):
    """training.compile: true on CUDA (inductor, mode reduce-overhead: the step replayed as a
    CUDA graph). Every client's fit copies its start into the same parameter tensors, so the
    graph must see each client's parameters: 2 rounds of uploads equal the eager ones. FedPer
    swaps in each client's own head; FedRep freezes parts per phase, and those partly frozen
    fits run eagerly under CUDA graphs (their replays gave other uploads on an H100, 2026-11-26)."""
    set_determinism(True)
    hp = HPARAMS.get(name)
    eager = method_engine(tiny_partition, make_cell, name, hp, device="cuda", rounds=2)
    comp = method_engine(tiny_partition, make_cell, name, hp, device="cuda", rounds=2, compile=True)
    assert_same_round_updates(eager, comp)
    assert eager.compiled.module is None
    assert (comp.compiled.module is None) == (name == "fedrep")  # FedRep: every fit is partly frozen


@cuda
def test_compiled_convolutions_equal_eager_on_cuda(conv_partition):
    set_determinism(True)
    eager, comp = conv_engine(conv_partition, "cuda"), conv_engine(conv_partition, "cuda", compile=True)
    assert_same_round_updates(eager, comp)
    assert comp.compiled.module is not None


# -- issue 36: the launch-limit levers on a GPU ----------------------------------------------------
LEVERS = ["resident_batches", "fused_step", "cuda_graph", "device_losses"]


class CountedGraph(torch.cuda.CUDAGraph if torch.cuda.is_available() else object):
    """torch.cuda.CUDAGraph counting its replays (the lever's steps really replayed)."""

    replays = 0

    def replay(self):
        CountedGraph.replays += 1
        return super().replay()


@cuda
@pytest.mark.parametrize("name", VECTORIZED)
def test_levers_equal_sequential_on_cuda(tiny_partition, make_cell, monkeypatch, name):
    """Every training lever at once on the GPU (the fused step, the captured and replayed CUDA
    graph): 2 rounds of uploads, losses, server model and client state equal the sequential path's."""
    set_determinism(True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CountedGraph)
    CountedGraph.replays = 0
    hp = HPARAMS.get(name)
    seq = method_engine(tiny_partition, make_cell, name, hp, device="cuda", rounds=2)
    fast = method_engine(tiny_partition, make_cell, name, hp, device="cuda", rounds=2, vectorize=True, levers=LEVERS)
    assert_same_round_updates(seq, fast)
    assert CountedGraph.replays > 0


@cuda
def test_lever_convolutions_equal_sequential_on_cuda(conv_partition):
    set_determinism(True)
    seq, fast = conv_engine(conv_partition, "cuda"), conv_engine(conv_partition, "cuda", vectorize=True, levers=LEVERS)
    assert_same_round_updates(seq, fast)


@cuda
def test_a_lever_round_never_waits_for_the_gpu(tiny_partition, make_cell):
    """No host synchronisation inside a vectorized round's local updates with every lever:
    torch's sync debug mode turns any synchronising call there into an error."""
    set_determinism(True)
    engine = method_engine(tiny_partition, make_cell, "fedavg", device="cuda", rounds=2, vectorize=True, levers=LEVERS)
    original = engine.method.local_updates

    def strict(clients, payloads):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(clients, payloads)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.method.local_updates = strict
    run_rounds(engine, 2)


@cuda
@pytest.mark.parametrize("name", ["fedper", "ditto"])
def test_batched_eval_equals_per_client_scoring_on_cuda(conv_partition, monkeypatch, name):
    """training.levers batched_eval on the GPU: fedavg_cnn's personalized models scored in one
    vmapped pass (grouped cuDNN convolutions) against one forward per client and chunk: each
    client's personal accuracy within one of its samples (tests/test_batched_eval.py)."""
    set_determinism(True)
    per_client = recorded(monkeypatch, conv_method_engine(conv_partition, name, device="cuda"))
    engine = conv_method_engine(conv_partition, name, device="cuda", levers=["batched_eval"])
    batched = recorded(monkeypatch, engine)
    assert engine.scoring.blocker_checked and engine.scoring.blocker is None
    assert_same_personal_scores(engine, per_client, batched)
