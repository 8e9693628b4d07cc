"""Issue 56: sources of variation a claim must survive. A partition that draws one partition per
training seed (`partitions.<label>.draw: per_seed`), labels measured over some of the seeds
(`methods.<label>.seeds`), the unseen clients scored on all of their data (unseen_all_global) and
the metric's resolution (one scored sample) beside the verdicts."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from fedrepro.config import ConfigError, resolve_experiment
from fedrepro.data.shards import partition_id
from fedrepro.planning import WorkflowPlan
from fedrepro.report.plateau import by_cell, resolution
from fedrepro.report.stats import evidence

from conftest import tiny_config


def drawn(**partition) -> dict:
    cfg = tiny_config()
    cfg["seeds"] = [0, 1, 2]
    cfg["partitions"]["dir"].update({"draw": "per_seed", **partition})
    return cfg


def test_each_seed_draws_its_own_partition_and_seed_zero_keeps_the_fixed_draw():
    fixed = resolve_experiment({**tiny_config(), "seeds": [0, 1, 2]})
    exp = resolve_experiment(drawn())
    assert len(fixed["partitions"]) == 1 and fixed["partitions"][0]["seeds"] == [0, 1, 2]
    draws = exp["partitions"]
    assert [p["seeds"] for p in draws] == [[0], [1], [2]]
    assert [p["spec"]["seed"] for p in draws] == [0, 1, 2]
    assert len({p["id"] for p in draws}) == 3  # one shard folder per draw
    assert draws[0]["id"] == fixed["partitions"][0]["id"]  # seed 0's draw is the fixed partition: its shards stay cached
    for c in exp["cells"]:  # every cell trains on its seed's draw, so a paired test by seed pairs the same data
        assert c["partition_id"] == draws[c["seed"]]["id"]
        assert c["partition"] == "dir"
    ids = {c["partition_id"] for c in fixed["cells"]}
    assert ids == {fixed["partitions"][0]["id"]}


def test_the_draw_offsets_the_partitions_own_seed():
    exp = resolve_experiment(drawn(seed=7))
    assert [p["spec"]["seed"] for p in exp["partitions"]] == [7, 8, 9]
    assert exp["partitions"][1]["id"] == partition_id({"dataset": "digits", "dataset_params": exp["datasets"]["digits"]["params"],
                                                        **{k: v for k, v in drawn(seed=8)["partitions"]["dir"].items()
                                                           if k != "draw"}})


@pytest.mark.parametrize("value", ["per_run", 3, None])
def test_a_bad_draw_is_refused_naming_the_key(value):
    from fedrepro.config import PARTITION_DRAWS

    with pytest.raises(ConfigError, match="partitions.dir.draw") as err:
        resolve_experiment(drawn(draw=value))
    assert str(list(PARTITION_DRAWS)) in str(err.value)


def test_a_draw_seed_past_numpys_range_is_refused():
    with pytest.raises(ConfigError, match=r"partitions.dir.seed' has value 4294967295 with draw: per_seed"):
        resolve_experiment(drawn(seed=2**32 - 1))


def test_the_workflow_gives_each_cell_its_draws_shards():
    exp = resolve_experiment(drawn())
    plan = WorkflowPlan(exp)
    for c in exp["cells"]:
        wc = SimpleNamespace(dataset=c["dataset"], partition=c["partition"], label=c["label"], seed=str(c["seed"]))
        assert plan.cell_shards(wc) == f"results/shards/digits/{c['partition_id']}"
    pngs = [p for p in plan.final_outputs() if p.startswith("results/shards/")]
    assert sorted(pngs) == sorted(f"results/shards/digits/{p['id']}.png" for p in exp["partitions"])


def test_a_label_measured_over_some_seeds_trains_only_those():
    cfg = drawn()
    cfg["methods"]["fedavg"] = {"seeds": [2, 0]}
    cfg["methods"]["fedavg_plus_ft"] = {"finetune": "fedavg", "hparams": {"ft_epochs": 1}}
    exp = resolve_experiment(cfg)
    by_label = {}
    for c in exp["cells"]:
        by_label.setdefault(c["label"], []).append(c["seed"])
    assert by_label["fedavg"] == [0, 2]  # in the experiment's order
    assert by_label["local"] == [0, 1, 2]
    assert by_label["fedavg_plus_ft"] == [0, 2]  # a fine-tuning row follows its base label


def test_a_label_seed_outside_the_experiments_is_refused():
    cfg = drawn()
    cfg["methods"]["fedavg"] = {"seeds": [0, 5]}
    with pytest.raises(ConfigError, match=r"methods.fedavg.seeds' has value \[0, 5\]; \[5\] not among the experiment's seeds"):
        resolve_experiment(cfg)


def test_unseen_clients_are_also_scored_on_all_of_their_data(tiny_partition, tmp_path):
    from fedrepro.data.datasets import load_dataset
    from fedrepro.data.shards import write_partition
    from fedrepro.engine.run import train_cell
    from fedrepro.verify import check_summaries

    cfg = tiny_config()
    cfg["partitions"]["dir"].update(num_clients=5, unseen_clients=2)
    exp = resolve_experiment(cfg)
    shards = tmp_path / exp["partitions"][0]["id"]
    manifest = write_partition(load_dataset("digits", tmp_path / "raw"), exp["partitions"][0]["spec"], shards)
    cell = copy.deepcopy(next(c for c in exp["cells"] if c["label"] == "fedavg"))
    m = train_cell(cell, shards, tmp_path / "run", progress=False)
    held = [c for c in manifest["clients"] if c["unseen"]]
    whole = [sum(c["sizes"].values()) for c in held]
    assert m["clients"]["unseen_size"] == whole
    assert all(w > t for w, t in zip(whole, m["clients"]["unseen_test_size"]))
    acc = m["final"]["unseen_all_global"]["acc"]
    assert len(acc) == 2
    assert m["summary"]["unseen_all_global_acc"]["weighted_mean"] == pytest.approx(np.average(acc, weights=whole), abs=1e-12)
    check_summaries(m, "metrics.json")  # verify recomputes it with the same weights
    forged = copy.deepcopy(m)
    forged["clients"]["unseen_size"] = [1, 1]
    with pytest.raises(Exception, match="unseen_all_global"):
        check_summaries(forged, "metrics.json")
    # one scored sample: 1 / the samples the kind scores
    target = SimpleNamespace(dataset="digits", partition="dir", label="fedavg", column="acc_weighted_mean")
    runs = by_cell([m])
    assert resolution(runs, target, "unseen_all_global", [0]) == pytest.approx(1 / sum(whole))
    assert resolution(runs, target, "unseen_global", [0]) == pytest.approx(1 / sum(m["clients"]["unseen_test_size"]))
    assert resolution(runs, SimpleNamespace(**{**vars(target), "column": "f1_mean"}), "global", [0]) == 0.0


def test_a_tie_below_the_resolution_detects_nothing_smaller_than_one_sample():
    same = {0: 0.9, 1: 0.9, 2: 0.9}
    one_off = {0: 0.9, 1: 0.9, 2: 0.9 - 1 / 123}
    blind = evidence(one_off, same, resolution=0.0)
    seen = evidence(one_off, same, resolution=1 / 123)
    assert seen.detectable >= 1 / 123
    assert seen.detectable >= blind.detectable


def _fedcrc_plan(edit=None):
    from fedrepro.config import load_config
    from fedrepro.report.papers import plan_paper_tables

    from conftest import REPO

    path = REPO / "config" / "papers" / "fedcrc_cpu.yaml"
    config = load_config(path)
    if edit:
        edit(config["paper_tables"]["tables"]["table2"])
    return plan_paper_tables(config, resolve_experiment(config), config_path=path)


def test_a_table_reading_is_built_as_a_table_of_its_own_from_another_kind():
    plan = _fedcrc_plan()
    main, reading = plan.tables["table2"], plan.tables["table2_all_data"]
    assert reading.table is main.table and reading.reading == "all_data" and main.reading is None
    assert {t.kinds for t in main.targets.values()} == {("unseen_global",)}
    assert {t.kinds for t in reading.targets.values()} == {("unseen_all_global",)}
    spec = plan.spec(table="table2_all_data")
    assert spec["table"] == "table2" and spec["reading"] == "all_data" and "readings" not in spec["mapping"]


@pytest.mark.parametrize("readings, needle", [
    ({"tests": {"kind": "unseen_all_global"}}, "not 'tests'"),
    ({"all": {"kind": "bogus"}}, "readings.all.kind"),
    ({"all": {"kind": "unseen_all_global", "metrics": {}}}, "allowed: {kind: K}"),
    ([], "allowed: {name: {kind: K}}"),
])
def test_a_bad_table_reading_is_refused_naming_the_key(readings, needle):
    with pytest.raises(ConfigError, match="paper_tables.tables.table2.readings") as err:
        _fedcrc_plan(lambda t: t.update(readings=readings))
    assert needle in str(err.value)
