# One training job per cell (dataset x partition x method label x seed).


rule train:
    input:
        cell_shards,
    output:
        metrics=f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/metrics.json",
        provenance=f"{OUT}/runs/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}/provenance.json",
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/train/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}.log",
    benchmark:
        f"{OUT}/benchmarks/train/{{dataset}}_{{partition}}_{{label}}_seed{{seed}}.tsv"
    params:
        cell=cell_json,
        # Not an output: it must survive a killed job so the rerun resumes from it.
        checkpoint=f"{OUT}/checkpoints/{{dataset}}/{{partition}}/{{label}}/seed{{seed}}.pt",
        out_dir=lambda wildcards, output: os.path.dirname(output.metrics),
    threads: 2
    resources:
        gpu=1,
        mem_mb=16000,
        runtime=240,
    message:
        "training cell {wildcards.dataset}/{wildcards.partition}/{wildcards.label}/seed{wildcards.seed}"
    shell:
        "fedrepro train --cell {params.cell:q} --shards {input:q} --out-dir {params.out_dir:q} "
        "--checkpoint {params.checkpoint:q} --threads {threads} > {log:q} 2>&1"
