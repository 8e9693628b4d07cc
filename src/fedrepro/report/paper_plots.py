"""Analogues of the papers' figures, drawn from the runs a paper table maps:

* curves       FedCRC Fig. 3, FedCoSR Fig. 5: accuracy per round, mean over seeds, min-max band
* client_bars  FedCoSR Fig. 6: final accuracy of every client, mean over seeds, one bar per method
* pg_tradeoff  GRP-FED Fig. 4: personalization P against generalization G per method, iso-lines of
               their harmonic mean, the paper's values as open markers
* mean_variance Calibre Fig. 3/4: mean client accuracy against its variance over clients
* metric_bars  FedGCR Tables 1-2 as bars (σ_type, σ_client): ours with 95 % intervals, the paper's
               values as black ticks
* client_cases GRP-FED Fig. 5: single clients' metrics per method, one panel per client the paper
               shows; ours from the client picked by the figure's rule, the paper's as black ticks

Headless and deterministic, like report/plots.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from matplotlib.ticker import MaxNLocator

from fedrepro.report.aggregate import cell_ident, curves_frame, is_ok, summary_frame
from fedrepro.report.paper_tables import TableResult, build_table
from fedrepro.report.papers import DIMS, FigurePlan, PaperPlan, Table, Target
from fedrepro.report.plots import label_colors, mark_no_data, plt, save_figure, seed_band


def _series(table: Table, targets: dict[tuple, Target], only: list[str] | None) -> list[tuple[str, str, tuple]]:
    """(row name, label, kinds) per mapped row of the table, layout order."""
    out = []
    for row in table.rows:
        if row.derived:
            continue
        keys = [k for k in targets if all(k[DIMS.index(d)] == v for d, v in row.key.items())]
        if not keys or (only and keys[0][0] not in only):
            continue
        t = targets[keys[0]]
        out.append((table.row_name(row), t.label, t.kinds))
    return list(dict.fromkeys(out))


def _panels(table: Table, targets: dict[tuple, Target]) -> list[tuple[str, str, str]]:
    """(title, dataset, partition) per mapped (dataset, setting), layout order."""
    out = []
    for key, t in targets.items():
        name = f"{table.name('dataset', key[1])} / {table.name('setting', key[2])}"
        if t.stand_in:
            name += f"\n(ours: {t.dataset}/{t.partition})"
        out.append((name, t.dataset, t.partition))
    return list(dict.fromkeys(out))


def _grid(n: int, width: float = 5.5, height: float = 4.2):
    cols = min(n, 3)
    rows = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows, max(cols, 1), figsize=(width * max(cols, 1), height * rows + 0.8),
                             layout="constrained", squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n]) if n else [axes.flat[0]]


def _title(fig, fp: FigurePlan, extra: str = "") -> None:
    width = max(40, int(fig.get_figwidth() * 13))
    lines = [textwrap.fill(fp.figure.get("caption", fp.id), width)] + ([textwrap.fill(extra, width)] if extra else [])
    fig.suptitle("\n".join(lines), fontsize=10)


def plot_curves(fp: FigurePlan, cells: list[dict], out: str | Path) -> None:
    curves = curves_frame(cells)
    acc = curves[(curves["metric"] == "acc") & (curves["stat"] == "weighted_mean")] if len(curves) else curves
    series = _series(fp.table, fp.targets, fp.figure.get("methods"))
    panels = _panels(fp.table, fp.targets)
    colors = label_colors([s[0] for s in series])
    fig, axes = _grid(len(panels))
    handles = {}
    for ax, (name, ds, part) in zip(axes, panels):
        here = acc[(acc["dataset"] == ds) & (acc["partition"] == part)] if len(acc) else acc
        drawn = False
        for rname, label, kinds in series:
            mine = here[here["label"] == label] if len(here) else here
            kind = next((k for k in kinds if len(mine) and (mine["kind"] == k).any()), None)
            if kind is None:
                continue
            handles[rname] = seed_band(ax, mine[mine["kind"] == kind], 100.0, color=colors[rname], label=rname)
            drawn = True
        ax.set(title=name, xlabel="round", ylabel="test accuracy (%), weighted over clients")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if not drawn:
            mark_no_data(ax)
    if handles:
        fig.legend(handles=list(handles.values()), loc="outside lower center", ncols=min(len(handles), 4), frameon=False)
    _title(fig, fp, "mean over seeds, band: min-max over seeds")
    save_figure(fig, out)


def plot_client_bars(fp: FigurePlan, cells: list[dict], out: str | Path) -> None:
    series = _series(fp.table, fp.targets, fp.figure.get("methods"))
    panels = _panels(fp.table, fp.targets)
    colors = label_colors([s[0] for s in series])
    n_clients = max([len((c.get("clients") or {}).get("ids") or []) for c in cells] + [1])
    fig, axes = _grid(len(panels), width=min(24.0, max(6.0, 0.1 * n_clients * max(len(series), 1) + 2)))
    for ax, (name, ds, part) in zip(axes, panels):
        here = [c for c in cells if is_ok(c) and (cell_ident(c)["dataset"], cell_ident(c)["partition"]) == (ds, part)]
        width = 0.8 / max(len(series), 1)
        drawn = False
        for i, (rname, label, kinds) in enumerate(series):
            mine = [c for c in here if cell_ident(c)["label"] == label]
            kind = next((k for k in kinds if any(((c.get("final") or {}).get(k) or {}).get("acc") for c in mine)), None)
            if kind is None:
                continue
            per_seed = [[np.nan if v is None else 100.0 * v for v in c["final"][kind]["acc"]] for c in mine]
            n = max(len(s) for s in per_seed)
            vals = np.nanmean(np.array([s + [np.nan] * (n - len(s)) for s in per_seed]), axis=0)
            ids = (mine[0].get("clients") or {}).get("ids") or list(range(n))
            x = np.arange(len(vals))
            ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, color=colors[rname], label=rname)
            ax.set_xticks(x, [str(j + 1 if isinstance(j, int) else j) for j in ids[: len(vals)]])
            drawn = True
        ax.set(title=name, xlabel="client", ylabel="final test accuracy (%)")
        ax.grid(axis="y", alpha=0.3)
        if drawn:
            ax.legend(fontsize="small", ncols=min(len(series), 5), loc="upper left", bbox_to_anchor=(0, -0.12))
        else:
            mark_no_data(ax)
    _title(fig, fp, "each client's final accuracy on its own test split, mean over seeds")
    save_figure(fig, out)


def _rk(row) -> tuple:
    return tuple(row.key.items())


def _panel_cells(res: TableResult, metrics: list[str]):
    """{(dataset, setting): {row: {metric: CellResult}}} over the mapped cells of the figure's methods."""
    out: dict = {}
    for c in res.cells.values():
        if c.target is None or c.key[3] not in metrics:
            continue
        out.setdefault((c.key[1], c.key[2]), {}).setdefault(_rk(c.row), {})[c.key[3]] = c
    return out


def plot_pg_tradeoff(fp: FigurePlan, res: TableResult, out: str | Path) -> None:
    m = fp.figure.get("metrics") or {}
    x, y = m.get("x", "p"), m.get("y", "g")
    t = res.table
    panels = _panel_cells(res, [x, y])
    rows = [r for r in t.rows if not r.derived and (not fp.figure.get("methods") or r.key.get("method") in fp.figure["methods"])]
    colors = label_colors([t.row_name(r) for r in rows])
    fig, axes = _grid(len(panels), width=5.0, height=4.6)
    grid = np.linspace(0.005, 1, 200)
    for ax, ((ds, st), by_row) in zip(axes, panels.items()):
        scale = t.paper.metrics[x].scale
        for level in (0.2, 0.4, 0.6, 0.8):  # harmonic mean 2pg/(p+g) = level
            with np.errstate(divide="ignore", invalid="ignore"):
                g = level * grid / (2 * grid - level)
            ok = np.isfinite(g) & (g > 0) & (g <= 1)
            ax.plot(grid[ok] * scale, g[ok] * scale, color="0.85", lw=0.8, zorder=0)
            ax.annotate(f"HM {level:g}", (1.0 * scale, level / (2 - level) * scale), fontsize=7, color="0.6", ha="right")
        for r in rows:
            cs = by_row.get(_rk(r), {})
            cx, cy = cs.get(x), cs.get(y)
            if cx is None or cy is None:
                continue
            name = t.row_name(r)
            if cx.has_value and cy.has_value:
                ax.errorbar(cx.stats.mean, cy.stats.mean, xerr=np.nan_to_num(cx.stats.std), yerr=np.nan_to_num(cy.stats.std),
                            fmt="o", color=colors[name], label=name, capsize=2)
            if cx.paper is not None and cy.paper is not None:
                ax.plot(cx.paper, cy.paper, marker="o", mfc="none", color=colors[name], ls="none")
        ax.set(title=f"{t.name('dataset', ds)} / {t.name('setting', st)}",
               xlabel=t.name('metric', x), ylabel=t.name('metric', y), xlim=(0, scale), ylim=(0, scale))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            mark_no_data(ax, "no runs")
    _title(fig, fp, "filled: ours (mean ± std over seeds); open: the paper; grey: iso-lines of the harmonic mean")
    save_figure(fig, out)


def plot_metric_bars(fp: FigurePlan, res: TableResult, out: str | Path) -> None:
    t = res.table
    metrics = list(fp.figure.get("metrics") or [])
    panels = _panel_cells(res, metrics)
    rows = [r for r in t.rows if not r.derived and (not fp.figure.get("methods") or r.key.get("method") in fp.figure["methods"])]
    fig, axes = _grid(len(panels), width=max(5.0, 0.7 * len(rows) * max(len(metrics), 1)))
    colors = label_colors(metrics)
    for ax, ((ds, st), by_row) in zip(axes, panels.items()):
        width = 0.8 / max(len(metrics), 1)
        x = np.arange(len(rows))
        for j, mt in enumerate(metrics):
            xs = x + (j - (len(metrics) - 1) / 2) * width
            cs = [by_row.get(_rk(r), {}).get(mt) for r in rows]
            means = [c.stats.mean if c is not None and c.has_value else np.nan for c in cs]
            err = [c.stats.half_width if c is not None and c.stats.n >= 2 else 0.0 for c in cs]
            ax.bar(xs, means, width, yerr=err, color=colors[mt], capsize=2, label=f"{t.name('metric', mt)} (ours)")
            papers = [c.paper if c is not None and c.paper is not None else np.nan for c in cs]
            ax.scatter(xs, papers, marker="_", s=200, color="black", zorder=3,
                       label="the paper" if j == 0 else None)
        ax.set_xticks(x, [t.row_name(r) for r in rows], rotation=30, ha="right")
        ax.set(title=f"{t.name('dataset', ds)} / {t.name('setting', st)}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    if not panels:
        mark_no_data(axes[0], "no runs")
    _title(fig, fp, "bars: ours, mean over seeds with the 95 % interval; black: the paper")
    save_figure(fig, out)


PICKS = {"highest": np.nanargmax, "lowest": np.nanargmin}


def _client_values(cells: list[dict], t: Target) -> np.ndarray:
    """Per-client values of a target (the metric family of its summary column), mean over seeds."""
    family = "f1" if t.column.startswith("f1") else "acc"
    mine = [c for c in cells if is_ok(c) and (cell_ident(c)["dataset"], cell_ident(c)["partition"],
                                              cell_ident(c)["label"]) == (t.dataset, t.partition, t.label)]
    kind = next((k for k in t.kinds if any(((c.get("final") or {}).get(k) or {}).get(family) for c in mine)), None)
    if kind is None:
        return np.array([])
    per_seed = [[np.nan if v is None else float(v) for v in c["final"][kind][family]] for c in mine]
    n = max(len(s) for s in per_seed)
    return np.nanmean(np.array([s + [np.nan] * (n - len(s)) for s in per_seed]), axis=0)


def plot_client_cases(fp: FigurePlan, cells: list[dict], out: str | Path) -> dict[str, int]:
    """GRP-FED Fig. 5: per panel (one of the paper's clients), grouped bars of the metrics per method.
    Returns the client picked per panel (the figure's `pick` rule on its first metric)."""
    t = fp.table
    pick = fp.figure.get("pick") or {}
    settings = list(dict.fromkeys(c.key["setting"] for c in t.columns))
    metrics = list(dict.fromkeys(c.key["metric"] for c in t.columns))
    rows = [r for r in t.rows if not r.derived]
    colors = label_colors(metrics)
    fig, axes = _grid(len(settings), width=max(5.0, 0.8 * len(rows) * len(metrics) / 2))
    picked: dict[str, int] = {}
    for ax, setting in zip(axes, settings):
        keys = [t.key(r, col) for r in rows for col in t.columns if col.key["setting"] == setting]
        values = {k: _client_values(cells, fp.targets[k]) for k in keys if k in fp.targets}
        # the client: by the first metric (Global Test) over the mapped methods, as the figure's rule says
        first = [v for k, v in values.items() if k[3] == metrics[0] and len(v)]
        client = None
        if first and setting in pick:
            n = min(len(v) for v in first)
            client = int(PICKS[pick[setting]](np.nanmean([v[:n] for v in first], axis=0)))
            picked[setting] = client
        x = np.arange(len(rows))
        width = 0.8 / len(metrics)
        for j, mt in enumerate(metrics):
            xs = x + (j - (len(metrics) - 1) / 2) * width
            ks = [t.key(r, col) for r in rows for col in t.columns if col.key == {**col.key, "setting": setting, "metric": mt}]
            ours = [values[k][client] if client is not None and k in values and len(values[k]) > client else np.nan for k in ks]
            scale = t.paper.metrics[mt].scale
            ax.bar(xs, np.asarray(ours) * scale, width, color=colors[mt], label=f"{t.name('metric', mt)} (ours)")
            paper = [t.cells[k].value if k in t.cells and t.cells[k].value is not None else np.nan for k in ks]
            ax.scatter(xs, paper, marker="_", s=200, color="black", zorder=3, label="the paper" if j == 0 else None)
        ax.set_xticks(x, [t.row_name(r) for r in rows], rotation=30, ha="right")
        ax.set(title=t.name("setting", setting), ylim=(0, 1.05 * t.paper.metrics[metrics[0]].scale))
        ax.grid(axis="y", alpha=0.3)
        if client is None:
            mark_no_data(ax, "no runs: the paper's values only")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False, fontsize="small")
    which = "; ".join(f"{t.name('setting', st)}: our client {i} ({pick[st]} {t.name('metric', metrics[0])})"
                      for st, i in picked.items())
    _title(fig, fp, "bars: ours, one client, mean over seeds; black: the paper" + (f". {which}" if which else ""))
    save_figure(fig, out)
    return picked


def plot_mean_variance(fp: FigurePlan, cells: list[dict], out: str | Path) -> None:
    frame = summary_frame(cells) if cells else pd.DataFrame()
    series = _series(fp.table, fp.targets, fp.figure.get("methods"))
    panels = _panels(fp.table, fp.targets)
    colors = label_colors([s[0] for s in series])
    fig, axes = _grid(len(panels), width=5.0, height=4.6)
    for ax, (name, ds, part) in zip(axes, panels):
        drawn = False
        for rname, label, kinds in series:
            mine = frame[(frame["dataset"] == ds) & (frame["partition"] == part) & (frame["label"] == label)
                         & (frame["status"] == "ok")] if len(frame) else frame
            kind = next((k for k in kinds if len(mine) and (mine["kind"] == k).any()), None)
            if kind is None:
                continue
            mine = mine[mine["kind"] == kind]
            var, mean = (mine["acc_std"] ** 2).to_numpy(), 100.0 * mine["acc_mean"].to_numpy()
            ax.errorbar(var.mean(), mean.mean(), xerr=[[var.mean() - var.min()], [var.max() - var.mean()]],
                        yerr=[[mean.mean() - mean.min()], [mean.max() - mean.mean()]], fmt="o", color=colors[rname],
                        label=rname, capsize=2)
            drawn = True
        ax.set(title=name, xlabel="variance of client accuracy", ylabel="mean client accuracy (%)")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            mark_no_data(ax)
    _title(fig, fp, "mean over seeds, bars: min-max over seeds; fair and accurate = top left")
    save_figure(fig, out)


def draw_figure(plan: PaperPlan, figure_id: str, cells: list[dict], out: str | Path) -> None:
    """Draw one paper figure's analogue from the mapped runs' metrics."""
    fp = plan.figures[figure_id]
    kind = fp.figure["plot"]
    if kind in ("pg_tradeoff", "metric_bars"):
        tp = plan.tables[fp.table.id]
        res = build_table(fp.table, summary_frame(cells), tp, plan.reduced, plan.seeds)
        (plot_pg_tradeoff if kind == "pg_tradeoff" else plot_metric_bars)(fp, res, out)
    else:
        {"curves": plot_curves, "client_bars": plot_client_bars, "mean_variance": plot_mean_variance,
         "client_cases": plot_client_cases}[kind](fp, cells, out)
