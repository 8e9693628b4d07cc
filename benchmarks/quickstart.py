"""Time the README's quick start, the default experiment end to end, before and after a change in
one run: each version in a fresh working folder (raw data, shards, training, tables, plots, report
page, as on a fresh machine), one after the other on the same machine.

    .venv/bin/python benchmarks/quickstart.py                        # main's code and config vs the working tree
    .venv/bin/python benchmarks/quickstart.py --before-rev 69faaab --repeat 2

"before" is the whole tree of a git revision (its code, Snakefile, profiles and config/config.yaml,
unpacked with `git archive` and put first on PYTHONPATH), "after" is this working tree. Prints per
version: wall time of `snakemake --workflow-profile workflow/profiles/local`, every job's start and
end (seconds from the start, from Snakemake's log), each cell's job time (Snakemake's benchmark
files) with its train / evaluation / personalized-evaluation seconds (metrics.json `resources`),
the final summary of every cell, and whether each cell's metrics.json equals the other version's
(benchmarks/compare_metrics.py: every field but the wall-clock ones). Give an idle machine: the
numbers are wall times. A bad argument (a revision that names no commit, a config that fedrepro
cannot resolve, --repeat below 1) is one line and exit 2 before anything runs (benchmarks/script_inputs.py).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from compare_metrics import differences, without_timings  # noqa: E402
from script_inputs import OneLineParser, experiment_file, positive_int, read_json, read_text, revision  # noqa: E402

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
RULE = re.compile(r"^(?:local)?rule (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")
MESSAGE = re.compile(r"^Job (\d+): .*?(?:/([^/ ]+)/seed\d+\b.*)?$")  # a rule's `message:` (a cell's: .../label/seedN)


def tree_at(commit: str) -> Path:
    """The files of the commit whose hash is `commit` (script_inputs.revision), unpacked into a new folder."""
    tree = Path(tempfile.mkdtemp(prefix=f"fedrepro-quickstart-{commit[:10]}-"))
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def timeline(log: str) -> list[tuple[str, float, float]]:
    """(job, start s, end s) of every job, from Snakemake's log (its time stamps have 1 s resolution)."""
    from datetime import datetime

    now = first = None
    started: dict[str, tuple[str, float]] = {}
    pending: list[str] = []
    jobs = []
    for line in log.splitlines():
        if m := STAMP.match(line):
            now = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y").timestamp()
            first = now if first is None else first
        elif m := RULE.match(line):
            pending = [m.group(1)]
        elif (m := JOBID.match(line)) and pending:
            started[m.group(1)] = (pending[0], now - first)
        elif m := MESSAGE.match(line):
            started[m.group(1)] = (m.group(2) or "", now - first)
        elif (m := WILDCARDS.match(line)) and started:
            job = list(started)[-1]
            label = dict(kv.split("=", 1) for kv in m.group(1).split(", ") if "=" in kv).get("label")
            if label:
                started[job] = (f"{started[job][0]} {label}", started[job][1])
        elif (m := FINISHED.match(line)) and m.group(1) in started:
            name, t0 = started.pop(m.group(1))
            if not name.startswith(m.group(2)):  # a message named only the cell
                name = f"{m.group(2)} {name}".strip()
            jobs.append((name, t0, now - first))
    return jobs


def run_once(tree: Path, config_text: str, keep: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fedrepro-quickstart-"))
    config = work / "config.yaml"
    config.write_text(config_text)
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile", str(tree / "workflow" / "profiles" / "local"),
           "--snakefile", str(tree / "Snakefile"), "--directory", str(work), "--configfile", str(config)]
    # the jobs call `fedrepro`: this interpreter's scripts first on PATH, as an activated venv has them, and
    # the version's own package first on the import path
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "src"), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed in {work}:\n{proc.stderr[-4000:]}")
    exp = next(p for p in (work / "results").iterdir() if (p / "summary.json").exists())
    cells, metrics_of = {}, {}
    for metrics in sorted(exp.glob("runs/*/*/*/seed*/metrics.json")):
        m = read_json(metrics, "metrics file")
        r = m["resources"]
        label = m["cell"]["label"]
        metrics_of[label] = without_timings(m)
        # a training job's, or a fine-tuning row's job (rule finetune: scored from its base's final model)
        bench = next(exp.glob(f"benchmarks/*/*_{label}_seed{m['cell']['seed']}.tsv"))
        job_s = float(bench.read_text().splitlines()[1].split("\t")[0])
        cells[label] = {"job_s": round(job_s, 1), "train_s": round(r["train_time_s"], 1), "eval_s": round(r["eval_time_s"], 1),
                        "personal_eval_s": round(r.get("personal_eval_time_s") or 0.0, 1),
                        "summary": {k: round(v["weighted_mean"], 4) for k, v in m["summary"].items()
                                    if isinstance(v, dict) and v.get("weighted_mean") is not None}}
    if not keep:
        shutil.rmtree(work)
    return {"wall_s": round(wall, 1), "cells": cells, "metrics": metrics_of, "jobs": timeline(proc.stdout + proc.stderr),
            "folder": str(work) if keep else None}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-rev", default="main", type=revision,
                    help="git revision whose tree (code, workflow, config) is 'before'")
    ap.add_argument("--after", type=experiment_file, default=str(REPO / "config" / "config.yaml"), help="the working tree's config")
    ap.add_argument("--repeat", type=positive_int, default=1, help="runs of each version, alternating")
    ap.add_argument("--keep", action="store_true", help="keep the working folders")
    args = ap.parse_args(argv)
    before_tree = tree_at(args.before_rev)
    versions = {f"before ({args.before_rev[:10]})": (before_tree, read_text(before_tree / "config" / "config.yaml", "config file")),
                "after": (REPO, read_text(args.after, "config file"))}
    print(f"host: {os.cpu_count()} CPUs, load average before: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in versions}
    try:
        for _ in range(args.repeat):
            for name, (tree, text) in versions.items():
                res = run_once(tree, text, args.keep)
                results[name].append(res)
                print(f"{name}: {res['wall_s']} s wall", flush=True)
                print("  jobs (start-end s): " + ", ".join(f"{job} {a:.0f}-{b:.0f}" for job, a, b in res["jobs"]), flush=True)
                for label, c in res["cells"].items():
                    print(f"  {label:<12} job {c['job_s']:>6} s  train {c['train_s']:>6} s  eval {c['eval_s']:>6} s "
                          f"(personalized {c['personal_eval_s']} s)  {c['summary']}", flush=True)
    finally:
        shutil.rmtree(before_tree)
    first, second = (rs[0]["metrics"] for rs in results.values())
    for label in sorted(set(first) | set(second)):
        diff = differences(first.get(label), second.get(label))
        print(f"{label}: metrics.json " + (f"differs between the versions at {', '.join(diff[:8])}" if diff else
                                           "identical between the versions") + " (timings aside)")
    print(json.dumps({name: [r["wall_s"] for r in rs] for name, rs in results.items()}))
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
