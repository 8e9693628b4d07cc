"""Hostile input, fourth round (issue 57): calibration numbers are bounded.

A calibration file or cache is data with a schema (fedrepro.calibration.read_calibration): finite,
positive timings within stated bounds, a bounded size and nesting, refused in one line naming the file,
the key, the value and what is allowed. A bad cache found by the workflow's estimate is a warning and
is ignored: the estimate never stops a workflow. `validate --gpus` and `calibrate --threads` are bounded
integers, and every printed duration is finite and short (fedrepro.cost.human)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, tiny_config
from fedrepro import calibration, cost, planning
from fedrepro.cli import main
from fedrepro.config import load_and_resolve, resolve_experiment

H100 = "cuda: NVIDIA H100 80GB HBM3"


@pytest.fixture
def quick(monkeypatch, tmp_path):
    """A fresh working folder (results/ under it), tiny_config's file, and probes that measure nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibration, "BUDGET_S", 0.05)
    monkeypatch.setattr(calibration, "measure_startup", lambda device, threads: 1.5)
    monkeypatch.setattr(calibration, "measure_client_round", lambda device, threads: 0.002)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return path


def write_calibration(path, exp: dict, device: str, threads: int, torch: str, timing: float = 0.01,
                      models: dict | None = None, **header) -> None:
    """A calibration file at `path` with every model of `exp`, each timing `timing` (or `models` as given),
    the header's keys replaced by `header`: JSON as an editor would write it, not through save_entry."""
    specs = [calibration.model_spec(c, exp["datasets"]) for c in exp["cells"] + exp["tuning_cells"]]
    entries = {s.key: {"train_step_s": timing, "forward_sample_s": timing, "head_step_s": timing, "label": s.label()}
               for s in specs}
    data = {"format": calibration.FORMAT, "device": device, "threads": threads, "torch": torch, "startup_s": 2.0,
            "client_round_s": 0.001, "updated": "2026-12-07T10:00:00+00:00",
            "models": entries if models is None else models, **header}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def one_line_refusal(captured, *words: str) -> str:
    assert captured.out == "" and "Traceback" not in captured.err, captured.err[-2000:]
    [line] = captured.err.strip().splitlines()
    for word in words:
        assert word in line, line
    return line


# -- a cached calibration of 1e308 s stopped every workflow (OverflowError in planning) ------------------

def test_a_cache_of_huge_timings_is_a_warning_and_ignored_never_the_workflows_failure(quick, tmp_path):
    exp = resolve_experiment(tiny_config())
    root = calibration.CALIBRATION_DIR  # the workflow's, under the working folder
    from fedrepro.local_plan import machine_plan

    device, threads, torch = cost.this_device(), machine_plan().threads, calibration.torch_version()
    forged = calibration.calibration_path(device, threads, torch, root)
    write_calibration(forged, exp, device, threads, torch, timing=1e308, startup_s=1e308)
    # the SLURM time limits (every rule's runtime, evaluated as Snakemake plans, dry or real): the fixed ones
    limits = planning.RuntimeLimits(exp, calibration_root=str(root), environ={}, shards_root=str(tmp_path))
    for cell in exp["cells"]:
        assert limits.minutes("train", cell, threads) == planning.FALLBACK_RUNTIME_MIN["train"]
    # the workflow's start: one warning naming the file, the key and the bound, then the hint
    warning, hint = cost.workflow_lines(exp)
    assert warning.startswith("experiment 'unit': warning: calibration file ") and str(forged) in warning
    assert "key 'startup_s' has value 1e+308; allowed: a number of seconds from 0.1 to 600" in warning
    assert hint.startswith("experiment 'unit': cost: no calibration for this machine")
    # an estimate too large to be a number (none can come from a bounded file) asks for the longest limit
    assert planning.runtime_minutes(math.inf, 240, 240) == 240 and planning.runtime_minutes(math.nan, 60, 240) == 240


@pytest.mark.slow
def test_a_dry_run_goes_past_a_cache_of_huge_timings_with_one_warning(tmp_path):
    """The whole workflow, as the red team ran it: 1e308 s timings cached at every thread count a job may
    take; before, the dry run stopped with an OverflowError before any job."""
    _, exp = load_and_resolve([str(REPO / "config" / "test.yaml")])
    root = tmp_path / "results" / ".calibration"
    for threads in range(1, 9):
        path = calibration.calibration_path("cpu: forged", threads, "0", root)
        write_calibration(path, exp, "cpu: forged", threads, "0", timing=1e308)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                           "-n", "--configfile", str(REPO / "config" / "test.yaml")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    said = proc.stdout + proc.stderr  # (Snakemake writes an input function's error to stdout)
    assert proc.returncode == 0 and "OverflowError" not in said and "Traceback" not in said, said[-3000:]
    warnings = [l for l in proc.stderr.splitlines() if "warning: calibration file " in l]
    assert len(warnings) == 8 and all("cpu-forged-t" in l and "has value 1e+308; allowed: a number of seconds from" in l
                                      for l in warnings), warnings


# -- validate --gpus 1000000000: a MemoryError; --gpus 1e21: an OverflowError ----------------------------

@pytest.mark.parametrize("gpus", ["1000000000", str(10 ** 21), "1e21", "0", "-3", "9" * 5000])
def test_validate_gpus_is_a_bounded_integer(quick, tmp_path, capsys, monkeypatch, gpus):
    exp = resolve_experiment(tiny_config())
    gpu_file = tmp_path / "h100.json"
    write_calibration(gpu_file, exp, H100, 2, "2.11.0")
    laid_out = []  # (on code before the bound, the layout itself would allocate gigabytes: recorded, not run)
    monkeypatch.setattr(cost, "experiment_lines", lambda *a, gpus=1, **k: laid_out.append(gpus) or [])
    assert main(["validate", str(quick), "--calibration", str(gpu_file), "--gpus", gpus]) == 2
    one_line_refusal(capsys.readouterr(), "argument --gpus", "allowed: a number of GPUs from 1 to 100,000")
    assert laid_out == []


def test_validate_on_the_most_gpus_allowed_is_quick_and_says_its_wall_time(quick, tmp_path, capsys):
    from fedrepro.cli_args import MAX_GPUS

    exp = resolve_experiment(tiny_config())
    gpu_file = tmp_path / "h100.json"
    write_calibration(gpu_file, exp, H100, 2, "2.11.0")
    assert main(["validate", str(quick), "--calibration", str(gpu_file), "--gpus", str(MAX_GPUS)]) == 0
    [line] = [l for l in capsys.readouterr().out.splitlines() if ": cost on " in l]
    assert f"wall time on {MAX_GPUS} GPUs with the slurm-packed profile" in line
    assert cost.wall_seconds([3.0, 1.0, 2.0], 10 ** 12) == 3.0  # more slots than jobs: only the jobs' own laid out


# -- timings of 0 or 1e300 printed "0 s", a 300-digit number or "inf days" -------------------------------

@pytest.mark.parametrize("key,value,allowed", [
    ("train_step_s", 0, "a number of seconds from 1e-09 to 3600"),
    ("train_step_s", 1e300, "a number of seconds from 1e-09 to 3600"),
    ("forward_sample_s", 0, "a number of seconds from 1e-09 to 3600"),
    ("head_step_s", 1e300, "a number of seconds from 1e-09 to 3600"),
    ("startup_s", 0, "a number of seconds from 0.1 to 600"),
    ("startup_s", 1e300, "a number of seconds from 0.1 to 600"),
    ("client_round_s", 1e300, "a number of seconds from 0 to 1.5"),
    ("threads", 100000, "an integer from 1 to 512"),
    ("device", "cuda: H100\nfedrepro: experiment 'x': cost on ...", "a printable string of at most 200 characters"),
])
def test_calibration_timings_out_of_bounds_are_refused_in_one_line(quick, tmp_path, capsys, key, value, allowed):
    exp = resolve_experiment(tiny_config())
    path = tmp_path / "bad.json"
    write_calibration(path, exp, H100, 2, "2.11.0")
    data = json.loads(path.read_text())
    per_model = key in ("train_step_s", "forward_sample_s", "head_step_s")
    for entry in data["models"].values() if per_model else [data]:
        entry[key] = value
    path.write_text(json.dumps(data))
    where = "key 'models." if per_model else f"key '{key}' has value"
    for command in (["validate", str(quick)], ["cells", str(quick), "--cost"]):
        assert main([*command, "--calibration", str(path)]) == 2
        line = one_line_refusal(capsys.readouterr(), f"calibration file {path}", where, key, f"allowed: {allowed}")
        assert "has value " in line


def test_every_printed_duration_is_finite_and_short():
    for hostile in (math.inf, 1e300, 1e17, sys.float_info.max):
        assert cost.human(hostile) == f"over {cost.HUMAN_MAX_DAYS:,} days"
        assert cost.human_hours(hostile) == f"over {cost.HUMAN_MAX_DAYS * 24:,}"
    for nonsense in (math.nan, -1.0, -math.inf, None, "5"):
        assert cost.human(nonsense) == "unknown" and cost.human_hours(nonsense) == "unknown"
    assert cost.human(1e-9) == cost.human(0.4) == "under 1 s"  # never "0 s" for a job that takes time
    assert cost.human(42) == "42 s" and cost.human(3 * 86400) == "3.0 days" and cost.human_hours(45000) == "12.5"
    for seconds in (0, 1e-300, 0.5, 89.9, 5e3, 1e5, 3e8, 1e12, 1e308, math.inf):
        shown = cost.human(seconds)
        assert len(shown) <= 20 and "inf" not in shown and "nan" not in shown and "e+" not in shown, shown


# -- a models key of deeply nested JSON in a string: calibrate ended in a RecursionError -----------------

def test_a_models_key_of_deeply_nested_json_is_refused_in_one_line(quick, tmp_path, capsys):
    import torch

    exp = resolve_experiment(tiny_config())
    device = calibration.device_name(torch.device("cpu"))
    path = calibration.calibration_path(device, 1, calibration.torch_version())  # the cache calibrate reads
    nested = "[" * 50_000 + "]" * 50_000  # inside a string: the file's own nesting check does not see it
    timings = {"train_step_s": 0.01, "forward_sample_s": 1e-5, "head_step_s": 1e-3}
    write_calibration(path, exp, device, 1, calibration.torch_version(), models={nested: timings})
    assert main(["calibrate", str(quick), "--device", "cpu", "--threads", "1"]) == 2
    one_line_refusal(capsys.readouterr(), f"calibration file {path}: key 'models' holds the key '[[[",
                     "allowed: a model spec as `fedrepro calibrate` writes it", "nested at most 16 deep")
    # where the estimate meets it (validate, the workflow's start), it is a warning and ignored
    warning, hint = cost.workflow_lines(exp)
    assert warning.startswith(f"experiment 'unit': warning: calibration file {path}: key 'models' holds the key ")
    assert hint.startswith("experiment 'unit': cost: no calibration for this machine")


# -- calibrate --threads 100000 made no progress in 90 s ---------------------------------------------------

@pytest.mark.parametrize("threads", ["100000", "513", "0", "1.5", "1e3"])
def test_calibrate_threads_is_a_bounded_integer(quick, capsys, monkeypatch, threads):
    ran = []  # (on code before the bound, 100,000 torch threads would hang the test: recorded, not run)
    monkeypatch.setattr(calibration, "calibrate", lambda specs, device, n, *a, **k: ran.append(n) or quick)
    assert main(["calibrate", str(quick), "--device", "cpu", "--threads", threads]) == 2
    one_line_refusal(capsys.readouterr(), "argument --threads", "allowed: a number of threads from 1 to 512")
    assert ran == []
    assert main(["calibrate", str(quick), "--device", "cpu", "--threads", "512"]) == 0 and ran == [512]  # the bound itself
