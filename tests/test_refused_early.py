"""Issue 46, "refused late" and "accepted without effect".

A partition that leaves a client without training or test data depends on the labels alone, so
`fedrepro validate` refuses it wherever they are known before any job (datasets.known_labels: the
labels `prepare` cached, or the data of a package or a generator), by running the partition step's
own code on them (shards.check_from_labels: make_partition, then check_clients_usable): the two
cannot disagree. Where the labels are not known, validate says nothing new and fetches nothing.

A lever of `training.levers` that can act on none of the methods its training block reaches
(config.LEVER_TARGETS: a vectorized local update, personalized models) is a config error naming the
block, the method and the lever."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest

from fedrepro.config import ConfigError, load_config, resolve_experiment, schema
from fedrepro.data.datasets import load_dataset, prepare_dataset
from fedrepro.data.shards import EmptyClientsError, make_partition, partition_id, resolve_partition_spec, write_partition

from test_hostile_feasibility import SHIFTED, shifted_config, validate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", Path("unused"))


def digits_config(partition: dict, methods: dict | None = None, **training) -> dict:
    return {"experiment": "e", "seeds": [0], "methods": methods or {"fedavg": {}},
            "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": [8]}}}},
            "partitions": {"p": {"seed": 0, **partition}}, "training": {"rounds": 1, **training}}


def job_refusal(raw, spec: dict, out: Path) -> str | None:
    """What the partition job (write_partition) says of `spec` over the real data: its refusal, or None."""
    try:
        write_partition(raw, spec, out / partition_id(spec))
    except ConfigError as exc:
        return str(exc)
    return None


def one_line(err: str) -> str:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip().removeprefix("fedrepro validate: error: ")


# ----------------------------------------------------------------------- clients without data, from the labels


EMPTY_CASES = {
    "dirichlet": {"partitioner": "dirichlet", "num_clients": 50, "params": {"alpha": 0.1, "min_partition_size": 1}},
    "quantity_skew": {"partitioner": "quantity_skew", "num_clients": 100},
    "iid": {"partitioner": "iid", "num_clients": 400},
}


@pytest.mark.parametrize("case", EMPTY_CASES)
def test_a_partition_leaving_clients_without_data_is_refused_by_validate_with_the_jobs_own_message(
        digits, tmp_path, capsys, case):
    """Each passes every check on the sizes and class counts, and the partition job refuses it: validate
    now refuses it first, in one line naming the partition key, the dataset, the clients and what they lack."""
    config = digits_config(EMPTY_CASES[case])
    spec = {"dataset": "digits", "dataset_params": {}, **config["partitions"]["p"]}
    job = job_refusal(digits, spec, tmp_path / "shards")
    assert job is not None and "without test data: [" in job
    rc, err = validate(tmp_path, config, capsys)
    message = one_line(err)
    assert rc == 2 and message.startswith("config key 'partitions.p': dataset 'digits', partition ")
    assert job in message and "the labels of digits, read without preparing" in message
    assert not (tmp_path / "results").exists()


def test_a_client_too_small_for_the_unstratified_split_is_refused_by_name_not_by_a_traceback(digits, tmp_path, capsys):
    """sklearn's split refuses a one-sample client (stratify: false); the job crashed with its ValueError.
    Now that client has no training data, which the job and validate say alike."""
    config = digits_config({"partitioner": "dirichlet", "num_clients": 50, "params": {"alpha": 0.1, "min_partition_size": 1},
                            "split": {"test_fraction": 0.25, "stratify": False}})
    spec = {"dataset": "digits", "dataset_params": {}, **config["partitions"]["p"]}
    with pytest.raises(EmptyClientsError, match=r"[1-9]\d* without training data: \[\d"):
        write_partition(digits, spec, tmp_path / "shards" / partition_id(spec))
    rc, err = validate(tmp_path, config, capsys)
    assert rc == 2 and job_refusal(digits, spec, tmp_path / "shards") in one_line(err)
    spec["allow_empty_clients"] = True  # kept: the small client is all test data, none drawn for it
    sizes = [(len(s["train"]), len(s["test"])) for s in make_partition(digits, spec)]
    assert (0, 1) in sizes


AGREEMENT = [
    {"partitioner": "iid", "num_clients": 6},
    {"partitioner": "iid", "num_clients": 300},
    {"partitioner": "dirichlet", "num_clients": 20, "params": {"alpha": 0.05, "min_partition_size": 0}},
    {"partitioner": "dirichlet", "num_clients": 20, "params": {"alpha": 0.3, "min_partition_size": 10}, "seed": 3},
    {"partitioner": "dirichlet", "num_clients": 10, "params": {"sampler": "plato", "alpha": 0.1, "partition_size": 20}},
    {"partitioner": "pathological", "num_clients": 150, "params": {"num_classes_per_partition": 2}},
    {"partitioner": "label_quantity", "num_clients": 40, "params": {"num_classes_per_partition": 3, "partition_size": 6}},
    {"partitioner": "quantity_skew", "num_clients": 60, "params": {"min_partition_size": 2}, "split": {"test_fraction": 0.4}},
    {"partitioner": "long_tail", "num_clients": 12, "params": {"imbalance_factor": 10}},
    {"partitioner": "iid", "num_clients": 100, "scarcity": {"clients": "all", "fraction": 0.2}},
    {"partitioner": "iid", "num_clients": 300, "allow_empty_clients": True},
]


def test_validate_and_the_partition_job_agree_on_every_partitioner(digits, tmp_path):
    """The same verdict on the same labels, refusal text included, over partitioners, splits, scarcity."""
    from fedrepro.data.datasets import known_labels
    from fedrepro.data.shards import check_from_labels

    labels, _ = known_labels("digits", {})
    verdicts = []
    for i, p in enumerate(AGREEMENT):
        spec = resolve_partition_spec({"dataset": "digits", "seed": 0, **p})
        job = job_refusal(digits, spec, tmp_path / str(i))
        try:
            assert check_from_labels(labels, spec) is True, p
            mine = None
        except ConfigError as exc:
            mine = str(exc)
        assert mine == job, p
        verdicts.append(job is None)
    assert any(verdicts) and not all(verdicts)


# ----------------------------------------------------------------------- the labels `prepare` caches


def test_prepare_caches_the_labels_and_validate_decides_from_them_only_then(tmp_path, capsys, monkeypatch):
    """shifted_domains has no labels before its data exists: validate accepts, and creates nothing. Once
    `prepare` has run, it refuses what the job refuses, from the cached labels."""
    from fedrepro.data.datasets import DATASETS, labels_path
    from fedrepro.registry import resolve_params

    monkeypatch.chdir(tmp_path)
    config = shifted_config(10)  # 4 clients of 10 samples: 2 get no test sample
    assert validate(tmp_path, config, capsys)[0] == 0
    assert not Path("results").exists()

    root = Path("results/raw/shifted_domains")
    prepare_dataset("shifted_domains", root, SHIFTED)
    raw = load_dataset("shifted_domains", root, SHIFTED)
    cached = np.load(labels_path(root, resolve_params("x", DATASETS.get("shifted_domains").params, SHIFTED)))
    assert np.array_equal(cached, np.stack([raw.y, raw.official_split]))
    params = resolve_params("x", DATASETS.get("shifted_domains").params, SHIFTED)  # as the workflow passes them
    spec = {"dataset": "shifted_domains", "dataset_params": params, **config["partitions"]["qs"]}
    job = job_refusal(raw, spec, tmp_path / "shards")
    assert job is not None and "2 without test data: [2, 3]" in job
    rc, err = validate(tmp_path, config, capsys)
    assert rc == 2 and job in one_line(err) and "the labels `fedrepro prepare` cached in results/raw/shifted_domains/labels-" in err


@pytest.mark.parametrize("plant", ["fifo", "garbage", "pickle", "other_counts", "shape"])
def test_a_planted_labels_cache_is_refused_in_one_line_and_never_hangs(tmp_path, capsys, monkeypatch, plant):
    import pickle

    from fedrepro.data.datasets import DATASETS, labels_path
    from fedrepro.registry import resolve_params

    monkeypatch.chdir(tmp_path)
    root = Path("results/raw/shifted_domains")
    prepare_dataset("shifted_domains", root, SHIFTED)
    path = labels_path(root, resolve_params("x", DATASETS.get("shifted_domains").params, SHIFTED))
    rows = np.load(path)
    path.unlink()
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "garbage":
        path.write_bytes(b"\x93NUMPY garbage" * 10)
    elif plant == "pickle":
        path.write_bytes(pickle.dumps({"labels": [1, 2]}))
    elif plant == "other_counts":
        rows[0, 0] = (rows[0, 0] + 1) % 10
        np.save(path, rows)
    else:
        np.save(path, rows[:1])
    config = shifted_config(1)
    config["partitions"]["qs"]["allow_empty_clients"] = True
    rc, err = validate(tmp_path, config, capsys)
    assert rc == 2 and str(path) in one_line(err) and "fedrepro prepare" in err, err


# ----------------------------------------------------------------------- bounded: left to the job beyond the budgets


def test_beyond_its_budgets_the_labels_check_is_left_to_the_partition_step(digits, monkeypatch):
    """Never more than the replay budget of redraws (a Dirichlet minimum first met in draw 115 is not
    decided under a 9-draw budget, rather than refused as the capped loop would), nor than
    LABELS_CHECK_BUDGET labels x clients."""
    import fedrepro.data.partitioners as partitioners
    import fedrepro.data.shards as shards
    from fedrepro.data.datasets import known_labels

    labels, _ = known_labels("digits", {})
    spec = resolve_partition_spec({"dataset": "digits", "partitioner": "dirichlet", "num_clients": 6, "seed": 0,
                                   "params": {"alpha": 0.5, "min_partition_size": 240}})
    assert shards.check_from_labels(labels, spec) is True
    monkeypatch.setattr(partitioners, "DIRICHLET_REPLAY_BUDGET", 100 * 1797)
    assert shards.check_from_labels(labels, spec) is False
    make_partition(digits, spec)  # what the job does: draw 115 fits

    empty = resolve_partition_spec({"dataset": "digits", **EMPTY_CASES["iid"]})
    with pytest.raises(EmptyClientsError):
        shards.check_from_labels(labels, empty)
    monkeypatch.setattr(shards, "LABELS_CHECK_BUDGET", 1797 * 400 - 1)
    assert shards.check_from_labels(labels, empty) is False


# ----------------------------------------------------------------------- levers that cannot act


@pytest.mark.parametrize("methods, blocks, key, lever, named", [
    ({"local": {}}, {"training": {"vectorize": True, "levers": ["resident_batches"]}},
     "training.levers", "resident_batches", "'local'"),
    ({"local": {"training": {"vectorize": True, "levers": ["device_losses"]}}, "fedavg": {}}, {},
     "methods.local.training.levers", "device_losses", "'local'"),
    ({"solo": {"method": "local"}}, {"training": {"vectorize": True, "levers": ["fused_step"]}},
     "training.levers", "fused_step", "'local' (label 'solo')"),
    ({"fedavg": {}, "fedprox": {}}, {"training": {"levers": ["batched_eval"]}},
     "training.levers", "batched_eval", "'fedavg', 'fedprox'"),
    ({"fedavg": {}}, {"datasets": {"levers": ["batched_eval"]}},
     "datasets.digits.training.levers", "batched_eval", "'fedavg'"),
])
def test_a_lever_that_acts_on_none_of_the_methods_it_reaches_is_a_config_error(tmp_path, capsys, methods, blocks, key,
                                                                               lever, named):
    config = digits_config({"partitioner": "iid", "num_clients": 4}, methods, **blocks.get("training", {}))
    if "datasets" in blocks:
        config["datasets"]["digits"]["training"] = blocks["datasets"]
    rc, err = validate(tmp_path, config, capsys)
    message = one_line(err)
    assert rc == 2 and message.startswith(f"config key '{key}' has value ") and f"'{lever}' can act on none" in message
    assert named in message and "allowed: the levers that act on" in message


def test_tuning_levers_are_judged_by_the_labels_they_tune(tmp_path, capsys):
    config = digits_config({"partitioner": "iid", "num_clients": 4}, {"local": {}, "fedavg": {}})
    # tuning.methods.<label>: {} tunes nothing of that label: here only `local` is tuned
    config["tuning"] = {"val_fraction": 0.25, "lr": [0.01, 0.1], "methods": {"fedavg": {}},
                        "training": {"rounds": 1, "vectorize": True, "levers": ["resident_batches"]}}
    rc, err = validate(tmp_path, config, capsys)
    assert rc == 2 and one_line(err).startswith("config key 'tuning.training.levers' has value ['resident_batches']; ")
    config["tuning"]["methods"] = {"local": {}}  # only fedavg tuned
    assert validate(tmp_path, config, capsys)[0] == 0


def test_levers_are_kept_where_they_act_on_a_method_they_reach():
    """An experiment-wide lever acting on some of its methods stays (the others run as without it), as
    does batched_eval on `local`'s personalized models and a lever in the block of a method it acts on."""
    base = load_config(ROOT / "config" / "test.yaml")  # local, fedavg, fedavg_ft
    every = ["resident_batches", "fused_step", "cuda_graph", "device_losses", "batched_eval"]
    config = copy.deepcopy(base)
    config["training"].update(vectorize=True, levers=every)
    assert all(c["training"]["levers"] == every for c in resolve_experiment(config)["cells"])
    config = copy.deepcopy(base)
    config["methods"] = {"local": {}, "fedavg": {"training": {"vectorize": True, "levers": every[:4]}}}
    config["training"]["levers"] = ["batched_eval"]
    cells = resolve_experiment(config)["cells"]
    assert {c["label"]: c["training"]["levers"] for c in cells} == {"local": ["batched_eval"], "fedavg": every[:4]}
    with pytest.raises(ConfigError, match="'batched_eval' can act on none of the methods it reaches \\('fedavg'\\)"):
        resolve_experiment({**config, "methods": {"fedavg": {}}})


def test_every_lever_declares_what_it_acts_on():
    """A lever the schema allows without a declared target could not be judged."""
    from fedrepro.config import LEVER_TARGETS

    levers = schema()["$defs"]["training"]["properties"]["levers"]["items"]["enum"]
    assert sorted(LEVER_TARGETS) == sorted(levers)


def test_the_vectorized_levers_act_on_a_class_that_opts_in_itself_as_the_engine_reads_it():
    """`vectorized` is never inherited (a subclass may change the local update): the engine and the lever
    check ask the same classmethod."""
    from fedrepro.config import LEVER_TARGETS
    from fedrepro.methods import METHODS

    fedavg = METHODS.get("fedavg")
    sub = type("Sub", (fedavg,), {})
    assert fedavg.has_vectorized_update() and not sub.has_vectorized_update()
    assert LEVER_TARGETS["resident_batches"][1](fedavg) and not LEVER_TARGETS["resident_batches"][1](sub)
    assert LEVER_TARGETS["batched_eval"][1](METHODS.get("local")) and not LEVER_TARGETS["batched_eval"][1](fedavg)
