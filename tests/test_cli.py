"""The `fedrepro` command: help texts, registry listings, validation exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from fedrepro.cli import build_parser, main
from fedrepro.data.datasets import DATASETS
from fedrepro.data.partitioners import PARTITIONERS
from fedrepro.methods import METHODS
from fedrepro.models import MODELS

SUBCOMMANDS = ["list", "validate", "cells", "prepare", "partition", "plot-partition", "train", "aggregate", "tables", "plots"]


def test_help_describes_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "fedrepro", "--help"], capture_output=True, text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in out
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in SUBCOMMANDS:
        assert len(sub.choices[name].description or "") > 30, name


@pytest.mark.parametrize("what,registry", [("datasets", DATASETS), ("partitioners", PARTITIONERS), ("methods", METHODS), ("models", MODELS)])
def test_list_prints_every_entry_with_parameters_and_defaults(capsys, what, registry):
    assert main(["list", what]) == 0
    out = capsys.readouterr().out
    for entry in registry:
        assert entry.name in out and entry.summary in out
        for key, param in entry.params.items():
            assert f"{key} = {param.default!r}" in out
    if what == "datasets":
        assert "size:" in out and "source:" in out


def test_validate_exit_codes(capsys, tmp_path):
    assert main(["validate", "--each", str(REPO / "config" / "config.yaml"), str(REPO / "config" / "test.yaml")]) == 0
    assert "12 cell(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "config" / "test.yaml").read_text().replace("fedavg: {}", "fedavg: {hparams: {mu: 0.1}}"))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "mu" in err and "fedavg" in err and "allowed" in err


def test_cells_lists_the_grid(capsys):
    assert main(["cells", str(REPO / "config" / "test.yaml")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 12 and any("pat2" in line and "fedavg_ft" in line and "seed1" in line for line in lines)


# ----------------------------------------------------------------------- misuse: one line, no traceback, before any work

#: (id, argv with {placeholders}, a substring the one-line message must hold: the argument or the path)
MISUSE = [
    ("no-subcommand", [], "COMMAND"),
    ("unknown-subcommand", ["frobnicate"], "'frobnicate'"),
    ("list-unknown-registry", ["list", "widgets"], "'widgets'"),
    ("validate-missing-file", ["validate", "{missing}"], "not found"),
    ("validate-directory", ["validate", "{dir}"], "a directory"),
    ("validate-empty-file", ["validate", "{empty}"], "(top level)"),
    ("validate-not-yaml", ["validate", "{binary}"], "not UTF-8"),
    ("cells-missing-file", ["cells", "{missing}"], "not found"),
    ("cells-directory", ["cells", "{dir}"], "a directory"),
    ("cells-cost-threads-0", ["cells", "{missing}", "--cost", "--threads", "0"], "--threads"),
    ("calibrate-missing-file", ["calibrate", "{missing}"], "not found"),
    ("calibrate-threads-0", ["calibrate", "{missing}", "--threads", "0"], "--threads"),
    ("calibrate-device-garbage", ["calibrate", "{missing}", "--device", "gpu0"], "--device"),
    ("train-missing-cell", ["train", "--shards", "{shards}", "--out-dir", "{d}/o"], "--cell"),
    ("finetune-missing-base", ["finetune", "--cell", "{cell}", "--final-model", "{d}/f.pt", "--shards", "{shards}",
                               "--out-dir", "{d}/o"], "--base-cell"),
    ("finetune-not-a-finetuning-row", ["finetune", "--cell", "{cell}", "--base-cell", "{cell}", "--final-model", "{d}/f.pt",
                                       "--shards", "{shards}", "--out-dir", "{d}/o"], "not a fine-tuning method"),
    ("train-cell-not-json", ["train", "--cell", "{{oops", "--shards", "{shards}", "--out-dir", "{d}/o"], "--cell"),
    ("train-cell-a-list", ["train", "--cell", "[1, 2]", "--shards", "{shards}", "--out-dir", "{d}/o"], "--cell"),
    ("train-cell-missing-keys", ["train", "--cell", "{{}}", "--shards", "{shards}", "--out-dir", "{d}/o"], "--cell"),
    ("train-cell-unknown-method", ["train", "--cell", "{cell_bad_method}", "--shards", "{shards}", "--out-dir", "{d}/o"], "'nomethod'"),
    ("train-cell-other-partition", ["train", "--cell", "{cell_other_partition}", "--shards", "{shards}", "--out-dir", "{d}/o"],
     "--shards"),
    ("train-shards-missing", ["train", "--cell", "{cell}", "--shards", "{missing}", "--out-dir", "{d}/o"], "--shards"),
    ("train-shards-a-file", ["train", "--cell", "{cell}", "--shards", "{file}", "--out-dir", "{d}/o"], "--shards"),
    ("train-shards-not-a-partition", ["train", "--cell", "{cell}", "--shards", "{dir}", "--out-dir", "{d}/o"], "manifest.json"),
    ("train-out-dir-a-file", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{file}"], "--out-dir"),
    ("train-out-dir-under-a-file", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{file}/run"], "--out-dir"),
    ("train-checkpoint-a-directory", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o",
                                      "--checkpoint", "{dir}"], "--checkpoint"),
    ("train-checkpoint-under-a-file", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o",
                                       "--checkpoint", "{file}/ckpt.pt"], "--checkpoint"),
    ("train-threads-0", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--threads", "0"], "--threads"),
    ("train-threads-negative", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--threads=-1"],
     "--threads"),
    ("train-threads-abc", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--threads", "abc"], "--threads"),
    ("train-device-garbage", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--device", "gpu0"],
     "--device"),
    ("train-tuned-missing", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--tuned", "{missing}"],
     "--tuned"),
    ("train-tuned-fifo", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--tuned", "{fifo}"], "FIFO"),
    ("train-tuned-not-json", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--tuned", "{file}"],
     "--tuned"),
    ("train-tuned-json-list", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--tuned", "{json_list}"],
     "--tuned"),
    ("train-tuned-not-a-selection", ["train", "--cell", "{cell}", "--shards", "{shards}", "--out-dir", "{d}/o", "--tuned",
                                     "{json_object}"], "--tuned"),
    ("partition-spec-not-json", ["partition", "--spec", "nope", "--root", "{d}/raw", "--out", "{d}/p"], "--spec"),
    ("partition-out-a-file", ["partition", "--spec", "{{}}", "--root", "{d}/raw", "--out", "{file}"], "--out"),
    ("partition-root-a-file", ["partition", "--spec", "{{}}", "--root", "{file}", "--out", "{d}/p"], "--root"),
    ("partition-spec-without-dataset", ["partition", "--spec", "{{}}", "--root", "{d}/raw", "--out", "{d}/p"], "dataset"),
    ("prepare-params-not-json", ["prepare", "digits", "--root", "{d}/raw", "--params", "x"], "--params"),
    ("prepare-unknown-dataset", ["prepare", "nodataset", "--root", "{d}/raw"], "'nodataset'"),
    ("prepare-out-a-directory", ["prepare", "digits", "--root", "{d}/raw", "--out", "{dir}"], "--out"),
    ("plot-partition-not-a-partition", ["plot-partition", "{dir}", "{d}/p.png"], "shards"),
    ("plot-partition-out-a-directory", ["plot-partition", "{shards}", "{dir}"], "out"),
    ("aggregate-metrics-missing", ["aggregate", "{missing}", "--csv", "{d}/s.csv", "--json", "{d}/s.json", "--curves", "{d}/c.csv"],
     "metrics"),
    ("aggregate-metrics-a-directory", ["aggregate", "{dir}", "--csv", "{d}/s.csv", "--json", "{d}/s.json", "--curves", "{d}/c.csv"],
     "metrics"),
    ("aggregate-metrics-fifo", ["aggregate", "{fifo}", "--csv", "{d}/s.csv", "--json", "{d}/s.json", "--curves", "{d}/c.csv"], "FIFO"),
    ("aggregate-csv-a-directory", ["aggregate", "{json_object}", "--csv", "{dir}", "--json", "{d}/s.json", "--curves", "{d}/c.csv"],
     "--csv"),
    ("aggregate-metrics-not-json", ["aggregate", "{file}", "--csv", "{d}/s.csv", "--json", "{d}/s.json", "--curves", "{d}/c.csv"],
     "JSON"),
    ("verify-results-missing", ["verify", "{missing}"], "nope.yaml"),
    ("verify-results-a-file", ["verify", "{file}"], "afile.txt"),
    ("verify-no-trained-cells", ["verify", "{dir}"], "no trained cells"),
    ("verify-sample-0", ["verify", "{dir}", "--sample", "0"], "--sample"),
    ("tables-summary-missing", ["tables", "--summary", "{missing}", "--out-dir", "{d}/t"], "--summary"),
    ("tables-out-dir-a-file", ["tables", "--summary", "{file}", "--out-dir", "{file}"], "--out-dir"),
    ("plots-metrics-missing", ["plots", "{missing}", "--dataset", "digits", "--partition", "p"], "metrics"),
    ("plots-curves-a-directory", ["plots", "{json_object}", "--dataset", "digits", "--partition", "p", "--curves", "{dir}"],
     "--curves"),
    ("paper-table-published-missing", ["paper-table", "--published", "{missing}", "--spec", "{{}}", "--out-prefix", "{d}/t"],
     "--published"),
    ("paper-table-spec-not-json", ["paper-table", "--published", "{file}", "--spec", "x", "--out-prefix", "{d}/t"], "--spec"),
    ("paper-figure-out-a-directory", ["paper-figure", "--published", "{file}", "--spec", "{{}}", "--out", "{dir}"], "--out"),
    ("select-spec-a-list", ["select", "--spec", "[]", "--out", "{d}/sel.json"], "--spec"),
    ("tuning-report-selection-missing", ["tuning-report", "{missing}", "--table", "{d}/t"], "selections"),
    ("status-results-a-file", ["status", "{file}"], "results"),
    ("status-watch-not-a-number", ["status", "{dir}", "--watch", "abc"], "--watch"),
    ("report-page-summary-missing", ["report-page", "--summary", "{missing}", "--spec", "{{}}", "--out", "{d}/p.rst"],
     "--summary"),
    ("report-page-spec-not-json", ["report-page", "--summary", "{file}", "--spec", "x", "--out", "{d}/p.rst"], "--spec"),
    ("train-cell-id-without-config", ["train", "--cell-id", "digits/dir/fedavg/seed0"], "--cell-id"),
    ("train-cell-and-cell-id", ["train", "--cell", "{cell}", "--cell-id", "digits/dir/fedavg/seed0", "--shards", "{shards}",
                                "--out-dir", "{d}/o"], "--cell"),
    ("train-cell-id-not-an-id", ["train", "{config}", "--cell-id", "no id"], "--cell-id"),
    ("train-cell-id-unknown-cell", ["train", "{config}", "--cell-id", "digits/dir0.5/nomethod/seed0"], "--cell-id"),
    ("pretrain-backbone-threads-0", ["pretrain-backbone", "--spec", "{{}}", "--root", "{d}/raw", "--out", "{d}/b.pt",
                                     "--threads", "0"], "--threads"),
    ("readings-ledger-missing", ["readings", "grp_fed", "--ledger", "{missing}"], "--ledger"),
    ("readings-md-a-directory", ["readings", "grp_fed", "--md", "{dir}"], "--md"),
    ("readings-nothing-to-do", ["readings"], "PAPER"),
    ("readings-docs-without-markers", ["readings", "--docs", "{file}"], "<!-- readings:begin -->"),
]


@pytest.fixture
def misuse_paths(tmp_path, tiny_partition, make_cell):
    import json
    import os

    shards, _ = tiny_partition
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile.txt").write_text("not json, not a directory\n")
    (tmp_path / "empty.yaml").write_bytes(b"")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "object.json").write_text('{"a": 1}')
    os.mkfifo(tmp_path / "fifo")
    cell = make_cell("fedavg")
    return {
        "config": str(REPO / "config" / "test.yaml"), "d": str(tmp_path), "dir": str(tmp_path / "adir"), "file": str(tmp_path / "afile.txt"),
        "empty": str(tmp_path / "empty.yaml"), "binary": str(tmp_path / "binary.yaml"), "missing": str(tmp_path / "nope.yaml"),
        "json_list": str(tmp_path / "list.json"), "json_object": str(tmp_path / "object.json"), "fifo": str(tmp_path / "fifo"),
        "shards": str(shards), "cell": json.dumps(cell), "cell_bad_method": json.dumps({**cell, "method": "nomethod"}),
        "cell_other_partition": json.dumps({**cell, "partition_id": "0123456789"}),
    }


@pytest.mark.parametrize("argv,named", [c[1:] for c in MISUSE], ids=[c[0] for c in MISUSE])
def test_misuse_is_a_one_line_error_before_any_work(misuse_paths, capsys, argv, named):
    """Every bad argument: a non-zero exit, no traceback, one line `fedrepro[ <cmd>]: error: ...`
    naming the argument or its value; nothing written (the checks run before any work)."""
    import os

    before = sorted(os.listdir(misuse_paths["d"]))
    rc = main([a.format(**misuse_paths) for a in argv])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedrepro") and ": error: " in lines[0], err
    assert named in lines[0], lines[0]
    assert sorted(os.listdir(misuse_paths["d"])) == before


def test_misuse_table_covers_every_subcommand():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    covered = {c[1][0] for c in MISUSE if c[1]}
    assert set(sub.choices) <= covered, set(sub.choices) - covered
    assert len(MISUSE) >= 43


@pytest.mark.parametrize("command", ["validate", "cells"])
def test_a_fifo_named_as_the_config_never_blocks(tmp_path, command):
    import os

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "fedrepro", command, str(fifo)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"fedrepro {command}: error: config file '{fifo}': a FIFO; allowed: the path of a regular YAML or JSON file"


def test_an_unexpected_error_keeps_its_traceback(monkeypatch, misuse_paths):
    """A bug (not bad input) is not turned into a one-line usage error: its traceback stays."""
    import fedrepro.engine.run as run

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in training")

    monkeypatch.setattr(run, "train_cell", broken)
    with pytest.raises(ZeroDivisionError):
        main(["train", "--cell", misuse_paths["cell"], "--shards", misuse_paths["shards"], "--out-dir", misuse_paths["d"] + "/o"])


def test_a_cuda_device_without_a_gpu_is_refused_before_any_work(misuse_paths, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    rc = main(["train", "--cell", misuse_paths["cell"], "--shards", misuse_paths["shards"], "--out-dir",
               misuse_paths["d"] + "/o", "--device", "cuda:0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == ("fedrepro train: error: argument --device: 'cuda:0': no CUDA device is visible; "
                                       "allowed: auto, cpu")
