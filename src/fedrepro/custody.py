"""Chain of custody of results: which cell a metrics.json, provenance.json or checkpoint belongs
to, and the metrics.json contract: its schema id (`METRICS_SCHEMA`), its one writer
(`write_metrics`) and its reader (`read_metrics`), so that a wrong, foreign or damaged file stops
with a message. The layout of the record is built by fedrepro.engine.record.

Every artifact of a cell carries its *identity* (`cell_identity`): the experiment, dataset,
partition label and id, method, label and seed, the hash of the resolved cell (`cell_key`, the
hash the engine has always keyed checkpoints by) and the hash of the shard manifest it was
trained on (`manifest_hash`). Aggregation compares a metrics file's identity with the cell the
workflow expects at that path; the engine compares a checkpoint's with its own cell before it
resumes from it (engine/checkpoints.load). docs/security.md lists what is checked where.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import yaml

from .io import FileTooLarge, NotRegularFile, fsync_dir, load_json, read_regular, short_hash, write_json_atomic
from .registry import ConfigError, show

if TYPE_CHECKING:  # the annotations only: jsonschema is imported where metrics are validated
    import jsonschema

#: The fields of an identity, in the order a mismatch is reported (the first differing one is named).
IDENTITY_FIELDS = ("experiment", "dataset", "partition", "partition_id", "method", "label", "seed", "cell_key", "manifest_hash")
#: What the workflow knows of a cell at parse time (the manifest is built later): what aggregation checks.
EXPECTED_FIELDS = ("experiment", "dataset", "partition", "label", "seed", "cell_key")
#: The schema id every metrics.json carries (the const of schemas/metrics.schema.yaml): the one place it is spelled.
METRICS_SCHEMA = "fedrepro.metrics/1"
#: metrics.json files larger than this are refused unread (a normal one is well below 1 MiB per
#: 1,000 clients; a t-SNE embedding adds about 60 bytes per sample).
METRICS_MAX_BYTES = 256 * 2**20


class ResultsError(ConfigError):
    """A results file that is damaged, foreign or of the wrong type: the message names the file,
    the field and what to do (printed by `fedrepro` as one line)."""


def manifest_hash(manifest: dict[str, Any]) -> str:
    """The identity of the shards a cell trains on: the manifest's own hash (`manifest_sha256`, the
    sha256 of every other field, shard checksums included; `fedrepro.data.shards.load_partition`
    has checked it), computed the same way for a manifest dict that lacks it."""
    from .data.shards import MANIFEST_HASH, manifest_hash as computed  # pyarrow: only where a manifest is at hand

    return manifest.get(MANIFEST_HASH) or computed(manifest)


def cell_identity(cell: dict[str, Any], manifest: dict[str, Any], cell_key: str | None = None) -> dict[str, Any]:
    """The identity an artifact of `cell` carries. `cell_key` defaults to the hash of `cell` itself;
    a tuned cell passes the hash of the cell as the workflow resolved it (before `--tuned`)."""
    return {k: cell[k] for k in IDENTITY_FIELDS[:7]} | {"cell_key": cell_key or short_hash(cell),
                                                        "manifest_hash": manifest_hash(manifest)}


def identity_mismatch(got: Any, expected: dict[str, Any], fields: Iterable[str] = IDENTITY_FIELDS) -> str | None:
    """'field X is A, expected B' for the first of `fields` where `got` differs from `expected`; None if none."""
    if not isinstance(got, dict):
        return f"has no identity (got {show(got)})"
    for k in fields:
        if k in expected and got.get(k) != expected[k]:
            return f"field '{k}' is {show(got.get(k))}, expected {show(expected[k])}"
    return None


# -- what the aggregate rule expects at each path ------------------------------------------------

def expected_token(cell: dict[str, Any]) -> str:
    """One command-line word naming what `fedrepro aggregate --expect` expects of `cell`'s metrics
    file: experiment/dataset/partition/label/seed/cell_key (names never contain '/')."""
    return "/".join(str(v) for v in (*(cell[k] for k in EXPECTED_FIELDS[:5]), short_hash(cell)))


def parse_token(token: str) -> dict[str, Any]:
    parts = token.split("/")
    if len(parts) != len(EXPECTED_FIELDS) or not parts[4].isdigit():
        raise ResultsError(f"--expect {show(token)}: allowed: experiment/dataset/partition/label/seed/cell_key")
    return dict(zip(EXPECTED_FIELDS, parts)) | {"seed": int(parts[4])}


# -- writing a metrics.json ----------------------------------------------------------------------

def write_metrics(path: str | os.PathLike, doc: dict[str, Any]) -> None:
    """Write the metrics record `doc` (engine.record.build_metrics, or a failed cell's) to `path`
    atomically. Not validated here (jsonschema stays out of the training job); the schema id is
    checked, so no writer can produce a file the reader refuses as foreign."""
    if doc.get("schema") != METRICS_SCHEMA:
        raise ValueError(f"{path}: a metrics record has schema {METRICS_SCHEMA!r}, not {doc.get('schema')!r}")
    write_json_atomic(path, doc)


# -- reading a metrics.json ----------------------------------------------------------------------

def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def read_bounded_json(path: str | os.PathLike, limit: int = METRICS_MAX_BYTES, what: str = "metrics file") -> Any:
    """JSON of a regular file of at most `limit` bytes, with finite numbers only. A symbolic link
    is followed only to a regular file inside the working directory (e.g. a DVC cache in the
    project). Anything else is a ResultsError naming the file and saying what to do."""
    path = Path(path)
    redo = "delete it and rerun the workflow (it retrains that cell)"
    if path.is_symlink():
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError) as exc:  # dangling, or a loop
            raise ResultsError(f"{path}: a symbolic link that leads nowhere ({exc}); allowed: a regular file") from None
        if not target.is_relative_to(Path.cwd().resolve()):
            raise ResultsError(f"{path}: a symbolic link to {target}, outside the working directory; allowed: "
                               f"a regular file (or a link to one inside {Path.cwd()})")
    try:
        data = read_regular(path, limit)
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such {what}; rerun the workflow to produce it") from None
    except NotRegularFile:
        raise ResultsError(f"{path}: not a regular file (a directory, device, FIFO or socket); allowed: a {what}") from None
    except FileTooLarge as exc:
        raise ResultsError(f"{path}: {exc.size} bytes, larger than the {limit} bytes a {what} may have; {redo}") from None
    except OSError as exc:
        raise ResultsError(f"{path}: cannot open the {what}: {exc.strerror}") from None
    try:
        return load_json(data.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise ResultsError(f"{path}: not UTF-8 text (byte {exc.start}); the {what} is damaged: {redo}") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                           f"the {what} is truncated or damaged: {redo}") from None
    except ValueError as exc:  # NaN, Infinity, 1e400
        raise ResultsError(f"{path}: {exc}; the {what} is damaged: {redo}") from None


@lru_cache(maxsize=1)
def _metrics_validator() -> jsonschema.protocols.Validator:
    import jsonschema  # here: only readers of metrics.json validate them, not the training job that writes one

    schema = yaml.safe_load(resources.files("fedrepro").joinpath("schemas/metrics.schema.yaml").read_text())
    # integers must be integers (JSON Schema's "integer" accepts 3.0)
    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, x: isinstance(x, int) and not isinstance(x, bool)))
    return cls(schema)


def _allowed(err: jsonschema.ValidationError) -> str:
    v, val = err.validator, err.validator_value
    if v == "type":
        return "type " + " or ".join([val] if isinstance(val, str) else val)
    return {"const": f"{val!r}", "enum": f"one of {val}", "minimum": f">= {val}", "required": f"the keys {', '.join(val)}",
            "maxLength": f"at most {val} characters", "pattern": f"matching {val}"}.get(v, f"{v} {show(val)}")


def validate_metrics(doc: Any, path: str | os.PathLike) -> None:
    """ResultsError naming the file and the first field whose value has the wrong type or range
    (schemas/metrics.schema.yaml: the fields the reports read)."""
    if not isinstance(doc, dict) or doc.get("schema") != METRICS_SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ResultsError(f"{path}: not a metrics file (schema {show(got)}); allowed: {METRICS_SCHEMA!r}")
    errors = sorted(_metrics_validator().iter_errors(doc), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        err = errors[0]
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        if err.validator == "required":
            missing = [k for k in err.validator_value if k not in err.instance]
            raise ResultsError(f"{path}: field '{where}' lacks the key(s) {', '.join(missing)}; not a complete metrics file")
        raise ResultsError(f"{path}: field '{where}' has value {show(err.instance)}; allowed: {_allowed(err)}")


def file_identity(doc: dict[str, Any], path: str | os.PathLike) -> dict[str, Any] | None:
    """The identity a (validated) metrics file records, checked against its own `cell` block;
    None for a file written before identities were recorded."""
    identity = doc.get("identity")
    if identity is None:
        return None
    for k in IDENTITY_FIELDS[:7]:
        if doc["cell"][k] != identity[k]:
            raise ResultsError(f"{path}: field 'cell.{k}' is {show(doc['cell'][k])} but 'identity.{k}' is "
                               f"{show(identity[k])}; the file was edited: delete it and rerun the workflow")
    return identity


def read_metrics(path: str | os.PathLike, expected: dict[str, Any] | None = None) -> dict[str, Any]:
    """A metrics.json read bounded, type-checked and, given `expected` (EXPECTED_FIELDS of the cell
    that belongs at `path`), checked to be that cell's. Returns the document."""
    doc = read_bounded_json(path)
    validate_metrics(doc, path)
    identity = file_identity(doc, path)
    if expected is not None:
        got = identity if identity is not None else doc["cell"]  # an older file: what its cell block says
        problem = identity_mismatch(got, expected, [k for k in EXPECTED_FIELDS if identity is not None or k != "cell_key"])
        if problem:
            raise ResultsError(f"{path}: {problem}: the file belongs to another cell (copied, moved or left from an "
                               "earlier configuration); delete it and rerun the workflow (it retrains that cell)")
    return doc


def check_unique(docs: list[dict[str, Any]], paths: list[str | os.PathLike]) -> None:
    """ResultsError when two files are the same cell, or files of several experiments are mixed."""
    seen: dict[tuple, Any] = {}
    experiments: dict[Any, Any] = {}
    for doc, path in zip(docs, paths):
        c = doc["cell"]
        experiments.setdefault(c["experiment"], path)
        if len(experiments) > 1:
            (e0, p0), (e1, p1) = list(experiments.items())[:2]
            raise ResultsError(f"{p1}: field 'experiment' is {show(e1)}, but {p0} is of experiment {show(e0)}; "
                               "allowed: the metrics files of one experiment")
        key = (c["dataset"], c["partition"], c["label"], c["seed"])
        if key in seen:
            raise ResultsError(f"{path}: field 'seed' ({c['seed']}) repeats the cell {'/'.join(map(str, key))} of "
                               f"{seen[key]}; one of them was copied: delete it and rerun the workflow")
        seen[key] = path


def warn_unchecked(paths: list[str | os.PathLike]) -> None:
    if paths:
        print(f"[fedrepro] warning: {len(paths)} metrics file(s) were written before cells recorded their identity "
              f"(e.g. {paths[0]}): their cell hash is not checked; delete them and rerun to record it", file=sys.stderr)


# -- moving a rejected file aside -----------------------------------------------------------------

def set_aside(path: Path, why: str) -> Path:
    """Rename `path` (file or directory) to `<name>.rejected-<UTC time>` beside it and return the new
    path, so it neither blocks the run nor is lost; `why` is only for the error if that fails."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = path.with_name(f"{path.name}.rejected-{stamp}")
    n = 1
    while os.path.lexists(dest):
        n += 1
        dest = path.with_name(f"{path.name}.rejected-{stamp}-{n}")
    try:
        os.replace(path, dest)
    except OSError as exc:
        # no advice to delete it: the path may name a file that is not fedrepro's (a mistaken --checkpoint)
        raise ResultsError(f"{path}: {why}, and it cannot be moved aside ({exc.strerror}): it was left as it is and not "
                           f"used; allowed: a path in a folder where fedrepro may rename files") from None
    fsync_dir(path.parent)
    return dest
