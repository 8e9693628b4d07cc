# All cells of the experiment -> summary files -> tables and plots (cheap, run locally).
from fedrepro.custody import expected_token
from fedrepro.planning import TABLES


rule aggregate:
    input:
        PLAN.all_metrics,
    output:
        csv=f"{OUT}/summary.csv",
        json=f"{OUT}/summary.json",
        curves=f"{OUT}/curves.csv",
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/aggregate.log",
    params:
        # per metrics file (PLAN.all_metrics' order) the cell it must belong to: a copied, moved or
        # stale file is an error naming it, not a wrong row
        expect=lambda wildcards: [expected_token(c) for c in EXP["cells"]],
    localrule: True
    shell:
        "fedrepro aggregate {input:q} --csv {output.csv:q} --json {output.json:q} "
        "--curves {output.curves:q} --expect {params.expect:q} > {log:q} 2>&1"


rule tables:
    input:
        f"{OUT}/summary.csv",
    output:
        [
            report(
                f"{OUT}/tables/{t}.csv",
                caption="../report/table.rst",
                category="Tables",
                labels={"table": t},
            )
            for t in TABLES
        ],
        [f"{OUT}/tables/{t}.{ext}" for t in TABLES for ext in ("md", "tex", "meta.json")],
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/tables.log",
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    localrule: True
    shell:
        "fedrepro tables --summary {input:q} --out-dir {params.out_dir:q} > {log:q} 2>&1"


rule plots:
    input:
        PLAN.panel_metrics,
    output:
        curves=report(
            f"{OUT}/plots/curves_{{dataset}}_{{partition}}.png",
            caption="../report/curves.rst",
            category="Learning curves",
            labels={"dataset": "{dataset}", "partition": "{partition}"},
        ),
        clients=report(
            f"{OUT}/plots/clients_{{dataset}}_{{partition}}.png",
            caption="../report/clients.rst",
            category="Per-client accuracy",
            labels={"dataset": "{dataset}", "partition": "{partition}"},
        ),
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/plots_{{dataset}}_{{partition}}.log",
    localrule: True
    shell:
        "fedrepro plots {input:q} --dataset {wildcards.dataset:q} --partition {wildcards.partition:q} "
        "--curves {output.curves:q} --clients {output.clients:q} > {log:q} 2>&1"


rule tsne_plot:
    input:
        PLAN.panel_metrics,
    output:
        report(
            f"{OUT}/plots/tsne_{{dataset}}_{{partition}}.png",
            caption="../report/tsne.rst",
            category="Representations (t-SNE)",
            labels={"dataset": "{dataset}", "partition": "{partition}"},
        ),
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/tsne_{{dataset}}_{{partition}}.log",
    localrule: True
    shell:
        "fedrepro plots {input:q} --dataset {wildcards.dataset:q} --partition {wildcards.partition:q} "
        "--tsne {output:q} > {log:q} 2>&1"


rule report_page:
    input:
        summary=f"{OUT}/summary.csv",
        curves=[f"{OUT}/plots/curves_{d}_{p}.png" for d, p in sorted(PLAN.partitions)],
    output:
        PLAN.landing,
    conda:
        "../envs/fedrepro.yaml"
    log:
        f"{OUT}/logs/report_page.log",
    params:
        spec=lambda wildcards: PLAN.landing_spec_json(PAPER.paper.short if PAPER else None),
    localrule: True
    shell:
        "fedrepro report-page --summary {input.summary:q} --spec {params.spec:q} --curves {input.curves:q} "
        "--out {output:q} > {log:q} 2>&1"


# The main table on the console when the whole run succeeded.
onsuccess:
    from fedrepro.report.landing import console_summary

    text = console_summary(f"{OUT}/summary.csv")
    if text:
        print(text, file=sys.stderr)
