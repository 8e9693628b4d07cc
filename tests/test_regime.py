"""The regime check (fedrepro.report.regime): a stand-in's baselines against the paper's values for
the same rows, and what the paper tables and the readings ledgers print where it disagrees."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from fedrepro.cli import main
from fedrepro.report import readings as rd
from fedrepro.report.plateau import NOT_CONVERGED
from fedrepro.report.regime import REGIME_DIFFERS, REGIME_UNCHECKED, Baseline, check, places
from test_papers import TOY, read_csv, toy, toy_spec  # noqa: F401 (toy: a fixture)
from test_plateau import _runs
from test_readings import LEDGER, PAPER, RUNS, make_repo


def _bs(ours: list[float], paper: list[float], ids: list[str] | None = None) -> list[Baseline]:
    ids = ids or [f"m{i}" for i in range(len(ours))]
    return [Baseline(i, i.upper(), o, p) for i, o, p in zip(ids, ours, paper)]


def test_places_share_ties_and_follow_the_direction():
    assert places([3.0, 1.0, 3.0, 2.0], "higher") == [1.5, 4, 1.5, 3]  # ties: the average place (issue 56)
    assert places([3.0, 1.0, 3.0, 2.0], "lower") == [3.5, 1, 3.5, 2]


def test_four_or_more_baselines_need_rank_agreement():
    same = check(_bs([90, 80, 70, 60, 50], [98, 97, 96, 95, 94]), "higher")
    assert same.agrees and same.rho == pytest.approx(1.0) and same.verdict_block is None
    reversed_ = check(_bs([50, 60, 70, 80, 90], [98, 97, 96, 95, 94]), "higher")
    assert reversed_.agrees is False and reversed_.rho == pytest.approx(-1.0)
    assert "ρ < 0.6 and τ < 0.45" in reversed_.reason and reversed_.verdict_block == REGIME_DIFFERS
    # one swap of five: ρ = 0.9, τ = 0.8, agrees; the orders are printed best first
    one_swap = check(_bs([90, 70, 80, 60, 50], [98, 97, 96, 95, 94]), "higher")
    assert one_swap.agrees and one_swap.rho == pytest.approx(0.9) and one_swap.tau == pytest.approx(0.8)
    assert "ours M0 > M2 > M1 > M3 > M4; the paper's M0 > M1 > M2 > M3 > M4" in one_swap.text()
    # lower is better: the same values, the order read the other way, still one monotone relation
    assert check(_bs([50, 60, 70, 80], [1, 2, 3, 4]), "lower").agrees


def test_local_and_fedavg_must_rank_within_one_place_of_the_paper():
    # ρ high, but FedAvg is last here and first in the paper (the FedCRC stand-in's defect)
    ids = ["fedavg", "fedrep", "fedbabu", "fedprox", "fedper", "x"]
    r = check(_bs([50, 95, 94, 93, 92, 91], [99, 98, 97, 96, 95, 94], ids), "higher")
    assert not r.agrees and r.places["fedavg"] == (6, 1)
    assert "FEDAVG is 6, the paper's 1 (more than 1 place apart)" in r.reason
    # one place off is allowed
    r = check(_bs([95, 96, 94, 93, 92], [99, 98, 97, 96, 95], ids[:5]), "higher")
    assert r.agrees and r.places["fedavg"] == (2, 1)


def test_fewer_than_four_baselines_need_the_papers_order():
    assert check(_bs([3, 2, 1], [30, 20, 10]), "higher").agrees
    r = check(_bs([3, 1, 2], [30, 20, 10]), "higher")
    assert not r.agrees and "order must be the paper's" in r.reason
    one = check(_bs([5], [1]), "higher")  # one baseline: no order to check (issue 56; was "agrees")
    assert one.agrees is None and one.verdict_block == REGIME_UNCHECKED and "unchecked: one baseline (M0)" in one.text()
    none = check([Baseline("m", "M", 1.0, math.nan)], "higher")
    assert none.agrees is None and none.verdict_block == f"{REGIME_UNCHECKED} (without M: no paper value)"


def _toy_with(tmp_path, part_value: float):
    """The toy paper with a published value for the baseline `part` (ours: Base 70.0 > part 62.0)."""
    doc = copy.deepcopy(TOY)
    doc["tables"]["t1"]["cells"].append({"method": "part", "dataset": "d", "setting": "s", "metric": "acc",
                                         "value": part_value})
    path = tmp_path / "toy_regime.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path


@pytest.mark.parametrize("part_value, agrees", [(80.0, False), (60.0, True)])
def test_paper_table_prints_not_judged_where_the_regime_differs(toy, tmp_path, part_value, agrees):  # noqa: F811
    out = tmp_path / "out" / "t1"
    assert main(["paper-table", *_runs(tmp_path, set()), "--published", str(_toy_with(tmp_path, part_value)), "--spec", toy_spec(),
                 "--out-prefix", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "Regime check (D / S / Acc. (%)): Spearman ρ = " in md
    tests = read_csv(out.with_name("t1_tests.csv")).set_index("baseline")
    cells = read_csv(out.with_name("t1.csv")).set_index("method")
    assert set(cells["regime_agrees"].dropna()) == {agrees}
    if agrees:
        assert (tests["regime"] == "agrees").all() and REGIME_DIFFERS not in md
        # two baselines: any order of two agrees by chance half the time, so the check is weak (issue 56)
        # ... and the row without a stand-in value is named in the verdict (issue 57: never silent)
        assert tests.loc["Base", "verdict"].startswith(
            "not shown, on a weak regime check (p = 0.5; without broken (no stand-in value)) (gain +2.00 [")
    else:
        assert "differs: with 2 baselines (< 4) the order must be the paper's" in md
        blocked = f"{REGIME_DIFFERS} (without broken: no stand-in value)"
        assert (tests["verdict"] == blocked).all() and tests["regime"].str.startswith("differs").all()
        assert f"verdict: {blocked}" in md
        for ext in (".tex", ".html"):
            assert "regime differs" in out.with_name("t1" + ext).read_text()


def test_ledger_verdicts_are_not_judged_where_the_regime_differs(tmp_path):
    agrees = rd.load_ledger(make_repo(tmp_path / "a", measured=RUNS))
    assert rd.regime(agrees).agrees
    assert rd.side(agrees, "qffl", rd.strongest(agrees)).verdict.startswith("holds: above the strongest baseline (Holm p < 0.05)")
    # the paper ranks Local above FedAvg; ours the other way: nothing is judged, nothing flips
    paper = copy.deepcopy(PAPER)
    paper["tables"]["t1"]["cells"][1]["value"] = 70.0
    path = make_repo(tmp_path / "b", measured=RUNS)
    (path.parent.parent / "toy.yaml").write_text(yaml.safe_dump(paper, allow_unicode=True))
    differs = rd.load_ledger(path)
    assert rd.regime(differs).agrees is False
    default = rd.side(differs, "qffl", rd.strongest(differs))
    assert default.verdict == REGIME_DIFFERS
    assert rd.flips(default, rd.side(differs, "qffl_q5", rd.strongest(differs))) == "n/a"
    md = rd.to_markdown(differs)
    assert "Regime check of the headline column" in md and f"every verdict below is '{REGIME_DIFFERS}'" in md
    # a moving row too: both reasons are given
    moving = {k: {str(s): [1, 2, 0.05] for s in range(3)} for k in LEDGER["headline"]["baselines"]}
    differs.measured["changes"] = {k: {int(s): v for s, v in per.items()} for k, per in moving.items()}
    # (every baseline moving leaves the ledger's check, as a paper table's: unchecked, issue 56)
    assert rd.side(differs, "qffl", "fedavg").verdict == f"{REGIME_UNCHECKED}; {NOT_CONVERGED}"
    assert "left out: Base (not converged)" in rd.regime(differs).text() or "not converged" in rd.regime(differs).text()


def test_means_equal_to_the_printed_digit_tie():
    """Two means that print alike are a tie, whatever float noise says (a table and a ledger of the
    same runs, one from rounded values, rank them alike)."""
    raw = _bs([76.69, 75.881300001, 75.8813, 74.40, 73.47], [96.18, 97.00, 96.82, 91.80, 83.59])
    rounded = check(raw, "higher", decimals=2)
    assert rounded.rho == pytest.approx(check(_bs([76.69, 75.88, 75.88, 74.40, 73.47],
                                                  [96.18, 97.00, 96.82, 91.80, 83.59]), "higher").rho)
    assert rounded.rho != pytest.approx(check(raw, "higher").rho)


# -- issue 56: how strong the check is ---------------------------------------------------------

def test_the_permutation_p_of_a_perfect_order_of_five_is_one_in_120():
    r = check(_bs([90, 80, 70, 60, 50], [98, 97, 96, 95, 94]), "higher")
    assert r.perm_p == pytest.approx(1 / 120) and r.agrees and not r.weak
    assert "permutation p = 0.0083" in r.text() and "weak" not in r.text()


def test_a_check_that_agrees_by_chance_often_is_printed_weak():
    # one swap of four: ρ = 0.8 agrees, but 4 of the 24 orderings do at least as well (p = 1/6)
    r = check(_bs([80, 90, 70, 60], [98, 97, 96, 95]), "higher")
    assert r.agrees and r.perm_p == pytest.approx(4 / 24) and r.weak
    assert "agrees, weak (p = 0.17 > 0.05)" in r.text()
    assert r.strength() == ", on a weak regime check (p = 0.17)"


def test_a_missing_or_unconverged_baseline_is_named_and_ties_print_as_equal():
    bs = _bs([90, math.nan, 80, 80, 60], [98, 97, 96, 95, 94])
    r = check(bs, "higher", moving={"m4"})
    assert [b.id for b in r.baselines] == ["m0", "m2", "m3"]
    assert r.dropped == (("M1", "no stand-in value"), ("M4", "not converged"))
    text = r.text()
    assert "left out: M1 (no stand-in value), M4 (not converged)" in text
    assert "ours M0 > M2 = M3" in text  # a tie is a tie, not an order
