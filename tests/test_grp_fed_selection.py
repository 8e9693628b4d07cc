"""GRP-FED's selection rule for λ (paper §4.3, Fig. 4: the value with "the best local test (L)"),
run as tuning on validation data: L on validation (engine.beyond), the tuning metric union_hm,
per-seed selection, and that nothing of it reads the test split."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import REPO, method_engine, tiny_config
from fedrepro.cli import main
from fedrepro.cli_args import check_select_spec
from fedrepro.config import load_and_resolve, resolve_experiment
from fedrepro.engine import beyond, data as engine_data, evaluation, run as engine_run
from fedrepro.engine.run import train_cell
from fedrepro.federation import Split
from fedrepro.io import read_json
from fedrepro.metrics import harmonic_mean, macro_f1
from fedrepro.planning import TuningPlan
from fedrepro.registry import ConfigError
from fedrepro.tuning import check_metric

LAMS = [0.1, 1.0]


def selection_config(tuning: dict | None = None) -> dict:
    """The tiny partition, FedAvg untuned and GRP-FED's λ tuned by L on validation, per seed."""
    config = tiny_config()
    config["methods"] = {"fedavg": {}, "grp_fed": {}}
    config["seeds"] = [0, 1]
    config["tuning"] = {"val_fraction": 0.25, "select": "per_seed", "training": {"rounds": 2},
                        "metric": {"model": "union_hm", "measure": "f1", "stat": "mean"},
                        "methods": {"fedavg": {}, "grp_fed": {"lam": LAMS}}, **(tuning or {})}
    return config


# ----------------------------------------------------------------------------- (a) L on validation


def scrambled(split: Split, seed: int) -> Split:
    """`split` with other features and permuted labels: the same sizes, different data."""
    g = torch.Generator().manual_seed(seed)
    return Split(torch.randn(split.x.shape, generator=g), split.y[torch.randperm(len(split.y), generator=g)])


def rescore(engine) -> tuple[dict, dict]:
    """The last round's evaluation and the beyond-scores, the cached pooled inputs dropped first."""
    engine.scoring.inputs.clear()
    engine.scoring.padded_splits.clear()
    record = evaluation.evaluate(engine)
    return record, beyond.evaluate_beyond(engine, record)


def validation_scores(scores: dict) -> dict:
    return {k: v for k, v in scores.items() if k.startswith(beyond.VAL_PREFIX)}


def test_validation_L_is_computed_from_the_validation_splits_only(tiny_partition, make_cell):
    engine = method_engine(tiny_partition, make_cell, "grp_fed", rounds=2)
    engine.cell["validation"] = {"global_test": ["union"]}  # as a trial of metric union_* asks (tuning.trial_validation)
    assert engine.training["global_test"] == [] and all(len(c.val) and len(c.test) for c in engine.clients)
    from fedrepro.engine.loop import run as run_rounds

    metrics = run_rounds(engine)
    # filed under the validation summary only; no union of TEST splits was asked for, none is there
    assert {f"union_{k}_{m}" for k in ("global", "personal", "hm") for m in ("acc", "f1")} <= set(metrics["summary_val"])
    assert not any(k.startswith("union") for k in metrics["summary"])
    # by hand: each client's personalized model on the union of the VALIDATION splits (G_val), and the
    # harmonic mean with its score on its own validation split (P_val): L_val
    union_x = torch.cat([c.val.x for c in engine.clients])
    union_y = torch.cat([c.val.y for c in engine.clients]).numpy()
    g_val = [macro_f1(union_y, evaluation.predict(engine, evaluation.personal(engine, c), union_x)) for c in engine.clients]
    p_val = metrics["final_val"]["personal"]["f1"]
    assert metrics["final_val"]["union_personal"]["f1"] == pytest.approx(g_val)
    assert metrics["final_val"]["union_hm"]["f1"] == pytest.approx([harmonic_mean(p, g) for p, g in zip(p_val, g_val)])
    assert metrics["summary_val"]["union_hm_f1"]["mean"] == pytest.approx(np.mean([harmonic_mean(p, g) for p, g in zip(p_val, g_val)]))

    record, scores = rescore(engine)
    for i, c in enumerate(engine.clients):  # other test data: the validation L does not move
        c.test = scrambled(c.test, i)
    test_changed, scores_test_changed = rescore(engine)
    assert test_changed["test/personal"] != record["test/personal"]  # the test data did change
    assert validation_scores(scores_test_changed) == validation_scores(scores)
    for i, c in enumerate(engine.clients):  # other validation data: it does
        c.val = scrambled(c.val, 100 + i)
    _, scores_val_changed = rescore(engine)
    assert validation_scores(scores_val_changed)["val:union/hm"] != validation_scores(scores)["val:union/hm"]


# ----------------------------------------------------------------------------- (b) the selection


def run_selection(tiny_partition, tmp_path, monkeypatch, name: str) -> dict:
    """Every GRP-FED trial of `selection_config` trained as the workflow's tune_trial jobs would
    (paths and specs from fedrepro.planning.TuningPlan), then `fedrepro select`: the selection record."""
    shards, pid = tiny_partition[0], tiny_partition[1]["partitions"][0]["id"]
    (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / name)  # the workflow's relative paths, results/unit/tuning/...
    exp = resolve_experiment(selection_config())
    plan = TuningPlan(exp)
    for c in exp["tuning_cells"]:
        train_cell({**c, "partition_id": pid}, shards, plan.trial_dir(c), progress=False)
    wildcards = SimpleNamespace(dataset="digits", partition="dir", label="grp_fed")
    spec = json.loads(plan.select_spec(wildcards))
    assert main(["select", "--spec", json.dumps(spec), "--out", plan.selection_json("digits", "dir", "grp_fed")]) == 0
    return read_json(plan.selection_json("digits", "dir", "grp_fed"))


def tamper(monkeypatch, split: str, change) -> list[int]:
    """Every job's clients read with `change` applied to `split` of each client's shard (as if the
    partition on disk held other data there). Returns the list of clients changed, per job."""
    original = engine_run.load_partition_with_official
    changed: list[int] = []

    def load(*args, **kwargs):
        manifest, shards, official = original(*args, **kwargs)
        for i, s in enumerate(shards):
            s.x[split], s.y[split] = change(s.x[split], s.y[split], i)
        changed.append(len(shards))
        return manifest, shards, official

    monkeypatch.setattr(engine_run, "load_partition_with_official", load)
    return changed


def corrupt(x: np.ndarray, y: np.ndarray, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Other features and permuted labels of the same shapes and types."""
    g = np.random.default_rng(1000 + i)
    return g.permutation(x.reshape(len(x), -1), axis=1).reshape(x.shape)[::-1].copy(), g.permutation(y)


def scores_of(selection: dict) -> list:
    return [(t["values"], t["scores"]) for t in selection["trials"]]


def test_the_chosen_lam_and_every_trial_score_ignore_the_test_split(tiny_partition, tmp_path, monkeypatch):
    selection = run_selection(tiny_partition, tmp_path, monkeypatch, "clean")
    assert [t["values"] for t in selection["trials"]] == [{"lam": v} for v in LAMS]
    assert selection["metric"] == {"model": "union_hm", "measure": "f1", "stat": "mean", "model_used": ["union_hm"],
                                   "split": "val"}
    assert set(selection["winners_by_seed"]) == {"seed0", "seed1"} and selection["select"] == "per_seed"
    for seed, w in selection["winners_by_seed"].items():  # each seed's own best L on validation
        best = max(selection["trials"], key=lambda t: t["scores"][seed])
        assert w["values"] == best["values"] and w["score"] == best["scores"][seed]
    trial_metrics = [read_json(p) for p in sorted((tmp_path / "clean").glob("results/unit/tuning/runs/**/metrics.json"))]
    assert len(trial_metrics) == len(LAMS) * 2 and all("union_hm_f1" in m["summary_val"] for m in trial_metrics)

    # the clients' TEST splits replaced by other data: the same trial scores, bit for bit, and the same λ
    changed = tamper(monkeypatch, "test", corrupt)
    test_changed = run_selection(tiny_partition, tmp_path, monkeypatch, "test_changed")
    assert changed == [4] * len(trial_metrics)  # every trial job read the other test data
    assert scores_of(test_changed) == scores_of(selection)
    assert test_changed["winners_by_seed"] == selection["winners_by_seed"] and test_changed["winner"] == selection["winner"]
    monkeypatch.undo()

    # other VALIDATION data (every carved label shifted to the next class), training data as it was: the
    # scores move, so the check above is not vacuous
    carve = engine_data.carve_validation

    def carve_relabelled(x, y, fraction, seed):
        train, (xv, yv) = carve(x, y, fraction, seed)
        return train, (xv, (yv + 1) % 10)

    monkeypatch.setattr(engine_data, "carve_validation", carve_relabelled)
    val_changed = run_selection(tiny_partition, tmp_path, monkeypatch, "val_changed")
    assert scores_of(val_changed) != scores_of(selection)


def test_each_final_seed_trains_with_its_own_tuning_seeds_winner(tiny_partition, tmp_path):
    shards, pid = tiny_partition[0], tiny_partition[1]["partitions"][0]["id"]
    exp = resolve_experiment(selection_config())
    trials = [{"id": t["id"], "values": t["values"]} for t in exp["tuning"]["labels"]["grp_fed"]["trials"]]
    winners = {"seed0": {**trials[0], "score": 0.5}, "seed1": {**trials[1], "score": 0.6}}
    sel = tmp_path / "grp_fed.json"
    sel.write_text(json.dumps({"dataset": "digits", "partition": "dir", "label": "grp_fed", "method": "grp_fed",
                               "select": "per_seed", "winner": winners["seed1"], "winners_by_seed": winners}))
    final = {**next(c for c in exp["cells"] if c["label"] == "grp_fed" and c["seed"] == 0), "partition_id": pid}
    final["training"] = {**final["training"], "rounds": 1}
    assert main(["train", "--cell", json.dumps(final), "--shards", str(shards), "--out-dir", str(tmp_path / "f"),
                 "--tuned", str(sel)]) == 0
    tuned = read_json(tmp_path / "f" / "provenance.json")["cell"]
    assert tuned["hparams"]["lam"] == LAMS[0]  # seed 0's winner, not the pooled one (seed 1's here)
    assert tuned["tuned"] == {"trial": trials[0]["id"], "values": trials[0]["values"], "select": "per_seed"}
    # a seed the selection has no winner for is refused, naming the file and the seeds it has
    assert main(["train", "--cell", json.dumps({**final, "seed": 5}), "--shards", str(shards), "--out-dir",
                 str(tmp_path / "g"), "--tuned", str(sel)]) == 2


# ----------------------------------------------------------------------------- config


def test_union_metric_trials_score_the_union_of_validation_splits_and_other_trials_are_unchanged():
    exp = resolve_experiment(selection_config())
    assert exp["tuning"]["seeds"] == [0, 1] and exp["tuning"]["select"] == "per_seed"  # per_seed: every seed by default
    trials = exp["tuning_cells"]
    assert len(trials) == 4 and {c["label"] for c in trials} == {"grp_fed"}
    assert all(c["validation"] == {"from_train": 0.25, "global_test": ["union"]} and c["training"]["global_test"] == []
               for c in trials)
    plain = resolve_experiment(selection_config({"metric": {"model": "auto"}, "select": "pooled"}))
    assert all(c["validation"] == {"from_train": 0.25} for c in plain["tuning_cells"])  # as before: the same hashes
    assert plain["tuning"]["metric"] == {"model": "auto", "stat": "weighted_mean"}  # no measure filled in: same specs
    spec = json.loads(TuningPlan(plain).select_spec(SimpleNamespace(dataset="digits", partition="dir", label="grp_fed")))
    assert "select" not in spec


def test_the_grp_fed_stand_in_tunes_lam_by_L_on_validation_per_seed():
    _, exp = load_and_resolve([str(REPO / "config/papers/grp_fed_cpu.yaml")], [])
    t = exp["tuning"]
    assert set(t["labels"]) == {"grp_fed"} and t["labels"]["grp_fed"]["space"] == {"lam": [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]}
    assert t["metric"] == {"model": "union_hm", "measure": "f1", "stat": "mean"} and t["select"] == "per_seed"
    assert t["seeds"] == [0, 1, 2] and len(exp["tuning_cells"]) == 18
    rounds = {c["training"]["rounds"] for c in exp["tuning_cells"]}
    assert rounds == {20} and max(rounds) <= exp["cells"][0]["training"]["rounds"]
    assert {c["label"] for c in exp["cells"] if c.get("tuned")} == {"grp_fed"}


@pytest.mark.parametrize("tuning, message", [
    ({"metric": {"model": "union_l"}}, r"'tuning.metric.model' has value 'union_l'; allowed: one of \['auto', 'personal', "
                                       r"'global', 'union_global', 'union_personal', 'union_hm'\]"),
    ({"metric": {"measure": "auc"}}, r"'tuning.metric.measure' has value 'auc'; allowed: one of \['acc', 'f1'\]"),
    ({"metric": {"modle": "union_hm"}}, r"'tuning.metric': unknown key\(s\) \['modle'\]; allowed keys: measure, model, stat"),
    ({"select": "each"}, r"'tuning.select' has value 'each'; allowed: one of \['pooled', 'per_seed'\]"),
    ({"seeds": [0]}, r"'tuning.seeds' has value \[0\], without seed\(s\) \[1\] of `seeds`; allowed: every seed of `seeds` "
                     r"\[0, 1\] with tuning.select: per_seed"),
    ({"metric": {"model": "union_personal"}, "methods": {"fedavg": {"lr": [0.01, 0.1]}, "grp_fed": {}}},
     r"'tuning.metric.model' has value 'union_personal', but method label 'fedavg' \(fedavg\) has no personalized model; "
     r"allowed: one of 'auto', 'global', 'union_global', 'union_hm' for it"),
])
def test_a_bad_metric_or_selection_is_refused_naming_key_value_and_allowed(tuning, message):
    with pytest.raises(ConfigError, match=message):
        resolve_experiment(selection_config(tuning))


@pytest.mark.parametrize("metric, message", [
    ({"model": "union_l"}, r"config key 'tuning.metric.model' has value 'union_l'; allowed: one of 'auto', 'personal', "
                           r"'global', 'union_global', 'union_personal', 'union_hm'"),
    ({"model": "union_hm", "measure": "auc"}, r"config key 'tuning.metric.measure' has value 'auc'; allowed: one of 'acc', 'f1'"),
    ({"stat": "std"}, r"config key 'tuning.metric.stat' has value 'std'; allowed: one of 'weighted_mean', 'mean'"),
    ({"model": "union_hm", "split": "test"}, r"config key 'tuning.metric': unknown key\(s\) \['split'\]; allowed keys: "
                                             r"model, stat, measure"),
    ("union_hm", r"config key 'tuning.metric' has value 'union_hm'; allowed: a mapping with keys model, stat, measure"),
])
def test_the_metric_check_itself_names_key_value_and_allowed(metric, message):
    # (the config schema refuses these first; check_metric guards a tuning block resolved without it)
    with pytest.raises(ConfigError, match=message):
        check_metric(metric)


def test_a_select_spec_with_a_bad_measure_or_selection_is_refused():
    spec = {"dataset": "d", "partition": "p", "label": "grp_fed", "method": "grp_fed", "space": {"lam": LAMS},
            "trials": [{"id": "ta", "values": {"lam": 0.1}}], "metric": {"model": "union_hm", "stat": "mean", "measure": "f1"},
            "runs": []}
    check_select_spec(spec)
    with pytest.raises(ConfigError, match=r"key 'metric' has value .*measure \(optional\): acc \| f1"):
        check_select_spec(copy.deepcopy(spec) | {"metric": {"model": "union_hm", "stat": "mean", "measure": "auc"}})
    with pytest.raises(ConfigError, match=r"key 'select' has value 'each'; allowed: pooled \| per_seed"):
        check_select_spec(spec | {"select": "each"})
