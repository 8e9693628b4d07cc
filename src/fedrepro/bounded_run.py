"""Running another program and reading what it prints, within bounds (docs/security.md, "Programs
fedrepro runs").

fedrepro reads the output of a few programs: nvidia-smi (the local profile's plan, while Snakemake
reads the profile), git (provenance) and its own interpreter (the plugins' search path). Each goes
through `run_bounded`: at most `limit` bytes of its standard output are read (the program is killed
past them), it is killed after `timeout` seconds, its standard error is discarded, and its output
must be UTF-8. Any of these failures is a `ProgramFailed` whose message is one line naming the program
("nvidia-smi printed more than 1 MiB"), for the caller to say what it does instead. Nothing here
imports more than the standard library: the profile is read before every Snakemake run.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from typing import Mapping, Sequence

#: Output read from a program at most (nvidia-smi's answer for 1,024 GPUs is about 64 KiB).
MAX_OUTPUT_BYTES = 1 << 20
_CHUNK = 1 << 16


#: ProgramFailed.reason: what went wrong.
NOT_RUN, TIMED_OUT, TOO_LARGE, NOT_UTF8, EXIT_STATUS = "not run", "timed out", "too large", "not UTF-8", "exit status"


class ProgramFailed(Exception):
    """run_bounded: the program could not start, ran past its time, printed too much or output that
    is not UTF-8, or (with `check`) exited unsuccessfully (`reason`, one of the constants above).
    str(): "<program> <what went wrong>"."""

    def __init__(self, program: str, what: str, reason: str):
        super().__init__(f"{program} {what}")
        self.program, self.reason = program, reason


class _PastDeadline(Exception):
    pass


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} bytes"


def _read_stdout(proc: subprocess.Popen, program: str, deadline: float, limit: int) -> bytes:
    """The program's standard output up to its end; _PastDeadline, or ProgramFailed past `limit` bytes."""
    chunks, total = [], 0
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _PastDeadline
            if not sel.select(left):
                continue  # the deadline is checked above
            chunk = os.read(proc.stdout.fileno(), _CHUNK)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ProgramFailed(program, f"printed more than {_size(limit)}", TOO_LARGE)


def run_bounded(argv: Sequence[str], *, timeout: float, limit: int = MAX_OUTPUT_BYTES, program: str | None = None,
                env: Mapping[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `argv` (no stdin, stderr discarded) and return its exit status and UTF-8 standard output
    (a CompletedProcess with text `stdout`). ProgramFailed, naming `program` (default: argv[0]'s
    name), where it cannot start, runs past `timeout` seconds, prints more than `limit` bytes or
    output that is not UTF-8, or, with `check`, exits with another status than 0. The program runs
    in a session of its own, so that on any failure it is killed with whatever it started."""
    program = program or os.path.basename(argv[0])
    deadline = time.monotonic() + timeout
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=None if env is None else dict(env), start_new_session=True)
    except (OSError, ValueError) as exc:
        raise ProgramFailed(program, f"could not be run ({getattr(exc, 'strerror', None) or exc})", NOT_RUN) from None
    finished = False
    try:
        out = _read_stdout(proc, program, deadline, limit)
        code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))  # it may close its output and go on
        finished = True
    except (_PastDeadline, subprocess.TimeoutExpired):
        raise ProgramFailed(program, f"timed out after {timeout:g} s", TIMED_OUT) from None
    finally:
        if not finished:  # the program and anything it started: never left running, nor blocked on a full pipe
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # one stuck in the kernel (a hung driver) dies later
                proc.wait(timeout=1)
        proc.stdout.close()
    if check and code != 0:
        what = f"exited with status {code}" if code > 0 else f"was killed by signal {-code}"
        raise ProgramFailed(program, what, EXIT_STATUS)
    try:
        text = out.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProgramFailed(program, f"printed output that is not UTF-8 (byte {exc.start})", NOT_UTF8) from None
    return subprocess.CompletedProcess(list(argv), code, text, None)
