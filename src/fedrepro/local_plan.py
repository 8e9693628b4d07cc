"""How many training cells the local profile runs at once, and with how many threads each.

`workflow/profiles/local` is rendered with YTE when Snakemake reads it; its `__definitions__`
call `profile_plan()`, which looks at the machine (the visible GPUs' free memory through
`nvidia-smi`, the CPUs this process may use, the available memory) and returns the plan whose
`resources()` and `set_threads()` fill the profile's `resources:` and `set-threads:`. Every
training job (rules in TRAINING_RULES) takes one of `gpu_slots` and its rule's threads.

* No GPU: cells run side by side at CPU_CELL_THREADS each and `--cores` bounds how many (one at a time
  on 2 cores, 16 at once on 32): gpu_slots is no limit, except where the available memory
  holds fewer cells (CELL_HOST_MIB each). A constant, not a function of the machine, and the
  2 threads every cell trained at before: a cell's numbers depend on its threads (torch's
  parallel sums), so the same cell gives the same numbers on any CPU machine and as recorded.
  1 thread a cell would be about 10 % faster on a full machine (docs/throughput.md, "How many
  cells at once"); FEDREPRO_TRAIN_THREADS=1 asks for it.
* GPUs: CELL_GPU_MIB of free memory per cell, at most MAX_CELLS_PER_GPU per GPU (each job takes
  the visible GPU with the most free memory, `fedrepro train --device auto`), and threads so
  that the cells at once fit the CPUs (at most GPU_CELL_THREADS, at least 1).

`plan()` is the pure part (unit-tested for 0, 1 and 4 GPUs); the command line still wins
(`--resources gpu_slots=N`, `--set-threads train=K` replace the profile's values), and so do
the environment variables SLOTS_ENV and THREADS_ENV. Nothing here imports torch: the profile
is read before every Snakemake run, dry runs included.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from .bounded_run import ProgramFailed, run_bounded
from .registry import ConfigError, show

SLOTS_ENV = "FEDREPRO_GPU_SLOTS"
THREADS_ENV = "FEDREPRO_TRAIN_THREADS"
#: The rules whose jobs train or fine-tune a cell (each takes a gpu_slot); the profile sets their
#: threads, the same for all, so a fine-tuning row computes as its base cell did.
TRAINING_RULES = ("train", "tune_trial", "train_tuned", "finetune")

#: Without a GPU, each cell's torch threads: those every cell trained at before issue 38, since the
#: numbers depend on them (1 against 2 measured: docs/throughput.md, benchmarks/cell_threads.py).
CPU_CELL_THREADS = 2
#: With GPUs, each cell's threads when the CPUs allow it (the rules' own default; the GPU computes).
GPU_CELL_THREADS = 2
#: GPU memory planned per cell: the default experiment's cells peaked at 510-541 MiB allocated on
#: an H100 (docs/gpu.md) plus about 500 MiB of CUDA context per process; twice that, for larger models.
CELL_GPU_MIB = 2048
#: Cells per GPU at most: 6 per H100 trained config/test.yaml side by side (docs/gpu.md); a cap
#: chosen, not measured, so that a large GPU does not start dozens of processes.
MAX_CELLS_PER_GPU = 8
#: Host memory planned per cell: the default experiment's cells peak at about 1 GiB RSS on the CPU.
CELL_HOST_MIB = 2048
#: Largest value of the override variables.
MAX_SLOTS = 4096
NVIDIA_SMI_TIMEOUT_S = 5.0
_said = False  # the plan's line was printed (by this process)
OVERRIDE_HINT = "override: --resources gpu_slots=N --set-threads train=K"


@dataclass(frozen=True)
class LocalPlan:
    """gpu_slots: training jobs at once (None: no limit, `--cores` bounds them); threads: each
    training job's threads; gpus_free_mib: free MiB of each visible GPU (None: unknown);
    line: what was chosen, for the user."""

    gpu_slots: int | None
    threads: int
    gpus_free_mib: tuple[int | None, ...]
    line: str

    def resources(self) -> dict[str, int] | None:
        """The profile's `resources:`; None leaves the key out (Snakemake then limits nothing by it)."""
        return None if self.gpu_slots is None else {"gpu_slots": self.gpu_slots}

    def set_threads(self) -> dict[str, int]:
        """The profile's `set-threads:` (a rule absent from the workflow is ignored by Snakemake)."""
        return {rule: self.threads for rule in TRAINING_RULES}


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f}".rstrip("0").rstrip(".")


def plan(cores: int, gpus_free_mib: Sequence[int | None], host_free_mib: int | None = None,
         slots: int | None = None, threads: int | None = None, note: str = "") -> LocalPlan:
    """The plan for a machine with `cores` usable CPUs, visible GPUs with these free MiB (None:
    unknown, e.g. a MIG instance: one cell) and `host_free_mib` of available memory (None:
    unknown). `slots` / `threads` (the environment's overrides) replace the planned values;
    `note` is added to the line (why no GPU was seen)."""
    gpus = tuple(gpus_free_mib)
    planned: int | None = None  # no GPU: cells at once are for --cores to bound
    why = ""
    if gpus:
        per_gpu = [1 if free is None else min(MAX_CELLS_PER_GPU, free // CELL_GPU_MIB) for free in gpus]
        planned = max(1, sum(per_gpu))  # a GPU without room for a cell still runs them one at a time
        packing = f"{'+'.join(map(str, per_gpu))}: " if len(gpus) > 1 else ""
        why = f" ({packing}{_gib(CELL_GPU_MIB)} GiB of GPU memory a cell, at most {MAX_CELLS_PER_GPU} a GPU)"
    if host_free_mib is not None and max(1, host_free_mib // CELL_HOST_MIB) < (planned or sys.maxsize):
        planned = max(1, host_free_mib // CELL_HOST_MIB)
        why = f" (memory: {_gib(host_free_mib)} GiB available, {_gib(CELL_HOST_MIB)} GiB a cell)"
    if slots is not None:
        planned, why = slots, f" ({SLOTS_ENV})"
    if threads is None:
        threads = CPU_CELL_THREADS if not gpus else max(1, min(GPU_CELL_THREADS, cores // planned))
        threads_why = ""
    else:
        threads_why = f" ({THREADS_ENV})"
    if gpus:
        shown = ", ".join("?" if free is None else _gib(free) for free in gpus)
        head = f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({shown} GiB free)"
    else:
        head = "no GPU"
    if planned is None:
        # what the profile's `--cores all` lets run at once (a --cores on the command line decides instead)
        fit = max(1, cores // threads)
        at_once = f"side by side, as many as --cores allows ({fit} at once with all {cores} cores)"
    elif planned == 1:
        at_once = f"one at a time{why}"
    else:
        at_once = f"side by side, at most {planned} at once{why}"
    line = (f"fedrepro: local profile: {head}{note}; training cells run {at_once}, {threads} thread"
            f"{'' if threads == 1 else 's'} each{threads_why} ({OVERRIDE_HINT})")
    return LocalPlan(planned, threads, gpus, line)


def env_count(name: str, environ: Mapping[str, str]) -> int | None:
    """The positive whole number in environment variable `name`, None when unset or empty."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 6 and 1 <= int(raw) <= MAX_SLOTS):
        raise ConfigError(f"environment variable {name} has value {show(raw)}; allowed: a whole number from 1 to {MAX_SLOTS}")
    return int(raw)


def visible_gpus(rows: Sequence[tuple[str, str, int | None]], cuda_visible: str | None) -> list[int | None]:
    """Free MiB of the GPUs CUDA will show a job: `rows` are nvidia-smi's (index, uuid, free MiB);
    CUDA_VISIBLE_DEVICES selects by index or UUID (prefix) and, as CUDA does, ends at the first
    entry that names no GPU. A MIG entry counts as one GPU of unknown free memory."""
    if cuda_visible is None:
        return [free for _, _, free in rows]
    chosen: list[int | None] = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        match = [free for index, uuid, free in rows
                 if entry == index or (entry.startswith("GPU-") and uuid.startswith(entry))]
        if match:
            chosen.append(match[0])
        elif entry.startswith("MIG-"):
            chosen.append(None)
        else:
            break
    return chosen


def query_gpus(timeout: float | None = None) -> tuple[list[tuple[str, str, int | None]], str]:
    """nvidia-smi's (index, uuid, free MiB) per GPU, and a note when it misbehaved (no GPUs then):
    read within bounds (bounded_run), so one that hangs, floods or prints non-UTF-8 costs at most
    NVIDIA_SMI_TIMEOUT_S and 1 MiB, and is named in the plan's line."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], ""
    try:
        proc = run_bounded([exe, "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"],
                           program="nvidia-smi", timeout=NVIDIA_SMI_TIMEOUT_S if timeout is None else timeout, check=False)
    except ProgramFailed as exc:
        return [], f" ({exc}; planning without a GPU)"
    if proc.returncode != 0:  # e.g. "No devices were found", or no driver loaded
        return [], ""
    rows = []
    for line in proc.stdout.splitlines()[:1024]:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            free = parts[2]  # MiB; "[N/A]" where the driver cannot say (a MIG-enabled GPU)
            rows.append((parts[0], parts[1], int(free) if free.isascii() and free.isdigit() and len(free) <= 12 else None))
    return rows, ""


def query_gpu_names(cuda_visible: str | None = None, timeout: float | None = None) -> list[str]:
    """The names of the GPUs CUDA will show a job (nvidia-smi's, CUDA_VISIBLE_DEVICES applied by index
    or UUID as in `visible_gpus`), without initialising CUDA; [] without nvidia-smi or when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        proc = run_bounded([exe, "--query-gpu=index,uuid,name", "--format=csv,noheader"], program="nvidia-smi",
                           timeout=NVIDIA_SMI_TIMEOUT_S if timeout is None else timeout, check=False)
    except ProgramFailed:
        return []
    if proc.returncode != 0:
        return []
    rows = [[p.strip() for p in line.split(",", 2)] for line in proc.stdout.splitlines()[:1024]]
    rows = [r for r in rows if len(r) == 3]
    if cuda_visible is None:
        return [name for _, _, name in rows]
    names = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        match = [name for index, uuid, name in rows if entry == index or (entry.startswith("GPU-") and uuid.startswith(entry))]
        if not match:
            break
        names.append(match[0])
    return names


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_mib(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable in MiB (Linux), None where it cannot be read."""
    from .io import read_regular

    try:
        text = read_regular(path, 1 << 16).decode("ascii", "replace")
    except (OSError, ValueError):
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) // 1024 if len(fields) >= 2 and fields[1].isdigit() else None
    return None


def machine_plan(environ: Mapping[str, str] | None = None) -> LocalPlan:
    """The plan for this machine (ConfigError for a bad override variable), said nowhere: what the
    local profile runs, and what `fedrepro validate` estimates the wall time with (fedrepro.cost)."""
    environ = os.environ if environ is None else environ
    slots, threads = env_count(SLOTS_ENV, environ), env_count(THREADS_ENV, environ)
    rows, failure = query_gpus()
    return plan(usable_cores(), visible_gpus(rows, environ.get("CUDA_VISIBLE_DEVICES")), available_memory_mib(),
                slots=slots, threads=threads, note=failure)


def cells_at_once(local: LocalPlan, cores: int | None = None) -> int:
    """Training cells the plan runs side by side with the profile's `--cores all`: as many as the cores
    hold at its threads per cell, at most its gpu_slots (GPUs, or the memory)."""
    fit = max(1, (usable_cores() if cores is None else cores) // local.threads)
    return fit if local.gpu_slots is None else min(fit, local.gpu_slots)


def profile_plan(environ: Mapping[str, str] | None = None, stream=None) -> LocalPlan:
    """The plan for this machine, said once on stderr: called by workflow/profiles/local while
    Snakemake reads it. A bad override variable stops Snakemake with one line."""
    try:
        result = machine_plan(environ)
    except ConfigError as exc:
        sys.exit(f"fedrepro: local profile: {exc}")
    global _said
    if not _said:  # Snakemake reads the profile once per run, in its own process; jobs never do
        print(result.line, file=stream or sys.stderr, flush=True)
        _said = True
    return result
