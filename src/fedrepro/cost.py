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
import heapq
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from .calibration import CALIBRATION_DIR, ModelSpec, model_spec
from .registry import ConfigError, show

#: The shards' folder, relative to the working directory (planning.WorkflowPlan.shard_dir's).
SHARDS_ROOT = Path("results") / "shards"
#: Training cells of rule `train` per submitted job in workflow/profiles/slurm-packed (its
#: `group-components: train_pack=8`; tests/test_cost.py holds the two equal): one GPU per job, its
#: cells one after another. Every other training rule's job runs alone (the profile groups only `train`).
PACKED_CELLS_PER_JOB = 8
PACKED_RULE = "train"
#: Above this many (clients x rounds) the sampling schedule is not drawn: the expected participation
#: stands in (the same mean; drawing 10,000 rounds of 100,000 clients would take minutes).
EXACT_SCHEDULE_LIMIT = 2_000_000
#: The (clients x rounds) one estimate draws in all, over the experiment's sampling schedules; beyond, the
#: expected participation stands in for the remaining ones: a plan of 1,000 seeds x 9,999 rounds x 200
#: clients drew for 220 s in `fedrepro status` (issue 57). No shipped config comes near it.
EXACT_SCHEDULE_BUDGET = 20_000_000


@dataclass(frozen=True)
class Sizes:
    """The training clients' (train, test, val) sample counts, where they come from, and the held-out
    (unseen) clients' counts."""

    clients: tuple[tuple[int, int, int], ...]
    source: str  # "manifest" or "estimate"
    unseen: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Work:
    """A job's work in calibrated units: whole-model training steps at the cell's batch size, head
    steps, and samples through a forward pass without gradient."""

    spec: ModelSpec
    train_steps: float
    head_steps: float
    forward_samples: float
    derived: bool = False
    client_rounds: float = 0.0  # clients trained, summed over the rounds: the engine's time beside their steps

    def seconds(self, calibration: dict[str, Any]) -> float | None:
        """Seconds under `calibration` (a cached file, fedrepro.calibration), None if it lacks the model."""
        entry = calibration["models"].get(self.spec.key)
        if entry is None:
            return None
        return (calibration.get("startup_s") or 0.0) + self.train_steps * entry["train_step_s"] + \
            self.head_steps * entry["head_step_s"] + self.forward_samples * entry["forward_sample_s"] + \
            self.client_rounds * (calibration.get("client_round_s") or 0.0)


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
    def counts(held_out: bool) -> tuple[tuple[int, int, int], ...]:
        return tuple((int(c["sizes"]["train"]), int(c["sizes"]["test"]), int(c["sizes"].get("val", 0)))
                     for c in manifest["clients"] if bool(c.get("unseen")) == held_out)

    return Sizes(counts(False), "manifest", counts(True))


def estimated_sizes(spec: dict[str, Any]) -> Sizes | None:
    """Equal clients from the dataset's known sample count (the pooled one, or the official train set
    with pool: false) over num_clients, or a partitioner's fixed `partition_size`, each scarce client
    (`scarcity`) keeping its fraction (a range's midpoint); None where the dataset's size is not known
    before it is read."""
    from .data.datasets import sample_bounds
    from .data.shards import scarce_client_ids, unseen_client_ids

    bounds = sample_bounds(spec["dataset"], spec.get("dataset_params") or {})
    params = spec.get("params") or {}
    fixed = params.get("partition_size") if params.get("sampler", "plato") == "plato" else None  # dirichlet's 'split' ignores it
    if bounds is None and not fixed:
        return None
    per_client = fixed or (bounds[1] if spec["pool"] else bounds[0]) / spec["num_clients"]
    fraction = (spec.get("scarcity") or {"fraction": 1.0})["fraction"]
    kept = (fraction[0] + fraction[-1]) / 2 if isinstance(fraction, list) else fraction
    scarce = set(scarce_client_ids(spec))
    split, unseen = spec["split"], set(unseen_client_ids(spec))
    clients, held_out = [], []
    for cid in range(spec["num_clients"]):
        n = per_client * (kept if cid in scarce else 1.0)
        test, val = n * split["test_fraction"], n * split["val_fraction"]
        (held_out if cid in unseen else clients).append((round(n - test - val), round(test), round(val)))
    return Sizes(tuple(clients), "estimate", tuple(held_out))


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

    if sampled >= n:  # every client every round: the schedule's counts, without drawing it
        return (rounds,) * n
    if n * rounds > EXACT_SCHEDULE_LIMIT:
        return expected_participations(n, sampled, rounds)
    counts = [0] * n
    for chosen in sampling_schedule(n, sampled, rounds, seed):
        for i in chosen:
            counts[i] += 1
    return tuple(counts)


def expected_participations(n: int, sampled: int, rounds: int) -> tuple[float, ...]:
    """The rounds each of `n` clients trains in on average when `sampled` of them train a round."""
    return (rounds * min(sampled, n) / n,) * n


def evaluated_rounds(rounds: int, every: int, personal_every: int | None) -> tuple[int, int]:
    """(how many rounds are evaluated, at how many of them the personalized models are scored): every
    `every`-th round and the last; the personalized ones where that round is also a multiple of
    `personal_every` (or every evaluation), and the last. Counted, not listed: 10,000 rounds of
    10,000 cells stay instant."""
    def multiples_and_last(k: int) -> int:
        return rounds // k + (rounds % k != 0)

    personal = math.lcm(every, personal_every or 1)
    return multiples_and_last(every), multiples_and_last(personal)


def _method_class(cell: dict[str, Any]):
    from .engine.finetune import finetune_class
    from .methods import METHODS

    return finetune_class(cell) if "finetune" in cell else METHODS.get(cell["method"])


def _carved(clients: tuple[tuple[int, int, int], ...], cell: dict[str, Any]) -> list[tuple[int, int, int]]:
    """The sizes as the cell's job sees them: a tuning trial carves its validation from train."""
    f = (cell.get("validation") or {}).get("from_train")
    if not f:
        return list(clients)
    return [(train - round(train * f), test, round(train * f)) for train, test, _ in clients]


def cell_work(cell: dict[str, Any], sizes: Sizes, datasets: dict[str, dict], derived: bool = False,
              schedule: Callable[[int, int, int, int], tuple[float, ...]] = participations) -> Work:
    """The work of one job: `cell` (resolved) on clients of `sizes`; `derived`: a fine-tuning row
    scored from its base cell's final model (only its last round's scoring); `schedule`: the rounds each
    client trains in (participations; an Estimator's keeps to its budget of draws)."""
    t, cls, hp = cell["training"], _method_class(cell), cell["hparams"]
    clients, unseen = _carved(sizes.clients, cell), _carved(sizes.unseen, cell)
    bs, epochs, drop = t["batch_size"], t["local_epochs"], t["drop_last"]
    rounds = t["rounds"]
    steps = [local_steps(train, bs, epochs, drop) for train, _, _ in clients]
    counts = schedule(len(clients), _sampled(len(clients), t["participation"]), rounds, int(cell["seed"]))
    trained = 0.0 if derived else sum(k * s for k, s in zip(counts, steps))
    passes = cls.cost_passes_for(hp, t)
    evaluated, personal = (1, 1) if derived else evaluated_rounds(rounds, t["eval_every"], t.get("personal_eval_every"))
    scored = sum(test + val for _, test, val in clients)
    forward = scored * (evaluated * cls.has_global + personal * cls.has_personal)
    model_steps, head_steps = trained * passes.model, trained * passes.head
    global_tests = t.get("global_test", []) + (cell.get("validation") or {}).get("global_test", [])
    # Each training client's personalized model is made at every personal evaluation, and once more
    # after the last round where the unseen clients' global score (no global model: the personal
    # models' mean) or a global test set needs it.
    made = personal + bool((unseen and not cls.has_global) or global_tests) if cls.has_personal else 0
    work = cls.cost_personal_for(hp, t)  # also the unseen clients' personalization, below
    if made:  # no personalized model made during training: nothing to add here
        for train, _, _ in clients:
            m, h, f = _personalizing(work, train, bs, drop)
            model_steps, head_steps, forward = model_steps + made * m, head_steps + made * h, forward + made * f
    if "union" in global_tests:
        forward += sum(test for _, test, _ in clients)
    # After the last round (engine.beyond) the unseen clients' test splits are scored by the global
    # model and, with personalized models, by each one's own: one local update, then personalization.
    if unseen:
        forward += sum(test for _, test, _ in unseen) * (1 + cls.has_personal)
        for train, _, _ in unseen if cls.has_personal else ():
            m, h, f = _personalizing(work, train, bs, drop)
            update = local_steps(train, bs, epochs, drop)
            model_steps, head_steps = model_steps + update * passes.model + m, head_steps + update * passes.head + h
            forward += f
    return Work(model_spec(cell, datasets), model_steps, head_steps, forward, derived, 0.0 if derived else sum(counts))


def _personalizing(work, train: int, batch_size: int, drop_last: bool) -> tuple[float, float, float]:
    """(model steps, head steps, forward samples) of one client's personalized model (`work`: the
    method's PersonalWork) on `train` training samples."""
    model = local_steps(train, batch_size, work.train_epochs, drop_last)
    if not work.head_epochs:
        return model, 0.0, 0.0
    # the frozen features, once per personalization, then the head's steps
    return model, local_steps(train, work.head_batch_size, work.head_epochs), float(train)


# -- an experiment's jobs -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One training, fine-tuning or tuning job of an experiment, and its work (None: sizes unknown)."""

    name: str
    cell: dict[str, Any]
    work: Work | None


class Estimator:
    """The work of an experiment's jobs, each partition's sizes read (or estimated) once."""

    def __init__(self, exp: dict[str, Any], shards_root: str | os.PathLike = SHARDS_ROOT,
                 schedule_budget: int | None = None):
        from .engine.finetune import derived_bases

        self.exp = exp
        self.shards_root = Path(shards_root)
        self.specs = {(p["dataset"], p["label"]): p for p in exp["partitions"]}
        self.derived = set(derived_bases(exp["cells"]))  # fine-tuning rows scored from their base cell's final model
        self._sizes: dict[tuple[str, str], Sizes | None] = {}
        self._drawn: set[tuple[int, int, int, int]] = set()  # the schedules drawn exactly (the methods of a seed share one)
        self._budget = EXACT_SCHEDULE_BUDGET if schedule_budget is None else schedule_budget  # (clients x rounds) still to draw

    def schedule(self, n: int, sampled: int, rounds: int, seed: int) -> tuple[float, ...]:
        """participations, drawing schedules exactly while the budget lasts, then their expectation."""
        key = (n, sampled, rounds, seed)
        drawn = sampled >= n or n * rounds > EXACT_SCHEDULE_LIMIT or key in self._drawn  # nothing (more) to draw
        if not drawn and n * rounds > self._budget:
            return expected_participations(n, sampled, rounds)
        if not drawn:
            self._budget -= n * rounds
            self._drawn.add(key)
        return participations(n, sampled, rounds, seed)

    def sizes(self, dataset: str, partition: str) -> Sizes | None:
        key = (dataset, partition)
        if key not in self._sizes:
            part = self.specs[key]
            self._sizes[key] = manifest_sizes(self.shards_root / dataset / part["id"]) or estimated_sizes(part["spec"])
        return self._sizes[key]

    def work(self, cell: dict[str, Any]) -> Work | None:
        sizes = self.sizes(cell["dataset"], cell["partition"])
        derived = "trial" not in cell and (cell["dataset"], cell["partition"], cell["label"], str(cell["seed"])) in self.derived
        return None if sizes is None else cell_work(cell, sizes, self.exp["datasets"], derived, self.schedule)

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


def training_rule(cell: dict[str, Any], derived: bool) -> str:
    """The rule whose job trains `cell`: a tuning trial's, a fine-tuning row scored from its base cell's
    final model (`derived`), a tuned label's final cell, or rule train (workflow/rules/*.smk)."""
    if "trial" in cell:
        return "tune_trial"
    if derived:
        return "finetune"
    return "train_tuned" if cell.get("tuned") else "train"


def packed_wall_seconds(timed: Iterable[tuple["Job", float]], gpus: int, per_job: int = PACKED_CELLS_PER_JOB) -> float:
    """The wall time of estimated jobs on `gpus` GPUs with workflow/profiles/slurm-packed: rule train's
    cells `per_job` to a submitted job of one GPU that runs them one after another (grouped in the
    config's order; Snakemake may group them otherwise), every other training job alone on a GPU, the
    jobs laid out as `wall_seconds` lays them."""
    packed, alone = [], []
    for job, seconds in timed:
        (packed if training_rule(job.cell, job.work.derived) == PACKED_RULE else alone).append(seconds)
    groups = [sum(packed[i:i + per_job]) for i in range(0, len(packed), per_job)]
    return wall_seconds(groups + alone, gpus)


def wall_seconds(durations: list[float], at_once: int) -> float:
    """The wall time of jobs of `durations` run `at_once` side by side, each taking the next free slot,
    longest first (as if independent: a fine-tuning row waits for its base, which this leaves out).
    More slots than jobs change nothing: only as many as there are jobs are laid out (`--gpus` is
    bounded, but a billion slots would still be gigabytes of zeros)."""
    slots = [0.0] * max(1, min(at_once, len(durations)))  # a heap of the slots' loads: the freest first
    for d in sorted(durations, reverse=True):
        heapq.heapreplace(slots, slots[0] + d)
    return max(slots) if durations else 0.0


#: The longest duration `human` spells out (days): a century. Beyond it an estimate says only that the run
#: is out of reach, and its digits would be noise: bounded timings x a bounded config can still give 1e17 s.
HUMAN_MAX_DAYS = 36_500


def human(seconds: float) -> str:
    """'42 s', '7.5 min', '3.2 h', '2.1 days'; 'under 1 s' for a fraction of one (never "0 s" for a job
    that takes time), 'over 36,500 days' beyond HUMAN_MAX_DAYS (infinity too), and 'unknown' for what is
    no duration (NaN, negative, not a number): every printed duration is finite and short."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
        return "unknown"
    if 0 < seconds < 1:  # "{:.0f} s" would say 0 s
        return "under 1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds <= HUMAN_MAX_DAYS * 86400:
        return f"{seconds / 86400:.1f} days"
    return f"over {HUMAN_MAX_DAYS:,} days"


def human_hours(seconds: float) -> str:
    """Hours to 3 significant digits ('12.5'), bounded as `human` bounds its days."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
        return "unknown"
    if seconds > HUMAN_MAX_DAYS * 86400:
        return f"over {HUMAN_MAX_DAYS * 24:,}"
    return f"{seconds / 3600:.3g}"


# -- which calibration --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chosen:
    """The calibration an estimate is made with (None: there is none for this machine), the device and
    threads it is for, whether that device is this machine's (only then is a wall time "here" with the
    local profile meaningful), the file `--calibration` named (None: this machine's cache), and one
    line per cached file that could not be used."""

    calibration: dict[str, Any] | None
    device: str
    threads: int
    here: bool
    named: str | None = None
    problems: tuple[str, ...] = ()

    @property
    def gpu(self) -> bool:
        """A GPU's calibration: its estimate is also said in GPU-hours and packed SLURM jobs."""
        return self.device.startswith("cuda:")


def this_device() -> str:
    """The device `--device auto` takes on this machine, as calibrations name it: the GPU, else the CPU."""
    from .calibration import cpu_name, gpu_name

    return gpu_name() or f"cpu: {cpu_name()}"


def machine_calibration(calibrations: list[dict], threads: int, device: str | None = None) -> tuple[dict | None, str]:
    """The calibration of this machine's device (`device`, if already known) at `threads` and this torch,
    and the device's name."""
    from .calibration import find_calibration, torch_version

    device = device or this_device()
    return find_calibration(calibrations, device, threads, torch_version(), _kernel_level(device)), device


def named_calibration(path: str | os.PathLike, device_here: str) -> dict[str, Any]:
    """The calibration file `path` (`--calibration`, e.g. one a GPU run recorded in docs/gpu_runs/),
    checked by calibration.read_calibration (ConfigError naming the file and what is wrong). A file of
    this very device under another torch is refused: the cells here run this torch, so its timings are
    stale. Another device's torch is that machine's, which nothing here can check."""
    from .calibration import read_calibration, torch_version

    data = read_calibration(path)
    torch_here = torch_version()
    if data["device"] == device_here and data["torch"] != torch_here:
        raise ConfigError(f"calibration file {path}: key 'torch' has value {show(data['torch'])}; allowed: this machine's "
                          f"torch {torch_here!r}, since it calibrates this device ({device_here}): run "
                          "`fedrepro calibrate CONFIG` again")
    return {**data, "path": str(path)}


def choose_calibration(threads: int, path: str | os.PathLike | None = None,
                       root: str | os.PathLike = CALIBRATION_DIR) -> Chosen:
    """The file `path` names (at its own threads), else this machine's cached calibration at `threads`."""
    from .calibration import load_calibrations

    device_here = this_device()
    if path is not None:
        data = named_calibration(path, device_here)
        return Chosen(data, data["device"], data["threads"], data["device"] == device_here, str(path))
    calibrations, problems = load_calibrations(root)
    data, _ = machine_calibration(calibrations, threads, device_here)
    return Chosen(data, device_here, threads, True, None, tuple(problems))


def calibrate_hint(chosen: Chosen) -> str:
    """How to make the calibration that is missing: on its device where that is not this machine's."""
    return "run `fedrepro calibrate CONFIG`" + ("" if chosen.here else f" on {chosen.device}")


def no_calibration_line(chosen: Chosen) -> str:
    """What validate, the workflow's start and `fedrepro status` say without a calibration."""
    return f"cost: no calibration for this machine ({chosen.device}, {chosen.threads} threads): {calibrate_hint(chosen)}"


# -- an experiment's estimate -------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """An experiment's jobs under one calibration: those estimated, with their seconds; those whose
    model it lacks; and how many could not be sized (their dataset's size is known only from its shards)."""

    timed: tuple[tuple[Job, float], ...]
    uncalibrated: tuple[Job, ...]
    unsized: int

    @property
    def total(self) -> float:
        return sum(s for _, s in self.timed)

    @property
    def longest(self) -> tuple[Job, float]:
        return max(self.timed, key=lambda js: js[1])

    def seconds(self) -> dict[str, float]:
        """Each estimated job's seconds by its name (job_name: as its run and status folders name it)."""
        return {job.name: s for job, s in self.timed}

    def missing_models(self) -> str:
        return "; ".join(sorted({job.work.spec.label() for job in self.uncalibrated}))


def estimate(jobs: Iterable[Job], calibration: dict[str, Any]) -> Estimate:
    timed, uncalibrated, unsized = [], [], 0
    for job in jobs:
        seconds = None if job.work is None else job.work.seconds(calibration)
        if job.work is None:
            unsized += 1
        elif seconds is None:
            uncalibrated.append(job)
        else:
            timed.append((job, seconds))
    return Estimate(tuple(timed), tuple(uncalibrated), unsized)


def local_wall_text(est: Estimate, local) -> str:
    """The wall time on this machine with the local profile's plan (`local`, local_plan.LocalPlan)."""
    from .local_plan import cells_at_once

    at_once = cells_at_once(local)
    side = "one at a time" if at_once == 1 else f"{at_once} side by side"
    return f"wall time here with the local profile ({side}): about {human(wall_seconds([s for _, s in est.timed], at_once))}"


def gpu_text(est: Estimate, gpus: int) -> str:
    """GPU-hours (every training job holds one GPU for its time) and the wall time on `gpus` GPUs, packed."""
    return (f"{human_hours(est.total)} GPU-hours; wall time on {gpus} GPU{'' if gpus == 1 else 's'} with the slurm-packed "
            f"profile ({PACKED_CELLS_PER_JOB} cells a job, in turn): about {human(packed_wall_seconds(est.timed, gpus))}")


def calibration_head(chosen: Chosen) -> str:
    """'cost on <device> (<threads> threads, calibrated <date>[, torch <version>, file <path>])'."""
    cal = chosen.calibration
    named = f", torch {cal['torch']}, file {chosen.named}" if chosen.named else ""
    return f"cost on {chosen.device} ({chosen.threads} threads, calibrated {(cal.get('updated') or '?')[:10]}{named})"


def cost_basis(calibration_file: str | os.PathLike | None = None, calibration_root: str | os.PathLike = CALIBRATION_DIR,
               threads: int | None = None):
    """(the local profile's plan for this machine, the calibration chosen at its threads or `threads`)."""
    from .local_plan import machine_plan

    local = machine_plan()
    return local, choose_calibration(threads or local.threads, calibration_file, calibration_root)


def experiment_lines(exp: dict[str, Any], local, chosen: Chosen, shards_root: str | os.PathLike = SHARDS_ROOT,
                     gpus: int = 1) -> list[str]:
    """What `fedrepro validate` and the workflow's start say of an experiment's cost: the total, the
    longest job, the wall time with the local profile's plan (`local`) where the calibration is this
    machine's, and with a GPU's, GPU-hours and the wall time on `gpus` GPUs packed as slurm-packed packs
    them; from a cached or named calibration only (never measured here), or how to make one."""
    lines = [f"warning: {p}" for p in chosen.problems]
    if chosen.calibration is None:
        return lines + [no_calibration_line(chosen)]
    est = estimate(Estimator(exp, shards_root).jobs(), chosen.calibration)
    head, hint = calibration_head(chosen), calibrate_hint(chosen)
    if not est.timed:
        return lines + [f"{head}: none of its models is calibrated ({est.missing_models()}): {hint}"]
    longest, longest_s = est.longest
    parts = [f"{len(est.timed)} job(s), {human(est.total)} in all, longest {human(longest_s)} ({longest.name})"]
    if chosen.here:
        parts.append(local_wall_text(est, local))
    if chosen.gpu:
        parts.append(gpu_text(est, gpus))
    lines.append(f"{head}: " + "; ".join(parts))
    if est.uncalibrated:
        lines.append(f"cost: {len(est.uncalibrated)} job(s) not estimated, models not calibrated ({est.missing_models()}): {hint}")
    if est.unsized:
        lines.append(f"cost: {est.unsized} job(s) not estimated: their dataset's size is known only once its shards exist")
    return lines


def workflow_lines(exp: dict[str, Any]) -> list[str]:
    """What the workflow says of the experiment's cost when Snakemake starts (workflow/rules/common.smk):
    validate's lines, each naming the experiment; from cached calibrations only (nothing is measured
    while Snakemake plans). An estimate is advice: whatever stops it (an unreadable calibration cache
    is already a warning and the hint) is one line, never the workflow's failure."""
    try:
        local, chosen = cost_basis()
        lines = experiment_lines(exp, local, chosen)
    except Exception as exc:  # noqa: BLE001 - advice only; the type is named so that a bug still shows
        lines = [f"cost: not estimated ({type(exc).__name__}: {exc}); `fedrepro validate CONFIG` says more"]
    return [f"experiment '{exp['experiment']}': {line}" for line in lines]


# -- the time left of a run: `fedrepro status` ---------------------------------------------------------

#: The states of `fedrepro status` (fedrepro.progress.collect) whose cells still train.
RUNNING_STATES = ("running", "finishing")


#: `fedrepro status` rescales the time left by the run's own pace once this many of its jobs have
#: finished with a recorded time: a machine's speed drifts by as much as the estimate's error
#: (docs/cost.md, "Measured accuracy"), and the finished jobs have measured the speed of today's.
PACE_MIN_JOBS = 3
#: The pace applied: the finished jobs' measured over estimated time within these bounds (the estimate's
#: error is tens of percent, docs/cost.md); beyond, their recorded times are not believed and the
#: estimates stand as they are (a hand-edited wall_time_s of 1e308 printed 'infx their estimate').
PACE_BOUNDS = (0.01, 100.0)
#: The longest time left printed; a longer (or non-finite) one is 'unknown', with why (issue 57: 'about
#: inf days' from hostile recorded times).
TIME_LEFT_MAX_S = 100 * 365 * 86400


def _elapsed(row: dict) -> float | None:
    """A status row's recorded seconds (`elapsed_s`), None where it records no usable number: absent,
    negative, not finite or beyond a year (fedrepro.progress.usable_seconds)."""
    from .progress import usable_seconds

    return usable_seconds(row.get("elapsed_s"))


class TimeLeft:
    """`fedrepro status`'s estimate of a run's time left: each job's estimate, from the config the run
    recorded (status/plan.json) under this machine's calibration at the local profile's threads, made
    once; or why there is none (`why`). Once PACE_MIN_JOBS jobs have finished, each estimate less its
    start-up (`startup`: what a job's own recorded time leaves out) is scaled by their measured time over
    their estimated one."""

    def __init__(self, seconds: dict[str, float] | None, at_once: int = 1, why: str = "", finished=None,
                 not_estimated: int = 0, startup: float = 0.0):
        self.estimates, self.at_once, self.why, self.not_estimated = seconds, at_once, why, not_estimated
        self.finished = finished or (lambda name: False)  # a job's metrics.json exists (no row names it)
        self.startup = startup

    def pace(self, states: dict[str, dict]) -> tuple[float, int]:
        """(measured / estimated time of the finished jobs, how many), (1.0, n) below PACE_MIN_JOBS."""
        measured = expected = 0.0
        jobs = 0
        for name, seconds in self.estimates.items():
            row = states.get(name) or {}
            took = _elapsed(row)
            if row.get("state") == "done" and took is not None:
                measured, expected, jobs = measured + took, expected + max(seconds - self.startup, 0.0), jobs + 1
        return (measured / expected if jobs >= PACE_MIN_JOBS and expected > 0 else 1.0), jobs

    @classmethod
    def of_results(cls, results_dir: str | os.PathLike) -> "TimeLeft":
        """The estimates of results/<experiment>: its calibrations and shards are the workflow's,
        results/.calibration and results/shards beside it."""
        from .config import resolve_experiment
        from .local_plan import cells_at_once
        from .progress import recorded_config

        root = Path(results_dir)
        config, why = recorded_config(root)
        if config is None:
            return cls(None, why=why)
        try:
            exp = resolve_experiment(config)
            local, chosen = cost_basis(calibration_root=root.parent / CALIBRATION_DIR.name)
        except ConfigError as exc:
            return cls(None, why=f"the config recorded in the run's plan is refused ({exc})")
        if chosen.calibration is None:
            return cls(None, why=no_calibration_line(chosen).removeprefix("cost: "))
        est = estimate(Estimator(exp, root.parent / SHARDS_ROOT.name).jobs(), chosen.calibration)
        finished = lambda name: any((root / sub / name / "metrics.json").exists() for sub in ("runs", "tuning/runs"))
        return cls(est.seconds(), cells_at_once(local), finished=finished, not_estimated=len(est.uncalibrated) + est.unsized,
                   startup=chosen.calibration.get("startup_s") or 0.0)

    def line(self, rows: list[dict]) -> str:
        """'time left: about <t> (...)': the estimate of every pending job, and of every running one less
        its elapsed time (never below 0), summed over the cells the local profile runs side by side (never
        less than the longest of them); a job of the plan with no row yet (a tuning trial not started)
        is pending."""
        if self.estimates is None:
            return f"time left: no estimate: {self.why}"
        states = {r["cell"]: r for r in rows}
        pace, done = self.pace(states)
        paced = done >= PACE_MIN_JOBS
        low, high = PACE_BOUNDS
        unpaced = "" if not paced or low <= pace <= high else (
            f"; the pace of its {done} finished jobs ({pace:.3g}x their estimate) not applied: allowed {low:g}x to {high:g}x")
        if unpaced:
            pace, paced = 1.0, False
        left, counts = [], {"pending": 0, "running": 0}
        for name, estimated in self.estimates.items():
            seconds = min(self.startup, estimated) + max(estimated - self.startup, 0.0) * pace
            row = states.get(name)
            state = row["state"] if row else "done" if self.finished(name) else "pending"
            if state in RUNNING_STATES:
                elapsed = _elapsed(row)
                left.append(max(0.0, seconds - (0.0 if elapsed is None else elapsed)))
                counts["running"] += 1
            elif state == "pending":
                left.append(seconds)
                counts["pending"] += 1
        unknown = f"; {self.not_estimated} job(s) of the plan not estimated" if self.not_estimated else ""
        if not left:
            return f"time left: none estimated (no pending or running job){unknown}{unpaced}"
        wall = max(sum(left) / self.at_once, max(left))
        jobs = f"{counts['running']} running, {counts['pending']} pending job(s)"
        if not (math.isfinite(wall) and wall <= TIME_LEFT_MAX_S):  # a calibration's or a plan's numbers beyond reason
            size = f"about {wall:.3g} s" if math.isfinite(wall) else "not a finite number of seconds"
            return (f"time left: unknown ({jobs}): the estimate is {size}; allowed: at most {human(TIME_LEFT_MAX_S)} "
                    f"(check the calibration: fedrepro calibrate CONFIG){unknown}{unpaced}")
        side = "one at a time" if self.at_once == 1 else f"{self.at_once} side by side"
        pace_text = f", at the run's pace: its {done} finished jobs took {pace:.2f}x their estimate" if paced else ""
        return (f"time left: about {human(wall)} ({jobs}, {side} with the local profile{pace_text}){unknown}{unpaced}")


def _kernel_level(device: str) -> str | None:
    """The CPU kernel level a calibration of `device` must have been measured at: the capped level's
    name as torch reports it (AVX2, AVX512), None (any) on a GPU or uncapped (fedrepro/kernels.py)."""
    from . import kernels

    if not device.startswith("cpu"):
        return None
    try:
        return {"avx2": "AVX2", "avx512": "AVX512"}.get(kernels.requested())
    except kernels.KernelLevelError:
        return None
