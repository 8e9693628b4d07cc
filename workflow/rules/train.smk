# One training job per cell (dataset x partition x method label x seed).


rule pretrain_backbone:
    input:
        lambda wc: ancient(PLAN.raw_marker(wc.dataset)),
    output:
        "results/pretrained/{dataset}/{phash}.pt",
    conda:
        "../envs/fedrepro.yaml"
    log:
        "results/logs/pretrain/{dataset}-{phash}.log",
    params:
        spec=PLAN.pretrain_spec_json,
        root=lambda wc: f"results/raw/{wc.dataset}",
    threads: 2
    resources:
        mem_mb=8000,
        runtime=120,
    message:
        "pre-training the ViT backbone of {wildcards.dataset} on its held-out proxy ({wildcards.phash})"
    shell:
        "fedrepro pretrain-backbone --spec {params.spec:q} --root {params.root:q} --out {output:q} "
        "--threads {threads} > {log:q} 2>&1"


rule train:
    input:
        unpack(PLAN.cell_inputs),
    # update(): Snakemake does not delete a finished cell's results before a forced or triggered
    # retrain (it backs them up and puts them back if the job fails); `fedrepro train` replaces
    # them only on success, so a failed retrain never loses the earlier result.
    output:
        metrics=update(f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/metrics.json"),
        provenance=update(f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/provenance.json"),
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
        gpu=1,  # SLURM: GPUs of the submitted job (--gpus); the slurm-packed profile packs cells on one
        gpu_slots=1,  # locally: one of the profile's `gpu_slots` (cells training at once on the GPUs)
        mem_mb=16000,
        runtime=PLAN.runtime("train"),  # SLURM -t: the cell's estimate x a margin, bounded (docs/cost.md)
    message:
        "training cell {wildcards.dataset}/{wildcards.partition}/{wildcards.label}/seed{wildcards.seed}"
    shell:
        "fedrepro train --cell {params.cell:q} --shards {input.shards:q} --out-dir {params.out_dir:q} "
        "--checkpoint {params.checkpoint:q} --threads {threads} > {log:q} 2>&1"


# A fine-tuning row scored only after training (fedrepro.engine.finetune.derived_bases) is not
# trained again: its base cell's final model is fine-tuned and scored; the metrics are those the
# row's own training writes. Rule train is unchanged, so no trained cell reruns for it.
ruleorder: finetune > train


rule finetune:
    input:
        unpack(PLAN.finetune_inputs),
    output:
        metrics=update(f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/metrics.json"),
        provenance=update(f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/provenance.json"),
    wildcard_constraints:
        label=one_of(PLAN.derived_labels) if PLAN.derived_labels else "(?!)",
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/finetune/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}.log",
    benchmark:
        f"{OUT}/benchmarks/finetune/{{dataset}}_{{partition}}_{{label}}_seed{{seed}}.tsv"
    params:
        cell=PLAN.cell_json,
        base=PLAN.base_cell_json,
        final_model=PLAN.final_model,
        out_dir=lambda wildcards, output: os.path.dirname(output.metrics),
    threads: 2
    resources:
        gpu=1,
        gpu_slots=1,
        mem_mb=16000,
        runtime=PLAN.runtime("finetune"),
    message:
        "fine-tuning row {wildcards.dataset}/{wildcards.partition}/{wildcards.label}/seed{wildcards.seed} from its base cell"
    shell:
        "fedrepro finetune --cell {params.cell:q} --base-cell {params.base:q} --final-model {params.final_model:q} "
        "--shards {input.shards:q} --out-dir {params.out_dir:q} --threads {threads} > {log:q} 2>&1"


# When jobs will run (not in a dry run): the plan of cells (`fedrepro status` lists the pending ones
# and estimates the time left from the experiment's config recorded with them), and a thread that
# prints one line per evaluation of every training cell to this console, from the status files the
# training processes rewrite each round (fedrepro/progress.py; the status folder is in the jobs'
# environment: fedrepro.planning.set_job_environment).
onstart:
    from fedrepro.diskspace import stop_if_full
    from fedrepro.progress import ConsoleWatcher, write_plan

    stop_if_full(OUT)  # a full disk: one line naming the folder and its free space, before any job (no stack)
    write_plan(OUT, EXP["cells"], EXPERIMENT_CONFIG)
    ConsoleWatcher(f"{OUT}/status").start()


# When the run fails: one line where a full disk may explain it (a job on a full disk may leave an empty log).
onerror:
    from fedrepro.diskspace import failure_note

    note = failure_note(OUT)
    if note:
        print(note, file=sys.stderr)
