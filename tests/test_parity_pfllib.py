"""benchmarks/parity_pfllib.py without PFLlib: the exporter writes exactly fedrepro's
normalised client tensors in PFLlib's npz format, and PFLlib's stdout is parsed right."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrepro.config import resolve_experiment
from fedrepro.data.datasets import load_dataset
from fedrepro.data.shards import load_partition, write_partition
from fedrepro.engine.data import load_clients

from conftest import load_script

parity = load_script("benchmarks/parity_pfllib.py")


def pfllib_read_data(dataset_dir: Path, idx: int, is_train: bool) -> dict:
    """PFLlib system/utils/data_utils.py read_data, transcribed (its '../dataset/<name>' root
    replaced by `dataset_dir`)."""
    data_dir = dataset_dir / ("train/" if is_train else "test/")
    with open(str(data_dir) + "/" + str(idx) + ".npz", "rb") as f:
        return np.load(f, allow_pickle=True)["data"].tolist()


def pfllib_process_image(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """PFLlib's process_image, as tensors instead of a list of pairs."""
    return torch.Tensor(data["x"]).type(torch.float32), torch.Tensor(data["y"]).type(torch.int64)


@pytest.fixture(scope="module")
def digits_partition(tmp_path_factory):
    cfg = {
        "experiment": "parity_unit",
        "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": [8]}}}},
        "partitions": {"dir": {"partitioner": "dirichlet", "num_clients": 5, "seed": 1,
                               "params": {"alpha": 0.5, "min_partition_size": 20, "self_balancing": True},
                               "split": {"test_fraction": 0.25, "stratify": False}}},
        "methods": {"fedavg": {}},
        "seeds": [0],
    }
    part = resolve_experiment(cfg)["partitions"][0]
    out = tmp_path_factory.mktemp("shards") / part["id"]
    write_partition(load_dataset("digits", tmp_path_factory.mktemp("raw")), part["spec"], out)
    manifest, shards = load_partition(out)
    return manifest, shards


def test_export_is_fedrepros_normalised_client_tensors(digits_partition, tmp_path):
    manifest, shards = digits_partition
    dataset_dir = tmp_path / "dataset" / parity.pfllib_dataset_name(manifest["partition_id"])
    config = parity.export_pfllib(manifest, shards, dataset_dir)
    clients = load_clients(manifest, shards, torch.device("cpu"))  # what fedrepro's engine trains and tests on
    assert config["num_clients"] == len(clients) == 5
    assert json.loads((dataset_dir / "config.json").read_text())["fedrepro"]["partition_id"] == manifest["partition_id"]
    for c in clients:
        for split, is_train in (("train", True), ("test", False)):
            data = pfllib_read_data(dataset_dir, c.id, is_train)
            assert set(data) == {"x", "y"}
            ref = getattr(c, split)
            assert data["x"].dtype == np.float32 and data["y"].dtype == np.int64
            assert data["x"].shape == tuple(ref.x.shape) and data["x"].ndim == 4  # (N, C, H, W)
            assert np.array_equal(data["x"], ref.x.numpy()), f"client {c.id} {split} x differs"
            assert np.array_equal(data["y"], ref.y.numpy()), f"client {c.id} {split} y differs"
            x, y = pfllib_process_image(data)  # what PFLlib's DataLoader then batches
            assert torch.equal(x, ref.x) and torch.equal(y, ref.y)
            assert len(ref) > 0
    # PFLlib reads clients 0..num_clients-1 and nothing else
    assert sorted(int(p.stem) for p in (dataset_dir / "train").glob("*.npz")) == list(range(5))
    assert sorted(int(p.stem) for p in (dataset_dir / "test").glob("*.npz")) == list(range(5))
    # the script's own reader agrees with the transcription
    np.testing.assert_array_equal(parity.read_pfllib_client(dataset_dir, 3, False)["x"], pfllib_read_data(dataset_dir, 3, False)["x"])


def test_dataset_name_selects_pfllibs_mnist_cnn():
    # main.py: model CNN and "MNIST" in the dataset name -> FedAvgCNN(in_features=1, dim=1024);
    # data_utils.read_client_data: no "News"/"Shakespeare" -> images.
    name = parity.pfllib_dataset_name("abc123")
    assert "MNIST" in name and "News" not in name and "Shakespeare" not in name and "Cifar10" not in name


# Captured from PFLlib d832e76 runs on this benchmark's data (trimmed): FedAvg with two trials,
# Ditto (two evaluations per round), pFedMe (print_: "Average Test Accuracy"), MOON ('-'*50 time line)
# and FedBABU (fine-tuned evaluation after the loop).
FEDAVG = """\
==================================================
algorithm = FedAvg
==================================================

============= Running time: 0th =============
Creating server and clients ...
FedAvgCNN(
  (fc): Linear(in_features=512, out_features=10, bias=True)
)

Join ratio / total clients: 1.0 / 20
Finished creating server and clients.

-------------Round number: 0-------------

Evaluate global model
Averaged Train Loss: 2.3128
Averaged Test Accuracy: 0.0612
Averaged Test AUC: 0.4229
Std Test Accuracy: 0.1275
Std Test AUC: 0.2008
------------------------- time cost ------------------------- 6.011188507080078

-------------Round number: 1-------------

Evaluate global model
Averaged Train Loss: 2.2832
Averaged Test Accuracy: 0.1865
Averaged Test AUC: 0.6009
Std Test Accuracy: 0.2063
Std Test AUC: 0.2236
------------------------- time cost ------------------------- 5.994189023971558

-------------Round number: 2-------------

Evaluate global model
Averaged Train Loss: 2.2350
Averaged Test Accuracy: 0.2483
Averaged Test AUC: 0.6644
Std Test Accuracy: 0.2592
Std Test AUC: 0.1554
------------------------- time cost ------------------------- 5.987019777297974

Best accuracy.
0.24829931972789115

Average time cost per round.
5.990604400634766
File path: ../results/FashionMNIST_fedrepro_30f512847f_FedAvg_parity0275a2202580_0.h5

============= Running time: 1th =============
Creating server and clients ...

-------------Round number: 0-------------

Evaluate global model
Averaged Train Loss: 2.3031
Averaged Test Accuracy: 0.1102
------------------------- time cost ------------------------- 6.2

-------------Round number: 1-------------

Evaluate global model
Averaged Train Loss: 2.2801
Averaged Test Accuracy: 0.2041
------------------------- time cost ------------------------- 6.4

-------------Round number: 2-------------

Evaluate global model
Averaged Test Accuracy: 0.2717
------------------------- time cost ------------------------- 6.0

Best accuracy.
0.2717

Average time cost: 18.36s.
Length:  3
std for best accuracy: 0.0
mean for best accuracy: 0.24829931972789115
All done!
"""

DITTO = """\
============= Running time: 0th =============

-------------Round number: 1-------------

Evaluate global models
Averaged Train Loss: 2.2832
Averaged Test Accuracy: 0.1865
Std Test AUC: 0.2236

Evaluate personalized models
Averaged Train Loss: 1.2345
Averaged Test Accuracy: 0.6543
Std Test AUC: 0.1000
------------------------- time cost ------------------------- 11.5
"""

PFEDME = """\
============= Running time: 0th =============

-------------Round number: 1-------------

Evaluate personalized model
Average Test Accuracy: 0.3210
Average Test AUC: 0.4444
Average Train Loss: 2.0000
------------------------- time cost ------------------------- 30.25
"""

MOON = """\
============= Running time: 0th =============

-------------Round number: 1-------------

Evaluate global model
Averaged Test Accuracy: 0.2000
-------------------------------------------------- 12.75
"""

FEDBABU = """\
============= Running time: 0th =============

-------------Round number: 2-------------

Evaluate global model
Averaged Test Accuracy: 0.3000
------------------------- time cost ------------------------- 5.5

Best accuracy.
0.3

Average time cost per round.
5.5

-------------Evaluate fine-tuned personalized models-------------
Averaged Train Loss: 0.5000
Averaged Test Accuracy: 0.8125
Std Test Accuracy: 0.1000
"""


def test_parse_pfllib_stdout_trials_rounds_and_times():
    trials = parity.parse_pfllib_stdout(FEDAVG)
    assert sorted(trials) == [0, 1]
    assert [(e["round"], e["acc"]) for e in trials[0]["evals"]] == [(0, 0.0612), (1, 0.1865), (2, 0.2483)]
    assert {e["series"] for e in trials[0]["evals"]} == {"Evaluate global model"}
    assert trials[0]["budget"] == [6.011188507080078, 5.994189023971558, 5.987019777297974]
    assert [e["acc"] for e in trials[1]["evals"]] == [0.1102, 0.2041, 0.2717]
    assert trials[1]["budget"] == [6.2, 6.4, 6.0]


def test_parse_pfllib_stdout_series_kinds():
    ditto = parity.parse_pfllib_stdout(DITTO)[0]["evals"]
    assert [(e["round"], e["series"], e["acc"]) for e in ditto] == [
        (1, "Evaluate global models", 0.1865), (1, "Evaluate personalized models", 0.6543)]
    pfedme = parity.parse_pfllib_stdout(PFEDME)[0]
    assert pfedme["evals"] == [{"round": 1, "series": "Evaluate personalized model", "acc": 0.321}]
    assert pfedme["budget"] == [30.25]
    moon = parity.parse_pfllib_stdout(MOON)[0]
    assert moon["budget"] == [12.75] and moon["evals"][0]["acc"] == 0.2
    babu = parity.parse_pfllib_stdout(FEDBABU)[0]["evals"]
    assert babu[-1] == {"round": "final", "series": "Evaluate fine-tuned personalized models", "acc": 0.8125}
    assert babu[0]["round"] == 2


def test_rows_pick_their_series_and_round():
    recs = {"evals": parity.parse_pfllib_stdout(DITTO)[0]["evals"] + parity.parse_pfllib_stdout(FEDBABU)[0]["evals"]}
    rows = {r.name: r for r in parity.ROWS}
    assert parity.pfllib_value(recs, rows["Ditto"], 1) == 0.6543
    assert parity.pfllib_value(recs, rows["Ditto (global)"], 1) == 0.1865
    assert parity.pfllib_value(recs, rows["FedBABU (fine-tuned)"], 2) == 0.8125
    with pytest.raises(KeyError):
        parity.pfllib_value(recs, rows["Ditto"], 5)


def test_every_row_resolves_in_fedrepro_and_pfllib_flags_exist():
    """Every row's fedrepro hparams are known to the method registry; every PFLlib flag is one
    of main.py's (checked against the names in this list, transcribed from main.py d832e76)."""
    main_flags = {"goal", "device", "device_id", "dataset", "num_classes", "model", "batch_size", "local_learning_rate",
                  "learning_rate_decay", "learning_rate_decay_gamma", "global_rounds", "top_cnt", "local_epochs",
                  "algorithm", "join_ratio", "random_join_ratio", "num_clients", "prev", "times", "eval_gap",
                  "save_folder_name", "auto_break", "dlg_eval", "dlg_gap", "batch_num_per_client", "num_new_clients",
                  "fine_tuning_epoch_new", "feature_dim", "vocab_size", "max_len", "few_shot", "client_drop_rate",
                  "train_slow_rate", "send_slow_rate", "time_select", "time_threthold", "beta", "lamda", "mu", "K",
                  "p_learning_rate", "M", "itk", "alphaK", "sigma", "alpha", "plocal_epochs", "tau",
                  "fine_tuning_epochs", "dr_learning_rate", "L", "noise_dim", "generator_learning_rate", "hidden_dim",
                  "server_epochs", "localize_feature_extractor", "server_learning_rate", "eta", "rand_percent",
                  "layer_idx", "mentee_learning_rate", "T_start", "T_end", "momentum", "kl_weight"}
    import argparse

    args = argparse.Namespace(dataset="fmnist", fraction=0.1, seeds=[0, 1], rounds=2)
    for row in parity.ROWS:
        assert {k for k, _ in row.pfllib.args} <= main_flags, row.name
        assert set(parity.PFLLIB_FLAGS) <= main_flags
        cells = resolve_experiment(parity.experiment_config(args, [row.fedrepro]))["cells"]
        assert [c["seed"] for c in cells] == [0, 1]
        for k, v in row.fedrepro.hparams:
            assert cells[0]["hparams"][k] == v, (row.name, k)
        assert cells[0]["training"]["drop_last"] is True and cells[0]["training"]["batch_size"] == 10


def test_flag_rule():
    assert parity.flag(0.05, 0.01, 0.02) == "≠"
    assert parity.flag(0.03, 0.01, 0.02) == ""
    assert parity.flag(0.009, 0.0, 0.0) == ""  # the 1-point floor
    assert parity.mean_std([0.5]) == (0.5, 0.0)


def test_speed_ratio_over_pairs_is_the_mean_of_the_pairs_ratios():
    """--pairs N: the speed ratio is the mean of the N back-to-back pairs' ratios, shown with
    their range; one pair (the default) reads the runs' own times as before."""
    import argparse

    row = next(r for r in parity.ROWS if r.name == "FedAvg")
    p_rec = {"evals": parity.parse_pfllib_stdout(FEDAVG)[0]["evals"], "s_per_round": 6.0}
    f_rec = {"final": {"global_acc": 0.25}, "s_per_round": 3.0}
    pres, fres = {row.pfllib: {0: p_rec}}, {row.fedrepro: {0: f_rec}}
    one = parity.summarize_rows([row], pres, fres, 2)[0]
    assert (one["speed_ratio"], one["speed_pairs"]) == (2.0, 1)
    pairs = {row.name: [(6.0, 3.0), (5.0, 4.0), (6.0, 4.0)]}
    many = parity.summarize_rows([row], pres, fres, 2, speeds=pairs)[0]
    assert many["speed_ratio"] == pytest.approx((2.0 + 1.25 + 1.5) / 3)
    assert (many["speed_ratio_min"], many["speed_ratio_max"], many["speed_pairs"]) == (1.25, 2.0, 3)
    assert (many["pfllib_s_per_round"], many["fedrepro_s_per_round"]) == (pytest.approx(17 / 3), pytest.approx(11 / 3))
    args = argparse.Namespace(fraction=0.1, rounds=2, seeds=[0], pairs=3)
    text = parity.markdown([many], args)
    assert "| 1.58× (1.25–2.00, 3 pairs) |" in text and "mean over 3 pairs" in text
    assert "pairs" not in parity.markdown([one], argparse.Namespace(fraction=0.1, rounds=2, seeds=[0]))
