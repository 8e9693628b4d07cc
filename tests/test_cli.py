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
