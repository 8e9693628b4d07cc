"""Fine-tuning rows derived from a finished cell's final model (issue 38; fedrepro.engine.finetune).

A `*_ft` row scored only at its last round is computed by `fedrepro finetune` from its base cell's
final_model.pt; its metrics.json must be the one training the row in full writes (resources aside)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.data.datasets import load_dataset
from fedrepro.data.shards import write_partition
from fedrepro.engine.finetune import FINAL_MODEL, base_problem
from fedrepro.io import sha256_file
from fedrepro.registry import ConfigError
from fedrepro.report.aggregate import summary_frame
from fedrepro.report.tables import finetune_note

from conftest import REPO, tiny_config


def strip_timing(metrics: dict) -> dict:  # as tests/test_faults.py
    return {k: v for k, v in metrics.items() if k != "resources"}


def ft_config() -> dict:
    """Default-experiment-like, tiny: partial participation (clients untrained at the end, scored by
    the 'personalize' rule), an unseen client, a validation split, the union test set, and a
    fine-tuning row scored only after training while its base scores every other round."""
    cfg = tiny_config(rounds=2, participation=0.5, eval_every=1, personal_eval_every=2, global_test=["union"])
    cfg["partitions"]["dir"]["num_clients"] = 5
    cfg["partitions"]["dir"]["unseen_clients"] = 1
    cfg["methods"] = {"fedavg": {}, "fedavg_ft": {"hparams": {"ft_epochs": 2}, "training": {"personal_eval_every": 3}},
                      "fedprox": {"hparams": {"mu": 0.1}},
                      "fedprox_ft": {"hparams": {"mu": 0.1, "ft_epochs": 2, "ft_fresh_head": True},
                                     "training": {"personal_eval_every": 3}},
                      "ditto": {}, "ditto_ft": {"finetune": "ditto", "hparams": {"ft_epochs": 2}}}  # "+FT" of any method
    return cfg


@pytest.fixture(scope="module")
def ft_exp(tmp_path_factory):
    exp = resolve_experiment(ft_config())
    part = exp["partitions"][0]
    shards = tmp_path_factory.mktemp("ftshards") / part["id"]
    write_partition(load_dataset("digits", tmp_path_factory.mktemp("ftraw")), part["spec"], shards)
    return shards, {c["label"]: c for c in exp["cells"]}


def train(cell: dict, shards: Path, out: Path) -> dict:
    assert main(["train", "--cell", json.dumps(cell), "--shards", str(shards), "--out-dir", str(out), "--threads", "1"]) == 0
    return json.loads((out / "metrics.json").read_text())


def finetune(cell: dict, base: dict, shards: Path, out: Path, final: Path) -> int:
    return main(["finetune", "--cell", json.dumps(cell), "--base-cell", json.dumps(base), "--final-model", str(final),
                 "--shards", str(shards), "--out-dir", str(out), "--threads", "1"])


@pytest.fixture(scope="module")
def trained(ft_exp, tmp_path_factory):
    """The base cells and the fine-tuning rows trained in full (today's path), once."""
    shards, cells = ft_exp
    root = tmp_path_factory.mktemp("ftruns")
    return {label: train(c, shards, root / label) for label, c in cells.items() if "finetune" not in c} | {"_root": root}


@pytest.mark.parametrize("label,base", [("fedavg_ft", "fedavg"), ("fedprox_ft", "fedprox")])
def test_derived_row_is_byte_identical_to_the_trained_row(ft_exp, trained, tmp_path, label, base):
    shards, cells = ft_exp
    root = trained["_root"]
    assert (root / base / FINAL_MODEL).is_file()
    assert finetune(cells[label], cells[base], shards, tmp_path, root / base / FINAL_MODEL) == 0
    derived = json.loads((tmp_path / "metrics.json").read_text())
    full = trained[label]
    assert json.dumps(strip_timing(derived)) == json.dumps(strip_timing(full))
    # the case is not trivial: fine-tuned, personalized-rule, unseen and union scores are all there
    assert full["clients"]["scored_by"].count("personalize") == 2 and full["curves"]["round"] == [1, 2]
    assert full["curves"]["personal_acc"]["mean"][0] is None
    assert full["summary"]["personal_acc"]["mean"] is not None and "unseen_personal_acc" in full["summary"]
    assert "union_personal_acc" in full["summary"] and full["best_val"] is not None
    assert derived["resources"]["train_time_s"] == 0.0 and derived["resources"]["finetuned_from"] == base
    note = finetune_note(summary_frame([trained[base], derived]))  # the tables' note says how the row was made
    assert note.startswith(f"{label} (personal) is {base}'s final model") and finetune_note(summary_frame([full])) == ""
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["derived_from"]["identity"]["label"] == base


def test_final_model_of_another_cell_is_refused(ft_exp, trained, tmp_path, capsys):
    shards, cells = ft_exp
    foreign = trained["_root"] / "fedprox" / FINAL_MODEL  # fedprox's model offered as fedavg's
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path, foreign) == 2
    err = capsys.readouterr().err
    assert "belongs to another cell" in err and "fedprox" in err and "Traceback" not in err
    assert not (tmp_path / "metrics.json").exists()
    other_seed = copy.deepcopy(cells["fedavg"]) | {"seed": 1}  # same label, another seed
    assert finetune(cells["fedavg_ft"] | {"seed": 1}, other_seed, shards, tmp_path, trained["_root"] / "fedavg" / FINAL_MODEL) == 2
    assert "field 'seed' is 0, expected 1" in capsys.readouterr().err


def test_damaged_final_model_is_refused(ft_exp, trained, tmp_path, capsys):
    shards, cells = ft_exp
    bad = tmp_path / FINAL_MODEL
    bad.write_bytes((trained["_root"] / "fedavg" / FINAL_MODEL).read_bytes()[:200])
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path / "out", bad) == 2
    err = capsys.readouterr().err
    assert "truncated or damaged" in err and "Traceback" not in err
    state = torch.load(trained["_root"] / "fedavg" / FINAL_MODEL, weights_only=True)
    state["history"] = state["history"][:-1]  # this cell's identity, but not its finished run
    torch.save(state, bad)
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path / "out", bad) == 2
    assert "inconsistent with the cell's 2 rounds" in capsys.readouterr().err


def test_base_without_final_model_keeps_or_trains_the_row(ft_exp, trained, tmp_path, capsys):
    """An experiment trained before final models were kept: the row's own finished metrics.json is
    kept; without it the row is trained in full (the same result)."""
    shards, cells = ft_exp
    absent = tmp_path / "old_base" / FINAL_MODEL
    kept = tmp_path / "kept"
    kept.mkdir()
    text = (trained["_root"] / "fedavg_ft" / "metrics.json").read_text()
    (kept / "metrics.json").write_text(text)
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, kept, absent) == 0
    assert "kept" in capsys.readouterr().err and (kept / "metrics.json").read_text() == text
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path / "full", absent) == 0
    assert "training fedavg_ft in full" in capsys.readouterr().err
    redone = json.loads((tmp_path / "full" / "metrics.json").read_text())
    assert strip_timing(redone) == strip_timing(json.loads(text))
    # a "+FT" row has no trained form: its base must be retrained
    assert finetune(cells["ditto_ft"], cells["ditto"], shards, tmp_path / "d", absent) == 2
    assert "retrain it" in capsys.readouterr().err


def test_final_model_file_holds_only_weights_and_identity(trained):
    state = torch.load(trained["_root"] / "fedavg" / FINAL_MODEL, weights_only=True)
    assert state["identity"]["label"] == "fedavg" and state["round"] == 2
    assert set(state) == {"identity", "round", "server", "rng", "history", "per_round"}


def test_base_must_match_the_row(ft_exp):
    _, cells = ft_exp
    assert base_problem(cells["fedavg_ft"], cells["fedavg"]) is None
    assert "fine-tunes 'fedavg'" in base_problem(cells["fedavg_ft"], cells["fedprox"])
    early = copy.deepcopy(cells["fedavg_ft"])
    early["training"]["personal_eval_every"] = 1  # a per-round fine-tuned curve: keeps training
    assert "during training" in base_problem(early, cells["fedavg"])
    other = copy.deepcopy(cells["fedavg_ft"])
    other["training"]["local_epochs"] = 2
    assert "training differs" in base_problem(other, cells["fedavg"])


def test_plus_ft_row_of_a_method_without_ft_variant(ft_exp, trained, tmp_path, capsys):
    shards, cells = ft_exp
    row, final = cells["ditto_ft"], trained["_root"] / "ditto" / FINAL_MODEL
    assert row["method"] == "ditto" and row["finetune"] == "ditto" and row["hparams"]["ft_epochs"] == 2
    assert base_problem(row, cells["ditto"]) is None
    for out in ("a", "b"):
        assert finetune(row, cells["ditto"], shards, tmp_path / out, final) == 0
    got = json.loads((tmp_path / "a" / "metrics.json").read_text())
    again = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert strip_timing(got) == strip_timing(again)  # deterministic
    ditto = trained["ditto"]
    assert got["cell"]["label"] == "ditto_ft" and got["cell"]["method"] == "ditto"
    for name in ("global_acc", "global_f1"):  # ditto's global model, as ditto's own cell scored it
        assert got["curves"][name] == ditto["curves"][name]
    assert got["curves"]["personal_acc"]["mean"][0] is None  # fine-tuned once, after training
    assert got["summary"]["personal_acc"]["mean"] != ditto["summary"]["personal_acc"]["mean"]  # not ditto's personal models
    # the row is never trained as a cell: its method would be ditto's, without fine-tuning
    assert main(["train", "--cell", json.dumps(row), "--shards", str(shards), "--out-dir", str(tmp_path / "t")]) == 2
    assert "fine-tuning row of label 'ditto'" in capsys.readouterr().err


@pytest.mark.parametrize("entry,words", [
    ({"finetune": "local"}, ["methods.x_ft.finetune", "'local'", "no global model"]),
    ({"finetune": "nope"}, ["methods.x_ft.finetune", "'nope'", "allowed: another label"]),
    ({"finetune": "fedavg_ft"}, ["'fedavg_ft'", "fine-tunes already"]),
    ({"finetune": "fedavg", "training": {"rounds": 1}}, ["methods.x_ft.training", "beside 'finetune'"]),
    ({"finetune": "fedavg", "hparams": {"mu": 1}}, ["methods.x_ft.hparams", "mu", "ft_epochs"]),
    ({"finetune": "fedavg", "sweep": {"training.optimizer.lr": [0.1, 0.2]}},
     ["methods.x_ft.sweep.training.optimizer.lr", "hparams keys (ft_*) only"]),
])
def test_plus_ft_config_errors(entry, words):
    cfg = tiny_config()
    cfg["methods"]["x_ft"] = entry
    with pytest.raises(ConfigError) as err:
        resolve_experiment(cfg)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_plus_ft_row_sweeps_its_fine_tuning_hparams(capsys, tmp_path):
    """A "+FT" row with a sweep of its ft_* hparams: one derived row per value, each from the same base."""
    cfg = tiny_config()
    cfg["methods"]["x_ft"] = {"finetune": "fedavg", "sweep": {"hparams.ft_epochs": [1, 2]}}
    rows = {c["label"]: c for c in resolve_experiment(cfg)["cells"] if c.get("finetune")}
    assert {label: (c["method"], c["hparams"]["ft_epochs"]) for label, c in rows.items()} == {
        "x_ft-ft_epochs1": ("fedavg", 1), "x_ft-ft_epochs2": ("fedavg", 2)}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["validate", str(path)]) == 0
    assert "derived (fine-tuning rows scored from their base cell's final model, not trained: x_ft-ft_epochs1 <- fedavg, " \
           "x_ft-ft_epochs2 <- fedavg)" in capsys.readouterr().out


# -- final models that are not believed (issue 46) --------------------------------------------------

def base_copy(trained, tmp_path: Path, label: str, provenance=lambda doc: doc) -> Path:
    """A copy of base cell `label`'s run folder without its final model (its provenance.json passed
    through `provenance`): where the final model is then put, or found missing."""
    src, dst = trained["_root"] / label, tmp_path / f"base_{label}"
    dst.mkdir(parents=True)
    (dst / "metrics.json").write_bytes((src / "metrics.json").read_bytes())
    (dst / "provenance.json").write_text(json.dumps(provenance(json.loads((src / "provenance.json").read_text()))))
    return dst


def edited(trained, change) -> dict:
    """fedavg's final model, changed by `change`."""
    state = torch.load(trained["_root"] / "fedavg" / FINAL_MODEL, weights_only=True)
    change(state)
    return state


def first_param(state: dict) -> str:
    return next(iter(state["server"]["global"]))


@pytest.mark.parametrize("change,words", [
    (lambda s: s["rng"].update(cpu=torch.zeros(10, dtype=torch.uint8)),
     "rng.cpu is a uint8 tensor of shape (10,); expected a uint8 tensor of shape (5056,)"),
    (lambda s: s["rng"].update(cpu=torch.get_rng_state().double()), "rng.cpu is a float64 tensor of shape (5056,)"),
    (lambda s: s["server"]["global"].update({first_param(s): torch.zeros(3, 3)}), "a float32 tensor of shape (3, 3); expected"),
    (lambda s: s["server"]["global"].update({first_param(s): s["server"]["global"][first_param(s)].half()}), "is a float16 tensor"),
    (lambda s: s["server"]["global"].pop(first_param(s)), "is missing"),
    (lambda s: s["server"]["global"].update(extra=torch.zeros(1)), "server.global.extra is unknown"),
    (lambda s: s["server"].update({"global": "weights"}), "server.global is a str; expected a dict"),
], ids=["rng-size", "rng-dtype", "param-shape", "param-dtype", "param-missing", "param-unknown", "params-not-a-dict"])
def test_final_model_that_does_not_fit_the_model_is_refused(ft_exp, trained, tmp_path, capsys, change, words):
    """Tensors of another shape or dtype than the row's model and torch's random generator take are
    refused before any is used (torch.set_rng_state would raise with a traceback), naming the key."""
    shards, cells = ft_exp
    final = base_copy(trained, tmp_path, "fedavg") / FINAL_MODEL
    torch.save(edited(trained, change), final)
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path / "row", final) == 2
    err = capsys.readouterr().err
    assert f"final model {final} does not fit the cell's model and random generator" in err and words in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "row" / "metrics.json").exists()


def test_oversized_final_model_is_refused_unread(ft_exp, trained, tmp_path, capsys, monkeypatch):
    """A final model larger than the cell's model and records can be (here a 24 MB random state) is
    refused by its size, before torch reads it."""
    shards, cells = ft_exp
    final = base_copy(trained, tmp_path, "fedavg") / FINAL_MODEL
    torch.save(edited(trained, lambda s: s["rng"].update(cpu=torch.zeros(24 << 20, dtype=torch.uint8))), final)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load of an oversized final model"))
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path / "row", final) == 2
    err = capsys.readouterr().err
    assert re.search(rf"final model {re.escape(str(final))} holds {final.stat().st_size:,} bytes; allowed: at most [\d,]+ "
                     r"\(its cell's model and records\); retrain its cell", err), err
    assert "Traceback" not in err and not (tmp_path / "row" / "metrics.json").exists()


def test_deleted_final_model_is_told_from_one_never_kept(ft_exp, trained, tmp_path, capsys):
    """A cell's provenance.json records the final model it kept: one deleted since is said missing,
    with how to regenerate it (the row is neither kept nor trained in full); a cell trained before
    final models were kept records none."""
    shards, cells = ft_exp
    kept = json.loads((trained["_root"] / "fedavg" / "provenance.json").read_text())["final_model"]
    assert kept == {"file": FINAL_MODEL, "sha256": sha256_file(trained["_root"] / "fedavg" / FINAL_MODEL)}
    for row, base in (("fedavg_ft", "fedavg"), ("ditto_ft", "ditto")):  # a row with a trained form, a "+FT" row
        final = base_copy(trained, tmp_path, base) / FINAL_MODEL
        assert finetune(cells[row], cells[base], shards, tmp_path / row, final) == 2
        err = capsys.readouterr().err
        assert f"final model {final} is missing: its cell {base}/seed0 kept one" in err, err
        assert f"retrain that cell to regenerate it (delete its metrics.json, or snakemake --forcerun {final.parent}/metrics.json)" in err
        assert "before final models were kept" not in err and "Traceback" not in err
        assert not (tmp_path / row / "metrics.json").exists()
    old = base_copy(trained, tmp_path / "old", "ditto", lambda doc: {k: v for k, v in doc.items() if k != "final_model"})
    assert finetune(cells["ditto_ft"], cells["ditto"], shards, tmp_path / "old_row", old / FINAL_MODEL) == 2
    err = capsys.readouterr().err
    assert "was trained before final models were kept (its provenance.json records none); retrain it" in err, err


def test_derived_row_records_the_final_model_it_was_scored_from(ft_exp, trained, tmp_path, capsys):
    """The row's provenance.json records the sha256 of the final model it read; a final model of the
    right cell and layout that is not the one its cell's provenance.json records was replaced after
    training and is refused."""
    shards, cells = ft_exp
    final = base_copy(trained, tmp_path, "fedavg") / FINAL_MODEL
    final.write_bytes((trained["_root"] / "fedavg" / FINAL_MODEL).read_bytes())
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path / "row", final) == 0
    derived = json.loads((tmp_path / "row" / "provenance.json").read_text())["derived_from"]
    assert derived["sha256"] == sha256_file(final) and derived["final_model"] == str(final)

    def nudge(state):
        state["server"]["global"][first_param(state)] += 0.01  # same cell, same layout, other weights

    torch.save(edited(trained, nudge), final)
    assert finetune(cells["fedavg_ft"], cells["fedavg"], shards, tmp_path / "row2", final) == 2
    err = capsys.readouterr().err
    assert f"final model {final} is not the one its cell kept (sha256 {sha256_file(final)[:12]}..., its provenance.json " \
           f"records {derived['sha256'][:12]}...): it was replaced after training; retrain its cell" in err, err
    assert not (tmp_path / "row2" / "metrics.json").exists()


# -- the workflow -----------------------------------------------------------------------------------

def workflow_config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    cfg["experiment"] = "ftrows"
    cfg["partitions"] = {"dir0.5": cfg["partitions"]["dir0.5"]}
    cfg["seeds"] = [0]
    cfg["training"]["rounds"] = 2
    cfg["methods"]["fedavg_ft"]["training"] = {"personal_eval_every": 2}  # scored after training only: derived
    path = tmp_path / "ftrows.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_workflow_plans_the_row_after_its_base_without_training_it(tmp_path):
    from test_workflow import snakemake

    config = workflow_config(tmp_path)
    dag = snakemake("--dag", "dot", "--configfile", str(config), "--cores", "2", cwd=tmp_path).stdout
    jobs = {n: (rule, label) for n, rule, label in re.findall(r'^\s*(\d+)\[label = "(\w+)(?:\\nlabel: (\w+))?', dag, re.M)}
    edges = set(re.findall(r"^\s*(\d+) -> (\d+)$", dag, re.M))
    assert sorted(job for job in jobs.values() if job[0] in ("train", "finetune")) == [
        ("finetune", "fedavg_ft"), ("train", "fedavg"), ("train", "local")]  # fedavg_ft is not trained again
    node = {job: n for n, job in jobs.items()}
    assert (node["train", "fedavg"], node["finetune", "fedavg_ft"]) in edges  # after its base's training job


def test_replaced_final_model_makes_the_row_stale(tmp_path):
    """A final model replaced after its cell trained (newer than its metrics.json) is an input of the
    rows scored from it: `snakemake -n` plans the row again, not the base; a finished experiment
    whose final models are as training wrote them plans nothing."""
    import os

    from test_workflow import snakemake

    from fedrepro.planning import WorkflowPlan

    config = workflow_config(tmp_path)
    plan = WorkflowPlan(resolve_experiment(yaml.safe_load(config.read_text())))
    cells = {c["label"]: c for c in plan.exp["cells"]}
    base, row = (tmp_path / plan.run_dir(cells[label]) for label in ("fedavg", "fedavg_ft"))
    # a finished experiment as its jobs leave it, oldest first (rule train writes the final model first)
    files = [tmp_path / plan.raw_marker("digits"), tmp_path / plan.shard_dir("digits", "dir0.5"),
             base / FINAL_MODEL, base / "provenance.json", base / "metrics.json", row / "provenance.json", row / "metrics.json"]
    files[1].mkdir(parents=True)
    for i, path in enumerate(files):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path != files[1]:
            path.write_text("{}")
        os.utime(path, (1e9 + i, 1e9 + i))
    target = str(row.relative_to(tmp_path) / "metrics.json")
    assert "Nothing to be done" in snakemake("-n", target, "--configfile", str(config), cwd=tmp_path).stdout
    (base / FINAL_MODEL).write_text("another model")  # replaced: newer than its cell's metrics.json
    plan_text = snakemake("-n", target, "--configfile", str(config), cwd=tmp_path).stdout
    assert set(re.findall(r"^(\w+)\s+(\d+)$", plan_text, re.M)) == {("finetune", "1"), ("total", "1")}, plan_text  # job stats
    assert f"Reason: Updated input files: {base.relative_to(tmp_path) / FINAL_MODEL}" in plan_text, plan_text



@pytest.mark.slow
def test_row_scored_with_its_base_is_up_to_date_until_the_final_model_is_replaced(tmp_path):
    """The real workflow: a row scored in the run that trains its base is up to date afterwards (its
    inputs as Snakemake recorded them); a final model replaced since makes it stale, and its job
    then refuses the file."""
    from test_workflow import snakemake

    config = workflow_config(tmp_path)
    row = "results/ftrows/runs/digits/dir0.5/fedavg_ft/seed0/metrics.json"
    final = tmp_path / "results/ftrows/runs/digits/dir0.5/fedavg/seed0" / FINAL_MODEL
    args = (row, "--configfile", str(config), "--cores", "2", "--set-threads", "train=1", "finetune=1")
    snakemake(*args, cwd=tmp_path)
    assert "Nothing to be done" in snakemake("-n", *args, cwd=tmp_path).stdout
    state = torch.load(final, weights_only=True)
    state["server"]["global"][first_param(state)] += 0.01  # another model of the same layout
    torch.save(state, final)
    assert f"Reason: Updated input files: {final.relative_to(tmp_path)}" in snakemake("-n", *args, cwd=tmp_path).stdout
    assert snakemake(*args, cwd=tmp_path, check=False).returncode != 0
    log = tmp_path / "results/ftrows/logs/finetune/digits/dir0.5/fedavg_ft/seed0.log"
    assert "is not the one its cell kept" in log.read_text()

#: The last commit before fine-tuning rows were derived (issue 38): its workflow trained every row.
BEFORE_DERIVED_ROWS = "69faaab"


@pytest.mark.slow
def test_experiment_finished_before_the_upgrade_retrains_nothing(tmp_path):
    """The upgrade path with the real workflows: an experiment finished by the code before derived rows
    (its Snakefile and package, from git) is rerun by today's. No cell trains again; the fine-tuning
    row's job keeps the row's metrics.json (its base kept no final model), byte for byte."""
    import io
    import os
    import subprocess
    import sys
    import tarfile

    from test_workflow import snakemake

    old = tmp_path / "old"
    archive = subprocess.run(["git", "archive", BEFORE_DERIVED_ROWS], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(old, filter="data")
    work = tmp_path / "work"
    work.mkdir()
    config = workflow_config(work)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": str(old / "src")}  # the old package first: its `fedrepro` jobs too
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(old / "Snakefile"), "--directory", str(work),
                           "--configfile", str(config), "--cores", "2", "--set-threads", "train=1"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = work / "results" / "ftrows" / "runs" / "digits" / "dir0.5"
    before = {label: (runs / label / "seed0" / "metrics.json").read_bytes() for label in ("local", "fedavg", "fedavg_ft")}
    assert not (runs / "fedavg" / "seed0" / FINAL_MODEL).exists()  # the old code kept no final model

    again = snakemake("--configfile", str(config), "--cores", "2", "--set-threads", "train=1", "finetune=1", cwd=work)
    log = again.stdout + again.stderr
    assert "training cell" not in log and re.search(r"Finished jobid: \d+ \(Rule: finetune\)", log), log[-4000:]
    after = {label: (runs / label / "seed0" / "metrics.json").read_bytes() for label in before}
    assert after == before
    row_log = work / "results" / "ftrows" / "logs" / "finetune" / "digits" / "dir0.5" / "fedavg_ft" / "seed0.log"
    assert "is already this row's (trained in full): kept" in row_log.read_text()
