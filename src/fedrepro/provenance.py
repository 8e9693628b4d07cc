"""provenance.json: everything needed to say where a result came from."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from typing import Any

import torch

from .overrides import recorded

PACKAGES = ("fedrepro", "torch", "torchvision", "numpy", "pyarrow", "pandas", "scikit-learn", "snakemake", "timm")


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def collect(cell: dict, manifest: dict, device: torch.device, determinism: dict[str, Any]) -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    cuda = torch.cuda.is_available()
    return {
        "cell": cell,
        "seeds": {"seed": cell["seed"], "partition_seed": manifest["seed"],
                  "derivation": "fedrepro.io.derive_seed(seed, purpose, round, client) via numpy SeedSequence"},
        "git": {"commit": commit, "dirty": bool(status) if status is not None else None},
        "packages": {p: _version(p) for p in PACKAGES},
        "python": sys.version,
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version() if cuda else None, "num_threads": torch.get_num_threads()},
        "device": {"type": device.type, "name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
                   "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
        "determinism": determinism,
        "shards": {"partition_id": manifest["partition_id"], "source_fingerprint": manifest["source_fingerprint"], "sha256": manifest["files"]},
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "slurm": {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SLURM_ARRAY_TASK_ID")},
        "command": sys.argv,
        "overrides": recorded(),  # the --set / --config set= items of the run (the cell above is the result)
    }
