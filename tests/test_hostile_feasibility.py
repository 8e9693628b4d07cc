"""Issue 37: partition feasibility is refused by `fedrepro validate` (and the workflow's parse-time
check, the same fedrepro.config.resolve_experiment) before any job, wherever the class counts decide
it, with the verdict the partition step reaches: label_quantity sizes, the Dirichlet draws against
min_partition_size (replayed exactly from the class counts and the seed), quantity-skew minima.
Each case runs the partitioner itself on the same data and checks that the two agree."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedrepro.cli import main
from fedrepro.config import load_config
from fedrepro.data.datasets import DATASETS, class_counts, class_counts_path, load_dataset, prepare_dataset, sample_bounds
from fedrepro.data.partitioners import Infeasible, dirichlet_partition, infeasibility
from fedrepro.data.shards import make_partition
from fedrepro.registry import resolve_params

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "config" / "test.yaml"
DIGITS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


@pytest.fixture(scope="module")
def base() -> dict:
    return load_config(TEST_CONFIG)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", Path("unused"))


def validate(tmp_path: Path, config: dict, capsys) -> tuple[int, str]:
    """`fedrepro validate` in-process on `config` written to a file: (exit status, stderr)."""
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    rc = main(["validate", str(path)])
    return rc, capsys.readouterr().err


def with_partition(base: dict, label: str, partition: dict) -> dict:
    config = copy.deepcopy(base)
    config["partitions"][label] = partition
    return config


def partition_refusal(raw, config: dict, label: str) -> Infeasible | None:
    """What the partition step says of partition `label` (its spec as the workflow passes it)."""
    spec = {"dataset": next(iter(config["datasets"])), "dataset_params": {}, **config["partitions"][label]}
    try:
        make_partition(raw, spec)
    except Infeasible as exc:
        return exc
    return None


# ----------------------------------------------------------------------- label_quantity


def test_label_quantity_beyond_a_class_is_refused_by_validate_as_by_the_partitioner(base, digits, tmp_path, capsys):
    # 10 clients x 3 classes x 178 samples = 1,780 <= 1,797 samples (the size check passes), but each class
    # is held by 3 clients wanting 60 + 59 + 59 of it, and class 8 has 174.
    bad = with_partition(base, "pat2", {"partitioner": "label_quantity", "num_clients": 10, "seed": 0,
                                        "params": {"num_classes_per_partition": 3, "partition_size": 178}})
    rc, err = validate(tmp_path, bad, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "config key 'partitions.pat2.params.partition_size' has value 178; allowed: 3 to 174" in err
    job = partition_refusal(digits, bad, "pat2")
    assert job is not None and job.key == "params.partition_size" and job.allowed.startswith("3 to 174 ")

    good = with_partition(base, "pat2", {**bad["partitions"]["pat2"], "params": {"num_classes_per_partition": 3, "partition_size": 174}})
    assert validate(tmp_path, good, capsys)[0] == 0
    assert partition_refusal(digits, good, "pat2") is None


def test_label_quantity_too_many_clients_names_the_largest_count_that_works(base, digits, tmp_path, capsys):
    # 9 of the 10 classes per client: 195 clients need 175.5 samples of each class on average; class 8 has 174
    bad = with_partition(base, "pat2", {"partitioner": "label_quantity", "num_clients": 195, "seed": 0,
                                        "params": {"num_classes_per_partition": 9}})
    rc, err = validate(tmp_path, bad, capsys)
    assert rc == 2 and "config key 'partitions.pat2.num_clients' has value 195; allowed: at most 193 " in err, err
    assert partition_refusal(digits, bad, "pat2").key == "num_clients"
    # (193 clients of about 9 samples, one a class, get no test sample at test_fraction 0.25: the partition
    # step's emptiness check, which validate runs on the labels too (test_refused_early.py), is set aside)
    good = with_partition(base, "pat2", {**bad["partitions"]["pat2"], "num_clients": 193, "allow_empty_clients": True})
    assert validate(tmp_path, good, capsys)[0] == 0
    assert partition_refusal(digits, good, "pat2") is None
    assert partition_refusal(digits, with_partition(base, "pat2", {**good["partitions"]["pat2"], "num_clients": 194}), "pat2")


# ----------------------------------------------------------------------- dirichlet


def test_dirichlet_min_partition_size_no_draw_meets_is_refused_with_the_largest_that_one_does(base, digits, tmp_path, capsys):
    # 6 clients x 290 = 1,740 <= 1,797 samples (the size check passes), but none of the 200 draws gives every client 290
    dirichlet = {**base["partitions"]["dir0.5"], "params": {"alpha": 0.5, "min_partition_size": 290, "max_retries": 200}}
    bad = with_partition(base, "dir0.5", dirichlet)
    rc, err = validate(tmp_path, bad, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "config key 'partitions.dir0.5.params.min_partition_size' has value 290; allowed: at most " in err
    job = partition_refusal(digits, bad, "dir0.5")
    assert job is not None and job.key == "params.min_partition_size" and f"allowed: {job.allowed}" in err
    largest = int(job.allowed.split()[2].rstrip(","))

    # exactly the largest one draw meets: it validates and the partition step makes it
    good = with_partition(base, "dir0.5", {**dirichlet, "params": {**dirichlet["params"], "min_partition_size": largest}})
    assert validate(tmp_path, good, capsys)[0] == 0
    assert partition_refusal(digits, good, "dir0.5") is None
    assert partition_refusal(digits, with_partition(base, "dir0.5", {**dirichlet, "params": {**dirichlet["params"],
                                                                                           "min_partition_size": largest + 1}}), "dir0.5")


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the partitioner's own cast of a NaN draw
@pytest.mark.parametrize("alpha,self_balancing", [(0.5, False), (0.1, True), (0.001, False), (5.0, True)])
def test_dirichlet_replay_agrees_with_the_partitioner(digits, alpha, self_balancing):
    """The replay from class counts gives the partitioner's verdict and its best draw, seed by seed;
    alpha 0.001 includes degenerate (NaN) draws, whose cut points np.split takes as it does."""
    n, k, retries = len(digits.y), 7, 15
    counts = np.bincount(digits.y)
    for seed in range(4):
        params = {"alpha": alpha, "min_partition_size": n // k, "self_balancing": self_balancing, "max_retries": retries,
                  "sampler": "split", "partition_size": 600}
        with pytest.raises(Infeasible) as job:  # no draw is perfectly even: the message holds the best draw
            dirichlet_partition(digits.y, k, np.random.RandomState(seed), **{p: params[p] for p in params if p != "partition_size"})
        with pytest.raises(Infeasible) as replay:
            infeasibility("dirichlet", counts, k, seed, params)
        assert str(replay.value) == str(job.value)
        best = int(job.value.allowed.split()[2].rstrip(","))
        met = {**params, "min_partition_size": best}
        assert infeasibility("dirichlet", counts, k, seed, met) is None
        dirichlet_partition(digits.y, k, np.random.RandomState(seed), **{p: met[p] for p in met if p != "partition_size"})


def test_a_dirichlet_replay_beyond_the_budget_is_left_to_the_partition_step(monkeypatch):
    """The documented limit: validate never spends more than DIRICHLET_REPLAY_BUDGET on one partition;
    an infeasible minimum it cannot replay to the end passes, and the partition step refuses it."""
    import fedrepro.data.partitioners as partitioners

    params = {"alpha": 0.5, "min_partition_size": 290, "self_balancing": False, "max_retries": 1000, "sampler": "split",
              "partition_size": 600}
    with pytest.raises(Infeasible):
        infeasibility("dirichlet", DIGITS_COUNTS, 6, 0, params)
    monkeypatch.setattr(partitioners, "DIRICHLET_REPLAY_BUDGET", 100 * 1797)  # a few draws, not 1,000
    assert infeasibility("dirichlet", DIGITS_COUNTS, 6, 0, params) is None
    assert infeasibility("dirichlet", DIGITS_COUNTS, 6, 0, {**params, "min_partition_size": 100}) is None  # met in draw 1


# ----------------------------------------------------------------------- quantity skew, from the counts prepare caches


SHIFTED = {"base": "digits", "domains": ["gray"], "per_domain": 40, "image_size": 8}


def shifted_config(min_partition_size: int) -> dict:
    return {"experiment": "e", "seeds": [0], "methods": {"fedavg": {}},
            "datasets": {"shifted_domains": {"params": SHIFTED, "model": {"name": "mlp", "params": {"hidden": [8]}}}},
            "partitions": {"qs": {"partitioner": "quantity_skew", "num_clients": 4, "seed": 0,
                                  "params": {"min_partition_size": min_partition_size}}}}


def test_quantity_skew_minimum_is_refused_from_the_counts_prepare_cached(tmp_path, capsys, monkeypatch):
    """shifted_domains has no size known before its data exists; once `prepare` has run (the workflow's
    first job), the parse-time check and `fedrepro validate` know its 40 samples."""
    monkeypatch.chdir(tmp_path)
    root = Path("results/raw/shifted_domains")
    prepare_dataset("shifted_domains", root, SHIFTED)
    resolved = resolve_params("x", DATASETS.get("shifted_domains").params, SHIFTED)
    assert class_counts_path(root, resolved).is_file()
    raw = load_dataset("shifted_domains", root, SHIFTED)

    bad = shifted_config(11)  # 4 x 11 = 44 > 40
    rc, err = validate(tmp_path, bad, capsys)
    assert rc == 2 and "config key 'partitions.qs.params.min_partition_size' has value 11; allowed: at most 10 " in err, err
    spec = {"dataset": "shifted_domains", "dataset_params": SHIFTED, **bad["partitions"]["qs"]}
    with pytest.raises(Infeasible) as job:
        make_partition(raw, spec)
    assert job.value.key == "params.min_partition_size" and job.value.allowed.startswith("at most 10 ")

    # (clients of 10 samples in few-sample classes may get no test sample: the emptiness check is set aside)
    assert validate(tmp_path, {**shifted_config(10), "partitions": {"qs": {**bad["partitions"]["qs"], "params": {
        "min_partition_size": 10}, "allow_empty_clients": True}}}, capsys)[0] == 0
    make_partition(raw, {**spec, "params": {"min_partition_size": 10}})


def test_label_quantity_is_decided_from_the_cached_counts_too(tmp_path, capsys, monkeypatch):
    """The 40 cached samples' classes ([5, 5, 5, 2, 4, 6, 6, 2, 1, 4]) decide label_quantity as well."""
    monkeypatch.chdir(tmp_path)
    root = Path("results/raw/shifted_domains")
    prepare_dataset("shifted_domains", root, SHIFTED)
    raw = load_dataset("shifted_domains", root, SHIFTED)
    config = shifted_config(1)
    config["partitions"] = {"lq": {"partitioner": "label_quantity", "num_clients": 4, "seed": 0,
                                   "params": {"num_classes_per_partition": 2, "partition_size": 4}}}
    rc, err = validate(tmp_path, config, capsys)
    assert rc == 2 and "config key 'partitions.lq.params.partition_size' has value 4; allowed: 2 to 3 " in err, err
    with pytest.raises(Infeasible, match="allowed: 2 to 3 "):
        make_partition(raw, {"dataset": "shifted_domains", "dataset_params": SHIFTED, **config["partitions"]["lq"]})
    config["partitions"]["lq"]["params"]["partition_size"] = 3
    config["partitions"]["lq"]["allow_empty_clients"] = True  # 3 samples of 2 classes: no test sample (emptiness aside)
    assert validate(tmp_path, config, capsys)[0] == 0
    make_partition(raw, {"dataset": "shifted_domains", "dataset_params": SHIFTED, **config["partitions"]["lq"]})


# ----------------------------------------------------------------------- the workflow's parse-time check


@pytest.mark.slow
@pytest.mark.parametrize("case", ["label_quantity-declared-counts", "quantity_skew-cached-counts"])
def test_snakemake_dry_run_refuses_them_while_parsing_with_validates_message(base, tmp_path, capsys, monkeypatch, case):
    """common.smk's resolve_experiment decides as `fedrepro validate` does: the registry's counts, or the
    counts the prepare job cached under the workflow's results/raw/<dataset> (--directory)."""
    monkeypatch.chdir(tmp_path)
    if case.startswith("label_quantity"):
        config = with_partition(base, "pat2", {"partitioner": "label_quantity", "num_clients": 10, "seed": 0,
                                               "params": {"num_classes_per_partition": 3, "partition_size": 178}})
    else:
        prepare_dataset("shifted_domains", Path("results/raw/shifted_domains"), SHIFTED)
        config = shifted_config(11)
    rc, err = validate(tmp_path, config, capsys)
    message = err.strip().removeprefix("fedrepro validate: error: ")
    assert rc == 2 and "partitions." in message
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
                           "-n", "--configfile", "exp.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"fedrepro: invalid experiment config: {message}" in text.splitlines(), text[-3000:]
    assert "Building DAG" not in text and "Traceback" not in text
    assert not Path("results/shards").exists()


# ----------------------------------------------------------------------- the cache is read bounded


def digits_cache() -> Path:
    return class_counts_path(Path("results/raw/digits"), {})


@pytest.mark.parametrize("plant", ["fifo", "dev_zero", "deep", "foreign"])
def test_a_planted_class_counts_cache_is_refused_in_one_line_and_never_hangs(base, tmp_path, capsys, monkeypatch, plant):
    monkeypatch.chdir(tmp_path)
    path = digits_cache()
    path.parent.mkdir(parents=True)
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "dev_zero":
        path.symlink_to("/dev/zero")
    elif plant == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text(json.dumps({"dataset": "fmnist", "params": {}, "all": [1] * 10, "train": [1] * 10}))
    rc, err = validate(tmp_path, base, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and str(path) in err and "Traceback" not in err, err


# ----------------------------------------------------------------------- the declared counts are the data's


def test_declared_class_counts_are_the_datas_and_sum_to_the_known_sizes(digits):
    assert DATASETS.get("digits").class_counts[0] == tuple(np.bincount(digits.y).tolist()) == tuple(DIGITS_COUNTS)
    for name in ("digits", "fmnist", "mnist", "cifar10", "cifar100"):
        train, all_rows = class_counts(name, {}, False, root=Path("/nonexistent")), class_counts(name, {}, True, root=Path("/nonexistent"))
        assert (int(train[0].sum()), int(all_rows[0].sum())) == sample_bounds(name, {}), name
        assert len(train[0]) == DATASETS.get(name).num_classes


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz").is_file(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_declared_fmnist_counts_are_those_of_debians_files():
    import gzip

    got = []
    for name in ("train", "t10k"):
        with gzip.open(f"/usr/share/datasets/fashion-mnist/{name}-labels-idx1-ubyte.gz") as fh:
            got.append(tuple(np.bincount(np.frombuffer(fh.read()[8:], np.uint8)).tolist()))
    assert tuple(got) == DATASETS.get("fmnist").class_counts
