"""The engine and the method API on a tiny cell: protocol, determinism, resume, failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from fedrepro.data.shards import load_partition
from fedrepro.engine.data import load_clients
from fedrepro.engine.engine import Engine, lr_at, sampling_schedule
from fedrepro.engine.run import train_cell
from fedrepro.methods import METHODS, Update, weighted_average
from fedrepro.metrics import STATS

from conftest import REPO, fit_cell_to_method, kill_in_round_3_and_resume


def engine_for(cell, shards):
    manifest, clients = load_partition(shards)
    return Engine(cell, manifest, load_clients(manifest, clients, torch.device("cpu")), torch.device("cpu"), progress=False)


def strip_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "resources"}


@pytest.mark.parametrize("label", METHODS.names())
def test_every_method_runs_two_rounds_with_valid_metrics(tiny_partition, make_cell, tmp_path, label):
    shards, _ = tiny_partition
    cell = make_cell("fedavg")
    method = METHODS.get(label)
    cell.update(method=label, label=label, hparams={k: p.default for k, p in method.hparams.items()})
    fit_cell_to_method(cell, label)
    m = train_cell(cell, shards, tmp_path, progress=False)
    assert m["status"] == "ok" and m["rounds"] == 2
    n = len(m["clients"]["ids"])
    for kind, present in (("global", method.has_global), ("personal", method.has_personal)):
        assert (m["final"][kind] is not None) == present
        assert (f"{kind}_acc" in m["summary"]) == present
        if present:
            acc = np.array(m["final"][kind]["acc"])
            assert len(acc) == n and ((acc >= 0) & (acc <= 1)).all()
            assert set(m["summary"][f"{kind}_acc"]) == set(STATS)
            assert m["curves"][f"{kind}_acc"]["weighted_mean"][-1] == pytest.approx(m["summary"][f"{kind}_acc"]["weighted_mean"])
    assert m["curves"]["round"] == [1, 2]
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "provenance.json").exists()
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["cell"]["label"] == label and prov["shards"]["sha256"] and prov["packages"]["torch"]
    assert set(prov["git"]) == {"commit", "dirty"} and "SLURM_JOB_ID" in prov["slurm"]


def test_final_result_is_last_round_not_best(tiny_partition, make_cell, tmp_path):
    m = train_cell(make_cell("fedavg", rounds=4), tiny_partition[0], tmp_path, progress=False)
    curve = m["curves"]["global_acc"]["weighted_mean"]
    assert m["summary"]["global_acc"]["weighted_mean"] == curve[-1]
    # a validation split exists, so best-on-validation is reported beside it, not instead of it
    assert m["best_val"]["round"] in m["curves"]["round"]


def test_fedavg_aggregate_is_the_sample_weighted_mean():
    a = Update(0, 1, {"w": torch.tensor([0.0, 3.0]), "n": torch.tensor(2)})
    b = Update(1, 3, {"w": torch.tensor([4.0, 7.0]), "n": torch.tensor(5)})
    avg = weighted_average([a, b])
    assert torch.allclose(avg["w"], torch.tensor([3.0, 6.0]))  # (1*0 + 3*4)/4, (1*3 + 3*7)/4
    assert int(avg["n"]) == 5  # integer buffers are not averaged


def test_fedavg_round_equals_manual_average(tiny_partition, make_cell):
    """One FedAvg round through the engine == averaging the clients' local models by hand."""
    eng = engine_for(make_cell("fedavg", rounds=1), tiny_partition[0])
    eng.method.setup()
    eng.round = 1
    start = {k: v.clone() for k, v in eng.method.server["global"].items()}
    updates = []
    for cid in eng.schedule[0]:
        eng.streams.start_client()
        updates.append(eng.method.local_update(eng.clients[cid], eng.method.broadcast(eng.clients[cid])))
    eng.method.aggregate(updates)
    total = sum(u.num_samples for u in updates)
    for k in start:
        manual = sum(u.params[k] * (u.num_samples / total) for u in updates)
        assert torch.allclose(eng.method.server["global"][k], manual, atol=1e-6)
        assert not torch.equal(eng.method.server["global"][k], start[k])


def test_local_never_communicates_and_keeps_personal_models(tiny_partition, make_cell, tmp_path):
    m = train_cell(make_cell("local"), tiny_partition[0], tmp_path, progress=False)
    assert m["communication"]["bytes_up_total"] == 0 and m["communication"]["bytes_down_total"] == 0
    eng = engine_for(make_cell("local"), tiny_partition[0])
    eng.method.setup()
    for r in (1, 2):
        eng.round = r
        for cid in eng.schedule[r - 1]:
            eng.method.local_update(eng.clients[cid], {})
    a, b = (eng.method.personal_params(c) for c in eng.clients[:2])
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_fedavg_bytes_are_model_size_times_clients(tiny_partition, make_cell, tmp_path):
    m = train_cell(make_cell("fedavg", participation=2), tiny_partition[0], tmp_path, progress=False)
    eng = engine_for(make_cell("fedavg"), tiny_partition[0])
    model_bytes = sum(v.numel() * v.element_size() for v in eng.model.state_dict().values())
    assert m["communication"]["bytes_up_per_round"] == [2 * model_bytes] * 2
    assert m["communication"]["bytes_down_per_round"] == [2 * model_bytes] * 2


def test_finetuning_changes_only_the_head(tiny_partition, make_cell):
    eng = engine_for(make_cell("fedavg_ft"), tiny_partition[0])
    eng.method.setup()
    g = eng.method.global_params()
    p = eng.method.personal_params(eng.clients[0])
    for k in g:
        if k.startswith("extractor."):
            assert torch.equal(p[k], g[k])
    assert any(not torch.equal(p[k], g[k]) for k in g if k.startswith("head."))
    # evaluating is side-effect free: the server's global model is untouched
    assert all(torch.equal(g[k], eng.method.global_params()[k]) for k in g)


def test_client_sampling_is_seeded_and_method_independent(tiny_partition, make_cell):
    s1 = sampling_schedule(20, 0.25, 10, seed=3)
    assert s1 == sampling_schedule(20, 0.25, 10, seed=3) and s1 != sampling_schedule(20, 0.25, 10, seed=4)
    assert all(len(r) == 5 and len(set(r)) == 5 for r in s1)
    assert all(len(r) == 7 for r in sampling_schedule(20, 7, 3, seed=0))
    engines = [engine_for(make_cell(label, participation=0.5, rounds=5), tiny_partition[0]) for label in ("local", "fedavg", "fedavg_ft")]
    assert engines[0].schedule == engines[1].schedule == engines[2].schedule


def test_lr_schedules():
    assert lr_at({"name": "constant"}, 0.1, 7) == 0.1
    fedcrc = {"name": "multistep", "milestones": [50, 75], "values": [0.05, 0.01, 0.001], "gamma": 0.1}
    assert [lr_at(fedcrc, 0.05, r) for r in (1, 50, 51, 75, 76, 100)] == [0.05, 0.05, 0.01, 0.01, 0.001, 0.001]
    step = {"name": "multistep", "milestones": [2], "values": [], "gamma": 0.5}
    assert [lr_at(step, 0.2, r) for r in (1, 2, 3)] == [0.2, 0.2, 0.1]
    cos = {"name": "cosine", "total_rounds": 3, "min_lr": 0.0}
    assert lr_at(cos, 1.0, 1) == 1.0 and lr_at(cos, 1.0, 4) == pytest.approx(0.0)


def test_same_seed_same_metrics_other_seed_differs(tiny_partition, make_cell, tmp_path):
    runs = [train_cell(make_cell("fedavg_ft", seed=s), tiny_partition[0], tmp_path / f"r{i}", progress=False)
            for i, s in enumerate((0, 0, 1))]
    assert strip_timing(runs[0]) == strip_timing(runs[1])
    a = (tmp_path / "r0" / "metrics.json").read_text()
    b = (tmp_path / "r1" / "metrics.json").read_text()
    assert json.loads(a)["final"] == json.loads(b)["final"]
    assert runs[0]["final"] != runs[2]["final"]


def test_resume_after_crash_gives_the_uninterrupted_result(tiny_partition, make_cell, tmp_path, monkeypatch):
    cell = make_cell("fedavg_ft", rounds=4, checkpoint_every=1, eval_every=1)
    full = train_cell(cell, tiny_partition[0], tmp_path / "full", progress=False)
    ckpt = tmp_path / "ckpt.pt"
    run = lambda: train_cell(cell, tiny_partition[0], tmp_path / "resumed", checkpoint=ckpt, progress=False)
    resumed = kill_in_round_3_and_resume(monkeypatch, "fedavg_ft", run, ckpt, tmp_path / "resumed")
    assert strip_timing(resumed) == strip_timing(full)
    assert not ckpt.exists()  # removed once the cell completed


def test_sigkill_mid_run_then_rerun_resumes_to_the_same_metrics(tiny_partition, make_cell, tmp_path):
    shards = tiny_partition[0]
    cell = make_cell("fedavg", rounds=60, checkpoint_every=5, eval_every=5)
    ckpt = tmp_path / "ckpt.pt"
    # the same thread count everywhere: float sums depend on it
    cmd = [sys.executable, "-m", "fedrepro", "train", "--cell", json.dumps(cell), "--shards", str(shards), "--threads", "1"]
    resumable = cmd + ["--checkpoint", str(ckpt), "--out-dir", str(tmp_path / "killed")]
    # the uninterrupted reference trains meanwhile, in its own process (its own cores where there are two)
    clean = subprocess.Popen(cmd + ["--out-dir", str(tmp_path / "clean")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO)
    try:
        proc = subprocess.Popen(resumable, stderr=subprocess.DEVNULL, cwd=REPO)
        deadline = time.time() + 120
        while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "the job finished before it could be killed; raise rounds"
        assert ckpt.exists() and not (tmp_path / "killed" / "metrics.json").exists()
        rerun = subprocess.run(resumable, capture_output=True, text=True, cwd=REPO, check=True)
        assert "resuming from the checkpoint" in rerun.stderr
        _, clean_err = clean.communicate(timeout=600)
        assert clean.returncode == 0, clean_err[-3000:]
        assert "resuming" not in clean_err
    finally:
        if clean.poll() is None:
            clean.kill()
            clean.wait()
    a = strip_timing(json.loads((tmp_path / "killed" / "metrics.json").read_text()))
    b = strip_timing(json.loads((tmp_path / "clean" / "metrics.json").read_text()))
    assert a == b


def test_diverging_run_is_recorded_as_failed(tiny_partition, make_cell, tmp_path):
    m = train_cell(make_cell("fedavg", optimizer={"lr": 1e6}), tiny_partition[0], tmp_path, progress=False)
    assert m["status"] == "failed" and "diverged" in m["failure"]["reason"]
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "failed"


def test_crash_leaves_no_metrics(tiny_partition, make_cell, tmp_path, monkeypatch):
    def boom(engine, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("fedrepro.engine.evaluation.evaluate", boom)  # the round loop calls it
    with pytest.raises(RuntimeError):
        train_cell(make_cell("fedavg"), tiny_partition[0], tmp_path, progress=False)
    assert not (tmp_path / "metrics.json").exists()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()) if tmp_path.exists() else True


def test_shard_of_another_partition_is_refused(tiny_partition, make_cell, tmp_path):
    cell = make_cell("fedavg")
    cell["partition_id"] = "0000000000"
    with pytest.raises(ValueError, match="not the cell's partition"):
        train_cell(cell, tiny_partition[0], tmp_path, progress=False)


def test_progress_shows_rounds_and_accuracy(tiny_partition, make_cell, tmp_path, capfd):
    train_cell(make_cell("fedavg"), tiny_partition[0], tmp_path, progress=True)
    err = capfd.readouterr().err
    assert "training cell unit/digits/dir/fedavg/seed0" in err
    assert "round 2/2" in err and "global acc" in err


def test_crop_flip_augmentation_is_a_seeded_shifted_window():
    from fedrepro.engine.data import AUGMENTATIONS

    aug = AUGMENTATIONS["crop_flip"]
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    a = aug(x, torch.Generator().manual_seed(0))
    assert a.shape == x.shape
    assert torch.equal(a, aug(x, torch.Generator().manual_seed(0)))
    for i in range(2):  # each output is a (possibly flipped) 8x8 window of the zero-padded input
        padded = torch.nn.functional.pad(x[i], (4, 4, 4, 4))
        windows = [padded[:, r : r + 8, c : c + 8] for r in range(9) for c in range(9)]
        assert any(torch.equal(a[i], w) or torch.equal(a[i], w.flip(-1)) for w in windows)
    outs = {tuple(aug(x, torch.Generator().manual_seed(s))[0, 0, 0].tolist()) for s in range(10)}
    assert len(outs) > 1  # the crop really moves


@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_drops_each_epochs_incomplete_batch_but_a_small_clients_only_one(tiny_partition, make_cell, drop_last):
    """`training.drop_last`: the last incomplete batch of each epoch is dropped, except where it is
    the client's only batch (fewer train samples than one batch): that client still trains on it,
    where PyTorch's DataLoader(drop_last=True), and so PFLlib, gives it no step (docs/parity.md)."""
    from conftest import method_engine

    eng = method_engine(tiny_partition, make_cell, "fedavg", drop_last=drop_last)
    eng.round = 1
    client = eng.clients[0]
    n = client.num_train
    assert n % 7
    sizes = [len(y) for _, y in eng.batches(client, batch_size=7)]
    assert sizes == [7] * (n // 7) + ([] if drop_last else [n % 7])
    assert [len(y) for _, y in eng.batches(client, batch_size=n + 5)] == [n]
