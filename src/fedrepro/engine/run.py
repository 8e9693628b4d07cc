"""Run one training cell end to end: shards -> engine -> metrics.json + provenance.json."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from .. import kernels
from ..custody import METRICS_SCHEMA, cell_identity, write_metrics
from ..data.shards import load_partition_with_official
from ..diskspace import require_space
from ..io import clean_stale, write_json_atomic
from ..provenance import collect
from ..registry import ConfigError
from .data import load_clients, load_split
from .engine import Engine
from .final_model import FINAL_MODEL, save_final
from .loop import TrainingDiverged, run as run_rounds
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
        "schema": METRICS_SCHEMA,
        "cell": metrics_cell(cell),
        "status": "failed",
        "failure": {"reason": reason, "round": round},
    }


def train_cell(cell: dict, shards_dir: str | Path, out_dir: str | Path, checkpoint: str | Path | None = None,
               device: str = "auto", threads: int | None = None, progress: bool = True,
               cell_key: str | None = None, method_class: type | None = None) -> dict[str, Any]:
    """Train `cell` on the partition in `shards_dir`; write metrics.json and provenance.json, both
    with the cell's identity (fedrepro.custody.cell_identity; `cell_key`: the hash of the cell as
    the workflow resolved it, where `cell` is a tuned one, else the hash of `cell`). A cell with a
    global model also keeps its final model (final_model.FINAL_MODEL), what its fine-tuning rows score.
    `method_class`: the method to train with instead of the cell's registered one (a "+FT" row)."""
    out_dir = Path(out_dir)
    folders = list(dict.fromkeys([out_dir, *([Path(checkpoint).parent] if checkpoint else [])]))
    require_space(folders)  # a full disk: one line naming the folder, before any work (and not an empty log)
    for folder in folders:
        clean_stale(folder)  # the temporary files of an earlier job of this cell killed with SIGKILL
    manifest, clients, dev, determinism, official = open_cell(cell, shards_dir, device, threads)
    label = f"{cell['experiment']}/{cell['dataset']}/{cell['partition']}/{cell['label']}/seed{cell['seed']}"
    print(f"[fedrepro] training cell {label} on {dev} ({len(clients)} clients, {cell['training']['rounds']} rounds)", file=sys.stderr)
    engine = Engine(cell, manifest, clients, dev, Path(checkpoint) if checkpoint else None, progress=progress,
                    official_test=official, method_class=method_class)
    identity = cell_identity(cell, manifest, cell_key)
    try:
        metrics = run_rounds(engine) | {"identity": identity}
    except TrainingDiverged as exc:
        print(f"[fedrepro] cell {label} FAILED: {exc.reason}", file=sys.stderr)
        metrics = failed_metrics(cell, exc.reason, exc.round, identity)
    # before metrics.json, so a finished cell has both; a failed one keeps none (no row is scored from an
    # earlier run's model). Tuning trials and tuned cells are no fine-tuning row's base (finetune.base_problem).
    kept = {}  # provenance.json records the final model kept (final_model.kept_final: a missing one is then told from none)
    if metrics["status"] == "ok" and engine.method.has_global and not {"validation", "tuned"} & set(cell):
        kept["final_model"] = {"file": FINAL_MODEL, "sha256": save_final(engine.final, out_dir / FINAL_MODEL, identity)}
    elif (out_dir / FINAL_MODEL).exists():
        (out_dir / FINAL_MODEL).unlink()
    write_json_atomic(out_dir / "provenance.json", collect(cell, manifest, dev, determinism) | {"identity": identity} | kept)
    write_metrics(out_dir / "metrics.json", metrics)
    if checkpoint and Path(checkpoint).exists():
        Path(checkpoint).unlink()
    return metrics


def open_cell(cell: dict, shards_dir: str | Path, device: str = "auto",
              threads: int | None = None) -> tuple[dict, list, torch.device, dict[str, Any], Any]:
    """What a job of `cell` needs before its engine: the manifest (its shards checked), the clients'
    data on the device, the device, the determinism settings and the official test split (or None)."""
    try:
        kernels.requested()  # a bad FEDREPRO_KERNELS is refused before any work
    except kernels.KernelLevelError as exc:
        raise ConfigError(str(exc)) from None
    if threads:
        torch.set_num_threads(threads)
    determinism = set_determinism(cell["training"]["deterministic"])
    dev = pick_device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # "cuda" and the memory statistics then mean this GPU
    # every file read once, the official test set too (refused where its sha256 differs)
    manifest, shards, official = load_partition_with_official(shards_dir, official="official" in cell["training"]["global_test"])
    if manifest["partition_id"] != cell["partition_id"]:
        raise ConfigError(f"{shards_dir}: partition {manifest['partition_id']} is not the cell's partition {cell['partition_id']}")
    carve = (cell.get("validation") or {}).get("from_train")  # a tuning trial: validation carved from train
    clients = load_clients(manifest, shards, dev, val_from_train=carve, seed=int(cell["seed"]))
    if "official" in cell["training"]["global_test"] and official is None:
        raise ConfigError(f"{shards_dir}: training.global_test asks for 'official' but the partition has no official test set "
                         "(it pooled it into the clients' data, pool: true, or the dataset has none)")
    return manifest, clients, dev, determinism, load_split(manifest, official, "test", dev) if official else None
