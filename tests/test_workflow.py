"""The Snakemake workflow end to end on the tiny digits experiment (config/test.yaml),
plus lint, dry runs with both profiles, and the config gate."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO

TEST_CONFIG = REPO / "config" / "test.yaml"


def snakemake(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(cwd), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def e2e(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wf")
    # with TensorBoard tracking on: a side channel (test_rerun_plans_nothing then runs without it)
    snakemake("--configfile", str(TEST_CONFIG), "--workflow-profile", str(REPO / "workflow/profiles/local"),
              "--cores", "2", "--set-threads", "train=1", "--resources", "gpu=2",
              "--config", "set=tracking.tensorboard=true", cwd=work)
    snakemake("--configfile", str(TEST_CONFIG), "--report", "results/test/report.html", cwd=work)
    return work


def test_every_cell_trained_and_tabulated(e2e):
    config = yaml.safe_load(TEST_CONFIG.read_text())
    out = e2e / "results" / "test"
    for part in config["partitions"]:
        for label in config["methods"]:
            for seed in config["seeds"]:
                m = json.loads((out / "runs" / "digits" / part / label / f"seed{seed}" / "metrics.json").read_text())
                assert m["status"] == "ok" and m["rounds"] == config["training"]["rounds"]
    for name in ("accuracy", "accuracy_client_mean", "accuracy_client_std", "accuracy_worst10", "macro_f1"):
        md = (out / "tables" / f"{name}.md").read_text()
        tex = (out / "tables" / f"{name}.tex").read_text()
        for label in config["methods"]:
            assert label in md and label.replace("_", r"\_") in tex
        for part in config["partitions"]:
            assert part in md and part.replace("_", r"\_") in tex
        assert r"\toprule" in tex and r"\bottomrule" in tex
    table = pd.read_csv(out / "tables" / "accuracy.csv")
    rows = set(zip(table["label"], table["kind"]))
    assert rows == {("local", "personal"), ("fedavg", "global"), ("fedavg_ft", "global"), ("fedavg_ft", "personal")}
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary[summary.kind.isin(["global", "personal"])]) == 2 * 2 * 4  # partitions x seeds x (label, kind)


def test_tensorboard_run_writes_one_series_per_metric_per_cell_with_the_values_of_metrics_json(e2e):
    from test_tracking import assert_series_are_the_metrics, read_scalars

    out = e2e / "results" / "test"
    runs = sorted(out.glob("runs/*/*/*/seed*/metrics.json"))
    assert len(runs) == 12
    for path in runs:
        cell_dir = path.parent.relative_to(out / "runs")
        assert_series_are_the_metrics(read_scalars(out / "tensorboard" / cell_dir), json.loads(path.read_text()))


def test_plots_and_report_cover_every_panel(e2e):
    config = yaml.safe_load(TEST_CONFIG.read_text())
    out = e2e / "results" / "test"
    report = (out / "report.html").read_text()
    for part in config["partitions"]:
        for kind in ("curves", "clients"):
            png = out / "plots" / f"{kind}_digits_{part}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert png.name in report
    for manifest in (e2e / "results" / "shards" / "digits").glob("*/manifest.json"):
        assert (manifest.parent.parent / f"{manifest.parent.name}.png").exists()
        assert f"{manifest.parent.name}.png" in report
    assert "accuracy.csv" in report
    # the landing page: the main table inline and the learning curves embedded
    landing = (out / "report" / "description.rst").read_text()
    assert "fedrepro-main" in report and "fedavg_ft (personal)" in report and landing.count("base64,") == 2
    assert "tuned" not in landing and "Paper" not in landing


def test_every_csv_the_workflow_writes_reads_back_with_pandas_and_the_status_shows_every_cell_done(e2e, capsys):
    from fedrepro.cli import main

    out = e2e / "results" / "test"
    paths = sorted(out.rglob("*.csv"))
    assert {p.name for p in paths} >= {"summary.csv", "curves.csv", "accuracy.csv", "macro_f1.csv"}
    for path in paths:
        frame = pd.read_csv(path)  # no options: no comment lines, one header
        assert not [c for c in frame.columns if c.startswith(("#", "Unnamed"))], path
        pd.testing.assert_frame_equal(pd.read_csv(io.StringIO(frame.to_csv(index=False))), frame)
    summary, table = pd.read_csv(out / "summary.csv"), pd.read_csv(out / "tables" / "accuracy.csv")
    assert summary["acc_weighted_mean"].max() <= 1 and table.filter(like="/mean").max().max() <= 1  # one unit
    assert main(["status", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: 12 cell(s): 12 done")
    # the run's merged config beside its cells: `fedrepro status` estimates the time left from it (docs/cost.md)
    assert json.loads((out / "status" / "plan.json").read_text())["config"]["experiment"] == "test"


def test_rerun_plans_nothing(e2e):
    proc = snakemake("--configfile", str(TEST_CONFIG), "-n", cwd=e2e)
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_lint_is_clean(tmp_path):
    snakemake("--lint", cwd=REPO)
    snakemake("--lint", "--configfile", str(TEST_CONFIG), cwd=REPO)


@pytest.mark.parametrize("profile", ["local", "slurm"])
def test_dry_run_with_each_profile(tmp_path, profile):
    proc = snakemake("-n", "--configfile", str(TEST_CONFIG), "--workflow-profile", str(REPO / "workflow/profiles" / profile), cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert "train" in text and "12" in text  # 12 training jobs planned


def test_default_experiment_plans_one_job_per_cell(tmp_path):
    proc = snakemake("-n", "--workflow-profile", str(REPO / "workflow/profiles/local"), cwd=tmp_path)
    text = proc.stdout + proc.stderr
    assert "results/default/runs/fmnist/dir0.1/fedavg_ft/seed0/metrics.json" in text
    assert "prepare_data" in text and "partition" in text


def test_bad_config_stops_before_any_job(tmp_path):
    bad = yaml.safe_load(TEST_CONFIG.read_text())
    bad["training"]["participation"] = 1.5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = snakemake("--configfile", str(path), "--cores", "1", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "participation" in proc.stderr and "1.5" in proc.stderr and "allowed" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_config_set_overrides_through_snakemake(tmp_path):
    """`--config set=...`: the items reach the experiment (a value with ': ' too), and a bad one
    stops the dry run with the override, the key, the value and what is allowed."""
    items = "seeds=[0] partitions.dir0.5.num_clients=5 methods.fedavg.sweep={training.optimizer.lr: [0.01, 0.1]}"
    proc = snakemake("-n", "-p", "--configfile", str(TEST_CONFIG), "--config", f"set={items}", cwd=tmp_path)
    text = proc.stdout + proc.stderr
    train = [line for line in text.splitlines() if "fedrepro train --cell " in line]
    assert len(train) == 2 * 4  # partitions x labels (local, fedavg-lr0.01, fedavg-lr0.1, fedavg_ft) x 1 seed
    assert sum('"label": "fedavg-lr0.1"' in line and '"lr": 0.1' in line for line in train) == 2
    assert sum('"num_clients": 5' in line for line in text.splitlines() if "fedrepro partition --spec " in line) == 1
    proc = snakemake("-n", "--configfile", str(TEST_CONFIG), "--config", "set=seeds=[0] training.rounds=abc", cwd=tmp_path,
                     check=False)
    assert proc.returncode != 0 and not (tmp_path / "results").exists()
    assert "override 'training.rounds=abc': config key 'training.rounds' has value 'abc'; allowed: type integer" in proc.stderr
