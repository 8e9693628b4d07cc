"""What a cell costs before it runs: its work counted from the resolved config, timed by a calibration.

A training cell's work (docs/cost.md):

* training: over the rounds, for every client the sampling schedule draws (the cell's own schedule,
  engine.sampling), its local steps, ceil(train samples / batch size) x local epochs, times the
  method's declared work per step (`Method.cost_passes_for`: whole-model steps and head steps);
* evaluation: at every evaluated round (every `eval_every`, and the last) a forward pass over every
  client's test (and validation) split for each column the method scores, and at the rounds whose
  personalized column is scored the method's personalization (`Method.cost_personal_for`: fine-tuning
  epochs of the whole model, or of the head on the client's frozen features);
* a fixed start-up (the calibration's: a fresh interpreter importing the engine).

A derived fine-tuning row (a "+FT" row scored from its base cell's final model) costs the start-up and
its last round's scoring only. The clients' split sizes are the partition manifest's where the shards
exist (results/shards/<dataset>/<partition id>), else an estimate: the dataset's known sample count
(`sample_bounds`) over the clients, split by the partition's fractions. Seconds = whole-model steps x
the calibrated seconds of a training step at the cell's batch size + head steps x seconds of a head
step + forwarded samples x seconds per sample of a forward + start-up (fedrepro.calibration).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .calibration import CALIBRATION_DIR, ModelSpec, model_spec

#: The shards' folder, relative to the working directory (planning.WorkflowPlan.shard_dir's).
SHARDS_ROOT = Path("results") / "shards"
#: Above this many (clients x rounds) the sampling schedule is not drawn: the expected participation
#: stands in (the same mean; drawing 10,000 rounds of 100,000 clients would take minutes).
EXACT_SCHEDULE_LIMIT = 2_000_000


@dataclass(frozen=True)
class Sizes:
    """The training clients' (train, test, val) sample counts, and where they come from."""

    clients: tuple[tuple[int, int, int], ...]
    source: str  # "manifest" or "estimate"


@dataclass(frozen=True)
class Work:
    """A job's work in calibrated units: whole-model training steps at the cell's batch size, head
    steps, and samples through a forward pass without gradient."""

    spec: ModelSpec
    train_steps: float
    head_steps: float
    forward_samples: float
    derived: bool = False

    def seconds(self, calibration: dict[str, Any]) -> float | None:
        """Seconds under `calibration` (a cached file, fedrepro.calibration), None if it lacks the model."""
        entry = calibration["models"].get(self.spec.key)
        if entry is None:
            return None
        return (calibration.get("startup_s") or 0.0) + self.train_steps * entry["train_step_s"] + \
            self.head_steps * entry["head_step_s"] + self.forward_samples * entry["forward_sample_s"]


# -- split sizes --------------------------------------------------------------------------------------

def manifest_sizes(shard_dir: str | os.PathLike) -> Sizes | None:
    """The training clients' split sizes from a partition's manifest, None where it is not there or
    cannot be used (a damaged one is the training job's to refuse, with its reason; the estimate stands in)."""
    from .data.shards import ShardChecksumError, read_manifest

    if not (Path(shard_dir) / "manifest.json").is_file():
        return None
    try:
        manifest = read_manifest(shard_dir)
    except (OSError, ValueError, ShardChecksumError):
        return None
    return Sizes(tuple((int(c["sizes"]["train"]), int(c["sizes"]["test"]), int(c["sizes"].get("val", 0)))
                       for c in manifest["clients"] if not c.get("unseen")), "manifest")


def estimated_sizes(spec: dict[str, Any]) -> Sizes | None:
    """Equal clients from the dataset's known sample count (the pooled one, or the official train set
    with pool: false) over num_clients, or a partitioner's fixed `partition_size`; None where the
    dataset's size is not known before it is read."""
    from .data.datasets import sample_bounds

    bounds = sample_bounds(spec["dataset"], spec.get("dataset_params") or {})
    params = spec.get("params") or {}
    fixed = params.get("partition_size") if params.get("sampler", "plato") == "plato" else None  # dirichlet's 'split' ignores it
    if bounds is None and not fixed:
        return None
    per_client = fixed or (bounds[1] if spec["pool"] else bounds[0]) / spec["num_clients"]
    split = spec["split"]
    test, val = per_client * split["test_fraction"], per_client * split["val_fraction"]
    one = (round(per_client - test - val), round(test), round(val))
    return Sizes((one,) * (spec["num_clients"] - spec["unseen_clients"]), "estimate")


# -- work ---------------------------------------------------------------------------------------------

def local_steps(n: int, batch_size: int, epochs: float, drop_last: bool = False) -> float:
    """Steps of `epochs` epochs over `n` samples (the last batch partial unless drop_last)."""
    per_epoch = n // batch_size if drop_last and n >= batch_size else math.ceil(n / batch_size)
    return epochs * per_epoch


def _sampled(n: int, participation: float | int) -> int:
    m = participation if isinstance(participation, int) else max(1, int(round(participation * n)))
    return min(m, n)


@functools.lru_cache(maxsize=1024)
def participations(n: int, sampled: int, rounds: int, seed: int) -> tuple[float, ...]:
    """How many rounds each of `n` clients trains in when `sampled` of them train a round: counted from
    the cell's sampling schedule (the same for every method of a partition and seed, so drawn once), or
    the expectation where drawing it would be slow. (A count, not the participation: 1 and 1.0 differ
    there but hash alike.)"""
    from .engine.sampling import sampling_schedule

    if n * rounds > EXACT_SCHEDULE_LIMIT:
        return (rounds * sampled / n,) * n
    counts = [0] * n
    for chosen in sampling_schedule(n, sampled, rounds, seed):
        for i in chosen:
            counts[i] += 1
    return tuple(counts)


def _method_class(cell: dict[str, Any]):
    from .engine.finetune import finetune_class
    from .methods import METHODS

    return finetune_class(cell) if "finetune" in cell else METHODS.get(cell["method"])


def _carved(sizes: Sizes, cell: dict[str, Any]) -> list[tuple[int, int, int]]:
    """The sizes as the cell's job sees them: a tuning trial carves its validation from train."""
    f = (cell.get("validation") or {}).get("from_train")
    if not f:
        return list(sizes.clients)
    return [(train - round(train * f), test, round(train * f)) for train, test, _ in sizes.clients]


def cell_work(cell: dict[str, Any], sizes: Sizes, datasets: dict[str, dict], derived: bool = False) -> Work:
    """The work of one job: `cell` (resolved) on clients of `sizes`; `derived`: a fine-tuning row
    scored from its base cell's final model (only its last round's scoring)."""
    t, cls, hp = cell["training"], _method_class(cell), cell["hparams"]
    clients = _carved(sizes, cell)
    bs, epochs, drop = t["batch_size"], t["local_epochs"], t["drop_last"]
    rounds = t["rounds"]
    steps = [local_steps(train, bs, epochs, drop) for train, _, _ in clients]
    counts = participations(len(clients), _sampled(len(clients), t["participation"]), rounds, int(cell["seed"]))
    trained = 0.0 if derived else sum(k * s for k, s in zip(counts, steps))
    passes = cls.cost_passes_for(hp, t)
    evaluated = [r for r in range(1, rounds + 1) if r % t["eval_every"] == 0 or r == rounds]
    personal = [r for r in evaluated if r % (t.get("personal_eval_every") or 1) == 0 or r == rounds]
    if derived:
        evaluated, personal = [rounds], [rounds]
    scored = sum(test + val for _, test, val in clients)
    forward = scored * (len(evaluated) * cls.has_global + len(personal) * cls.has_personal)
    model_steps, head_steps = trained * passes.model, trained * passes.head
    if cls.has_personal and personal:
        work = cls.cost_personal_for(hp, t)
        for train, _, _ in clients:
            model_steps += len(personal) * local_steps(train, bs, work.train_epochs, drop)
            if work.head_epochs:
                forward += len(personal) * train  # the frozen features, once per personalization
                head_steps += len(personal) * local_steps(train, work.head_batch_size, work.head_epochs)
    if "union" in t.get("global_test", []) + (cell.get("validation") or {}).get("global_test", []):
        forward += sum(test for _, test, _ in clients)
    return Work(model_spec(cell, datasets), model_steps, head_steps, forward, derived)


# -- an experiment's jobs -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One training, fine-tuning or tuning job of an experiment, and its work (None: sizes unknown)."""

    name: str
    cell: dict[str, Any]
    work: Work | None


class Estimator:
    """The work of an experiment's jobs, each partition's sizes read (or estimated) once."""

    def __init__(self, exp: dict[str, Any], shards_root: str | os.PathLike = SHARDS_ROOT):
        from .engine.finetune import derived_bases

        self.exp = exp
        self.shards_root = Path(shards_root)
        self.specs = {(p["dataset"], p["label"]): p for p in exp["partitions"]}
        self.derived = set(derived_bases(exp["cells"]))  # fine-tuning rows scored from their base cell's final model
        self._sizes: dict[tuple[str, str], Sizes | None] = {}

    def sizes(self, dataset: str, partition: str) -> Sizes | None:
        key = (dataset, partition)
        if key not in self._sizes:
            part = self.specs[key]
            self._sizes[key] = manifest_sizes(self.shards_root / dataset / part["id"]) or estimated_sizes(part["spec"])
        return self._sizes[key]

    def work(self, cell: dict[str, Any]) -> Work | None:
        sizes = self.sizes(cell["dataset"], cell["partition"])
        derived = "trial" not in cell and (cell["dataset"], cell["partition"], cell["label"], str(cell["seed"])) in self.derived
        return None if sizes is None else cell_work(cell, sizes, self.exp["datasets"], derived)

    def jobs(self) -> list[Job]:
        """The experiment's training jobs: its cells (derived rows included) and its tuning trials."""
        out = [Job(job_name(c), c, self.work(c)) for c in self.exp["cells"]]
        out += [Job(job_name(c), c, self.work(c)) for c in self.exp["tuning_cells"]]
        return out


def job_name(cell: dict[str, Any]) -> str:
    """dataset/partition/label[/trial]/seed<n>: the job as its run folder names it."""
    trial = f"/{cell['trial']}" if "trial" in cell else ""
    return f"{cell['dataset']}/{cell['partition']}/{cell['label']}{trial}/seed{cell['seed']}"


def slowest_seconds(work: Work, calibrations: Iterable[dict[str, Any]]) -> float | None:
    """The longest estimate of `work` among the calibrations that have its model, None if none has."""
    found = [s for s in (work.seconds(c) for c in calibrations) if s is not None]
    return max(found) if found else None


def wall_seconds(durations: list[float], at_once: int) -> float:
    """The wall time of jobs of `durations` run `at_once` side by side, each taking the next free slot,
    longest first (as if independent: a fine-tuning row waits for its base, which this leaves out)."""
    slots = [0.0] * max(1, at_once)
    for d in sorted(durations, reverse=True):
        i = min(range(len(slots)), key=slots.__getitem__)
        slots[i] += d
    return max(slots) if durations else 0.0


def human(seconds: float) -> str:
    """'42 s', '7.5 min', '3.2 h', '2.1 days'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


# -- what validate and cells print --------------------------------------------------------------------

def machine_calibration(calibrations: list[dict], threads: int) -> tuple[dict | None, str]:
    """The calibration of this machine's device (`--device auto`'s: the GPU, else the CPU) at `threads`
    and this torch, and the device's name."""
    from .calibration import cpu_name, find_calibration, gpu_name, torch_version

    device = gpu_name() or f"cpu: {cpu_name()}"
    return find_calibration(calibrations, device, threads, torch_version()), device


def experiment_lines(exp: dict[str, Any], calibration_root: str | os.PathLike = CALIBRATION_DIR,
                     shards_root: str | os.PathLike = SHARDS_ROOT) -> list[str]:
    """What `fedrepro validate` says of an experiment's cost on this machine: the total, the longest
    job and the wall time with the local profile's plan, from a cached calibration only (never
    measured here), or how to make one."""
    from .calibration import load_calibrations
    from .local_plan import cells_at_once, machine_plan

    local = machine_plan()
    calibrations, problems = load_calibrations(calibration_root)
    calibration, device = machine_calibration(calibrations, local.threads)
    lines = [f"warning: {p}" for p in problems]
    if calibration is None:
        return lines + [f"cost: no calibration for this machine ({device}, {local.threads} threads): run "
                        "`fedrepro calibrate CONFIG`"]
    jobs = Estimator(exp, shards_root).jobs()
    timed = [(j, j.work.seconds(calibration)) for j in jobs if j.work is not None]
    known = [(j, s) for j, s in timed if s is not None]
    missing = sorted({j.work.spec.label() for j, s in timed if s is None})
    unsized = len(jobs) - len(timed)
    when = calibration.get("updated", "?")[:10]
    head = f"cost on {device} ({local.threads} threads, calibrated {when})"
    if not known:
        return lines + [f"{head}: none of its models is calibrated ({'; '.join(missing)}): run `fedrepro calibrate CONFIG`"]
    total = sum(s for _, s in known)
    longest, longest_s = max(known, key=lambda js: js[1])
    at_once = cells_at_once(local)
    wall = wall_seconds([s for _, s in known], at_once)
    side = "one at a time" if at_once == 1 else f"{at_once} side by side"
    lines.append(f"{head}: {len(known)} job(s), {human(total)} in all, longest {human(longest_s)} ({longest.name}); "
                 f"wall time here with the local profile ({side}): about {human(wall)}")
    if missing:
        lines.append(f"cost: {len(timed) - len(known)} job(s) not estimated, models not calibrated ({'; '.join(missing)}): "
                     "run `fedrepro calibrate CONFIG`")
    if unsized:
        lines.append(f"cost: {unsized} job(s) not estimated: their dataset's size is known only once its shards exist")
    return lines
