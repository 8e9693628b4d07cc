"""Issue 57 (hostile input, fourth round): what `fedrepro verify` and `fedrepro status` read is checked
like a config, and a full disk is one line at a job's and at the workflow's start.

1. verify: the cell provenance.json records is refused before any training unless it is the cell of
   its folder (experiment, identity, cell hash; with --config, the config's cell) and within a config's
   schema and bounds; the thread count it starts is bounded by this machine's cores.
2. status: hostile recorded numbers print 'unknown', never 'inf' or 300 digits; the sampling schedules
   an estimate draws are bounded per plan.
3. A full disk: `fedrepro train` stops with one line naming the folder and its free space before any
   work; the workflow's onstart stops before any job, its onerror names a full disk.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from fedrepro import cost, progress
from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.io import short_hash, write_json_atomic
from fedrepro.registry import ConfigError

from conftest import REPO, tiny_config
from test_cost import quick, status_file, this_machines_calibration  # noqa: F401  (fixtures)
from test_verify import _edit, _run, copy, trained  # noqa: F401  (fixtures)

#: a run of this many digits in a status line is a hostile number printed whole
LONG_NUMBER = re.compile(r"\d{20,}")


# -- 1. verify ------------------------------------------------------------------------------------------

@pytest.fixture
def spy(monkeypatch):
    """`fedrepro train` as verify calls it, recorded and stopped: what verify would have trained."""
    import fedrepro.cli as cli

    seen = []

    def stopped(args):
        seen.append(json.loads(json.dumps(args.cell)))
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(cli, "cmd_train", stopped)
    return seen


def _forge(run: Path, edit) -> Path:
    """Edit the cell provenance.json records and give both files the identity.cell_key of the edited
    cell (what a forger does so that the cell's hash checks out): only the bounds can then refuse it."""
    prov = run / "provenance.json"
    _edit(prov, lambda d: edit(d["cell"]))
    cell = json.loads(prov.read_text())["cell"]
    for name in ("provenance.json", "metrics.json"):
        _edit(run / name, lambda d: d["identity"].update(cell_key=short_hash(cell)))
    return prov


@pytest.mark.parametrize("edit, named", [
    (lambda c: c["training"].update(rounds=1_000_000),
     "field 'cell.training.rounds' has value 1000000; allowed: at most 10,000"),
    (lambda c: c["training"].update(batch_size=10**9), "field 'cell.training.batch_size' has value 1000000000; allowed"),
    (lambda c: c["training"]["optimizer"].update(lr=1e300), "field 'cell.training.optimizer.lr' has value 1e+300; allowed"),
    (lambda c: c["training"].update(epochs=3), "field 'cell.training': unknown key(s) ['epochs']; allowed keys:"),
    (lambda c: c["evaluation"].update(untrained="never"), "field 'cell.evaluation.untrained' has value 'never'; allowed:"),
    (lambda c: c["hparams"].update(mu=10**9), "field 'cell.hparams' (method 'fedavg'): unknown parameter(s) ['mu']"),
    (lambda c: c["model"].update(name="resnet9000"), "field 'cell.model.name' has value 'resnet9000'; allowed:"),
    (lambda c: c.update(tuned={"trial": "t1", "values": {"lr": 1e300}}),  # a tuned cell's selection applied, then checked
     "field 'cell.training.optimizer.lr' has value 1e+300; allowed"),
], ids=["rounds", "batch_size", "lr", "unknown-key", "evaluation", "hparam", "model", "tuned-lr"])
def test_a_recorded_cell_beyond_a_configs_bounds_is_refused_before_any_training(copy, spy, capsys, edit, named):
    run = copy / "runs/digits/dir0.5/fedavg/seed0"
    prov = _forge(run, edit)
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "*/fedavg/seed0")
    assert spy == [], "verify trained a cell beyond the bounds"
    [line] = [line for line in out if line.startswith("digits/dir0.5/fedavg/seed0: ")]
    assert line.startswith(f"digits/dir0.5/fedavg/seed0: refused: {prov}: {named}"), line
    assert rc == 1 and out[-1].endswith("0 of 1 cell(s) exact, 0 differ, 0 cannot be reproduced here, 1 refused")


def test_a_thread_count_beyond_this_machines_cores_is_not_started(copy, spy, capsys, monkeypatch):
    monkeypatch.setattr("fedrepro.local_plan.usable_cores", lambda: 2)
    run = copy / "runs/digits/dir0.5/fedavg/seed0"
    _edit(run / "provenance.json", lambda d: d["torch"].update(num_threads=100_000))
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "*/fedavg/seed0")
    assert spy == [] and rc == 3
    assert (f"digits/dir0.5/fedavg/seed0: cannot reproduce here: {run}/provenance.json: field 'torch.num_threads' has "
            "value 100000; allowed: at most 8 (4 per core of the 2 core(s) usable here)") in out[-2], out


def test_a_cell_folder_copied_from_another_experiment_is_refused(copy, spy, capsys):
    other = copy.parent / "other"
    shutil.copytree(copy, other)
    rc, out, _ = _run(capsys, "verify", str(other), "--cells", "*/fedavg/seed0")
    assert spy == [] and rc == 1
    assert out[-2] == (f"digits/dir0.5/fedavg/seed0: refused: {other}/runs/digits/dir0.5/fedavg/seed0/provenance.json: "
                       f"field 'cell.experiment' has value 'test'; allowed: 'other', the experiment of the results folder "
                       f"{other} it sits in (a cell folder copied from another experiment's results is verified in that "
                       "experiment's folder)")


@pytest.mark.parametrize("file, edit, named", [
    ("provenance.json", lambda d: d["identity"].update(partition_id="0123456789"),
     "identity field 'partition_id' is '0123456789', expected "),
    ("provenance.json", lambda d: d["identity"].update(experiment="other"),
     "identity field 'experiment' is 'other', expected 'test'"),
    ("metrics.json", lambda d: d["identity"].update(manifest_hash="0" * 64),  # provenance.json's is the shards'
     None),
    ("provenance.json", lambda d: d["cell"]["hparams"].clear() or d["cell"]["training"].update(rounds=2),
     "field 'cell' hashes to "),
], ids=["partition-id", "experiment", "manifest-hash", "cell-hash"])
def test_a_record_whose_identity_or_hash_is_not_its_folders_cell_is_refused(copy, spy, capsys, file, edit, named):
    run = copy / "runs/digits/dir0.5/fedavg/seed0"
    _edit(run / file, edit)
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "*/fedavg/seed0")
    assert spy == [] and rc == 1, out
    line = out[-2]
    assert line.startswith(f"digits/dir0.5/fedavg/seed0: refused: {run}/"), line
    if named is None:  # the two files disagree: named from provenance.json, against metrics.json's
        assert "identity field 'manifest_hash' is " in line and "(metrics.json's beside it)" in line, line
    else:
        assert f"{run / file}: {named}" in line, line


def test_with_its_config_verify_trains_the_configs_cell_and_refuses_one_the_folder_does_not_hold(copy, spy, capsys):
    config = str(REPO / "config" / "test.yaml")
    run = copy / "runs/digits/dir0.5/local/seed0"
    rc, out, _ = _run(capsys, "verify", str(copy), "--config", config, "--cells", "*/local/seed0")
    assert rc == 3 and out[-2] == "digits/dir0.5/local/seed0: cannot reproduce here: stopped by the test"
    assert spy == [json.loads((run / "provenance.json").read_text())["cell"]]  # the config's cell: the recorded one
    rc, out, _ = _run(capsys, "verify", str(copy), "--config", config, "--set", "training.rounds=2", "--cells", "*/local/*")
    assert rc == 1 and len(spy) == 1
    assert out[-2].startswith(f"digits/dir0.5/local/seed0: refused: {run}/metrics.json: field 'identity.cell_key' has "
                              "value "), out
    assert "but the config's cell at this folder hashes to " in out[-2]
    # a forged cell with a consistent hash: the config's cell does not hash to it
    _forge(run, lambda c: c["training"].update(rounds=1_000_000))
    rc, out, _ = _run(capsys, "verify", str(copy), "--config", config, "--cells", "*/local/*")
    assert rc == 1 and len(spy) == 1 and "field 'identity.cell_key' has value" in out[-2]


def test_a_config_of_another_experiment_or_set_without_config_is_one_usage_line(copy, capsys):
    config = str(REPO / "config" / "test.yaml")
    for argv, needle in ([["--config", config, "--set", "experiment=other"], f"argument --config: {config} is experiment "
                          f"'other'; allowed: the config of the results folder {copy}, experiment 'test'"],
                         [["--set", "training.rounds=2"], "--set goes with --config"]):
        rc, out, err = _run(capsys, "verify", str(copy), *argv)
        assert rc == 2 and not out and len(err.splitlines()) == 1 and needle in err, err


# -- 2. status -------------------------------------------------------------------------------------------

def _run_plan(tmp_path, config: dict) -> tuple[Path, dict]:
    exp = resolve_experiment(config)
    root = tmp_path / "results" / "unit"
    progress.write_plan(root, exp["cells"], config)
    this_machines_calibration(tmp_path / "results" / ".calibration", exp, train=0.05, startup=2.0)
    return root, exp


def _status(capsys, root) -> str:
    assert main(["status", str(root)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.out


def _job(cell: dict) -> str:
    return cost.job_name(cell)


def test_hostile_recorded_times_print_unknown_never_inf_or_hundreds_of_digits(quick, tmp_path, capsys):
    root, exp = _run_plan(tmp_path, {**tiny_config(rounds=3), "seeds": [0, 1]})
    cells = exp["cells"]
    for cell in cells[:3]:  # three finished jobs that 'took' 1e308 s: a pace of inf
        write_json_atomic(root / "runs" / _job(cell) / "metrics.json",
                          {"status": "ok", "rounds": 3, "resources": {"wall_time_s": 1e308}})
    status_file(root, cells[3], elapsed_s=1e300, eta_s=-5.0, round=10**300, acc={"global": 1e300}, train_loss=1e300)
    out = _status(capsys, root)
    assert "inf" not in out and not LONG_NUMBER.search(out), out
    [running] = [line for line in out.splitlines() if line.startswith(_job(cells[3]))]
    assert running.split()[1:] == ["running", "unknown/2", "unknown", "-", "unknown", "unknown"], running
    assert all(line.split()[-2:] == ["unknown", "-"] for line in out.splitlines() if " done " in line), out
    [left] = [line for line in out.splitlines() if line.startswith("time left: ")]
    assert left.startswith("time left: about ") and "pace" not in left, left  # unusable times: the estimate as it is
    line = progress.console_line(json.loads(progress.status_path(root / "status", cells[3]).read_text()))
    assert "inf" not in line and not LONG_NUMBER.search(line) and "loss unknown" in line and "global acc unknown" in line


def test_a_pace_beyond_its_bounds_is_not_applied_and_says_so(quick, tmp_path, capsys):
    root, exp = _run_plan(tmp_path, {**tiny_config(rounds=3), "seeds": [0, 1]})
    for cell in exp["cells"][:3]:  # 100 days each (a usable duration), estimated at seconds
        write_json_atomic(root / "runs" / _job(cell) / "metrics.json",
                          {"status": "ok", "rounds": 3, "resources": {"wall_time_s": 100 * 86400.0}})
    [left] = [line for line in _status(capsys, root).splitlines() if line.startswith("time left: ")]
    assert "at the run's pace" not in left and not LONG_NUMBER.search(left), left
    assert re.search(r"; the pace of its 3 finished jobs \([0-9.e+]+x their estimate\) not applied: allowed 0.01x to "
                     r"100x$", left), left


@pytest.mark.parametrize("seconds", [math.inf, math.nan, 1e300])
def test_a_time_left_beyond_any_run_is_unknown_with_why(seconds):
    line = cost.TimeLeft({"d/p/l/seed0": seconds}).line([])
    assert line.startswith("time left: unknown (0 running, 1 pending job(s)): the estimate is "), line
    assert "allowed: at most 36500.0 days" in line and "inf" not in line and "nan" not in line, line


def test_the_schedules_an_estimate_draws_are_bounded_per_plan(monkeypatch):
    """1,000 seeds x 9,999 rounds x 200 clients drew every seed's schedule (220 s of `fedrepro status`):
    now at most EXACT_SCHEDULE_BUDGET client-rounds in all, the expectation beyond, and none at all
    where every client trains every round (the counts are known)."""
    from fedrepro.engine import sampling

    drawn = []
    real = sampling.sampling_schedule
    monkeypatch.setattr(sampling, "sampling_schedule", lambda n, m, rounds, seed: drawn.append(n * rounds) or
                        real(n, m, rounds, seed))
    monkeypatch.setattr(cost, "EXACT_SCHEDULE_BUDGET", 2_000, raising=False)
    cost.participations.cache_clear()
    config = {**tiny_config(rounds=100, participation=2), "seeds": list(range(20))}
    exp = resolve_experiment(config)
    jobs = cost.Estimator(exp).jobs()
    assert 0 < sum(drawn) <= 2_000 and len(jobs) == len(exp["cells"])  # 5 of the 20 seeds' schedules drawn
    assert all(job.work.train_steps > 0 for job in jobs)  # the others estimated from the expectation
    drawn.clear()
    cost.participations.cache_clear()
    cost.Estimator(resolve_experiment({**config, "training": {**config["training"], "participation": 1.0}})).jobs()
    assert drawn == []


def test_evaluated_rounds_are_counted_as_the_engine_evaluates_them():
    for rounds in range(1, 40):
        for every in (1, 2, 3, 5):
            for personal in (None, every, 2 * every, 3 * every):
                listed = [r for r in range(1, rounds + 1) if r % every == 0 or r == rounds]
                scored = [r for r in listed if r % (personal or 1) == 0 or r == rounds]
                assert cost.evaluated_rounds(rounds, every, personal) == (len(listed), len(scored))


# -- 3. a full disk --------------------------------------------------------------------------------------

def _full(monkeypatch, free: int = 0) -> None:
    """Every file system reports `free` bytes available (os.statvfs, what shutil.disk_usage reads too)."""
    import os

    Statvfs = namedtuple("Statvfs", "f_bsize f_frsize f_blocks f_bfree f_bavail")
    monkeypatch.setattr(os, "statvfs", lambda path: Statvfs(1, 1, 10 << 30, free, free))


def test_a_train_job_on_a_full_disk_stops_with_one_line_naming_the_folder_before_any_work(
        tiny_partition, make_cell, tmp_path, monkeypatch, capsys):
    import fedrepro.engine.run as run

    opened = []
    monkeypatch.setattr(run, "open_cell", lambda *a, **k: opened.append(a) or (_ for _ in ()).throw(AssertionError))
    _full(monkeypatch, free=1000)
    out = tmp_path / "out"
    rc = main(["train", "--cell", json.dumps(make_cell("fedavg")), "--shards", str(tiny_partition[0]), "--out-dir", str(out),
               "--checkpoint", str(tmp_path / "ckpt" / "seed0.pt")])
    err = capsys.readouterr().err
    assert rc == 2 and opened == [] and not out.exists()
    assert err.splitlines() == [f"fedrepro train: error: No space left on device: cannot write {out} (1000 B free; "
                                "allowed: at least 64.0 KiB free: free space there and rerun)"], err


def test_the_workflow_stops_on_a_full_disk_before_any_job_in_one_line(tmp_path, monkeypatch):
    from fedrepro import diskspace

    out = tmp_path / "results" / "test"
    diskspace.stop_if_full(out)  # room: nothing said
    assert diskspace.failure_note(out) is None
    _full(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        diskspace.stop_if_full(out)
    assert stop.value.code == (f"fedrepro: No space left on device: cannot write {out} (0 B free; allowed: at least "
                               "64.0 KiB free: free space there and rerun); no job was started")
    assert diskspace.failure_note(out).startswith(f"fedrepro: the workflow failed on a full disk: No space left on device: "
                                                  f"cannot write {out} (0 B free;")
    # the onstart checks before it writes the plan or starts the watcher; the onerror says it when a run fails
    text = (REPO / "workflow" / "rules" / "train.smk").read_text()
    onstart = text[text.index("onstart:"):]
    assert onstart.index("stop_if_full(OUT)") < onstart.index("write_plan(") < onstart.index("ConsoleWatcher(")
    assert "failure_note(OUT)" in text[text.index("onerror:"):]


def test_sizes_are_said_in_binary_units():
    from fedrepro import diskspace

    assert [diskspace.size_text(n) for n in (0, 1023, 1024, 65536, 3 << 30)] == ["0 B", "1023 B", "1.0 KiB", "64.0 KiB",
                                                                                 "3.0 GiB"]
