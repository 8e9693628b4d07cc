# Config validation and the helpers that turn an experiment into paths.
# All checks run here, at parse time: a bad config stops before any job starts.
import json
import os
import sys

from fedrepro.config import resolve_experiment
from fedrepro.registry import ConfigError

try:
    # Checks the JSON schema in workflow/schemas/config.schema.yaml, then every name and
    # hyper-parameter against fedrepro's registries.
    EXP = resolve_experiment(config)
except ConfigError as exc:
    sys.exit(f"fedrepro: invalid experiment config: {exc}")

NAME = EXP["experiment"]
OUT = f"results/{NAME}"
CELLS = {
    (c["dataset"], c["partition"], c["label"], str(c["seed"])): c for c in EXP["cells"]
}
PARTITIONS = {(p["dataset"], p["label"]): p for p in EXP["partitions"]}


wildcard_constraints:
    dataset="|".join(EXP["datasets"]),
    seed=r"\d+",
    pid=r"[0-9a-f]{10}",


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


def cell_shards(wildcards):
    return shard_dir(wildcards.dataset, wildcards.partition)


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


def final_outputs():
    panels = sorted(PARTITIONS)
    return (
        [f"{OUT}/tables/{t}.{ext}" for t in TABLES for ext in ("md", "tex", "csv")]
        + [f"{OUT}/plots/curves_{d}_{p}.png" for d, p in panels]
        + [f"{OUT}/plots/clients_{d}_{p}.png" for d, p in panels]
        + [f"{shard_dir(d, p)}.png" for d, p in panels]
        + [f"{OUT}/summary.json"]
    )
