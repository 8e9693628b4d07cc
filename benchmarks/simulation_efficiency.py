"""Simulation efficiency: FedAvg training throughput through the engine divided by
plain centralized training throughput, on the same samples, model and batch size,
measured in one run.

    .venv/bin/python benchmarks/simulation_efficiency.py            # fmnist, 20 clients, Dir(0.1), batch 10
    .venv/bin/python benchmarks/simulation_efficiency.py --dataset digits --rounds 3

Target (issue 2): >= 0.8 on fmnist, 20 clients, batch 10, CPU. PFLlib on this machine:
47.8 s per round (30 s training + 18 s evaluation); centralized 1,790 samples/s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fedrepro.config import resolve_experiment
from fedrepro.data.datasets import load_dataset, prepare_dataset
from fedrepro.data.shards import load_partition, write_partition
from fedrepro.engine.data import load_clients
from fedrepro.engine.engine import Engine, use_layout
from fedrepro.engine.run import pick_device, set_determinism
from fedrepro.io import derive_seed
from fedrepro.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--raw-root", default=None, help="raw data folder (default results/raw/<dataset>)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="FedAvg rounds timed (1 local epoch each)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    set_determinism(True)
    device = pick_device(args.device)
    root = Path(args.raw_root or f"results/raw/{args.dataset}")
    prepare_dataset(args.dataset, root)
    raw = load_dataset(args.dataset, root)
    cfg = {
        "experiment": "bench", "datasets": {args.dataset: {}},
        "partitions": {"dir": {"partitioner": "dirichlet", "num_clients": args.clients, "seed": 1,
                               "params": {"alpha": args.alpha, "min_partition_size": 40, "self_balancing": True},
                               "split": {"test_fraction": 0.25, "stratify": False}}},
        "methods": {"fedavg": {}}, "seeds": [0],
        "training": {"rounds": args.rounds, "batch_size": args.batch_size, "eval_every": 10**6, "checkpoint_every": 10**6},
    }
    exp = resolve_experiment(cfg)
    cell, part = exp["cells"][0], exp["partitions"][0]
    with tempfile.TemporaryDirectory() as tmp:
        write_partition(raw, part["spec"], Path(tmp) / part["id"])
        manifest, shards = load_partition(Path(tmp) / part["id"])
    clients = load_clients(manifest, shards, device)
    n_train = sum(c.num_train for c in clients)

    # Federated: the engine's own loop (sampling, broadcast, parameter swaps, local SGD,
    # aggregation, byte counting); its training time excludes the one final evaluation.
    engine = Engine(cell, manifest, clients, device, progress=False)
    fed_time = engine.run()["resources"]["train_time_s"]
    fed_sps = n_train * args.rounds / fed_time

    # Centralized: the same samples pooled, the same model, batch size and epochs, a plain loop.
    x = torch.cat([c.train.x for c in clients])
    y = torch.cat([c.train.y for c in clients])
    torch.manual_seed(0)
    model = use_layout(build_model(cell["model"]["name"], manifest["sample_shape"], manifest["num_classes"]).to(device),
                       cell["training"]["channels_last"], device)  # the engine's layout for this cell
    opt = torch.optim.SGD(model.parameters(), lr=cell["training"]["optimizer"]["lr"])
    g = torch.Generator().manual_seed(derive_seed(0, "central"))
    model.train()
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        perm = torch.randperm(len(y), generator=g).to(device)
        for s in range(0, len(y), args.batch_size):
            idx = perm[s : s + args.batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    cen_time = time.perf_counter() - t0
    cen_sps = n_train * args.rounds / cen_time

    print(f"dataset={args.dataset} clients={args.clients} Dir({args.alpha}) batch={args.batch_size} device={device} threads={torch.get_num_threads()}")
    print(f"train samples per epoch: {n_train}")
    print(f"federated (engine, FedAvg): {fed_sps:,.0f} samples/s  ({fed_time / args.rounds:.2f} s per round of training)")
    print(f"centralized (plain loop):   {cen_sps:,.0f} samples/s")
    print(f"simulation efficiency (federated / centralized): {fed_sps / cen_sps:.3f}")


if __name__ == "__main__":
    main()
