"""The scripts in benchmarks/ a user runs by hand (issue 46) read their inputs as `fedrepro` does
(benchmarks/script_inputs.py): a metrics or JSON file that is a link to /dev/zero, a FIFO, a
directory, too large or nested too deep, an unknown git revision or one that git would read as an
option, a bad folder, config or count is one line on stderr naming it, exit 2: never a traceback,
a hang or gigabytes of memory. Each script runs as a subprocess, as a user runs it, under a memory
cap and a timeout (the red team's /dev/zero link took more than 2 GB; its FIFO hung)."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from fedrepro.custody import METRICS_MAX_BYTES

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
import script_inputs  # noqa: E402

#: each planted input and a word of the one line that must refuse it
KINDS = {"devzero": "character device", "fifo": "FIFO", "deep": "nested more than 64", "dir": "a directory",
         "huge": "larger than", "list": "JSON of type list"}


def plant(path: Path, kind: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "deep":
        path.write_text("[" * 100_000)
    elif kind == "dir":
        path.mkdir()
    elif kind == "huge":  # sparse: no disk used
        with open(path, "wb") as fh:
            fh.truncate(METRICS_MAX_BYTES + 1)
    elif kind == "list":
        path.write_text("[1, 2]")
    return path


def run(script: str, *args: str, memory: int = 2 << 30, timeout: float = 60) -> subprocess.CompletedProcess:
    def cap():  # the old readers' /dev/zero stops at a MemoryError here instead of taking the machine
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, preexec_fn=cap)


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (proc.returncode, err[-3000:])
    for w in words:
        assert w in err, (w, err)
    return err


# -- metrics files: compare_metrics.py (and, through it, quickstart, startup, cell_threads) -------

def _metrics(path: Path, acc: float, wall: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": {"global_acc": acc}, "resources": {"wall_time_s": wall}}))
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_compare_metrics_refuses_a_hostile_metrics_file_in_one_line(tmp_path, kind):
    bad = plant(tmp_path / "before" / "runs" / "a" / "metrics.json", kind)
    _metrics(tmp_path / "after" / "runs" / "a" / "metrics.json", 0.5, 1.0)
    refused(run("compare_metrics.py", str(tmp_path / "before"), str(tmp_path / "after")), str(bad), "metrics file", KINDS[kind])


def test_compare_metrics_still_compares_what_it_reads(tmp_path):
    for side, wall in (("before", 1.0), ("after", 2.0)):
        _metrics(tmp_path / side / "runs" / "a" / "metrics.json", 0.5, wall)
    same = run("compare_metrics.py", str(tmp_path / "before"), str(tmp_path / "after"))
    assert same.returncode == 0 and "1 metrics.json compared, 0 difference(s)" in same.stdout, same.stdout + same.stderr
    _metrics(tmp_path / "after" / "runs" / "a" / "metrics.json", 0.6, 2.0)
    differ = run("compare_metrics.py", str(tmp_path / "before"), str(tmp_path / "after"))
    assert differ.returncode == 1 and "differs: runs/a/metrics.json: .summary.global_acc" in differ.stdout


@pytest.mark.parametrize("which", ["missing", "file"])
def test_compare_metrics_refuses_a_folder_that_is_not_one(tmp_path, which):
    (tmp_path / "after").mkdir()
    before = tmp_path / "before"
    if which == "file":
        before.write_text("{}")
    refused(run("compare_metrics.py", str(before), str(tmp_path / "after")), "argument before", str(before),
            "no such directory" if which == "missing" else "not a directory")


# -- git revisions: cell_hashes.py, quickstart.py, startup.py ------------------------------------

REVISION_ARGS = [("cell_hashes.py", "--base"), ("quickstart.py", "--before-rev"), ("startup.py", "--before-rev")]


@pytest.mark.parametrize("script,option", REVISION_ARGS)
@pytest.mark.parametrize("value", ["no-such-revision", "HEAD~100000", "HEAD:README.md"])
def test_an_unknown_revision_is_one_line(script, option, value):
    refused(run(script, f"{option}={value}"), f"argument {option}", "unknown revision", repr(value))


@pytest.mark.parametrize("script,option", REVISION_ARGS)
@pytest.mark.parametrize("value", ["--output={out}", "-x"])
def test_a_revision_git_would_read_as_an_option_is_refused(tmp_path, script, option, value):
    value = value.format(out=tmp_path / "injected")
    refused(run(script, f"{option}={value}"), f"argument {option}", "not a revision", "not starting with '-'")
    assert not (tmp_path / "injected").exists()


def test_a_revision_resolves_to_the_hash_of_its_commit():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert script_inputs.revision("HEAD") == head
    assert script_inputs.revision(head[:12]) == head


# -- configs, folders and counts: quickstart.py, cell_threads.py, startup.py -----------------------

CONFIG_ARGS = [("quickstart.py", "--after"), ("cell_threads.py", "--configfile")]


@pytest.mark.parametrize("script,option", CONFIG_ARGS)
@pytest.mark.parametrize("kind", ["devzero", "fifo", "deep", "dir"])
def test_a_hostile_config_is_one_line(tmp_path, script, option, kind):
    bad = plant(tmp_path / "config.yaml", kind)
    refused(run(script, f"{option}={bad}"), f"argument {option}", str(bad))


@pytest.mark.parametrize("script,args,words", [
    ("quickstart.py", ["--repeat=0"], ["argument --repeat", "an integer >= 1"]),
    ("cell_threads.py", ["--cores=0"], ["argument --cores", "an integer >= 1"]),
    ("cell_threads.py", ["--labels", "no_such_label"], ["argument --labels", "no_such_label", "fedavg"]),
    ("startup.py", ["--rounds=0"], ["argument --rounds", "an integer >= 1"]),
    ("startup.py", ["--label=no_such_label", "--raw-root=."], ["argument --label", "no_such_label", "fedavg"]),
    ("startup.py", ["--raw-root=/no/such/folder"], ["argument --raw-root", "no such directory"]),
])
def test_a_bad_argument_is_one_line_before_any_work(script, args, words):
    refused(run(script, *args, memory=6 << 30), *words)  # a label is checked on the resolved config: torch is imported


def test_cost_accuracy_estimates_with_a_kept_calibration_file_or_refuses_it_in_one_line(tmp_path):
    """--calibration: a table measured on another day is estimated with that day's calibration (the
    files docs/cost.md's rows were made with are kept in docs/calibrations/)."""
    kept = sorted((REPO / "docs" / "calibrations").glob("*.json"))[0]
    results = tmp_path / "results" / "test"
    results.mkdir(parents=True)
    args = ("--experiment", "config/test.yaml", str(results))
    proc = run("cost_accuracy.py", "--calibration", str(kept), *args, memory=6 << 30, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"calibration: {kept} (cpu: AMD EPYC, 2 threads, ")
    assert re.search(r"\| config/test\.yaml \| 0 \(\+[1-9]\d* not compared; ", proc.stdout)  # nothing run there yet
    refused(run("cost_accuracy.py", "--calibration", str(plant(tmp_path / "cal.json", "list")), *args, memory=6 << 30,
                timeout=120), "calibration file", "cal.json")


def test_startup_says_in_one_line_when_its_raw_root_holds_no_data(tmp_path):
    refused(run("startup.py", f"--raw-root={tmp_path}", memory=6 << 30, timeout=120), "argument --raw-root", str(tmp_path),
            "fedrepro partition: error:")


# -- the GPU runs' summaries: gpu_check.py, gpu_launch.py ------------------------------------------

def _gpu_check(tmp_path) -> subprocess.CompletedProcess:
    return run("gpu_check.py", "--mode", "cpu", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
               "--clients", "10")


@pytest.mark.parametrize("kind", ["devzero", "fifo", "deep", "dir"])
def test_gpu_check_refuses_a_hostile_metrics_file(tmp_path, kind):
    (tmp_path / "out").mkdir()
    bad = plant(tmp_path / "work" / "workflow_test" / "results" / "e" / "runs" / "d" / "p" / "l" / "seed0" / "metrics.json", kind)
    refused(_gpu_check(tmp_path), "metrics file", str(bad), KINDS[kind])


@pytest.mark.parametrize("name,what", [("work/stages.tsv", "stage table"), ("out/throughput.json", "throughput file"),
                                       ("out/cuda_tests.xml", "JUnit report")])
def test_gpu_check_refuses_its_other_inputs_when_they_are_no_files(tmp_path, name, what):
    (tmp_path / "work").mkdir()
    (tmp_path / "out").mkdir()
    bad = plant(tmp_path / name, "fifo")
    refused(_gpu_check(tmp_path), what, str(bad), "FIFO")


def test_gpu_check_refuses_a_missing_work_folder(tmp_path):
    refused(_gpu_check(tmp_path), "argument --work", "no such directory")


@pytest.mark.parametrize("name,kind,what", [("pfllib_FedAvg.json", "deep", "PFLlib rows file"),
                                            ("provenance.json", "fifo", "provenance file")])
def test_gpu_launch_refuses_a_hostile_json_file(tmp_path, name, kind, what):
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    cell = work / "cells_per_hour" / "results" / "e" / "runs" / "d" / "p" / "l" / "seed0"
    cell.mkdir(parents=True)
    (work / "stages.tsv").write_text("cells_per_hour\t0\t10\n")
    (cell / "metrics.json").write_text(json.dumps({"status": "ok", "resources": {"device": "cpu"}}))
    bad = plant((work if name.startswith("pfllib") else cell) / name, kind)
    proc = run("gpu_launch.py", "--mode", "cpu", "--work", str(work), "--out", str(out), "--methods", "fedavg",
               memory=6 << 30)  # it imports torch
    refused(proc, what, str(bad), KINDS[kind])


# -- parity_plato.py: the fedrepro runs it compares with -----------------------------------------

def test_parity_plato_refuses_fedrepro_runs_that_are_no_folder(tmp_path):
    bad = plant(tmp_path / "runs", "fifo")
    refused(run("parity_plato.py", "--fedrepro-runs", str(bad)), "argument --fedrepro-runs", str(bad))
