"""The summary of benchmarks/gpu_launch.sh (issue 36, docs/gpu.md "Issue 36: the launch-limit run"):
the issue's goals as checks, the table of each lever's effect, and where the time goes.

    python benchmarks/gpu_launch.py --mode gpu --work /tmp/gpu_launch --out $OUT --methods fedavg fedper \\
        --cells-config config/experiments/baselines_fmnist_quick.yaml --cells-set 'seeds=[0] training.vectorize=true ...'

Reads the stages' table (<work>/stages.tsv), the cuda tests' JUnit XML (<out>/cuda_tests.xml),
the lever rows of benchmarks/gpu_throughput.py (<out>/levers.json: FedAvg, FedPer and the
centralized row; <out>/levers_ditto.json: Ditto, if time allowed), PFLlib's s/round on the same
device (<work>/pfllib_<Method>.json: benchmarks/parity_pfllib.py's output of one method) and the
cells of the cells-per-hour workflow (<work>/cells_per_hour). Writes <out>/summary.json (`checks`,
each a boolean, `ok` = all of them, `goals` with their values, the lever rows, PFLlib, cells per
hour, the profile split of each method's best row) and <out>/levers.md (the table), prints them
and exits 1 unless ok.

The GPU mode's checks are the issue's "Must hold" on one GPU; the CPU mode (a rehearsal on
digits) checks that every stage and every lever row ran and that the rows agree, and reports the
goals' values without checking them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_check import cuda_tests_check, environment, finite_positive, read_cells, read_junit, read_stages  # noqa: E402
from gpu_throughput import cumulative_paths  # noqa: E402
from script_inputs import OneLineParser, existing_dir, fail, read_json  # noqa: E402

from fedrepro.config import load_and_resolve  # noqa: E402
from fedrepro.io import write_json_atomic  # noqa: E402
from fedrepro.overrides import split_items  # noqa: E402
from fedrepro.registry import ConfigError  # noqa: E402

#: The issue's goals on one GPU, at PFLlib's protocol (evaluation every round).
FEDAVG_S_PER_ROUND = 0.5
FEDAVG_SPEEDUP = 40.0
PERSONAL_SPEEDUP = 20.0  # FedPer or Ditto
CENTRAL_RATIO = 3.0  # engine samples/s over centralized samples/s at batch 10
PERSONAL_METHODS = ("fedper", "ditto")
#: tests/test_cuda.py's accuracy tolerance (test_cuda_agrees_with_the_cpu): 0.5 percentage points.
ACC_TOL = 0.005
#: Stages that may run out of time without failing the run: Ditto's rows take the time left.
OPTIONAL_STAGES = ("levers_ditto",)


def read_rows(*paths: Path) -> tuple[list[dict], str | None]:
    """The rows of gpu_throughput.py's JSON files that exist, and the device they ran on."""
    rows, device = [], None
    for path in paths:
        if path.exists():
            data = read_json(path, "lever rows file")
            rows += data["rows"]
            device = data.get("device")
    return rows, device


def read_pfllib(work: Path) -> dict[str, dict]:
    """PFLlib's s/round per fedrepro method, from parity_pfllib.py's JSON of each method's stage."""
    out = {}
    for path in sorted(work.glob("pfllib_*.json")):
        for row in read_json(path, "PFLlib rows file")["rows"]:
            if finite_positive(row.get("pfllib_s_per_round")):
                out[row["fedrepro_method"]] = {"row": row["row"], "s_per_round": row["pfllib_s_per_round"],
                                               "acc": row.get("pfllib_acc")}
    return out


def lever_label(row: dict) -> str:
    """A cumulative row by what it adds: sequential, vectorized, + <its last lever>."""
    if row["levers"]:
        return "+ " + row["levers"][-1]
    return row["row"].removeprefix("engine/")


def accuracy_gaps(rows: list[dict]) -> dict[str, float | None]:
    """Per row of one method, the largest |accuracy - the sequential row's| over the global and
    personal accuracies it has (None without a sequential row)."""
    seq = next((r for r in rows if r["row"] == "engine/sequential"), None)
    gaps = {}
    for r in rows:
        diffs = [abs(r[k] - seq[k]) for k in ("global_acc", "personal_acc")
                 if seq is not None and r.get(k) is not None and seq.get(k) is not None]
        gaps[r["row"]] = max(diffs) if diffs else None
    return gaps


def best(rows: list[dict], key: str, lowest: bool = True) -> dict | None:
    good = [r for r in rows if finite_positive(r.get(key))]
    return (min if lowest else max)(good, key=lambda r: r[key]) if good else None


def goals(by_method: dict[str, list[dict]], pfllib: dict[str, dict]) -> dict[str, dict]:
    """Each goal of the issue: its value, the row it comes from and whether it is met (None where
    it could not be measured)."""
    out = {}
    fastest = best(by_method.get("fedavg", []), "s_per_round")
    out["fedavg_s_per_round"] = {"goal": f"<= {FEDAVG_S_PER_ROUND}", "row": fastest and fastest["row"],
                                 "value": fastest and fastest["s_per_round"]}
    out["fedavg_s_per_round"]["met"] = None if not fastest else fastest["s_per_round"] <= FEDAVG_S_PER_ROUND

    def speedup(method: str) -> dict:
        row = best(by_method.get(method, []), "s_per_round")
        p = pfllib.get(method)
        value = p["s_per_round"] / row["s_per_round"] if row and p else None
        return {"row": row and row["row"], "value": value, "pfllib_s_per_round": p and p["s_per_round"],
                "why": None if p else "PFLlib's s/round not measured"}

    out["fedavg_speedup_vs_pfllib"] = {"goal": f">= {FEDAVG_SPEEDUP:g}x", **speedup("fedavg")}
    v = out["fedavg_speedup_vs_pfllib"]["value"]
    out["fedavg_speedup_vs_pfllib"]["met"] = None if v is None else v >= FEDAVG_SPEEDUP
    per = {m: speedup(m) for m in PERSONAL_METHODS}
    values = [p["value"] for p in per.values() if p["value"] is not None]
    out["fedper_or_ditto_speedup_vs_pfllib"] = {"goal": f">= {PERSONAL_SPEEDUP:g}x", "per_method": per,
                                                 "value": max(values) if values else None,
                                                 "met": max(values) >= PERSONAL_SPEEDUP if values else None}
    fed = best(by_method.get("fedavg", []), "ratio_to_central", lowest=False)
    out["samples_per_s_vs_centralized"] = {"goal": f">= {CENTRAL_RATIO:g}x", "row": fed and fed["row"],
                                           "value": fed and fed["ratio_to_central"],
                                           "met": None if not fed else fed["ratio_to_central"] >= CENTRAL_RATIO}
    return out


def cells_per_hour(work: Path, stages: dict, config: str | None, sets: str) -> dict | None:
    """Finished cells of the cells-per-hour workflow per hour of its stage's wall time."""
    stage = stages.get("cells_per_hour")
    if not stage or stage["status"] == "skipped":
        return None
    results = work / "cells_per_hour" / "results"
    wf = read_cells(work / "cells_per_hour") or {"cells": {}, "max_cells_at_once": 0}
    finished = sum(c["status"] == "ok" for c in wf["cells"].values())
    try:
        planned = len(load_and_resolve([config], split_items(sets))[1]["cells"]) if config else None
    except ConfigError as exc:
        fail(f"argument --cells-config/--cells-set: {exc}")
    # what the cells trained with (their provenance): the overrides reached every job
    provenances = [results / key / "provenance.json" for key in wf["cells"]]
    trained = {(bool(t.get("vectorize")), tuple(t.get("levers") or ())) for p in provenances if p.exists()
               for t in [read_json(p, "provenance file")["cell"]["training"]]}
    return {"config": config, "set": sets, "planned_cells": planned, "finished_cells": finished,
            "vectorize_and_levers": sorted([v, list(levers)] for v, levers in trained),
            "devices": sorted({str(c["device"]) for c in wf["cells"].values()}), "wall_s": stage["seconds"],
            "stage_status": stage["status"], "max_cells_at_once": wf["max_cells_at_once"],
            "cells_per_hour": finished / stage["seconds"] * 3600 if stage["seconds"] > 0 else None}


def markdown(mode: str, by_method: dict[str, list[dict]], pfllib: dict[str, dict], gaps: dict[str, dict],
             device: str | None) -> str:
    def num(v, fmt="{:.3g}"):
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    head = ["method", "path", "s/round", "training s/round", "evaluation s/round", "warm-up s", "samples/s",
            "× centralized", "× PFLlib", "global acc", "personal acc", "max |Δ acc| vs sequential (pp)",
            "profiled round: kernels s", "syncs s", "host s"]
    lines = [f"Device: {device}. Rows: benchmarks/gpu_throughput.py --paths cumulative (each lever added to the ones "
             "above); s/round = training and evaluation of a timed round, after one warm-up round; × PFLlib = PFLlib's "
             "s/round on the same device ÷ the row's." + (
                 " CPU mode: a rehearsal on digits (PFLlib, where carried, on a Fashion-MNIST fraction): the ratios "
                 "test the script, they measure nothing." if mode == "cpu" else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, rows in by_method.items():
        p = pfllib.get(method)
        for r in rows:
            rounds = r["rounds_per_s"] and 1 / r["rounds_per_s"]
            gap = gaps[method].get(r["row"])
            lines.append("| " + " | ".join([
                method, lever_label(r), num(r["s_per_round"]), num(rounds),
                num(r["s_per_round"] - rounds if rounds else None), num(r.get("warmup_s")),
                num(r["samples_per_s"], "{:,.0f}"), num(r.get("ratio_to_central")),
                num(p["s_per_round"] / r["s_per_round"] if p else None, "{:.1f}×"),
                num(r.get("global_acc"), "{:.4f}"), num(r.get("personal_acc"), "{:.4f}"),
                num(gap * 100 if gap is not None else None, "{:.2f}"),
                num(r.get("kernels_s")), num(r.get("syncs_s")), num(r.get("host_s"))]) + " |")
    for method, p in pfllib.items():
        lines.append(f"\nPFLlib {p['row']}: {p['s_per_round']:.3g} s/round (its Budget, same device).")
    return "\n".join(lines) + "\n"


def checks(mode: str, stages: dict, tests: dict | None, by_method: dict[str, list[dict]], central: dict | None,
           methods: list[str], gaps: dict[str, dict], goal: dict, cells: dict | None, pfllib: dict[str, dict]) -> dict[str, bool]:
    out = {"every stage ran and exited 0 (Ditto's may run out of time)": bool(stages) and all(
        s["status"] == "ok" or (s["status"] == "skipped" and "why" in s)
        or (name in OPTIONAL_STAGES and s["status"] in ("timeout", "skipped")) for name, s in stages.items())}
    name, good = cuda_tests_check(mode, tests)
    out[name] = good
    for name, stage in stages.items():  # parity_pfllib.py exits 0 when PFLlib fails (its table says why)
        if name.startswith("pfllib_") and stage["status"] != "skipped":
            out[f"{name}: PFLlib's s/round measured"] = name.removeprefix("pfllib_") in {p["row"] for p in pfllib.values()}
    expected = cumulative_paths()
    for method in methods:
        rows = {r["row"]: r for r in by_method.get(method, [])}
        out[f"{method}: every lever row ran"] = all(f"engine/{p}" in rows for p in expected)
    for method, rows in by_method.items():
        out[f"{method}: every row's accuracies equal the sequential row's (within {ACC_TOL * 100:g} pp)"] = all(
            g is not None and g <= ACC_TOL for g in gaps[method].values())
    out["centralized row at batch 10 ran"] = bool(central) and central["batch"] == 10 and finite_positive(central["samples_per_s"])
    device = "cuda" if mode == "gpu" else "cpu"
    out[f"cells per hour: cells finished on {device}"] = bool(cells) and cells["finished_cells"] > 0 \
        and cells["devices"] == [device]
    if mode == "gpu":
        out[f"FedAvg at PFLlib's protocol in <= {FEDAVG_S_PER_ROUND} s per round"] = goal["fedavg_s_per_round"]["met"] is True
        out[f"FedAvg >= {FEDAVG_SPEEDUP:g}x PFLlib's s/round"] = goal["fedavg_speedup_vs_pfllib"]["met"] is True
        out[f"FedPer or Ditto >= {PERSONAL_SPEEDUP:g}x PFLlib's"] = goal["fedper_or_ditto_speedup_vs_pfllib"]["met"] is True
        out[f"samples/s at batch 10 >= {CENTRAL_RATIO:g}x centralized"] = goal["samples_per_s_vs_centralized"]["met"] is True
    return out


def profiles(by_method: dict[str, list[dict]]) -> dict[str, dict]:
    """Per method, the time split of one profiled round (gpu_throughput.profile_split) of its
    fastest profiled row."""
    out = {}
    for method, rows in by_method.items():
        row = best([r for r in rows if finite_positive(r.get("wall_s"))], "s_per_round")
        if row:
            out[method] = {"row": row["row"], **{k: row[k] for k in ("wall_s", "kernels_s", "syncs_s", "host_s")}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    ap.add_argument("--work", type=existing_dir, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--methods", nargs="+", required=True, help="methods whose lever rows must all have run")
    ap.add_argument("--cells-config", default=None, help="the cells-per-hour workflow's experiment")
    ap.add_argument("--cells-set", default="", help="its --config set= items")
    args = ap.parse_args(argv)
    stages = read_stages(args.work / "stages.tsv")
    tests = read_junit(args.out / "cuda_tests.xml")
    rows, device = read_rows(args.out / "levers.json", args.out / "levers_ditto.json")
    central = next((r for r in rows if r["row"] == "centralized"), None)
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        if r["row"] != "centralized":
            by_method.setdefault(r["method"], []).append(r)
    gaps = {m: accuracy_gaps(rs) for m, rs in by_method.items()}
    pfllib = read_pfllib(args.work)
    goal = goals(by_method, pfllib)
    cells = cells_per_hour(args.work, stages, args.cells_config, args.cells_set)
    result = checks(args.mode, stages, tests, by_method, central, args.methods, gaps, goal, cells, pfllib)
    table = markdown(args.mode, by_method, pfllib, gaps, device)
    missed = [k for k, g in goal.items() if g["met"] is not True]
    summary = {"mode": args.mode, "ok": all(result.values()), "checks": result, "goals": goal, "goals_missed": missed,
               "device": device, "environment": environment(), "stages": stages,
               "wall_s": round(time.time() - float(os.environ["GPU_LAUNCH_START"]), 1)
               if os.environ.get("GPU_LAUNCH_START") else None,
               "cuda_tests": tests, "pfllib": pfllib, "centralized": central, "lever_rows": rows,
               "accuracy_gaps": gaps, "cells_per_hour": cells, "profile": profiles(by_method), "lever_table": table}
    write_json_atomic(args.out / "summary.json", summary)
    (args.out / "levers.md").write_text(table)
    print(table)
    for name, good in result.items():
        print(f"[gpu_launch] {'ok  ' if good else 'FAIL'} {name}")
    for name, g in goal.items():  # the goals are the GPU run's: on the CPU their values only show the script works
        state = "met" if g["met"] else "not met" if g["met"] is False else "not measured"
        print(f"[gpu_launch] goal {name} {g['goal']}: {g['value']} ({state}{', CPU rehearsal' if args.mode == 'cpu' else ''})")
    for name, stage in stages.items():
        print(f"[gpu_launch] stage {name}: {stage['status']}{': ' + stage['why'] if 'why' in stage else ''} ({stage['seconds']:.0f} s)")
    if tests and tests["failed"]:
        for name, message in tests["failed"].items():
            print(f"[gpu_launch] failed test {name}: {message}")
    if cells:
        print(f"[gpu_launch] cells per hour: {cells['finished_cells']} of {cells['planned_cells']} cells in "
              f"{cells['wall_s']:.0f} s = {cells['cells_per_hour']:.0f} cells/hour on {cells['devices']}")
    if missed:
        for method, split in summary["profile"].items():
            print(f"[gpu_launch] profile of one round of {method} {split['row']}: wall {split['wall_s']:.3g} s, kernels "
                  f"{split['kernels_s']:.3g} s, syncs {split['syncs_s']:.3g} s, host {split['host_s']:.3g} s")
    print(f"[gpu_launch] {'OK' if summary['ok'] else 'NOT OK'} after {summary['wall_s']} s: {args.out / 'summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
