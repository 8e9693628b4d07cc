"""Paper-style tables: methods as rows, dataset × partition as columns, "mean ± std" over seeds.

Written as Markdown, LaTeX (booktabs) and a numeric CSV, without tabulate or jinja2. Units: the
CSV holds accuracy and F1 as fractions in [0, 1], as metrics.json, summary.csv and curves.csv do;
the rendered Markdown/LaTeX/HTML show percent and say so in their caption. The CSV is plain (pandas
reads it without options); its caption, notes and unit are in <name>.meta.json and the Markdown.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd

from fedrepro.io import FileTooLarge, NotRegularFile, atomic_path, file_kind, read_regular, write_json_atomic, write_text_atomic
from fedrepro.registry import ConfigError
from fedrepro.report.aggregate import DECIMALS, GROUP, METRIC_COLUMNS, column_keys, row_keys, seed_table

DEFAULT_TABLES = {
    "accuracy": "acc_weighted_mean",
    "accuracy_client_mean": "acc_mean",
    "accuracy_client_std": "acc_std",
    "accuracy_worst10": "acc_worst10",
    "macro_f1": "f1_mean",
}

_METRIC_NAMES = {"acc": "Accuracy (%)", "f1": "Macro-F1 (%)"}
_STAT_NAMES = {
    "weighted_mean": "weighted by client test size",
    "mean": "unweighted mean over clients",
    "std": "standard deviation across clients",
    "min": "worst client",
    "max": "best client",
    "worst10": "mean of the worst 10% of clients",
}


def is_percent(column: str) -> bool:
    """Accuracy/F1 columns are fractions and shown ×100."""
    return column.removeprefix("bestval_").split("_")[0] in _METRIC_NAMES


def caption(column: str, n_seeds: int | None = None) -> str:
    """One-line description of what a table built from `column` shows; `n_seeds` the most
    successful seeds of any entry (1: the entries are single runs, not a spread over seeds)."""
    base = column.removeprefix("bestval_")
    metric, _, stat = base.partition("_")
    if metric in _METRIC_NAMES and stat in _STAT_NAMES:
        what = f"{_METRIC_NAMES[metric]} {_STAT_NAMES[stat]}"
    else:
        what = column
    when = "at the best validation round" if column.startswith("bestval_") else "final round"
    if n_seeds == 1:
        return f"{what}, {when}, one seed (no spread over seeds)"
    return f"{what}, {when}, mean ± std (sample, ddof=1) over {f'{n_seeds} ' if n_seeds else ''}seeds"


def max_seeds(frame: pd.DataFrame) -> int:
    """The most successful seeds behind any (dataset, partition, label, kind) entry."""
    ok = frame[frame["status"] == "ok"]
    return int(ok.groupby(GROUP, sort=False).size().max()) if len(ok) else 0


def identical_rows(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(row, earlier row) pairs whose every metric equals the earlier row's in every dataset,
    partition and seed: the same model under two names (e.g. fedavg (global) and fedavg_ft
    (global), whose fine-tuning only changes the personal models)."""
    ok = frame[frame["status"] == "ok"]
    seen: dict[tuple, str] = {}
    pairs = []
    for label, kind in row_keys(frame):
        rows = ok[(ok["label"] == label) & (ok["kind"] == kind)].sort_values(["dataset", "partition", "seed"])
        if rows.empty:
            continue
        values = rows[["dataset", "partition", "seed", *METRIC_COLUMNS]].round(DECIMALS)
        key = tuple(map(tuple, values.astype(str).to_numpy()))
        name = row_name(label, kind)
        if key in seen:
            pairs.append((name, seen[key]))
        else:
            seen[key] = name
    return pairs


def identical_note(frame: pd.DataFrame) -> str:
    pairs = identical_rows(frame)
    return " ".join(f"{a} is identical to {b} in every cell and seed (the same model)." for a, b in pairs)


def row_name(label: str, kind: str) -> str:
    """Row label: "<label> (global)" / "<label> (personal)", plain label for never-successful methods."""
    return label if kind == "failed" else f"{label} ({kind})"


def format_cell(mean: float, std: float, n_seeds: int, n_failed: int, scale: float = 100.0) -> str:
    """'85.31 ± 0.42', '85.31' (one seed), 'failed', with ' (k failed)' when some seeds failed."""
    if n_seeds == 0 or math.isnan(mean):
        return "failed" if n_failed and n_seeds == 0 else "-"
    text = f"{mean * scale:.2f}" if math.isnan(std) else f"{mean * scale:.2f} ± {std * scale:.2f}"
    return f"{text} ({n_failed} failed)" if n_failed else text


def pivot_table(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Strings table: index = method rows, columns = MultiIndex (dataset, partition)."""
    scale = 100.0 if is_percent(column) else 1.0
    stats = {(r.label, r.kind, r.dataset, r.partition): r for r in seed_table(frame, column).itertuples(index=False)}
    rows, cols = row_keys(frame), column_keys(frame)
    data = []
    for label, kind in rows:
        line = []
        for ds, part in cols:
            r = stats.get((label, kind, ds, part))
            line.append("-" if r is None else format_cell(r.mean, r.std, r.n_seeds, r.n_failed, scale))
        data.append(line)
    index = pd.Index([row_name(label, kind) for label, kind in rows], name="method")
    columns = pd.MultiIndex.from_tuples(cols, names=["dataset", "partition"])
    return pd.DataFrame(data, index=index, columns=columns)


def numeric_table(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Machine-readable wide table: label, kind, then '<dataset>/<partition>/{mean,std,n_seeds,n_failed}',
    in the summary's unit (fractions for accuracy and F1)."""
    scale = 1.0
    stats = seed_table(frame, column)
    out = pd.DataFrame(row_keys(frame), columns=["label", "kind"])
    for ds, part in column_keys(frame):
        sub = stats[(stats["dataset"] == ds) & (stats["partition"] == part)].set_index(["label", "kind"])
        sub = sub.reindex(pd.MultiIndex.from_frame(out[["label", "kind"]]))
        out[f"{ds}/{part}/mean"] = (sub["mean"] * scale).round(DECIMALS).to_numpy()
        out[f"{ds}/{part}/std"] = (sub["std"] * scale).round(DECIMALS).to_numpy()
        out[f"{ds}/{part}/n_seeds"] = sub["n_seeds"].fillna(0).astype(int).to_numpy()
        out[f"{ds}/{part}/n_failed"] = sub["n_failed"].fillna(0).astype(int).to_numpy()
    return out


def to_markdown(table: pd.DataFrame, title: str = "") -> str:
    """Pipe table with a 'Table: ...' caption line; columns headed 'dataset / partition'."""
    def esc(s: object) -> str:
        return str(s).replace("|", "\\|")

    header = [table.index.name or ""]
    header += [" / ".join(map(str, c)) if isinstance(c, tuple) else str(c) for c in table.columns]
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join([":---"] + ["---:"] * len(table.columns)) + "|"]
    for name, row in table.iterrows():
        lines.append("| " + " | ".join(esc(v) for v in [name, *row]) + " |")
    return (f"Table: {title}\n\n" if title else "") + "\n".join(lines) + "\n"


def latex_escape(text: object) -> str:
    """Escape LaTeX specials in a cell; '±' becomes $\\pm$."""
    s = str(text)
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
                 ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("~", r"\textasciitilde{}"), ("^", r"\^{}")):
        s = s.replace(a, b)
    return s.replace("±", r"$\pm$")


def to_latex(table: pd.DataFrame, title: str = "", label: str = "", note: str = "") -> str:
    """booktabs tabular in a table float: dataset header row (with cmidrules) over partition row."""
    cols = list(table.columns)
    n = len(cols)
    groups: list[tuple[str, int]] = []
    for ds, _ in cols:
        if groups and groups[-1][0] == ds:
            groups[-1] = (ds, groups[-1][1] + 1)
        else:
            groups.append((ds, 1))
    top, rules, start = [""], [], 2
    for ds, width in groups:
        top.append(rf"\multicolumn{{{width}}}{{c}}{{{latex_escape(ds)}}}")
        rules.append(rf"\cmidrule(lr){{{start}-{start + width - 1}}}")
        start += width
    lines = [f"% {title}", r"\begin{table}[t]", r"\centering"]
    if title:
        lines.append(rf"\caption{{{latex_escape(title)}}}")
    if label:
        lines.append(rf"\label{{tab:{label}}}")
    lines += [
        r"\begin{tabular}{l" + "c" * n + "}",
        r"\toprule",
        " & ".join(top) + r" \\",
        " ".join(rules),
        " & ".join(["Method"] + [latex_escape(p) for _, p in cols]) + r" \\",
        r"\midrule",
    ]
    for name, row in table.iterrows():
        lines.append(" & ".join(latex_escape(v) for v in [name, *row]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if note:
        lines.append(rf"\par\smallskip{{\footnotesize {latex_escape(note)}}}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def untrained_note(frame: pd.DataFrame) -> str:
    """The footnote every table carries: how clients that never trained were scored, and how
    many there were per dataset/partition and seed (they count in the rows as the rule says)."""
    ok = frame[(frame["status"] == "ok") & frame["untrained_rule"].notna()]
    if ok.empty:
        return ""
    rules = sorted(set(ok["untrained_rule"]))
    counts = ok.groupby(["dataset", "partition", "seed"], sort=False)[["untrained_clients", "num_clients"]].max()
    some = counts[counts["untrained_clients"] > 0]
    rule = ", ".join(repr(r) for r in rules)
    if some.empty:
        return f"Every client trained in every cell (evaluation.untrained = {rule} was not needed)."
    where = "; ".join(f"{ds}/{part} seed {seed}: {int(r.untrained_clients)} of {int(r.num_clients)}"
                      for (ds, part, seed), r in some.iterrows())
    return f"Clients that never trained, scored by evaluation.untrained = {rule}: {where}."


def unscored_note(frame: pd.DataFrame) -> str:
    """How many clients had no test data and were left out of the scores (partitions with
    allow_empty_clients: true), per dataset/partition and seed; empty where every client was scored."""
    ok = frame[(frame["status"] == "ok") & (frame["unscored_clients"] > 0)] if "unscored_clients" in frame else frame[:0]
    if ok.empty:
        return ""
    counts = ok.groupby(["dataset", "partition", "seed"], sort=False)[["unscored_clients", "num_clients"]].max()
    where = "; ".join(f"{ds}/{part} seed {seed}: {int(r.unscored_clients)} of {int(r.num_clients)}"
                      for (ds, part, seed), r in counts.iterrows())
    return f"Clients without test data (allow_empty_clients), left out of every score: {where}."


def client_notes(frame: pd.DataFrame) -> list[str]:
    """The notes on which clients the scores cover: untrained clients' rule, clients not scored; and how
    fine-tuning rows were made."""
    return [n for n in (untrained_note(frame), unscored_note(frame), finetune_note(frame)) if n]


def finetune_note(frame: pd.DataFrame) -> str:
    """How the fine-tuning rows scored from another cell's final model were made (summary column
    finetuned_from; absent in summaries written before rows were derived)."""
    if "finetuned_from" not in frame:
        return ""
    ok = frame[(frame["status"] == "ok") & frame["finetuned_from"].notna() & (frame["kind"] == "personal")]
    pairs = list(dict.fromkeys(zip(ok["label"], ok["finetuned_from"])))
    return " ".join(f"{label} (personal) is {base}'s final model with each client's head fine-tuned after training, "
                    f"scored in a job of its own ({base} was not trained twice)." for label, base in pairs)


#: Largest summary.csv `fedrepro tables` reads (10,000 cells x a few kinds x ~40 columns: tens of MB).
MAX_SUMMARY_BYTES = 256 << 20
#: The summary.csv columns the tables read (unscored_clients is optional: summaries before it lack it).
SUMMARY_INPUT_COLUMNS = [*GROUP, "seed", "status", *METRIC_COLUMNS, "num_clients", "untrained_clients", "untrained_rule"]
_NUMERIC_INPUT_COLUMNS = ["seed", *METRIC_COLUMNS, "num_clients", "untrained_clients"]


def read_summary(path: str | Path) -> pd.DataFrame:
    """The summary.csv `fedrepro aggregate` wrote, read through the bounded regular-file reader; a
    ConfigError (one line, naming the file) for anything else: not CSV, not text, too large, or
    without the columns the tables read."""
    allowed = "the summary.csv `fedrepro aggregate` writes (results/<experiment>/summary.csv)"
    try:
        data = read_regular(path, MAX_SUMMARY_BYTES)
    except NotRegularFile as exc:
        raise ConfigError(f"--summary {str(path)!r}: {file_kind(exc.st_mode)}, not a regular file; allowed: {allowed}") from None
    except FileTooLarge as exc:
        raise ConfigError(f"--summary {str(path)!r}: {exc.size:,} bytes; allowed: {allowed}, at most "
                          f"{MAX_SUMMARY_BYTES:,} bytes") from None
    try:
        frame = pd.read_csv(io.BytesIO(data))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"--summary {str(path)!r}: not a CSV file ({' '.join(str(exc).split())[:200]}); "
                          f"allowed: {allowed}") from None
    missing = [c for c in SUMMARY_INPUT_COLUMNS if c not in frame.columns]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ConfigError(f"--summary {str(path)!r}: a CSV without the column(s) {shown}; allowed: {allowed}")
    wrong = [c for c in _NUMERIC_INPUT_COLUMNS if not pd.api.types.is_numeric_dtype(frame[c])]
    if wrong:
        raise ConfigError(f"--summary {str(path)!r}: column(s) {', '.join(wrong)} hold values that are not numbers; "
                          f"allowed: {allowed}")
    return frame


def write_tables(frame: pd.DataFrame, out_dir: str | Path, columns: dict[str, str] = DEFAULT_TABLES) -> list[Path]:
    """Write <name>.md, <name>.tex, <name>.csv and <name>.meta.json per table; return the written paths.

    The CSV is plain (pd.read_csv reads it as is); its caption, notes and unit are in the .meta.json.
    """
    out_dir = Path(out_dir)
    written = []
    seeds = max_seeds(frame)
    notes = [*client_notes(frame), *filter(None, [identical_note(frame)])]
    note = " ".join(notes)
    for name, column in columns.items():
        title = caption(column, seeds)
        table = pivot_table(frame, column)
        md, tex, csv, meta = (out_dir / f"{name}{ext}" for ext in (".md", ".tex", ".csv", ".meta.json"))
        write_text_atomic(md, to_markdown(table, title) + (f"\n{note}\n" if note else ""))
        write_text_atomic(tex, to_latex(table, title, name, note))
        with atomic_path(csv) as tmp:
            numeric_table(frame, column).to_csv(tmp, index=False)
        write_json_atomic(meta, {"table": name, "caption": title, "notes": notes, "column": column,
                                 "unit": "fraction (0-1; the .md and .tex show percent)" if is_percent(column) else "as in summary.csv",
                                 "seeds": seeds})
        written += [md, tex, csv, meta]
    return written
