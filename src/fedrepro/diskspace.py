"""Free space where a job or the workflow writes, checked before it starts (issue 57).

A training job started on a file system with no space left failed with an empty log (its log could not
be written either), and a full disk when the workflow started gave a multi-line stack before any job.
Both now stop first with one line naming the path and its free space: a training job (engine.run.train_cell:
`fedrepro train`, a fine-tuning row trained in full, verify's retraining) before any data is read, the
workflow's onstart before its plan is written or a job starts; and when the workflow fails on a full
disk, its onerror says so (the failed jobs' logs may be empty).

A write that fills the disk later is still reported where it fails (fedrepro.io.atomic_path: "No space
left on device: cannot write <file> (nothing was written)").
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable

#: A folder with less free space than this is full for fedrepro: a job's log, status file, metrics.json
#: and provenance.json take a few KiB to a few MiB; below 64 KiB even the log's first lines may not fit.
#: Small on purpose: a disk that can take the job's first files runs it, and a later full write is named.
MIN_FREE_BYTES = 64 << 10
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size_text(n: int) -> str:
    """'0 B', '12.0 KiB', '3.4 GiB'."""
    size, unit = float(n), 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{int(size)} B" if unit == 0 else f"{size:.1f} {_UNITS[unit]}"


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (a folder the job will create lies on that one's file system)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int | None:
    """The bytes an unprivileged writer may still write on the file system of `path` (or of its nearest
    existing parent), as shutil.disk_usage counts them (statvfs: available blocks x fragment size); None
    where the file system cannot say. Read from os.statvfs, not shutil.disk_usage: fedrepro.io asks the
    latter after a failed write, and tests that fake its answer there must not stop a job at its start."""
    try:
        st = os.statvfs(_existing(Path(path)))
    except (OSError, ValueError):
        return None
    return st.f_bavail * st.f_frsize


def full_disk_problem(paths: Iterable[str | os.PathLike], need: int = MIN_FREE_BYTES) -> str | None:
    """'No space left on device: cannot write <path> (<free> free; ...)' for the first of `paths` whose
    file system has less than `need` bytes free; None where all have room (or cannot say)."""
    for path in dict.fromkeys(str(p) for p in paths if p is not None):
        free = free_bytes(path)
        if free is not None and free < need:
            return (f"No space left on device: cannot write {path} ({size_text(free)} free; allowed: at least "
                    f"{size_text(need)} free: free space there and rerun)")
    return None


def require_space(paths: Iterable[str | os.PathLike]) -> None:
    """OSError ENOSPC, its message naming the path and its free space, where a job could not write its
    files: `fedrepro`'s main prints it as its one error line (exit status 2)."""
    problem = full_disk_problem(paths)
    if problem:
        raise OSError(errno.ENOSPC, problem)


def workflow_paths(out: str | os.PathLike) -> list[str]:
    """What a workflow run writes into: the experiment's folder results/<experiment> and results/ beside it
    (shards, raw data, logs)."""
    return [str(out), str(Path(out).parent)]


def stop_if_full(out: str | os.PathLike) -> None:
    """The workflow's onstart: stop before any job, with one line, where results/ has no space left."""
    problem = full_disk_problem(workflow_paths(out))
    if problem:
        raise SystemExit(f"fedrepro: {problem}; no job was started")


def failure_note(out: str | os.PathLike) -> str | None:
    """The workflow's onerror: one line where a full disk may explain the failure (and empty logs)."""
    problem = full_disk_problem(workflow_paths(out))
    return None if problem is None else (f"fedrepro: the workflow failed on a full disk: {problem}; a failed job's "
                                         "log may be empty (it could not be written)")
