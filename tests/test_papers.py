"""Paper tables beside the published numbers: statistics checked by hand on a synthetic table,
missing and failed cells, every paper's layout rendered from fixtures, the config mapping and
its checks, the figures and the Snakemake targets."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import REPO
from fedrepro.cli import main
from fedrepro.config import load_config, resolve_experiment
from fedrepro.io import write_json_atomic
from fedrepro.registry import ConfigError
from fedrepro.report.aggregate import SUMMARY_COLUMNS, load_cells
from fedrepro.report.paper_plots import draw_figure
from fedrepro.report.paper_tables import PER_CLIENT, build_from_plan, build_table, to_html, to_latex, to_markdown, write_table
from fedrepro.report.papers import (FigurePlan, Inventory, PaperPlan, TablePlan, load_published, plan_paper_tables,
                                    resolve_targets)
from fedrepro.report.stats import deviation, paired_test, seed_stats

PUBLISHED = REPO / "config" / "papers" / "published"
CONFIGS = sorted((REPO / "config" / "papers").glob("*.yaml"))
PNG = b"\x89PNG\r\n\x1a\n"
T975_2 = 4.302652729911275  # t(0.975, 2 df), from tables


# ---------------------------------------------------------------------------------------------
# fixtures: metrics.json files and summary frames


def metrics(dataset: str, partition: str, label: str, seed: int, acc: dict[str, float] | None,
            method: str = "fedavg", clients: int = 4) -> dict:
    """A metrics.json dict: `acc` = {kind: weighted accuracy} (None: a failed cell)."""
    cell = {"schema": "fedrepro.metrics/1",
            "cell": {"experiment": "toy", "dataset": dataset, "partition": partition, "partition_id": "0123456789",
                     "method": method, "label": label, "model": "cnn", "seed": seed},
            "status": "ok" if acc is not None else "failed", "rounds": 3,
            "failure": None if acc is not None else {"reason": "loss is NaN at round 2", "round": 2},
            "clients": {"ids": list(range(clients)), "untrained": 0, "untrained_rule": "personalize"},
            "communication": {"bytes_up_total": 1, "bytes_down_total": 1}, "resources": {"wall_time_s": 1.0},
            "best_val": None}
    if acc is None:
        return cell | {"final": None, "summary": None, "curves": {"round": [1], "train_loss": [1.0]}}
    summary, final, curves = {}, {}, {"round": [1, 2, 3], "train_loss": [1.0, 0.6, 0.4]}
    for kind, w in acc.items():
        per_client = [w - 0.03, w - 0.01, w + 0.01, w + 0.03][:clients]
        for m, v in (("acc", w), ("f1", w - 0.05)):
            summary[f"{kind}_{m}"] = {"weighted_mean": v, "mean": v, "std": 0.02, "min": v - 0.03, "max": v + 0.03,
                                      "worst10": v - 0.03}
        final[kind] = {"acc": per_client, "f1": [v - 0.05 for v in per_client]}
        if kind in ("global", "personal"):
            curves[f"{kind}_acc"] = {s: [w - 0.2, w - 0.1, w] for s in ("weighted_mean", "mean", "std", "min", "max", "worst10")}
    return cell | {"final": final, "summary": summary, "curves": curves}


def synthetic_frame(plan: PaperPlan, exp: dict, seed_offset: float = 0.0) -> pd.DataFrame:
    """A summary frame with every kind of every run of the experiment, values by label and seed."""
    from fedrepro.report.papers import producible_kinds

    specs = {(p["dataset"], p["label"]): p["spec"] for p in exp["partitions"]}
    rng = np.random.default_rng(0)
    rows = []
    for c in exp["cells"]:
        for kind in sorted(producible_kinds(c["method"], specs[(c["dataset"], c["partition"])], c["training"])):
            r = dict.fromkeys(SUMMARY_COLUMNS)
            r.update(dataset=c["dataset"], partition=c["partition"], label=c["label"], method=c["method"], seed=c["seed"],
                     status="ok", kind=kind, num_clients=4.0, untrained_clients=0.0, untrained_rule="personalize")
            for col in ("acc_weighted_mean", "acc_mean", "acc_std", "f1_mean", "f1_weighted_mean", "type_avg", "type_sigma",
                        "client_sigma", "cluster_acc"):
                r[col] = float(np.clip(0.6 + 0.1 * rng.standard_normal() + seed_offset, 0.01, 0.99))
            rows.append(r)
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


TOY = {
    "paper": {"id": "toy", "short": "Toy", "title": "A toy paper", "source": "none", "proposed": ["ours"]},
    "names": {"method": {"ours": "Ours", "base": "Base"}, "dataset": {"d": "D"}, "setting": {"s": "S"}},
    "metrics": {"acc": {"name": "Acc. (%)", "better": "higher", "unit": "percent", "decimals": 2}},
    "tables": {
        "t1": {"title": "Table 1", "caption": "toy", "pm": None, "bold": {"rule": "best"},
               "rows": [{"method": ["ours", "base", "part", "broken", "ghost", "absent"]}],
               "columns": {"header": ["setting"], "groups": [{"dataset": "d", "setting": "s", "metric": "acc"}]},
               "cells": [{"method": "ours", "dataset": "d", "setting": "s", "metric": "acc", "value": 78.0},
                         {"method": "base", "dataset": "d", "setting": "s", "metric": "acc", "value": 75.0},
                         {"method": "broken", "dataset": "d", "setting": "s", "metric": "acc", "value": 50.0}]},
        "t2": {"title": "Table 2", "caption": "toy with the paper's seed std", "pm": {"kind": "seed_std", "runs": 3},
               "bold": {"rule": "none"}, "rows": [{"method": ["ours"]}],
               "columns": {"header": ["setting"], "groups": [{"dataset": "d", "setting": "s", "metric": "acc"}]},
               "cells": [{"method": "ours", "dataset": "d", "setting": "s", "metric": "acc", "value": 78.0, "pm": 2.0}]},
    },
}
# per label, weighted accuracy of seeds 0, 1, 2 (None: that seed failed)
TOY_RUNS = {"ours": [0.70, 0.72, 0.74], "base": [0.68, 0.69, 0.73], "part": [0.60, 0.64, None],
            "broken": [None, None, None]}
TOY_MAPPING = {"kind": "global", "datasets": {"d": "digits"}, "settings": {"s": "p"}, "metrics": {"acc": "acc_weighted_mean"}}
TOY_INVENTORY = {"labels": {k: "fedavg" for k in ("ours", "base", "part", "broken", "ghost")}, "partitions": {"digits": ["p"]}}


@pytest.fixture
def toy(tmp_path):
    """The toy paper's file and metrics.json files of its runs (ghost has none: missing)."""
    published = tmp_path / "toy.yaml"
    published.write_text(yaml.safe_dump(TOY, allow_unicode=True))
    paths = []
    for label, accs in TOY_RUNS.items():
        for seed, acc in enumerate(accs):
            path = tmp_path / "runs" / label / f"seed{seed}" / "metrics.json"
            write_json_atomic(path, metrics("digits", "p", label, seed, None if acc is None else {"global": acc}))
            paths.append(str(path))
    return published, paths


def toy_spec(table: str = "t1") -> str:
    return json.dumps({"paper": "toy", "table": table, "mapping": TOY_MAPPING, "reduced": False, "seeds": [0, 1, 2],
                       "inventory": TOY_INVENTORY})


def read_csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path)  # plain CSV: no options needed (title and notes are in the .md/.html)


# ---------------------------------------------------------------------------------------------
# statistics


def test_seed_stats_and_interval_by_hand():
    s = seed_stats([70.0, 72.0, 74.0])
    assert (s.n, s.mean, s.std) == (3, 72.0, 2.0)
    half = T975_2 * 2.0 / math.sqrt(3)  # 4.968...
    assert s.ci_low == pytest.approx(72 - half) and s.ci_high == pytest.approx(72 + half)
    one = seed_stats([70.0, float("nan")])
    assert one.n == 1 and math.isnan(one.std) and math.isnan(one.ci_low)


def _t2_sf(t: float) -> float:
    """Upper tail of Student's t with 2 degrees of freedom, in closed form."""
    return 0.5 * (1 - t / math.sqrt(t * t + 2))


def test_paired_tests_by_hand():
    # d = (2, 3, 1): mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.4641 on 2 df
    r = paired_test({0: 72.0, 1: 72.0, 2: 74.0}, {0: 70.0, 1: 69.0, 2: 73.0})
    assert r.test == "paired t" and r.n == 3 and r.mean_diff == pytest.approx(2.0)
    assert r.statistic == pytest.approx(2 * math.sqrt(3))
    assert r.p == pytest.approx(2 * _t2_sf(2 * math.sqrt(3)))  # 0.0742
    # 6 seeds, every difference positive and distinct: W- = 0, exact two-sided p = 2 / 2^6
    w = paired_test({s: 1.0 + s for s in range(6)}, {s: 0.5 + s - 0.05 * s for s in range(6)})
    assert w.test == "Wilcoxon signed-rank" and w.n == 6 and w.p == pytest.approx(2 / 64)
    # seeds only one side has are not paired; one common seed: no test
    none = paired_test({0: 1.0, 1: 2.0}, {1: 1.5, 2: 3.0})
    assert none.test == "none" and none.n == 1 and math.isnan(none.p)


def test_deviation_rules_by_hand():
    ours = seed_stats([70.0, 72.0, 74.0])  # 95 % interval 72 ± 4.97
    far = deviation(ours, 78.0)  # t = 6 / (2 / sqrt 3) = 5.196 on 2 df
    assert far.test == "one-sample t" and far.beyond and far.p == pytest.approx(2 * _t2_sf(3 * math.sqrt(3)))
    assert deviation(ours, 76.0).beyond is False  # inside the interval
    # Welch with the paper's 78 ± 2 over 3 runs: se = sqrt(4/3 + 4/3), df = 4 (equal variances and n)
    w = deviation(ours, 78.0, 2.0, 3)
    t = 6 / math.sqrt(8 / 3)
    x = np.linspace(t, 400, 400001)  # upper tail of t(4) by integrating its density (3/8)(1 + x²/4)^(-5/2)
    tail = np.trapezoid(0.375 * (1 + x * x / 4) ** -2.5, x)
    assert w.test == "Welch t" and w.p == pytest.approx(2 * tail, rel=1e-4) and w.beyond
    assert deviation(seed_stats([72.0]), 90.0).beyond is None  # one seed: not judged


# ---------------------------------------------------------------------------------------------
# a table built from synthetic metrics


def test_toy_table_numbers(toy, tmp_path):
    published, paths = toy
    assert main(["paper-table", *paths, "--published", str(published), "--spec", toy_spec(), "--out-prefix",
                 str(tmp_path / "out" / "t1")]) == 0
    cells = read_csv(tmp_path / "out" / "t1.csv").set_index("method")
    ours = cells.loc["ours"]
    assert (ours["status"], ours["n_seeds"], ours["seeds"]) == ("ok", 3, "0 1 2")
    assert ours["mean"] == pytest.approx(72.0) and ours["std"] == pytest.approx(2.0)
    assert ours["ci95_low"] == pytest.approx(72 - T975_2 * 2 / math.sqrt(3), abs=1e-5)
    assert ours["paper"] == 78.0 and ours["diff"] == pytest.approx(-6.0) and bool(ours["beyond_spread"])
    assert ours["deviation_p"] == pytest.approx(2 * _t2_sf(3 * math.sqrt(3)), abs=1e-5)
    base = cells.loc["base"]  # 68, 69, 73: mean 70, std sqrt 7; paper 75 inside its interval
    assert base["mean"] == pytest.approx(70.0) and base["std"] == pytest.approx(math.sqrt(7))
    assert not bool(base["beyond_spread"]) and base["rank_ours"] != 1 and ours["rank_ours"] == 1
    tests = read_csv(tmp_path / "out" / "t1_tests.csv").set_index("baseline")
    assert tests.loc["Base", "test"] == "paired t" and tests.loc["Base", "n"] == 3
    assert tests.loc["Base", "mean_diff"] == pytest.approx(2.0)
    assert tests.loc["Base", "p"] == pytest.approx(2 * _t2_sf(2 * math.sqrt(3)), abs=1e-5)
    assert tests.loc["part", "n"] == 2  # seed 2 of "part" failed: paired over 0 and 1
    md = (tmp_path / "out" / "t1.md").read_text()
    assert "72.00△ ± 2.00 / 78.00 / −6.00 ◇" in md  # △: our best under the paper's rule
    assert "Seeds: 3 seed(s) per cell (0, 1, 2)" in md
    assert "Base | +2.00, t, p = 0.074 (n=3)" in md


def test_missing_and_failed_cells_render_as_such(toy, tmp_path):
    published, paths = toy
    main(["paper-table", *paths, "--published", str(published), "--spec", toy_spec(), "--out-prefix", str(tmp_path / "t1")])
    cells = read_csv(tmp_path / "t1.csv").set_index("method")
    assert cells.loc["broken", "status"] == "failed" and pd.isna(cells.loc["broken", "mean"])
    assert cells.loc["broken", "paper"] == 50.0 and pd.isna(cells.loc["broken", "diff"])
    assert cells.loc["ghost", "status"] == "missing" and pd.isna(cells.loc["ghost", "mean"])
    assert cells.loc["absent", "status"] == "not run" and pd.isna(cells.loc["absent", "label"])
    assert cells.loc["part", "n_seeds"] == 2 and cells.loc["part", "n_failed"] == 1
    md = (tmp_path / "t1.md").read_text()
    assert "| broken | failed (3 seeds) / 50.00 / – |" in md
    assert "| ghost | missing / – / – |" in md and "| absent | not run / – / – |" in md
    assert "| part | 62.00 ± 2.83 (n=2, 1 failed) / – / – |" in md
    tex = (tmp_path / "t1.tex").read_text()
    assert r"\toprule" in tex and r"72.00$^{\triangle }$" in tex and "failed (3 seeds)" in tex
    html = (tmp_path / "t1.html").read_text()
    assert "72.00<sup>△</sup>" in html and "not run" in html and "class=beyond" in html


def test_welch_when_the_paper_gives_its_seed_std(toy, tmp_path):
    published, paths = toy
    main(["paper-table", *paths, "--published", str(published), "--spec", toy_spec("t2"), "--out-prefix", str(tmp_path / "t2")])
    ours = read_csv(tmp_path / "t2.csv").iloc[0]
    assert ours["deviation_test"] == "Welch t" and ours["paper_pm"] == 2.0 and ours["paper_pm_kind"] == "seed_std"
    assert "Welch's test with the paper's ± as the std of its 3 runs" in (tmp_path / "t2.md").read_text()


def test_one_seed_is_not_judged(toy, tmp_path):
    published, paths = toy
    seed0 = [p for p in paths if "seed0" in p]
    spec = json.loads(toy_spec())
    spec["seeds"] = [0]
    main(["paper-table", *seed0, "--published", str(published), "--spec", json.dumps(spec), "--out-prefix", str(tmp_path / "t")])
    cells = read_csv(tmp_path / "t.csv")
    assert not (cells["beyond_spread"] == True).any() and cells["std"].isna().all()  # noqa: E712
    assert "One seed: there is no spread over seeds" in (tmp_path / "t.md").read_text()
    assert (read_csv(tmp_path / "t_tests.csv")["test"] == "none").all()


# ---------------------------------------------------------------------------------------------
# every paper's layout, from fixtures


def config_plan(path: Path) -> tuple[PaperPlan, dict]:
    config = load_config(path)
    exp = resolve_experiment(config)
    return plan_paper_tables(config, exp, config_path=path), exp


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_paper_config_has_its_tables(path):
    plan, exp = config_plan(path)
    assert plan is not None and plan.paper.id == path.stem.removesuffix("_cpu")
    assert plan.reduced == path.stem.endswith("_cpu")
    expected = {"fedcrc": ["table1", "table2"], "grp_fed": ["table1", "fig5"], "fedcosr": ["table2", "fairness", "scarcity"],
                "fedcrc_cpu": ["table1", "table2", "table2_all_data"], "grp_fed_cpu": ["table1"], "fedcosr_cpu": ["table2", "scarcity"],
                "fedgcr": ["table1", "table2", "table3", "table4", "table5"], "fedgcr_cpu": ["table1", "table5"],
                "calibre": ["table1", "methods"], "calibre_cpu": ["table1", "methods"]}
    assert list(plan.tables) == expected[path.stem]
    frame = synthetic_frame(plan, exp)
    for tid, tp in plan.tables.items():
        res = build_from_plan(plan, tid, frame)
        statuses = [c.status for c in res.cells.values() if not c.row.derived]
        # a table of single clients' values (GRP-FED Fig. 5) shows ours only in its figure analogue
        assert statuses.count(PER_CLIENT if tp.table.per_client else "ok") == len(tp.targets)
        assert statuses.count("not run") == tp.layout_cells - len(tp.targets)
        if not plan.reduced:  # a full-scale config fills every cell (a reduced one may fill a small table too)
            assert statuses.count("not run") == 0
        for text in (to_markdown(res), to_latex(res, tid), to_html(res)):
            assert res.table.title in text and not NEGATIVE_ZERO.search(text)
        check_tex(to_latex(res, tid), len(res.table.columns))
        if plan.reduced:
            assert all(math.isnan(c.diff) for c in res.cells.values())


def check_tex(tex: str, n: int) -> None:
    """booktabs structure: balanced braces, 1 + 3n cells in every body row, the rules in order."""
    assert tex.count("{") - tex.count(r"\{") == tex.count("}") - tex.count(r"\}")
    body = tex[tex.index(r"\midrule"):tex.index(r"\bottomrule")]
    for line in body.splitlines():
        if line.endswith(r"\\") and "multicolumn" not in line:
            assert line.replace(r"\&", "").count("&") == 3 * n, line
    assert tex.index(r"\toprule") < tex.index(r"\midrule") < tex.index(r"\bottomrule")


@pytest.mark.parametrize("paper", ["calibre", "fedgcr", "fedcrc", "grp_fed", "fedcosr"])
def test_every_layout_renders_without_runs(paper):
    """No experiment (Calibre, FedGCR) or no runs: every cell of ours reads "not run", never a number."""
    p = load_published(PUBLISHED / f"{paper}.yaml")
    for t in p.tables.values():
        res = build_table(t, pd.DataFrame(columns=SUMMARY_COLUMNS))
        assert {c.status for c in res.cells.values()} <= {"not run", "derived"}
        md = to_markdown(res)
        check_tex(to_latex(res, t.id), len(t.columns))
        body = [line for line in md.splitlines() if line.startswith("| ") and "/" in line][1:]
        for line in body:
            for cell in line.split(" | ")[1:]:
                ours = cell.split(" / ")[0].strip(" |*")
                assert ours in ("not run", "–", ""), (paper, t.id, line)
        to_latex(res, t.id), to_html(res)


def test_paper_marks_are_data_and_ours_follow_the_rule():
    """The paper's marks come from the published file as printed; the rule marks only ours (△)."""
    plan, exp = config_plan(REPO / "config" / "papers" / "fedcosr.yaml")
    res = build_from_plan(plan, "table2", synthetic_frame(plan, exp))

    def marks(metric: str) -> dict:
        return {c.key[0]: c.paper_mark for c in res.cells.values()
                if c.key[1:] == ("cifar10", "practical", metric) and c.paper_mark}

    # the paper: Acc. 92.15* (FedCoSR), 90.79† (FedPAC), 90.66‡ (FedRep); Std. 5.57* 6.28† 6.51‡ (lower is better)
    assert marks("acc") == {"fedcosr": "*", "fedpac": "†", "fedrep": "‡"}
    assert marks("std") == {"fedcosr": "*", "fedrep": "†", "fedper": "‡"}
    ours = [c for c in res.cells.values() if c.key[1:] == ("cifar10", "practical", "std") and not c.row.derived]
    best = min(ours, key=lambda c: c.stats.mean)
    assert sorted(c.rank_ours for c in ours if c.rank_ours) == [1, 2, 3] and best.rank_ours == 1
    assert f"{best.stats.mean:.2f}△1" in to_markdown(res)
    avg = res.cells[("averaged", "cifar10", "practical", "std")]
    assert avg.rank_ours == 0  # the derived row is not ranked; it is the mean of the rows above it
    assert avg.stats.mean == pytest.approx(np.mean([c.stats.mean for c in ours])) and avg.paper == 8.21
    assert avg.diff == pytest.approx(avg.stats.mean - 8.21) and avg.dev.beyond is None
    # GRP-FED's text carries no bold: no paper value is marked; ours only in Global Test and Local Test
    plan, exp = config_plan(REPO / "config" / "papers" / "grp_fed.yaml")
    res = build_from_plan(plan, "table1", synthetic_frame(plan, exp))
    assert not any(c.paper_mark for c in res.cells.values())
    assert {c.key[3] for c in res.cells.values() if c.rank_ours == 1} == {"g_test", "l"}
    assert "are not recorded for this table, so its values are shown plain" in to_markdown(res)


def _no_runs(paper: str, table: str):
    return build_table(load_published(PUBLISHED / f"{paper}.yaml").tables[table], pd.DataFrame(columns=SUMMARY_COLUMNS))


def test_fedgcr_table1_bolds_exactly_the_papers_bold_cells():
    """Bold as the paper prints it (the text's <b>…</b>), in every rendering; 9.86 and 8.40 (DIF 5, σ_type and
    σ_client) are the best of their columns but plain in the paper."""
    res = _no_runs("fedgcr", "table1")
    bold = {"85.82", "8.55", "85.11", "82.74", "12.26", "8.52"}
    md, tex, html = to_markdown(res), to_latex(res, "t"), to_html(res)
    assert set(re.findall(r"\*\*(\d+\.\d+)\*\*", md)) == bold and md.count("**8.55**") == 2
    assert set(re.findall(r"\\textbf\{(\d+\.\d+)\}", tex)) == bold
    assert set(re.findall(r"<b>(\d+\.\d+)</b>", html)) == bold
    assert "The paper's values carry the paper's own marks" in md and "fedgcr.txt" in md


def test_fedcrc_table1_has_the_papers_rows_and_no_sections():
    res = _no_runs("fedcrc", "table1")
    assert [r.key["method"] for r in res.table.rows] == ["fedavg", "fedprox", "fedbabu", "fedper", "fedrep", "fedcrc",
                                                         "fedcrc_per"]
    assert {r.section for r in res.table.rows} == {None}
    md = to_markdown(res)
    names = [line.split(" | ")[0].strip("| ") for line in md.splitlines() if line.startswith("| ")][1:]
    assert names == ["FedAvg", "FedProx", "FedBABU", "FedPer", "FedRep", "FedCRC", "FedCRC-Per"]
    assert r"\emph{" not in to_latex(res, "t")


def test_calibre_cells_mark_the_papers_spread_over_clients():
    res = _no_runs("calibre", "table1")
    md = to_markdown(res)
    assert "54.67 ± 14.32 (clients)" in md and "± its spread over clients" in md
    kinds = re.findall(r"/ \d+\.\d+ ± \d+\.\d+( \(clients\))?", md)  # the paper's side of every cell
    assert len(kinds) == 12 and all(kinds)
    assert "(clients)" in to_latex(res, "t") and "(clients)" in to_html(res)


def test_fedgcr_table5_keeps_the_papers_sigma_domain():
    md = to_markdown(_no_runs("fedgcr", "table5"))
    assert "σ_domain (↓)" in md and "σ_type" not in md.split("\n\n")[2]


def test_grp_fed_notes_say_what_the_welch_marks_assume():
    res = _no_runs("grp_fed", "table1")
    res.seeds = [0, 1, 2]
    md = to_markdown(res)
    assert "Assumed: the paper's ± is the std over 3 runs ([RECON]; the paper does not say" in md
    assert "± its std over 3 runs (assumed, see below)" in md


def test_degenerate_paired_tests_have_no_p():
    """Every per-seed difference the same: neither test is defined (n = 2 or 6 alike); zero differences are not
    counted in the signed-rank test's n."""
    for n in (2, 3, 6):
        r = paired_test({s: 71.0 + s for s in range(n)}, {s: 70.0 + s for s in range(n)})
        assert (r.test, r.n, r.note) == ("none", n, "all differences equal") and math.isnan(r.p)
        assert r.mean_diff == pytest.approx(1.0)
    zero = paired_test({s: 1.0 for s in range(6)}, {s: 1.0 for s in range(6)})
    assert zero.test == "none" and zero.note == "all differences zero" and math.isnan(zero.p)
    # 6 seeds, one zero difference: the signed-rank test ranks 5; all positive, so p = 2 / 2^5
    w = paired_test({s: 1.0 + s for s in range(6)}, {0: 1.0, **{s: 0.5 + s for s in range(1, 6)}})
    assert (w.test, w.n) == ("Wilcoxon signed-rank", 5) and w.p == pytest.approx(2 / 2**5)
    assert w.note == "1 zero difference(s) dropped"
    assert deviation(seed_stats([72.0, 72.0, 72.0]), 78.0).p != 0.0  # identical seeds: no p either
    assert math.isnan(deviation(seed_stats([72.0, 72.0, 72.0]), 78.0).p)


def test_degenerate_tests_render_as_such(toy, tmp_path):
    """A baseline exactly 1 point below ours in every seed: 'n/a: all differences equal', never 'p < 0.001'."""
    published, _ = toy
    paths = []
    for label, accs in {"ours": [0.70, 0.72, 0.74], "base": [0.69, 0.71, 0.73]}.items():
        for seed, acc in enumerate(accs):
            path = tmp_path / "deg" / label / f"seed{seed}" / "metrics.json"
            write_json_atomic(path, metrics("digits", "p", label, seed, {"global": acc}))
            paths.append(str(path))
    assert main(["paper-table", *paths, "--published", str(published), "--spec", toy_spec(), "--out-prefix",
                 str(tmp_path / "t1")]) == 0
    for ext in (".md", ".tex", ".html"):
        text = (tmp_path / f"t1{ext}").read_text()
        assert "n/a: all differences equal (n=3)" in text and "p < 0.001" not in text
    tests = read_csv(tmp_path / "t1_tests.csv").set_index("baseline")
    assert tests.loc["Base", "test"] == "none" and pd.isna(tests.loc["Base", "p"]) and tests.loc["Base", "n"] == 3


def test_latex_carries_the_paired_tests(toy, tmp_path):
    published, paths = toy
    main(["paper-table", *paths, "--published", str(published), "--spec", toy_spec(), "--out-prefix", str(tmp_path / "t1")])
    tex = (tmp_path / "t1.tex").read_text()
    tests = tex[tex.index(r"\label{tab:toy_t1_tests}"):]
    assert "Ours vs Base & +2.00, t, p = 0.074 (n=3)" in tests and r"\bottomrule" in tests
    assert tex.count(r"\begin{table}") == tex.count(r"\end{table}") == 2


NEGATIVE_ZERO = re.compile(r"(?:−|-|\$-\$)0\.0+(?![0-9])")


def test_no_negative_zero_in_rendered_tables(tmp_path):
    """A difference that rounds to zero prints as 0.00, in every rendering."""
    doc = copy.deepcopy(TOY)
    doc["tables"]["t1"]["cells"][0]["value"] = 72.004  # ours: 72.00 over 3 seeds; Δ = −0.004
    published = tmp_path / "toy.yaml"
    published.write_text(yaml.safe_dump(doc, allow_unicode=True))
    paths = []
    for seed, acc in enumerate([0.70, 0.72, 0.74]):
        path = tmp_path / "runs" / f"seed{seed}" / "metrics.json"
        write_json_atomic(path, metrics("digits", "p", "ours", seed, {"global": acc}))
        paths.append(str(path))
    main(["paper-table", *paths, "--published", str(published), "--spec", toy_spec(), "--out-prefix", str(tmp_path / "t1")])
    md = (tmp_path / "t1.md").read_text()
    assert "72.00△ ± 2.00 / 72.00 / 0.00 |" in md
    for ext in (".md", ".tex", ".html"):
        assert not NEGATIVE_ZERO.search((tmp_path / f"t1{ext}").read_text()), ext


# ---------------------------------------------------------------------------------------------
# the mapping's checks (fedrepro validate)


def test_validate_prints_the_coverage(capsys):
    assert main(["validate", "--each", str(REPO / "config" / "papers" / "fedcrc.yaml"), str(REPO / "config" / "papers" / "fedcrc_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "paper table fedcrc_table1 (FedCRC Table I): 84 of 84 cells from 72 run(s) x 3 seed(s) (every cell)" in out
    assert "paper table fedcrc_table1 (FedCRC Table I): 7 of 84 cells from 6 run(s) x 10 seed(s) (reduced" in out


def _plan_with(path: Path, edit) -> None:
    config = load_config(path)
    edit(config["paper_tables"])
    plan_paper_tables(config, resolve_experiment(config), config_path=path)


@pytest.mark.parametrize("edit, message", [
    (lambda pt: pt["tables"]["table2"].pop("settings"), "reads kind ['unseen_global'] of cifar10/beta0.1/fedavg"),
    (lambda pt: pt["tables"]["table1"]["methods"].update(fedrep=False), "12 of 84 cells of FedCRC Table I are not produced"),
    (lambda pt: pt["tables"]["table1"]["methods"].update(fedrep="nope"), "label 'nope' is not a method of the experiment"),
    (lambda pt: pt["tables"]["table1"]["metrics"].update(acc="acc_median"), "metrics.acc.column' has value 'acc_median'"),
    (lambda pt: pt["tables"].update(table9={}), "FedCRC has no table 'table9'"),
    (lambda pt: pt["tables"]["table1"]["methods"].update(fedbabu={"kind": "unseen_personal"}), "writes only"),
    (lambda pt: pt["tables"]["table1"].update(settings={"iid": "beta0.2"}), "partition 'beta0.2' is not applied"),
])
def test_a_mapped_cell_the_config_does_not_produce_is_an_error(edit, message):
    with pytest.raises(ConfigError, match=re_escape(message)):
        _plan_with(REPO / "config" / "papers" / "fedcrc.yaml", edit)


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_no_paper_tables_no_plan():
    config = load_config(REPO / "config" / "test.yaml")
    assert plan_paper_tables(config, resolve_experiment(config)) is None


# ---------------------------------------------------------------------------------------------
# figures


def _cells_for(plan: PaperPlan, exp: dict, tmp_path: Path) -> list[dict]:
    from fedrepro.report.papers import producible_kinds

    specs = {(p["dataset"], p["label"]): p["spec"] for p in exp["partitions"]}
    runs = {r for tp in plan.tables.values() for r in tp.runs}
    out = []
    for c in exp["cells"]:
        if (c["dataset"], c["partition"], c["label"]) not in runs:
            continue
        kinds = producible_kinds(c["method"], specs[(c["dataset"], c["partition"])], c["training"])
        out.append(metrics(c["dataset"], c["partition"], c["label"], c["seed"],
                           {k: 0.5 + 0.01 * len(c["label"]) for k in kinds}, c["method"]))
    return out


@pytest.mark.parametrize("config, figure", [("fedcrc_cpu", "fig3"), ("grp_fed_cpu", "fig4"), ("fedcosr_cpu", "fig5"),
                                            ("fedcosr_cpu", "fig6")])
def test_figures_from_fixtures(config, figure, tmp_path):
    plan, exp = config_plan(REPO / "config" / "papers" / f"{config}.yaml")
    out = tmp_path / f"{figure}.png"
    draw_figure(plan, figure, _cells_for(plan, exp, tmp_path), out)
    assert out.read_bytes()[:8] == PNG


@pytest.mark.parametrize("paper, table, plot", [("fedgcr", "table1", "metric_bars"), ("fedcosr", "table2", "mean_variance")])
def test_figures_of_papers_without_experiments(paper, table, plot, tmp_path):
    """FedGCR's σ bars and Calibre's mean-variance scatter, drawn on a hand-made mapping."""
    p = load_published(PUBLISHED / f"{paper}.yaml")
    t = p.tables[table]
    ds, st = t.columns[0].key["dataset"], t.columns[0].key["setting"]
    labels = [r.key["method"] for r in t.rows if not r.derived][:4]
    inv = Inventory({m: "fedavg" for m in labels}, {ds: [st]})
    mapping = {"kind": "global", "metrics": {c.key["metric"]: "acc_mean" for c in t.columns}}
    targets = resolve_targets(t, mapping, inv)
    fig = {"plot": plot, "caption": "test", "metrics": ["sigma_type", "sigma_client"]} if plot == "metric_bars" else {"plot": plot}
    plan = PaperPlan(p, False, inv, [0, 1], {table: TablePlan(t, mapping, targets, 0)},
                     {"f": FigurePlan("f", fig, t, mapping, targets)})
    cells = [metrics(ds, st, m, s, {"global": 0.6 + 0.05 * i + 0.01 * s}) for i, m in enumerate(labels) for s in (0, 1)]
    draw_figure(plan, "f", cells, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == PNG


def test_grp_fed_fig5_analogue(tmp_path):
    """Fig. 5 (single clients): ours from the client with the highest / lowest Global Test, the paper's 36 values
    beside them; the table itself shows ours only as 'in the figure', never a mean over clients."""
    from fedrepro.report.paper_plots import plot_client_cases

    p = load_published(PUBLISHED / "grp_fed.yaml")
    t = p.tables["fig5"]
    labels = [r.key["method"] for r in t.rows]
    inv = Inventory({m: "fedavg" for m in labels}, {"mitbih": ["patients"]})
    mapping = {"settings": {"client_similar": "patients", "client_far": "patients"},
               "metrics": {"client_g_test": {"column": "f1_mean", "kind": "global"},
                           "client_l": {"column": "f1_mean", "kind": "global"}, "client_p": {"column": "f1_mean", "kind": "personal"}}}
    targets = resolve_targets(t, mapping, inv)
    assert len(targets) == 36
    fp = FigurePlan("fig5", p.figures["fig5"], t, mapping, targets)
    # per-client values w - 0.03, w - 0.01, w + 0.01, w + 0.03 (metrics()): client 3 is highest, client 0 lowest
    cells = [metrics("mitbih", "patients", m, s, {"global": 0.6 + 0.01 * s, "personal": 0.7}) for m in labels for s in (0, 1)]
    picked = plot_client_cases(fp, cells, tmp_path / "fig5.png")
    assert picked == {"client_similar": 3, "client_far": 0}
    assert (tmp_path / "fig5.png").read_bytes()[:8] == PNG
    res = build_table(t, pd.DataFrame(columns=SUMMARY_COLUMNS), TablePlan(t, mapping, targets, 36))
    assert {c.status for c in res.cells.values()} == {"in the figure"} and not res.tests
    assert "| GRP-FED | in the figure / 0.997 / – |" in to_markdown(res)


FIG5_MAPPING = {"settings": {"client_similar": "patients", "client_far": "patients"},
                "metrics": {"client_g_test": {"column": "f1_mean", "kind": "global"},
                            "client_l": {"column": "f1_mean", "kind": "union_hm"},
                            "client_p": {"column": "f1_mean", "kind": ["personal", "global"]}}}


def test_grp_fed_fig5_maps_onto_the_paper_config(tmp_path):
    """config/papers/grp_fed.yaml's Fig. 5 (tables.fig5 + figures.fig5) plans its 36 cells and draws."""
    path = REPO / "config" / "papers" / "grp_fed.yaml"
    config = load_config(path)
    assert config["paper_tables"]["tables"]["fig5"] == FIG5_MAPPING and "fig5" in config["paper_tables"]["figures"]
    exp = resolve_experiment(config)
    plan = plan_paper_tables(config, exp, config_path=path)
    fp = plan.figures["fig5"]
    assert fp.table.id == "fig5" and len(fp.targets) == 36 and {t.partition for t in fp.targets.values()} == {"patients"}
    assert json.loads(json.dumps(plan.spec(table="fig5", figure="fig5")))["figure"] == "fig5"


# ---------------------------------------------------------------------------------------------
# Snakemake: one target per table, exactly the cells it needs


def snakemake(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(cwd), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_table_target_plans_exactly_its_cells(tmp_path):
    config = str(REPO / "config" / "papers" / "fedcosr.yaml")
    text = snakemake("--list-target-rules", "--configfile", config, cwd=tmp_path)
    assert {"fedcosr_table2", "fedcosr_fairness", "fedcosr_scarcity", "fedcosr_paper"} <= set(text.split())
    # the fairness table: 16 methods x 5 seeds on CIFAR-10's fairness partition, nothing else
    text = snakemake("-n", "fedcosr_fairness", "--configfile", config, cwd=tmp_path)
    trains = sorted(line.split("training cell ")[1] for line in text.splitlines() if "training cell " in line)
    assert len(trains) == 80 and {t.split("/")[:2] == ["cifar10", "fairness"] for t in trains} == {True}
    assert "paper_table" in text and "paper_figure" in text


def test_cli_has_the_paper_commands():
    from fedrepro.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("paper-table", "paper-figure"):
        assert len(sub.choices[name].description or "") > 30


def test_p_values_print_as_an_inequality_below_a_thousandth():
    from fedrepro.report.paper_tables import _fmt_p

    assert (_fmt_p(2e-5), _fmt_p(0.0421), _fmt_p(float("nan"))) == ("p < 0.001", "p = 0.042", "p = –")
