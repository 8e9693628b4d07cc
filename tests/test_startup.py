"""A training job's start-up (issue 38): it imports only what it uses and reads every shard file once."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import random_images
from fedrepro.data import shards
from fedrepro.data.shards import partition_id, write_partition
from fedrepro.engine.run import train_cell
from fedrepro.metrics import macro_f1

#: Libraries a fedavg cell on images never uses, each a fraction of a second to seconds to import on
#: 2 cores (sklearn pulls pandas and scipy in): `python -X importtime -m fedrepro train ...` shows them.
UNUSED = ("sklearn", "pandas", "scipy", "jsonschema", "matplotlib", "pyarrow.dataset", "snakemake", "torchvision", "timm")


def test_train_imports_none_of_the_libraries_it_does_not_use(tiny_partition, make_cell, tmp_path):
    # a fresh interpreter: this test process has imported all of them already
    cell = make_cell("fedavg", rounds=1)
    code = ("import json, sys\nfrom fedrepro.cli import main\n"
            f"main(['train', '--cell', {json.dumps(cell)!r}, '--shards', {str(tiny_partition[0])!r}, "
            f"'--out-dir', {str(tmp_path / 'out')!r}, '--threads', '1'])\n"
            f"print(json.dumps([m for m in {UNUSED!r} if m in sys.modules]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "metrics.json").exists()
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_train_reads_every_shard_file_once(tmp_path, make_cell, monkeypatch):
    # a partition that keeps the official test set apart (pool: false), scored after training
    spec = {"dataset": "random_images", "partitioner": "dirichlet", "num_clients": 3, "seed": 1, "pool": False,
            "params": {"alpha": 100.0}}
    part = tmp_path / partition_id(spec)
    manifest = write_partition(random_images(300), spec, part)
    assert manifest["official_test"]
    cell = make_cell("fedavg", rounds=1)
    cell["partition_id"], cell["training"]["global_test"] = manifest["partition_id"], ["official"]
    reads, read_regular = Counter(), shards.read_regular

    def counted(path, limit=None):
        reads[Path(path).name] += 1
        return read_regular(path, limit)

    monkeypatch.setattr(shards, "read_regular", counted)
    metrics = train_cell(cell, part, tmp_path / "out", progress=False)
    assert metrics["status"] == "ok" and any(k.startswith("official_") for k in metrics["summary"])
    assert {f: reads[f] for f in manifest["files"]} == {f: 1 for f in manifest["files"]}


@pytest.mark.parametrize("classes", [1, 2, 10])
def test_macro_f1_is_sklearns_to_the_bit(classes):
    # macro_f1 no longer calls sklearn (its import was a second of every job's start): the scores must not change
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(classes)
    for _ in range(300):
        n = int(rng.integers(1, 200))
        y = rng.integers(0, classes, n)
        pred = np.where(rng.random(n) < rng.random(), y, rng.integers(0, classes + 2, n))  # also classes never true
        assert macro_f1(y, pred) == float(f1_score(y, pred, average="macro", zero_division=0))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 40, 61, 240, 1001])
@pytest.mark.parametrize("test_size", [0.25, 0.1, 1 / 3, 0.5, 0.9])
def test_shuffled_split_is_sklearns_train_test_split_to_the_bit(n, test_size):
    from sklearn.model_selection import train_test_split

    from fedrepro.data.partitioners import shuffled_split

    indices = np.random.RandomState(n).permutation(5 * n)[:n] + 17
    ours, theirs = np.random.RandomState(3), np.random.RandomState(3)
    try:
        expected = train_test_split(indices, test_size=test_size, shuffle=True, random_state=theirs)
    except ValueError as exc:  # an empty train set: refused alike
        with pytest.raises(ValueError, match="the resulting train set will be empty"):
            shuffled_split(indices, test_size, ours)
        assert "the resulting train set will be empty" in str(exc)
        return
    got = shuffled_split(indices, test_size, ours)
    assert [a.tolist() for a in got] == [a.tolist() for a in expected] and [a.dtype for a in got] == [a.dtype for a in expected]
    assert ours.randint(1 << 30) == theirs.randint(1 << 30)  # the generator is left where sklearn leaves it


def test_partition_imports_neither_torch_nor_sklearn(tmp_path):
    """The partition job (PFLlib's unstratified split, as the default experiment's) imports only what it
    uses: no torch (only methods and models need it) and no scikit-learn (`shuffled_split`). The
    synthetic dataset, since digits itself is read by scikit-learn."""
    from conftest import tiny_config
    from fedrepro.config import resolve_experiment

    cfg = tiny_config()
    cfg["datasets"] = {"synthetic": {"model": {"name": "mlp"}}}
    cfg["partitions"]["dir"]["split"] = {"test_fraction": 0.25, "stratify": False}
    spec = resolve_experiment(cfg)["partitions"][0]["spec"]
    out = tmp_path / partition_id(spec)
    code = ("import json, sys\nfrom fedrepro.cli import main\n"
            f"code = main(['partition', '--spec', {json.dumps(spec)!r}, '--root', {str(tmp_path / 'raw')!r}, '--out', {str(out)!r}])\n"
            "print(json.dumps([code] + [m for m in ('torch', 'sklearn', 'scipy') if m in sys.modules]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [0] and (out / "manifest.json").exists()
