"""The `fedrepro` command: the steps the Snakemake rules call, plus registry listings."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shlex
import sys
from pathlib import Path

from . import cli_args as check
from .planning import untrained_warnings
from .registry import ConfigError


def _print_entries(title: str, registry, extra=lambda e: [], names: list[str] | None = None) -> None:
    print(f"{title}:")
    for e in registry:
        if names and e.name not in names:
            continue
        print(f"  {e.name:<16} {e.summary}")
        for line in [f"origin: {e.origin}", *extra(e)]:
            print(f"  {'':<16} {line}")
        for key, p in e.params.items():
            print(f"  {'':<16}   {key} = {p.default!r}: {p.doc}")


def _registry(what: str):
    """The registry `fedrepro list` prints for `what`, and the extra lines of each entry."""
    if what == "datasets":
        from .data.datasets import DATASETS

        return DATASETS, lambda e: [f"size: {e.info['size']}", f"shape: {e.obj.sample_shape}, classes: {e.obj.num_classes}",
                                    f"source: {e.info['source']}"]
    if what == "partitioners":
        from .data.partitioners import PARTITIONERS

        return PARTITIONERS, lambda e: []
    if what == "methods":
        from .methods import METHODS
        from .tuning import default_space_lines

        return METHODS, lambda e: ([f"paper: {e.info['paper']}"] if e.info.get("paper") else []) + default_space_lines(e.name)
    from .models import MODELS

    return MODELS, lambda e: [f"inputs: {e.info['inputs']}"] if e.info.get("inputs") else []


def cmd_list(args) -> None:
    import difflib

    registry, extra = _registry(args.what)
    for name in args.names:
        if name not in registry:
            close = difflib.get_close_matches(name, registry.names(), n=5, cutoff=0.6)
            hint = f"close matches: {', '.join(close)}" if close else f"see `fedrepro list {args.what}`"
            raise ConfigError(f"no {args.what[:-1]} named {name!r}; {hint}")
    _print_entries(args.what, registry, extra, args.names)
    if args.what == "partitioners":
        print("every partition also takes: num_clients, seed, pool (merge official train+test), "
              "split: {test_fraction=0.25, val_fraction=0.0, stratify=true}")


def _experiment(args) -> tuple[dict, dict]:
    """(merged config, resolved experiment) of the config files and --set items of `args`."""
    from .config import load_and_resolve
    from .overrides import cli_items

    return load_and_resolve(args.configs, cli_items(args.set))


def cmd_validate(args) -> None:
    import os
    from unittest import mock

    from .registry import ALLOW_LARGE_ENV

    # for this command only: `main` called in-process (tests, notebooks) must not keep the bounds lifted
    with mock.patch.dict(os.environ, {ALLOW_LARGE_ENV: "1"} if args.allow_large_budgets else {}):
        _validate(args)


def _validate(args) -> None:
    from .config import load_and_resolve
    from .cost import cost_basis, experiment_lines
    from .overrides import cli_items

    # the calibration is read before any config, so that a bad --calibration file stops at once
    local, chosen = cost_basis(args.calibration)
    # one experiment of the merged files (as Snakemake's --configfile), or --each file on its own
    runs = [[path] for path in args.configs] if args.each else [args.configs]
    for paths in runs:
        config, exp = load_and_resolve(paths, cli_items(args.set))
        name = " + ".join(paths)
        tuning = (f", {len(exp['tuning_cells'])} tuning trial run(s) for {len(exp['tuning']['labels'])} method label(s)"
                  if exp["tuning"] else "")
        print(f"{name}: ok, experiment '{exp['experiment']}': {_partition_count(exp)}, {len(exp['cells'])} cell(s)"
              + derived_note(exp) + tuning)
        for line in untrained_warnings(exp):
            print(f"{name}: warning: {line}", file=sys.stderr)
        for line in paper_table_lines(paths[-1], exp, config):
            print(f"{name}: {line}")
        for line in experiment_lines(exp, local, chosen, gpus=args.gpus):  # from a calibration file only: never measured
            print(f"{name}: {line}")


def paper_table_lines(path, exp: dict, config: dict) -> list[str]:
    """Check the config's `paper_tables` (every cell a mapped layout names is produced by the
    experiment) and say how much of each paper table it covers; [] without paper_tables."""
    from .report.papers import coverage_lines, plan_paper_tables

    plan = plan_paper_tables(config, exp, config_path=path)
    return coverage_lines(plan) if plan else []


def _partition_count(exp: dict) -> str:
    """"N partition(s)", and the draws where a partition draws one per seed (partitions.<label>.draw)."""
    n = len({(p["dataset"], p["label"]) for p in exp["partitions"]})
    draws = len(exp["partitions"])
    return f"{n} partition(s)" + (f" in {draws} draws (one per seed where draw: per_seed)" if draws > n else "")


def cell_id(c: dict) -> str:
    """A cell as `fedrepro cells` prints it: dataset/partition(partition id)/label[method]/seed<seed>."""
    return f"{c['dataset']}/{c['partition']}({c['partition_id']})/{c['label']}[{c['method']}]/seed{c['seed']}"


def derived_note(exp: dict) -> str:
    """', N derived (...: row <- base, ...)' where the experiment has fine-tuning rows derived from a base cell."""
    from .engine.finetune import derived_bases

    derived = derived_bases(exp["cells"])
    pairs = sorted({(key[2], base["label"]) for key, base in derived.items()})
    return (f", {len(derived)} derived (fine-tuning rows scored from their base cell's final model, not trained: "
            f"{', '.join(f'{row} <- {base}' for row, base in pairs)})" if derived else "")


def cmd_cells(args) -> None:
    _, exp = _experiment(args)
    if not args.cost:
        for c in exp["cells"]:
            print(cell_id(c))
        return
    from .cost import Estimator, calibrate_hint, calibration_head, cost_basis, human

    if args.calibration and args.threads:
        raise ConfigError("--threads goes without --calibration: a calibration file's threads are its own")
    _, chosen = cost_basis(args.calibration, threads=args.threads)
    calibration = chosen.calibration
    for line in chosen.problems:
        print(f"fedrepro cells: warning: {line}", file=sys.stderr)
    print(f"[fedrepro] {calibration_head(chosen)}: calibration {calibration['path']}" if calibration else
          f"[fedrepro] cost on {chosen.device}, {chosen.threads} threads: uncalibrated ({calibrate_hint(chosen)})",
          file=sys.stderr)
    estimator = Estimator(exp)
    for c in exp["cells"]:
        work = estimator.work(c)
        seconds = work.seconds(calibration) if work is not None and calibration else None
        shown = ("size unknown" if work is None else human(seconds) if seconds is not None else
                 f"uncalibrated ({work.train_steps:,.0f} steps, {work.forward_samples:,.0f} forwards)")
        print(f"{cell_id(c)}\t{shown}")


def cmd_calibrate(args) -> None:
    import time

    from . import calibration as cal
    from .engine.run import pick_device
    from .local_plan import machine_plan

    t0 = time.perf_counter()
    _, exp = _experiment(args)
    cells = exp["cells"] + exp["tuning_cells"]
    specs = list({s.key: s for s in (cal.model_spec(c, exp["datasets"]) for c in cells)}.values())
    deterministic = all(c["training"]["deterministic"] for c in cells)
    path = cal.calibrate(specs, pick_device(args.device), args.threads or machine_plan().threads, deterministic,
                         force=args.force, say=lambda line: print(line, file=sys.stderr))
    print(f"{path}: {len(specs)} model(s) calibrated in {time.perf_counter() - t0:.1f} s")


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
    from .data.datasets import load_dataset, resolve_dataset
    from .data.shards import partition_id, write_partition

    spec = args.spec
    pid = partition_id(spec)
    resolve_dataset(spec["dataset"], spec.get("dataset_params"))  # an unknown dataset is named, not blamed on --out
    out = Path(args.out)
    if out.name != pid:
        raise ConfigError(f"--out {out}: the partition directory must be named by the spec's id {pid}")
    raw = load_dataset(spec["dataset"], Path(args.root), spec.get("dataset_params"))
    manifest = write_partition(raw, spec, out)
    sizes = [sum(c["sizes"].values()) for c in manifest["clients"]]
    print(f"[fedrepro] partition {pid}: {len(sizes)} clients, sizes {min(sizes)}..{max(sizes)}", file=sys.stderr)


def cmd_plot_partition(args) -> None:
    from .data.shards import read_manifest
    from .report.plots import check_partition_folder, plot_partition

    manifest = read_manifest(args.shards)
    check_partition_folder(args.shards, manifest)
    plot_partition(manifest, args.out)


_CELL_ID = re.compile(r"(?P<dataset>[^/]+)/(?P<partition>[^/(]+)(?:\((?P<pid>[0-9a-f]+)\))?/(?P<label>[^/\[]+)"
                      r"(?:\[(?P<method>[^\]/]+)\])?/seed(?P<seed>\d+)")


def find_cell(exp: dict, ident: str) -> dict:
    """The cell of `exp` named by an id as `fedrepro cells` prints it (the partition id and
    [method] may be left out: digits/dir0.5/local/seed0)."""
    import difflib

    m = _CELL_ID.fullmatch(ident)
    if not m:
        raise ConfigError(f"--cell-id {ident!r} is not a cell id; allowed: a line of `fedrepro cells` "
                          "(dataset/partition(id)/label[method]/seed<n>) or dataset/partition/label/seed<n>")
    for c in exp["cells"]:
        if (c["dataset"], c["partition"], c["label"], str(c["seed"])) == m.group("dataset", "partition", "label", "seed"):
            if m["pid"] and m["pid"] != c["partition_id"]:
                raise ConfigError(f"--cell-id {ident!r}: partition id {m['pid']}, but the config's partition "
                                  f"{c['partition']} now has id {c['partition_id']} (its settings changed); allowed: {cell_id(c)}")
            if m["method"] and m["method"] != c["method"]:
                raise ConfigError(f"--cell-id {ident!r}: method {m['method']!r}, but label {c['label']!r} runs "
                                  f"{c['method']!r}; allowed: {cell_id(c)}")
            return c
    ids = [cell_id(c) for c in exp["cells"]]
    close = difflib.get_close_matches(ident, ids, n=3, cutoff=0.5) or ids[:3]
    raise ConfigError(f"--cell-id {ident!r}: no such cell in experiment '{exp['experiment']}' ({len(ids)} cells); "
                      f"close matches: {', '.join(close)} (all of them: `fedrepro cells`)")


def _cell_from_id(args) -> dict:
    """The resolved cell of --cell-id, with --shards and --out-dir defaulted to the workflow's paths."""
    from .overrides import cli_items, record

    if not args.configs:
        raise ConfigError("--cell-id needs the experiment's config file(s) before it, as `fedrepro cells` takes them: "
                          "fedrepro train config/test.yaml --cell-id digits/dir0.5/local/seed0")
    _, exp = _experiment(args)
    cell = find_cell(exp, args.cell_id)
    record(cli_items(args.set))  # provenance.json "overrides"
    where = f"{cell['dataset']}/{cell['partition']}/{cell['label']}/seed{cell['seed']}"
    if args.shards is None:
        args.shards = f"results/shards/{cell['dataset']}/{cell['partition_id']}"  # the workflow's (planning.WorkflowPlan.shard_dir)
        if not (Path(args.shards) / "manifest.json").is_file():
            items = cli_items(args.set)
            command = shlex.join(["snakemake", "--cores", "1", args.shards, "--configfile", *args.configs]
                                 + (["--config", f"set={' '.join(items)}"] if items else []))
            raise ConfigError(f"--shards: the cell's partition {args.shards} does not exist here; allowed: make it with "
                              f"`{command}`, or pass --shards DIR")
    if args.out_dir is None:
        args.out_dir = f"results/{cell['experiment']}/debug/{where}"  # beside, never over, the workflow's runs/
    if cell.get("tuned") and not args.tuned:
        selection = Path(f"results/{cell['experiment']}/tuning/{cell['dataset']}/{cell['partition']}/{cell['label']}.json")
        if selection.is_file():
            args.tuned = str(selection)
    print(f"[fedrepro] cell {cell_id(cell)} -> {args.out_dir}", file=sys.stderr)
    return cell


def cmd_train(args) -> None:
    from .engine.run import train_cell
    from .io import short_hash

    if (args.cell is None) == (args.cell_id is None):
        raise ConfigError("give one of --cell JSON (the resolved cell, as the workflow does) or CONFIG ... --cell-id ID "
                          "(a line of `fedrepro cells`)")
    if args.cell_id is not None:
        cell = _cell_from_id(args)
        args.shards, args.out_dir = check.partition_dir(args.shards), check.output_dir(args.out_dir)
    else:
        if args.configs or args.set:
            raise ConfigError("config files and --set go with --cell-id; --cell is the resolved cell itself")
        for flag, value in (("--shards", args.shards), ("--out-dir", args.out_dir)):
            if value is None:
                raise ConfigError(f"{flag} is required with --cell (with --cell-id it defaults to the workflow's path)")
        cell = args.cell
    check.train_inputs(cell, args.shards, args.device)  # before any data is loaded
    if "finetune" in cell:
        raise ConfigError(f"cell {cell['label']} is a fine-tuning row of label {cell['finetune']!r}: it is scored from that "
                          "cell's final model by `fedrepro finetune`, not trained")
    resolved_key = short_hash(cell)  # what the workflow expects in metrics.json, also for a tuned cell
    if cell.get("tuned") and not args.tuned:
        raise ConfigError("the cell's hyper-parameters are tuned: pass --tuned <the select rule's JSON>")
    if args.tuned:
        from .io import read_json
        from .tuning import apply_values, tuned_winner

        sel = read_json(args.tuned)  # a JSON object: checked while parsing (cli_args.json_file)
        if not {"dataset", "partition", "label", "winner"} <= set(sel):
            raise ConfigError(f"argument --tuned: {args.tuned!r} lacks the keys of a select record; allowed: the select "
                              "rule's JSON (dataset, partition, label, winner)")
        if (sel["dataset"], sel["partition"], sel["label"]) != (cell["dataset"], cell["partition"], cell["label"]):
            raise ConfigError(f"--tuned {args.tuned} selects for {sel['dataset']}/{sel['partition']}/{sel['label']}, "
                              f"not this cell's {cell['dataset']}/{cell['partition']}/{cell['label']}")
        # per_seed: the winner of the cell's own tuning seed; refused unless the record recomputes from its
        # trials and its values are within the bounds a config's are (an lr of 1e300 overflowed in the optimizer)
        winner = tuned_winner(sel, args.tuned, cell)
        cell = apply_values(cell, winner["values"]) | {"tuned": {"trial": winner["id"], "values": winner["values"],
                                                                 **({"select": sel["select"]} if "select" in sel else {})}}
    train_cell(cell, args.shards, args.out_dir, args.checkpoint, device=args.device, threads=args.threads, cell_key=resolved_key)


def cmd_finetune(args) -> None:
    from .engine.finetune import finetune_cell

    for cell in (args.cell, args.base_cell):
        check.train_inputs(cell, args.shards, args.device)  # before any data is loaded
    finetune_cell(args.cell, args.base_cell, args.shards, args.out_dir, args.final_model, device=args.device,
                  threads=args.threads)


def cmd_pretrain_backbone(args) -> None:
    from .models.pretrain import pretrain_backbone

    stats = pretrain_backbone(args.spec, Path(args.root), Path(args.out), threads=args.threads)
    print(f"[fedrepro] pretrained backbone -> {args.out} (final loss {stats['loss']:.4f}, acc {stats['train_acc']:.4f})",
          file=sys.stderr)


def cmd_select(args) -> None:
    from .custody import read_metrics
    from .io import write_json_atomic
    from .tuning import select_checked
    from .verify import check_summaries

    spec = args.spec
    check.check_select_spec(spec)
    runs = [{"trial": r["trial"], "seed": r["seed"], "metrics": read_metrics(r["metrics"]), "path": r["metrics"]}
            for r in spec["runs"]]
    for run in runs:
        check_summaries(run["metrics"], run["path"])  # each summary is what its per-client scores give, as in aggregate
    record = select_checked(spec, runs)  # and each trial's metrics are those of the trial cell trained beside them
    record = {k: spec[k] for k in ("dataset", "partition", "label", "method")} | record
    write_json_atomic(args.out, record)
    w = record["winner"]
    print(f"[fedrepro] {spec['dataset']}/{spec['partition']}/{spec['label']}: selected {w['values']} "
          f"(validation score {w['score']:.4f}) of {len(record['trials'])} trial(s)", file=sys.stderr)
    for seed, w in (record.get("winners_by_seed") or {}).items():
        print(f"[fedrepro]   {seed}: selected {w['values']} (validation score {w['score']:.4f})", file=sys.stderr)


def cmd_tuning_report(args) -> None:
    from .report.tuning import plot_tuning, write_tuning_table

    if args.table:
        for path in write_tuning_table(args.selections, args.table):
            print(path)
    if args.plot:
        plot_tuning(args.selections, args.plot)


def cmd_aggregate(args) -> None:
    from .report.aggregate import load_cells, write_curves_csv, write_summary
    from .verify import check_summaries

    cells = load_cells(args.metrics, expect=args.expect)
    for path, cell in zip(args.metrics, cells):
        check_summaries(cell, path)  # each summary statistic is what its per-client scores give
    write_summary(cells, args.csv, args.json)
    write_curves_csv(cells, args.curves)


def cmd_verify(args) -> int:
    from .verify import check_experiment, verify

    if args.seed is not None and args.sample is None:
        raise ConfigError("--seed goes with --sample (it draws the sampled cells)")
    if args.set and not args.configs:
        raise ConfigError("--set goes with --config (it overrides the config's keys)")
    exp = None
    if args.configs:  # the cells are then the config's, each refused unless it is the one its folder holds
        _, exp = _experiment(args)
        check_experiment(Path(args.results), exp, args.configs)
    def train(argv: list[str]) -> None:  # `fedrepro train ...` in this process (cmd_train)
        trained = build_parser().parse_args(argv)
        trained.func(trained)

    return verify(args.results, train, args.cells, args.sample, args.seed or 0, exp)


def cmd_tables(args) -> None:
    from .report.tables import read_summary, write_tables

    for path in write_tables(read_summary(args.summary), args.out_dir):
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
    for path in write_table(build_from_plan(plan, spec["table"], summary_frame(cells), cells), args.out_prefix):
        print(path)


def cmd_paper_figure(args) -> None:
    from .report.paper_plots import draw_figure

    plan, spec, cells = _paper_plan(args)
    draw_figure(plan, spec["figure"], cells, args.out)


def cmd_readings(args) -> None:
    from .report import readings as rd

    if (args.check or args.docs) and (args.md or args.html or args.record):
        raise ConfigError("--check and --docs go without --md, --html and --record")
    if args.complete and not args.check:
        raise ConfigError("--complete goes with --check")
    if not (args.check or args.docs or args.paper or args.ledger):
        raise ConfigError("give PAPER (or --ledger FILE) with --md/--html/--record, or --check, or --docs FILE")
    if args.docs:
        changed = rd.update_docs(args.docs)
        print(f"{args.docs}: {'rewritten' if changed else 'up to date'}")
        if not args.check:
            return
    if args.check:
        papers = [args.paper] if args.paper else rd.seed_papers()
        paths = [Path(args.ledger)] if args.ledger else [rd.ledger_path(p) for p in papers]
        problems = []
        for path in paths:
            found = []
            try:
                ledger = rd.load_ledger(path)
            except ConfigError as exc:
                found.append(str(exc))
                try:  # its marks can still be checked where only its labels are wrong
                    ledger = rd.load_ledger(path, resolve=False)
                except ConfigError:
                    problems += found
                    continue
            found += rd.mark_violations(ledger)
            source, wrong, notes = rd.verify(ledger)  # the measured: block against the results, where present
            found += wrong
            pending = rd.incomplete(ledger) if ledger.targets else []
            if args.complete:
                found += pending
            problems += found
            recomputed = f" (recomputed from {source}: {f'{len(wrong)} problem(s)' if wrong else 'agrees'})" if source else ""
            print(f"{ledger.rel}: {f'{len(found)} problem(s)' if found else 'ok'}, {len(ledger.readings)} reading(s), "
                  f"{'measured' + recomputed if ledger.measured else 'not measured yet'}"
                  f"{f', {len(pending)} entry(ies) not yet measured' if pending else ''}")
            for line in notes:
                print(f"  {line}")
            if pending and not args.complete:
                for line in pending:
                    print(f"  not yet measured: {line}")
        for line in problems:
            print(f"fedrepro readings: {line}", file=sys.stderr)
        if problems:
            raise ConfigError(f"{len(problems)} problem(s) in the readings ledgers (above)")
        return
    path = Path(args.ledger) if args.ledger else rd.ledger_path(args.paper)
    if args.skip_unreadable and not args.record:
        raise ConfigError("--skip-unreadable goes with --record")
    if args.record:
        try:
            ledger, skipped = rd.record(path, args.record, args.skip_unreadable)
        except rd.UnreadableCells as exc:
            for line in exc.lines:
                print(f"fedrepro readings: {line}", file=sys.stderr)
            raise
        for u in skipped:
            print(f"fedrepro readings: skipped {u}", file=sys.stderr)
        counts = ", ".join(f"{k}: {len(v)}" for k, v in ledger.measured["labels"].items())
        print(f"{path}: measured from {args.record} (seeds per label: {counts})")
    else:
        ledger = rd.load_ledger(path)
    for out in rd.write(ledger, args.md, args.html):
        print(out)


def cmd_plots(args) -> None:
    from .report.aggregate import load_cells
    from .report.plots import check_panel, plot_client_distribution, plot_curves

    cells = load_cells(args.metrics)
    check_panel(cells, args.dataset, args.partition)
    if args.tsne:
        from .report.plots import plot_tsne

        plot_tsne(cells, args.dataset, args.partition, args.tsne)
    if args.curves:
        plot_curves(cells, args.dataset, args.partition, args.curves)
    if args.clients:
        plot_client_distribution(cells, args.dataset, args.partition, args.clients)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="override config keys: dotted keys, values as in a config file (repeatable; several items per "
                   "argument separated by spaces), e.g. --set 'training.rounds=1 seeds=[0,1]'; snakemake: --config set='...'")


def _add_calibration(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", type=check.existing_file, metavar="PATH", help="estimate with this calibration file "
                   "(as `fedrepro calibrate` writes them, e.g. one a GPU run recorded in docs/gpu_runs/) instead of this "
                   "machine's cached one (docs/cost.md)")


def cmd_status(args) -> None:
    import time

    from .cost import TimeLeft
    from .progress import collect, render

    root = Path(args.results)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such results folder (give results/<experiment>)")
    if args.watch is not None and not args.watch > 0:
        raise ConfigError(f"--watch {args.watch:g}: must be a number of seconds > 0")
    left = TimeLeft.of_results(root)  # every job's estimate, made once: the plan does not change while it runs
    while True:
        problems: list[str] = []  # files that are not regular, too large or not JSON: named, never read whole
        rows = collect(root, problems)
        text = render(rows, root, problems, footer=[left.line(rows)])
        if not args.watch:
            print(text)
            return
        # clear the screen and redraw, until Ctrl-C
        sys.stdout.write("\x1b[H\x1b[2J" + text + f"\n\n(every {args.watch:g} s; Ctrl-C to stop)\n")
        sys.stdout.flush()
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return


def cmd_report_page(args) -> None:
    from .io import write_text_atomic
    from .report.landing import description_rst
    from .report.tables import read_summary

    write_text_atomic(args.out, description_rst(read_summary(args.summary), args.spec, args.curves))


def build_parser() -> argparse.ArgumentParser:
    ap = check.OneLineParser(prog="fedrepro", description="fedrepro: reproducible benchmarks of personalized and fair "
                                 "federated learning. The Snakemake workflow calls these steps; `list` shows the registries.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="print a registry with parameters and defaults", description="Print the registered datasets, "
                       "partitioners, methods or models with their parameters and defaults.")
    p.add_argument("what", choices=["datasets", "partitioners", "methods", "models"])
    p.add_argument("names", nargs="*", metavar="NAME", help="print only these entries (e.g. `fedrepro list methods fedavg`)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("validate", help="check an experiment config", description="Validate an experiment against the "
                       "schema and the registries; print the number of cells or a message naming the bad key. Several "
                       "files are merged as Snakemake's --configfile merges them (later ones over earlier ones); --each "
                       "checks each file as an experiment of its own.")
    p.add_argument("configs", nargs="+", metavar="CONFIG")
    _add_set(p)
    p.add_argument("--each", action="store_true", help="validate every CONFIG on its own instead of merging them")
    p.add_argument("--allow-large-budgets", action="store_true", help="lift the sanity bounds on rounds, epochs, clients, "
                   "cells and parameter magnitudes (as FEDREPRO_ALLOW_LARGE_BUDGETS=1 does for Snakemake)")
    _add_calibration(p)
    p.add_argument("--gpus", type=check.gpu_count, default=1, metavar="N", help="with a GPU's calibration: the "
                   f"wall time on N GPUs (1 to {check.MAX_GPUS:,}), cells packed as the slurm-packed profile packs them "
                   "(default 1)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("cells", help="list the training cells of an experiment", description="List the cells "
                       "(dataset/partition(partition id)/label[method]/seed) that an experiment expands to: config files "
                       "merged as Snakemake's --configfile merges them, then the --set overrides.")
    p.add_argument("configs", nargs="+", metavar="CONFIG")
    _add_set(p)
    p.add_argument("--cost", action="store_true", help="add each cell's estimated time on this machine (from a cached "
                   "calibration: `fedrepro calibrate`; docs/cost.md)")
    p.add_argument("--threads", type=check.positive_int, default=None, help="with --cost: the cells' threads (default: "
                   "the local profile's)")
    _add_calibration(p)
    p.set_defaults(func=cmd_cells)

    p = sub.add_parser("calibrate", help="time this machine's training steps for an experiment's models",
                       description="Time a few training steps, forward passes and head steps of every model (with its "
                       "input shape, classes and batch size) the experiment's cells use, a job's start-up and the "
                       "engine's time per client and round, on the "
                       "device and at the thread count the cells would run with; cache the seconds per step under "
                       "results/.calibration/ (one file per device, threads and torch version). `fedrepro validate` and "
                       "`fedrepro cells --cost` estimate every cell's time from it, and the SLURM profiles its time "
                       "limit (docs/cost.md). Models already cached are skipped (--force measures again).")
    p.add_argument("configs", nargs="+", metavar="CONFIG")
    _add_set(p)
    p.add_argument("--device", default="auto", type=check.device, help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=check.thread_count, default=None, help="torch CPU threads (default: the local "
                   "profile's per cell, 2; more than the cores make the timings long)")
    p.add_argument("--force", action="store_true", help="measure every model again, cached or not")
    p.set_defaults(func=cmd_calibrate)

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
                       "write metrics.json and provenance.json into --out-dir; resumes from --checkpoint if present. The cell "
                       "is either the resolved cell as JSON (--cell, as the workflow calls it) or a line of `fedrepro cells` "
                       "(CONFIG ... [--set ...] --cell-id ID).")
    p.add_argument("configs", nargs="*", metavar="CONFIG", type=check.existing_file,
                   help="with --cell-id: the experiment's config file(s)")
    p.add_argument("--cell", type=check.json_object_text, help="resolved cell as JSON (the workflow's train rule passes it)")
    p.add_argument("--cell-id", help="a cell as `fedrepro cells` prints it, e.g. digits/dir0.5(d4a81f8466)/local[local]/seed0 "
                   "or digits/dir0.5/local/seed0")
    _add_set(p)
    p.add_argument("--shards", type=check.partition_dir,
                   help="partition directory (with --cell-id: the workflow's results/shards/<dataset>/<id>)")
    p.add_argument("--out-dir", type=check.output_dir,
                   help="output folder (with --cell-id: results/<experiment>/debug/<dataset>/<partition>/<label>/seed<n>)")
    p.add_argument("--checkpoint", type=check.output_file, help="checkpoint file (written every training.checkpoint_every rounds)")
    p.add_argument("--device", default="auto", type=check.device, help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=check.positive_int, default=None, help="torch CPU threads")
    p.add_argument("--tuned", type=check.json_file, help="the select rule's JSON: train with its winning hyper-parameters "
                   "(a per_seed selection: those of the cell's own tuning seed)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("finetune", help="score a fine-tuning row from its base cell's final model",
                       description="Write a fine-tuning row's metrics.json and provenance.json into --out-dir without "
                       "training: its base cell's final model (final_model.pt, kept beside the base's metrics.json) is "
                       "fine-tuned and scored as the row's own training would (docs/evaluation.md). Where the base was "
                       "trained before final models were kept, the row is trained in full; a final model its base's "
                       "provenance.json records but that is missing or another file is refused (retrain the base).")
    p.add_argument("--cell", required=True, type=check.json_object_text, help="the fine-tuning row's resolved cell as JSON")
    p.add_argument("--base-cell", required=True, type=check.json_object_text, help="its base cell's resolved cell as JSON")
    p.add_argument("--final-model", required=True, help="the base cell's final_model.pt (read and checked by the command)")
    p.add_argument("--shards", required=True, type=check.partition_dir, help="partition directory")
    p.add_argument("--out-dir", required=True, type=check.output_dir, help="output folder of the row")
    p.add_argument("--device", default="auto", type=check.device, help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=check.positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_finetune)

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
                       description="Score every tuning trial by its validation score (tuning.metric; never test data) "
                       "and write every trial's score and the winner (select: per_seed, also each tuning seed's) to --out.")
    p.add_argument("--spec", required=True, type=check.json_object_text, help="JSON: dataset, partition, label, method, "
                   "space, trials, metric, runs [{trial, seed, metrics}] and optionally select (the workflow's select rule "
                   "writes it)")
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
    p.add_argument("--expect", nargs="+", metavar="CELL", help="per metrics file, in the same order, the cell it must "
                   "belong to: experiment/dataset/partition/label/seed/cell_key (the aggregate rule passes them); "
                   "a file of another cell is an error naming the file and the field")
    p.set_defaults(func=cmd_aggregate)

    p = sub.add_parser("verify", help="retrain cells and compare them with their recorded metrics",
                       description="Recompute cells of results/<experiment>: retrain each from the resolved cell, "
                       "thread count and device its provenance.json records (as `fedrepro train` does, into a scratch "
                       "folder, on the experiment's shards results/shards/<dataset>/<partition id>) and compare every "
                       "field of metrics.json but times and memory; print each mismatch and one verdict per cell. "
                       "Before any training, each recorded cell is refused unless it is the cell of its folder "
                       "(experiment, identity, cell hash) and within a config's schema and bounds; with --config, the "
                       "config's cell is trained, refused unless it hashes to the recorded one. "
                       "Exit status 0: every chosen cell exact; 1: some cell differs or is refused; 3: none of that, but "
                       "some could not be recomputed here (a CUDA cell without a GPU, shards missing, more threads than "
                       "this machine takes, ...). docs/security.md.")
    p.add_argument("results", type=check.input_dir, help="results/<experiment>")
    p.add_argument("--config", dest="configs", nargs="+", default=[], metavar="CONFIG", type=check.existing_file,
                   help="the experiment's config file(s) (merged as --configfile merges them): retrain the config's cells")
    _add_set(p)
    p.add_argument("--cells", nargs="+", metavar="GLOB", help="only the cells matching one of these patterns of "
                   "dataset/partition/label/seed<k> (shell wildcards: 'digits/*/fedavg/*')")
    p.add_argument("--sample", type=check.positive_int, metavar="K", help="K of the chosen cells drawn at random")
    p.add_argument("--seed", type=int, metavar="S", help="the seed of --sample's draw (default 0: reproducible)")
    p.set_defaults(func=cmd_verify)

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

    p = sub.add_parser("status", help="progress of the cells of a results folder", description="Show the cells of "
                       "results/<experiment> while the workflow runs: running (round r/R, last accuracy, time left), done, "
                       "failed, stopped and pending, from the status files the training jobs write and the finished metrics.json; "
                       "then the time left, estimated from the run's recorded config and this machine's calibration "
                       "(docs/cost.md).")
    p.add_argument("results", type=check.input_dir, help="results/<experiment>")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="redraw every SECONDS until Ctrl-C")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("report-page", help="write the report's landing page", description="Write the reStructuredText "
                       "landing page of `snakemake --report`: the main table inline, the learning curves, and what the "
                       "experiment ran (the workflow's report_page rule).")
    p.add_argument("--summary", required=True, type=check.existing_file, help="summary.csv")
    p.add_argument("--spec", required=True, type=check.json_object_text,
                   help="JSON: experiment, rounds, seeds, tuning (bool), paper (name or null)")
    p.add_argument("--curves", nargs="*", default=[], type=check.existing_file, help="learning-curve PNGs to embed")
    p.add_argument("--out", required=True, type=check.output_file)
    p.set_defaults(func=cmd_report_page)

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

    p = sub.add_parser("readings", help="a seed paper's readings ledger: check, record, render",
                       description="The readings ledger of a seed paper (config/papers/published/readings/<paper>.yaml): "
                       "every [RECON] and [PAPER≠CODE] choice of its method with the measured effect of each alternative "
                       "on the paper's headline comparison. PAPER --md/--html renders it; PAPER --record results/<exp> "
                       "writes the per-seed values of its labels into the ledger's measured: block; --check validates "
                       "every ledger (or PAPER's) and its marks in the source; --docs FILE rewrites the ledgers between "
                       "the markers of FILE (docs/papers.md).")
    p.add_argument("paper", nargs="?", help="the paper id (config/papers/published/<paper>.yaml)")
    p.add_argument("--ledger", type=check.existing_file, help="the ledger file (default: the paper's in the repository)")
    p.add_argument("--md", type=check.output_file, help="write the ledger as Markdown")
    p.add_argument("--html", type=check.output_file, help="write the ledger as an HTML page")
    p.add_argument("--record", type=check.input_dir, metavar="RESULTS", help="results/<experiment> of the ledger's "
                   "headline experiment: record its values in the ledger (every cell of the ledger's labels must be "
                   "readable: each one that is not is named, and nothing is recorded)")
    p.add_argument("--skip-unreadable", action="store_true", help="with --record: record without the cells whose "
                   "metrics.json is missing or unreadable (each still named on stderr)")
    p.add_argument("--check", action="store_true", help="validate the ledgers and their marks in the source; "
                   "recompute each measured: block from results/<experiment> where those results are present (refusing "
                   "a block that disagrees); list the entries not yet measured")
    p.add_argument("--complete", action="store_true", help="with --check: also refuse an entry not yet measured (a "
                   "'pending:' entry, or an alternative measured over fewer than 3 seeds)")
    p.add_argument("--docs", type=check.existing_file, metavar="FILE", help="rewrite the ledgers between "
                   "<!-- readings:begin --> and <!-- readings:end --> in FILE")
    p.set_defaults(func=cmd_readings)
    return ap


#: exit status when the reader of our output went away (`fedrepro list methods | head`): 128 + SIGPIPE,
#: what a shell reports for a command that SIGPIPE ended (as `yes | head` does)
EXIT_BROKEN_PIPE = 141


def _quiet_broken_pipe() -> int:
    """Python's recipe (docs of `signal`, "Note on SIGPIPE"): point stdout at devnull so that the
    interpreter's last flush does not raise again, and end quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


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
        status = args.func(args)  # None, or an exit status (`verify`)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:
        return _quiet_broken_pipe()
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
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
