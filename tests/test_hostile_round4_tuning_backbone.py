"""Issue 57 (hostile input, fourth round): the tuning selection and the backbone pre-training.

What `fedrepro select` and `fedrepro train --tuned` read is checked, not believed: each trial's
summaries recompute from its per-client scores, each trial's metrics are those of the trial cell
trained beside them, and a selection record recomputes from its trials and holds values within the
method's bounds. `fedrepro validate` bounds a ViT backbone's memory and `pretrain-backbone` refuses
what it cannot build, each in one line naming the file or key, the value and what is allowed."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from conftest import tiny_config
from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.engine.run import train_cell
from fedrepro.registry import ConfigError
from fedrepro.tuning import trial_id

MUS = [0.01, 1.0]


def selection_config() -> dict:
    """FedProx on the tiny partition, its mu tuned over two values (one lr): two trials of one round."""
    config = tiny_config()
    config["methods"] = {"fedprox": {}}
    config["tuning"] = {"val_fraction": 0.25, "training": {"rounds": 1}, "lr": [0.05],
                        "methods": {"fedprox": {"mu": MUS}}}
    return config


@pytest.fixture(scope="module")
def trained(tiny_partition, tmp_path_factory) -> tuple[Path, dict]:
    """Both trials trained once into <root>/<trial>/seed0 (metrics.json and provenance.json, as the
    workflow's tune_trial jobs write them). Returns (root, experiment)."""
    root = tmp_path_factory.mktemp("trials")
    pid = tiny_partition[1]["partitions"][0]["id"]
    exp = resolve_experiment(selection_config())
    for c in exp["tuning_cells"]:
        train_cell({**c, "partition_id": pid}, tiny_partition[0], root / c["trial"] / f"seed{c['seed']}", progress=False)
    return root, exp


def trials_copy(trained, tmp_path) -> tuple[Path, dict]:
    """A copy of the trained trials to tamper with, and the select rule's --spec over it."""
    root, exp = trained
    runs_dir = tmp_path / "runs"
    shutil.copytree(root, runs_dir)
    plan = exp["tuning"]["labels"]["fedprox"]
    runs = [{"trial": c["trial"], "seed": c["seed"], "metrics": str(runs_dir / c["trial"] / f"seed{c['seed']}" / "metrics.json")}
            for c in exp["tuning_cells"]]
    spec = {"dataset": "digits", "partition": "dir", "label": "fedprox", "method": "fedprox", "space": plan["space"],
            "trials": plan["trials"], "metric": exp["tuning"]["metric"], "runs": runs}
    return runs_dir, spec


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def refused(capsys, argv: list[str], *named: str) -> str:
    """`fedrepro argv` exits 2 with one error line (progress lines aside) naming each of `named`."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[fedrepro] ")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


def select(spec: dict, out: Path) -> list[str]:
    return ["select", "--spec", json.dumps(spec), "--out", str(out)]


def selected(capsys, spec: dict, out: Path) -> dict:
    assert main(select(spec, out)) == 0, capsys.readouterr().err
    return json.loads(out.read_text())


def final_cell(trained, tiny_partition) -> dict:
    cell = next(c for c in trained[1]["cells"] if c["label"] == "fedprox")
    return {**cell, "partition_id": tiny_partition[1]["partitions"][0]["id"]}


def train_tuned(cell: dict, tiny_partition, out: Path, selection: Path) -> list[str]:
    return ["train", "--cell", json.dumps(cell), "--shards", str(tiny_partition[0]), "--out-dir", str(out),
            "--tuned", str(selection)]


# ----------------------------------------------------------------------------- the tuning selection


def test_select_recomputes_a_trials_summary_from_its_per_client_scores(trained, tmp_path, capsys):
    """Before: an edited summary_val mean moved the selection to the edited trial, without a word."""
    runs_dir, spec = trials_copy(trained, tmp_path)
    clean = selected(capsys, spec, tmp_path / "clean.json")
    loser = next(t["id"] for t in clean["trials"] if t["id"] != clean["winner"]["id"])
    metrics = runs_dir / loser / "seed0" / "metrics.json"
    edit_json(metrics, lambda d: d["summary_val"]["global_acc"].update(weighted_mean=0.999))
    out = tmp_path / "sel.json"
    refused(capsys, select(spec, out), str(metrics), "'summary_val.global_acc.weighted_mean'", "0.999",
            "per-client scores", "allowed")
    assert not out.exists()


def test_select_refuses_a_winners_metrics_copied_over_a_losers(trained, tmp_path, capsys):
    """Before: the copy made both trials score alike, and the first in grid order won."""
    runs_dir, spec = trials_copy(trained, tmp_path)
    clean = selected(capsys, spec, tmp_path / "clean.json")
    winner = clean["winner"]["id"]
    loser = next(t["id"] for t in clean["trials"] if t["id"] != winner)
    shutil.copy(runs_dir / winner / "seed0" / "metrics.json", runs_dir / loser / "seed0" / "metrics.json")
    out = tmp_path / "sel.json"
    refused(capsys, select(spec, out), str(runs_dir / loser / "seed0" / "metrics.json"), "'identity.cell_key'", "hashes to",
            "allowed")
    # the trial's folder copied whole (metrics and provenance): the cell it records is the other trial
    shutil.copy(runs_dir / winner / "seed0" / "provenance.json", runs_dir / loser / "seed0" / "provenance.json")
    refused(capsys, select(spec, out), str(runs_dir / loser / "seed0" / "provenance.json"), "'cell.trial'", repr(winner),
            f"allowed: {loser!r}")
    assert not out.exists()


def test_train_tuned_refuses_a_selection_that_does_not_recompute_from_its_trials(trained, tiny_partition, tmp_path,
                                                                                 capsys):
    """Before: a hand-edited winner (mu 0.123) was trained as it stood."""
    _, spec = trials_copy(trained, tmp_path)
    clean = selected(capsys, spec, tmp_path / "clean.json")
    cell = final_cell(trained, tiny_partition)
    sel = tmp_path / "sel.json"
    edited = copy.deepcopy(clean)
    edited["winner"]["values"]["mu"] = 0.123
    sel.write_text(json.dumps(edited))
    refused(capsys, train_tuned(cell, tiny_partition, tmp_path / "f", sel), str(sel), "'winner'", "0.123", "allowed",
            "recomputed from its trials")
    # the edit carried through space, trial, id and winner alike: the trial's scores still pick the other value
    edited = copy.deepcopy(clean)
    loser = next(t for t in edited["trials"] if t["id"] != clean["winner"]["id"])
    edited["space"]["mu"] = [0.123 if v == loser["values"]["mu"] else v for v in edited["space"]["mu"]]
    loser["values"]["mu"] = 0.123
    loser["id"] = trial_id(loser["values"])
    edited["winner"] = {"id": loser["id"], "values": loser["values"], "score": clean["winner"]["score"]}
    sel.write_text(json.dumps(edited))
    refused(capsys, train_tuned(cell, tiny_partition, tmp_path / "f", sel), str(sel), "'winner'", "0.123", "allowed")
    # a trial whose values are no point of the record's space
    edited = copy.deepcopy(clean)
    edited["trials"][0]["values"]["mu"] = 0.123
    sel.write_text(json.dumps(edited))
    refused(capsys, train_tuned(cell, tiny_partition, tmp_path / "f", sel), str(sel), "'trials[0].values.mu'", "0.123",
            "allowed: one of [0.01, 1.0]")
    assert not (tmp_path / "f" / "metrics.json").exists()
    # the record as `fedrepro select` wrote it trains
    sel.write_text(json.dumps(clean))
    assert main(train_tuned({**cell, "training": {**cell["training"], "rounds": 1}}, tiny_partition, tmp_path / "f",
                            sel)) == 0


def test_train_tuned_refuses_an_lr_beyond_the_configs_bound(trained, tiny_partition, tmp_path, capsys):
    """Before: a tuned lr of 1e300 ended in a RuntimeError traceback inside the optimizer."""
    cell = final_cell(trained, tiny_partition)
    sel = tmp_path / "sel.json"
    winner = {"id": trial_id({"lr": 1e300, "mu": 0.01}), "values": {"lr": 1e300, "mu": 0.01}}
    # a bare winner (as `fedrepro verify` writes one to retrain a recorded cell)
    sel.write_text(json.dumps({"dataset": "digits", "partition": "dir", "label": "fedprox", "winner": winner}))
    refused(capsys, train_tuned(cell, tiny_partition, tmp_path / "f", sel), str(sel), "'winner.values.lr'", "1e+300",
            "allowed: at most")
    # a whole select record built around it: its space is refused first
    trial = {**winner, "score": 0.5, "scores": {"seed0": 0.5}}
    sel.write_text(json.dumps({"dataset": "digits", "partition": "dir", "label": "fedprox", "method": "fedprox",
                               "schema": "fedrepro.tuning/1", "space": {"lr": [1e300], "mu": [0.01]}, "trials": [trial],
                               "winner": {**winner, "score": 0.5}}))
    refused(capsys, train_tuned(cell, tiny_partition, tmp_path / "f", sel), str(sel), "'space.lr[0]'", "1e+300",
            "allowed: at most")
    assert not (tmp_path / "f" / "metrics.json").exists()


# ----------------------------------------------------------------------------- the backbone


def vit_config(backbone_args: dict) -> dict:
    config = tiny_config()
    config["methods"] = {"fedavg": {}}
    config["datasets"]["digits"]["model"] = {"name": "prompted_vit", "params": {
        "backbone": "vit_tiny_patch16_224", "weights": "none", "backbone_args": backbone_args}}
    return config


@pytest.mark.parametrize("backbone_args, named", [
    ({"embed_dim": 65536, "num_heads": 2}, "65536"),  # before: passed validate; the job allocated 50+ GB
    ({"img_size": 100000}, "100000"),
])
def test_validate_bounds_the_backbones_memory(backbone_args, named, monkeypatch):
    monkeypatch.setattr("fedrepro.models.prompted_vit.machine_memory_bytes", lambda: 64 * 2**30, raising=False)
    with pytest.raises(ConfigError) as info:
        resolve_experiment(vit_config(backbone_args))
    message = str(info.value)
    for text in ("config key 'datasets.digits.model.params'", named, "parameters", "at least", "64.0 GiB of memory",
                 "allowed"):
        assert text in message, message
    # the tiny ViT of the tests still validates
    resolve_experiment(vit_config({"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}))


PRETRAIN = {"dataset": "shifted_domains", "dataset_params": {}, "epochs": 1, "samples": 8, "batch_size": 4, "lr": 0.001,
            "seed": 0}


@pytest.mark.parametrize("backbone, named", [
    ({"backbone": "resnet18", "backbone_args": {}}, ["key 'backbone' has value 'resnet18'", "allowed: a timm "
                                                     "VisionTransformer"]),  # before: AssertionError traceback
    ({"backbone": "vit_tiny_patch16_224", "backbone_args": {"checkpoint_path": "/etc/passwd"}},
     ["'backbone_args'", "'checkpoint_path'", "allowed", "img_size", "weights"]),  # before: IndexError / timm's loader
    ({"backbone": "vit_tiny_patch16_224", "backbone_args": {"embed_dim": 65536, "num_heads": 2}},
     ["key 'backbone.backbone_args'", "65536", "pre-training the backbone needs at least", "GiB of memory"]),
])
def test_pretrain_backbone_refuses_what_it_cannot_build_in_one_line(backbone, named, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fedrepro.models.prompted_vit.machine_memory_bytes", lambda: 64 * 2**30, raising=False)
    (tmp_path / "raw").mkdir()
    out = tmp_path / "b.pt"
    refused(capsys, ["pretrain-backbone", "--spec", json.dumps({**PRETRAIN, "backbone": backbone}), "--root",
                     str(tmp_path / "raw"), "--out", str(out)], "fedrepro pretrain-backbone: error: ", *named)
    assert not out.exists()
