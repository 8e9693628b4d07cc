"""The inputs of the scripts in benchmarks/, checked as `fedrepro`'s own commands check theirs
(fedrepro.cli_args): a bad argument or input file ends the script with one line on stderr naming
it and what is allowed (exit 2), never a traceback; files are read bounded and without blocking
(fedrepro.io.read_regular: a FIFO, device, directory or oversized file is refused unread), JSON
with its nesting bounded; a git revision is resolved to a commit before git sees it as an argument.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from fedrepro.cli_args import OneLineParser, _bad, positive_int, print_error  # noqa: E402,F401 (the scripts' parser and checks)
from fedrepro.custody import METRICS_MAX_BYTES  # noqa: E402
from fedrepro.io import FileTooLarge, NotRegularFile, file_kind, read_json as _read_json, read_regular  # noqa: E402
from fedrepro.registry import ConfigError  # noqa: E402

#: Largest text file (a Snakemake benchmark table, a stage table, a JUnit report) a script reads.
MAX_TEXT_BYTES = 16 << 20


def fail(message: str) -> NoReturn:
    """`<script>: error: <message>` on stderr, exit 2 (a usage error, as `fedrepro`'s)."""
    print_error(Path(sys.argv[0]).name, " ".join(str(message).split()))
    raise SystemExit(2)


def error_line(stderr: str) -> str:
    """What a failed command said, in one line: `fedrepro`'s "...: error: ..." line, else its last
    line (a traceback's exception)."""
    lines = stderr.strip().splitlines() or ["no message"]
    return next((line for line in lines if ": error: " in line), lines[-1])


def _refuse(path: Path, what: str, exc: Exception, limit: int) -> NoReturn:
    allowed = f"a regular {what} of at most {limit:,} bytes"
    if isinstance(exc, NotRegularFile):
        why = f"{file_kind(exc.st_mode)}, not a regular file"
    elif isinstance(exc, FileTooLarge):
        why = f"larger than {limit:,} bytes"
    elif isinstance(exc, FileNotFoundError):
        why = "no such file"
    elif isinstance(exc, OSError):
        why = f"cannot be read ({exc.strerror or exc})"
    else:  # io.read_json's message names the file already
        why = f"not valid JSON ({exc.msg.removeprefix(f'{path}: ') if isinstance(exc, json.JSONDecodeError) else exc})"
        allowed += " holding a JSON object"
    fail(f"{what} {str(path)!r}: {why}; allowed: {allowed}")


def read_json(path: Path, what: str = "JSON file", limit: int = METRICS_MAX_BYTES) -> dict[str, Any]:
    """The JSON object in the regular file `path` (fedrepro.io.read_json); anything else ends the
    script (fail). `what` names the file in the message ("metrics file", ...)."""
    try:
        doc = _read_json(path, limit)
    except (OSError, ValueError) as exc:  # ValueError: invalid, too deep or not UTF-8, or a 5,000-digit number
        _refuse(path, what, exc, limit)
    if not isinstance(doc, dict):
        fail(f"{what} {str(path)!r}: JSON of type {type(doc).__name__}; allowed: a JSON object {{...}}")
    return doc


def read_text(path: Path, what: str = "file", limit: int = MAX_TEXT_BYTES) -> str:
    """The text of the regular file `path` (fedrepro.io.read_regular); anything else ends the script."""
    try:
        return read_regular(path, limit).decode("utf-8", "replace")
    except OSError as exc:
        _refuse(path, what, exc, limit)


def revision(value: str) -> str:
    """A git revision of this repository (argparse type): the full hash of the commit it names. A
    value starting with '-' is refused (git would read it as an option), the rest resolved with
    `git rev-parse --verify --end-of-options <value>^{commit}`, so git only ever gets the hash."""
    allowed = f"a branch, tag or commit of the git repository {REPO} (not starting with '-')"
    if not value or value.startswith("-"):
        raise _bad("not a revision", value, allowed)
    try:
        run = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{value}^{{commit}}"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _bad(f"git cannot resolve it ({exc})", value, allowed) from None
    if run.returncode != 0:
        raise _bad("unknown revision", value, allowed)
    return run.stdout.strip()


def existing_dir(value: str) -> Path:
    """A directory that exists (argparse type)."""
    if not value or not Path(value).is_dir():
        raise _bad("no such directory" if not Path(value).exists() else "not a directory", value, "an existing directory")
    return Path(value)


def experiment_file(value: str) -> Path:
    """An experiment config that fedrepro reads and resolves (argparse type; fedrepro.config). Read
    first on its own (fedrepro.configfile), so a file that is no config is refused before torch loads."""
    from fedrepro.configfile import read_config_file

    try:
        read_config_file(value)
        from fedrepro.config import load_and_resolve

        load_and_resolve([value])
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(value)
