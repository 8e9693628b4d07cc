"""Each training job's estimated time beside its measured one: the accuracy table of docs/cost.md.

    .venv/bin/fedrepro calibrate config/test.yaml          # first, on the same idle machine
    .venv/bin/python benchmarks/cost_accuracy.py --experiment config/test.yaml results/test \
        [--experiment CONFIG RESULTS ...] [--jobs] [--calibration FILE]

For every job of each experiment whose Snakemake benchmark table exists (results/E/benchmarks/
{train,finetune,tuning}/*.tsv: the job's own wall time, start-up included, as the workflow measured
it), the estimate `fedrepro validate` makes from this machine's calibration (fedrepro.cost), with the
clients' sizes from the partitions' manifests beside the results folder (RESULTS/../shards, where the
workflow wrote them; a partition without one is estimated and the row says so); with
--calibration, that calibration file's estimate instead (the file kept from the day the experiments
ran: a later calibration times a machine whose speed has moved since, docs/cost.md). Prints one
Markdown row per experiment: jobs compared, the share within ±35 %, the totals and the total's error
(estimated / measured - 1); with --jobs, a row per job too. A job without a benchmark table (not run
yet) or without an estimate (its model not calibrated) is counted apart, not compared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from script_inputs import OneLineParser, existing_dir, experiment_file, fail, read_text  # noqa: E402

#: The issue's bounds: a job within ±35 %, an experiment's total within ±25 %.
JOB_BOUND, TOTAL_BOUND = 0.35, 0.25


def benchmark_table(results: Path, job) -> Path:
    """The Snakemake benchmark table of `job` (workflow/rules/train.smk, tuning.smk)."""
    c = job.cell
    stem = f"{c['dataset']}_{c['partition']}_{c['label']}"
    if "trial" in c:
        return results / "benchmarks" / "tuning" / f"{stem}_{c['trial']}_seed{c['seed']}.tsv"
    return results / "benchmarks" / ("finetune" if job.work and job.work.derived else "train") / f"{stem}_seed{c['seed']}.tsv"


def measured_seconds(path: Path) -> float:
    """The wall seconds (column `s`) of a Snakemake benchmark table's first run."""
    lines = read_text(path, "benchmark table").splitlines()
    try:
        head, row = lines[0].split("\t"), lines[1].split("\t")
        return float(row[head.index("s")])
    except (IndexError, ValueError):
        fail(f"benchmark table {str(path)!r}: no column 's' with a number in its first row; allowed: the table Snakemake's "
             "`benchmark:` directive writes")


def main() -> None:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", nargs=2, action="append", required=True, metavar=("CONFIG", "RESULTS"),
                    help="an experiment config and its results folder (repeatable)")
    ap.add_argument("--jobs", action="store_true", help="print a row per job too")
    ap.add_argument("--calibration", metavar="FILE",
                    help="estimate with this calibration file (default: this machine's cached one)")
    args = ap.parse_args()
    from fedrepro.config import load_and_resolve
    from fedrepro.cost import Estimator, choose_calibration
    from fedrepro.local_plan import machine_plan
    from fedrepro.registry import ConfigError

    try:  # the checks of an argparse type, for the two values of one option
        pairs = [(experiment_file(config), existing_dir(results)) for config, results in args.experiment]
    except argparse.ArgumentTypeError as exc:
        fail(f"argument --experiment: {exc}")
    try:
        chosen = choose_calibration(machine_plan().threads, args.calibration)
    except ConfigError as exc:
        fail(str(exc))
    calibration = chosen.calibration
    if calibration is None:
        fail(f"no calibration for this machine ({chosen.device}): run `fedrepro calibrate CONFIG` first")
    print(f"calibration: {calibration['path']} ({chosen.device}, {calibration['threads']} threads, {calibration.get('updated')})")
    print("| experiment | jobs compared | within ±35 % | estimated total | measured total | total error |")
    print("|---|---|---|---|---|---|")
    job_rows = []
    for config, results in pairs:
        _, exp = load_and_resolve([str(config)])
        compared, apart = [], 0
        # the partitions' manifests beside the results (the workflow's results/shards): the clients' real
        # sizes; without them every client is estimated equal, far off for a Dirichlet split
        estimator = Estimator(exp, shards_root=results.parent / "shards")
        guessed = {(c["dataset"], c["partition"]) for c in exp["cells"]
                   if (sizes := estimator.sizes(c["dataset"], c["partition"])) is not None and sizes.source != "manifest"}
        for job in estimator.jobs():
            table = benchmark_table(results, job)
            estimate = job.work.seconds(calibration) if job.work else None
            if estimate is None or not table.is_file():
                apart += 1
                continue
            compared.append((job.name, estimate, measured_seconds(table)))
        within = sum(abs(e / m - 1) <= JOB_BOUND for _, e, m in compared if m > 0)
        est, meas = sum(e for _, e, _ in compared), sum(m for _, _, m in compared)
        error = f"{est / meas - 1:+.0%}" if meas else "-"
        sizes = f"; {len(guessed)} partition(s) without a manifest in {results.parent / 'shards'}: sizes estimated" if guessed else ""
        print(f"| {config} | {len(compared)} (+{apart} not compared{sizes}) | {within}/{len(compared)} | {est:.0f} s | "
              f"{meas:.0f} s | {error} |")
        job_rows += [(config, *row) for row in compared]
    if args.jobs:
        print("\n| experiment | job | estimated | measured | error |\n|---|---|---|---|---|")
        for config, name, e, m in job_rows:
            print(f"| {config} | {name} | {e:.1f} s | {m:.1f} s | {e / m - 1:+.0%} |" if m else f"| {config} | {name} | {e:.1f} s | 0 s | - |")


if __name__ == "__main__":
    sys.exit(main())
