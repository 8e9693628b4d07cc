# The experiment's config and its validation: all checks run here, at parse time, so a bad config
# stops before any job starts. What the jobs are (paths, specs, targets) is fedrepro.planning's.
import json
import os
import sys

from fedrepro.config import load_and_resolve
from fedrepro.cost import workflow_lines
from fedrepro.overrides import snakemake_items
from fedrepro.planning import WorkflowPlan, one_of, set_job_environment, untrained_warnings
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
except ConfigError as exc:
    sys.exit(f"fedrepro: invalid experiment config: {exc}")

# The warnings `fedrepro validate` prints (clients that never train under the client sampling), and
# its estimate of the experiment's cost (fedrepro.cost: from a cached calibration only, never measured
# here, and never a failure), from the same functions, once: in the main Snakemake process, not again
# in each job that re-parses this file.
if workflow.is_main_process:
    for line in untrained_warnings(EXP):
        print(f"fedrepro: warning: {line}", file=sys.stderr)
    for line in workflow_lines(EXP):
        print(f"fedrepro: {line}", file=sys.stderr)

# Plugins: the config's `plugins:` key only names installed plugins it requires, and imports nothing
# (fedrepro.plugins.require, above). Modules named by the operator's FEDREPRO_PLUGINS reach every
# job (local or SLURM) through the environment the jobs inherit, looked up on PYTHONPATH and the
# installed packages only, never in the workflow folder Snakemake puts on sys.path.

# The environment every job inherits (the overrides, the status and TensorBoard folders): set here
# and nowhere else in the workflow.
set_job_environment(EXP, OVERRIDES)

# The jobs' paths, specs and targets (fedrepro.planning; tuning's: workflow/rules/tuning.smk).
PLAN = WorkflowPlan(EXP)
OUT = PLAN.out


# Every wildcard matches only what this experiment defines (names are checked in full by
# fedrepro.config: letters, digits, '_', '.', '-'), so no path can be matched across folders.
wildcard_constraints:
    dataset=one_of(EXP["datasets"]),
    partition=one_of({p["label"] for p in EXP["partitions"]}),
    label=one_of({c["label"] for c in EXP["cells"]}),
    seed=r"\d+",
    trial=r"t[0-9a-f]{8}",
    pid=r"[0-9a-f]{10}",
    prepared=r"[0-9a-f]{8}",
    phash=r"[0-9a-f]{10}",
