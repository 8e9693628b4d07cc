# Hyper-parameter tuning on validation data (config `tuning:`): one training job per trial
# (dataset x partition x method label x trial x tuning seed) scored on validation carved from
# each client's training split -> select (every trial's validation score and the winner) ->
# the final cells of tuned labels (rule train_tuned: rule train plus the selection) train with
# the winner; labels with nothing to tune go straight to rule train.
# Its paths and specs: fedrepro.planning.TuningPlan.
from fedrepro.planning import TuningPlan

TUNING = TuningPlan(EXP)


rule tune_trial:
    input:
        unpack(PLAN.cell_inputs),  # the shards, and a pre-trained backbone where the model loads one
    output:
        metrics=f"{OUT}/tuning/runs/{{dataset}}/{{partition}}/{{label}}/{{trial}}/seed{{seed}}/metrics.json",
        provenance=f"{OUT}/tuning/runs/{{dataset}}/{{partition}}/{{label}}/{{trial}}/seed{{seed}}/provenance.json",
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/tuning/{{dataset}}/{{partition}}/{{label}}/{{trial}}/seed{{seed}}.log",
    benchmark:
        f"{OUT}/benchmarks/tuning/{{dataset}}_{{partition}}_{{label}}_{{trial}}_seed{{seed}}.tsv"
    params:
        cell=TUNING.trial_cell_json,
        # Not an output: it must survive a killed job so the rerun resumes from it.
        checkpoint=f"{OUT}/checkpoints/tuning/{{dataset}}/{{partition}}/{{label}}/{{trial}}/seed{{seed}}.pt",
        out_dir=lambda wildcards, output: os.path.dirname(output.metrics),
    threads: 2
    resources:
        gpu=1,
        gpu_slots=1,  # locally: one of the profile's `gpu_slots`, as a training cell
        mem_mb=16000,
        runtime=TUNING.runtime("tune_trial"),
    message:
        "tuning trial {wildcards.dataset}/{wildcards.partition}/{wildcards.label}/{wildcards.trial}/seed{wildcards.seed}"
    shell:
        "fedrepro train --cell {params.cell:q} --shards {input.shards:q} --out-dir {params.out_dir:q} "
        "--checkpoint {params.checkpoint:q} --threads {threads} > {log:q} 2>&1"


rule select:
    input:
        TUNING.trial_metrics,
    output:
        f"{OUT}/tuning/{{dataset}}/{{partition}}/{{label}}.json",
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/tuning/select_{{dataset}}_{{partition}}_{{label}}.log",
    params:
        spec=TUNING.select_spec,
    localrule: True
    shell:
        "fedrepro select --spec {params.spec:q} --out {output:q} > {log:q} 2>&1"


rule tuning_table:
    input:
        TUNING.all_selections,
    output:
        csv=report(
            f"{OUT}/tables/tuning.csv",
            caption="../report/tuning_table.rst",
            category="Tuning",
            labels={"table": "selected hyper-parameters"},
        ),
        md=f"{OUT}/tables/tuning.md",
        tex=f"{OUT}/tables/tuning.tex",
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/tuning/table.log",
    params:
        prefix=lambda wildcards, output: output.csv.removesuffix(".csv"),
    localrule: True
    shell:
        "fedrepro tuning-report {input:q} --table {params.prefix:q} > {log:q} 2>&1"


rule tuning_plot:
    input:
        TUNING.panel_selections,
    output:
        report(
            f"{OUT}/plots/tuning_{{dataset}}_{{partition}}.png",
            caption="../report/tuning_plot.rst",
            category="Tuning",
            labels={"dataset": "{dataset}", "partition": "{partition}"},
        ),
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/tuning/plot_{{dataset}}_{{partition}}.log",
    localrule: True
    shell:
        "fedrepro tuning-report {input:q} --plot {output:q} > {log:q} 2>&1"


if TUNING.tuned_labels:

    # A tuned label's final cell: rule train's job with the selected hyper-parameters (`--tuned`).
    # Rule train itself stays unchanged, so adding tuning reruns no existing untuned cell.
    ruleorder: train_tuned > train

    rule train_tuned:
        input:
            unpack(PLAN.cell_inputs),  # the shards, and a pre-trained backbone where the model loads one
            tuned=TUNING.tuned_selection,
        output:
            metrics=f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/metrics.json",
            provenance=f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/provenance.json",
        wildcard_constraints:
            label=one_of(TUNING.tuned_labels),
        conda:
            "../envs/fedrepro.yaml"
        log:
            f"{OUT}/logs/train/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}.log",
        benchmark:
            f"{OUT}/benchmarks/train/{{dataset}}_{{partition}}_{{label}}_seed{{seed}}.tsv"
        params:
            cell=PLAN.cell_json,
            # Not an output: it must survive a killed job so the rerun resumes from it.
            checkpoint=f"{OUT}/checkpoints/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}.pt",
            out_dir=lambda wildcards, output: os.path.dirname(output.metrics),
        threads: 2
        resources:
            gpu=1,
            gpu_slots=1,  # locally: one of the profile's `gpu_slots`, as a training cell
            mem_mb=16000,
            runtime=PLAN.runtime("train_tuned"),
        message:
            "training tuned cell {wildcards.dataset}/{wildcards.partition}/{wildcards.label}/seed{wildcards.seed}"
        shell:
            "fedrepro train --cell {params.cell:q} --shards {input.shards:q} --out-dir {params.out_dir:q} "
            "--checkpoint {params.checkpoint:q} --threads {threads} --tuned {input.tuned:q} > {log:q} 2>&1"
