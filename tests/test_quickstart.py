"""The quick start's default experiment (config/config.yaml) scores its personalized columns less
often than it evaluates; that may not change a final number."""

from __future__ import annotations

import pytest

from conftest import REPO
from fedrepro.config import load_config, resolve_experiment
from fedrepro.engine.run import train_cell


@pytest.mark.parametrize("label", ["local", "fedavg_ft"])
def test_scoring_the_personal_column_less_often_changes_no_final_number(tiny_partition, make_cell, tmp_path, label):
    """Under partial participation (one of 4 clients per round, so some never train and `local`
    personalizes them at every scored evaluation) and with fine-tuning (fedavg_ft): the final
    scores, summaries and global curves are the same whether the personalized column is scored
    every round or only at the last one."""
    every = train_cell(make_cell(label, rounds=4, participation=1, eval_every=1), tiny_partition[0], tmp_path / "a",
                       progress=False)
    once = train_cell(make_cell(label, rounds=4, participation=1, eval_every=1, personal_eval_every=4),
                      tiny_partition[0], tmp_path / "b", progress=False)
    assert any(not r or r[0] > 1 for r in every["clients"]["trained_rounds"])  # untrained clients at round 1
    assert once["final"] == every["final"]
    assert once["summary"] == every["summary"] and once["train_loss_per_round"] == every["train_loss_per_round"]
    assert once["curves"].get("global_acc") == every["curves"].get("global_acc")
    assert once["curves"]["personal_acc"]["weighted_mean"][:3] == [None] * 3
    assert once["resources"]["personal_eval_time_s"] < every["resources"]["personal_eval_time_s"]


def test_default_experiment_scores_personalized_columns_sparsely_and_fine_tunes_once():
    exp = resolve_experiment(load_config(REPO / "config" / "config.yaml"))
    t = {c["label"]: c["training"] for c in exp["cells"]}
    assert set(t) == {"local", "fedavg", "fedavg_ft"}  # the same methods as before
    assert t["fedavg_ft"]["personal_eval_every"] == t["fedavg_ft"]["rounds"]
    assert t["local"]["personal_eval_every"] == 2 * t["local"]["eval_every"]
