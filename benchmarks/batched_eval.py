"""Seconds of one evaluation with and without the lever `batched_eval` (issue 36): every client's
personalized model scored in one vmapped pass against one forward per client and chunk.

    .venv/bin/python benchmarks/batched_eval.py                          # FedPer and Ditto, 20 clients, CPU or GPU
    .venv/bin/python benchmarks/batched_eval.py --dataset digits --repeats 1   # a quick check of the script

Data and protocol: those of benchmarks/gpu_throughput.py (Fashion-MNIST, PFLlib's Dir(0.1)
partition of benchmarks/parity_pfllib.py, fedavg_cnn, each method at its hparams of PFLlib's
protocol). Each method's cell is set up at round 1 with every client counted as trained, without
training: a client's personalized model is then its method's model of an untrained client (FedPer:
the global extractor and its own head; Ditto: the initial model), which costs what a trained one
costs to score. One `evaluation.evaluate` per row and repeat, the two rows of a method alternating
on the same engine (the same machine load); the median over `--repeats`. Rows: `eval_s` (the whole
evaluation: the global model's pooled pass and the personalized models), `personal_s` (the part
that made and scored the personalized models: `Scoring.personal_seconds`), and, in the lever's
row, `speedup` = the per-client row's personal_s / this one's (above 1: the lever is faster) and
`max_acc_diff`, the largest difference in a client's personal test accuracy between the rows
(equal up to float32 near-ties).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_throughput import engine_cell, partition, sync, table  # noqa: E402  (the same data and protocol)

from fedrepro.engine import evaluation  # noqa: E402
from fedrepro.engine.data import load_clients  # noqa: E402
from fedrepro.engine.engine import Engine  # noqa: E402
from fedrepro.engine.run import pick_device, set_determinism  # noqa: E402

LEVER = "batched_eval"


def timed_evaluation(engine: Engine, device: torch.device) -> tuple[float, float, list[float]]:
    """(seconds of one evaluation, of its personalized part, the personal test accuracies)."""
    before = engine.scoring.personal_seconds
    sync(device)
    t0 = time.perf_counter()
    record = evaluation.evaluate(engine)
    sync(device)
    return time.perf_counter() - t0, engine.scoring.personal_seconds - before, record["test/personal"]["acc"]


def method_rows(args, manifest, shards, device, method: str) -> list[dict]:
    cell = engine_cell(args, args.clients, 10, "sequential", method)
    engine = Engine(cell, manifest, load_clients(manifest, shards, device), device, progress=False)
    engine.method.setup()
    engine.round = 1  # every client trains in round 1 (participation 1): scored by its personalized model
    levers = {False: [], True: [LEVER]}
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    accs = {}
    for repeat in range(args.repeats + 1):  # the first of each row warms up (padded inputs, the vmap probe)
        for on in (False, True):
            engine.training["levers"] = levers[on]
            eval_s, personal_s, accs[on] = timed_evaluation(engine, device)
            if repeat:
                times[on].append((eval_s, personal_s))
    rows = []
    for on in (False, True):
        row = {"method": method, "levers": "+".join(levers[on]) or "-", "clients": args.clients,
               "eval_s": statistics.median(t for t, _ in times[on]), "personal_s": statistics.median(p for _, p in times[on])}
        if on:
            row["speedup"] = rows[0]["personal_s"] / row["personal_s"]
            row["max_acc_diff"] = max(abs(a - b) for a, b in zip(accs[False], accs[True]))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--methods", nargs="+", default=["fedper", "ditto"])
    ap.add_argument("--repeats", type=int, default=3, help="timed evaluations per row (after one warm-up)")
    ap.add_argument("--fraction", type=float, default=1.0, help="every client keeps this fraction of its data")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fedrepro-throughput"))
    ap.add_argument("--dataset", default="fmnist", choices=["fmnist", "digits"])
    ap.add_argument("--raw-root", default=None, help="the dataset's raw folder (default <work>/raw/<dataset>)")
    args = ap.parse_args(argv)
    args.rounds, args.eval_every = 1, None  # what gpu_throughput's engine_cell reads
    if args.threads:
        torch.set_num_threads(args.threads)
    set_determinism(True)
    device = pick_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{args.dataset} Dir(0.1) {args.clients} clients, fraction {args.fraction}", file=sys.stderr)
    manifest, shards = partition(args, args.clients)
    rows = [row for method in args.methods for row in method_rows(args, manifest, shards, device, method)]
    print(table(rows, ["method", "levers", "clients", "eval_s", "personal_s", "speedup", "max_acc_diff"]))
    return rows


if __name__ == "__main__":
    main()
