"""Figures: learning curves, per-client accuracy distributions and partition label distributions.

Headless (Agg backend) and deterministic: no timestamps or software tags in the files,
fixed jitter seeds, so the same inputs give byte-identical PNGs on one machine.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fedrepro.data.shards import MANIFEST_HASH, partition_id  # noqa: E402
from fedrepro.io import atomic_path  # noqa: E402
from fedrepro.registry import ConfigError  # noqa: E402
from fedrepro.report.aggregate import cell_ident, curves_frame, is_ok, row_keys, summary_frame  # noqa: E402
from fedrepro.report.tables import row_name  # noqa: E402

matplotlib.rcParams["svg.hashsalt"] = "fedrepro"
_METADATA = {"png": {"Software": None}, "svg": {"Date": None}, "pdf": {"CreationDate": None, "ModDate": None}}
_STYLE = {"global": "-", "personal": "--"}
_MAX_BAR_CLIENTS = 50


def save_figure(fig: plt.Figure, out_path: str | Path, stamp: dict[str, str] | None = None) -> None:
    """Save atomically in the format named by the suffix (PNG by default), then close. `stamp`: text
    chunks a PNG carries (other formats take only their fixed metadata keys)."""
    fmt = Path(out_path).suffix.lstrip(".").lower() or "png"
    metadata = _METADATA.get(fmt)
    if stamp and fmt == "png":
        metadata = {**metadata, **stamp}
    try:
        with atomic_path(out_path) as tmp:
            fig.savefig(tmp, format=fmt, dpi=120, metadata=metadata)
    finally:
        plt.close(fig)


def label_colors(labels: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def mark_no_data(ax: plt.Axes, text: str = "no successful cells") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _in(cells: list[dict], dataset: str, partition: str) -> list[dict]:
    return [c for c in cells if (cell_ident(c)["dataset"], cell_ident(c)["partition"]) == (dataset, partition)]


def check_panel(cells: list[dict], dataset: str, partition: str) -> None:
    """ConfigError unless some cell (ok or failed) is of `dataset` and `partition`: a panel the metrics
    files lack would be drawn empty, like one whose cells all failed, and pass for a result."""
    idents = [cell_ident(c) for c in cells]
    datasets = sorted({str(i["dataset"]) for i in idents})
    if dataset not in datasets:
        raise ConfigError(f"--dataset has value {dataset!r}, which no given metrics file is of; allowed: "
                          f"{', '.join(map(repr, datasets)) or 'none (no metrics files)'}")
    partitions = sorted({str(i["partition"]) for i in idents if i["dataset"] == dataset})
    if partition not in partitions:
        raise ConfigError(f"--partition has value {partition!r}, which no given metrics file of {dataset!r} is of; "
                          f"allowed: {', '.join(map(repr, partitions))}")


def seed_band(ax: plt.Axes, series: pd.DataFrame, scale: float, **style) -> plt.Line2D:
    """Mean over seeds per round as a line, min–max over seeds as a shaded band."""
    agg = series.groupby("round")["value"].agg(["mean", "min", "max"]).sort_index() * scale
    x = agg.index.to_numpy()
    marker = "o" if len(x) == 1 else None
    (line,) = ax.plot(x, agg["mean"], marker=marker, **style)
    ax.fill_between(x, agg["min"], agg["max"], color=line.get_color(), alpha=0.2, linewidth=0)
    return line


def distinct_series(curves: pd.DataFrame, by: list[str], name) -> list[tuple[str, pd.DataFrame, tuple]]:
    """The groups of `curves` by `by`, each drawn once: a group whose (seed, round, value) rows equal
    an earlier group's (the same model under two names, e.g. fedavg and fedavg_ft's global model)
    joins its legend entry, "fedavg = fedavg_ft (global)". Returns (legend, rows, first key)."""
    out: dict[tuple, list] = {}
    for key, g in curves.groupby(by, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        values = tuple(map(tuple, g[["seed", "round", "value"]].sort_values(["seed", "round"]).astype(str).to_numpy()))
        out.setdefault(values, [g, key, []])[2].append(key)
    return [(_joined([name(*k) for k in keys]), g, first) for g, first, keys in out.values()]


def _joined(names: list[str]) -> str:
    """"fedavg (global)", "fedavg_ft (global)" -> "fedavg = fedavg_ft (global)"."""
    suffixes = {n[n.rfind(" ("):] if n.endswith(")") and " (" in n else "" for n in names}
    if len(names) > 1 and len(suffixes) == 1 and (suffix := suffixes.pop()):
        return " = ".join(n.removesuffix(suffix) for n in names) + suffix
    return " = ".join(names)


def plot_curves(frame_or_cells: pd.DataFrame | list[dict], dataset: str, partition: str, out_path: str | Path) -> None:
    """`curves_figure` saved to `out_path`."""
    save_figure(curves_figure(frame_or_cells, dataset, partition), out_path)


def curves_figure(frame_or_cells: pd.DataFrame | list[dict], dataset: str, partition: str) -> plt.Figure:
    """Accuracy (weighted mean over clients, %) and train loss (every round) vs round for one dataset × partition.

    Accepts a `curves_frame` or the cells themselves (then failed seeds are named in the title).
    One line per (label, kind): mean over seeds, min–max band over seeds; identical series are
    drawn once with a joined legend entry. Each panel has its own legend.
    """
    failed: list[str] = []
    if isinstance(frame_or_cells, pd.DataFrame):
        curves = frame_or_cells
    else:
        cells = _in(list(frame_or_cells), dataset, partition)
        curves = curves_frame(cells)
        failed = [f"{cell_ident(c)['label']} (seed {cell_ident(c)['seed']})" for c in cells if not is_ok(c)]
    curves = curves[(curves["dataset"] == dataset) & (curves["partition"] == partition)]
    colors = label_colors(list(dict.fromkeys(curves["label"])))
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")

    acc = curves[(curves["metric"] == "acc") & (curves["stat"] == "weighted_mean")]
    for legend, g, (label, kind) in distinct_series(acc, ["label", "kind"], row_name):
        seed_band(ax_acc, g, 100.0, color=colors[label], linestyle=_STYLE.get(kind, "-"), label=legend)
    loss = curves[curves["metric"] == "train_loss"]
    for legend, g, (label,) in distinct_series(loss, ["label"], str):
        seed_band(ax_loss, g, 1.0, color=colors[label], label=legend)

    ax_acc.set(xlabel="round", ylabel="accuracy (%), weighted over clients", title="test accuracy")
    ax_loss.set(xlabel="round", ylabel="train loss (mean over sampled clients)", title="train loss, every round")
    for ax, empty in ((ax_acc, acc.empty), (ax_loss, loss.empty)):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if empty:
            mark_no_data(ax)
        else:
            ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, frameon=False)
    title = f"{dataset} / {partition}"
    if failed:
        title += "\nfailed: " + ", ".join(failed)
    fig.suptitle(title)
    return fig


def plot_client_distribution(cells: list[dict], dataset: str, partition: str, out_path: str | Path) -> None:
    """Final per-client accuracy per (label, kind): box plot + jittered client points, seeds pooled.

    Methods whose seeds all failed get an empty slot ticked "(failed)"; partial failures "(k failed)".
    """
    cells = _in(cells, dataset, partition)
    frame = summary_frame(cells)
    # per-client kinds only: a global test set's global score is one number per cell
    keys = [k for k in (row_keys(frame) if len(frame) else []) if k[1] not in ("union_global", "official_global")]
    colors = label_colors(list(dict.fromkeys(label for label, _ in keys)))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(keys) + 2), 4.5), layout="constrained")
    ticks = []
    for pos, (label, kind) in enumerate(keys, start=1):
        mine = [c for c in cells if cell_ident(c)["label"] == label]
        values = [100.0 * float(v) for c in mine if is_ok(c)
                  for v in ((c.get("final") or {}).get(kind) or {}).get("acc") or [] if v is not None]
        n_failed = sum(not is_ok(c) for c in mine)
        tick = row_name(label, kind)
        if not values:
            tick += "\n(failed)" if n_failed else "\n(no data)"
        elif n_failed:
            tick += f"\n({n_failed} failed)"
        ticks.append(tick)
        if values:
            ax.boxplot([values], positions=[pos], widths=0.6, showfliers=False,
                       medianprops={"color": "black"}, boxprops={"color": colors[label]})
            jitter = np.random.default_rng(pos).uniform(-0.18, 0.18, len(values))
            ax.scatter(pos + jitter, values, s=10, alpha=0.6, color=colors[label], zorder=3)
    ax.set_xticks(range(1, len(keys) + 1), ticks, rotation=30 if len(keys) > 4 else 0,
                  ha="right" if len(keys) > 4 else "center")
    ax.set_xlim(0.4, len(keys) + 0.6)
    ax.set(ylabel="final per-client test accuracy (%)", title=f"{dataset} / {partition}: clients, seeds pooled")
    ax.grid(axis="y", alpha=0.3)
    if not keys:
        mark_no_data(ax, "no cells")
    save_figure(fig, out_path)


def plot_tsne(cells: list[dict], dataset: str, partition: str, out_path: str | Path) -> None:
    """t-SNE of the chosen clients' test representations (`evaluation.embed_clients`), one panel per
    label at its lowest seed: colour = class, marker = client (Calibre's Fig. 5)."""
    cells = [c for c in _in(cells, dataset, partition) if is_ok(c) and c.get("embedding")]
    first: dict[str, dict] = {}
    for c in sorted(cells, key=lambda c: cell_ident(c)["seed"]):
        first.setdefault(cell_ident(c)["label"], c)
    n = max(1, len(first))
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), layout="constrained", squeeze=False)
    markers = "o^sDvP*Xh<>p"
    cmap = plt.get_cmap("tab10")
    for ax, (label, c) in zip(axes.flat, first.items()):
        emb = c["embedding"]
        x, y = np.asarray(emb["x"]), np.asarray(emb["y"])
        lab, owner = np.asarray(emb["label"]), np.asarray(emb["client"])
        novel = set((c.get("clients") or {}).get("unseen_ids") or [])
        for j, cid in enumerate(dict.fromkeys(owner.tolist())):
            mine = owner == cid
            ax.scatter(x[mine], y[mine], c=[cmap(int(k) % 10) for k in lab[mine]], marker=markers[j % len(markers)],
                       s=12, alpha=0.8, label=f"client {cid}" + (" (novel)" if cid in novel else ""))
        ax.set(title=f"{label} (seed {cell_ident(c)['seed']})", xticks=[], yticks=[])
        ax.legend(fontsize="x-small", markerscale=1.2, loc="best")
    for ax in list(axes.flat)[len(first):]:
        ax.axis("off")
    if not first:
        mark_no_data(axes.flat[0], "no embeddings (evaluation.embed_clients)")
    fig.suptitle(f"{dataset} / {partition}: t-SNE of test representations (colour: class, marker: client)")
    save_figure(fig, out_path)


def _counts(manifest: dict) -> np.ndarray:
    """(clients, classes) label counts summed over the splits (train + test + val)."""
    clients = manifest.get("clients") or []
    width = int(manifest.get("num_classes") or 0)
    rows = []
    for c in clients:
        splits = (c.get("class_counts") or {}).values()
        row = np.zeros(max([width] + [len(s) for s in splits]), dtype=np.int64)
        for s in splits:
            row[: len(s)] += np.asarray(s, dtype=np.int64)
        rows.append(row)
    width = max([width] + [len(r) for r in rows])
    return np.array([np.pad(r, (0, width - len(r))) for r in rows], dtype=np.int64).reshape(len(rows), width)


def check_partition_folder(part_dir: str | Path, manifest: dict) -> None:
    """ConfigError unless the manifest read from `part_dir` is of the partition the folder is named by,
    and its spec gives that id: a folder swapped with another partition's (and later restored) would
    otherwise be drawn under the wrong id, and the picture would outlive the restore."""
    name = Path(os.path.abspath(part_dir)).name  # the name given (a link keeps its own name), "." and ".." resolved
    pid = manifest.get("partition_id")
    own = partition_id(manifest["spec"]) if isinstance(manifest.get("spec"), dict) else None
    if pid != name or own != pid:
        found = f"partition {pid!r}" + ("" if own == pid else f" whose spec gives id {own!r}")
        raise ConfigError(f"{part_dir}: its manifest.json is of {found} (manifest_sha256 {str(manifest.get(MANIFEST_HASH))[:16]}); "
                          f"allowed: the manifest of partition {name!r}, the id the folder is named by (rerun its "
                          "partition step)")


def partition_stamp(manifest: dict) -> dict[str, str]:
    """The PNG text chunks naming the partition a picture shows: a picture whose stamp differs from the
    folder's manifest (read_png_stamp) is stale."""
    return {"fedrepro.partition_id": str(manifest.get("partition_id")),
            "fedrepro.manifest_sha256": str(manifest.get(MANIFEST_HASH))}


def read_png_stamp(path: str | Path) -> dict[str, str]:
    """The fedrepro.* text chunks of a PNG (partition_stamp), {} when it has none."""
    from PIL import Image

    with Image.open(path) as img:
        return {k: v for k, v in (getattr(img, "text", None) or {}).items() if k.startswith("fedrepro.")}


def plot_partition(manifest: dict, out_path: str | Path) -> None:
    """Per-client label distribution: stacked bars (≤ 50 clients) or a bubble plot (more). The PNG
    carries the partition id and manifest hash (partition_stamp)."""
    counts = _counts(manifest)
    n, k = counts.shape
    ids = [c.get("id", i) for i, c in enumerate(manifest.get("clients") or [])]
    params = ", ".join(f"{key}={val}" for key, val in sorted((manifest.get("params") or {}).items()))
    title = textwrap.fill(f"{manifest.get('dataset', '?')}: {manifest.get('partitioner', '?')}({params}), "
                          f"seed {manifest.get('seed', '?')}, {n} clients, partition {manifest.get('partition_id', '?')}", width=80)
    cmap = plt.get_cmap("tab10" if k <= 10 else "tab20" if k <= 20 else "viridis")
    if n <= _MAX_BAR_CLIENTS:
        fig, ax = plt.subplots(figsize=(9, max(3.0, 0.28 * n + 1.5)), layout="constrained")
        left = np.zeros(n)
        for j in range(k):
            color = cmap(j) if k <= 20 else cmap(j / max(k - 1, 1))
            ax.barh(range(n), counts[:, j], left=left, color=color, height=0.8, label=str(j))
            left += counts[:, j]
        ax.set_yticks(range(n), [str(i) for i in ids])
        ax.invert_yaxis()
        ax.set(xlabel="samples (train + test + val)", ylabel="client")
        if k <= 20:
            ax.legend(title="class", loc="upper left",
                      bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
        else:
            sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, k - 1))
            fig.colorbar(sm, ax=ax, label="class")
    else:
        fig, ax = plt.subplots(figsize=(min(24.0, 4 + 0.08 * n), max(3.5, 0.3 * k + 1.5)), layout="constrained")
        cc, kk = np.nonzero(counts)
        share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        sc = ax.scatter(cc, kk, s=120 * counts[cc, kk] / max(counts.max(), 1), c=share[cc, kk],
                        cmap="viridis", vmin=0, vmax=1)
        fig.colorbar(sc, ax=ax, label="share of the client's samples")
        ax.set(xlabel="client (index)", ylabel="class", xlim=(-1, n), ylim=(-0.5, k - 0.5))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.invert_yaxis()
    if n == 0:
        mark_no_data(ax, "no clients")
    ax.set_title(title)
    save_figure(fig, out_path, partition_stamp(manifest))
