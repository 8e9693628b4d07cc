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
