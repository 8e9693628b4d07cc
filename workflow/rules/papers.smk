# Paper tables beside the published numbers (config key paper_tables, config/README.md; data in
# config/papers/published/). One target per table, <paper>_<table> (e.g. fedcrc_table1), builds
# exactly the cells that table needs; <paper>_paper builds every table and figure of the config.
# Where the paper has a readings ledger (config/papers/published/readings/<paper>.yaml), both
# targets also render it (rule paper_readings) beside the tables.


include: "paper_common.smk"


if PAPER:

    wildcard_constraints:
        paper_table="|".join(re.escape(t) for t in PAPER.tables),
        paper_figure="|".join(re.escape(f) for f in PAPER.figures) or "(?!)",

    rule paper_table:
        input:
            published=str(PAPER.paper.path),
            metrics=paper_table_metrics,
        output:
            html=report(
                f"{PAPER_OUT}/{{paper_table}}.html",
                caption="../report/paper_table.rst",
                category=paper_category,
                subcategory=lambda wc: paper_subcategory(wc.paper_table),
                labels={"entry": "1 comparison with the paper"},
            ),
            csv=report(
                f"{PAPER_OUT}/{{paper_table}}.csv",
                caption="../report/paper_cells.rst",
                category=paper_category,
                subcategory=lambda wc: paper_subcategory(wc.paper_table),
                labels={"entry": "2 cells: seeds, intervals, differences (CSV)"},
            ),
            tests=report(
                f"{PAPER_OUT}/{{paper_table}}_tests.csv",
                caption="../report/paper_tests.rst",
                category=paper_category,
                subcategory=lambda wc: paper_subcategory(wc.paper_table),
                labels={"entry": "3 paired tests (CSV)"},
            ),
            md=f"{PAPER_OUT}/{{paper_table}}.md",
            tex=f"{PAPER_OUT}/{{paper_table}}.tex",
        conda:
            "../envs/fedrepro.yaml"
        log:
            f"{OUT}/logs/paper/{{paper_table}}.log",
        params:
            spec=lambda wc: json.dumps(PAPER.spec(table=wc.paper_table), sort_keys=True),
            prefix=lambda wc: f"{PAPER_OUT}/{wc.paper_table}",
        localrule: True
        shell:
            "fedrepro paper-table {input.metrics:q} --published {input.published:q} "
            "--spec {params.spec:q} --out-prefix {params.prefix:q} > {log:q} 2>&1"

    rule paper_figure:
        input:
            published=str(PAPER.paper.path),
            metrics=paper_figure_metrics,
        output:
            report(
                f"{PAPER_OUT}/{{paper_figure}}.png",
                caption="../report/paper_figure.rst",
                category=paper_category,
                subcategory=lambda wc: paper_subcategory(
                    PAPER.figures[wc.paper_figure].table.id
                ),
                labels=lambda wc: {
                    "entry": f"4 {PAPER.figures[wc.paper_figure].figure.get('caption', wc.paper_figure)}"
                },
            ),
        conda:
            "../envs/fedrepro.yaml"
        log:
            f"{OUT}/logs/paper/{{paper_figure}}.log",
        params:
            spec=lambda wc: json.dumps(PAPER.spec(figure=wc.paper_figure), sort_keys=True),
        localrule: True
        shell:
            "fedrepro paper-figure {input.metrics:q} --published {input.published:q} "
            "--spec {params.spec:q} --out {output:q} > {log:q} 2>&1"

    if READINGS:

        rule paper_readings:
            input:
                ledger=READINGS,
                published=str(PAPER.paper.path),
            output:
                html=report(
                    f"{PAPER_OUT}/readings.html",
                    caption="../report/paper_readings.rst",
                    category=paper_category,
                    subcategory="0 · Readings ledger",
                    labels={"entry": "readings ledger: [RECON] and [PAPER≠CODE] choices"},
                ),
                md=f"{PAPER_OUT}/readings.md",
            conda:
                "../envs/fedrepro.yaml"
            log:
                f"{OUT}/logs/paper/readings.log",
            params:
                paper=PAPER.paper.id,
            localrule: True
            shell:
                "fedrepro readings {params.paper:q} --ledger {input.ledger:q} "
                "--md {output.md:q} --html {output.html:q} > {log:q} 2>&1"

    for _tid in PAPER.tables:

        rule:
            name:
                f"{PAPER.paper.id}_{_tid}"
            input:
                paper_table_outputs(_tid),
            localrule: True

    rule:
        name:
            f"{PAPER.paper.id}_paper"
        input:
            paper_outputs(),
        localrule: True
