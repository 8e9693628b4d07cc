"""What a person sees first: the report's landing page and the console summary at the end of a run.

- `description_rst`: the text of `snakemake --report`'s first screen (the workflow's `report:`
  description): the main table rendered inline, the learning curves embedded, and a description of
  only what this experiment has (tuning and paper paragraphs only when it tunes or names a paper).
- `console_summary`: the main table as text, printed when the workflow succeeds (onsuccess).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import pandas as pd

from fedrepro.report.tables import (DEFAULT_TABLES, caption, client_notes, identical_note, max_seeds, pivot_table,
                                    read_summary)

MAIN_TABLE = "accuracy"
MAX_EMBEDDED_PLOTS = 6  # more panels: the first ones inline, all of them under "Learning curves"


# Snakemake's report centres its main panel vertically (flex items-center), so a landing page taller
# than the window would start above its top, out of reach: align it to the top instead.
_TOP_ALIGNED = "<style>div.grow.h-screen.overflow-auto{align-items:flex-start}</style>"


def main_table(frame: pd.DataFrame) -> tuple[str, pd.DataFrame, list[str]]:
    """(caption, table of "mean ± std" strings, notes) of the main table."""
    column = DEFAULT_TABLES[MAIN_TABLE]
    notes = [*filter(None, [identical_note(frame)]), *client_notes(frame)]
    return caption(column, max_seeds(frame)), pivot_table(frame, column), notes


def table_html(table: pd.DataFrame) -> str:
    """The table as a small self-styled HTML table (the report's CSS resets table borders)."""
    cell = "padding:3px 10px;border-bottom:1px solid #ddd;"
    cols = [" / ".join(map(str, c)) if isinstance(c, tuple) else str(c) for c in table.columns]
    head = "".join(f"<th style='{cell}text-align:right'>{html.escape(c)}</th>" for c in cols)
    rows = "".join(
        f"<tr><td style='{cell}text-align:left'>{html.escape(str(name))}</td>"
        + "".join(f"<td style='{cell}text-align:right'>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for name, row in table.iterrows())
    return (f"<table class='fedrepro-main' style='border-collapse:collapse;margin:6px 0'><thead><tr>"
            f"<th style='{cell}text-align:left'>{html.escape(table.index.name or '')}</th>{head}</tr></thead>"
            f"<tbody>{rows}</tbody></table>")


def _raw_html(text: str) -> list[str]:
    """An rst raw-HTML block. {% raw %}: the report renders the description with Jinja before
    docutils (the tag opens the directive's line: Snakemake's Jinja strips blanks before a tag
    at a line's start); short lines: docutils refuses lines over 10,000 characters."""
    lines = (text.replace("><", ">\n<") + "{% endraw %}").split("\n")
    return ["{% raw %}.. raw:: html", "", *("   " + line for line in lines), "", ""]  # Jinja eats one newline


def _image_html(path: Path) -> str:
    # the PNG inline, its base64 in short lines (a browser drops the newlines in a data: URL)
    data = base64.b64encode(path.read_bytes()).decode()
    wrapped = "\n".join(data[i:i + 76] for i in range(0, len(data), 76))
    return (f"<figure style='margin:8px 0'><img alt='{html.escape(path.name)}' style='max-width:100%' "
            f"src='data:image/png;base64,\n{wrapped}\n'/><figcaption style='font-size:small'>{html.escape(path.name)}"
            "</figcaption></figure>")


def description_rst(frame: pd.DataFrame, spec: dict, curves: list[str | Path]) -> str:
    """The report's landing page. `spec`: experiment (name), rounds, seeds (list), tuning (bool),
    paper (its short name or None); `curves`: the learning-curve PNGs, embedded inline."""
    title = f"{spec['experiment']}: results"
    cap, table, notes = main_table(frame)
    ok = frame[frame["status"] == "ok"]
    failed = frame[frame["status"] != "ok"]
    cells = len(ok.drop_duplicates(["dataset", "partition", "label", "seed"])) + len(failed)
    lines = [title, "=" * len(title), "",
             f"**{cap}** ({cells} cell(s), {spec['rounds']} rounds"
             + (f", {len(failed)} failed" if len(failed) else "") + ")", ""]
    lines += _raw_html(_TOP_ALIGNED + table_html(table))
    lines += [" ".join(notes), ""] if notes else []
    lines += ["The other tables (per-client mean, spread across clients, worst 10 % of clients, macro-F1) are under "
              "Tables_, as CSV (fractions), Markdown and LaTeX.", ""]
    embedded = [Path(p) for p in curves if Path(p).exists()][:MAX_EMBEDDED_PLOTS]
    if embedded:
        lines += ["Learning curves", "---------------", ""]
        lines += _raw_html("".join(_image_html(p) for p in embedded))
        if len(curves) > len(embedded):
            lines += [f"{len(curves) - len(embedded)} more panel(s) under `Learning curves`_.", ""]
    seeds = spec.get("seeds") or []
    spread = ("one seed, so no spread over seeds is shown" if len(seeds) == 1
              else f"mean ± standard deviation over {len(seeds)} seeds ({', '.join(map(str, seeds))})")
    lines += ["How these numbers were made", "---------------------------", "",
              "Each method was trained on each dataset partition and seed as one job. Metrics are measured on every "
              "client's own test split at the **final round** (never the best round on test data); the table weights "
              f"clients by their test size; {spread}.", ""]
    if spec.get("tuning"):
        lines += ["Hyper-parameters were tuned first: each method was trained once per point of its search space with a "
                  "validation split carved from every client's training data, and the point with the best validation "
                  "accuracy (never test data) was selected. The \"Tuning\" group shows the selected values.", ""]
    if spec.get("paper"):
        lines += [f"The tables of {spec['paper']} are regenerated beside the published numbers under \"Paper: "
                  f"{spec['paper']}\": our mean ± std over seeds, the paper's value, the difference and whether the "
                  "seed spread explains it, with 95 % intervals, paired tests and the figures' analogues.", ""]
    return "\n".join(lines) + "\n"


def console_summary(summary_csv: str | Path) -> str:
    """The main table as text, for the console at the end of a run ('' without a summary)."""
    path = Path(summary_csv)
    if not path.exists():
        return ""
    frame = read_summary(path)  # bounded, one-line errors (docs/security.md)
    if frame.empty:
        return ""
    cap, table, notes = main_table(frame)
    table.columns = [" / ".join(map(str, c)) for c in table.columns]
    return "\n".join([f"fedrepro: {cap}", "", table.rename_axis(None).to_string(), *([""] + notes if notes else []), "",
                      f"tables: {path.parent / 'tables'}/  plots: {path.parent / 'plots'}/  status: fedrepro status {path.parent}"])
