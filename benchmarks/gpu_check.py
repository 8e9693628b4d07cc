"""The summary of benchmarks/gpu_check.sh: what each stage did, as one JSON file and a few lines.

    python benchmarks/gpu_check.py --mode gpu --work /tmp/gpu_check --out $OUT

Reads the stages' table (<work>/stages.tsv: name, exit status, seconds), the cuda tests' JUnit
XML, every workflow stage's cells (<work>/<stage>/results/<experiment>/runs/**/metrics.json), the
throughput rows and the calibration stage's cache file (<out>/calibration.json); writes
<out>/summary.json with `checks` (each a boolean) and `ok` (all of them), and exits 1 unless ok.
docs/gpu.md says what each check means. Every file is read bounded and without blocking
(benchmarks/script_inputs.py): one that is not a regular file, too large or not JSON where JSON is
due ends the script with one line naming it (exit 2).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from fedrepro.io import write_json_atomic  # noqa: E402
from fedrepro.registry import ConfigError  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from script_inputs import OneLineParser, existing_dir, fail, read_json, read_text  # noqa: E402

WORKFLOW_STAGES = ("workflow_test", "workflow_default")


def read_stages(path: Path) -> dict[str, dict]:
    """The stages' table: name, exit status, seconds and, for a stage skipped on purpose, why
    (benchmarks/gpu_launch.sh: 'no .pfllib')."""
    stages = {}
    if path.exists():
        for line in read_text(path, "stage table").splitlines():
            name, rc, seconds, *why = line.split("\t")
            rc = int(rc)
            status = {0: "ok", 124: "timeout", 137: "timeout", -1: "skipped"}.get(rc, "failed")
            stages[name] = {"status": status, "rc": rc, "seconds": float(seconds), **({"why": why[0]} if why else {})}
    return stages


def read_junit(path: Path) -> dict | None:
    """Counts of the JUnit XML of pytest and the failed tests (name: first line of the message)."""
    if not path.exists():
        return None
    try:
        root = ET.fromstring(read_text(path, "JUnit report"))
    except ET.ParseError as exc:
        fail(f"JUnit report {str(path)!r}: not valid XML ({exc}); allowed: pytest's --junitxml report")
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = {}
    for case in root.iter("testcase"):
        for bad in (case.find("failure"), case.find("error")):
            if bad is not None:
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                failed[f"{case.get('classname')}::{case.get('name')}"] = message[0][:300] if message else ""
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of (start, end) intervals that hold at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda t: (t[0], t[1]))
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def job_interval(benchmark: Path) -> tuple[float, float] | None:
    """(start, end) of a Snakemake job from its benchmark file: written as the job ends, with the
    job's wall seconds `s`."""
    if not benchmark.exists():
        return None
    rows = read_text(benchmark, "benchmark file").splitlines()
    seconds = float(rows[1].split("\t")[rows[0].split("\t").index("s")])
    end = benchmark.stat().st_mtime
    return end - seconds, end


def read_cells(stage_dir: Path) -> dict | None:
    """Every trained cell of the workflow stage's experiment, and how many training jobs ran at
    once (each job's interval from its Snakemake benchmark file)."""
    files = sorted(stage_dir.glob("results/*/runs/**/metrics.json"))
    if not files:
        return None
    cells, intervals = {}, []
    for f in files:
        m = read_json(f, "metrics file")
        res = m.get("resources") or {}
        summary = m.get("summary") or {}
        key = str(f.parent.relative_to(stage_dir / "results"))
        cells[key] = {"status": m.get("status"), "device": res.get("device"), "rounds": m.get("rounds"),
                      "wall_time_s": res.get("wall_time_s"), "peak_gpu_mb": res.get("peak_gpu_mb"),
                      **{f"{kind}_acc": (summary.get(f"{kind}_acc") or {}).get("weighted_mean")
                         for kind in ("global", "personal")}}
        experiment, _, dataset, partition, label, seed = Path(key).parts
        interval = job_interval(stage_dir / "results" / experiment / "benchmarks" / "train" /
                                f"{dataset}_{partition}_{label}_{seed}.tsv")
        if interval:
            intervals.append(interval)
    experiments = sorted({k.split("/")[0] for k in cells})
    tables = [str(p.relative_to(stage_dir)) for e in experiments for p in sorted((stage_dir / "results" / e).glob("tables/*"))]
    return {"experiments": experiments, "cells": cells, "max_cells_at_once": max_overlap(intervals), "tables": tables}


def read_throughput(path: Path) -> dict | None:
    if not path.exists():
        return None
    data = read_json(path, "throughput file")
    keep = ("row", "clients", "batch", "vectorized", "rounds_per_s", "samples_per_s", "ratio_to_central", "busy",
            "peak_round_mb", "before_round_mb")
    return {"device": data.get("device"), "rows": [{k: r.get(k) for k in keep if k in r} for r in data["rows"]]}


def read_calibration_header(path: Path) -> dict | None:
    """What the calibration stage measured, as an estimate names it (docs/cost.md): device, threads,
    torch, date, start-up and the models timed; the file itself stays beside the summary."""
    from fedrepro.calibration import read_calibration

    if not path.exists():
        return None
    try:
        data = read_calibration(path)
    except ConfigError as exc:
        fail(str(exc))
    return {**{k: data.get(k) for k in ("device", "threads", "torch", "updated", "startup_s", "client_round_s")},
            "models": sorted(str(entry.get("label", "?")) for entry in data["models"].values())}


def finite_positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def cuda_tests_check(mode: str, tests: dict | None) -> tuple[str, bool]:
    """The check of the cuda tests' JUnit counts: on a GPU every test ran and passed; without one
    every test is collected and skipped, and none errors."""
    passed = bool(tests) and tests["tests"] > 0 and not tests["failures"] and not tests["errors"]
    if mode == "gpu":
        return "cuda tests ran (none skipped) and none failed", passed and tests["skipped"] == 0
    return "cuda tests collected, none failed", passed


def checks(mode: str, stages: dict, tests: dict | None, workflows: dict, throughput: dict | None, clients: int) -> dict:
    device = "cuda" if mode == "gpu" else "cpu"
    out = {"every stage ran and exited 0": bool(stages) and all(s["status"] in ("ok", "skipped") for s in stages.values())}
    name, good = cuda_tests_check(mode, tests)
    out[name] = good
    for name, stage in stages.items():
        if name not in WORKFLOW_STAGES or stage["status"] == "skipped":
            continue
        wf = workflows.get(name)
        out[f"{name}: every cell ok on {device}"] = bool(wf) and all(
            c["status"] == "ok" and c["device"] == device for c in wf["cells"].values())
        out[f"{name}: cells trained side by side"] = bool(wf) and wf["max_cells_at_once"] >= 2
        out[f"{name}: tables written"] = bool(wf) and bool(wf["tables"])
    rows = {r["row"]: r for r in (throughput or {}).get("rows", [])}
    vec = rows.get("engine/vectorized")
    out[f"throughput: a vectorized round at {clients} clients"] = bool(vec) and vec.get("vectorized") is True \
        and vec.get("clients") == clients and finite_positive(vec.get("rounds_per_s"))
    if mode == "gpu":
        out["throughput: its peak GPU memory"] = bool(vec) and finite_positive(vec.get("peak_round_mb"))
    return out


def environment() -> dict:
    env = {"python": platform.python_version()}
    try:
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:  # pragma: no cover - fedrepro needs torch
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    ap.add_argument("--work", type=existing_dir, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--clients", type=int, required=True, help="clients of the throughput stage's vectorized round")
    args = ap.parse_args(argv)
    stages = read_stages(args.work / "stages.tsv")
    tests = read_junit(args.out / "cuda_tests.xml")
    workflows = {name: read_cells(args.work / name) for name in WORKFLOW_STAGES if (args.work / name).exists()}
    throughput = read_throughput(args.out / "throughput.json")
    result = checks(args.mode, stages, tests, workflows, throughput, args.clients)
    summary = {"mode": args.mode, "ok": all(result.values()), "checks": result, "environment": environment(),
               "stages": stages, "wall_s": round(time.time() - float(os.environ["GPU_CHECK_START"]), 1)
               if os.environ.get("GPU_CHECK_START") else None,
               "cuda_tests": tests, "workflows": workflows, "throughput": throughput,
               "calibration": read_calibration_header(args.out / "calibration.json")}
    write_json_atomic(args.out / "summary.json", summary)
    for name, good in result.items():
        print(f"[gpu_check] {'ok  ' if good else 'FAIL'} {name}")
    for name, stage in stages.items():
        print(f"[gpu_check] stage {name}: {stage['status']} ({stage['seconds']:.0f} s)")
    if tests and tests["failed"]:
        for name, message in tests["failed"].items():
            print(f"[gpu_check] failed test {name}: {message}")
    vec = next((r for r in (throughput or {}).get("rows", []) if r["row"] == "engine/vectorized"), None)
    if vec:
        print(f"[gpu_check] vectorized round at {vec['clients']} clients: {vec['rounds_per_s']:.3g} rounds/s, "
              f"peak {vec.get('peak_round_mb')} MiB (before the round {vec.get('before_round_mb')} MiB)")
    calibration = summary["calibration"]
    if calibration:
        print(f"[gpu_check] calibration of {calibration['device']} at {calibration['threads']} thread(s), torch "
              f"{calibration['torch']}: {len(calibration['models'])} model(s) in {args.out / 'calibration.json'}")
    print(f"[gpu_check] {'OK' if summary['ok'] else 'NOT OK'} after {summary['wall_s']} s: {args.out / 'summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
