"""The plateau check (fedrepro.report.plateau): the last change of a table cell's curve, and what
the paper tables and the readings ledgers say where a row has not converged."""

from __future__ import annotations

import pytest
import yaml

from fedrepro.cli import main
from fedrepro.io import write_json_atomic
from fedrepro.report import readings as rd
from fedrepro.report.regime import REGIME_UNCHECKED
from fedrepro.report.plateau import NOT_CONVERGED, PLATEAU_TOLERANCE, last_change, movement
from test_papers import TOY_RUNS, metrics, read_csv, toy, toy_spec  # noqa: F401 (toy: a fixture)
from test_readings import RUNS, make_repo

STATS = ("weighted_mean", "mean", "std", "min", "max", "worst10")


def curve(*values: float) -> dict:
    return {s: list(values) for s in STATS}


CELL = {"status": "ok", "curves": {
    "round": [10, 20, 30, 40],
    "global_acc": curve(0.50, 0.60, 0.70, 0.72) | {"mean": [0.5, 0.6, 0.7, 0.705]},
    "personal_acc": curve(0.40, 0.50, 0.60, 0.65),
    "global_f1": curve(0.40, 0.45, 0.50, 0.49),
    "personal_f1": {**curve(0.3, 0.3, 0.3, 0.3), "mean": [0.3, None, 0.35, None]},  # not scored every round
    "train_loss": [1.0, 0.8, 0.7, 0.6]}}


def test_last_change_of_a_hand_made_cell():
    assert last_change(CELL, "global", "acc_weighted_mean") == (30, 40, pytest.approx(0.02))
    assert last_change(CELL, "union_global", "acc_weighted_mean") == (30, 40, pytest.approx(0.02))
    assert last_change(CELL, "unseen_personal", "acc_mean") == (30, 40, pytest.approx(0.05))
    # hm: whichever of personal (+0.05) and global (−0.01) moved most
    assert last_change(CELL, "union_hm", "acc_mean") == (30, 40, pytest.approx(0.05))
    assert last_change(CELL, "union_hm", "f1_weighted_mean") == (30, 40, pytest.approx(-0.01))
    # a column that is not <metric>_<stat>: acc / mean (global's mean ends 0.70 -> 0.705)
    assert last_change(CELL, "global", "type_avg") == (30, 40, pytest.approx(0.005))
    assert last_change(CELL, "global", "bestval_acc_weighted_mean") == (30, 40, pytest.approx(0.005))
    # rounds without a value are skipped: personal f1 mean is scored at 10 and 30 only
    assert last_change(CELL, "personal", "f1_mean") == (10, 30, pytest.approx(0.05))
    one = {"status": "ok", "curves": {"round": [40], "global_acc": curve(0.7)}}
    assert last_change(one, "global", "acc_mean") is None  # one point
    assert last_change(CELL, "official_personal", "f1_weighted_mean") == (30, 40, 0.0)
    assert last_change({"status": "ok", "curves": {"round": [1, 2]}}, "global", "acc_mean") is None  # no such curve
    assert last_change({**CELL, "status": "failed"}, "global", "acc_mean") is None


def test_movement_holds_the_mean_absolute_change_against_the_tolerance():
    m = movement([(30, 40, 0.01), (30, 40, -0.01), None])
    assert (m.change, m.moved, m.rounds, m.n) == (0.0, 0.01, ((30, 40),), 2) and m.converged
    assert movement([(30, 40, 0.72 - 0.71)]).converged  # 0.010000000000000009: at the tolerance
    assert not movement([(30, 40, PLATEAU_TOLERANCE + 0.001)]).converged
    assert movement([None]) is None


def _runs(tmp_path, moving: set[str]) -> list[str]:
    """The toy table's metrics.json files; the curves of `moving` still rise by 5 points at the end."""
    paths = []
    for label, accs in TOY_RUNS.items():
        for seed, acc in enumerate(accs):
            m = metrics("digits", "p", label, seed, None if acc is None else {"global": acc})
            if acc is not None:
                last = 0.05 if label in moving else 0.002
                m["curves"]["global_acc"] = curve(acc - 0.3, acc - last, acc)
            path = tmp_path / "runs" / label / f"seed{seed}" / "metrics.json"
            write_json_atomic(path, m)
            paths.append(str(path))
    return paths


def test_paper_table_with_a_row_that_still_moves(toy, tmp_path):  # noqa: F811
    published, _ = toy
    out = tmp_path / "out" / "t1"
    assert main(["paper-table", *_runs(tmp_path, {"base"}), "--published", str(published), "--spec", toy_spec(),
                 "--out-prefix", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert ("Not converged: Base (S) moved by +5.00 between rounds 2 and 3 (the last two evaluations; tolerance 1.00, "
            "a convention of this project): their ordering is not judged.") in md
    # the moving row leaves the regime check (issue 56): one baseline is left, so the check is unchecked
    assert f"| Ours vs Base | +2.00, t, p = 0.074 (n=3); verdict: {REGIME_UNCHECKED} (without broken: no stand-in value); {NOT_CONVERGED} |" in md
    assert f"| Ours vs part | +9.00, t, p = 0.070 (n=2); verdict: {REGIME_UNCHECKED} (without broken: no stand-in value) |" in md
    assert "left out: Base (not converged)" in md
    for ext in (".tex", ".html"):
        assert NOT_CONVERGED in out.with_name("t1" + ext).read_text()
    tests = read_csv(out.with_name("t1_tests.csv")).set_index("baseline")
    assert tests.loc["Base", "convergence"] == NOT_CONVERGED and tests.loc["part", "convergence"] == "plateau"
    cells = read_csv(out.with_name("t1.csv")).set_index("method")
    assert cells.loc["base", "last_change"] == pytest.approx(5.0) and cells.loc["base", "last_rounds"] == "2-3"
    assert not cells.loc["base", "converged"] and cells.loc["ours", "converged"]


def test_paper_table_at_a_plateau_says_so(toy, tmp_path):  # noqa: F811
    published, _ = toy
    out = tmp_path / "t1"
    main(["paper-table", *_runs(tmp_path, set()), "--published", str(published), "--spec", toy_spec(),
          "--out-prefix", str(out)])
    md = out.with_suffix(".md").read_text()
    assert "Plateau: every row moved by at most 0.20 between rounds 2 and 3 (the last two evaluations" in md
    assert NOT_CONVERGED not in md and "Not converged" not in md


def test_ledger_whose_option_still_moves_is_not_judged(tmp_path):
    path = make_repo(tmp_path, measured=RUNS)
    doc = yaml.safe_load(path.read_text())
    doc["measured"]["changes"] = {name: {str(s): [20, 30, 0.05 if name == "qffl_q5" else -0.002] for s in range(3)}
                                  for name in RUNS}
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    ledger = rd.load_ledger(path)
    default, option = rd.side(ledger, "qffl", "fedavg"), rd.side(ledger, "qffl_q5", "fedavg")
    assert default.verdict.startswith("holds: above the strongest baseline (Holm p < 0.05)")  # the default and FedAvg are at a plateau
    assert option.verdict == NOT_CONVERGED and rd.flips(default, option) == "n/a"
    md = rd.to_markdown(ledger)
    assert "last change +5.00 between rounds 20 and 30" in md and "last change −0.20 between rounds 20 and 30" in md
    assert f"verdict: {NOT_CONVERGED}" in md and "5.0: n/a" in md and "Plateau: the last change" in md
    assert NOT_CONVERGED in rd.to_html(ledger)
    # the strongest baseline still moving: no verdict is judged
    doc["measured"]["changes"]["fedavg"] = {str(s): [20, 30, 0.03] for s in range(3)}
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    assert rd.side(rd.load_ledger(path), "qffl", "fedavg").verdict == f"{REGIME_UNCHECKED}; {NOT_CONVERGED}"  # the moving FedAvg leaves the regime check
