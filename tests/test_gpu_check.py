"""The prepared GPU check (benchmarks/gpu_check.sh, docs/gpu.md) on the CPU, so it cannot rot
between GPU sessions: its CPU mode end to end, its summary's checks, and the wheel list it
carries (benchmarks/gpu_wheels.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run_device_script(script: Path, prefix: str, tmp_path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A device script (benchmarks/gpu_*.sh, its variables named PREFIX_WORK, PREFIX_MODE) into tmp_path/out."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), f"{prefix}_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    env.pop(f"{prefix}_MODE", None)
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=timeout)


def run_script(tmp_path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_device_script(SCRIPT, "GPU_CHECK", tmp_path, *args, timeout=timeout)


@pytest.mark.slow
def test_cpu_mode_runs_every_stage_and_writes_the_summary(tmp_path):
    proc = run_script(tmp_path, "--cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cpu" and summary["ok"] and all(summary["checks"].values())
    assert {k: v["status"] for k, v in summary["stages"].items()} == {
        "cuda_tests": "ok", "workflow_test": "ok", "workflow_default": "skipped", "throughput": "ok", "calibrate": "ok"}
    tests = summary["cuda_tests"]
    assert tests["tests"] > 40 and tests["skipped"] == tests["tests"]  # every cuda test collected, skipped here
    cells = summary["workflows"]["workflow_test"]["cells"]
    assert len(cells) == 2 and {c["device"] for c in cells.values()} == {"cpu"}
    assert summary["workflows"]["workflow_test"]["max_cells_at_once"] == 2  # gpu_slots 2: side by side
    vec = next(r for r in summary["throughput"]["rows"] if r["row"] == "engine/vectorized")
    assert vec["vectorized"] is True and vec["clients"] == 10
    # what comes back from a device machine: at most 8 files, the logs in one archive
    files = sorted(p.name for p in out.iterdir())
    assert files == ["calibration.json", "cuda_tests.xml", "logs.tar.gz", "summary.json", "throughput.json"]
    # this device's calibration, kept for the run's records (docs/cost.md): the cache file as written
    from fedrepro.calibration import read_calibration

    calibrated = read_calibration(out / "calibration.json")
    assert calibrated["device"].startswith("cpu: ") and calibrated["threads"] == 1 and calibrated["startup_s"] > 0
    assert summary["calibration"]["device"] == calibrated["device"] and len(summary["calibration"]["models"]) == 1
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "./logs/workflow_test.log" in names and "./logs/environment.log" in names and "./stages.tsv" in names
    assert any(n.endswith("/logs/train/digits/dir/fedavg/seed0.log") for n in names)
    assert "[gpu_check] OK after " in proc.stdout and summary["wall_s"] > 0


def test_script_refuses_an_unknown_argument(tmp_path):
    proc = run_script(tmp_path, "--fast", timeout=30)
    assert proc.returncode == 2 and "unknown argument '--fast'; allowed: --cpu, --gpu" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_summary_checks_fail_on_what_the_gpu_run_must_show():
    """A failed cuda test, a stage out of time, a cell that ran on the CPU, cells one after
    another and a vectorized row without its peak memory each fail their check."""
    stages = {"cuda_tests": {"status": "ok"}, "workflow_test": {"status": "timeout"}, "throughput": {"status": "ok"}}
    tests = {"tests": 60, "skipped": 0, "failures": 1, "errors": 0}
    workflows = {"workflow_test": {"cells": {"a": {"status": "ok", "device": "cpu"}}, "max_cells_at_once": 1,
                                   "tables": ["results/test/tables/x.csv"]}}
    throughput = {"rows": [{"row": "engine/vectorized", "clients": 100, "vectorized": True, "rounds_per_s": 3.0,
                            "peak_round_mb": float("nan")}]}
    result = gpu_check.checks("gpu", stages, tests, workflows, throughput, 100)
    assert {k for k, good in result.items() if not good} == {
        "every stage ran and exited 0", "cuda tests ran (none skipped) and none failed",
        "workflow_test: every cell ok on cuda", "workflow_test: cells trained side by side",
        "throughput: its peak GPU memory"}
    assert gpu_check.max_overlap([(0, 2), (1, 3), (2.5, 4), (5, 6)]) == 2


def test_the_summary_names_a_damaged_calibration_file_in_one_line(tmp_path, capsys):
    (tmp_path / "work").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "calibration.json").write_text('{"format": "fedrepro-calibration/1", "device": 3}')
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--mode", "cpu", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--clients", "10"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert f"calibration file {tmp_path / 'out' / 'calibration.json'}: key 'device' has value 3" in err


def test_wheel_list_is_the_locks_closure_minus_the_device_image():
    pins = gpu_wheels.read_lock()
    carried = gpu_wheels.needed()
    for name in ("snakemake", "jsonschema", "kornia", "lightly", "kornia-rs", "rpds-py", "hydra-core", "yte"):
        assert carried.get(name) == pins[name], name  # the package and its dependencies, at the locked version
    for name in ("torch", "torchvision", "numpy", "pandas", "scikit-learn", "pyarrow", "pulp"):
        assert name not in carried, name  # the image has them; pulp is left out (NOT_CARRIED)
    assert "packaging" in carried  # the image has it, but Snakemake needs packaging<26
    cmd = gpu_wheels.download_command({"kornia": pins["kornia"]})
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("-d") + 1] == str(REPO / ".whl") and cmd[-1] == f"kornia=={pins['kornia']}"


def test_carried_folders_are_never_committed():
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert "/.whl/" in ignored and "/.fmnist/" in ignored
