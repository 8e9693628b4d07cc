"""provenance.json: everything needed to say where a result came from."""

from __future__ import annotations

import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

import torch

from . import kernels
from .bounded_run import NOT_RUN, TOO_LARGE, ProgramFailed, run_bounded
from .overrides import recorded

PACKAGES = ("fedrepro", "torch", "torchvision", "numpy", "pyarrow", "pandas", "scikit-learn", "snakemake", "timm")


GIT_TIMEOUT_S = 10


def _git(*args: str, too_much: str | None = None) -> str | None:
    """git's answer, read within bounds (fedrepro.bounded_run); None where there is none (no git, not
    a repository), with a warning where git misbehaved (too slow, too much output, not UTF-8).
    `too_much`: the answer to record where git printed more than the bound (instead of None)."""
    try:
        proc = run_bounded(["git", *args], timeout=GIT_TIMEOUT_S, check=False)
    except ProgramFailed as exc:
        if exc.reason == TOO_LARGE and too_much is not None:
            return too_much
        if exc.reason != NOT_RUN:  # no git at all: the nulls say so, as before
            print(f"[fedrepro] warning: provenance: {exc}; its answer to 'git {args[0]}' is recorded as unknown",
                  file=sys.stderr)
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def collect(cell: dict, manifest: dict, device: torch.device, determinism: dict[str, Any]) -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", too_much="more changes than can be listed")  # dirty
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
        "kernels": kernels.in_force(),  # the CPU kernel level in force (fedrepro/kernels.py)
        "shards": {"partition_id": manifest["partition_id"], "source_fingerprint": manifest["source_fingerprint"], "sha256": manifest["files"]},
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "slurm": {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SLURM_ARRAY_TASK_ID")},
        "command": sys.argv,
        "overrides": recorded(),  # the --set / --config set= items of the run (the cell above is the result)
    }
