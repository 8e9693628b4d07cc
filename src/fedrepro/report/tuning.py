"""Tuning results: the selected hyper-parameters per cell (table) and validation score
against each tuned parameter (one figure per dataset/partition)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from fedrepro.io import atomic_path, read_json, write_text_atomic  # noqa: E402
from fedrepro.report.plots import save_figure  # noqa: E402


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def selections_frame(paths: list[str | Path]) -> pd.DataFrame:
    """One row per selection file: dataset, partition, label, method, winner values, score, trials."""
    rows = []
    for p in paths:
        s = read_json(p)
        values = lambda w: ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(w["values"].items()))  # noqa: E731
        # a per-seed selection trains each seed with its own winner: show those, not the pooled one
        per_seed = s.get("winners_by_seed") or {}
        selected = "; ".join(f"{seed}: {values(w)}" for seed, w in sorted(per_seed.items())) or values(s["winner"])
        rows.append({"dataset": s["dataset"], "partition": s["partition"], "label": s["label"], "method": s["method"],
                     "selected": selected, "val_score": s["winner"]["score"], "trials": len(s["trials"]),
                     "metric": f"val {'/'.join(s['metric']['model_used'])} {s['metric'].get('measure', 'acc')} "
                               f"{s['metric']['stat']}" + (" (per seed)" if per_seed else "")})
    return pd.DataFrame(rows).sort_values(["dataset", "partition", "label"]).reset_index(drop=True)


def write_tuning_table(paths: list[str | Path], out_prefix: str | Path) -> list[Path]:
    """PREFIX.csv (one row per cell), PREFIX.md and PREFIX.tex: methods x dataset/partition, each cell
    the selected values and their validation score (%)."""
    df = selections_frame(paths)
    out = [Path(f"{out_prefix}{ext}") for ext in (".csv", ".md", ".tex")]
    with atomic_path(out[0]) as tmp:
        df.to_csv(tmp, index=False)
    df["cell"] = [f"{sel} (val {100 * sc:.2f})" for sel, sc in zip(df["selected"], df["val_score"])]
    wide = df.pivot(index="label", columns=["dataset", "partition"], values="cell").fillna("-")
    cols = [f"{d}/{p}" for d, p in wide.columns]
    md = ["Selected hyper-parameters (validation score %, " + "; ".join(sorted(set(df["metric"]))) + ")", "",
          "| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    md += [f"| {label} | " + " | ".join(row) + " |" for label, row in zip(wide.index, wide.values.tolist())]
    write_text_atomic(out[1], "\n".join(md) + "\n")

    def tex(s: str) -> str:
        return s.replace("_", r"\_").replace("%", r"\%")

    lines = [r"\begin{tabular}{l" + "l" * len(cols) + "}", r"\toprule", "method & " + " & ".join(map(tex, cols)) + r" \\",
             r"\midrule"] + [tex(label) + " & " + " & ".join(map(tex, row)) + r" \\" for label, row in
                             zip(wide.index, wide.values.tolist())] + [r"\bottomrule", r"\end{tabular}"]
    write_text_atomic(out[2], "\n".join(lines) + "\n")
    return out


def plot_tuning(paths: list[str | Path], out_path: str | Path) -> None:
    """Validation score of every trial against each tuned parameter (one row per method, one panel
    per parameter; the winner is the star). Log x-axis where a parameter's values span >= 10x."""
    sels = [read_json(p) for p in paths]
    sels = sorted(sels, key=lambda s: s["label"])
    ncols = max([len(s["params"]) for s in sels] + [1])
    fig, axes = plt.subplots(max(1, len(sels)), ncols, figsize=(max(4.8, 3.2 * ncols), 2.4 * max(1, len(sels)) + 0.4), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for row, s in enumerate(sels):
        for col, param in enumerate(s["params"]):
            ax = axes[row][col]
            ax.set_visible(True)
            pts = [(t["values"][param], t["score"]) for t in s["trials"] if t["score"] is not None]
            numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x, _ in pts)
            xs = [x if numeric else str(x) for x, _ in pts]
            ax.scatter(xs, [100 * y for _, y in pts], s=14, color="tab:blue", alpha=0.7)
            w = s["winner"]["values"][param]
            ax.scatter([w if numeric else str(w)], [100 * s["winner"]["score"]], marker="*", s=120, color="tab:red", zorder=3)
            positive = [x for x, _ in pts if numeric and x > 0]
            if numeric and positive and len(positive) == len(pts) and max(positive) / min(positive) >= 10:
                ax.set_xscale("log")
            ax.set_xlabel(param)
            ax.set_ylabel(f"{s['label']}: val acc (%)" if col == 0 else "")
            ax.grid(alpha=0.3)
    title = f"{sels[0]['dataset']}/{sels[0]['partition']}: validation accuracy per trial\n(star: selected)" if sels else "no tuning"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, out_path)
