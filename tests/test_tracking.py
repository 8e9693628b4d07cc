"""Opt-in TensorBoard tracking: one series per metric per cell, the numbers of metrics.json, and
no effect on cells, hashes or results."""

from __future__ import annotations

import json
import struct

import pytest

from conftest import REPO, tiny_config
from fedrepro.config import load_config, resolve_experiment
from fedrepro.engine.run import train_cell
from fedrepro.io import short_hash
from fedrepro.progress import cell_name
from fedrepro.tracking import TENSORBOARD_DIR_ENV
from tensorboardX.proto.event_pb2 import Event  # pinned in workflow/envs/requirements.lock


def read_scalars(run_dir) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every event file in `run_dir` (TFRecord framing: length, crc, data, crc)."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def assert_series_are_the_metrics(scalars: dict[str, dict[int, float]], m: dict) -> None:
    """Every per-round value of metrics.json is a series (float32: TensorBoard's scalar type), and nothing else."""
    scalars = dict(scalars)
    rounds = list(range(1, m["rounds"] + 1))
    assert scalars.pop("train_loss") == pytest.approx(dict(zip(rounds, m["train_loss_per_round"])), rel=1e-6)
    assert scalars.pop("comm/bytes_up") == pytest.approx(dict(zip(rounds, m["communication"]["bytes_up_per_round"])))
    assert scalars.pop("comm/bytes_down") == pytest.approx(dict(zip(rounds, m["communication"]["bytes_down_per_round"])))
    curves = {k: v for k, v in m["curves"].items() if k not in ("round", "train_loss")}
    assert curves
    for name, by_stat in curves.items():
        for stat, values in by_stat.items():
            want = {r: v for r, v in zip(m["curves"]["round"], values) if v is not None}
            assert scalars.pop(f"test/{name}/{stat}") == pytest.approx(want, rel=1e-6), (name, stat)
    for key, by_stat in m["summary"].items():  # the summaries without a curve, at the last round
        if key not in m["curves"]:
            for stat, v in by_stat.items():
                if v is not None:
                    assert scalars.pop(f"final/{key}/{stat}") == pytest.approx({m["rounds"]: v}, rel=1e-6)
    assert not scalars, f"series without a metrics.json value: {sorted(scalars)}"


def test_tensorboard_run_has_one_series_per_metric_with_the_values_of_metrics_json(tiny_partition, make_cell, tmp_path,
                                                                                   monkeypatch):
    shards = tiny_partition[0]
    plain = train_cell(make_cell("fedavg", rounds=3), shards, tmp_path / "plain", progress=False)
    monkeypatch.setenv(TENSORBOARD_DIR_ENV, str(tmp_path / "tb"))
    for label in ("fedavg", "fedavg_ft"):  # fedavg_ft: a personalized curve with a gap (personal_eval_every)
        cell = make_cell(label, rounds=3) if label == "fedavg" else make_cell(label, rounds=3, personal_eval_every=2)
        m = train_cell(cell, shards, tmp_path / label, progress=False)
        assert_series_are_the_metrics(read_scalars(tmp_path / "tb" / cell_name(cell)), m)
    # tracking is a side channel: the same cell trains to the same numbers with and without it
    assert json.loads((tmp_path / "fedavg" / "metrics.json").read_text())["final"] == plain["final"]


def test_tracking_key_changes_no_cell_and_is_off_by_default():
    exp = resolve_experiment(load_config(REPO / "config" / "test.yaml"))
    on = resolve_experiment({**load_config(REPO / "config" / "test.yaml"), "tracking": {"tensorboard": True}})
    assert exp["tracking"] == {"tensorboard": False} and on["tracking"] == {"tensorboard": True}
    assert [short_hash(c) for c in exp["cells"]] == [short_hash(c) for c in on["cells"]]
    with pytest.raises(Exception, match="tracking"):
        resolve_experiment({**tiny_config(), "tracking": {"tensorboard": "yes"}})
