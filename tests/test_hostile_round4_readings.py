"""Issue 57, hostile input round 4: the two views of a readings ledger agree. `readings --md` and
`--html` read the measured block as `--check` does: a block that does not recompute from the
results here is marked on the page, and one whose results are absent says it was not verified."""

from __future__ import annotations

from fedrepro.cli import main
from fedrepro.report import readings as rd
from test_readings import RUNS, _edit, make_repo
from test_readings_hostile import recorded


def _forge(path):
    # FedAvg's seeds lowered: the verdict against it would flip on the page
    _edit(path, lambda d: d["measured"]["labels"]["fedavg"].update({"0": 0.31, "1": 0.32}))


def test_md_marks_a_forged_block_that_check_refuses(tmp_path, capsys):
    path, _ = recorded(tmp_path)
    md, page = tmp_path / "ledger.md", tmp_path / "ledger.html"
    assert main(["readings", "toy", "--ledger", str(path), "--md", str(md), "--html", str(page)]) == 0
    text = md.read_text()
    assert "Verified here: the measured block recomputes from results/toy" in text and "NOT REPRODUCED" not in text
    _forge(path)
    assert main(["readings", "toy", "--ledger", str(path), "--md", str(md), "--html", str(page)]) == 0
    for text in (md.read_text(), page.read_text()):
        assert "(not reproduced here)" in text.splitlines()[0] or "(not reproduced here)" in text
        assert "NOT REPRODUCED HERE: the measured block does not recompute from the results here, 2 problem(s)" in text
        assert "labels.fedavg seed 0: recorded 0.31, the results give 0.6" in text
    capsys.readouterr()
    assert main(["readings", "--check", "--ledger", str(path)]) == 2  # the same reading refuses it
    assert "labels.fedavg seed 0: recorded 0.31" in capsys.readouterr().err


def test_md_says_not_verified_where_the_results_are_absent(tmp_path):
    path = make_repo(tmp_path, measured=RUNS)  # a block, and no results/toy
    text = rd.to_markdown(rd.load_ledger(path))
    assert "Not verified here: not recomputed: results/toy/runs is absent" in text
    assert "Verified here" not in text and "NOT REPRODUCED" not in text


def test_the_docs_page_of_the_committed_ledgers_does_not_depend_on_the_machines_results(tmp_path):
    path, _ = recorded(tmp_path)
    _forge(path)
    ledger = rd.load_ledger(path)
    docs = rd.to_markdown(ledger, verified=False)
    assert "Verification: `fedrepro readings toy --check` recomputes the measured block" in docs
    assert "Verified here" not in docs and "NOT REPRODUCED" not in docs


# ---------------------------------------------------------------------------------------------
# published-values files are read strictly, and the regime check says what a missing row does


def test_a_duplicate_key_in_a_published_file_is_refused_naming_it(tmp_path):
    import pytest

    from conftest import REPO
    from fedrepro.registry import ConfigError
    from fedrepro.report.papers import load_published

    text = (REPO / "config" / "papers" / "published" / "fedcrc.yaml").read_text()
    assert "value: 98.49" in text
    bad = tmp_path / "fedcrc.yaml"
    bad.write_text(text.replace("value: 98.49", "value: 11.0, value: 98.49", 1))
    with pytest.raises(ConfigError) as err:
        load_published(bad)
    msg = str(err.value)
    assert str(bad) in msg and ".value' appears twice" in msg and "\n" not in msg


def test_a_nulled_baseline_row_never_turns_into_a_judged_verdict():
    import math

    from fedrepro.report.regime import REGIME_UNCHECKED, Baseline, check

    two = [Baseline("a", "A", 70.0, 60.0), Baseline("b", "B", 62.0, 80.0)]  # ours against the paper's: differs
    assert check(two, "higher").verdict_block.startswith("not judged: regime differs")
    nulled = [two[0], Baseline("b", "B", 62.0, math.nan)]  # the paper's B deleted or nulled
    r = check(nulled, "higher")
    assert r.verdict_block == f"{REGIME_UNCHECKED} (without B: no paper value)"


def test_a_missing_row_that_switches_the_rule_is_named_in_the_text_and_the_verdict():
    import math

    from fedrepro.report.regime import Baseline, check

    rows = [Baseline("a", "A", 80.0, 90.0), Baseline("b", "B", 70.0, 80.0), Baseline("c", "C", 60.0, 70.0),
            Baseline("d", "D", 50.0, math.nan)]
    r = check(rows, "higher")
    assert r.agrees and r.switched
    assert "took it from 4 baselines to 3: below 4 the order must be the paper's" in r.text()
    assert "without D (no paper value), so the 3-baseline rule" in r.strength()
    full = check(rows[:3] + [Baseline("d", "D", 50.0, 60.0)], "higher")
    assert not full.switched and "without" not in full.strength()
