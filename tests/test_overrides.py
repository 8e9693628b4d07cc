"""The researcher's loop on the config side: `--set` overrides, several config files, sweeps,
`fedrepro train --cell-id`, `fedrepro list KIND NAME` and a closed output pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, tiny_config
from fedrepro.cli import EXIT_BROKEN_PIPE, main
from fedrepro.config import apply_sets, expand_sweeps, load_and_resolve, load_config, resolve_experiment
from fedrepro.io import short_hash
from fedrepro.overrides import snakemake_items, split_items
from fedrepro.registry import ConfigError
from fedrepro.report.aggregate import metrics_json, summary_frame

TEST_CONFIG = REPO / "config" / "test.yaml"


def _diff(a, b, path=()) -> list[tuple]:
    """The key paths where two plain values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), path + (k,))]
    return [] if a == b else [path]


# ------------------------------------------------------------------------------- overrides


def test_an_override_changes_exactly_the_named_key():
    base, base_exp = load_and_resolve([TEST_CONFIG])
    for item, path, value in [("training.rounds=1", ("training", "rounds"), 1),
                              ("partitions.dir0.5.num_clients=8", ("partitions", "dir0.5", "num_clients"), 8),
                              ("partitions[dir0.5].seed=3", ("partitions", "dir0.5", "seed"), 3),
                              ("methods.fedavg_ft.hparams.ft_epochs=1", ("methods", "fedavg_ft", "hparams", "ft_epochs"), 1)]:
        config, exp = load_and_resolve([TEST_CONFIG], [item])
        assert _diff(base, config) == [path], item
        node = config
        for key in path:
            node = node[key]
        assert node == value
        assert len(exp["cells"]) == len(base_exp["cells"])
    # in the resolved cells: only the overridden value differs, and so only those cells' hashes
    _, exp = load_and_resolve([TEST_CONFIG], ["methods.fedavg_ft.hparams.ft_epochs=1"])
    for old, new in zip(base_exp["cells"], exp["cells"]):
        changed = _diff(old, new)
        assert changed == ([("hparams", "ft_epochs")] if old["label"] == "fedavg_ft" else []), old["label"]
        assert (short_hash(old) == short_hash(new)) == (old["label"] != "fedavg_ft")


def test_override_values_are_read_like_a_config_file():
    config, _ = apply_sets({}, split_items("seeds=[0, 1] training.optimizer={name: adam, lr: 0.01} a.b='x y' c=null "
                                           "d=true e=1e-3"))
    assert config == {"seeds": [0, 1], "training": {"optimizer": {"name": "adam", "lr": 0.01}}, "a": {"b": "x y"},
                      "c": None, "d": True, "e": 0.001}
    # a mapping value is merged into the mapping there, as one more --configfile would be
    merged = load_and_resolve([TEST_CONFIG], ["training.optimizer={momentum: 0.9}"])[0]["training"]["optimizer"]
    assert merged == {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@pytest.mark.parametrize("item,expected", [
    ("training.rounds=abc", ["override 'training.rounds=abc'", "config key 'training.rounds'", "'abc'", "allowed: type integer"]),
    ("training.roundz=1", ["override 'training.roundz=1'", "unknown key(s) ['roundz']", "allowed keys", "rounds"]),
    ("methods.fedavg.hparams.mu=0.1", ["override", "methods.fedavg.hparams", "'mu'", "allowed"]),
    ("seeds=[0, 1.5]", ["override 'seeds=[0, 1.5]'", "config key 'seeds.1'", "1.5", "allowed: type integer"]),
    ("a.b=", ["override 'a.b='", "no value", "allowed: KEY=VALUE", "a.b=null"]),
    ("training.rounds", ["override 'training.rounds'", "no '='", "allowed: KEY=VALUE"]),
    ("a..b=1", ["override 'a..b=1'", "'a..b'", "allowed: KEY=VALUE"]),
    ("training.rounds=.nan", ["override", "config key 'training.rounds'", "nan", "allowed: a finite number"]),
    ("training.rounds=1e400", ["override", "config key 'training.rounds'", "inf", "allowed: a finite number"]),
    ("training.rounds=!!python/object:os.system ls", ["override", "config key 'training.rounds'", "tag", "allowed: plain values"]),
    ("training.rounds=[1", ["override 'training.rounds=[1'", "'[1'", "not valid YAML"]),
])
def test_a_bad_override_is_rejected_with_key_value_and_what_is_allowed(item, expected):
    with pytest.raises(ConfigError) as err:
        load_and_resolve([TEST_CONFIG], [item])
    for part in expected:
        assert part in str(err.value), (part, str(err.value))


def test_snakemake_config_set_items():
    class Settings:  # what Snakemake's ConfigSettings holds: the parsed --config and its raw strings
        def __init__(self, config, args):
            self.config, self.config_args = config, args

    # a value with ': ' is read from the raw string (Snakemake's own parse made a mapping of it)
    raw = ["set=seeds=[0] methods.fedavg.sweep={hparams.mu: [1]}", "set=training.rounds=2"]
    assert snakemake_items(Settings({"set": {"seeds=[0] methods.fedavg.sweep={hparams.mu": "[1]}"}}, raw)) == [
        "seeds=[0]", "methods.fedavg.sweep={hparams.mu: [1]}", "training.rounds=2"]
    assert snakemake_items(Settings({"set": "training.rounds=1"}, None)) == ["training.rounds=1"]
    # Snakemake's API: ConfigSettings(config={"set": ...}) derives quoted config_args from the mapping
    from snakemake.settings.types import ConfigSettings

    api = ConfigSettings(config={"set": "training.rounds=1 seeds=[0]"})
    assert snakemake_items(api) == ["training.rounds=1", "seeds=[0]"]
    assert snakemake_items(Settings({}, [])) == []
    with pytest.raises(ConfigError, match=r"--config training=.*not an override; allowed: --config set="):
        snakemake_items(Settings({"training": {"rounds": "1"}}, ["training={rounds: 1}"]))


# ---------------------------------------------------------------- several files, the CLI


def test_validate_and_cells_merge_several_files_and_take_set(tmp_path, capsys):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("training: {rounds: 1}\nseeds: [0]\n")  # not an experiment on its own
    assert main(["validate", str(overlay)]) == 2
    assert "required" in capsys.readouterr().err
    assert main(["validate", str(TEST_CONFIG), str(overlay)]) == 0
    assert "6 cell(s)" in capsys.readouterr().out
    assert main(["validate", str(TEST_CONFIG), str(overlay), "--set", "seeds=[0,1,2]", "--set", "training.rounds=2"]) == 0
    assert "18 cell(s)" in capsys.readouterr().out
    assert main(["cells", str(TEST_CONFIG), str(overlay)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(line.endswith("/seed0") for line in lines)
    assert main(["cells", str(TEST_CONFIG), "--set", "seeds=[4] methods={fedavg: {}}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 3 and sum("/fedavg[fedavg]/seed4" in line for line in lines) == 2  # methods merged, not replaced
    assert main(["cells", str(TEST_CONFIG), "--set", "training.rounds=0"]) == 2
    err = capsys.readouterr().err
    assert "override 'training.rounds=0'" in err and "allowed: >= 1" in err


def test_list_filters_by_name_and_suggests_close_ones(capsys):
    assert main(["list", "methods", "fedavg"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[0] == "fedavg" and "fedprox" not in out
    assert len(out.splitlines()) < 10
    assert main(["list", "methods", "fedavgg"]) == 2
    err = capsys.readouterr().err
    assert "'fedavgg'" in err and "close matches: fedavg" in err


@pytest.mark.parametrize("argv", [["list", "methods"], ["list", "models"]])  # a long and a short output
def test_a_closed_pipe_ends_quietly(argv):
    proc = subprocess.Popen([sys.executable, "-m", "fedrepro", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    proc.stdout.close()  # the reader is gone before the first line (`| head -0`): every write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE and err == "", err


# ------------------------------------------------------------------------------- sweeps


def test_a_sweep_expands_to_one_label_per_value_with_the_values_in_the_summary():
    cfg = tiny_config()
    cfg["methods"]["fedprox"] = {"sweep": {"hparams.mu": [0.01, 0.1]}, "training": {"local_epochs": 2}}
    cfg["methods"]["fedavg"] = {"sweep": {"training": {"optimizer": {"lr": [0.1, 0.5]}}}}
    exp = resolve_experiment(cfg)
    labels = sorted({c["label"] for c in exp["cells"]})
    assert labels == ["fedavg-lr0.1", "fedavg-lr0.5", "fedavg_ft", "fedprox-mu0.01", "fedprox-mu0.1", "local"]
    by_label = {c["label"]: c for c in exp["cells"]}
    assert by_label["fedprox-mu0.1"]["method"] == "fedprox" and by_label["fedprox-mu0.1"]["hparams"]["mu"] == 0.1
    assert by_label["fedprox-mu0.01"]["training"]["local_epochs"] == 2  # the entry's own keys are kept
    assert by_label["fedprox-mu0.01"]["sweep"] == {"hparams.mu": 0.01}
    assert by_label["fedavg-lr0.5"]["training"]["optimizer"]["lr"] == 0.5
    assert by_label["fedavg-lr0.5"]["sweep"] == {"training.optimizer.lr": 0.5}
    assert "sweep" not in by_label["local"]
    # a sweep given on the command line: the same cells
    same, _ = apply_sets(tiny_config(), ["methods.fedprox.sweep.hparams.mu=[0.01,0.1]"])
    assert {c["label"] for c in resolve_experiment(same)["cells"]} >= {"fedprox-mu0.01", "fedprox-mu0.1"}
    # the summary: one sweep.<key> column per swept key, the values of each row's cell
    metrics = []
    for c in exp["cells"]:
        stats = {s: 0.5 for s in ("weighted_mean", "mean", "std", "min", "max", "worst10")}
        metrics.append({"schema": "fedrepro.metrics/1", "status": "ok", "rounds": 2,
                        "cell": {k: c[k] for k in ("experiment", "dataset", "partition", "partition_id", "method", "label",
                                                   "seed")} | {"model": "mlp"} | ({"sweep": c["sweep"]} if "sweep" in c else {}),
                        "summary": {"global_acc": stats, "global_f1": stats}})
    frame = summary_frame(metrics)
    assert {"sweep.hparams.mu", "sweep.training.optimizer.lr"} <= set(frame.columns)
    row = frame[frame.label == "fedprox-mu0.1"].iloc[0]
    assert row["sweep.hparams.mu"] == 0.1 and row.isna()["sweep.training.optimizer.lr"]
    assert frame[frame.label == "local"][["sweep.hparams.mu", "sweep.training.optimizer.lr"]].isna().all().all()
    nested = metrics_json(frame)["digits"]["dir"]
    assert nested["fedavg-lr0.5"]["global"]["sweep.training.optimizer.lr"] == 0.5
    assert "sweep.hparams.mu" not in nested["local"]["global"]


@pytest.mark.parametrize("sweep,expected", [
    ({"hparams.mu": []}, ["methods.fedprox.sweep.hparams.mu", "a non-empty list"]),
    ({"hparam.mu": [0.1]}, ["methods.fedprox.sweep.hparam.mu", "allowed: keys under hparams, training, model"]),
    ({"hparams.mu": [0.1, 0.1]}, ["distinct values"]),
    ({"hparams.mu": [[0.1]]}, ["methods.fedprox.sweep.hparams.mu", "[0.1]", "allowed: numbers, booleans, null or names"]),
    ({"hparams.mu": ["a b"]}, ["'a b'", "allowed: numbers"]),
    ({"hparams.nu": [0.1]}, ["methods.fedprox-nu0.1.hparams", "'nu'", "allowed"]),
    ({}, ["methods.fedprox.sweep", "allowed: a mapping"]),
])
def test_a_bad_sweep_is_rejected(sweep, expected):
    cfg = tiny_config()
    cfg["methods"]["fedprox"] = {"sweep": sweep}
    with pytest.raises(ConfigError) as err:
        resolve_experiment(cfg)
    for part in expected:
        assert part in str(err.value), (part, str(err.value))


def test_sweep_label_clash_and_tuning_are_refused():
    cfg = tiny_config()
    cfg["methods"]["fedavg-mu0.1"] = {"method": "fedprox"}
    cfg["methods"]["fedprox"] = {"method": "fedprox"}
    cfg["methods"]["fedavg"] = {"method": "fedprox", "sweep": {"hparams.mu": [0.1]}}
    with pytest.raises(ConfigError, match="makes the label 'fedavg-mu0.1', which is already a label"):
        resolve_experiment(cfg)
    cfg = tiny_config() | {"tuning": {}}
    cfg["methods"]["fedprox"] = {"sweep": {"hparams.mu": [0.1]}}
    with pytest.raises(ConfigError, match="a sweep or tuning, not both"):
        resolve_experiment(cfg)


def test_shipped_configs_have_no_sweep_and_expand_unchanged():
    for path in sorted((REPO / "config").rglob("*.yaml")):
        config = load_config(path)
        if isinstance(config, dict) and "methods" in config:
            assert expand_sweeps(config) == (config, {}), path


# ------------------------------------------------------------------ train from a cell id


def test_train_from_a_cell_id_with_an_override(tiny_partition, tmp_path, monkeypatch, capsys):
    shards, _ = tiny_partition
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config()))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDREPRO_OVERRIDES", raising=False)
    # the workflow's shards path is absent here: the message says how to make it
    assert main(["train", str(config), "--cell-id", "digits/dir/fedavg/seed0"]) == 2
    err = capsys.readouterr().err
    assert f"results/shards/digits/{shards.name}" in err and "snakemake" in err and "--shards DIR" in err
    assert main(["train", str(config), "--cell-id", "digits/dir/fedavgx/seed0", "--shards", str(shards)]) == 2
    assert "close matches: digits/dir(" in capsys.readouterr().err
    assert main(["cells", str(config)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "/fedavg[" in line)  # as `fedrepro cells` prints it
    assert main(["train", str(config), "--cell-id", line, "--set", "training.rounds=1", "--shards", str(shards),
                 "--threads", "1"]) == 0
    out = tmp_path / "results" / "unit" / "debug" / "digits" / "dir" / "fedavg" / "seed0"
    metrics = json.loads((out / "metrics.json").read_text())
    provenance = json.loads((out / "provenance.json").read_text())
    assert metrics["status"] == "ok" and metrics["rounds"] == 1
    _, exp = load_and_resolve([config], ["training.rounds=1"])
    assert provenance["cell"] == next(c for c in exp["cells"] if c["label"] == "fedavg")
    assert provenance["overrides"] == ["training.rounds=1"]
    # the workflow's form still works, and needs --shards and --out-dir
    assert main(["train", "--cell", json.dumps(provenance["cell"]), "--shards", str(shards)]) == 2
    assert "--out-dir is required" in capsys.readouterr().err

