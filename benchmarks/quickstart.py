"""Time the README's quick start, the default experiment end to end, for two versions of its config
in one run: each in a fresh working folder (raw data, shards, training, tables, plots, report
page, as on a fresh machine), one after the other on the same machine.

    .venv/bin/python benchmarks/quickstart.py                        # config/config.yaml at main vs now
    .venv/bin/python benchmarks/quickstart.py --before-rev 95c69b1 --repeat 2

Prints per version: wall time of `snakemake --workflow-profile workflow/profiles/local`, each
training cell's time (Snakemake's benchmark files) with its train / evaluation / personalized-
evaluation seconds (metrics.json `resources`), and the final summary of every cell, so the
two pictures can be compared beside the times. Give an idle machine: the numbers are wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(config_text: str, keep: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fedrepro-quickstart-"))
    config = work / "config.yaml"
    config.write_text(config_text)
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile", "workflow/profiles/local", "--snakefile",
           str(REPO / "Snakefile"), "--directory", str(work), "--configfile", str(config)]
    t0 = time.perf_counter()
    # the jobs call `fedrepro`: this interpreter's scripts first on PATH, as an activated venv has them
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed in {work}:\n{proc.stderr[-4000:]}")
    exp = next(p for p in (work / "results").iterdir() if (p / "summary.json").exists())
    cells = {}
    for metrics in sorted(exp.glob("runs/*/*/*/seed*/metrics.json")):
        m = json.loads(metrics.read_text())
        r = m["resources"]
        label = m["cell"]["label"]
        # a training job's, or a fine-tuning row's job (rule finetune: scored from its base's final model)
        bench = next(exp.glob(f"benchmarks/*/*_{label}_seed{m['cell']['seed']}.tsv"))
        job_s = float(bench.read_text().splitlines()[1].split("\t")[0])
        cells[label] = {"job_s": round(job_s, 1), "train_s": round(r["train_time_s"], 1), "eval_s": round(r["eval_time_s"], 1),
                        "personal_eval_s": round(r.get("personal_eval_time_s") or 0.0, 1),
                        "summary": {k: round(v["weighted_mean"], 4) for k, v in m["summary"].items()
                                    if isinstance(v, dict) and v.get("weighted_mean") is not None}}
    if not keep:
        shutil.rmtree(work)
    return {"wall_s": round(wall, 1), "cells": cells, "folder": str(work) if keep else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-rev", default="main", help="git revision whose config/config.yaml is 'before'")
    ap.add_argument("--after", type=Path, default=REPO / "config" / "config.yaml")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each version, alternating")
    ap.add_argument("--keep", action="store_true", help="keep the working folders")
    args = ap.parse_args(argv)
    before = subprocess.run(["git", "show", f"{args.before_rev}:config/config.yaml"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    versions = {f"before ({args.before_rev})": before, "after": args.after.read_text()}
    print(f"host: {os.cpu_count()} CPUs, load average before: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in versions}
    for _ in range(args.repeat):
        for name, text in versions.items():
            res = run_once(text, args.keep)
            results[name].append(res)
            print(f"{name}: {res['wall_s']} s wall", flush=True)
            for label, c in res["cells"].items():
                print(f"  {label:<12} job {c['job_s']:>6} s  train {c['train_s']:>6} s  eval {c['eval_s']:>6} s "
                      f"(personalized {c['personal_eval_s']} s)  {c['summary']}", flush=True)
    print(json.dumps({name: [r["wall_s"] for r in rs] for name, rs in results.items()}))
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
