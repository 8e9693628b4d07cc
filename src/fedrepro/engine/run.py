"""Run one training cell end to end: shards -> engine -> metrics.json + provenance.json."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..custody import cell_identity
from ..data.shards import load_partition, read_official_test
from ..io import clean_stale, write_json_atomic
from ..provenance import collect
from ..registry import ConfigError
from .data import load_clients, load_split
from .engine import Engine
from .loop import TrainingDiverged
from .record import metrics_cell


def pick_device(name: str = "auto") -> torch.device:
    """"auto": the CPU without CUDA; with several visible GPUs the one with the most free memory,
    so jobs sharing a machine (the local profile's gpu_slots) spread over its GPUs."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if torch.cuda.device_count() == 1:
            return torch.device("cuda")
        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        return torch.device("cuda", max(range(len(free)), key=free.__getitem__))
    return torch.device(name)


def set_determinism(deterministic: bool) -> dict[str, Any]:
    # Must precede CUDA initialisation for older torch; harmless elsewhere.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # Under warn_only, memory-efficient attention keeps its nondeterministic backward on CUDA
    # (FedGCR's ViT warned so on an H100, 2026-11-26): deterministic cells take the math kernel.
    torch.backends.cuda.enable_mem_efficient_sdp(not deterministic)
    return {"use_deterministic_algorithms": deterministic, "cudnn_benchmark": False, "tf32": False,
            "mem_efficient_attention": not deterministic}


def failed_metrics(cell: dict, reason: str, round: int | None, identity: dict[str, Any]) -> dict[str, Any]:
    return {
        "identity": identity,
        "schema": "fedrepro.metrics/1",
        "cell": metrics_cell(cell),
        "status": "failed",
        "failure": {"reason": reason, "round": round},
    }


def train_cell(cell: dict, shards_dir: str | Path, out_dir: str | Path, checkpoint: str | Path | None = None,
               device: str = "auto", threads: int | None = None, progress: bool = True,
               cell_key: str | None = None) -> dict[str, Any]:
    """Train `cell` on the partition in `shards_dir`; write metrics.json and provenance.json, both
    with the cell's identity (fedrepro.custody.cell_identity; `cell_key`: the hash of the cell as
    the workflow resolved it, where `cell` is a tuned one, else the hash of `cell`)."""
    out_dir = Path(out_dir)
    for folder in {out_dir, *([Path(checkpoint).parent] if checkpoint else [])}:
        clean_stale(folder)  # the temporary files of an earlier job of this cell killed with SIGKILL
    if threads:
        torch.set_num_threads(threads)
    determinism = set_determinism(cell["training"]["deterministic"])
    dev = pick_device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # "cuda" and the memory statistics then mean this GPU
    manifest, shards = load_partition(shards_dir)  # refuses shards whose sha256 differs
    if manifest["partition_id"] != cell["partition_id"]:
        raise ConfigError(f"{shards_dir}: partition {manifest['partition_id']} is not the cell's partition {cell['partition_id']}")
    carve = (cell.get("validation") or {}).get("from_train")  # a tuning trial: validation carved from train
    clients = load_clients(manifest, shards, dev, val_from_train=carve, seed=int(cell["seed"]))
    official = read_official_test(shards_dir, manifest) if "official" in cell["training"]["global_test"] else None
    if "official" in cell["training"]["global_test"] and official is None:
        raise ConfigError(f"{shards_dir}: training.global_test asks for 'official' but the partition has no official test set "
                         "(it pooled it into the clients' data, pool: true, or the dataset has none)")
    label = f"{cell['experiment']}/{cell['dataset']}/{cell['partition']}/{cell['label']}/seed{cell['seed']}"
    print(f"[fedrepro] training cell {label} on {dev} ({len(clients)} clients, {cell['training']['rounds']} rounds)", file=sys.stderr)
    engine = Engine(cell, manifest, clients, dev, Path(checkpoint) if checkpoint else None, progress=progress,
                    official_test=load_split(manifest, official, "test", dev) if official else None)
    identity = cell_identity(cell, manifest, cell_key)
    try:
        metrics = engine.run() | {"identity": identity}
    except TrainingDiverged as exc:
        print(f"[fedrepro] cell {label} FAILED: {exc.reason}", file=sys.stderr)
        metrics = failed_metrics(cell, exc.reason, exc.round, identity)
    write_json_atomic(out_dir / "provenance.json", collect(cell, manifest, dev, determinism) | {"identity": identity})
    write_json_atomic(out_dir / "metrics.json", metrics)
    if checkpoint and Path(checkpoint).exists():
        Path(checkpoint).unlink()
    return metrics
