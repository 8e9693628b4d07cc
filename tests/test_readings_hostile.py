"""Readings ledgers against hostile or damaged input (issue 46): malformed seed keys in `measured:`,
a hand-edited `measured:` block (`--check` recomputes it from the results where they are present),
a headline experiment outside the repository, and metrics.json files `--record` cannot read."""

from __future__ import annotations

import os

import pytest
import yaml

from fedrepro.cli import main
from fedrepro.registry import ConfigError
from fedrepro.report import readings as rd
from test_readings import RUNS, _edit, make_repo, write_results


def recorded(tmp_path):
    """A ledger recorded from a complete results folder (results/toy of its repository)."""
    path = make_repo(tmp_path)
    results = write_results(tmp_path)
    assert main(["readings", "toy", "--ledger", str(path), "--record", str(results)]) == 0
    return path, results


def one_line(err: str, what: str) -> str:
    """The one line of `err` that says `what` (--check prints each problem, then how many)."""
    lines = [x for x in err.splitlines() if what in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 1. seed keys: ASCII digits only ('²'.isdigit() is True)


@pytest.mark.parametrize("key", ["²", "١", "0x1", "-1", " 1", "1.0", "01", "9" * 40])
@pytest.mark.parametrize("block", ["labels", "changes"])
def test_a_seed_key_outside_the_grammar_is_one_line_naming_file_entry_and_key(tmp_path, capsys, key, block):
    path = make_repo(tmp_path)
    value = 0.7 if block == "labels" else [1, 2, 0.0]
    _edit(path, lambda d: d.update(measured={"labels": {}, block: {"qffl": {"0": value, key: value}}}))
    with pytest.raises(ConfigError) as err:
        rd.load_ledger(path)
    assert str(path) in str(err.value) and f"{block}.qffl has seed key {key!r}" in str(err.value), str(err.value)
    assert main(["readings", "--check", "--ledger", str(path)]) == 2
    line = one_line(capsys.readouterr().err, "has seed key")
    assert f"{block}.qffl has seed key {key!r}" in line and "allowed: a seed in ASCII digits" in line


def test_canonical_seed_keys_still_load(tmp_path):
    ledger = rd.load_ledger(make_repo(tmp_path, measured={"qffl": [0.7, 0.72, 0.74], "fedavg": [0.6] * 11}))
    assert rd.values(ledger, "fedavg").keys() == set(range(11))


# ---------------------------------------------------------------------------------------------
# 2. --check recomputes the measured block from the results it names, where they are present


def test_check_passes_a_block_that_agrees_with_its_results(tmp_path, capsys):
    path, _ = recorded(tmp_path)
    capsys.readouterr()
    assert main(["readings", "--check", "--ledger", str(path)]) == 0
    out = capsys.readouterr().out
    assert "measured (recomputed from results/toy: agrees)" in out and "not recomputed" not in out


def test_check_refuses_a_hand_edited_value_that_flips_the_verdict(tmp_path, capsys):
    path, _ = recorded(tmp_path)
    before = rd.to_markdown(rd.load_ledger(path))
    # the hand edit: FedAvg's seeds 0 and 1 lowered, and the default's changes made converged
    _edit(path, lambda d: (d["measured"]["labels"]["fedavg"].update({"0": 0.31, "1": 0.32}),
                           d["measured"]["changes"]["qffl"].update({"0": [2, 3, 0.0]})))
    assert rd.to_markdown(rd.load_ledger(path)) != before  # --md would render the forged numbers
    capsys.readouterr()
    assert main(["readings", "--check", "--ledger", str(path)]) == 2
    err = capsys.readouterr().err
    assert "measured: labels.fedavg seed 0: recorded 0.31, the results give 0.6" in err
    assert "measured: labels.fedavg seed 1: recorded 0.32, the results give 0.61" in err
    assert "measured: changes.qffl seed 0: recorded [2, 3, 0.0], the results give [2, 3, 0.1]" in err
    assert "3 problem(s) in the readings ledgers" in err and "Traceback" not in err


def test_check_refuses_a_seed_deleted_or_added_by_hand(tmp_path, capsys):
    path, _ = recorded(tmp_path)
    _edit(path, lambda d: (d["measured"]["labels"]["local"].pop("2"), d["measured"]["labels"]["qffl"].update({"7": 0.99})))
    capsys.readouterr()
    assert main(["readings", "--check", "--ledger", str(path)]) == 2
    err = capsys.readouterr().err
    assert "measured: labels.local seed 2: recorded none, the results give 0.42" in err
    assert "measured: labels.qffl seed 7: recorded 0.99, the results give none" in err


def test_check_says_not_recomputed_where_the_results_are_absent(tmp_path, capsys):
    path = make_repo(tmp_path, measured=RUNS)  # a block, and no results/toy
    assert main(["readings", "--check", "--ledger", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("not recomputed") == 1 and "not recomputed: results/toy/runs is absent" in out


def test_check_notes_missing_cells_and_refuses_unreadable_ones(tmp_path, capsys):
    path, results = recorded(tmp_path)
    cell = results / "runs" / "digits" / "dir" / "local" / "seed2" / "metrics.json"
    cell.unlink()
    capsys.readouterr()
    assert main(["readings", "--check", "--ledger", str(path)]) == 0  # its value cannot be checked: said so
    assert "not recomputed for 1 cell(s) whose metrics.json is absent: local seed 2" in capsys.readouterr().out
    os.mkfifo(cell)  # present, but not a file: a problem, never a hang
    assert main(["readings", "--check", "--ledger", str(path)]) == 2
    assert "local seed 2: " in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 3. headline.experiment outside the repository: refused without quoting the file


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_a_headline_experiment_outside_the_repository_is_refused_unread(tmp_path, capsys, where):
    repo = tmp_path / "repo"
    path = make_repo(repo)
    secret = tmp_path / "outside" / "secret.yaml"
    secret.parent.mkdir()
    secret.write_text("SECRET-CONTENT-1234: [valid, config]\n")  # an error about it would quote it
    value = {"absolute": str(secret), "dotdot": "../outside/secret.yaml", "symlink": "config/link.yaml"}[where]
    if where == "symlink":
        (repo / "config" / "link.yaml").symlink_to(secret)
    _edit(path, lambda d: d["headline"].update(experiment=value))
    with pytest.raises(ConfigError, match="key 'experiment' has value .*outside the repository"):
        rd.load_ledger(path)
    for argv in (["readings", "--check", "--ledger", str(path)], ["readings", "toy", "--ledger", str(path), "--md",
                                                                  str(tmp_path / "r.md")]):
        assert main(argv) == 2
        cap = capsys.readouterr()
        assert "SECRET" not in cap.err + cap.out and "valid, config" not in cap.err + cap.out
        assert f"key 'experiment' has value {value!r}" in cap.err and "Traceback" not in cap.err


# ---------------------------------------------------------------------------------------------
# 4. --record names every cell it cannot read, and refuses unless told to skip


def test_record_names_every_unreadable_cell_and_writes_nothing(tmp_path, capsys):
    path = make_repo(tmp_path)
    results = write_results(tmp_path, skip={("local", 2)})
    runs = results / "runs" / "digits" / "dir"
    os.mkfifo(runs / "qffl" / "seed1" / "metrics.json.fifo")
    (runs / "qffl" / "seed1" / "metrics.json").unlink()
    os.rename(runs / "qffl" / "seed1" / "metrics.json.fifo", runs / "qffl" / "seed1" / "metrics.json")
    (runs / "fedavg" / "seed0" / "metrics.json").unlink()
    (runs / "fedavg" / "seed0" / "metrics.json").symlink_to("/dev/zero")
    before = path.read_text()
    assert main(["readings", "toy", "--ledger", str(path), "--record", str(results)]) == 2
    err = capsys.readouterr().err
    assert path.read_text() == before  # nothing recorded
    lines = [x for x in err.splitlines() if x.startswith("fedrepro readings: cannot read")]
    assert len(lines) == 3, err
    assert any("local seed 2" in x and "no such metrics file" in x for x in lines)
    assert any("qffl seed 1" in x and "not a regular file" in x for x in lines)
    assert any("fedavg seed 0" in x and "/dev/zero" in x for x in lines)
    assert "3 cell(s) of the ledger's labels could not be read" in err and "--skip-unreadable" in err
    # told to skip: recorded without them, each still named
    assert main(["readings", "toy", "--ledger", str(path), "--record", str(results), "--skip-unreadable"]) == 0
    cap = capsys.readouterr()
    assert sum(x.startswith("fedrepro readings: skipped") for x in cap.err.splitlines()) == 3, cap.err
    labels = yaml.safe_load(path.read_text())["measured"]["labels"]
    assert list(labels["local"]) == ["0", "1"] and list(labels["qffl"]) == ["0", "2"] and list(labels["fedavg"]) == ["1", "2"]
    assert main(["readings", "toy", "--ledger", str(path), "--skip-unreadable"]) == 2
    assert "--skip-unreadable goes with --record" in capsys.readouterr().err


def test_skip_unreadable_is_documented():
    from conftest import REPO
    from fedrepro.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert "--skip-unreadable" in sub.choices["readings"].format_help()
    for doc in ("config/papers/published/README.md", "docs/papers.md"):
        assert "--skip-unreadable" in (REPO / doc).read_text(), doc
