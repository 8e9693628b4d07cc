# Config validation and the helpers that turn an experiment into paths.
# All checks run here, at parse time: a bad config stops before any job starts.
import json
from pathlib import Path
import os
import re
import sys

from fedrepro.config import load_and_resolve
from fedrepro.overrides import record, snakemake_items
from fedrepro.registry import ConfigError

try:
    # The config files are read again with fedrepro's strict reader (the one `fedrepro validate`
    # uses: no YTE, no tags, no duplicate keys, aliases within a small budget, finite numbers),
    # whatever Snakemake's own reader made of them, merged as Snakemake merges them; then the
    # overrides of `--config set='training.rounds=1 seeds=[0,1]'` (fedrepro.overrides: the same
    # items as `fedrepro validate --set`). Then the JSON schema in workflow/schemas/config.schema.yaml,
    # every name and hyper-parameter against fedrepro's registries, the dataset sizes and the
    # budgets. (The workflow profiles make Snakemake itself read --configfile strictly too:
    # docs/security.md.)
    CONFIG_FILES = [str(p) for p in workflow.overwrite_configfiles] or [
        f"{workflow.basedir}/config/config.yaml"
    ]
    OVERRIDES = snakemake_items(workflow.config_settings)
    EXPERIMENT_CONFIG, EXP = load_and_resolve(CONFIG_FILES, OVERRIDES)
    record(OVERRIDES)  # the training jobs inherit them: provenance.json "overrides"
except ConfigError as exc:
    sys.exit(f"fedrepro: invalid experiment config: {exc}")

# The warnings `fedrepro validate` prints (clients that never train under the client sampling), from
# the same function, once: in the main Snakemake process, not again in each job that re-parses this file.
if workflow.is_main_process:
    from fedrepro.cli import untrained_warnings

    for line in untrained_warnings(EXP):
        print(f"fedrepro: warning: {line}", file=sys.stderr)

# Plugins: the config's `plugins:` key only names installed plugins it requires, and imports nothing
# (fedrepro.plugins.require, above). Modules named by the operator's FEDREPRO_PLUGINS reach every
# job (local or SLURM) through the environment the jobs inherit, looked up on PYTHONPATH and the
# installed packages only, never in the workflow folder Snakemake puts on sys.path.

NAME = EXP["experiment"]
OUT = f"results/{NAME}"
CELLS = {
    (c["dataset"], c["partition"], c["label"], str(c["seed"])): c for c in EXP["cells"]
}
PARTITIONS = {(p["dataset"], p["label"]): p for p in EXP["partitions"]}
# Fine-tuning rows scored from their base cell's final model (rule finetune, docs/evaluation.md),
# keyed like CELLS, each with its base cell: the other cells train (rule train).
from fedrepro.engine.finetune import FINAL_MODEL, derived_bases

DERIVED = derived_bases(EXP["cells"])
DERIVED_LABELS = sorted({k[2] for k in DERIVED})


def _one_of(names):
    return "|".join(re.escape(n) for n in sorted(names))


# Every wildcard matches only what this experiment defines (names are checked in full by
# fedrepro.config: letters, digits, '_', '.', '-'), so no path can be matched across folders.
wildcard_constraints:
    dataset=_one_of(EXP["datasets"]),
    partition=_one_of({p["label"] for p in EXP["partitions"]}),
    label=_one_of({c["label"] for c in EXP["cells"]}),
    seed=r"\d+",
    trial=r"t[0-9a-f]{8}",
    pid=r"[0-9a-f]{10}",
    prepared=r"[0-9a-f]{8}",
    phash=r"[0-9a-f]{10}",


def raw_marker(dataset):
    return f"results/raw/{dataset}/dataset-{EXP['datasets'][dataset]['prepared_id']}.json"


def shard_dir(dataset, partition):
    return f"results/shards/{dataset}/{PARTITIONS[(dataset, partition)]['id']}"


def spec_by_id(wildcards):
    for p in EXP["partitions"]:
        if p["dataset"] == wildcards.dataset and p["id"] == wildcards.pid:
            return json.dumps(p["spec"], sort_keys=True)
    raise ValueError(f"no partition {wildcards.pid} of {wildcards.dataset} in this experiment")


def cell_json(wildcards):
    key = (wildcards.dataset, wildcards.partition, wildcards.label, wildcards.seed)
    return json.dumps(CELLS[key], sort_keys=True)


def base_cell_json(wildcards):
    key = (wildcards.dataset, wildcards.partition, wildcards.label, wildcards.seed)
    return json.dumps(DERIVED[key], sort_keys=True)


def base_run_dir(wildcards):
    return run_dir(DERIVED[(wildcards.dataset, wildcards.partition, wildcards.label, wildcards.seed)])


def finetune_inputs(wildcards):
    """A derived row's inputs: its cell's, and its base cell's metrics.json (the base trains first;
    its final model, written before that file, is read by `fedrepro finetune`, not declared, so
    adding rows changes no training job)."""
    return cell_inputs(wildcards) | {"base": f"{base_run_dir(wildcards)}/metrics.json"}


def cell_shards(wildcards):
    return shard_dir(wildcards.dataset, wildcards.partition)


def cell_inputs(wildcards):
    """The cell's shards, and the pre-trained backbone its model loads (weights: proxy)."""
    pretrained = EXP["datasets"][wildcards.dataset]["pretrained"]
    return {"shards": cell_shards(wildcards), **({"backbone": pretrained["out"]} if pretrained else {})}


def pretrain_spec_json(wildcards):
    for ds, info in EXP["datasets"].items():
        if ds == wildcards.dataset and info["pretrained"] and Path(info["pretrained"]["out"]).stem == wildcards.phash:
            return json.dumps(info["pretrained"]["spec"], sort_keys=True)
    raise ValueError(f"no pre-trained backbone {wildcards.phash} of {wildcards.dataset} in this experiment")


def run_dir(c):
    return f"{OUT}/runs/{c['dataset']}/{c['partition']}/{c['label']}/seed{c['seed']}"


def all_metrics(wildcards=None):
    return [f"{run_dir(c)}/metrics.json" for c in EXP["cells"]]


def panel_metrics(wildcards):
    return [
        f"{run_dir(c)}/metrics.json"
        for c in EXP["cells"]
        if c["dataset"] == wildcards.dataset and c["partition"] == wildcards.partition
    ]


TABLES = [
    "accuracy",
    "accuracy_client_mean",
    "accuracy_client_std",
    "accuracy_worst10",
    "macro_f1",
]


# The report's landing page (`report:` in the Snakefile, fedrepro/report/landing.py): written by the
# report_page rule; until it exists the report falls back to workflow/report/description.rst.
LANDING = f"{OUT}/report/description.rst"


def report_description():
    return os.path.abspath(LANDING) if os.path.exists(LANDING) else "workflow/report/description.rst"


def landing_spec_json(wildcards=None):
    seeds = sorted({c["seed"] for c in EXP["cells"]})
    rounds = sorted({c["training"]["rounds"] for c in EXP["cells"]})
    return json.dumps({"experiment": NAME, "rounds": ", ".join(map(str, rounds)), "seeds": seeds,
                       "tuning": bool(EXP["tuning_cells"]), "paper": PAPER.paper.short if PAPER else None}, sort_keys=True)


# clients whose representations are laid out by t-SNE after training (evaluation.embed_clients)
EMBED_CLIENTS = EXP["cells"] and (EXP["cells"][0]["evaluation"].get("embed_clients") or [])


def final_outputs():
    panels = sorted(PARTITIONS)
    return (
        [f"{OUT}/tables/{t}.{ext}" for t in TABLES for ext in ("md", "tex", "csv")]
        + [f"{OUT}/plots/curves_{d}_{p}.png" for d, p in panels]
        + [f"{OUT}/plots/clients_{d}_{p}.png" for d, p in panels]
        + [f"{OUT}/plots/tsne_{d}_{p}.png" for d, p in panels if EMBED_CLIENTS]
        + [f"{shard_dir(d, p)}.png" for d, p in panels]
        + [f"{OUT}/summary.json", LANDING]
        + tuning_outputs()
    )


# -- tuning (workflow/rules/tuning.smk) ------------------------------------------------
TUNING = EXP["tuning"] or {"labels": {}}
TUNING_CELLS = {
    (c["dataset"], c["partition"], c["label"], c["trial"], str(c["seed"])): c
    for c in EXP["tuning_cells"]
}


def selection_json(dataset, partition, label):
    return f"{OUT}/tuning/{dataset}/{partition}/{label}.json"


def trial_dir(c):
    return f"{OUT}/tuning/runs/{c['dataset']}/{c['partition']}/{c['label']}/{c['trial']}/seed{c['seed']}"


def trial_cell_json(wildcards):
    key = (wildcards.dataset, wildcards.partition, wildcards.label, wildcards.trial, wildcards.seed)
    return json.dumps(TUNING_CELLS[key], sort_keys=True)


def _trial_cells(wildcards):
    return [
        c
        for c in EXP["tuning_cells"]
        if (c["dataset"], c["partition"], c["label"])
        == (wildcards.dataset, wildcards.partition, wildcards.label)
    ]


def trial_metrics(wildcards):
    return [f"{trial_dir(c)}/metrics.json" for c in _trial_cells(wildcards)]


def select_spec(wildcards):
    plan = TUNING["labels"][wildcards.label]
    runs = [
        {"trial": c["trial"], "seed": c["seed"], "metrics": f"{trial_dir(c)}/metrics.json"}
        for c in _trial_cells(wildcards)
    ]
    spec = {
        "dataset": wildcards.dataset,
        "partition": wildcards.partition,
        "label": wildcards.label,
        "method": plan["method"],
        "space": plan["space"],
        "trials": plan["trials"],
        "metric": TUNING["metric"],
        "runs": runs,
    }
    return json.dumps(spec, sort_keys=True)


def panel_selections(wildcards):
    return [
        selection_json(wildcards.dataset, wildcards.partition, label)
        for label in TUNING["labels"]
        if (wildcards.dataset, wildcards.partition, label)
        in {(c["dataset"], c["partition"], c["label"]) for c in EXP["tuning_cells"]}
    ]


def all_selections(wildcards=None):
    keys = sorted({(c["dataset"], c["partition"], c["label"]) for c in EXP["tuning_cells"]})
    return [selection_json(*k) for k in keys]


def tuning_outputs():
    if not EXP["tuning_cells"]:
        return []
    panels = sorted({(c["dataset"], c["partition"]) for c in EXP["tuning_cells"]})
    return [f"{OUT}/tables/tuning.{ext}" for ext in ("csv", "md", "tex")] + [
        f"{OUT}/plots/tuning_{d}_{p}.png" for d, p in panels
    ]


TUNED_LABELS = sorted({c["label"] for c in EXP["cells"] if c.get("tuned")})


def tuned_selection(wildcards):
    """The select rule's JSON whose winner a tuned final cell trains with."""
    return selection_json(wildcards.dataset, wildcards.partition, wildcards.label)
