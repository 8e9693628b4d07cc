"""The `fedrepro` command: the steps the Snakemake rules call, plus registry listings."""

from __future__ import annotations

import argparse
import json
import errno
import sys
from pathlib import Path

from . import cli_args as check
from .registry import ConfigError


def _print_entries(title: str, registry, extra=lambda e: []) -> None:
    print(f"{title}:")
    for e in registry:
        print(f"  {e.name:<16} {e.summary}")
        for line in extra(e):
            print(f"  {'':<16} {line}")
        for key, p in e.params.items():
            print(f"  {'':<16}   {key} = {p.default!r}: {p.doc}")


def cmd_list(args) -> None:
    if args.what == "datasets":
        from .data.datasets import DATASETS

        _print_entries("datasets", DATASETS, lambda e: [f"size: {e.info['size']}", f"shape: {e.obj.sample_shape}, classes: {e.obj.num_classes}",
                                                        f"source: {e.info['source']}"])
    elif args.what == "partitioners":
        from .data.partitioners import PARTITIONERS

        _print_entries("partitioners", PARTITIONERS)
        print("every partition also takes: num_clients, seed, pool (merge official train+test), "
              "split: {test_fraction=0.25, val_fraction=0.0, stratify=true}")
    elif args.what == "methods":
        from .methods import METHODS

        from .tuning import default_space_lines

        _print_entries("methods", METHODS, lambda e: ([f"paper: {e.info['paper']}"] if e.info.get("paper") else [])
                       + default_space_lines(e.name))
    else:
        from .models import MODELS

        _print_entries("models", MODELS, lambda e: [f"inputs: {e.info['inputs']}"] if e.info.get("inputs") else [])


def cmd_validate(args) -> None:
    import os

    from .config import load_config, resolve_experiment
    from .registry import ALLOW_LARGE_ENV

    if args.allow_large_budgets:
        os.environ[ALLOW_LARGE_ENV] = "1"
    for path in args.configs:
        exp = resolve_experiment(load_config(path))
        tuning = (f", {len(exp['tuning_cells'])} tuning trial run(s) for {len(exp['tuning']['labels'])} method label(s)"
                  if exp["tuning"] else "")
        print(f"{path}: ok, experiment '{exp['experiment']}': {len(exp['partitions'])} partition(s), {len(exp['cells'])} cell(s)"
              + tuning)
        for line in untrained_warnings(exp):
            print(f"{path}: warning: {line}", file=sys.stderr)
        for line in paper_table_lines(path, exp):
            print(f"{path}: {line}")


def paper_table_lines(path, exp: dict) -> list[str]:
    """Check the config's `paper_tables` (every cell a mapped layout names is produced by the
    experiment) and say how much of each paper table it covers; [] without paper_tables."""
    from .config import load_config
    from .report.papers import coverage_lines, plan_paper_tables

    plan = plan_paper_tables(load_config(path), exp, config_path=path)
    return coverage_lines(plan) if plan else []


def untrained_warnings(exp: dict) -> list[str]:
    """One line per (partition, training schedule, seed) whose client sampling leaves some
    clients untrained at the end: they are scored by the experiment's `evaluation.untrained`."""
    from .engine.engine import sampling_schedule, trained_rounds

    specs = {(p["dataset"], p["label"]): p["spec"] for p in exp["partitions"]}
    seen: dict[tuple, list[str]] = {}
    for c in exp["cells"]:
        spec, t = specs[(c["dataset"], c["partition"])], c["training"]
        n = spec["num_clients"] - spec["unseen_clients"]
        key = (c["dataset"], c["partition"], n, t["participation"], t["rounds"], c["seed"])
        seen.setdefault(key, []).append(c["label"])
    lines = []
    for (ds, part, n, participation, rounds, seed), labels in seen.items():
        never = [i for i, r in trained_rounds(sampling_schedule(n, participation, rounds, seed), list(range(n))).items() if not r]
        if never:
            rule = exp["cells"][0]["evaluation"]["untrained"]
            lines.append(f"{ds}/{part} seed {seed} ({', '.join(labels)}): {len(never)} of {n} training clients never train "
                         f"(participation {participation}, {rounds} rounds; positions {never}); they are scored by "
                         f"evaluation.untrained = {rule!r}")
    return lines


def cmd_cells(args) -> None:
    from .config import load_config, resolve_experiment

    exp = resolve_experiment(load_config(args.config))
    for c in exp["cells"]:
        print(f"{c['dataset']}/{c['partition']}({c['partition_id']})/{c['label']}[{c['method']}]/seed{c['seed']}")


def cmd_prepare(args) -> None:
    import os

    from .data.datasets import prepare_dataset
    from .data.downloads import ALLOW_UNPINNED_ENV
    from .io import write_json_atomic

    if args.allow_unpinned:
        os.environ[ALLOW_UNPINNED_ENV] = "1"
    info = prepare_dataset(args.dataset, Path(args.root), args.params)
    if args.out:
        write_json_atomic(args.out, info)
    print(f"[fedrepro] {args.dataset}: {info['num_samples']} samples, fingerprint {info['fingerprint'][:16]}", file=sys.stderr)


def cmd_partition(args) -> None:
    from .data.datasets import load_dataset
    from .data.shards import partition_id, write_partition

    spec = args.spec
    pid = partition_id(spec)
    out = Path(args.out)
    if out.name != pid:
        raise ConfigError(f"--out {out}: the partition directory must be named by the spec's id {pid}")
    raw = load_dataset(spec["dataset"], Path(args.root), spec.get("dataset_params"))
    manifest = write_partition(raw, spec, out)
    sizes = [sum(c["sizes"].values()) for c in manifest["clients"]]
    print(f"[fedrepro] partition {pid}: {len(sizes)} clients, sizes {min(sizes)}..{max(sizes)}", file=sys.stderr)


def cmd_plot_partition(args) -> None:
    from .data.shards import read_manifest
    from .report.plots import plot_partition

    plot_partition(read_manifest(args.shards), args.out)


def cmd_train(args) -> None:
    from .engine.run import train_cell

    cell = args.cell
    check.train_inputs(cell, args.shards, args.device)  # before any data is loaded
    if cell.get("tuned") and not args.tuned:
        raise ConfigError("the cell's hyper-parameters are tuned: pass --tuned <the select rule's JSON>")
    if args.tuned:
        from .io import read_json
        from .tuning import apply_values

        sel = read_json(args.tuned)  # a JSON object: checked while parsing (cli_args.json_file)
        if not {"dataset", "partition", "label", "winner"} <= set(sel):
            raise ConfigError(f"argument --tuned: {args.tuned!r} lacks the keys of a select record; allowed: the select "
                              "rule's JSON (dataset, partition, label, winner)")
        if (sel["dataset"], sel["partition"], sel["label"]) != (cell["dataset"], cell["partition"], cell["label"]):
            raise ConfigError(f"--tuned {args.tuned} selects for {sel['dataset']}/{sel['partition']}/{sel['label']}, "
                              f"not this cell's {cell['dataset']}/{cell['partition']}/{cell['label']}")
        cell = apply_values(cell, sel["winner"]["values"]) | {"tuned": {"trial": sel["winner"]["id"],
                                                                        "values": sel["winner"]["values"]}}
    train_cell(cell, args.shards, args.out_dir, args.checkpoint, device=args.device, threads=args.threads)


def cmd_pretrain_backbone(args) -> None:
    from .models.pretrain import pretrain_backbone

    stats = pretrain_backbone(args.spec, Path(args.root), Path(args.out), threads=args.threads)
    print(f"[fedrepro] pretrained backbone -> {args.out} (final loss {stats['loss']:.4f}, acc {stats['train_acc']:.4f})",
          file=sys.stderr)


def cmd_select(args) -> None:
    from .io import read_json, write_json_atomic
    from .tuning import select_winner

    spec = args.spec
    runs = [{"trial": r["trial"], "seed": r["seed"], "metrics": read_json(r["metrics"])} for r in spec["runs"]]
    record = select_winner(spec, runs, spec["metric"])
    record = {k: spec[k] for k in ("dataset", "partition", "label", "method")} | record
    write_json_atomic(args.out, record)
    w = record["winner"]
    print(f"[fedrepro] {spec['dataset']}/{spec['partition']}/{spec['label']}: selected {w['values']} "
          f"(validation score {w['score']:.4f}) of {len(record['trials'])} trial(s)", file=sys.stderr)


def cmd_tuning_report(args) -> None:
    from .report.tuning import plot_tuning, write_tuning_table

    if args.table:
        for path in write_tuning_table(args.selections, args.table):
            print(path)
    if args.plot:
        plot_tuning(args.selections, args.plot)


def cmd_aggregate(args) -> None:
    from .report.aggregate import load_cells, write_curves_csv, write_summary

    cells = load_cells(args.metrics)
    write_summary(cells, args.csv, args.json)
    write_curves_csv(cells, args.curves)


def cmd_tables(args) -> None:
    import pandas as pd

    from .report.tables import write_tables

    for path in write_tables(pd.read_csv(args.summary), args.out_dir):
        print(path)


def _paper_plan(args):
    from .report.aggregate import load_cells
    from .report.papers import load_published, plan_from_spec

    spec = args.spec
    return plan_from_spec(load_published(args.published), spec), spec, load_cells(args.metrics)


def cmd_paper_table(args) -> None:
    from .report.aggregate import summary_frame
    from .report.paper_tables import build_from_plan, write_table

    plan, spec, cells = _paper_plan(args)
    for path in write_table(build_from_plan(plan, spec["table"], summary_frame(cells)), args.out_prefix):
        print(path)


def cmd_paper_figure(args) -> None:
    from .report.paper_plots import draw_figure

    plan, spec, cells = _paper_plan(args)
    draw_figure(plan, spec["figure"], cells, args.out)


def cmd_plots(args) -> None:
    from .report.aggregate import load_cells
    from .report.plots import plot_client_distribution, plot_curves

    cells = load_cells(args.metrics)
    if args.tsne:
        from .report.plots import plot_tsne

        plot_tsne(cells, args.dataset, args.partition, args.tsne)
    if args.curves:
        plot_curves(cells, args.dataset, args.partition, args.curves)
    if args.clients:
        plot_client_distribution(cells, args.dataset, args.partition, args.clients)


def build_parser() -> argparse.ArgumentParser:
    ap = check.OneLineParser(prog="fedrepro", description="fedrepro: reproducible benchmarks of personalized and fair "
                                 "federated learning. The Snakemake workflow calls these steps; `list` shows the registries.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="print a registry with parameters and defaults", description="Print the registered datasets, "
                       "partitioners, methods or models with their parameters and defaults.")
    p.add_argument("what", choices=["datasets", "partitioners", "methods", "models"])
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("validate", help="check experiment configs", description="Validate experiment YAML files against the "
                       "schema and the registries; print the number of cells or a message naming the bad key.")
    p.add_argument("configs", nargs="+")
    p.add_argument("--allow-large-budgets", action="store_true", help="lift the sanity bounds on rounds, epochs, clients, "
                   "cells and parameter magnitudes (as FEDREPRO_ALLOW_LARGE_BUDGETS=1 does for Snakemake)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("cells", help="list the training cells of an experiment", description="List the cells "
                       "(dataset/partition/method/seed) that an experiment config expands to.")
    p.add_argument("config")
    p.set_defaults(func=cmd_cells)

    p = sub.add_parser("prepare", help="make a dataset's raw files present", description="Make a dataset's raw files "
                       "present under --root (local system package, or download) and record its fingerprint.")
    p.add_argument("dataset")
    p.add_argument("--root", required=True, type=check.output_dir)
    p.add_argument("--params", default="{}", type=check.json_object_text, help="dataset parameters as JSON")
    p.add_argument("--out", type=check.output_file, help="write the dataset info (fingerprint, size) to this JSON file")
    p.add_argument("--allow-unpinned", action="store_true", help="also download files without a published checksum "
                   "(their sha256 is recorded in --out); as FEDREPRO_ALLOW_UNPINNED_DOWNLOADS=1")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("partition", help="partition a dataset into Parquet client shards", description="Partition a dataset "
                       "into per-client Parquet shards plus manifest.json, written atomically into --out (named by the spec's id).")
    p.add_argument("--spec", required=True, type=check.json_object_text, help="resolved partition spec as JSON")
    p.add_argument("--root", required=True, type=check.input_dir, help="the dataset's raw data folder")
    p.add_argument("--out", required=True, type=check.output_dir)
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser("plot-partition", help="plot a partition's per-client label distribution",
                       description="Plot the per-client label distribution of a partition from its manifest.")
    p.add_argument("shards", type=check.partition_dir)
    p.add_argument("out", type=check.output_file)
    p.set_defaults(func=cmd_plot_partition)

    p = sub.add_parser("train", help="train one cell", description="Train one cell (method x dataset x partition x seed) and "
                       "write metrics.json and provenance.json into --out-dir; resumes from --checkpoint if present.")
    p.add_argument("--cell", required=True, type=check.json_object_text, help="resolved cell as JSON (see `fedrepro cells`)")
    p.add_argument("--shards", required=True, type=check.partition_dir, help="partition directory")
    p.add_argument("--out-dir", required=True, type=check.output_dir)
    p.add_argument("--checkpoint", type=check.output_file, help="checkpoint file (written every training.checkpoint_every rounds)")
    p.add_argument("--device", default="auto", type=check.device, help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=check.positive_int, default=None, help="torch CPU threads")
    p.add_argument("--tuned", type=check.json_file, help="the select rule's JSON: train with its winning hyper-parameters")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("pretrain-backbone", help="pre-train a ViT backbone on a dataset's held-out proxy",
                       description="Pre-train the backbone of a `prompted_vit` with `weights: proxy` once on the dataset's "
                       "held-out proxy images and write its state dict to --out (the workflow's pretrain_backbone rule; "
                       "the spec is the resolved one `fedrepro.config` derives, see models/pretrain.py).")
    p.add_argument("--spec", required=True, type=check.json_object_text, help="resolved pretraining spec as JSON")
    p.add_argument("--root", required=True, type=check.input_dir, help="the dataset's raw data folder")
    p.add_argument("--out", required=True, type=check.output_file, help="checkpoint file to write (atomically)")
    p.add_argument("--threads", type=check.positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_pretrain_backbone)

    p = sub.add_parser("select", help="pick a method's hyper-parameters from its tuning trials",
                       description="Score every tuning trial by its validation accuracy (never test data) and write "
                       "every trial's score and the winner to --out.")
    p.add_argument("--spec", required=True, type=check.json_object_text, help="JSON: dataset, partition, label, method, "
                   "space, trials, metric and runs [{trial, seed, metrics}] (the workflow's select rule writes it)")
    p.add_argument("--out", required=True, type=check.output_file)
    p.set_defaults(func=cmd_select)

    p = sub.add_parser("tuning-report", help="table and plot of the selected hyper-parameters",
                       description="From select JSON files: a table of the selected values per cell (PREFIX.csv/.md/.tex) "
                       "and/or a plot of validation score against each tuned parameter.")
    p.add_argument("selections", nargs="+", type=check.existing_file)
    p.add_argument("--table", type=check.output_file, help="output prefix of the table")
    p.add_argument("--plot", type=check.output_file, help="output PNG")
    p.set_defaults(func=cmd_tuning_report)

    p = sub.add_parser("aggregate", help="collect cells' metrics into summary files", description="Collect metrics.json files "
                       "into a long summary CSV, a nested summary JSON (for dvc metrics) and a curves CSV (for dvc plots).")
    p.add_argument("metrics", nargs="+", type=check.existing_file)
    p.add_argument("--csv", required=True, type=check.output_file)
    p.add_argument("--json", required=True, type=check.output_file)
    p.add_argument("--curves", required=True, type=check.output_file)
    p.set_defaults(func=cmd_aggregate)

    p = sub.add_parser("tables", help="write paper-style tables", description="Write Markdown, LaTeX (booktabs) and CSV tables "
                       "(methods x dataset/partition, mean ± std over seeds) from a summary CSV.")
    p.add_argument("--summary", required=True, type=check.existing_file)
    p.add_argument("--out-dir", required=True, type=check.output_dir)
    p.set_defaults(func=cmd_tables)

    p = sub.add_parser("plots", help="plot learning curves and per-client accuracy", description="Plot learning curves, "
                       "per-client accuracy distributions and t-SNE embeddings of one dataset/partition from metrics.json files.")
    p.add_argument("metrics", nargs="+", type=check.existing_file)
    p.add_argument("--dataset", required=True)
    p.add_argument("--partition", required=True)
    p.add_argument("--curves", type=check.output_file, help="learning curves PNG")
    p.add_argument("--clients", type=check.output_file, help="per-client accuracy PNG")
    p.add_argument("--tsne", type=check.output_file, help="t-SNE PNG of the clients of evaluation.embed_clients")
    p.set_defaults(func=cmd_plots)

    p = sub.add_parser("paper-table", help="regenerate a paper table beside the published numbers",
                       description="Build one paper table from metrics.json files: per cell our mean ± std over seeds, "
                       "the paper's value and the difference, 95 %% intervals and paired tests; writes PREFIX.md, .tex, "
                       ".csv, .html and PREFIX_tests.csv.")
    p.add_argument("metrics", nargs="*", type=check.existing_file)
    p.add_argument("--published", required=True, type=check.existing_file,
                   help="the paper's data file (config/papers/published/<paper>.yaml)")
    p.add_argument("--spec", required=True, type=check.json_object_text,
                   help="the table and its mapping as JSON (the workflow's paper rules write it)")
    p.add_argument("--out-prefix", required=True, type=check.output_file)
    p.set_defaults(func=cmd_paper_table)

    p = sub.add_parser("paper-figure", help="draw a paper figure's analogue", description="Draw the analogue of one of a "
                       "paper's figures from the metrics.json files of the runs its table maps.")
    p.add_argument("metrics", nargs="*", type=check.existing_file)
    p.add_argument("--published", required=True, type=check.existing_file)
    p.add_argument("--spec", required=True, type=check.json_object_text)
    p.add_argument("--out", required=True, type=check.output_file)
    p.set_defaults(func=cmd_paper_figure)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Bad arguments are one-line usage errors (exit 2) raised while parsing
    (fedrepro.cli_args), before any work. Errors of the user's input found later are one line too:
    ConfigError, missing data, a shard checksum, a full disk (exit 2), invalid JSON in an input file
    (exit 2), an OSError on a named path (exit 1). Anything else is a bug, not a usage error: its
    traceback is kept (exit 1), so a programming error in training is never disguised as bad input."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: a usage error (2, printed on one line by OneLineParser) or --help (0)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    from .data.base import DataMissingError
    from .data.shards import ShardChecksumError

    prog = f"fedrepro {args.command}"
    try:
        args.func(args)
    except (ConfigError, DataMissingError, ShardChecksumError) as exc:
        check.print_error(prog, exc)
        return 2
    except json.JSONDecodeError as exc:
        check.print_error(prog, f"an input file is not valid JSON ({exc}); allowed: the JSON files fedrepro writes")
        return 2
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            check.print_error(prog, exc.strerror if exc.filename is None else exc)
            return 2
        if exc.filename is None:
            raise
        check.print_error(prog, f"{exc.strerror or type(exc).__name__}: {exc.filename!r}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
