# fedrepro: partition -> [tune -> select] -> train (one job per cell) -> aggregate -> tables, plots, report.
#
#   snakemake --workflow-profile workflow/profiles/local                     # the default experiment
#   snakemake --workflow-profile workflow/profiles/local --configfile config/test.yaml
#   snakemake --workflow-profile workflow/profiles/slurm --configfile config/experiments/X.yaml
from snakemake.utils import min_version

min_version("9.0")


# The embedded default experiment. An experiment given with --configfile replaces it
# (Snakemake would otherwise deep-merge the two and train the union of their methods).
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/tuning.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/papers.smk"


# The landing page of `snakemake --report`: the main table and the learning curves (the
# report_page rule writes it with the results; the static text until then).
report: PLAN.report_description()


rule all:
    default_target: True
    input:
        PLAN.final_outputs(),
        TUNING.outputs(),
        paper_outputs(),
