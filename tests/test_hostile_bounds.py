"""Every input bounded before it is expanded or read (issue 37): sweep and tuning grids are sized
from their lists' lengths before one point is built; every file `fedrepro status` and the console
watcher read goes through the bounded, non-blocking reader; JSON nesting is bounded wherever JSON
is read; the numbers of a training block are bounded before any job (docs/security.md)."""

from __future__ import annotations

import copy
import itertools
import json
import os
import pathlib

import pytest
import yaml

from fedrepro import progress
from fedrepro.cli import main
from fedrepro.config import TRAINING_NUMBER_MAX, resolve_experiment
from fedrepro.io import MAX_JSON_DEPTH, load_json, read_json, write_json_atomic
from fedrepro.registry import ALLOW_LARGE_ENV, HARD_CELLS_MAX, HARD_NUMBER_MAX, ConfigError

from conftest import REPO

BASE = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
DEEP = "[" * 200_000 + "]" * 200_000  # the red team's document: RecursionError in json.loads


def _config(tmp_path, edit) -> str:
    cfg = copy.deepcopy(BASE)
    edit(cfg)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _one_line_error(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture
def nothing_built(monkeypatch):
    """itertools.product refuses to run: a grid refused from its lists' lengths never gets that far."""
    def refuse(*args, **kwargs):
        raise AssertionError("a grid was built before its size was checked")

    monkeypatch.setattr(itertools, "product", refuse)


# -- 1. sweep and tuning grids: sized before they are built -------------------------------------

def _sweep_bomb(cfg):
    cfg["methods"] = {"x": {"method": "fedavg", "sweep": {"hparams": {k: list(range(10)) for k in "abcdefghij"}}}}


def test_a_sweep_bomb_is_refused_from_its_list_lengths_before_a_point_is_built(tmp_path, capsys, nothing_built):
    path = _config(tmp_path, _sweep_bomb)  # 10 keys x 10 values: 1.5 KB, 10^10 labels
    assert os.path.getsize(path) < 2_000
    assert main(["validate", path]) == 2
    _one_line_error(capsys, "config key 'methods.x.sweep'", "10,000,000,000 labels", "hparams.a: 10 x", "at most 10,000 cells",
                    ALLOW_LARGE_ENV)


def test_a_sweep_counts_the_cells_of_each_label_and_the_other_labels(nothing_built):
    # 1,700 labels x 2 partitions x 2 seeds (+ 3 other labels) = 6,812 cells... and 2,500 make 10,012
    cfg = copy.deepcopy(BASE)
    cfg["methods"]["fp"] = {"method": "fedprox", "sweep": {"hparams.mu": [i / 1000 for i in range(1, 2501)]}}
    with pytest.raises(ConfigError, match=r"makes 2,500 labels .* with 3 other label\(s\) and 4 cell\(s\) per label .* "
                                          r"10,012 cells; allowed: at most 10,000"):
        resolve_experiment(cfg)


def test_a_tuning_grid_is_refused_from_its_list_lengths_before_a_trial_is_built(nothing_built):
    cfg = copy.deepcopy(BASE)
    values = [round(0.001 * i, 3) for i in range(1, 31)]
    cfg["tuning"] = {"methods": {"fedavg_ft": {"lr": values, "ft_lr": values, "ft_momentum": values}, "fedavg": {},
                                 "local": {}}}  # 27,000 trials
    with pytest.raises(ConfigError, match=r"config key 'tuning.methods.fedavg_ft' makes 27,000 trials .*lr: 30 x ft_lr: 30 "
                                          r"x ft_momentum: 30.*at most 10,000 cells"):
        resolve_experiment(cfg)


def test_a_random_tuning_sample_of_a_huge_grid_never_builds_the_grid(nothing_built):
    cfg = copy.deepcopy(BASE)
    values = [round(0.0001 * i, 4) for i in range(1, 1001)]
    cfg["tuning"] = {"search": "random", "samples": 3, "methods": {
        "fedavg_ft": {"lr": values, "ft_lr": values, "ft_momentum": values}, "fedavg": {}, "local": {}}}  # 10^9 points
    exp = resolve_experiment(cfg)
    trials = exp["tuning"]["labels"]["fedavg_ft"]["trials"]
    assert len(trials) == 3 and all(set(t["values"]) == {"lr", "ft_lr", "ft_momentum"} for t in trials)


# -- 2. status and progress files: read bounded, never blocking ---------------------------------

@pytest.fixture
def no_whole_reads(monkeypatch):
    """Path.read_text / read_bytes read a file whole, whatever it is: the status readers must not use them."""
    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{self} read whole, without a bound")

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)


def _good_status(root, label):
    cell = {"experiment": "e", "dataset": "d", "partition": "p", "label": label, "method": label, "seed": 0, "trial": None}
    write_json_atomic(root / "status" / "d" / "p" / label / "seed0.json",
                      {"schema": progress.STATUS_SCHEMA, "cell": cell, "state": "running", "round": 2, "rounds": 5,
                       "eval_round": 2, "acc": {"global": 0.5}, "train_loss": 1.0, "elapsed_s": 20.0, "eta_s": 30.0,
                       "pid": os.getpid(), "host": "elsewhere", "started": "x", "updated": "x"})


def test_status_names_and_skips_devices_fifos_large_and_deep_files_and_shows_the_rest(tmp_path, capsys, no_whole_reads):
    root = tmp_path / "results" / "e"
    _good_status(root, "fine")
    (root / "status" / "d" / "p" / "zero").mkdir(parents=True)
    os.symlink("/dev/zero", root / "status" / "d" / "p" / "zero" / "seed0.json")
    os.symlink("/dev/zero", root / "status" / progress.PLAN_FILE)
    os.mkfifo(root / "status" / "d" / "p" / "fine" / "seed1.json")
    big = root / "status" / "d" / "p" / "big" / "seed0.json"
    big.parent.mkdir()
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(progress.STATUS_MAX_BYTES + 1)
    deep = root / "status" / "d" / "p" / "deep" / "seed0.json"
    deep.parent.mkdir()
    deep.write_text(DEEP)
    metrics = root / "runs" / "d" / "p" / "m" / "seed0" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    os.symlink("/dev/zero", metrics)

    assert main(["status", str(root)]) == 0
    out = capsys.readouterr().out
    assert "d/p/fine/seed0  running" in out
    skipped = [line for line in out.splitlines() if line.startswith("skipped: ")]
    assert sorted(skipped) == sorted([
        f"skipped: {root}/status/{progress.PLAN_FILE}: a character device, not a regular file",
        f"skipped: {metrics}: a character device, not a regular file",
        f"skipped: {root}/status/d/p/zero/seed0.json: a character device, not a regular file",
        f"skipped: {root}/status/d/p/fine/seed1.json: a FIFO, not a regular file",
        f"skipped: {big}: {progress.STATUS_MAX_BYTES + 1:,} bytes; allowed: at most {progress.STATUS_MAX_BYTES:,}",
        f"skipped: {deep}: not valid JSON (nested more than {MAX_JSON_DEPTH} levels deep; allowed: at most {MAX_JSON_DEPTH})",
    ])


def test_status_survives_status_files_whose_fields_have_the_wrong_types(tmp_path, capsys):
    root = tmp_path / "results" / "e"
    write_json_atomic(root / "status" / progress.PLAN_FILE, {"cells": ["not a cell", {"dataset": "d", "partition": "p",
                                                                                      "label": "l", "seed": 0}]})
    for i, bad in enumerate([{"cell": ["x"]}, {"state": ["x"]}, {"acc": [1]}, {"elapsed_s": "long", "eta_s": "soon"},
                             {"cell": {"dataset": "d\x00", "partition": "p", "label": "l4", "seed": 0}}]):
        _good_status(root, f"l{i}")
        path = root / "status" / "d" / "p" / f"l{i}" / "seed0.json"
        write_json_atomic(path, {**json.loads(path.read_text()), **bad})
    assert main(["status", str(root)]) == 0
    out = capsys.readouterr().out
    states = {line.split()[0]: line.split()[1] for line in out.split("\n\n")[1].splitlines()[1:]}  # the table's rows
    assert states == {"d/p/l/seed0": "pending", "d/p/l3/seed0": "running", "d\x00/p/l4/seed0": "running"}


def test_the_console_watcher_names_a_planted_device_once_and_never_reads_it(tmp_path, no_whole_reads):
    status = tmp_path / "status"
    (status / "d" / "p" / "l").mkdir(parents=True)
    os.symlink("/dev/zero", status / "d" / "p" / "l" / "seed0.json")
    watcher = progress.ConsoleWatcher(status)
    watcher.since = 0
    first = watcher.poll()
    assert first == [f"[fedrepro] status file skipped: {status}/d/p/l/seed0.json: a character device, not a regular file"]
    watcher.mtimes.clear()  # even when it looks changed: named once
    assert watcher.poll() == []


# -- 3. JSON nesting bounded wherever JSON is read ----------------------------------------------

def test_load_json_bounds_nesting_before_parsing_and_ignores_brackets_in_strings():
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(ok) is not None
    assert load_json(json.dumps({"s": "[[[[" * 100, "t": '\\"{{{'})) == {"s": "[[[[" * 100, "t": '\\"{{{'}
    with pytest.raises(json.JSONDecodeError, match=rf"nested more than {MAX_JSON_DEPTH} levels deep.*char {MAX_JSON_DEPTH}\)"):
        load_json("[" + ok + "]")
    with pytest.raises(json.JSONDecodeError, match=r"line 2 column 69"):
        load_json(b'{"a": "]]]",\n "b":' + b"[" * 200_000)
    # an unterminated string full of escaped quotes: the scan stays linear (a string is never retried from inside)
    with pytest.raises(json.JSONDecodeError, match="Unterminated string"):
        load_json('"' + '\\"' * 200_000)


def test_read_json_is_bounded_and_names_the_file(tmp_path):
    with pytest.raises(OSError, match="a directory, not a regular file"):
        read_json(tmp_path)
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(20 << 20)
    with pytest.raises(OSError, match=f"{big}: 20,971,520 bytes; allowed: at most 16,777,216"):
        read_json(big)
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    with pytest.raises(json.JSONDecodeError, match=f"{deep}: nested more than"):
        read_json(deep)


def test_aggregate_refuses_a_deeply_nested_metrics_file_in_one_line(tmp_path, capsys):
    metrics = tmp_path / "metrics.json"
    metrics.write_text(DEEP)
    out = [f"--{k}={tmp_path / k}" for k in ("csv", "json", "curves")]
    assert main(["aggregate", str(metrics), *out]) == 2
    _one_line_error(capsys, str(metrics), "nested more than 64 levels deep", "damaged")


def test_select_refuses_a_deeply_nested_trial_metrics_file_in_one_line(tmp_path, capsys):
    metrics = tmp_path / "metrics.json"
    metrics.write_text(DEEP)
    spec = {"dataset": "d", "partition": "p", "label": "l", "method": "fedavg", "metric": {"model": "auto", "stat": "mean"},
            "space": {"lr": [0.1]},
            "trials": [{"id": "t1", "values": {"lr": 0.1}}], "runs": [{"trial": "t1", "seed": 0, "metrics": str(metrics)}]}
    assert main(["select", "--spec", json.dumps(spec), "--out", str(tmp_path / "sel.json")]) == 2
    _one_line_error(capsys, str(metrics), "nested more than 64 levels deep")


def test_train_refuses_a_deeply_nested_manifest_in_one_line(tmp_path, capsys, make_cell):
    part = tmp_path / "part"
    part.mkdir()
    (part / "manifest.json").write_text(DEEP)
    args = ["train", "--cell", json.dumps(make_cell("fedavg")), "--shards", str(part), "--out-dir", str(tmp_path / "out")]
    assert main(args) == 2
    _one_line_error(capsys, "manifest.json", "nested more than 64 levels deep")


def test_json_arguments_are_bounded_in_nesting(tmp_path, capsys):
    deep = tmp_path / "sel.json"
    deep.write_text(DEEP)
    part = tmp_path / "part"
    part.mkdir()
    (part / "manifest.json").write_text("{}")
    assert main(["train", "--cell", "{}", "--shards", str(part), "--out-dir", str(tmp_path), "--tuned", str(deep)]) == 2
    _one_line_error(capsys, "argument --tuned", "nested more than 64 levels deep")
    assert main(["select", "--spec", DEEP[:1000] + DEEP[-1000:], "--out", str(tmp_path / "s.json")]) == 2
    _one_line_error(capsys, "argument --spec", "nested more than 64 levels deep")


# -- 4. training numbers bounded before any job ------------------------------------------------

@pytest.mark.parametrize("where, value", [
    ("optimizer.lr", 1e308),
    ("optimizer.weight_decay", 1e308),
    ("optimizer.lr", 2e6),
])
def test_training_numbers_beyond_the_bound_are_refused_by_validate(tmp_path, capsys, where, value):
    section, key = where.split(".")

    def edit(cfg):
        cfg["training"][section][key] = value

    assert main(["validate", _config(tmp_path, edit)]) == 2
    _one_line_error(capsys, f"config key 'training.{where}' has value {value!r}", "allowed: at most")


def test_an_lr_schedule_value_beyond_the_bound_is_refused(tmp_path, capsys):
    def edit(cfg):
        cfg["training"]["lr_schedule"] = {"name": "multistep", "milestones": [1], "values": [0.05, 1e308]}

    assert main(["validate", _config(tmp_path, edit)]) == 2
    _one_line_error(capsys, "config key 'training.lr_schedule.values[1]' has value 1e+308")


def test_a_multistep_gamma_that_raises_the_lr_out_of_range_is_refused(tmp_path, capsys):
    def edit(cfg):
        cfg["training"].update(rounds=10, lr_schedule={"name": "multistep", "milestones": [1, 2, 3, 4], "gamma": 100.0})

    assert main(["validate", _config(tmp_path, edit)]) == 2
    _one_line_error(capsys, "config key 'training.lr_schedule.gamma' has value 100.0, which raises 'training.optimizer.lr' "
                    "(0.05) to about 1e7 after its 4 milestone(s)", "at most 1,000,000")


@pytest.mark.parametrize("item", ["training.optimizer.lr=1e308", "training.optimizer.weight_decay=1e308",
                                  "methods.fedavg_ft.training.optimizer.lr=1e308"])
def test_training_numbers_beyond_the_bound_are_refused_as_overrides(capsys, item):
    assert main(["validate", str(REPO / "config" / "test.yaml"), "--set", item]) == 2
    _one_line_error(capsys, f"override {item!r}", "has value 1e+308", "allowed: at most")


def test_lifting_the_budgets_keeps_training_numbers_in_the_range_torch_takes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ALLOW_LARGE_ENV, "1")
    assert main(["validate", str(REPO / "config" / "test.yaml"), "--set", "training.optimizer.lr=2e6"]) == 0
    capsys.readouterr()
    assert main(["validate", str(REPO / "config" / "test.yaml"), "--set", "training.optimizer.lr=1e308"]) == 2
    _one_line_error(capsys, f"allowed: at most {TRAINING_NUMBER_MAX:g} in magnitude", "not lifted")
    cfg = copy.deepcopy(BASE)
    cfg["tuning"] = {"lr": [0.1, 1e300]}
    with pytest.raises(ConfigError, match=r"key 'lr\[1\]' has value 1e\+300; allowed: at most 1e\+12 in magnitude"):
        resolve_experiment(cfg)


def test_lifting_the_budgets_keeps_a_hard_bound_on_sweeps_and_method_parameters(tmp_path, capsys, monkeypatch, nothing_built):
    """FEDREPRO_ALLOW_LARGE_BUDGETS lifts the sanity bounds, not the hard ones: the sweep bomb is still
    refused from its lists' lengths, and a method's 1e308 still never reaches torch."""
    monkeypatch.setenv(ALLOW_LARGE_ENV, "1")
    assert main(["validate", _config(tmp_path, _sweep_bomb)]) == 2
    _one_line_error(capsys, "40,000,000,000 cells", f"at most {HARD_CELLS_MAX:,} cells even with the budgets lifted")
    assert main(["validate", str(REPO / "config" / "test.yaml"), "--set", "methods.fedavg_ft.hparams.ft_lr=1e308"]) == 2
    _one_line_error(capsys, "key 'ft_lr' has value 1e+308", f"at most {HARD_NUMBER_MAX:g} in magnitude", "not lifted")


def test_method_hyper_parameters_are_bounded_too(capsys):
    # (the registry's sanity bound on declared parameters: a guard, as it already held)
    assert main(["validate", str(REPO / "config" / "test.yaml"), "--set", "methods.fedavg_ft.hparams.ft_lr=1e308"]) == 2
    _one_line_error(capsys, "key 'ft_lr' has value 1e+308", "at most 1,000,000 in magnitude")
