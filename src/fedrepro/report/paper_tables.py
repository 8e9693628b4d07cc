"""A paper's table regenerated beside the published numbers: per cell our mean ± std over
seeds with its 95 % interval, the paper's value and the difference, marked where it is beyond
the seed spread; paired tests of the proposed method against each baseline, not judged where a
row has not reached a plateau (report/plateau.py); written as Markdown, LaTeX (booktabs), CSV and
HTML (the report's entry). Rules: report/stats.py.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fedrepro.io import atomic_path, write_text_atomic
from fedrepro.report.papers import DIMS, Column, PaperPlan, Row, Table, TablePlan, Target
from fedrepro.report.plateau import NOT_CONVERGED, PLATEAU_TOLERANCE, by_cell, movement, resolution, rounds_text, seed_changes
from fedrepro.report.regime import Baseline, Regime
from fedrepro.report.regime import check as regime_check
from fedrepro.report.stats import (ALPHA, LEVEL, WILCOXON_MIN_SEEDS, Deviation, PairedTest, SeedStats, deviation,
                                   evidence, evidence_text, holm, holm_alpha, paired_test, seed_stats, verdict_word)
from fedrepro.report.tables import client_notes, latex_escape

MARK = "◇"  # Markdown/HTML; LaTeX: $\diamond$
TEX_MARK = r"$^{\diamond}$"
OURS_BEST = "△"  # our best under the paper's rule (the paper's own marks are bold / *, †, ‡ on its values)
_TEX_UNICODE = {"◇": r"$\diamond$", "△": r"$\triangle$", "Δ": r"$\Delta$", "−": "$-$", "←": r"$\leftarrow$", "β": r"$\beta$", "τ": r"$\tau$",
                "σ": r"$\sigma$", "λ": r"$\lambda$", "✓": r"$\surd$", "✗": r"$\times$", "↑": r"$\uparrow$",
                "↓": r"$\downarrow$", "†": r"$\dagger$", "‡": r"$\ddagger$", "·": r"$\cdot$", "–": "--"}
_TEX_RANK = {"*": "*", "†": r"\dagger", "‡": r"\ddagger", "△": r"\triangle "}


def tex(text: object) -> str:
    """latex_escape plus the few non-ASCII symbols the tables use, for pdflatex."""
    s = latex_escape(text)
    for a, b in _TEX_UNICODE.items():
        s = s.replace(a, b)
    return s
DASH = "–"

# Cell states, as rendered
NOT_RUN = "not run"  # the experiment does not map this cell (a reduced config, or no experiment at all)
MISSING = "missing"  # mapped, but no metrics.json was given for it
FAILED = "failed"  # every seed failed
NO_KIND = "no such model"  # the runs succeeded but do not hold the kind asked for
PER_CLIENT = "in the figure"  # a table of single clients' values: ours only in its figure analogue


@dataclass
class CellResult:
    row: Row
    col: Column
    key: tuple
    target: Target | None
    status: str  # ok | not run | missing | failed | no such model | derived
    kind: str | None = None
    values: dict[int, float] = field(default_factory=dict)  # seed -> value in the paper's unit
    n_failed: int = 0
    stats: SeedStats = field(default_factory=lambda: seed_stats([]))
    paper: float | None = None
    paper_pm: float | None = None
    paper_note: str = ""
    paper_mark: str | None = None  # the paper's own mark (bold, *, †, ‡), as recorded in the published file
    in_paper: bool = False  # the paper has the cell (value or "–")
    diff: float = math.nan
    dev: Deviation = field(default_factory=lambda: Deviation("none", math.nan, None, ""))
    rank_ours: int = 0  # 1 = best, 2, 3 (rank rule): our values under the paper's rule
    # the change of its learning curve between the last two evaluations (report/plateau.py), in the
    # paper's unit: its mean over seeds and the mean of |change| (held against the tolerance); the
    # rounds; converged: moved <= tolerance (None: no curve)
    change: float = math.nan
    moved: float = math.nan
    change_rounds: tuple[tuple[int, int], ...] = ()
    converged: bool | None = None
    resolution: float = 0.0  # one scored sample in the paper's unit (plateau.resolution; 0: not known)

    @property
    def has_value(self) -> bool:
        return self.stats.n > 0 and np.isfinite(self.stats.mean)


@dataclass
class TestResult:
    proposed: Row
    baseline: Row
    col_key: tuple  # the shared (dataset, setting, metric) + any other dims, as the layout key of the proposed cell
    proposed_key: tuple
    baseline_key: tuple
    result: PairedTest


@dataclass
class TableResult:
    table: Table
    plan: TablePlan | None
    reduced: bool
    seeds: list[int]
    cells: dict[tuple, CellResult]
    tests: list[TestResult]
    frame: pd.DataFrame
    regimes: dict[tuple, Regime] = field(default_factory=dict)  # column key (key[1:]) -> its regime check

    def cell(self, row: Row, col: Column) -> CellResult:
        return self.cells[self.table.key(row, col)]


# ---------------------------------------------------------------------------------------------
# Building


def target_per_seed(frame: pd.DataFrame, t: Target) -> tuple[str, str | None, dict[int, float], int]:
    """(status, kind used, seed -> raw value, failed seeds) of a target in a summary frame."""
    mine = frame[(frame["dataset"] == t.dataset) & (frame["partition"] == t.partition) & (frame["label"] == t.label)]
    if mine.empty:
        return MISSING, None, {}, 0
    ok = mine[mine["status"] == "ok"]
    n_failed = int(mine.loc[mine["status"] != "ok", "seed"].nunique())
    if ok.empty:
        return FAILED, None, {}, n_failed
    present = set(ok["kind"])
    kind = next((k for k in t.kinds if k in present), None)
    if kind is None:
        return NO_KIND, None, {}, n_failed
    rows = ok[ok["kind"] == kind]
    values = {int(s): float(v) for s, v in zip(rows["seed"], rows[t.column])}
    return "ok", kind, values, n_failed


def build_table(table: Table, frame: pd.DataFrame, plan: TablePlan | None = None, reduced: bool = False,
                seeds: list[int] | None = None, runs: list[dict] | None = None) -> TableResult:
    """Fill `table` from a summary frame (report.aggregate.summary_frame of the cells' metrics);
    `runs`, those metrics (their curves: whether each cell reached a plateau)."""
    targets = plan.targets if plan is not None else {}
    curves = by_cell(runs or [])
    pm = table.pm or {}
    paper_runs = pm.get("runs") if pm.get("kind") == "seed_std" else None
    cells: dict[tuple, CellResult] = {}
    for row in table.rows:
        for col in table.columns:
            key = table.key(row, col)
            metric = table.metric(key)
            pc = table.cells.get(key)
            c = CellResult(row, col, key, targets.get(key), NOT_RUN if not row.derived else "derived")
            if pc is not None:
                c.in_paper, c.paper, c.paper_pm, c.paper_note, c.paper_mark = True, pc.value, pc.pm, pc.note, pc.mark
            if c.target is not None and table.per_client:
                c.status = PER_CLIENT
            elif c.target is not None:
                c.status, c.kind, raw, c.n_failed = target_per_seed(frame, c.target)
                c.values = {s: v * metric.scale for s, v in raw.items()}
                c.stats = seed_stats(c.values.values())
                if c.status == "ok" and c.stats.n == 0:
                    c.status = FAILED if c.n_failed else MISSING
                c.resolution = resolution(curves, c.target, c.kind, c.values) * metric.scale
                move = movement(seed_changes(curves, c.target, c.kind, c.values).values())
                if move is not None:  # the plateau check: the last change, in the paper's unit
                    c.change, c.moved = move.change * metric.scale, move.moved * metric.scale
                    c.change_rounds, c.converged = move.rounds, move.converged
            cells[key] = c
    # derived rows: the mean of the other rows' means in the column, where every one of them has a value
    for row in table.rows:
        if row.derived != "mean":
            continue
        for col in table.columns:
            others = [cells[table.key(r, col)] for r in table.rows if not r.derived]
            c = cells[table.key(row, col)]
            if others and all(o.has_value for o in others):
                c.stats = seed_stats([float(np.mean([o.stats.mean for o in others]))])
                c.status = "ok"
    for c in cells.values():
        if c.has_value and c.paper is not None and not reduced:
            c.diff = c.stats.mean - c.paper
            if not c.row.derived:
                c.dev = deviation(c.stats, c.paper, c.paper_pm if paper_runs else None, paper_runs)
    _rank(table, cells)
    tests = _tests(table, cells)
    return TableResult(table, plan, reduced, list(seeds or []), cells, tests, frame, _regimes(table, cells))


def _regimes(table: Table, cells: dict[tuple, CellResult]) -> dict[tuple, Regime]:
    """The regime check (report/regime.py) of every column that holds a proposed cell of ours: its
    baseline rows' means against the paper's values for the same rows."""
    proposed = set(table.proposed)
    columns = {c.key[1:] for c in cells.values() if c.key[0] in proposed and not c.row.derived and c.has_value}
    out = {}
    for col in sorted(columns, key=str):
        # every baseline row the paper has a value for: one without a value of ours is named as dropped
        rows = [c for c in cells.values() if c.key[1:] == col and c.key[0] not in proposed and not c.row.derived
                and c.paper is not None and (c.has_value or c.status in (MISSING, FAILED, NO_KIND))]
        base = [Baseline(c.key[0], table.row_name(c.row), c.stats.mean if c.has_value else math.nan, c.paper) for c in rows]
        moving = {c.key[0] for c in rows if c.converged is False}  # not at its plateau: its place is not its own
        metric = table.metric(next(k for k in cells if k[1:] == col))
        out[col] = regime_check(base, metric.better, metric.decimals, moving)
    return out


def _rank(table: Table, cells: dict[tuple, CellResult]) -> None:
    """Apply the paper's bolding rule to our means (the paper's own marks are data: PaperCell.mark)."""
    rule = table.bold.get("rule", "none")
    if rule == "none":
        return
    only = table.bold.get("metrics")
    within = table.bold.get("within", "column")
    top = 1 if rule == "best" else len(table.bold.get("marks") or ["*", "†", "‡"])
    groups: dict[tuple, list[CellResult]] = {}
    for c in cells.values():
        if c.row.derived or (only and c.key[3] not in only):
            continue
        gkey = ("table",) if within == "table" else (c.col.header, tuple(c.col.key.items())) + (
            (c.row.section,) if within == "section" else ())
        groups.setdefault(gkey, []).append(c)
    for group in groups.values():
        vals = []
        for c in group:
            if c.has_value:
                m = table.metric(c.key)
                vals.append((round(c.stats.mean if m.better == "higher" else -c.stats.mean, m.decimals), c))
        distinct = sorted({v for v, _ in vals}, reverse=True)
        for v, c in vals:
            r = distinct.index(v) + 1
            if r <= top:
                c.rank_ours = r


def _tests(table: Table, cells: dict[tuple, CellResult]) -> list[TestResult]:
    """Each proposed cell against every baseline cell that shares all dims but the method."""
    out = []
    proposed = set(table.proposed)
    for c in cells.values():
        if c.key[0] not in proposed or c.row.derived or c.status != "ok":
            continue
        for b in cells.values():
            if b.key[0] in proposed or b.row.derived or b.key[1:] != c.key[1:]:
                continue
            if b.status != "ok":
                continue
            out.append(TestResult(c.row, b.row, c.key[1:], c.key, b.key, paired_test(c.values, b.values)))
    return out


# ---------------------------------------------------------------------------------------------
# Text


def number_text(v: float, d: int) -> str:
    """`v` with `d` decimals, or a dash where there is no finite value (a table cell)."""
    if v is None or not np.isfinite(v):
        return DASH
    return f"{round(v, d) + 0.0:.{d}f}"  # + 0.0: a value that rounds to zero prints without a sign


def signed_text(v: float, d: int) -> str:
    """`v` with `d` decimals and its sign (a typographic minus), or a dash where there is no finite value."""
    if not np.isfinite(v):
        return DASH
    r = round(v, d) + 0.0
    return f"{r:+.{d}f}".replace("-", "−") if r else f"{0:.{d}f}"


def paired_text(r: PairedTest, d: int) -> str:
    """One paired test as a cell: mean difference, test, p and the n it used; degenerate: why there is no p."""
    if r.test == "none":
        return f"n/a: {r.note} (n={r.n})" if r.n >= 2 else f"n/a ({r.note})"
    short = "W" if r.test.startswith("Wilcoxon") else "t"
    return f"{signed_text(r.mean_diff, d)}, {short}, {_fmt_p(r.p)} (n={r.n}{'; ' + r.note if r.note else ''})"


def _fmt_p(p: float) -> str:
    if not np.isfinite(p):
        return f"p = {DASH}"
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def ours_text(res: TableResult, c: CellResult) -> tuple[str, str]:
    """(number part, trailing note) of our side of a cell; the best-mark goes between them."""
    d = res.table.metric(c.key).decimals
    if c.row.derived:
        return (number_text(c.stats.mean, d), "") if c.has_value else (DASH, "")
    if c.status != "ok":
        return "", (f"{FAILED} ({c.n_failed} seed{'s' if c.n_failed != 1 else ''})" if c.status == FAILED else c.status)
    main = number_text(c.stats.mean, d)
    spread = f" ± {number_text(c.stats.std, d)}" if c.stats.n >= 2 else ""
    extra = []
    expected = len(res.seeds)
    if expected and c.stats.n < expected:
        extra.append(f"n={c.stats.n}")
    if c.n_failed:
        extra.append(f"{c.n_failed} failed")
    return main, spread + (f" ({', '.join(extra)})" if extra else "")


def ours_mark(res: TableResult, c: CellResult) -> str:
    """△ on our best under the paper's rule (△1, △2, △3 under a rank rule); never the paper's own marks."""
    if c.rank_ours == 0:
        return ""
    return OURS_BEST if res.table.bold.get("rule") == "best" else f"{OURS_BEST}{c.rank_ours}"


def paper_parts(res: TableResult, c: CellResult) -> tuple[str, bool, str, str]:
    """(value, bold as printed, the paper's rank mark, trailing ±) of the paper's side of a cell.

    A ± that is not a spread over runs (Calibre: over clients) carries its kind, so that it is
    never read as the same kind of spread as ours beside it."""
    d = res.table.metric(c.key).decimals
    if not c.in_paper:
        return DASH, False, "", ""
    if c.paper is None:
        return "n/a", False, "", ""
    pm = ""
    if c.paper_pm is not None:
        kind = (res.table.pm or {}).get("kind")
        pm = f" ± {number_text(c.paper_pm, d)}" + (f" ({PM_LABEL[kind]})" if kind in PM_LABEL else "")
    mark = c.paper_mark if c.paper_mark not in (None, "bold") else ""
    return number_text(c.paper, d), c.paper_mark == "bold", mark, pm


PM_LABEL = {"client_std": "clients"}  # the ± kinds that differ from ours (std over seeds)


def paper_text(res: TableResult, c: CellResult) -> str:
    value, _, mark, pm = paper_parts(res, c)
    return value + mark + pm


def diff_text(res: TableResult, c: CellResult, mark: str = MARK) -> str:
    d = res.table.metric(c.key).decimals
    if res.reduced or not np.isfinite(c.diff):
        return DASH
    return signed_text(c.diff, d) + (f" {mark}" if c.dev.beyond else "")


def _rule_text(t: Table) -> str:
    rule = t.bold.get("rule")
    what = {"best": f"{OURS_BEST}: our best", "rank": f"{OURS_BEST}1, {OURS_BEST}2, {OURS_BEST}3: our 1st, 2nd, 3rd best"}[rule]
    scope = {"table": "in the table", "section": "per column within each section", "column": "per column"}[t.bold.get("within", "column")]
    only = f" (metrics {', '.join(t.name('metric', m) for m in t.bold['metrics'])} only)" if t.bold.get("metrics") else ""
    return f"{what} {scope}{only}, by the paper's rule{' (' + t.bold['note'] + ')' if t.bold.get('note') else ''}"


def notes(res: TableResult) -> list[str]:
    """The footnotes every rendering carries: how to read a cell, and every assumption behind a mark."""
    t = res.table
    n = len(res.seeds)
    pm = t.pm or {}
    out = []
    counts = sorted({c.stats.n for c in res.cells.values() if c.status == "ok" and not c.row.derived})
    seeds = f"{n} seed(s) per cell ({', '.join(map(str, res.seeds))})" if n else "seeds as run"
    out.append(f"Seeds: {seeds}; successful seeds per cell: {', '.join(map(str, counts)) or 'none'}"
               f"{' (a cell with fewer shows its n)' if len(counts) > 1 or (counts and n and counts[0] < n) else ''}.")
    paper_pm = ""
    if pm.get("kind") == "seed_std":
        paper_pm = f" ± its std over {pm.get('runs')} runs" + (" (assumed, see below)" if pm.get("assumed") else "")
    elif pm.get("kind") == "client_std":
        paper_pm = " ± its spread over clients, marked '(clients)': a different kind of spread from ours"
    out.append(f"Each cell: ours = mean ± std over seeds (sample std, ddof = 1) / the paper's value{paper_pm} / "
               f"Δ = ours − paper. 95 % confidence intervals (Student t over seeds) are in the CSV.")
    if t.per_client:
        out.append("The paper's values here are single clients' (a figure of the paper); ours are drawn in the figure "
                   "analogue, not averaged over clients into this table.")
    if res.reduced:
        out.append("Reduced configuration: the runs stand in for the paper's setting (datasets below); the paper's values "
                   "are shown for reference only, so no difference is computed or judged.")
    elif n == 1 or (counts and max(counts) < 2):
        out.append(f"One seed: there is no spread over seeds, so no difference is judged ({MARK} never shown) and no paired "
                   "test is run.")
    else:
        paper_side = (f"Welch's test with the paper's ± as the std of its {pm.get('runs')} runs"
                      if pm.get("kind") == "seed_std" and pm.get("runs") else "a one-sample t-test, i.e. the paper's value "
                      "lies outside our 95 % interval")
        out.append(f"{MARK}: Δ beyond what the seed spread explains: {paper_side}, two-sided, p < {ALPHA}; "
                   f"no {MARK} and no p where every seed has the same value (the test is undefined)."
                   + (" The paper's ± is a spread over clients and is not used." if pm.get("kind") == "client_std" else ""))
    if pm.get("assumed"):
        out.append(f"Assumed: the paper's ± is the std over {pm.get('runs')} runs ({pm['assumed']}); every {MARK} of this "
                   "table rests on it.")
    if t.marks:
        out.append(f"The paper's values carry the paper's own marks (bold, or {', '.join(t.bold.get('marks') or ['*', '†', '‡'])}), "
                   f"as printed; source: {t.marks['source']}{' (' + t.marks['note'] + ')' if t.marks.get('note') else ''}.")
    else:
        out.append("The paper's marks (bold and the like) are not recorded for this table, so its values are shown plain.")
    if t.bold.get("rule") != "none":
        out.append(_rule_text(t) + ".")
    if t.measure:
        out.append(f"Paper's measure: {t.measure}.")
    used = sorted({(c.target.column, c.kind) for c in res.cells.values() if c.target is not None and c.kind})
    if used:
        out.append("Ours: " + "; ".join(f"summary column {col} of model kind '{kind}'" for col, kind in used) + ".")
    resolved = sorted({(t.name("metric", c.key[3]), round(c.resolution, 4)) for c in res.cells.values() if c.resolution > 0})
    if resolved:
        out.append("Resolution: one scored sample is " + "; ".join(f"{r:g} of {m}" for m, r in resolved)
                   + " (1 / the samples scored, mean over seeds): a spread below it counts as it, and no gain below it "
                   "is called detectable.")
    plateau = plateau_note(res)
    if plateau:
        out.append(plateau)
    out.extend(regime_notes(res))
    stand = sorted({(t.name("dataset", c.key[1]), c.target.dataset, c.target.partition, t.name("setting", c.key[2]))
                    for c in res.cells.values() if c.target is not None and c.target.stand_in})
    if stand:
        out.append("Stand-ins: " + "; ".join(f"{pd_} {ps} ← our {ds}/{part}" for pd_, ds, part, ps in stand) + ".")
    if t.note:
        out.append(f"Transcription: {t.note}")
    for c in res.cells.values():
        if c.paper_note:
            out.append(f"{t.row_name(c.row)}, {_col_name(t, c.col)}: {c.paper_note}.")
    if res.tests:
        used_tests = sorted({tr.result.test for tr in res.tests if tr.result.test != "none"})
        out.append(f"Paired tests ({', '.join(used_tests) or 'none possible'}): {', '.join(t.name('method', m) for m in t.proposed)} "
                   f"against each baseline, same column, paired by seed; Wilcoxon signed-rank from {WILCOXON_MIN_SEEDS} "
                   f"common seeds on (its n: the non-zero differences it ranks), paired t-test below; two-sided; the verdict "
                   f"reads the Holm-adjusted p over the column's tests: holds / contradicted where it is below {ALPHA} "
                   f"(the gain positive / negative), not shown otherwise; beside it the mean gain with its 95 % interval, "
                   f"P(A > B) over seeds (ties count half) and the gain the seeds detect at 80 % power; no p where "
                   f"every difference is the same (the tests are undefined).")
    note = " ".join(client_notes(res.frame)) if len(res.frame) else ""
    if note:
        out.append(note)
    out.append(f"Source: {t.paper.info.get('source')}, {t.title}"
               f"{', page ' + str(t.page) if t.page else ''}{' (' + t.location + ')' if t.location else ''}.")
    return out


def plateau_note(res: TableResult) -> str:
    """Did every row reach a plateau (report/plateau.py)? '' where no cell has a curve."""
    t = res.table
    valued = [c for c in res.cells.values() if c.has_value and not c.row.derived]
    judged = [c for c in valued if c.converged is not None]
    if not judged:
        return ""
    d = lambda c: t.metric(c.key).decimals  # noqa: E731
    tol = ", ".join(sorted({number_text(PLATEAU_TOLERANCE * t.metric(c.key).scale, d(c)) for c in judged}))
    why = f"the last two evaluations; tolerance {tol}, a convention of this project"
    if len(judged) < len(valued):
        why += f"; {len(valued) - len(judged)} cell(s) without a curve not judged"
    moving = [c for c in judged if not c.converged]
    if not moving:
        top = max(judged, key=lambda c: c.moved)
        return (f"Plateau: every row moved by at most {number_text(top.moved, d(top))} between "
                f"{rounds_text(r for c in judged for r in c.change_rounds)} ({why}).")
    # one entry per row and movement: the columns that read the same curve moved alike
    by_row: dict[str, dict[str, list[str]]] = {}
    for c in moving:
        moved = f"{_moved_text(c.change, c.moved, d(c))} between {rounds_text(c.change_rounds)}"
        by_row.setdefault(t.row_name(c.row), {}).setdefault(moved, []).append(_col_name(t, c.col))
    rows = [f"{row} ({', '.join(cols)}) moved by {moved}" for row, moves in by_row.items() for moved, cols in moves.items()]
    return f"Not converged: {'; '.join(rows)} ({why}): their ordering is not judged."


def _moved_text(change: float, moved: float, d: int) -> str:
    """The mean change, signed; where the seeds moved both ways, their mean |change| too."""
    both = abs(change) < moved - 1e-9
    return signed_text(change, d) + (f" (mean |change| {number_text(moved, d)}: the seeds moved both ways)" if both else "")


def test_verdict(res: TableResult, tr: TestResult) -> str:
    """The verdict of one paired test (issue 56): holds / contradicted (the Holm-adjusted p over the
    column's paired tests below ALPHA, the proposed row better / worse in the metric's direction) or
    not shown, each with its evidence (stats.evidence_text); "not judged: ..." where the column's
    regime check disagrees (report/regime.py), where a side has not reached a plateau, or where the
    test is undefined. A weak regime check is said beside the verdict."""
    blocks = []
    regime = res.regimes.get(tr.col_key)
    if regime is not None and regime.verdict_block:
        blocks.append(regime.verdict_block)
    if _moving(res, tr):
        blocks.append(NOT_CONVERGED)
    if blocks:
        return "; ".join(blocks)
    r = tr.result
    if r.test == "none" or not np.isfinite(r.p):
        return f"not judged ({r.note})" if r.note else "not judged"
    family = [t for t in res.tests if t.col_key == tr.col_key]
    p_holm = holm([t.result.p for t in family])[family.index(tr)]
    metric = res.table.metric(tr.proposed_key)
    a, b = res.cells[tr.proposed_key], res.cells[tr.baseline_key]
    e = evidence(a.values, b.values, metric.better, max(a.resolution, b.resolution), holm_alpha(r.p, p_holm))
    return (f"{verdict_word(e.gain, p_holm)}{regime.strength() if regime is not None else ''} "
            f"({evidence_text(e, p_holm, metric.decimals)})")


def regime_notes(res: TableResult) -> list[str]:
    """One note per checked column: its regime check, and what a disagreement does to the verdicts."""
    t = res.table
    out = []
    for col, regime in res.regimes.items():
        where = " / ".join(t.name(d, v) for d, v in zip(DIMS[1:], col))
        line = f"Regime check ({where}): {regime.text()}"
        if regime.verdict_block:
            line += f"; every paired test of this column: '{regime.verdict_block}'"
        out.append(line + ".")
    if out:
        out.append("Regime check: our baseline rows' means against the paper's values for the same rows (src/fedrepro/"
                   "report/regime.py): it agrees with ρ ≥ 0.6 or τ ≥ 0.45 and Local and FedAvg within one place of the "
                   "paper's, and with two or three baselines where the order is the paper's; one baseline is unchecked; "
                   "ties take the average place; rows without a value or not converged are left out and named; "
                   "conventions of this project. The permutation p is the share of orderings of our baselines that "
                   "agree with the paper's at least as well (Spearman ρ); above 0.05 the check is 'weak'. Only where it "
                   "agrees and both rows reached a plateau is a test given a verdict.")
    return out


def _moving(res: TableResult, tr: TestResult) -> bool:
    """Does either side of a paired test still move (not converged)?"""
    return any(res.cells[k].converged is False for k in (tr.proposed_key, tr.baseline_key))


def _col_name(t: Table, col: Column) -> str:
    return " / ".join(t.name(d, v) for d, v in col.header) or t.name("metric", col.key.get("metric", ""))


def title(res: TableResult) -> str:
    t = res.table
    reading = res.plan.reading if res.plan is not None else None
    kind = f" (reading {reading}: kind {', '.join(res.plan.mapping['kind'] if isinstance(res.plan.mapping['kind'], list) else [res.plan.mapping['kind']])})" if reading else ""
    return f"{t.paper.short} {t.title}{kind}: {t.caption}"


def to_markdown(res: TableResult) -> str:
    t = res.table
    head = ["Method" if "method" in t.rows[0].key else " · ".join(t.rows[0].key)] + [_col_name(t, c) for c in t.columns]
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = [f"Table: {title(res)}", "",
             "Each cell: ours (mean ± std over seeds) / paper / Δ (ours − paper).", "",
             "| " + " | ".join(map(esc, head)) + " |", "|" + "|".join([":---"] + ["---:"] * len(t.columns)) + "|"]
    section = None
    for row in t.rows:
        if row.section != section and row.section:
            lines.append("| " + f"*{esc(row.section)}*" + " |" * len(t.columns) + " |")
        section = row.section
        cells = []
        for col in t.columns:
            c = res.cell(row, col)
            main, rest = ours_text(res, c)
            value, bold, mark, pm = paper_parts(res, c)
            paper = (f"**{value}**" if bold else value) + mark.replace("*", "\\*") + pm
            cells.append(f"{main}{ours_mark(res, c)}{rest} / {paper} / {diff_text(res, c)}")
        lines.append("| " + " | ".join(map(esc, [t.row_name(row), *cells])) + " |")
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes(res)) + "\n"
    if res.tests:
        text += "\n" + tests_markdown(res)
    return text


def _tests_grid(res: TableResult) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The paired tests as (column names, [(row name, cells)]): one row per proposed-baseline pair."""
    t = res.table
    cols = list(dict.fromkeys(tr.col_key for tr in res.tests))
    pairs = list(dict.fromkeys((tr.proposed_key[0], tr.baseline_key[0]) for tr in res.tests))
    by = {(tr.proposed_key[0], tr.baseline_key[0], tr.col_key): tr for tr in res.tests}
    varying = [i for i in range(3) if len({k[i] for k in cols}) > 1]
    names = [" / ".join(t.name(DIMS[1 + i], k[i]) for i in varying) or t.name("metric", k[2]) for k in cols]
    rows = []
    for p, b in pairs:
        cells = [DASH if (p, b, k) not in by else paired_text(by[(p, b, k)].result, t.paper.metrics[k[2]].decimals)
                 + f"; verdict: {test_verdict(res, by[(p, b, k)])}" for k in cols]
        rows.append((f"{t.name('method', p)} vs {t.name('method', b)}", cells))
    return names, rows


TESTS_TITLE = "Paired tests: proposed − baseline over common seeds, mean difference (in the paper's unit), test, p, n used."
TESTS_KEY = ("t: paired t-test; W: Wilcoxon signed-rank (exact where possible; n counts the non-zero differences it "
             "ranks); two-sided; n/a: the test is undefined (every difference the same) or fewer than 2 common seeds.")


def tests_markdown(res: TableResult) -> str:
    names, rows = _tests_grid(res)
    lines = [TESTS_TITLE, "", "| Proposed vs baseline | " + " | ".join(names) + " |", "|:---|" + "---:|" * len(names)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return "\n".join(lines) + f"\n\n{TESTS_KEY}\n"


def tests_latex(res: TableResult, label: str = "") -> str:
    """The paired tests as a second booktabs table (the same numbers as the Markdown, HTML and CSV)."""
    names, rows = _tests_grid(res)
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{tex(res.table.paper.short + ' ' + res.table.title + ': ' + TESTS_TITLE)}}}"]
    if label:
        lines.append(rf"\label{{tab:{label}_tests}}")
    lines += [r"\resizebox{\linewidth}{!}{%", r"\begin{tabular}{l" + "r" * len(names) + "}", r"\toprule",
              " & ".join(["Proposed vs baseline", *map(tex, names)]) + r" \\", r"\midrule"]
    lines += [" & ".join([tex(name), *map(tex, cells)]) + r" \\" for name, cells in rows]
    lines += [r"\bottomrule", r"\end{tabular}}", r"\par\smallskip{\footnotesize " + tex(TESTS_KEY) + "}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def _header_spans(t: Table, level: int) -> list[tuple[str, int]]:
    """(name, width) runs of equal header prefixes at `level` (0 = outermost)."""
    spans: list[tuple[tuple, str, int]] = []
    for col in t.columns:
        prefix = col.header[: level + 1]
        if spans and spans[-1][0] == prefix:
            spans[-1] = (prefix, spans[-1][1], spans[-1][2] + 1)
        else:
            spans.append((prefix, t.name(*col.header[level]), 1))
    return [(n, w) for _, n, w in spans]


def _tex_sup(mark: str) -> str:
    """A mark (*, †, ‡ or △, △1 ...) as a LaTeX superscript."""
    body = "".join(_TEX_RANK.get(ch, ch) for ch in mark)
    return f"$^{{{body}}}$" if mark else ""


def to_latex(res: TableResult, label: str = "") -> str:
    """booktabs, three sub-columns (ours | paper | Δ) per paper column, then the paired tests;
    needs booktabs and graphicx."""
    t = res.table
    n = len(t.columns)
    levels = len(t.columns[0].header)
    lines = [f"% {title(res)}", "% needs \\usepackage{booktabs,graphicx}", r"\begin{table}[t]", r"\centering",
             rf"\caption{{{tex(title(res))}}}"]
    if label:
        lines.append(rf"\label{{tab:{label}}}")
    lines += [r"\resizebox{\linewidth}{!}{%", r"\begin{tabular}{l" + "rrr" * n + "}", r"\toprule"]
    for level in range(levels):
        cells, rules, start = [""], [], 2
        for name, width in _header_spans(t, level):
            cells.append(rf"\multicolumn{{{3 * width}}}{{c}}{{{tex(name)}}}")
            rules.append(rf"\cmidrule(lr){{{start}-{start + 3 * width - 1}}}")
            start += 3 * width
        lines += [" & ".join(cells) + r" \\", " ".join(rules)]
    first = "Method" if "method" in t.rows[0].key else ""
    lines.append(" & ".join([first] + [r"ours & paper & $\Delta$"] * n) + r" \\")
    lines.append(r"\midrule")
    section = None
    for i, row in enumerate(t.rows):
        if row.section != section and row.section:
            if i:
                lines.append(r"\midrule")
            lines.append(rf"\multicolumn{{{1 + 3 * n}}}{{l}}{{\emph{{{tex(row.section)}}}}} \\")
        elif row.derived and i and not t.rows[i - 1].derived:
            lines.append(r"\midrule")
        section = row.section
        out = [tex(t.row_name(row))]
        for col in t.columns:
            c = res.cell(row, col)
            main, rest = ours_text(res, c)
            ours = tex(main) + _tex_sup(ours_mark(res, c)) + tex(rest)
            value, bold, mark, pm = paper_parts(res, c)
            paper = (rf"\textbf{{{tex(value)}}}" if bold else tex(value)) + _tex_sup(mark) + tex(pm)
            diff = tex(diff_text(res, c, mark="").strip()) + (TEX_MARK if c.dev.beyond and not res.reduced else "")
            out += [ours, paper, diff]
        lines.append(" & ".join(out) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}}"]
    lines.append(r"\par\smallskip{\footnotesize " + " ".join(tex(x) for x in notes(res)) + "}")
    lines.append(r"\end{table}")
    text = "\n".join(lines) + "\n"
    if res.tests:
        text += "\n" + tests_latex(res, label)
    return text


def to_html(res: TableResult) -> str:
    """A standalone HTML page: the comparison table, its notes and the paired tests."""
    t = res.table
    e = html.escape
    n = len(t.columns)
    levels = len(t.columns[0].header)
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + e(title(res)) + "</title><style>",
           "body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse;margin:8px 0}"
           "th,td{padding:2px 6px;text-align:right;white-space:nowrap}td.m,th.m{text-align:left}"
           "thead tr:last-child th{border-bottom:1px solid #000}table{border-top:2px solid #000;border-bottom:2px solid #000}"
           "td.p{color:#555}td.d{color:#555;border-right:1px solid #ddd}tr.s td{font-style:italic;text-align:left;"
           "border-top:1px solid #000}.beyond{color:#b00;font-weight:bold}.na{color:#999}",
           "</style></head><body>", f"<h3>{e(title(res))}</h3>", "<table><thead>"]
    for level in range(levels):
        out.append("<tr><th class='m'></th>" + "".join(f"<th colspan='{3 * w}'>{e(name)}</th>"
                                                       for name, w in _header_spans(t, level)) + "</tr>")
    out.append("<tr><th class='m'>Method</th>" + "<th>ours</th><th>paper</th><th>Δ</th>" * n + "</tr></thead><tbody>")
    section = None
    for row in t.rows:
        if row.section != section and row.section:
            out.append(f"<tr class='s'><td colspan='{1 + 3 * n}'>{e(row.section)}</td></tr>")
        section = row.section
        tds = [f"<td class='m'>{e(t.row_name(row))}</td>"]
        for col in t.columns:
            c = res.cell(row, col)
            main, rest = ours_text(res, c)
            mark = ours_mark(res, c)
            cls = "" if c.status in ("ok", "derived") else " class='na'"
            tds.append(f"<td{cls}>{e(main)}{f'<sup>{e(mark)}</sup>' if mark else ''}{e(rest)}</td>")
            value, bold, pmark, pm = paper_parts(res, c)
            paper = (f"<b>{e(value)}</b>" if bold else e(value)) + (f"<sup>{e(pmark)}</sup>" if pmark else "") + e(pm)
            tds.append(f"<td class='p'>{paper}</td>")
            diff = e(diff_text(res, c))
            tds.append(f"<td class='d'>{f'<span class=beyond>{diff}</span>' if c.dev.beyond and not res.reduced else diff}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</tbody></table><ul>" + "".join(f"<li>{e(x)}</li>" for x in notes(res)) + "</ul>")
    if res.tests:
        out.append("<h4>Paired tests</h4><pre>" + e(tests_markdown(res)) + "</pre>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


CELL_COLUMNS = ["paper_id", "table", "section", "row", *DIMS, "unit", "label", "dataset_run", "partition", "kind",
                "column", "status", "n_seeds", "n_failed", "seeds", "mean", "std", "ci95_low", "ci95_high", "paper",
                "paper_pm", "paper_pm_kind", "paper_mark", "diff", "beyond_spread", "deviation_test", "deviation_p",
                "rank_ours", "reduced", "note", "last_change", "last_rounds", "converged", "regime_rho", "regime_tau",
                "regime_agrees", "regime_perm_p", "regime_weak"]
TEST_COLUMNS = ["paper_id", "table", "proposed", "baseline", "dataset", "setting", "metric", "n", "mean_diff", "test",
                "statistic", "p", "note", "convergence", "regime", "verdict"]


def cells_frame(res: TableResult) -> pd.DataFrame:
    t = res.table
    rows = []
    for c in res.cells.values():
        tg = c.target
        metric = t.metric(c.key)
        rows.append({
            "paper_id": t.paper.id, "table": t.id, "section": c.row.section, "row": t.row_name(c.row),
            **dict(zip(DIMS, c.key)), "unit": metric.unit,
            "label": tg.label if tg else None, "dataset_run": tg.dataset if tg else None,
            "partition": tg.partition if tg else None, "kind": c.kind, "column": tg.column if tg else None,
            "status": c.status, "n_seeds": c.stats.n, "n_failed": c.n_failed,
            "seeds": " ".join(map(str, sorted(c.values))) or None,
            "mean": c.stats.mean if c.has_value else None, "std": c.stats.std if c.stats.n >= 2 else None,
            "ci95_low": c.stats.ci_low if c.stats.n >= 2 else None, "ci95_high": c.stats.ci_high if c.stats.n >= 2 else None,
            "paper": c.paper, "paper_pm": c.paper_pm, "paper_pm_kind": (t.pm or {}).get("kind") if c.paper_pm is not None else None,
            "diff": c.diff if np.isfinite(c.diff) else None, "beyond_spread": c.dev.beyond,
            "deviation_test": None if c.dev.test == "none" else c.dev.test,
            "deviation_p": c.dev.p if np.isfinite(c.dev.p) else None,
            "paper_mark": c.paper_mark, "rank_ours": c.rank_ours or None, "reduced": res.reduced,
            "note": c.paper_note or None,
            "last_change": c.change if np.isfinite(c.change) else None,
            "last_rounds": " ".join(f"{a}-{b}" for a, b in c.change_rounds) or None, "converged": c.converged,
            **_regime_fields(res.regimes.get(c.key[1:])),
        })
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def tests_frame(res: TableResult) -> pd.DataFrame:
    t = res.table
    rows = [{"paper_id": t.paper.id, "table": t.id, "proposed": t.row_name(tr.proposed), "baseline": t.row_name(tr.baseline),
             "dataset": tr.proposed_key[1], "setting": tr.proposed_key[2], "metric": tr.proposed_key[3], "n": tr.result.n,
             "mean_diff": tr.result.mean_diff if np.isfinite(tr.result.mean_diff) else None, "test": tr.result.test,
             "statistic": tr.result.statistic if np.isfinite(tr.result.statistic) else None,
             "p": tr.result.p if np.isfinite(tr.result.p) else None, "note": tr.result.note or None,
             "convergence": _convergence(res, tr), "regime": _regime_text(res, tr), "verdict": test_verdict(res, tr)}
            for tr in res.tests]
    return pd.DataFrame(rows, columns=TEST_COLUMNS)


def _regime_fields(regime: Regime | None) -> dict:
    """The cells CSV's regime columns: the column's ρ, τ and whether it agrees (None: no check)."""
    if regime is None:
        return {"regime_rho": None, "regime_tau": None, "regime_agrees": None, "regime_perm_p": None, "regime_weak": None}
    fin = lambda v: v if np.isfinite(v) else None  # noqa: E731
    return {"regime_rho": fin(regime.rho), "regime_tau": fin(regime.tau), "regime_agrees": regime.agrees,
            "regime_perm_p": fin(regime.perm_p), "regime_weak": regime.weak}


def _regime_text(res: TableResult, tr: TestResult) -> str | None:
    """The tests CSV's regime: 'agrees', 'differs: ...' or 'unchecked: ...'."""
    r = res.regimes.get(tr.col_key)
    if r is None:
        return None
    return "agrees" if r.agrees else f"{'differs' if r.agrees is False else 'unchecked'}: {r.reason}"


def _convergence(res: TableResult, tr: TestResult) -> str | None:
    """The tests CSV's convergence: NOT_CONVERGED, 'plateau' (both sides), None (a side has no curve)."""
    if _moving(res, tr):
        return NOT_CONVERGED
    return "plateau" if all(res.cells[k].converged for k in (tr.proposed_key, tr.baseline_key)) else None


def _write_csv(path: Path, frame: pd.DataFrame) -> None:
    """A plain CSV (pd.read_csv reads it as is): the title and notes are in the .md and .html beside it."""
    with atomic_path(path) as tmp:
        frame.round(6).to_csv(tmp, index=False)


def write_table(res: TableResult, out_prefix: str | Path) -> list[Path]:
    """<prefix>.md, .tex, .csv (one row per cell), .html and <prefix>_tests.csv."""
    prefix = Path(out_prefix)
    paths = {ext: prefix.with_name(prefix.name + ext) for ext in (".md", ".tex", ".csv", ".html", "_tests.csv")}
    label = f"{res.table.paper.id}_{res.table.id}"
    write_text_atomic(paths[".md"], to_markdown(res))
    write_text_atomic(paths[".tex"], to_latex(res, label))
    write_text_atomic(paths[".html"], to_html(res))
    _write_csv(paths[".csv"], cells_frame(res))
    _write_csv(paths["_tests.csv"], tests_frame(res))
    return list(paths.values())


def build_from_plan(plan: PaperPlan, table_id: str, frame: pd.DataFrame, runs: list[dict] | None = None) -> TableResult:
    tp = plan.tables[table_id]
    return build_table(tp.table, frame, tp, plan.reduced, plan.seeds, runs)
