"""Hyper-parameter tuning on validation data: search spaces, trials, selection, the DAG."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import REPO, TINY_HPARAMS, TINY_MODELS, kill_in_round_3_and_resume, tiny_config
from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.custody import expected_token, parse_token, read_metrics
from fedrepro.data.shards import load_partition
from fedrepro.engine.data import carve_validation, load_clients
from fedrepro.engine.run import train_cell
from fedrepro.methods import METHODS
from fedrepro.registry import ConfigError
from fedrepro.tuning import default_spaces, method_space, select_winner, trial_id, trial_points

CPU = torch.device("cpu")


def tuning_config(tuning: dict | None = None, **training) -> dict:
    config = tiny_config(**training)
    config["methods"] = {"local": {}, "fedavg": {}, "fedprox": {}}
    config["tuning"] = {"val_fraction": 0.25, "training": {"rounds": 1}, "lr": [0.01, 0.1],
                        "methods": {"local": {}, "fedprox": {"mu": [0.01, 1.0]}}, **(tuning or {})}
    return config


# ----------------------------------------------------------------------------- selection


def fake_run(trial: str, seed: int, val: float, test: float, personal: bool = True) -> dict:
    """A trial's metrics.json whose validation and test accuracies are `val` and `test`."""
    stats = lambda v: {"weighted_mean": v, "mean": v, "std": 0.0, "min": v, "max": v, "worst10": v}  # noqa: E731
    kinds = ("global", "personal") if personal else ("global",)
    return {"trial": trial, "seed": seed, "metrics": {
        "status": "ok", "cell": {"method": "ditto"},
        "summary": {f"{k}_acc": stats(test) for k in kinds},
        "best_val": {"summary": {f"{k}_acc": stats(test) for k in kinds}},
        "summary_val": {f"{k}_acc": stats(val) for k in kinds}}}


def test_selection_reads_validation_scores_only_where_test_data_prefers_another_value():
    plan = {"space": {"lam": [0.1, 1.0]}, "trials": [{"id": "ta", "values": {"lam": 0.1}}, {"id": "tb", "values": {"lam": 1.0}}]}
    # test accuracy prefers lam = 1.0 (tb) by far; validation prefers lam = 0.1 (ta)
    runs = [fake_run("ta", 0, val=0.70, test=0.40), fake_run("tb", 0, val=0.60, test=0.95)]
    record = select_winner(plan, runs, {"model": "auto", "stat": "weighted_mean"})
    assert record["winner"]["values"] == {"lam": 0.1}
    assert [t["score"] for t in record["trials"]] == [0.70, 0.60]
    assert record["metric"]["split"] == "val" and record["metric"]["model_used"] == ["personal"]
    # the scores come from summary_val alone: removing every test-based entry changes nothing
    for r in runs:
        del r["metrics"]["summary"], r["metrics"]["best_val"]
    assert select_winner(plan, runs, {"model": "auto", "stat": "weighted_mean"}) == record


def test_selection_metric_stat_model_seeds_and_failed_trials():
    plan = {"space": {"lr": [0.01, 0.1]}, "trials": [{"id": "ta", "values": {"lr": 0.01}}, {"id": "tb", "values": {"lr": 0.1}}]}
    runs = [fake_run("ta", 0, 0.8, 0.5), fake_run("ta", 1, 0.4, 0.5), fake_run("tb", 0, 0.7, 0.5), fake_run("tb", 1, 0.6, 0.5)]
    record = select_winner(plan, runs, {"model": "auto", "stat": "weighted_mean"})
    assert record["winner"]["id"] == "tb" and record["trials"][0]["score"] == pytest.approx(0.6)  # mean over seeds
    runs[0]["metrics"]["summary_val"]["personal_acc"]["worst10"] = 0.9
    runs[1]["metrics"]["summary_val"]["personal_acc"]["worst10"] = 0.9
    assert select_winner(plan, runs, {"model": "auto", "stat": "worst10"})["winner"]["id"] == "ta"
    runs[0]["metrics"]["summary_val"]["global_acc"]["weighted_mean"] = 0.99
    assert select_winner(plan, runs, {"model": "global", "stat": "weighted_mean"})["winner"]["id"] == "ta"
    runs[2]["metrics"] = {"status": "failed", "cell": {"method": "ditto"}}  # a diverged seed fails its trial
    record = select_winner(plan, runs, {"model": "auto", "stat": "weighted_mean"})
    assert record["winner"]["id"] == "ta" and record["trials"][1]["score"] is None
    global_only = [fake_run("ta", 0, 0.5, 0.5, personal=False), fake_run("tb", 0, 0.6, 0.5, personal=False)]
    record = select_winner(plan, global_only, {"model": "auto", "stat": "weighted_mean"})
    assert record["winner"]["id"] == "tb" and record["metric"]["model_used"] == ["global"]


def test_validation_is_carved_from_training_data_and_test_data_never_loaded(tiny_partition):
    manifest, shards = load_partition(tiny_partition[0])
    plain = load_clients(manifest, shards, CPU)
    carved = load_clients(manifest, shards, CPU, val_from_train=0.25, seed=3)
    again = load_clients(manifest, shards, CPU, val_from_train=0.25, seed=3)
    other = load_clients(manifest, shards, CPU, val_from_train=0.25, seed=4)
    for p, c, a, o in zip(plain, carved, again, other):
        assert len(c.train) + len(c.val) == len(p.train) and len(c.val) == round(0.25 * len(p.train))
        rows = {tuple(r) for r in p.train.x.flatten(1).tolist()}
        for split in (c.train, c.val, c.test):  # every row a trial sees comes from the training split
            assert all(tuple(r) in rows for r in split.x.flatten(1).tolist())
        assert torch.equal(c.test.x, c.val.x) and torch.equal(c.test.y, c.val.y)  # the test slot holds validation
        assert torch.equal(c.val.x, a.val.x)  # deterministic from (seed, client)
    assert any(not torch.equal(c.val.y, o.val.y) or not torch.equal(c.val.x, o.val.x) for c, o in zip(carved, other))
    (xt, yt), (xv, yv) = carve_validation(np.arange(50), np.arange(50), 0.2, 0)
    assert len(yv) == 10 and not set(yv) & set(yt) and sorted([*yt, *yv]) == list(range(50))  # disjoint, complete
    (xt, yt), (xv, yv) = carve_validation(np.arange(2), np.arange(2), 0.01, 0)
    assert len(yt) == 1 and len(yv) == 1  # at least one validation sample, never the whole train split


# ----------------------------------------------------------------------------- config and trials


def test_tuning_block_expands_into_trials_and_tuned_final_cells():
    exp = resolve_experiment(tuning_config())
    labels = exp["tuning"]["labels"]
    assert set(labels) == {"fedavg", "fedprox"}  # local: an empty space, nothing to tune
    assert [t["values"] for t in labels["fedavg"]["trials"]] == [{"lr": 0.01}, {"lr": 0.1}]
    assert [t["values"] for t in labels["fedprox"]["trials"]] == [{"mu": 0.01}, {"mu": 1.0}]
    assert {c["label"]: c.get("tuned", False) for c in exp["cells"]} == {"local": False, "fedavg": True, "fedprox": True}
    assert "tuned" not in resolve_experiment(tiny_config())["cells"][0]  # untuned cells as before: no rerun
    trials = exp["tuning_cells"]
    assert len(trials) == 4 and all(c["validation"] == {"from_train": 0.25} for c in trials)
    assert all(c["training"]["rounds"] == 1 and c["training"]["global_test"] == [] for c in trials)
    longer = resolve_experiment(tuning_config({"training": {"rounds": 4}}, eval_every=1, global_test=["union"]))
    assert {(c["training"]["rounds"], c["training"]["eval_every"]) for c in longer["tuning_cells"]} == {(4, 4)}
    assert all(c["training"]["global_test"] == [] for c in longer["tuning_cells"])
    assert all(c["training"]["global_test"] == ["union"] for c in longer["cells"])
    # a trial scores its last round only: the final cells' personal_eval_every (2, not a multiple of the
    # trial's eval_every 4) is dropped from the trials, not rejected
    sparse = resolve_experiment(tuning_config({"training": {"rounds": 4}}, eval_every=1, personal_eval_every=2))
    assert all("personal_eval_every" not in c["training"] for c in sparse["tuning_cells"])
    assert all(c["training"]["personal_eval_every"] == 2 for c in sparse["cells"])
    assert sorted(c["training"]["optimizer"]["lr"] for c in trials if c["label"] == "fedavg") == [0.01, 0.1]
    assert sorted(c["hparams"]["mu"] for c in trials if c["label"] == "fedprox") == [0.01, 1.0]
    assert exp == resolve_experiment(tuning_config())  # deterministic
    assert "tuning_cells" in exp and resolve_experiment(tiny_config())["tuning"] is None


def test_default_spaces_and_random_sample_are_seeded():
    exp = resolve_experiment(tuning_config({"methods": {}, "search": "random", "samples": 3, "sample_seed": 7}))
    fedprox = [t["values"] for t in exp["tuning"]["labels"]["fedprox"]["trials"]]
    assert len(fedprox) == 3 and all(set(v) == {"lr", "mu"} for v in fedprox)
    grid = [dict(zip(("lr", "mu"), p)) for p in __import__("itertools").product([0.01, 0.1], [0.001, 0.01, 0.1, 1.0])]
    assert all(v in grid for v in fedprox)
    again = resolve_experiment(tuning_config({"methods": {}, "search": "random", "samples": 3, "sample_seed": 7}))
    assert again["tuning"] == exp["tuning"]
    space = {"lr": [0.01, 0.1], "mu": [0.001, 0.01, 0.1, 1.0]}
    samples = {tuple(map(trial_id, trial_points(space, "random", 3, s))) for s in range(6)}
    assert len(samples) > 1  # the sample depends on the seed
    assert trial_points(space, "random", 100, 0) == trial_points(space, "grid", None, 0)
    # a point's trial id does not depend on the rest of the space: results are reused
    assert trial_id({"lr": 0.1, "mu": 0.01}) == trial_id({"mu": 0.01, "lr": 0.1})


def check_default_space(name: str) -> None:
    """The method's default space (search_spaces.yaml, its class's, or the shared lr grid) is cited
    and every value passes the method's parameter checks."""
    entry = method_space(name)
    assert entry["source"].strip()
    cfg = tuning_config({"methods": {}})
    cfg["methods"] = {"m": {"method": name, "hparams": copy.deepcopy(TINY_HPARAMS.get(name, {}))}}
    for needed in METHODS.get(name).models[:1]:  # e.g. FedGCR's prompted ViT
        cfg["datasets"] = {ds: {**spec, "model": copy.deepcopy(TINY_MODELS[needed])} for ds, spec in cfg["datasets"].items()}
    space = resolve_experiment(cfg)["tuning"]["labels"]["m"]["space"]
    lr_grid = cfg["tuning"].get("lr") or default_spaces()["lr"]["values"]
    assert space == {"lr": lr_grid, **entry["params"]}


def test_every_registered_method_has_a_cited_default_space_of_valid_values(capsys):
    assert set(default_spaces()["methods"]) <= set(METHODS.names())  # no entry for a method that is gone
    for name in METHODS.names():
        check_default_space(name)
    assert main(["list", "methods"]) == 0
    out = capsys.readouterr().out
    assert "tuning space: lr in [0.005, 0.01, 0.05, 0.1], mu in [0.001, 0.01, 0.1, 1.0]" in out
    assert "FedProx (Li et al., MLSys 2020)" in out


@pytest.mark.parametrize("tuning, message", [
    ({"methods": {"fedprox": {"alpha": [0.1]}}}, r"'tuning.methods.fedprox.alpha': unknown parameter 'alpha'; allowed parameters: lr, mu"),
    ({"methods": {"fedprox": {"mu": []}}}, r"'tuning.methods.fedprox.mu' has value \[\]; allowed: a non-empty list"),
    ({"methods": {"fedprox": {"mu": "0.1"}}}, r"'tuning.methods.fedprox.mu' has value '0.1'; allowed: a non-empty list"),
    ({"methods": {"fedprox": {"mu": [0.1, "big"]}}}, r"key 'mu\[1\]' has value 'big' of type str; allowed: float/int"),
    ({"methods": {"fedprox": {"lr": [0.1, -1.0]}}}, r"key 'lr\[1\]' has value -1.0; allowed: > 0"),
    ({"methods": {"fedprox": {"mu": [0.1, 0.1]}}}, r"'tuning.methods.fedprox.mu' has value \[0.1, 0.1\]; allowed: no duplicates"),
    ({"methods": {"fedrep": {}}}, r"'tuning.methods' names \['fedrep'\]; allowed: the experiment's method labels"),
    ({"lr": []}, r"'tuning.lr' has value \[\]; allowed: a non-empty list"),
    ({"search": "random"}, r"'tuning.samples' is missing; allowed: an integer >= 1"),
    ({"search": "bayes"}, r"'tuning.search' has value 'bayes'; allowed: one of \['grid', 'random'\]"),
    ({"val_fraction": 1.5}, r"'tuning.val_fraction' has value 1.5; allowed: < 1"),
    ({"metric": {"stat": "std"}}, r"'tuning.metric.stat' has value 'std'; allowed: one of"),
    ({"typo": 1}, r"'tuning': unknown key\(s\) \['typo'\]"),
])
def test_bad_search_space_is_rejected_naming_key_value_and_allowed(tuning, message):
    with pytest.raises(ConfigError, match=message):
        resolve_experiment(tuning_config(tuning))


# ----------------------------------------------------------------------------- trials run


def trial_cells(label: str = "fedprox") -> list[dict]:
    exp = resolve_experiment(tuning_config(rounds=3, checkpoint_every=1))
    return [c for c in exp["tuning_cells"] if c["label"] == label]


def test_a_trial_scores_validation_deterministically_and_a_killed_trial_resumes(tiny_partition, tmp_path, monkeypatch):
    cell = copy.deepcopy(trial_cells()[0])
    cell["partition_id"] = tiny_partition[1]["partitions"][0]["id"]
    cell["training"]["rounds"] = 3
    full = train_cell(cell, tiny_partition[0], tmp_path / "full", progress=False)
    assert full["summary_val"]["global_acc"]["weighted_mean"] is not None
    assert full["summary"] == full["summary_val"]  # no test data in a trial: its "test" scores are validation ones
    assert full["clients"]["val_size"] == [len(c.val) for c in load_clients(*load_partition(tiny_partition[0]), CPU,
                                                                             val_from_train=0.25, seed=0)]
    ckpt = tmp_path / "ckpt.pt"
    run = lambda: train_cell(cell, tiny_partition[0], tmp_path / "resumed", checkpoint=ckpt, progress=False)
    resumed = kill_in_round_3_and_resume(monkeypatch, "fedprox", run, ckpt)
    for key in ("summary_val", "final_val", "summary", "final"):
        assert resumed[key] == full[key]


def test_select_and_tuned_training_through_the_cli(tiny_partition, tmp_path):
    shards = tiny_partition[0]
    pid = tiny_partition[1]["partitions"][0]["id"]
    exp = resolve_experiment(tuning_config())
    runs = []
    for c in [c for c in exp["tuning_cells"] if c["label"] == "fedprox"]:
        c = {**c, "partition_id": pid}
        out = tmp_path / c["trial"]
        train_cell(c, shards, out, progress=False)
        runs.append({"trial": c["trial"], "seed": c["seed"], "metrics": str(out / "metrics.json")})
    plan = exp["tuning"]["labels"]["fedprox"]
    spec = {"dataset": "digits", "partition": "dir", "label": "fedprox", "method": "fedprox", "space": plan["space"],
            "trials": plan["trials"], "metric": exp["tuning"]["metric"], "runs": runs}
    sel = tmp_path / "fedprox.json"
    assert main(["select", "--spec", json.dumps(spec), "--out", str(sel)]) == 0
    record = json.loads(sel.read_text())
    scores = [json.loads(open(r["metrics"]).read())["summary_val"]["global_acc"]["weighted_mean"] for r in runs]
    assert record["winner"]["score"] == max(scores)
    final = {**next(c for c in exp["cells"] if c["label"] == "fedprox"), "partition_id": pid}
    assert main(["train", "--cell", json.dumps(final), "--shards", str(shards), "--out-dir", str(tmp_path / "f")]) == 2
    assert main(["train", "--cell", json.dumps(final), "--shards", str(shards), "--out-dir", str(tmp_path / "f"),
                 "--tuned", str(sel)]) == 0
    prov = json.loads((tmp_path / "f" / "provenance.json").read_text())
    assert prov["cell"]["hparams"]["mu"] == record["winner"]["values"]["mu"]
    # the metrics are the tuned cell's as the aggregate rule expects it (its hash before the selection)
    read_metrics(tmp_path / "f" / "metrics.json", parse_token(expected_token(final)))
    assert prov["cell"]["tuned"]["trial"] == record["winner"]["id"]
    assert main(["tuning-report", str(sel), "--table", str(tmp_path / "tuning"), "--plot", str(tmp_path / "t.png")]) == 0
    assert f"mu={record['winner']['values']['mu']:g}" in (tmp_path / "tuning.md").read_text()
    table = pd.read_csv(tmp_path / "tuning.csv")  # plain CSV, fractions as in summary.csv
    assert table["val_score"].tolist() == [pytest.approx(record["winner"]["score"], abs=1e-9)]
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- the DAG


def test_dag_tunes_selects_then_trains_and_untuned_methods_skip_tuning(tmp_path):
    import yaml

    configfile = tmp_path / "tune.yaml"
    configfile.write_text(yaml.safe_dump(tuning_config()))
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--forceall", "--configfile", str(configfile),
                           "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path), "-p"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    stats = out[out.index("Job stats:"):].splitlines()
    counts = {w[0]: int(w[1]) for w in map(str.split, stats) if len(w) == 2 and w[1].isdigit()}
    # fedavg (lr: 2 points) and fedprox (mu: 2 points) are tuned; local has nothing to tune
    assert (counts["tune_trial"], counts["select"], counts["train_tuned"], counts["train"]) == (4, 2, 2, 1)
    assert counts["tuning_table"] == 1 and counts["tuning_plot"] == 1
    assert "--tuned results/unit/tuning/digits/dir/fedprox.json" in out
    assert "--tuned results/unit/tuning/digits/dir/fedavg.json" in out
    local_cmd = next(line for line in out.splitlines() if "fedrepro train" in line and '"label": "local"' in line)
    assert "--tuned" not in local_cmd


def test_dag_trials_and_tuned_cells_wait_for_the_pretrained_backbone(tmp_path):
    """A tuned label on a model that loads a pre-trained backbone (fedgcr_cpu's q-FFL): its trials and
    its final cells take the backbone as an input, as rule train does, so none starts before
    pretrain_backbone has written it (they failed with 'a checkpoint file that does not exist')."""
    import re

    proc = subprocess.run([sys.executable, "-m", "snakemake", "--dag", "--forceall", "--configfile",
                           str(REPO / "config" / "papers" / "fedgcr_cpu.yaml"), "--snakefile", str(REPO / "Snakefile"),
                           "--directory", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rule_of = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)', proc.stdout, re.M))
    after_backbone = {rule_of[b] for a, b in re.findall(r"^\s*(\d+) -> (\d+)", proc.stdout, re.M)
                      if rule_of[a] == "pretrain_backbone"}
    jobs = [j for j, r in rule_of.items() if r in ("tune_trial", "train_tuned")]
    assert len(jobs) == 6  # 3 trials of q-FFL's lr, 3 tuned final cells
    assert {"tune_trial", "train_tuned", "train"} <= after_backbone
    for j in jobs:
        assert any(rule_of[a] == "pretrain_backbone" for a, b in re.findall(r"^\s*(\d+) -> (\d+)", proc.stdout, re.M)
                   if b == j), rule_of[j]
