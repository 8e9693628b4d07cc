"""Time a training job's start-up, the source of a git revision against the working tree, in one run.

    .venv/bin/python benchmarks/startup.py                       # HEAD's src/ against the working tree
    .venv/bin/python benchmarks/startup.py --before-rev 74097aa --repeat 3 --start-repeat 10 --label local

The job is `fedrepro train --cell ...` exactly as the workflow runs it, on a cell of config/config.yaml
(the default experiment: fmnist, 20 clients, fedavg_cnn) cut to --rounds rounds. Its partition is built
once in a temporary folder from the raw data in --raw-root (`fedrepro prepare` writes it; the
workflow's results/raw/fmnist). Each version runs from its own src/ (PYTHONPATH), alternating: --repeat
whole jobs, then more runs stopped once started up to --start-repeat; printed per version, the fastest:
  start_s      process start -> the job's "training cell" line, just before round 1 (python, imports,
               shards read, checked and on the device)
  start_cpu_s  the CPU seconds the job used until then (less sensitive than wall time to a busy machine)
  wall_s       a whole job (1 round: start-up, the round, scoring, writing metrics.json)
  import_s     the sum of `python -X importtime`'s top-level module times of one more whole job
and the ratio after/before of each, and whether the two versions' metrics.json agree (timings aside).
Give an idle machine: the numbers are wall times. A bad argument (a revision that names no commit,
no --raw-root folder, an unknown --label, a count below 1) is one line and exit 2 before anything
runs (benchmarks/script_inputs.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from compare_metrics import without_timings  # noqa: E402
from script_inputs import OneLineParser, error_line, existing_dir, fail, positive_int, read_json, revision  # noqa: E402


def source_tree(commit: str, into: Path) -> Path:
    """src/ of the commit whose hash is `commit` (script_inputs.revision), unpacked into `into` (read from
    git; the working tree is not touched)."""
    blob = subprocess.run(["git", "archive", commit, "--", "src"], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_job(src: Path, cell: str, shards: Path, out: Path, importtime: bool = False, start_only: bool = False) -> dict:
    """One `fedrepro train` of `cell` from `src`; `start_only`: killed once it has started (its start-up timed)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "fedrepro", "train", "--cell", cell,
           "--shards", str(shards), "--out-dir", str(out), "--threads", "2"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    start, start_cpu, imports, tail = None, None, 0, []
    for line in proc.stderr:
        if start is None and line.startswith("[fedrepro] training cell"):
            start, start_cpu = time.perf_counter() - t0, cpu_seconds(proc.pid)
            if start_only:
                proc.kill()
                proc.wait()
                return {"start_s": start, "start_cpu_s": start_cpu}
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S)", line)  # a top-level import: no indentation
        if m:
            imports += int(m.group(1))
        else:
            tail = (tail + [line])[-20:]
    if proc.wait() != 0:
        raise SystemExit(f"fedrepro train failed ({src}):\n{''.join(tail)}")
    return {"start_s": start, "start_cpu_s": start_cpu, "wall_s": time.perf_counter() - t0, "import_s": imports / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-rev", default="HEAD", type=revision, help="git revision whose src/ is 'before'")
    ap.add_argument("--raw-root", type=existing_dir, default=str(REPO / "results" / "raw" / "fmnist"))
    ap.add_argument("--label", default="fedavg", help="the default experiment's cell (local, fedavg, fedavg_ft)")
    ap.add_argument("--rounds", type=positive_int, default=1)
    ap.add_argument("--repeat", type=positive_int, default=2, help="whole jobs of each version, alternating (at least 1)")
    ap.add_argument("--start-repeat", type=positive_int, default=6, help="runs of each version in all, alternating, the ones "
                    "beyond --repeat stopped once started (start-up only)")
    ap.add_argument("--keep", action="store_true", help="keep the working folder (shards, both versions' outputs)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    from fedrepro.config import load_and_resolve
    from fedrepro.overrides import cli_items

    _, exp = load_and_resolve([str(REPO / "config" / "config.yaml")], cli_items([f"training.rounds={args.rounds}"]))
    cell = next((c for c in exp["cells"] if c["label"] == args.label), None)
    if cell is None:
        ap.error(f"argument --label: unknown label: {args.label!r}; allowed: one of {sorted(c['label'] for c in exp['cells'])}")
    work = Path(tempfile.mkdtemp(prefix="fedrepro-startup-"))
    shards = work / cell["partition_id"]
    spec = json.dumps(next(p["spec"] for p in exp["partitions"] if p["id"] == cell["partition_id"]))
    proc = subprocess.run([sys.executable, "-m", "fedrepro", "partition", "--spec", spec, "--root", str(args.raw_root), "--out",
                           str(shards)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if proc.returncode != 0:
        shutil.rmtree(work)
        fail(f"argument --raw-root {str(args.raw_root)!r}: no partition built from it "
             f"({error_line(proc.stderr)}); allowed: the raw data `fedrepro prepare` writes")
    versions = {f"before ({args.before_rev[:10]})": source_tree(args.before_rev, work / "before"), "after (working tree)": REPO / "src"}
    print(f"host: {os.cpu_count()} CPUs, load average before: {os.getloadavg()}; cell {args.label}, {args.rounds} round(s)",
          flush=True)
    cell_json = json.dumps(cell, sort_keys=True)
    runs: dict[str, list[dict]] = {name: [] for name in versions}
    for i in range(max(args.repeat, args.start_repeat)):
        for name, src in versions.items():
            whole = i < args.repeat
            runs[name].append(run_job(src, cell_json, shards, work / name.split()[0] / f"out{i}", start_only=not whole))
            print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items() if k != "import_s"), flush=True)
    best = {}
    for name, src in versions.items():
        best[name] = {k: min(r[k] for r in runs[name] if k in r) for k in ("start_s", "start_cpu_s", "wall_s")}
        best[name]["import_s"] = run_job(src, cell_json, shards, work / "importtime", importtime=True)["import_s"]
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in best[name].items()))
    (b, a) = best.values()
    print("after/before: " + ", ".join(f"{k} {a[k] / b[k]:.2f}" for k in b))
    metrics = [without_timings(read_json(work / n.split()[0] / "out0" / "metrics.json", "metrics file")) for n in versions]
    print("metrics.json (timings aside): " + ("identical" if metrics[0] == metrics[1] else "DIFFERENT"))
    print(f"load average after: {os.getloadavg()}" + (f"; files in {work}" if args.keep else ""))
    if not args.keep:
        shutil.rmtree(work)
    return 0 if metrics[0] == metrics[1] else 1


if __name__ == "__main__":
    sys.exit(main())
