"""fedrepro.planning: the environment the workflow's jobs inherit, set in one place."""

import os

import pytest

from fedrepro.overrides import OVERRIDES_ENV
from fedrepro.planning import TuningPlan, set_job_environment
from fedrepro.progress import STATUS_DIR_ENV
from fedrepro.tracking import TENSORBOARD_DIR_ENV


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    """The variables set_job_environment writes are restored after each test; the cwd is a fresh folder."""
    monkeypatch.chdir(tmp_path)
    for name in (OVERRIDES_ENV, STATUS_DIR_ENV, TENSORBOARD_DIR_ENV):
        monkeypatch.delenv(name, raising=False)


def _exp(tensorboard: bool) -> dict:
    return {"experiment": "e", "tracking": {"tensorboard": tensorboard}, "tuning": None, "tuning_cells": [], "cells": []}


def test_the_jobs_environment_names_the_overrides_the_status_and_tensorboard_folders(tmp_path):
    set_job_environment(_exp(True), ["training.rounds=1"])
    assert os.environ[OVERRIDES_ENV] == '["training.rounds=1"]'
    assert os.environ[STATUS_DIR_ENV] == str(tmp_path / "results" / "e" / "status")
    assert os.environ[TENSORBOARD_DIR_ENV] == str(tmp_path / "results" / "e" / "tensorboard")


def test_without_overrides_or_tracking_nothing_stale_is_inherited(monkeypatch, tmp_path):
    monkeypatch.setenv(OVERRIDES_ENV, '["seeds=[0]"]')  # a parent's: not this run's
    set_job_environment(_exp(False), [])
    assert OVERRIDES_ENV not in os.environ and TENSORBOARD_DIR_ENV not in os.environ
    assert os.environ[STATUS_DIR_ENV] == str(tmp_path / "results" / "e" / "status")


def test_an_experiment_without_tuning_has_no_tuning_targets():
    plan = TuningPlan(_exp(False))
    assert plan.outputs() == [] and plan.all_selections() == [] and plan.tuned_labels == []
