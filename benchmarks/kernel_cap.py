"""What the CPU kernel cap costs (issue 56, src/fedrepro/kernels.py): one cell trained with its
kernels capped at AVX2 (the default) and uncapped (FEDREPRO_KERNELS=native), interleaved and
repeated, in one run, on the same shards.

    .venv/bin/python benchmarks/kernel_cap.py                      # the fedavg cell of config/config.yaml
    .venv/bin/python benchmarks/kernel_cap.py --label local --repeat 3

Prepares the experiment's data and shards once (not timed), then trains the cell with Snakemake
(the local profile, 2 threads) under each level in turn. Prints each run's wall time and job
seconds (Snakemake's benchmark file), the kernel level each run recorded in provenance.json, the
ratio capped / uncapped (best of each), and whether the two levels' metrics are identical
(benchmarks/compare_metrics.py; on a CPU with AVX-512 they need not be: that is why the cap
exists). Give an idle machine: the numbers are wall times.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from cell_threads import snakemake  # noqa: E402
from compare_metrics import compare  # noqa: E402
from script_inputs import OneLineParser, experiment_file, positive_int  # noqa: E402

LEVELS = ("avx2", "native")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", type=experiment_file, default=str(REPO / "config" / "config.yaml"))
    ap.add_argument("--label", default="fedavg", help="the method label of the cell to train")
    ap.add_argument("--repeat", type=positive_int, default=2, help="runs of each level, alternating")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    from fedrepro.config import load_config, resolve_experiment

    exp = resolve_experiment(load_config(args.configfile))
    cell = next((c for c in exp["cells"] if c["label"] == args.label), None)
    if cell is None:
        ap.error(f"argument --label: value {args.label!r}; allowed: one of {sorted({c['label'] for c in exp['cells']})}")
    work = Path(tempfile.mkdtemp(prefix="fedrepro-kernel-cap-"))
    out = Path("results") / exp["experiment"]
    folder = out / "runs" / cell["dataset"] / cell["partition"] / cell["label"] / f"seed{cell['seed']}"
    print(f"host: {os.cpu_count()} CPUs, load average before: {os.getloadavg()}; cell {folder}", flush=True)
    snakemake(work, args.configfile, "--cores", "2", "--until", "partition")
    walls: dict[str, list[float]] = {level: [] for level in LEVELS}
    for i in range(args.repeat):
        for level in LEVELS:
            for leftover in ("runs", "checkpoints", "benchmarks", "logs/train"):
                shutil.rmtree(work / out / leftover, ignore_errors=True)
            wall = snakemake(work, args.configfile, "--cores", "2", "--", str(folder / "metrics.json"),
                             env={"FEDREPRO_KERNELS": level})
            walls[level].append(wall)
            job = [float(b.read_text().splitlines()[1].split("\t")[0]) for b in (work / out / "benchmarks" / "train").glob("*.tsv")]
            kernels = json.loads((work / folder / "provenance.json").read_text())["kernels"]
            print(f"{level}: {wall:.1f} s wall, job {job[0] if job else float('nan'):.1f} s; recorded capability "
                  f"{kernels['capability']}, oneDNN {kernels['onednn_max_cpu_isa']}, MKL {kernels['mkl_enable_instructions']}",
                  flush=True)
            shutil.copytree(work / out / "runs", work / f"run{i}-{level}" / "runs")
    capped, native = (min(walls[level]) for level in LEVELS)
    print(f"capped / uncapped (wall, best of each): {capped / native:.2f}")
    compared, diffs = compare(work / "run0-avx2", work / "run0-native")
    print(f"metrics capped against uncapped: {compared} cells compared, "
          f"{'identical' if not diffs else f'{len(diffs)} field(s) differ: ' + '; '.join(diffs[:3])}")
    print(json.dumps({level: [round(w, 1) for w in ws] for level, ws in walls.items()}))
    print(f"load average after: {os.getloadavg()}")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
