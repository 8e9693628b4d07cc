"""glibc's malloc thresholds and the engine's speed, on this machine: seconds per round and page
faults per round of whole engine rounds, each method run in a fresh process with glibc's
default (adaptive) thresholds and with fixed ones that keep freed memory in the heap
(`keep_freed_memory` below), alternating, in one run. The evidence for leaving the engine on
the defaults (docs/throughput.md, "The allocator").

    .venv/bin/python benchmarks/allocator.py                          # fedavg pfedme apfl ditto, 2 repeats
    .venv/bin/python benchmarks/allocator.py --methods pfedme --repeats 3 --rounds 2

The cell is the parity benchmark's (`parity_pfllib.experiment_config` with the method's parity
row, docs/parity.md): Fashion-MNIST, Dir(0.1) into 20 clients,
every client cut to `--fraction` of its data, fedavg_cnn, batch 10, SGD lr 0.005, all
clients per round, one thread; every round is evaluated. Per row: the best of the repeats
(the least disturbed by other load) of the engine's (train_time_s + eval_time_s) / rounds, and
the process's minor page faults per round (getrusage) over the rounds. The numbers of both
runs are the same (checked: equal summaries); only where freed memory goes differs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fedrepro.config import resolve_experiment
from fedrepro.data.datasets import load_dataset, prepare_dataset
from fedrepro.data.shards import load_partition, write_partition
from fedrepro.engine.engine import Engine
from fedrepro.engine.data import load_clients
from fedrepro.engine.run import set_determinism

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_pfllib import ROWS, F, experiment_config  # noqa: E402  (the parity protocol)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(trim_bytes: int = 256 << 20, mmap_bytes: int = 32 << 20) -> bool:
    """Fixed thresholds: allocations under `mmap_bytes` come from the heap, and up to `trim_bytes`
    of free heap stay in the process instead of going back to the kernel (and returning as
    fresh, zero-filled pages: one page fault each). Whether glibc took them."""
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))


def config(method: str, rounds: int, fraction: float) -> dict:
    """The parity benchmark's experiment for `method` (its parity row's hparams and training, else defaults)."""
    run = next((r.fedrepro for r in ROWS if r.fedrepro.method == method), F(method))
    return experiment_config(argparse.Namespace(dataset="fmnist", fraction=fraction, seeds=[0], rounds=rounds), [run])


def child(method: str, allocator: str, rounds: int, fraction: float, shards: str) -> None:
    """One cell in this process; prints one JSON line."""
    if allocator == "kept" and not keep_freed_memory():
        raise SystemExit("glibc did not take the malloc thresholds")
    torch.set_num_threads(1)
    cell = resolve_experiment(config(method, rounds, fraction))["cells"][0]
    set_determinism(cell["training"]["deterministic"])
    manifest, data = load_partition(shards)
    clients = load_clients(manifest, data, torch.device("cpu"))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    metrics = Engine(cell, manifest, clients, torch.device("cpu"), progress=False).run()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    res = metrics["resources"]
    print(json.dumps({"s_per_round": (res["train_time_s"] + res["eval_time_s"]) / rounds, "faults_per_round": faults / rounds,
                      "summary": metrics["summary"]}, sort_keys=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "pfedme", "apfl", "ditto"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--fraction", type=float, default=0.1, help="each client's share of its data (parity: 0.1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--raw-root", default="results/raw/fmnist")
    ap.add_argument("--child", nargs=2, metavar=("ALLOCATOR", "SHARDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.methods[0], args.child[0], args.rounds, args.fraction, args.child[1])
    prepare_dataset("fmnist", Path(args.raw_root))
    part = resolve_experiment(config("fedavg", args.rounds, args.fraction))["partitions"][0]
    print(f"fmnist Dir(0.1), 20 clients, fraction {args.fraction}, {args.rounds} round(s), one thread; best of "
          f"{args.repeats}; default = glibc's adaptive thresholds, kept = keep_freed_memory()")
    print("| method | default s/round | kept s/round | speed-up | default faults/round | kept faults/round | same numbers |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / part["id"]
        write_partition(load_dataset("fmnist", Path(args.raw_root)), part["spec"], shards)
        for method in args.methods:
            runs: dict[str, list[dict]] = {"default": [], "kept": []}
            for _ in range(args.repeats):
                for allocator in runs:
                    out = subprocess.run([sys.executable, __file__, "--methods", method, "--rounds", str(args.rounds),
                                          "--fraction", str(args.fraction), "--child", allocator, str(shards)],
                                         check=True, capture_output=True, text=True).stdout
                    runs[allocator].append(json.loads(out.strip().splitlines()[-1]))
            best = {a: min(r["s_per_round"] for r in rs) for a, rs in runs.items()}
            faults = {a: min(r["faults_per_round"] for r in rs) for a, rs in runs.items()}
            same = all(r["summary"] == runs["default"][0]["summary"] for rs in runs.values() for r in rs)
            print(f"| {method} | {best['default']:.2f} | {best['kept']:.2f} | {best['default'] / best['kept']:.2f}x | "
                  f"{faults['default']:,.0f} | {faults['kept']:,.0f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
