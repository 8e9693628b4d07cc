"""DVC round trip of an experiment between two clones (see README "DVC" and docs/operations.md).

A producer clone (git clone of this repository's HEAD) runs a tiny experiment named
`test` (dvc.yaml declares results/test/summary.json as a metric), versions it with
workflow/scripts/dvc_track.sh, which pushes raw data, shards, runs, tables and plots to
the configured local remote `localstore` (../fedrepro-dvc-store, a sibling of the clone),
and commits; then reruns it with another learning rate and commits again. A consumer
clone of the producer pulls the data, runs the documented `snakemake --touch` and must
then plan no retraining; `dvc metrics diff` between the two commits shows the change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
DVC = BIN / "dvc"
CONFIG = "config/dvc_tiny.yaml"
LOCAL = ["--workflow-profile", "workflow/profiles/local"]
RUN = [*LOCAL, "--configfile", CONFIG, "--cores", "2", "--set-threads", "train=1", "--resources", "gpu=2"]
TRACKED = ["results/test/runs", "results/test/tables", "results/test/plots", "results/shards", "results/raw/digits"]


def tiny_config(lr: float) -> dict:
    return {
        "experiment": "test",  # dvc.yaml lists results/test/summary.json and results/test/curves.csv
        "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": [16]}}}},
        "partitions": {"dir": {"partitioner": "dirichlet", "num_clients": 4, "seed": 0,
                               "params": {"alpha": 0.5, "min_partition_size": 20}}},
        "methods": {"local": {}, "fedavg": {}},
        "training": {"rounds": 2, "batch_size": 32, "optimizer": {"name": "sgd", "lr": lr}},
        "seeds": [0],
    }


ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC": str(DVC), "DVC_NO_ANALYTICS": "1",
       "GIT_AUTHOR_NAME": "fedrepro test", "GIT_AUTHOR_EMAIL": "test@fedrepro.invalid",
       "GIT_COMMITTER_NAME": "fedrepro test", "GIT_COMMITTER_EMAIL": "test@fedrepro.invalid"}


def sh(cwd: Path, *cmd, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed in {cwd}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def snakemake(cwd: Path, *args, check: bool = True) -> subprocess.CompletedProcess:
    return sh(cwd, sys.executable, "-m", "snakemake", *args, check=check)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> SimpleNamespace:
    base = tmp_path_factory.mktemp("dvc")
    producer, consumer, store = base / "producer", base / "consumer", base / "fedrepro-dvc-store"
    sh(base, "git", "clone", "-q", REPO, producer)  # the committed state (HEAD)
    assert "results/test/summary.json" in (producer / "dvc.yaml").read_text()

    for version, lr in (("v1", 0.05), ("v2", 0.2)):
        (producer / CONFIG).write_text(yaml.safe_dump(tiny_config(lr)))
        snakemake(producer, *RUN)
        sh(producer, "bash", "workflow/scripts/dvc_track.sh", "test")
        sh(producer, "git", "add", CONFIG)
        sh(producer, "git", "commit", "-q", "-m", f"results {version} (lr {lr})")

    sh(base, "git", "clone", "-q", producer, consumer)
    pulled = sh(consumer, DVC, "pull")
    return SimpleNamespace(base=base, producer=producer, consumer=consumer, store=store, pull_log=pulled.stdout)


def test_results_are_pushed_to_the_local_remote(repos):
    assert repos.store.is_dir() and any(p.is_file() for p in repos.store.rglob("*"))
    status = sh(repos.producer, DVC, "status", "--cloud")
    assert "in sync" in status.stdout, status.stdout
    in_git = sh(repos.producer, "git", "ls-files").stdout.split()
    for target in TRACKED:
        assert f"{target}.dvc" in in_git
    for small in ("results/test/summary.json", "results/test/summary.csv", "results/test/curves.csv", CONFIG):
        assert small in in_git
    assert not any(name.startswith("results/test/runs/") for name in in_git)  # cell outputs are in DVC, not git


def test_pull_restores_the_producers_results(repos):
    for target in TRACKED:
        ours, theirs = files(repos.consumer / target), files(repos.producer / target)
        assert ours and ours.keys() == theirs.keys(), target
        assert ours == theirs, target
    for label in ("local", "fedavg"):
        m = json.loads((repos.consumer / "results/test/runs/digits/dir" / label / "seed0/metrics.json").read_text())
        assert m["status"] == "ok" and m["cell"]["experiment"] == "test"


def test_touch_after_pull_marks_outputs_up_to_date_and_nothing_is_retrained(repos):
    consumer = repos.consumer
    metrics = {p: p.read_bytes() for p in (consumer / "results/test/runs").rglob("metrics.json")}
    # `dvc pull` writes files in no particular order; make the pulled shards newer than the
    # pulled metrics, as happens when they come out last: Snakemake would retrain.
    later = time.time() + 5
    for p in [consumer / "results/shards", *(consumer / "results/shards").rglob("*")]:
        os.utime(p, (later, later))
    before = snakemake(consumer, "-n", "--configfile", CONFIG)
    assert "training cell" in before.stdout and "train " in before.stdout  # retraining planned

    snakemake(consumer, *LOCAL, "--configfile", CONFIG, "--touch")  # the documented command
    after = snakemake(consumer, "-n", "--configfile", CONFIG)
    text = after.stdout + after.stderr
    assert "Nothing to be done" in text, text[-3000:]
    assert "training cell" not in text
    assert {p: p.read_bytes() for p in metrics} == metrics  # --touch changed times only
    assert sh(consumer, "git", "status", "--porcelain").stdout.strip() == ""  # still the pulled commit


def test_metrics_diff_between_two_commits_shows_the_changed_metric(repos):
    diff = json.loads(sh(repos.consumer, DVC, "metrics", "diff", "HEAD~1", "HEAD", "--json").stdout)
    changes = diff["results/test/summary.json"]
    old = json.loads(sh(repos.consumer, "git", "show", "HEAD~1:results/test/summary.json").stdout)
    new = json.loads((repos.consumer / "results/test/summary.json").read_text())
    key = "digits.dir.fedavg.global.acc_weighted_mean"
    assert key in changes, sorted(changes)
    assert changes[key]["old"] == old["digits"]["dir"]["fedavg"]["global"]["acc_weighted_mean"]
    assert changes[key]["new"] == new["digits"]["dir"]["fedavg"]["global"]["acc_weighted_mean"]
    assert changes[key]["old"] != changes[key]["new"]
    table = sh(repos.consumer, DVC, "metrics", "diff", "HEAD~1", "HEAD").stdout
    assert "results/test/summary.json" in table and key in table
