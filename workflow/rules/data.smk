# Raw data -> Parquet client shards (content-addressed by the partition spec's hash).


rule prepare_data:
    output:
        "results/raw/{dataset}/dataset-{prepared}.json",
    conda:
        "../envs/fedrepro.yaml"
    log:
        "results/logs/prepare/{dataset}-{prepared}.log",
    params:
        ds_params=lambda wc: json.dumps(EXP["datasets"][wc.dataset]["params"]),
        root=lambda wc: f"results/raw/{wc.dataset}",
    resources:
        runtime=60,
    message:
        "preparing raw data of {wildcards.dataset}"
    shell:
        "fedrepro prepare {wildcards.dataset:q} --root {params.root:q} "
        "--params {params.ds_params:q} --out {output:q} > {log:q} 2>&1"


rule partition:
    input:
        lambda wc: ancient(PLAN.raw_marker(wc.dataset)),
    output:
        directory("results/shards/{dataset}/{pid}"),
    conda:
        "../envs/fedrepro.yaml"
    log:
        "results/logs/partition/{dataset}-{pid}.log",
    params:
        spec=PLAN.spec_by_id,
        root=lambda wc: f"results/raw/{wc.dataset}",
    resources:
        mem_mb=8000,
        runtime=60,
    message:
        "partitioning {wildcards.dataset} into shards {wildcards.pid}"
    shell:
        "fedrepro partition --spec {params.spec:q} --root {params.root:q} "
        "--out {output:q} > {log:q} 2>&1"


rule plot_partition:
    input:
        "results/shards/{dataset}/{pid}",
    output:
        report(
            "results/shards/{dataset}/{pid}.png",
            caption="../report/partition.rst",
            category="Partitions",
            labels={"dataset": "{dataset}", "partition": "{pid}"},
        ),
    conda:
        "../envs/fedrepro.yaml"
    log:
        "results/logs/partition/{dataset}-{pid}.plot.log",
    localrule: True
    shell:
        "fedrepro plot-partition {input:q} {output:q} > {log:q} 2>&1"
