"""Verification by recomputation (issue 46).

Training is deterministic, so a recorded result can be checked by computing it again:

* `fedrepro verify results/<exp>` retrains chosen cells from the resolved cell their
  provenance.json records, through `fedrepro train`'s own entry point (cli.cmd_train), with the
  thread count and device provenance.json records, on the experiment's shards, into a scratch
  folder; then compares every field of the new metrics.json with the recorded one, except those
  a second run cannot reproduce (`UNCOMPARED`: times and the process's memory).
* `fedrepro aggregate` recomputes each cell's summary statistics from the per-client scores
  beside them (`check_summaries`) and refuses a file whose summary contradicts them.

What each catches and what it cannot: docs/security.md#verification-by-recomputation. Nothing
here imports torch at module level: `fedrepro aggregate` imports this module.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import random
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from . import kernels
from .custody import ResultsError, read_bounded_json, read_metrics
from .metrics import beyond_weights, summarize
from .registry import ConfigError, show

# -- aggregate: summaries against their per-client scores -----------------------------------------

#: How closely a recorded summary statistic must equal the one recomputed from its per-client
#: scores: both are numpy's float64 arithmetic on the same list, so they agree to the last bit on
#: one machine; the tolerance only absorbs another numpy's summation order (SIMD) on another one.
#: Absolute for values near 0 (the std of equal scores).
SUMMARY_REL_TOL = SUMMARY_ABS_TOL = 1e-12
_ABSENT = object()  # a key a document lacks


def _same_stat(recorded: Any, recomputed: float) -> bool:
    if recorded is _ABSENT:
        return False
    if math.isnan(recomputed):
        return recorded is None
    return isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and math.isclose(
        recorded, recomputed, rel_tol=SUMMARY_REL_TOL, abs_tol=SUMMARY_ABS_TOL)


#: The clients field that weighs each unseen-client score (engine/record.build_metrics).
UNSEEN_WEIGHTS = {"unseen": "unseen_test_size", "unseen_all": "unseen_size"}

_REDO = "the file was edited or damaged: delete it and rerun the workflow (it retrains that cell)"


def _summary_checks(doc: dict, path: str | os.PathLike) -> Iterator[tuple[str, str, list, list, str]]:
    """(summary field, per-client field, its scores, their weights, what the weights are) of every
    summary entry of `doc` that its per-client scores determine, as engine/record.build_metrics
    computes them: final -> summary weighted by clients.test_size, final_val -> summary_val by
    clients.val_size, a score after training ('<where>_<kind>') by metrics.beyond_weights. Not
    recomputable, so not checked: '<kind>_types' (the clients' types are not recorded) and best_val
    (that round's per-client scores are not recorded)."""
    clients = doc.get("clients") or {}
    for final_key, summary_key, sizes in (("final", "summary", "test_size"), ("final_val", "summary_val", "val_size")):
        final = doc.get(final_key) or {}
        for key in doc.get(summary_key) or {}:
            if key.endswith("_types"):
                continue
            kind, _, metric = key.rpartition("_")
            scores = (final.get(kind) or {}).get(metric)
            where = f"{final_key}.{kind}.{metric}"
            if not isinstance(scores, list):
                raise ResultsError(f"{path}: field '{summary_key}.{key}' has no per-client scores ('{where}') it "
                                   f"summarises; {_REDO}")
            place = kind.rpartition("_")[0]  # '' for global/personal (the clients' own splits), else unseen, union, ...
            if place and place not in UNSEEN_WEIGHTS:
                yield f"{summary_key}.{key}", where, scores, beyond_weights(place, len(scores), []), "equally"
                continue
            weights_key = UNSEEN_WEIGHTS[place] if place else sizes
            weights = clients.get(weights_key)
            if not isinstance(weights, list) or len(weights) != len(scores):
                raise ResultsError(f"{path}: field '{where}' has {len(scores)} score(s) but 'clients.{weights_key}' "
                                   f"{f'has {len(weights)}' if isinstance(weights, list) else 'is missing'}; {_REDO}")
            yield f"{summary_key}.{key}", where, scores, weights, f"clients.{weights_key}"


def check_summaries(doc: dict, path: str | os.PathLike) -> None:
    """ResultsError, one line naming `path` and the field, where a summary statistic of the metrics
    document `doc` (read_metrics: schema-checked) is not what its per-client scores give."""
    if doc.get("status") != "ok":
        return
    for field_name, where, scores, weights, weighted in _summary_checks(doc, path):
        summary, key = field_name.split(".")
        stats = doc[summary][key]
        for stat, value in summarize(scores, weights).items():
            if not _same_stat(stats.get(stat, _ABSENT), value):
                got = "absent" if stat not in stats else show(stats[stat])
                give = "null (no client scored)" if math.isnan(value) else repr(value)
                raise ResultsError(f"{path}: field '{field_name}.{stat}' is {got}, but the per-client scores it "
                                   f"summarises ('{where}', weighted {'by ' if weighted != 'equally' else ''}{weighted}) "
                                   f"give {give} (allowed: within {SUMMARY_REL_TOL:g} relative); {_REDO}")


# -- verify: recompute cells and compare ---------------------------------------------------------

#: metrics.json fields a second run does not reproduce, never compared: how long the job took,
#: how much memory its process held (it depends on what else the process did), and whether it
#: resumed from a checkpoint (resuming is exact by design; verify always trains from round 0).
UNCOMPARED = frozenset({"resources.wall_time_s", "resources.train_time_s", "resources.eval_time_s",
                        "resources.personal_eval_time_s", "resources.peak_rss_mb", "resources.peak_gpu_mb",
                        "resources.resumed_from_round"})
#: On CUDA, numbers are compared within this relative tolerance (tests/test_cuda.py's TOL: float32
#: kernels of another GPU or library version differ in summation order; docs/gpu.md).
CUDA_REL_TOL = 1e-4
#: Mismatches printed per cell (the verdict counts them all).
MAX_LINES_PER_CELL = 20


class Items(int):
    """A list's length, where the recorded and recomputed lists differ in it."""

    def __repr__(self) -> str:
        return f"{int(self)} item(s)"


def _show_value(v: Any) -> str:
    if v is _ABSENT or isinstance(v, Items):
        return "absent" if v is _ABSENT else repr(v)
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def diff(recorded: Any, recomputed: Any, rel_tol: float = 0.0, path: str = "") -> Iterator[tuple[str, Any, Any, bool]]:
    """(field path, recorded, recomputed, within_tolerance) of every leaf where the two documents
    differ, except UNCOMPARED fields; `within_tolerance`: unequal, but floats within `rel_tol`
    (which then do not count as differences). Lists of different lengths are one entry, their
    lengths (`Items`) in place of the values. The identity and the cell block come first: where
    they differ, the recomputed cell is not the recorded one, which explains the rest."""
    if path in UNCOMPARED:
        return
    if isinstance(recorded, dict) and isinstance(recomputed, dict):
        keys = [*recorded, *(k for k in recomputed if k not in recorded)]
        if not path:
            keys.sort(key=lambda k: k not in ("identity", "cell"))
        for key in keys:
            yield from diff(recorded.get(key, _ABSENT), recomputed.get(key, _ABSENT), rel_tol, f"{path}.{key}" if path else key)
    elif isinstance(recorded, list) and isinstance(recomputed, list):
        if len(recorded) != len(recomputed):
            yield path, Items(len(recorded)), Items(len(recomputed)), False
            return
        for i, (a, b) in enumerate(zip(recorded, recomputed)):
            yield from diff(a, b, rel_tol, f"{path}[{i}]")
    elif path == "resources.device" and isinstance(recorded, str) and isinstance(recomputed, str):
        if recorded.split(":")[0] != recomputed.split(":")[0]:  # cuda:1 there is cuda:0 here
            yield path, recorded, recomputed, False
    elif _is_number(recorded) and _is_number(recomputed):
        if recorded != recomputed:
            close = (rel_tol > 0 and isinstance(recorded, float) and isinstance(recomputed, float)
                     and math.isclose(recorded, recomputed, rel_tol=rel_tol, abs_tol=1e-12))
            yield path, recorded, recomputed, close
    elif recorded != recomputed or isinstance(recorded, bool) != isinstance(recomputed, bool):
        yield path, recorded, recomputed, False


@dataclass
class Verdict:
    cell: str
    state: str  # "exact", "differs", "cannot", "refused"
    text: str
    lines: list[str] = field(default_factory=list)


def find_cells(results: Path) -> list[Path]:
    """The run folders of `results` (results/<exp>) that hold a metrics.json, sorted."""
    runs = results / "runs"
    return sorted(p.parent for p in runs.glob("*/*/*/seed*/metrics.json")) if runs.is_dir() else []


def choose(results: Path, globs: list[str] | None, sample: int | None, seed: int) -> list[Path]:
    """The run folders to verify: all, or those matching one of `globs` (dataset/partition/label/seed<k>,
    fnmatch), then `sample` of them drawn with random.Random(seed)."""
    runs = find_cells(results)
    if not runs:
        raise ConfigError(f"{results}: no trained cells (no runs/<dataset>/<partition>/<label>/seed<k>/metrics.json); "
                          "allowed: the results folder of an experiment, results/<experiment>")
    names = {run: cell_name(results, run) for run in runs}
    if globs:
        for pattern in globs:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names.values()):
                raise ConfigError(f"argument --cells: {pattern!r} matches none of the {len(runs)} cell(s) of {results} "
                                  f"(e.g. {', '.join(list(names.values())[:3])}); allowed: dataset/partition/label/seed<k> "
                                  "patterns, * and ? as in the shell")
        runs = [run for run in runs if any(fnmatch.fnmatchcase(names[run], p) for p in globs)]
    if sample is not None and sample < len(runs):
        runs = sorted(random.Random(seed).sample(runs, sample))
    return runs


def cell_name(results: Path, run: Path) -> str:
    return run.relative_to(results / "runs").as_posix()


@contextlib.contextmanager
def _isolated_training() -> Iterator[None]:
    """A retraining that touches no live run: the workflow's status and TensorBoard folders
    (set in the environment of a workflow job) are not written, and torch's thread count is put back."""
    import torch

    from .progress import STATUS_DIR_ENV
    from .tracking import TENSORBOARD_DIR_ENV

    saved_env = {k: os.environ.pop(k) for k in (STATUS_DIR_ENV, TENSORBOARD_DIR_ENV) if k in os.environ}
    saved_threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        os.environ.update(saved_env)


#: The most torch threads verify starts per usable core of this machine. A cell's numbers depend on its
#: thread count, so the recorded one is taken: more threads than cores compute the same numbers, only
#: slower, but far more make no progress at all (num_threads: 100000 made none in 90 s, issue 57).
THREADS_PER_CORE_MAX = 4


def _settings(provenance: dict, path: Path) -> tuple[str, int]:
    """(device, threads) of the recorded run (`path`: its provenance.json), or ConfigError saying why
    this machine cannot redo it."""
    import torch

    from .local_plan import usable_cores

    device = (provenance.get("device") or {}).get("type")
    threads = (provenance.get("torch") or {}).get("num_threads")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"provenance.json records the device {show(device)}; verify recomputes cpu and cuda cells")
    if not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        raise ConfigError("provenance.json records no torch thread count (torch.num_threads), on which a cell's numbers "
                          "depend (written by an older fedrepro)")
    cores = usable_cores()
    if threads > THREADS_PER_CORE_MAX * cores:
        raise ConfigError(f"{path}: field 'torch.num_threads' has value {show(threads)}; allowed: at most "
                          f"{THREADS_PER_CORE_MAX * cores} ({THREADS_PER_CORE_MAX} per core of the {cores} core(s) usable "
                          "here): a cell's numbers depend on its thread count, verify it on a machine with more cores")
    if device == "cuda" and not torch.cuda.is_available():
        name = (provenance.get("device") or {}).get("name")
        raise ConfigError(f"recorded on CUDA ({name}), and no CUDA GPU is visible here")
    return device, threads


def _shards(results: Path, cell: dict, identity: dict | None) -> tuple[Path, dict]:
    """The experiment's partition folder of `cell` (the train rule's input: results/shards/<dataset>/<id>
    beside results/<exp>), checked to be the one the cell was trained on, and its manifest; ConfigError if not."""
    from .custody import manifest_hash
    from .data.shards import read_manifest

    shards = results.parent / "shards" / str(cell["dataset"]) / str(cell["partition_id"])
    if not (shards / "manifest.json").is_file():
        raise ConfigError(f"its shards {shards} are missing (make them with the workflow: snakemake --cores 1 {shards} "
                          "--configfile <the experiment's config>)")
    manifest = read_manifest(shards)
    recorded = (identity or {}).get("manifest_hash")
    if recorded is not None and manifest_hash(manifest) != recorded:
        raise ConfigError(f"the shards at {shards} are not those it was trained on (their manifest hash differs from "
                          f"identity.manifest_hash {recorded})")
    return shards, manifest


# -- verify: the recorded cell is this folder's, and within a config's bounds (issue 57) ---------------

class Refused(ResultsError):
    """A record verify does not retrain: its cell is not the one of the folder it sits in, or asks for
    more than a config may (the message names the file, the field, the value and what is allowed)."""


def _as_field(exc: ConfigError, path: Path) -> Refused:
    """A config check's refusal ("config key 'cell.training.rounds' ...") as one of the record at `path`."""
    return Refused(f"{path}: {str(exc).replace('config key ', 'field ', 1)}")


def check_belongs(results: Path, run: Path, cell: dict, recorded: dict, provenance: dict) -> None:
    """Refused unless the cell provenance.json records is the one of its folder
    results/<experiment>/runs/<dataset>/<partition>/<label>/seed<n> (the names below runs/ are checked
    by the caller): the experiment is the results folder's, metrics.json and provenance.json carry
    the same identity, that of the cell, and (untuned) the cell hashes to the identity's cell_key."""
    from .custody import IDENTITY_FIELDS, identity_mismatch
    from .io import short_hash

    prov, metrics = run / "provenance.json", run / "metrics.json"
    experiment = results.resolve().name
    if cell.get("experiment") != experiment:
        raise Refused(f"{prov}: field 'cell.experiment' has value {show(cell.get('experiment'))}; allowed: "
                      f"{experiment!r}, the experiment of the results folder {results} it sits in (a cell folder "
                      "copied from another experiment's results is verified in that experiment's folder)")
    own = {k: cell.get(k) for k in IDENTITY_FIELDS[:7]}  # experiment, dataset, partition, partition_id, method, label, seed
    identities = {metrics: recorded.get("identity"), prov: provenance.get("identity")}
    for path, identity in identities.items():
        if not isinstance(identity, dict):
            raise Refused(f"{path}: field 'identity' has value {show(identity)}; allowed: the identity `fedrepro train` "
                          f"records ({', '.join(IDENTITY_FIELDS)})")
        why = identity_mismatch(identity, own)
        if why:
            raise Refused(f"{path}: identity {why} (the cell provenance.json records); allowed: the identity of the "
                          "cell trained in this folder")
    why = identity_mismatch(identities[prov], identities[metrics])
    if why:
        raise Refused(f"{prov}: identity {why} (metrics.json's beside it); allowed: the identity of metrics.json: both "
                      "files of one training")
    key = identities[metrics].get("cell_key")
    if not isinstance(cell.get("tuned"), dict) and short_hash(cell) != key:  # (a tuned cell's key is its cell's before the selection)
        raise Refused(f"{prov}: field 'cell' hashes to {short_hash(cell)!r}, not to its identity.cell_key {show(key)} "
                      "(metrics.json's too): the cell was edited after training; allowed: the cell as `fedrepro train` "
                      "recorded it")


def config_cell(exp: dict, folder: str, run: Path, recorded: dict) -> dict:
    """The cell of the experiment config `exp` (resolved) at `folder` (dataset/partition/label/seed<n>),
    refused unless it is the one trained there: it hashes to metrics.json's identity.cell_key."""
    from .io import short_hash

    cells = {f"{c['dataset']}/{c['partition']}/{c['label']}/seed{c['seed']}": c for c in exp["cells"]}
    cell = cells.get(folder)
    if cell is None:
        raise Refused(f"{run}: experiment '{exp['experiment']}' of --config has no cell {folder} ({len(cells)} cell(s)); "
                      "allowed: a folder of a cell of the config (`fedrepro cells CONFIG`)")
    key, want = (recorded.get("identity") or {}).get("cell_key"), short_hash(cell)
    if key != want:
        raise Refused(f"{run / 'metrics.json'}: field 'identity.cell_key' has value {show(key)}, but the config's cell at "
                      f"this folder hashes to {want!r} (the cell was trained with other settings than --config gives); "
                      f"allowed: {want!r}: the config files and --set items of the run")
    return cell


def check_recorded_cell(cell: dict, manifest: dict, path: Path) -> None:
    """Refused (naming `path`, provenance.json, and the field) unless `cell` is within the schema and the
    bounds a config's cell is held to (fedrepro.config.check_resolved_cell: names, the training block,
    the evaluation rule, the method's hyper-parameters and its own checks, the model's parameters against
    the partition's samples); `manifest`: the partition the cell trains on (its resolved spec)."""
    from .cli_args import CELL_KEYS
    from .config import check_resolved_cell

    missing = [k for k in CELL_KEYS if k not in cell]
    if missing:
        raise Refused(f"{path}: field 'cell' lacks key(s) {missing}; allowed: a resolved cell with keys {', '.join(CELL_KEYS)}")
    try:
        check_resolved_cell(cell, manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {})
    except ConfigError as exc:
        raise _as_field(exc, path) from None


def _selection(cell: dict, tuned: Any, tmp: Path) -> tuple[dict, list[str]]:
    """A tuned cell (`tuned`: the `tuned` block provenance.json records, the selected trial and values) as
    `fedrepro train` takes it: the cell as the workflow resolved it (tuned: true) and a select record
    with that winner."""
    if not isinstance(tuned, dict):
        return cell, []
    winner = {"id": tuned.get("trial"), "values": tuned.get("values") or {}}
    record = {k: cell[k] for k in ("dataset", "partition", "label")} | {"winner": winner}
    if "select" in tuned:
        record |= {"select": tuned["select"], "winners_by_seed": {f"seed{cell['seed']}": winner}}
    path = tmp / "selection.json"
    path.write_text(json.dumps(record))
    return cell | {"tuned": True}, ["--tuned", str(path)]


#: runs `fedrepro <argv>` in this process: cli hands verify its own entry point, so a cell is retrained
#: exactly as `fedrepro train` trains it (and this module does not import the cli back)
Train = Callable[[list[str]], None]

_PARTITION_ID = re.compile(r"[0-9a-f]{1,64}")


def _trained_cell(cell: dict, exp: dict | None, folder: str, run: Path, recorded: dict) -> tuple[dict, dict]:
    """(the cell to train, with a tuned cell's recorded selection still to apply; the cell as it trains,
    the selection applied: what the bounds are checked on). With the experiment's config (`exp`), the
    config's cell at `folder`, refused unless it is the one trained there; else the recorded `cell`."""
    from .tuning import apply_values

    source = config_cell(exp, folder, run, recorded) if exp is not None else cell
    tuned = cell.get("tuned")
    if not isinstance(tuned, dict):
        return source, source
    values = tuned.get("values")
    if not isinstance(values, dict):
        raise Refused(f"{run / 'provenance.json'}: field 'cell.tuned.values' has value {show(values)}; allowed: the "
                      "mapping of selected values the select rule records")
    return source, apply_values({k: v for k, v in source.items() if k != "tuned"}, values) | {"tuned": tuned}


def _retrain(results: Path, folder: str, recorded: dict, provenance: dict, train: Train,
             exp: dict | None = None) -> tuple[dict, str]:
    """The recomputed metrics of the cell `provenance` records (that of runs/<folder>) and the device
    they were computed on; Refused where the record is not this folder's cell or beyond a config's
    bounds, ConfigError (and the engine's data errors) where it cannot be recomputed here; all of it
    before any training. `exp`: the experiment's config, resolved, whose cell is then trained. A
    fine-tuning row scored from its base's final model (provenance `derived_from`) is trained in
    full: the scoring writes what that training writes (engine/finetune.py)."""

    cell = provenance.get("cell")
    if not isinstance(cell, dict):
        raise ConfigError("provenance.json records no resolved cell")
    names = [cell.get(k) for k in ("dataset", "partition", "label", "seed")]
    if "/".join(map(str, names[:3])) + f"/seed{names[3]}" != folder:  # also keeps the shards' path inside results/
        raise ConfigError(f"provenance.json records the cell {show(names)}, not this folder's")
    if not _PARTITION_ID.fullmatch(str(cell.get("partition_id"))):
        raise ConfigError(f"provenance.json records the partition id {show(cell.get('partition_id'))}; allowed: hex digits")
    if "finetune" in cell:
        raise ConfigError(f"a fine-tuning row, scored from the final model of label {show(cell['finetune'])} by "
                          "`fedrepro finetune`, not trained; verify that label's cell")
    run = results / "runs" / folder
    check_belongs(results, run, cell, recorded, provenance)
    device, threads = _settings(provenance, run / "provenance.json")
    shards, manifest = _shards(results, cell, recorded.get("identity"))
    source, trained = _trained_cell(cell, exp, folder, run, recorded)
    check_recorded_cell(trained, manifest, run / "provenance.json")
    with tempfile.TemporaryDirectory(prefix="fedrepro-verify-") as tmp, _isolated_training():
        cell, tuned = _selection(source, cell.get("tuned"), Path(tmp))
        out = Path(tmp) / "run"
        train(["train", "--cell", json.dumps(cell), "--shards", str(shards), "--out-dir", str(out), "--device", device,
               "--threads", str(threads), *tuned])
        return read_metrics(out / "metrics.json"), device


def verify_cell(results: Path, run: Path, train: Train, exp: dict | None = None) -> Verdict:
    from .data.base import DataMissingError
    from .data.shards import ShardChecksumError

    name = cell_name(results, run)
    try:
        recorded = read_metrics(run / "metrics.json")
        provenance = read_bounded_json(run / "provenance.json", what="provenance file")
        if not isinstance(provenance, dict):
            raise ResultsError(f"{run / 'provenance.json'}: not a JSON object; allowed: the provenance.json fedrepro writes")
        recomputed, device = _retrain(results, name, recorded, provenance, train, exp)
    except ResultsError as exc:  # a record edited, damaged or not this folder's (Refused): not a limit of this machine
        return Verdict(name, "refused", f"refused: {exc}")
    except (ConfigError, DataMissingError, ShardChecksumError, FileNotFoundError) as exc:
        return Verdict(name, "cannot", f"cannot reproduce here: {exc}")
    found = list(diff(recorded, recomputed, CUDA_REL_TOL if device == "cuda" else 0.0))
    notes = []
    if isinstance(provenance["cell"].get("tuned"), dict):  # provenance.json keeps the cell after the selection
        found = [d for d in found if d[0] != "identity.cell_key"]
        notes.append("identity.cell_key not recomputed: a tuned cell's key is the hash of its cell before the selection")
    if "derived_from" in provenance:
        found = [d for d in found if d[0] != "resources.finetuned_from"]
        notes.append("a fine-tuning row scored from its base cell's final model: recomputed by training it in full")
    level = kernels.difference(kernels.capability(provenance), kernels.in_force()["capability"])
    if level:  # a different CPU kernel level, not a wrong number, may explain a difference (fedrepro/kernels.py)
        notes.append(level)
    close = [d for d in found if d[3]]
    differs = [d for d in found if not d[3]]
    lines = [f"{name}: {path}: recorded {_show_value(a)}, recomputed {_show_value(b)}" for path, a, b, _ in differs]
    if len(lines) > MAX_LINES_PER_CELL:
        lines = lines[:MAX_LINES_PER_CELL] + [f"{name}: ... and {len(lines) - MAX_LINES_PER_CELL} more field(s)"]
    if device == "cuda":
        notes.append(f"on CUDA: numbers compared within {CUDA_REL_TOL:g} relative (tests/test_cuda.py)"
                     + (f", {len(close)} field(s) within it but not bit-identical" if close else ""))
    note = f" ({'; '.join(notes)})" if notes else ""
    if differs:
        return Verdict(name, "differs", f"differs in {len(differs)} field(s){note}", lines)
    return Verdict(name, "exact", f"exact{note}")


def check_experiment(results: Path, exp: dict, configs: list[str]) -> None:
    """ConfigError (a usage error) unless the config given to verify is that of the results folder."""
    if exp["experiment"] != results.resolve().name:
        raise ConfigError(f"argument --config: {' + '.join(configs)} is experiment {exp['experiment']!r}; allowed: the "
                          f"config of the results folder {results}, experiment {results.resolve().name!r}")


def verify(results: str | os.PathLike, train: Train, globs: list[str] | None = None, sample: int | None = None,
           seed: int = 0, exp: dict | None = None) -> int:
    """Recompute and compare the chosen cells of `results`; print each mismatch and one verdict line
    per cell, then a total. `exp`: the experiment's config (resolved), whose cells are then trained.
    Returns the exit status: 0 every chosen cell exact, 1 some cell differs or is refused (its record
    is not its folder's cell, or beyond a config's bounds), 3 none of that but some could not be
    recomputed here."""
    results = Path(results)
    runs = choose(results, globs, sample, seed)
    verdicts = []
    for i, run in enumerate(runs, 1):
        print(f"[fedrepro] verify: recomputing {cell_name(results, run)} ({i}/{len(runs)})", file=sys.stderr)
        v = verify_cell(results, run, train, exp)
        for line in v.lines:
            print(line)
        print(f"{v.cell}: {v.text}", flush=True)
        verdicts.append(v)
    counts = {state: sum(v.state == state for v in verdicts) for state in ("exact", "differs", "cannot", "refused")}
    refused = f", {counts['refused']} refused" if counts["refused"] else ""
    print(f"{results}: {counts['exact']} of {len(verdicts)} cell(s) exact, {counts['differs']} differ, "
          f"{counts['cannot']} cannot be reproduced here{refused}")
    return 1 if counts["differs"] or counts["refused"] else 3 if counts["cannot"] else 0
