"""Threads per training cell on a CPU: cells side by side at 1 thread each against the same cells
one after another at 2 threads each, in one run, on the same shards.

    .venv/bin/python benchmarks/cell_threads.py                          # fedavg + local of config/config.yaml
    .venv/bin/python benchmarks/cell_threads.py --labels fedavg local fedavg_ft --repeat 2

Prepares the experiment's data and shards once (not timed), then trains the chosen cells with
Snakemake (`--workflow-profile workflow/profiles/local`, the command line overriding its plan):
"side by side": `--cores C --set-threads train=1 --resources gpu_slots=C`; "in turn":
`--cores C --set-threads train=2 --resources gpu_slots=1`, C = the cores given (default 2).
Prints each mode's wall time, each cell's job seconds (Snakemake's benchmark files), the ratio,
and whether the cells' metrics are identical between the modes (benchmarks/compare_metrics.py:
every field but the wall-clock ones). Give an idle machine: the numbers are wall times.
The local profile's choice (src/fedrepro/local_plan.py, CPU_CELL_THREADS) rests on this.
A bad argument (a config fedrepro cannot resolve, a label it has no cell of, a count below 1) is
one line and exit 2 before anything runs (benchmarks/script_inputs.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from compare_metrics import compare  # noqa: E402
from script_inputs import OneLineParser, experiment_file, positive_int  # noqa: E402

MODES = {"side by side, 1 thread": (1, None), "in turn, 2 threads": (2, 1)}


def snakemake(work: Path, config: Path, *args: str, env: dict | None = None) -> float:
    cmd = [sys.executable, "-m", "snakemake", "--workflow-profile", str(REPO / "workflow/profiles/local"), "--snakefile",
           str(REPO / "Snakefile"), "--directory", str(work), "--configfile", str(config), *args]
    env = {**os.environ, **(env or {}), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"snakemake {' '.join(args)} failed in {work}:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", type=experiment_file, default=str(REPO / "config" / "config.yaml"))
    ap.add_argument("--labels", nargs="+", default=["fedavg", "local"], help="method labels of the cells to train")
    ap.add_argument("--cores", type=positive_int, default=2)
    ap.add_argument("--repeat", type=positive_int, default=1, help="runs of each mode, alternating")
    ap.add_argument("--keep", action="store_true", help="keep the working folder")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    from fedrepro.config import load_config, resolve_experiment

    exp = resolve_experiment(load_config(args.configfile))
    cells = [c for c in exp["cells"] if c["label"] in args.labels]
    if len(cells) != len(args.labels):
        ap.error(f"argument --labels: the cells of {args.labels} in {args.configfile} are {[c['label'] for c in cells]}; "
                 f"allowed: distinct labels of one cell each, of {sorted({c['label'] for c in exp['cells']})}")
    work = Path(tempfile.mkdtemp(prefix="fedrepro-cell-threads-"))
    out = Path("results") / exp["experiment"]
    targets = [str(out / "runs" / c["dataset"] / c["partition"] / c["label"] / f"seed{c['seed']}" / "metrics.json")
               for c in cells]
    print(f"host: {os.cpu_count()} CPUs, load average before: {os.getloadavg()}; cells {args.labels}, --cores {args.cores}",
          flush=True)
    snakemake(work, args.configfile, "--cores", str(args.cores), "--until", "partition")
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.repeat):
        for mode, (threads, slots) in MODES.items():
            for leftover in ("runs", "checkpoints", "benchmarks", "logs/train"):
                shutil.rmtree(work / out / leftover, ignore_errors=True)
            wall = snakemake(work, args.configfile, "--cores", str(args.cores), "--set-threads", f"train={threads}",
                             "--resources", f"gpu_slots={slots or args.cores}", "--", *targets)
            walls[mode].append(wall)
            jobs = {}
            for bench in sorted((work / out / "benchmarks" / "train").glob("*.tsv")):
                label = bench.stem.rsplit("_seed", 1)[0].split("_", 2)[-1]  # <dataset>_<partition>_<label>_seed<s>
                jobs[label] = round(float(bench.read_text().splitlines()[1].split("\t")[0]), 1)
            print(f"{mode}: {wall:.1f} s wall; job seconds {jobs}", flush=True)
            keep = work / f"run{i}-{threads}t"
            shutil.copytree(work / out / "runs", keep / "runs")
    side, turn = (walls[m] for m in MODES)
    print(f"side by side / in turn (wall, best of each): {min(side) / min(turn):.2f}")
    compared, diffs = compare(work / "run0-1t", work / "run0-2t")
    print(f"metrics at 1 thread against 2 threads: {compared} cells compared, "
          f"{'identical' if not diffs else f'{len(diffs)} differ: ' + '; '.join(diffs[:3])}")
    print(json.dumps({m: [round(w, 1) for w in ws] for m, ws in walls.items()}))
    print(f"load average after: {os.getloadavg()}")
    if not args.keep:
        shutil.rmtree(work)
    else:
        print(f"kept: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
