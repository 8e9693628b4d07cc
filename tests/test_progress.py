"""Live progress while cells train: the status file, the console lines and `fedrepro status`."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys

import pytest

from fedrepro import progress
from fedrepro.cli import main
from fedrepro.engine.run import train_cell
from fedrepro.io import write_json_atomic


def _without_times(metrics: dict) -> dict:
    m = copy.deepcopy(metrics)
    m.pop("resources")
    return m


def test_a_training_run_rewrites_its_status_file_each_round_and_the_console_gets_a_line_per_evaluation(
        tiny_partition, make_cell, tmp_path, monkeypatch):
    cell = make_cell("fedavg_ft", rounds=2, eval_every=1)
    plain = train_cell(cell, tiny_partition[0], tmp_path / "plain", progress=False)

    written = []
    real_write = progress.write_json_atomic
    monkeypatch.setattr(progress, "write_json_atomic", lambda p, obj: (written.append(copy.deepcopy(obj)), real_write(p, obj)))
    monkeypatch.setenv(progress.STATUS_DIR_ENV, str(tmp_path / "status"))
    watcher = progress.ConsoleWatcher(tmp_path / "status")
    watcher.since = 0
    watched = train_cell(cell, tiny_partition[0], tmp_path / "watched", progress=False)

    # during the run: the file at the start (round 0), after every evaluated round, then "finishing"
    assert [(s["state"], s["round"]) for s in written] == [("running", 0), ("running", 1), ("running", 2),
                                                           ("finishing", 2)]
    status = tmp_path / "status" / "digits" / "dir" / "fedavg_ft" / "seed0.json"
    last = json.loads(status.read_text())
    assert last["rounds"] == 2 and last["cell"]["label"] == "fedavg_ft" and last["pid"] == os.getpid()
    assert set(last["acc"]) == {"global", "personal"} and last["eta_s"] == 0
    assert last["acc"]["personal"] == pytest.approx(watched["curves"]["personal_acc"]["weighted_mean"][-1], abs=1e-6)
    # the console of the workflow: a compact line when a cell's status changes, not again without a change
    line = progress.console_line(written[2])
    assert line.startswith("[fedrepro] digits/dir/fedavg_ft/seed0: round 2/2, global acc ")
    assert "personal acc" in line and "elapsed" in line and "left" in line
    assert watcher.poll() == [progress.console_line(last)] and watcher.poll() == []
    assert progress.console_line(last).startswith("[fedrepro] digits/dir/fedavg_ft/seed0: trained 2/2")
    # a side channel only: the metrics are those of the run without it
    assert _without_times(watched) == _without_times(plain)


def _status(root, dataset, partition, label, seed, **fields):
    cell = {"experiment": "e", "dataset": dataset, "partition": partition, "label": label, "method": label, "seed": seed,
            "trial": fields.pop("trial", None)}
    state = {"schema": progress.STATUS_SCHEMA, "cell": cell, "state": "running", "round": 2, "rounds": 5,
             "eval_round": 2, "acc": {"global": 0.5}, "train_loss": 1.0, "elapsed_s": 20.0, "eta_s": 30.0,
             "pid": os.getpid(), "host": socket.gethostname(), "started": "x", "updated": "x", **fields}
    write_json_atomic(root / "status" / dataset / partition / label / f"seed{seed}.json", state)


def test_status_lists_running_stopped_done_failed_and_pending_cells(tmp_path, capsys):
    root = tmp_path / "results" / "e"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cells = [{"dataset": "d", "partition": "p", "label": m, "seed": 0, "training": {"rounds": 5}}
             for m in ("run", "killed", "ok", "bad", "later")]
    progress.write_plan(root, cells)
    _status(root, "d", "p", "run", 0)
    _status(root, "d", "p", "killed", 0, pid=dead.pid)
    # an old status file of a cell whose metrics.json came later: the metrics decide
    _status(root, "d", "p", "ok", 0, state="finishing", pid=dead.pid)
    write_json_atomic(root / "runs/d/p/ok/seed0/metrics.json",
                      {"status": "ok", "rounds": 5, "summary": {"personal_acc": {"weighted_mean": 0.8125}},
                       "resources": {"wall_time_s": 65.0}})
    write_json_atomic(root / "runs/d/p/bad/seed0/metrics.json", {"status": "failed", "rounds": 3})
    _status(root, "d", "p", "tuned", 0, trial="t0123abcd", state="finishing", round=5)  # a tuning trial, then its metrics
    write_json_atomic(root / "tuning/runs/d/p/tuned/t0123abcd/seed0/metrics.json", {"status": "ok", "rounds": 5})

    assert main(["status", str(root)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.split("\n\n")[1].splitlines()[1:]}  # the table's rows
    assert out.splitlines()[0] == f"{root}: 6 cell(s): 1 running, 1 stopped, 1 failed, 1 pending, 2 done"
    assert lines["d/p/run/seed0"] == ["d/p/run/seed0", "running", "2/5", "50.00%", "-", "0:20", "0:30"]
    assert lines["d/p/killed/seed0"][1:3] == ["stopped", "2/5"] and lines["d/p/killed/seed0"][-1] == "-"
    assert lines["d/p/ok/seed0"] == ["d/p/ok/seed0", "done", "5/5", "-", "81.25%", "1:05", "-"]
    assert lines["d/p/bad/seed0"][1:3] == ["failed", "3/5"]
    assert lines["d/p/later/seed0"][1:3] == ["pending", "-/5"]
    assert lines["d/p/tuned/t0123abcd/seed0"][1:3] == ["done", "5/5"]

    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert main(["status", str(root), "--watch", "0"]) == 2
    assert "--watch 0: must be" in capsys.readouterr().err


def test_a_config_json_cannot_hold_is_left_out_of_the_plan_not_the_start(tmp_path):
    """write_plan runs in the workflow's onstart: a config value JSON cannot hold (a YAML date, keys of
    mixed types) leaves the config out of the plan, so `fedrepro status` says it has no estimate, and
    the cells are still written."""
    import datetime

    root = tmp_path / "results" / "e"
    cells = [{"dataset": "d", "partition": "p", "label": "a", "seed": 0, "training": {"rounds": 5}}]
    for config in ({"experiment": "e", "note": datetime.date(2026, 11, 29)}, {"experiment": "e", "m": {1: 0, "x": 1}}):
        progress.write_plan(root, cells, config)
        plan = json.loads((root / "status" / progress.PLAN_FILE).read_text())
        assert plan["cells"][0]["label"] == "a" and "config" not in plan
        assert progress.recorded_config(root)[0] is None
    progress.write_plan(root, cells, {"experiment": "e"})
    assert progress.recorded_config(root)[0] == {"experiment": "e"}
