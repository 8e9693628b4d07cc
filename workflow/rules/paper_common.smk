# The paper tables' plan (config key paper_tables) and the helpers of workflow/rules/papers.smk.
import json
import re
import sys

from fedrepro.registry import ConfigError
from fedrepro.report.papers import plan_paper_tables

try:
    # Every mapped cell must be produced by the experiment (label, partition, model kind).
    PAPER = plan_paper_tables(EXPERIMENT_CONFIG, EXP, root=workflow.basedir)
except ConfigError as exc:
    sys.exit(f"fedrepro: invalid experiment config: {exc}")

PAPER_OUT = f"{OUT}/paper"
PAPER_EXTS = ("html", "csv", "md", "tex")
# The paper's readings ledger (fedrepro.report.readings), shown with its tables where it exists.
READINGS = (
    PAPER.paper.path.parent / "readings" / f"{PAPER.paper.id}.yaml" if PAPER else None
)
READINGS = str(READINGS) if READINGS is not None and READINGS.is_file() else None


def _paper_runs_metrics(runs):
    runs = set(runs)
    return [
        f"{PLAN.run_dir(c)}/metrics.json"
        for c in EXP["cells"]
        if (c["dataset"], c["partition"], c["label"]) in runs
    ]


def paper_table_metrics(wildcards):
    return _paper_runs_metrics(PAPER.tables[wildcards.paper_table].runs)


def paper_figure_metrics(wildcards):
    return _paper_runs_metrics(PAPER.figures[wildcards.paper_figure].runs)


def paper_table_outputs(tid):
    figures = [f for f, fp in PAPER.figures.items() if fp.table.id == tid]
    return (
        [f"{PAPER_OUT}/{tid}.{ext}" for ext in PAPER_EXTS]
        + [f"{PAPER_OUT}/{tid}_tests.csv"]
        + [f"{PAPER_OUT}/{f}.png" for f in figures]
        + readings_outputs()
    )


def readings_outputs():
    return [f"{PAPER_OUT}/readings.{ext}" for ext in ("html", "md")] if READINGS else []


def paper_outputs():
    outputs = [p for tid in PAPER.tables for p in paper_table_outputs(tid)] if PAPER else []
    return list(dict.fromkeys(outputs))


def paper_category(wildcards):
    return f"Paper: {PAPER.paper.short}"


def paper_subcategory(tid):
    # numbered so that the report lists the tables in the config's order
    return f"{list(PAPER.tables).index(tid) + 1} · {PAPER.tables[tid].table.title}"
