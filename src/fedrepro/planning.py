"""What an experiment runs, planned from its resolved config before any job starts.

The Snakemake workflow keeps config and validation in workflow/rules/common.smk and asks a
`WorkflowPlan` (a `TuningPlan` for the tuning rules) for everything else: the paths each job reads
and writes, the JSON specs the rules hand to the CLI, and the targets of `rule all`. Its input
functions take the job's wildcards (anything with the wildcard names as attributes), so they are
plain Python, testable without Snakemake. `set_job_environment` is the one place the workflow sets
the FEDREPRO_* variables its jobs inherit; `untrained_warnings` is what both `fedrepro validate`
and Snakemake warn about before any job.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

#: SLURM time limits (the training rules' `runtime`, minutes) from each cell's cost estimate (docs/cost.md):
#: estimate x RUNTIME_MARGIN + RUNTIME_FLOOR_MIN, times the attempt (a job killed at its limit is retried
#: with a longer one, and resumes from its checkpoint), at most the maximum of MAX_RUNTIME_ENV.
#: The margin covers what the estimate leaves out or cannot know: a node busier than the calibrated
#: machine, the data's loading, an untimed method extra (docs/cost.md's table says how far off it is).
RUNTIME_MARGIN = 2.0
#: A short cell's limit is still this long: staging Python and the data on a node takes minutes.
RUNTIME_FLOOR_MIN = 10
#: The largest time limit a job asks for (your GPU partition's MaxTime), in minutes; the SLURM profiles
#: set it (default DEFAULT_MAX_RUNTIME_MIN, the fixed limit every training job asked for before).
MAX_RUNTIME_ENV = "FEDREPRO_MAX_RUNTIME"
DEFAULT_MAX_RUNTIME_MIN = 240
#: Each rule's limit where no calibration has the cell's model (the fixed values of before).
FALLBACK_RUNTIME_MIN = {"train": 240, "train_tuned": 240, "tune_trial": 240, "finetune": 60}
#: Estimate from the calibration of this device only (as calibrations name it, e.g. "cuda: NVIDIA H100 80GB
#: HBM3"); unset: the slowest calibrated device at the job's threads (a limit errs on the long side).
COST_DEVICE_ENV = "FEDREPRO_COST_DEVICE"
#: The longest limit MAX_RUNTIME_ENV may set: a year.
MAX_RUNTIME_LIMIT = 525_600

#: The tables `fedrepro tables` writes for every experiment (md, tex, csv, meta.json each).
TABLES = ["accuracy", "accuracy_client_mean", "accuracy_client_std", "accuracy_worst10", "macro_f1"]
#: Where the report's landing page falls back to until the report_page rule has written it.
STATIC_LANDING = "workflow/report/description.rst"


def results_dir(exp: dict[str, Any]) -> str:
    """The experiment's results folder, relative to the workflow's working directory."""
    return f"results/{exp['experiment']}"


def one_of(names: Iterable[str]) -> str:
    """A regular expression matching exactly the given names (a wildcard constraint)."""
    return "|".join(re.escape(n) for n in sorted(names))


def cell_key(c: dict[str, Any]) -> tuple[str, str, str, str]:
    """(dataset, partition, label, seed) of a cell, as the wildcards of its job spell them."""
    return c["dataset"], c["partition"], c["label"], str(c["seed"])


def wildcard_key(wildcards) -> tuple[str, str, str, str]:
    return wildcards.dataset, wildcards.partition, wildcards.label, wildcards.seed


def set_job_environment(exp: dict[str, Any], overrides: Sequence[str]) -> None:
    """Set, in this process, the FEDREPRO_* variables every job of the experiment inherits (locally,
    and on SLURM, where each job parses the workflow again): the `--config set=` items
    (provenance.json "overrides"), the status folder (`fedrepro status`, the console watcher) and,
    with `tracking: {tensorboard: true}`, the TensorBoard folder. Set here, not in the rules, so
    their code (and so every finished cell) stays as it was."""
    from .overrides import record
    from .progress import STATUS_DIR_ENV
    from .tracking import TENSORBOARD_DIR_ENV

    record(overrides)
    out = results_dir(exp)
    os.environ[STATUS_DIR_ENV] = os.path.abspath(f"{out}/status")
    if exp["tracking"]["tensorboard"]:
        os.environ[TENSORBOARD_DIR_ENV] = os.path.abspath(f"{out}/tensorboard")


def untrained_warnings(exp: dict[str, Any]) -> list[str]:
    """One line per (partition, training schedule, seed) whose client sampling leaves some
    clients untrained at the end: they are scored by the experiment's `evaluation.untrained`."""
    from .engine.sampling import sampling_schedule, trained_rounds

    specs = {(p["dataset"], p["label"]): p["spec"] for p in exp["partitions"]}
    seen: dict[tuple, list[str]] = {}
    for c in exp["cells"]:
        spec, t = specs[(c["dataset"], c["partition"])], c["training"]
        n = spec["num_clients"] - spec["unseen_clients"]
        key = (c["dataset"], c["partition"], n, t["participation"], t["rounds"], c["seed"])
        seen.setdefault(key, []).append(c["label"])
    lines = []
    for (ds, part, n, participation, rounds, seed), labels in seen.items():
        never = [i for i, r in trained_rounds(sampling_schedule(n, participation, rounds, seed), list(range(n))).items() if not r]
        if never:
            rule = exp["cells"][0]["evaluation"]["untrained"]
            lines.append(f"{ds}/{part} seed {seed} ({', '.join(labels)}): {len(never)} of {n} training clients never train "
                         f"(participation {participation}, {rounds} rounds; positions {never}); they are scored by "
                         f"evaluation.untrained = {rule!r}")
    return lines


def max_runtime(environ: dict[str, str] | None = None) -> int:
    """The largest time limit in minutes: MAX_RUNTIME_ENV, else DEFAULT_MAX_RUNTIME_MIN (ConfigError if bad)."""
    from .registry import ConfigError, show

    raw = (os.environ if environ is None else environ).get(MAX_RUNTIME_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_RUNTIME_MIN
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 7 and 1 <= int(raw) <= MAX_RUNTIME_LIMIT):
        raise ConfigError(f"environment variable {MAX_RUNTIME_ENV} has value {show(raw)}; allowed: a whole number of "
                          f"minutes from 1 to {MAX_RUNTIME_LIMIT} (your partition's time limit)")
    return int(raw)


def runtime_minutes(estimate_s: float | None, fallback: int, cap: int, attempt: int = 1) -> int:
    """A job's time limit in minutes: the estimate x RUNTIME_MARGIN + RUNTIME_FLOOR_MIN, times the
    attempt, at most `cap`; `fallback` (at most `cap`) where there is no estimate. An estimate that is no
    finite number (calibrations are bounded, so none should be) asks for `cap`: a limit errs long, and
    math.ceil of infinity would be an OverflowError that stops the whole workflow."""
    if estimate_s is None:
        return min(fallback, cap)
    if not math.isfinite(estimate_s) or estimate_s / 60 * RUNTIME_MARGIN >= cap:
        return cap
    return min(cap, math.ceil(estimate_s / 60 * RUNTIME_MARGIN + RUNTIME_FLOOR_MIN) * max(1, attempt))


class RuntimeLimits:
    """The training jobs' SLURM time limits from the cached calibrations (fedrepro.cost), read once
    when the first limit is asked for: each job's estimate at its threads, on COST_DEVICE_ENV's
    device or the slowest calibrated one."""

    def __init__(self, exp: dict[str, Any], calibration_root: str | None = None, environ: dict[str, str] | None = None,
                 shards_root: str | None = None):
        self.exp = exp
        self.root, self.shards_root = calibration_root, shards_root
        self.environ = os.environ if environ is None else environ
        self._loaded: tuple | None = None

    def _state(self):
        if self._loaded is None:
            from .calibration import CALIBRATION_DIR, load_calibrations
            from .cost import SHARDS_ROOT, Estimator

            calibrations, _ = load_calibrations(self.root or CALIBRATION_DIR)  # an unreadable one is no estimate
            device = self.environ.get(COST_DEVICE_ENV)
            if device:
                calibrations = [c for c in calibrations if c["device"] == device]
            self._loaded = (calibrations, Estimator(self.exp, self.shards_root or SHARDS_ROOT), max_runtime(self.environ))
        return self._loaded

    def estimate(self, cell: dict[str, Any], threads: int) -> float | None:
        """The cell's estimated seconds at `threads`, None without a calibration that has its model."""
        from .cost import slowest_seconds

        calibrations, estimator, _ = self._state()
        work = estimator.work(cell)
        at = [c for c in calibrations if c["threads"] == threads]
        return None if work is None else slowest_seconds(work, at)

    def minutes(self, rule: str, cell: dict[str, Any], threads: int, attempt: int = 1) -> int:
        cap = self._state()[2]
        return runtime_minutes(self.estimate(cell, threads), FALLBACK_RUNTIME_MIN[rule], cap, attempt)

    def resource(self, rule: str, cell_of):
        """The `runtime` resource of `rule`: a function of the job's wildcards, threads and attempt
        (Snakemake passes them by name), `cell_of(wildcards)` its resolved cell."""
        def runtime(wildcards, threads, attempt):
            return self.minutes(rule, cell_of(wildcards), threads, attempt)

        return runtime


class WorkflowPlan:
    """The experiment's data, training and report jobs: their paths, specs and targets."""

    def __init__(self, exp: dict[str, Any]):
        from .engine.finetune import derived_bases

        self.exp = exp
        self.out = results_dir(exp)
        self.cells = {cell_key(c): c for c in exp["cells"]}
        self.partitions: dict[tuple[str, str], dict] = {}  # (dataset, label) -> its first draw (partitions.<label>.draw)
        for p in exp["partitions"]:
            self.partitions.setdefault((p["dataset"], p["label"]), p)
        # Fine-tuning rows scored from their base cell's final model (rule finetune,
        # docs/evaluation.md), keyed like `cells`, each with its base cell: the other cells train.
        self.derived = derived_bases(exp["cells"])
        self.derived_labels = sorted({k[2] for k in self.derived})
        # The report's landing page (`report:` in the Snakefile, fedrepro/report/landing.py): written
        # by the report_page rule; until it exists the report falls back to STATIC_LANDING.
        self.landing = f"{self.out}/report/description.rst"
        # clients whose representations are laid out by t-SNE after training (evaluation.embed_clients)
        self.embed_clients = exp["cells"] and (exp["cells"][0]["evaluation"].get("embed_clients") or [])
        self.limits = RuntimeLimits(exp)

    def runtime(self, rule: str):
        """The SLURM time limit of a training or fine-tuning job of `rule` (RuntimeLimits)."""
        return self.limits.resource(rule, lambda wildcards: self.cells[wildcard_key(wildcards)])

    # -- data -------------------------------------------------------------------------------
    def raw_marker(self, dataset: str) -> str:
        return f"results/raw/{dataset}/dataset-{self.exp['datasets'][dataset]['prepared_id']}.json"

    def shard_dir(self, dataset: str, partition: str) -> str:
        return f"results/shards/{dataset}/{self.partitions[(dataset, partition)]['id']}"

    def spec_by_id(self, wildcards) -> str:
        for p in self.exp["partitions"]:
            if p["dataset"] == wildcards.dataset and p["id"] == wildcards.pid:
                return json.dumps(p["spec"], sort_keys=True)
        raise ValueError(f"no partition {wildcards.pid} of {wildcards.dataset} in this experiment")

    def pretrain_spec_json(self, wildcards) -> str:
        for ds, info in self.exp["datasets"].items():
            if ds == wildcards.dataset and info["pretrained"] and Path(info["pretrained"]["out"]).stem == wildcards.phash:
                return json.dumps(info["pretrained"]["spec"], sort_keys=True)
        raise ValueError(f"no pre-trained backbone {wildcards.phash} of {wildcards.dataset} in this experiment")

    # -- training ---------------------------------------------------------------------------
    def run_dir(self, c: dict[str, Any]) -> str:
        return f"{self.out}/runs/{c['dataset']}/{c['partition']}/{c['label']}/seed{c['seed']}"

    def cell_json(self, wildcards) -> str:
        return json.dumps(self.cells[wildcard_key(wildcards)], sort_keys=True)

    def cell_shards(self, wildcards) -> str:
        """The cell's own partition draw (a tuning trial trains on its label's first cell's)."""
        if hasattr(wildcards, "trial"):  # config._tuning_cells: trials copy their label's first cell
            return self.shard_dir(wildcards.dataset, wildcards.partition)
        return f"results/shards/{wildcards.dataset}/{self.cells[wildcard_key(wildcards)]['partition_id']}"

    def cell_inputs(self, wildcards) -> dict[str, str]:
        """The cell's shards, and the pre-trained backbone its model loads (weights: proxy)."""
        pretrained = self.exp["datasets"][wildcards.dataset]["pretrained"]
        return {"shards": self.cell_shards(wildcards), **({"backbone": pretrained["out"]} if pretrained else {})}

    def base_cell_json(self, wildcards) -> str:
        return json.dumps(self.derived[wildcard_key(wildcards)], sort_keys=True)

    def base_run_dir(self, wildcards) -> str:
        return self.run_dir(self.derived[wildcard_key(wildcards)])

    def final_model(self, wildcards) -> str:
        """The base cell's final model a derived row is fine-tuned from."""
        from .engine.finetune import FINAL_MODEL

        return f"{self.base_run_dir(wildcards)}/{FINAL_MODEL}"

    def finetune_inputs(self, wildcards) -> dict[str, str]:
        """A derived row's inputs: its cell's, and its base cell's metrics.json (the base trains first;
        its final model, written before that file, is read by `fedrepro finetune`, not declared, so
        adding rows changes no training job). A final model newer than that metrics.json was put there
        after its cell trained: it is an input too, so the row is scored again (and `fedrepro finetune`
        compares it with the sha256 the base's provenance.json records). Only then: a row scored in the
        run that trained its base keeps the inputs Snakemake recorded for it (a row last scored from a
        replaced final model is scored once more after its base is retrained: its inputs changed)."""
        base, final = f"{self.base_run_dir(wildcards)}/metrics.json", self.final_model(wildcards)
        replaced = os.path.exists(base) and os.path.exists(final) and os.path.getmtime(final) > os.path.getmtime(base)
        return self.cell_inputs(wildcards) | {"base": base} | ({"final_model": final} if replaced else {})

    # -- results ----------------------------------------------------------------------------
    def all_metrics(self, wildcards=None) -> list[str]:
        return [f"{self.run_dir(c)}/metrics.json" for c in self.exp["cells"]]

    def panel_metrics(self, wildcards) -> list[str]:
        return [f"{self.run_dir(c)}/metrics.json" for c in self.exp["cells"]
                if c["dataset"] == wildcards.dataset and c["partition"] == wildcards.partition]

    def report_description(self) -> str:
        return os.path.abspath(self.landing) if os.path.exists(self.landing) else STATIC_LANDING

    def landing_spec_json(self, paper_short: str | None) -> str:
        seeds = sorted({c["seed"] for c in self.exp["cells"]})
        rounds = sorted({c["training"]["rounds"] for c in self.exp["cells"]})
        return json.dumps({"experiment": self.exp["experiment"], "rounds": ", ".join(map(str, rounds)), "seeds": seeds,
                           "tuning": bool(self.exp["tuning_cells"]), "paper": paper_short}, sort_keys=True)

    def final_outputs(self) -> list[str]:
        """The experiment's targets: tables, plots, summary and landing page (tuning's: TuningPlan.outputs)."""
        out, panels = self.out, sorted(self.partitions)
        return (
            [f"{out}/tables/{t}.{ext}" for t in TABLES for ext in ("md", "tex", "csv")]
            + [f"{out}/plots/curves_{d}_{p}.png" for d, p in panels]
            + [f"{out}/plots/clients_{d}_{p}.png" for d, p in panels]
            + [f"{out}/plots/tsne_{d}_{p}.png" for d, p in panels if self.embed_clients]
            + [f"results/shards/{p['dataset']}/{p['id']}.png" for p in self.exp["partitions"]]  # each draw's
            + [f"{out}/summary.json", self.landing]
        )


class TuningPlan:
    """Hyper-parameter tuning's jobs (workflow/rules/tuning.smk): one training job per trial and
    tuning seed, a selection per (dataset, partition, label), and the tuned final cells."""

    def __init__(self, exp: dict[str, Any]):
        self.exp = exp
        self.out = results_dir(exp)
        self.tuning = exp["tuning"] or {"labels": {}}
        self.cells = {(c["dataset"], c["partition"], c["label"], c["trial"], str(c["seed"])): c for c in exp["tuning_cells"]}
        self.tuned_labels = sorted({c["label"] for c in exp["cells"] if c.get("tuned")})
        self.limits = RuntimeLimits(exp)

    def runtime(self, rule: str):
        """The SLURM time limit of a tuning trial (RuntimeLimits)."""
        key = lambda w: (w.dataset, w.partition, w.label, w.trial, w.seed)
        return self.limits.resource(rule, lambda wildcards: self.cells[key(wildcards)])

    def selection_json(self, dataset: str, partition: str, label: str) -> str:
        return f"{self.out}/tuning/{dataset}/{partition}/{label}.json"

    def trial_dir(self, c: dict[str, Any]) -> str:
        return f"{self.out}/tuning/runs/{c['dataset']}/{c['partition']}/{c['label']}/{c['trial']}/seed{c['seed']}"

    def trial_cell_json(self, wildcards) -> str:
        key = (wildcards.dataset, wildcards.partition, wildcards.label, wildcards.trial, wildcards.seed)
        return json.dumps(self.cells[key], sort_keys=True)

    def trial_cells(self, wildcards) -> list[dict[str, Any]]:
        return [c for c in self.exp["tuning_cells"]
                if (c["dataset"], c["partition"], c["label"]) == (wildcards.dataset, wildcards.partition, wildcards.label)]

    def trial_metrics(self, wildcards) -> list[str]:
        return [f"{self.trial_dir(c)}/metrics.json" for c in self.trial_cells(wildcards)]

    def select_spec(self, wildcards) -> str:
        """The select rule's --spec (fedrepro.cli_args: the keys `fedrepro select` reads)."""
        plan = self.tuning["labels"][wildcards.label]
        runs = [{"trial": c["trial"], "seed": c["seed"], "metrics": f"{self.trial_dir(c)}/metrics.json"}
                for c in self.trial_cells(wildcards)]
        spec = {"dataset": wildcards.dataset, "partition": wildcards.partition, "label": wildcards.label,
                "method": plan["method"], "space": plan["space"], "trials": plan["trials"],
                "metric": self.tuning["metric"], "runs": runs}
        if self.tuning.get("select", "pooled") != "pooled":  # only then: the pooled selections' specs stay as they were
            spec["select"] = self.tuning["select"]
        return json.dumps(spec, sort_keys=True)

    def panel_selections(self, wildcards) -> list[str]:
        tuned = {(c["dataset"], c["partition"], c["label"]) for c in self.exp["tuning_cells"]}
        return [self.selection_json(wildcards.dataset, wildcards.partition, label) for label in self.tuning["labels"]
                if (wildcards.dataset, wildcards.partition, label) in tuned]

    def all_selections(self, wildcards=None) -> list[str]:
        keys = sorted({(c["dataset"], c["partition"], c["label"]) for c in self.exp["tuning_cells"]})
        return [self.selection_json(*k) for k in keys]

    def tuned_selection(self, wildcards) -> str:
        """The select rule's JSON whose winner a tuned final cell trains with."""
        return self.selection_json(wildcards.dataset, wildcards.partition, wildcards.label)

    def outputs(self) -> list[str]:
        """Tuning's targets: the table of selected hyper-parameters and a plot per panel (none without tuning)."""
        if not self.exp["tuning_cells"]:
            return []
        panels = sorted({(c["dataset"], c["partition"]) for c in self.exp["tuning_cells"]})
        return [f"{self.out}/tables/tuning.{ext}" for ext in ("csv", "md", "tex")] + [
            f"{self.out}/plots/tuning_{d}_{p}.png" for d, p in panels
        ]
