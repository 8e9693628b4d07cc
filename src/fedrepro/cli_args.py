"""Argument checks of the `fedrepro` command: every bad argument is a one-line usage error
(`fedrepro <cmd>: error: argument <arg>: <what>: <value>; allowed: <what is allowed>`, exit 2)
raised while the arguments are parsed, so before any long work starts.

Each `type=` function below returns the checked value or raises `argparse.ArgumentTypeError`,
which `OneLineParser` prints on one line. Input files are stat-ed before they are opened (a FIFO
or a device would block the reader) and read only up to a size bound; output paths are checked
for their type and writability up front (a training run must not find out after hours that its
--out-dir is a file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

from .io import FileTooLarge, NotRegularFile, file_kind, load_json, read_regular

#: Largest JSON file an argument may name (--tuned, a select rule's record: a few KB).
MAX_JSON_BYTES = 16 << 20
DEVICE_RE = re.compile(r"auto|cpu|mps|cuda(:\d{1,3})?")


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with its usage errors on one line (the usage text stays in --help)."""

    def error(self, message: str):
        message = " ".join(message.split())  # argparse's own messages may span lines
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _bad(what: str, value: Any, allowed: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{what}: {value!r}; allowed: {allowed}")


def existing_file(value: str) -> str:
    """A regular file that exists and is readable (never opened here: a FIFO would block)."""
    try:
        st = os.stat(value)
    except FileNotFoundError:
        raise _bad("no such file", value, "the path of an existing file") from None
    except OSError as exc:
        raise _bad(f"cannot stat the file ({exc.strerror})", value, "a readable regular file") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(f"{file_kind(st.st_mode)}, not a regular file", value, "the path of an existing regular file")
    if not os.access(value, os.R_OK):
        raise _bad("the file is not readable", value, "a readable regular file")
    return value


def read_bounded(path: str, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (fedrepro.io.read_regular)."""
    try:
        return read_regular(path, limit)
    except NotRegularFile as exc:
        raise _bad(f"{file_kind(exc.st_mode)}, not a regular file", path, "the path of an existing regular file") from None
    except FileTooLarge:
        raise _bad(f"larger than {limit:,} bytes", path, f"a file of at most {limit:,} bytes") from None


def json_object_text(value: str) -> dict:
    """A JSON object given inline (--cell, --spec, --params)."""
    try:
        obj = load_json(value)
    except json.JSONDecodeError as exc:
        raise _bad(f"not JSON ({exc.msg})", _short(value), "a JSON object {...}") from None
    if not isinstance(obj, dict):
        raise _bad(f"JSON of type {type(obj).__name__}", _short(value), "a JSON object {...}")
    return obj


def json_object_file(value: str) -> dict:
    """A regular file holding a JSON object (--tuned), read up to MAX_JSON_BYTES."""
    existing_file(value)
    try:
        obj = load_json(read_bounded(value, MAX_JSON_BYTES))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(f"not a JSON file ({getattr(exc, 'msg', None) or type(exc).__name__})", value, "a file holding a JSON object") from None
    except OSError as exc:
        raise _bad(f"cannot read the file ({exc.strerror})", value, "a readable regular file") from None
    if not isinstance(obj, dict):
        raise _bad(f"JSON of type {type(obj).__name__}", value, "a file holding a JSON object {...}")
    return obj


def json_file(value: str) -> str:
    """The path of a regular file holding a JSON object (checked by reading it once)."""
    json_object_file(value)
    return value


def partition_dir(value: str) -> str:
    """A partition folder written by `fedrepro partition` (a directory with manifest.json)."""
    if not os.path.isdir(value):
        raise _bad("no such directory" if not os.path.exists(value) else "not a directory", value,
                   "a partition folder results/shards/<dataset>/<partition id>/ (with manifest.json)")
    if not os.path.isfile(os.path.join(value, "manifest.json")):
        raise _bad("no manifest.json in the directory", value,
                   "a partition folder written by `fedrepro partition` (results/shards/<dataset>/<partition id>/)")
    return value


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_creatable(path: Path, value: str) -> None:
    """The folders up to `path` exist or can be created: the nearest existing one is a writable directory."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise _bad(f"{base} is a file, not a directory", value, "a path whose parent folders are directories")
    if not os.access(base, os.W_OK | os.X_OK):
        raise _bad(f"directory {base} is not writable", value, "a path in a writable directory")


def output_dir(value: str) -> str:
    """A directory to write into: an existing writable directory, or one that can be created."""
    if not value:
        raise _bad("an empty path", value, "a directory path")
    p = Path(value)
    if p.exists() and not p.is_dir():
        raise _bad("an existing file, not a directory", value, "a directory (existing or to be created)")
    _check_creatable(p, value)
    return value


def input_dir(value: str) -> str:
    """A directory to read (and, for prepare, fill): existing, or absent (a missing dataset is reported later)."""
    if os.path.exists(value) and not os.path.isdir(value):
        raise _bad("an existing file, not a directory", value, "a directory")
    return value


def output_file(value: str) -> str:
    """A file to write (atomically, by rename): not a directory; an existing one is writable; its folder
    exists or can be created."""
    if not value or value.endswith(("/", os.sep)):
        raise _bad("not a file path", value, "the path of a file to write")
    p = Path(value)
    if p.is_dir():
        raise _bad("an existing directory, not a file", value, "the path of a file to write")
    if p.exists() and not p.is_file():
        raise _bad(f"{file_kind(p.stat().st_mode)}, not a regular file", value, "the path of a regular file to write")
    if p.exists() and not os.access(p, os.W_OK):
        raise _bad("an existing file that is not writable", value, "a writable file")
    _check_creatable(p.parent, value)
    return value


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise _bad("not an integer", value, "an integer >= 1") from None
    if n < 1:
        raise _bad("out of range", value, "an integer >= 1")
    return n


#: GPUs `validate --gpus` lays an estimate out on: more than any cluster lends one user (the largest
#: machines hold about 40,000); more GPUs than jobs change nothing. A billion was a MemoryError, 1e21 an
#: OverflowError, both in the layout of the jobs on them.
MAX_GPUS = 100_000


def bounded_int(low: int, high: int, what: str = "an integer"):
    """An argparse type: a whole number from `low` to `high` in decimal digits (no 1e3, no 10**21 that a
    later list or thread pool of that size would choke on)."""
    def check(value: str) -> int:
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
            raise _bad("not an integer", _short(value), f"{what} from {low:,} to {high:,}")
        n = int(text)
        if not low <= n <= high:
            raise _bad("out of range", _short(value), f"{what} from {low:,} to {high:,}")
        return n

    check.__name__ = f"integer_{low}_to_{high}"
    return check


def gpu_count(value: str) -> int:
    """`validate --gpus`: 1 to MAX_GPUS."""
    return bounded_int(1, MAX_GPUS, "a number of GPUs")(value)


def thread_count(value: str) -> int:
    """`calibrate --threads`: 1 to calibration.MAX_THREADS (a calibration file's own bound)."""
    from .calibration import MAX_THREADS

    return bounded_int(1, MAX_THREADS, "a number of threads")(value)


def device(value: str) -> str:
    if not DEVICE_RE.fullmatch(value):
        raise _bad("unknown device", value, "auto, cpu, cuda, cuda:N or mps")
    return value


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[:limit] + f"... ({len(value):,} characters)"


def print_error(prog: str, message: Any) -> None:
    """`<prog>: error: <message>` on stderr (a missing dataset's message goes on with the steps to get it)."""
    print(f"{prog}: error: {message}", file=sys.stderr)


#: The keys of a resolved cell (`fedrepro cells`, the workflow's cell_json) that `fedrepro train` reads.
CELL_KEYS = ("experiment", "dataset", "partition", "partition_id", "method", "label", "hparams", "model", "seed",
             "training", "evaluation")


def train_inputs(cell: dict, shards: str, device_name: str) -> None:
    """`fedrepro train`'s arguments together, before any data is loaded: the cell (check_cell), its
    partition against the one in --shards, and a CUDA --device against the visible GPUs."""
    from .data.shards import read_manifest
    from .registry import ConfigError

    check_cell(cell)
    pid = read_manifest(shards).get("partition_id")
    if pid != cell["partition_id"]:
        raise ConfigError(f"argument --shards: {shards!r} holds partition {pid}, not the cell's partition "
                          f"{cell['partition_id']}; allowed: the cell's partition folder")
    if device_name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"argument --device: {device_name!r}: no CUDA device is visible; allowed: auto, cpu")


def check_cell(cell: dict) -> None:
    """ConfigError (a one-line usage error) for a --cell that is not a resolved cell: missing keys, or a
    method, model or dataset the registries do not know. The training setup itself was resolved by
    fedrepro.config when the cell was made."""
    from .data.datasets import DATASETS
    from .methods import METHODS
    from .models import MODELS
    from .registry import ConfigError, show

    missing = [k for k in CELL_KEYS if k not in cell]
    if missing:
        raise ConfigError(f"argument --cell: missing key(s) {missing}; allowed: a resolved cell with keys "
                          f"{', '.join(CELL_KEYS)} (`fedrepro cells`, the workflow writes them)")
    model = cell["model"]
    for key, value, registry in (("method", cell["method"], METHODS), ("dataset", cell["dataset"], DATASETS),
                                 ("model.name", model.get("name") if isinstance(model, dict) else model, MODELS)):
        if not isinstance(value, str) or value not in registry:
            raise ConfigError(f"argument --cell: key '{key}' has value {show(value)}; allowed: {', '.join(registry.names())}")
    for key in ("hparams", "training", "evaluation"):
        if not isinstance(cell[key], dict):
            raise ConfigError(f"argument --cell: key '{key}' has value {show(cell[key])}; allowed: a mapping")


#: The keys of the select rule's --spec (fedrepro.planning.TuningPlan.select_spec) that `fedrepro select` reads
#: (and `select`, optional: tuning.select where it is not pooled).
SELECT_SPEC_KEYS = ("dataset", "partition", "label", "method", "space", "trials", "metric", "runs")


def check_select_spec(spec: dict) -> None:
    """ConfigError (one line) for a `fedrepro select --spec` that is not what the select rule writes:
    a missing key, a key of the wrong type, or a run of a trial the spec does not list."""
    from .registry import ConfigError, show
    from .tuning import METRIC_MEASURES, METRIC_MODELS, METRIC_STATS, SELECTIONS

    missing = [k for k in SELECT_SPEC_KEYS if k not in spec]
    if missing:
        raise ConfigError(f"argument --spec: missing key(s) {', '.join(missing)}; allowed: a JSON object with keys "
                          f"{', '.join(SELECT_SPEC_KEYS)} (the workflow's select rule writes it)")

    def need(ok: bool, key: str, allowed: str) -> None:
        if not ok:
            value = spec
            for part in key.replace("]", "").replace("[", ".").split("."):
                value = value[int(part)] if isinstance(value, list) else value[part]
            raise ConfigError(f"argument --spec: key '{key}' has value {show(value)}; allowed: {allowed}")

    for key in ("dataset", "partition", "label", "method"):
        need(isinstance(spec[key], str), key, "a string")
    need(isinstance(spec["space"], dict), "space", "a mapping of tuned parameter -> values")
    need(isinstance(spec["metric"], dict) and spec["metric"].get("model") in METRIC_MODELS
         and spec["metric"].get("stat") in METRIC_STATS and spec["metric"].get("measure", "acc") in METRIC_MEASURES,
         "metric", f"{{model: {' | '.join(METRIC_MODELS)}, stat: {' | '.join(METRIC_STATS)}, "
                   f"measure (optional): {' | '.join(METRIC_MEASURES)}}}")
    need(spec.get("select", "pooled") in SELECTIONS, "select", " | ".join(SELECTIONS))
    need(isinstance(spec["trials"], list) and bool(spec["trials"]), "trials", "a non-empty list of {id, values}")
    for i, t in enumerate(spec["trials"]):
        need(isinstance(t, dict) and isinstance(t.get("id"), str) and isinstance(t.get("values"), dict), f"trials[{i}]",
             "{id: string, values: mapping}")
    ids = [t["id"] for t in spec["trials"]]
    need(isinstance(spec["runs"], list), "runs", "a list of {trial, seed, metrics}")
    for i, r in enumerate(spec["runs"]):
        need(isinstance(r, dict) and r.get("trial") in ids and isinstance(r.get("seed"), int)
             and not isinstance(r.get("seed"), bool) and isinstance(r.get("metrics"), str), f"runs[{i}]",
             f"{{trial: one of the trials' ids {show(ids)}, seed: integer, metrics: path of the trial's metrics.json}}")
