"""Tests for fedrepro.report: summaries, metrics JSON, tables and plots on fake metrics files."""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest

from fedrepro.io import write_json_atomic
from fedrepro.registry import ConfigError
from fedrepro.report.aggregate import (
    curves_frame,
    load_cells,
    summary_frame,
    write_curves_csv,
    write_summary,
)
from fedrepro.report.plots import plot_client_distribution, plot_curves, plot_partition, plt, seed_band
from fedrepro.report.tables import DEFAULT_TABLES, pivot_table, write_tables

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GRID = [("fmnist", "dir0.1"), ("cifar10", "shards2")]
# Final weighted-mean accuracy per (dataset, method, kind) for seeds 0 and 1.
ACC = {
    ("fmnist", "fedavg_ft", "global"): [0.80, 0.82],
    ("fmnist", "fedavg_ft", "personal"): [0.90, 0.93],
    ("fmnist", "fedavg", "global"): [0.78, 0.79],
    ("cifar10", "fedavg_ft", "global"): [0.50, None],  # seed 1 fails
    ("cifar10", "fedavg_ft", "personal"): [0.70, None],
    ("cifar10", "fedavg", "global"): [0.40, 0.44],
}
KINDS = {"fedavg_ft": ["global", "personal"], "fedavg": ["global"]}


def _stats(w: float) -> dict:
    return {"weighted_mean": w, "mean": w - 0.01, "std": 0.1, "min": w - 0.2, "max": w + 0.1, "worst10": w - 0.15}


def make_cell(dataset: str, partition: str, method: str, seed: int, failed: bool = False) -> dict:
    """A metrics.json dict; accuracies from ACC, F1 = accuracy - 0.05."""
    cell = {
        "schema": "fedrepro.metrics/1",
        "cell": {"experiment": "default", "dataset": dataset, "partition": partition, "partition_id": f"id-{dataset}",
                 "method": method, "label": method, "model": "cnn", "seed": seed},
        "status": "failed" if failed else "ok",
        "failure": {"reason": "loss is NaN at round 3", "round": 3} if failed else None,
        "rounds": 2 if failed else 3,
        "clients": {"ids": [0, 1, 2], "train_size": [30, 30, 30], "test_size": [10, 10, 10]},
        "communication": {"bytes_up_per_round": [10] * 3, "bytes_down_per_round": [20] * 3,
                          "bytes_up_total": 30, "bytes_down_total": 60},
        "resources": {"wall_time_s": 1.5, "train_time_s": 1.0, "eval_time_s": 0.5, "peak_rss_mb": 100.0,
                      "peak_gpu_mb": None, "device": "cpu"},
        "best_val": None,
    }
    if failed:  # partial curves, no final/summary
        cell["final"] = None
        cell["curves"] = {"round": [1, 2], "train_loss": [2.0, 9.0]}  # never in the summary or curves
        return cell
    final, summary = {"global": None, "personal": None}, {}
    curves = {"round": [1, 2, 3], "train_loss": [1.0, 0.5, 0.25 + 0.1 * seed]}
    for kind in KINDS[method]:
        w = ACC[(dataset, method, kind)][seed]
        final[kind] = {"acc": [w - 0.1, w, w + 0.1], "f1": [w - 0.15, w - 0.05, w + 0.05]}
        summary[f"{kind}_acc"], summary[f"{kind}_f1"] = _stats(w), _stats(w - 0.05)
        curves[f"{kind}_acc"] = {s: [v - 0.2, v - 0.1, v] for s, v in _stats(w).items()}
        curves[f"{kind}_f1"] = {s: [v - 0.2, v - 0.1, v] for s, v in _stats(w - 0.05).items()}
    cell.update(final=final, summary=summary, curves=curves)
    return cell


@pytest.fixture
def cells(tmp_path) -> list[dict]:
    paths = []
    for dataset, partition in GRID:
        for method in ("fedavg_ft", "fedavg"):
            for seed in (0, 1):
                failed = ACC[(dataset, method, "global")][seed] is None
                path = tmp_path / "runs" / dataset / partition / method / str(seed) / "metrics.json"
                write_json_atomic(path, make_cell(dataset, partition, method, seed, failed))
                paths.append(path)
    return load_cells(paths)


@pytest.fixture
def manifest() -> dict:
    return {"dataset": "fmnist", "partition_id": "3f2a9c1b0e", "partitioner": "dirichlet", "params": {"alpha": 0.1},
            "num_clients": 3, "num_classes": 10, "seed": 1,
            "clients": [{"id": i, "sizes": {"train": 30, "test": 10, "val": 0},
                         "class_counts": {"train": [3 * ((i + j) % 3) for j in range(10)],
                                          "test": [(i + j) % 2 for j in range(10)], "val": [0] * 10}}
                        for i in range(3)]}


def test_load_cells_rejects_foreign_schema(tmp_path):
    write_json_atomic(tmp_path / "x.json", {"schema": "other/1"})
    with pytest.raises(ConfigError, match="schema"):
        load_cells([tmp_path / "x.json"])


def test_summary_frame_rows(cells):
    frame = summary_frame(cells)
    # ok: fmnist 2*2 + 2, cifar10 2 + 2; failed: 1 row
    assert len(frame) == 11
    assert frame["kind"].value_counts().to_dict() == {"global": 7, "personal": 3, "failed": 1}
    failed = frame[frame["status"] == "failed"].iloc[0]
    key = (failed["dataset"], failed["method"], failed["seed"], failed["kind"])
    assert key == ("cifar10", "fedavg_ft", 1, "failed")
    assert failed["failure_reason"] == "loss is NaN at round 3"
    assert math.isnan(failed["acc_weighted_mean"])
    row = frame[(frame["dataset"] == "fmnist") & (frame["method"] == "fedavg_ft") & (frame["seed"] == 1)
                & (frame["kind"] == "personal")].iloc[0]
    assert row["acc_weighted_mean"] == pytest.approx(0.93)
    assert row["acc_worst10"] == pytest.approx(0.78)
    assert row["f1_mean"] == pytest.approx(0.87)
    assert math.isnan(row["bestval_acc_weighted_mean"])
    assert row["bytes_up_total"] == 30 and row["rounds"] == 3 and row["peak_rss_mb"] == 100.0
    for col in ("acc_weighted_mean", "f1_worst10", "bestval_f1_weighted_mean", "wall_time_s", "failure_reason"):
        assert col in frame.columns


def test_bestval_columns():
    cell = make_cell("fmnist", "dir0.1", "fedavg", 0)
    cell["best_val"] = {"round": 2, "summary": {"global_acc": _stats(0.6), "global_f1": _stats(0.55)}}
    row = summary_frame([cell]).iloc[0]
    assert row["bestval_acc_weighted_mean"] == pytest.approx(0.6)
    assert row["bestval_f1_weighted_mean"] == pytest.approx(0.55)


def test_write_summary_json(cells, tmp_path):
    write_summary(cells, tmp_path / "out" / "summary.csv", tmp_path / "out" / "metrics.json")
    csv = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert len(csv) == 11
    data = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert set(data) == {"fmnist", "cifar10"}
    assert set(data["fmnist"]) == {"dir0.1"}
    ft = data["fmnist"]["dir0.1"]["fedavg_ft"]
    assert set(ft) == {"global", "personal"}
    assert ft["personal"]["acc_weighted_mean"] == pytest.approx(0.915)
    assert ft["personal"]["acc_mean"] == pytest.approx(0.905)
    assert ft["personal"]["acc_worst10"] == pytest.approx(0.765)
    assert ft["personal"]["acc_std"] == pytest.approx(0.1)
    assert ft["personal"]["f1_mean"] == pytest.approx(0.855)
    assert (ft["personal"]["n_seeds"], ft["personal"]["n_failed"]) == (2, 0)
    assert set(data["fmnist"]["dir0.1"]["fedavg"]) == {"global"}
    cifar = data["cifar10"]["shards2"]["fedavg_ft"]["global"]
    assert cifar["acc_weighted_mean"] == pytest.approx(0.5)  # failed seed excluded
    assert (cifar["n_seeds"], cifar["n_failed"]) == (1, 1)
    assert data["cifar10"]["shards2"]["fedavg"]["global"]["acc_weighted_mean"] == pytest.approx(0.42)
    # rounded to 6 decimals
    assert all(len(repr(v).split(".")[-1]) <= 6 for v in ft["global"].values() if isinstance(v, float))


def test_curves(cells, tmp_path):
    curves = curves_frame(cells)
    assert list(curves.columns) == ["dataset", "partition", "label", "kind", "seed", "round", "metric", "stat", "value"]
    assert set(curves["kind"]) == {"global", "personal", "train"}
    assert not ((curves["dataset"] == "cifar10") & (curves["label"] == "fedavg_ft") & (curves["seed"] == 1)).any()
    write_curves_csv(cells, tmp_path / "curves.csv")
    csv = pd.read_csv(tmp_path / "curves.csv")
    assert list(csv.columns) == ["dataset", "partition", "label", "kind", "seed", "round", "acc_weighted_mean"]
    assert len(csv) == (4 + 2 + 2 + 2) * 3  # (cell, kind) series of ok cells × 3 rounds
    last = csv[(csv["dataset"] == "fmnist") & (csv["label"] == "fedavg") & (csv["seed"] == 1) & (csv["round"] == 3)]
    assert last["acc_weighted_mean"].item() == pytest.approx(0.79)


EXPECTED = {
    "fedavg_ft (global)": ["81.00 ± 1.41", "50.00 (1 failed)"],
    "fedavg_ft (personal)": ["91.50 ± 2.12", "70.00 (1 failed)"],
    "fedavg (global)": ["78.50 ± 0.71", "42.00 ± 2.83"],
}


def test_pivot_table(cells):
    table = pivot_table(summary_frame(cells), "acc_weighted_mean")
    assert list(table.index) == list(EXPECTED)
    assert list(table.columns) == GRID
    for name, values in EXPECTED.items():
        assert list(table.loc[name]) == values


def test_pivot_table_all_failed_and_single_seed(cells):
    extra = [make_cell("fmnist", "dir0.1", "ditto", s, failed=True) for s in (0, 1)]
    table = pivot_table(summary_frame(cells + extra), "acc_weighted_mean")
    assert list(table.loc["ditto"]) == ["failed", "-"]
    single = pivot_table(summary_frame([make_cell("fmnist", "dir0.1", "fedavg", 0)]), "acc_weighted_mean")
    assert single.iloc[0, 0] == "78.00"


def test_write_tables(cells, tmp_path):
    extra = [make_cell("fmnist", "dir0.1", "ditto", s, failed=True) for s in (0, 1)]
    paths = write_tables(summary_frame(cells + extra), tmp_path / "tables")
    assert {p.name for p in paths} == {f"{n}.{e}" for n in DEFAULT_TABLES for e in ("md", "tex", "csv", "meta.json")}
    assert all(p.exists() for p in paths)

    md = (tmp_path / "tables" / "accuracy.md").read_text()
    assert md.startswith("Table: Accuracy (%) weighted by client test size, final round, mean ± std (sample, ddof=1) over 2 seeds")
    assert "| fmnist / dir0.1 | cifar10 / shards2 |" in md
    for name, (a, b) in EXPECTED.items():
        assert f"| {name} | {a} | {b} |" in md
    assert "| ditto | failed | - |" in md

    tex = (tmp_path / "tables" / "accuracy.tex").read_text()
    for rule in (r"\toprule", r"\midrule", r"\bottomrule"):
        assert tex.count(rule) == 1
    assert r"\caption{Accuracy (\%) weighted by client test size" in tex
    assert r"fedavg\_ft (global) & 81.00 $\pm$ 1.41 & 50.00 (1 failed) \\" in tex
    assert r"fedavg (global) & 78.50 $\pm$ 0.71 & 42.00 $\pm$ 2.83 \\" in tex
    assert r"ditto & failed & - \\" in tex
    assert r"\multicolumn{1}{c}{fmnist}" in tex and r"\multicolumn{1}{c}{cifar10}" in tex
    assert "dir0.1 & shards2" in tex
    assert "±" not in tex.split("\n", 1)[1] and "fedavg_ft" not in tex  # escaped outside the comment line

    # a plain CSV in the summary's unit (fractions); caption, notes and unit in the sidecar
    csv = pd.read_csv(tmp_path / "tables" / "accuracy.csv")
    meta = json.loads((tmp_path / "tables" / "accuracy.meta.json").read_text())
    assert meta["caption"] in md and meta["unit"].startswith("fraction") and meta["seeds"] == 2
    assert list(csv["label"]) == ["fedavg_ft", "fedavg_ft", "fedavg", "ditto"]
    assert list(csv["kind"]) == ["global", "personal", "global", "failed"]
    for ds, part in GRID:
        for stat in ("mean", "std"):
            assert f"{ds}/{part}/{stat}" in csv.columns
    assert csv.loc[0, "fmnist/dir0.1/mean"] == pytest.approx(0.81)
    assert csv.loc[0, "fmnist/dir0.1/std"] == pytest.approx(0.02 / math.sqrt(2), abs=1e-6)
    assert csv.loc[0, "cifar10/shards2/n_failed"] == 1

    worst = (tmp_path / "tables" / "accuracy_worst10.md").read_text()
    assert "| fedavg_ft (global) | 66.00 ± 1.41 | 35.00 (1 failed) |" in worst
    assert "macro" in (tmp_path / "tables" / "macro_f1.md").read_text().lower()


def _assert_png(path) -> bytes:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000
    return data


def test_plots(cells, manifest, tmp_path):
    for dataset, partition in GRID:
        plot_curves(cells, dataset, partition, tmp_path / f"curves_{dataset}.png")
        plot_client_distribution(cells, dataset, partition, tmp_path / f"clients_{dataset}.png")
        _assert_png(tmp_path / f"curves_{dataset}.png")
        _assert_png(tmp_path / f"clients_{dataset}.png")
    plot_curves(curves_frame(cells), "fmnist", "dir0.1", tmp_path / "from_frame.png")
    _assert_png(tmp_path / "from_frame.png")
    plot_partition(manifest, tmp_path / "partition.png")
    _assert_png(tmp_path / "partition.png")
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temp files


def test_plots_are_deterministic(cells, manifest, tmp_path):
    for i in (1, 2):
        plot_curves(cells, "fmnist", "dir0.1", tmp_path / f"c{i}.png")
        plot_client_distribution(cells, "fmnist", "dir0.1", tmp_path / f"d{i}.png")
        plot_partition(manifest, tmp_path / f"p{i}.png")
    for name in "cdp":
        assert (tmp_path / f"{name}1.png").read_bytes() == (tmp_path / f"{name}2.png").read_bytes()


def test_curve_joins_the_rounds_a_sparse_column_scored(tmp_path):
    """A personalized curve scored every 2nd round (`training.personal_eval_every: 2`; null
    between) is drawn through rounds 2 and 4, not as isolated points in NaN gaps, and the
    dvc plots CSV has rows for those rounds only."""
    cell = make_cell("fmnist", "dir0.1", "fedavg_ft", 0)
    cell["curves"] = {"round": [1, 2, 3, 4], "global_acc": {"weighted_mean": [0.1, 0.2, 0.3, 0.4]},
                      "personal_acc": {"weighted_mean": [None, 0.5, None, 0.7]}, "train_loss": [1.0] * 4}
    frame = curves_frame([cell])
    acc = frame[(frame["metric"] == "acc") & (frame["stat"] == "weighted_mean")]
    fig, ax = plt.subplots()
    personal = seed_band(ax, acc[acc["kind"] == "personal"], 100.0)
    glob = seed_band(ax, acc[acc["kind"] == "global"], 100.0)
    plt.close(fig)
    assert list(personal.get_xdata()) == [2, 4] and list(personal.get_ydata()) == [50.0, 70.0]
    assert list(glob.get_xdata()) == [1, 2, 3, 4]
    write_curves_csv([cell], tmp_path / "curves.csv")
    rows = pd.read_csv(tmp_path / "curves.csv")
    assert rows.groupby("kind")["round"].apply(list).to_dict() == {"global": [1, 2, 3, 4], "personal": [2, 4]}


def test_plots_edge_cases(manifest, tmp_path):
    one = make_cell("fmnist", "dir0.1", "fedavg", 0)
    one["rounds"] = 1
    one["curves"] = {"round": [1], "global_acc": {"weighted_mean": [0.5]}, "train_loss": [1.0]}
    all_failed = [make_cell("fmnist", "dir0.1", "ditto", s, failed=True) for s in (0, 1)]
    plot_curves([one] + all_failed, "fmnist", "dir0.1", tmp_path / "one.png")
    plot_curves(all_failed, "fmnist", "dir0.1", tmp_path / "failed_curves.png")
    plot_client_distribution([one] + all_failed, "fmnist", "dir0.1", tmp_path / "one_dist.png")
    plot_client_distribution(all_failed, "fmnist", "dir0.1", tmp_path / "failed_dist.png")
    plot_client_distribution([], "fmnist", "dir0.1", tmp_path / "empty_dist.png")
    many = dict(manifest, num_clients=60, clients=[dict(manifest["clients"][i % 3], id=i) for i in range(60)])
    plot_partition(many, tmp_path / "many.png")
    wide = dict(manifest, num_classes=30, clients=[
        {"id": i, "class_counts": {"train": [(i * j) % 5 for j in range(30)]}} for i in range(4)])
    plot_partition(wide, tmp_path / "wide.png")
    for name in ("one", "failed_curves", "one_dist", "failed_dist", "empty_dist", "many", "wide"):
        _assert_png(tmp_path / f"{name}.png")
    # summaries and tables of failed-only cells don't crash either
    frame = summary_frame(all_failed)
    assert list(frame["kind"]) == ["failed", "failed"]
    assert pivot_table(frame, "acc_mean").iloc[0, 0] == "failed"
    write_tables(frame, tmp_path / "t")
    write_summary(all_failed, tmp_path / "s.csv", tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text()) == {
        "fmnist": {"dir0.1": {"ditto": {"failed": {"n_seeds": 0, "n_failed": 2}}}}}


# ----------------------------------------------------------------------------- chain of custody


@pytest.fixture(scope="module")
def trained(tiny_partition, tmp_path_factory):
    """Real metrics.json files of the fedavg cell, seeds 0 and 1 (1 round), in the workflow's layout:
    (cells, their paths)."""
    from conftest import tiny_config

    from fedrepro.config import resolve_experiment
    from fedrepro.engine.run import train_cell

    base = next(c for c in resolve_experiment(tiny_config(rounds=1))["cells"] if c["label"] == "fedavg")
    cells = [base | {"seed": s} for s in (0, 1)]
    root = tmp_path_factory.mktemp("custody")
    paths = []
    for c in cells:
        out = root / "results" / c["experiment"] / "runs" / "digits" / "dir" / "fedavg" / f"seed{c['seed']}"
        train_cell(c, tiny_partition[0], out, progress=False)
        paths.append(out / "metrics.json")
    return cells, paths


def _aggregate(tmp_path, paths, cells=None) -> tuple[int, str]:
    from fedrepro.cli import main
    from fedrepro.custody import expected_token

    expect = ["--expect", *map(expected_token, cells)] if cells else []
    return main(["aggregate", *map(str, paths), "--csv", str(tmp_path / "s.csv"), "--json", str(tmp_path / "s.json"),
                 "--curves", str(tmp_path / "c.csv"), *expect])


def _copies(trained, tmp_path) -> tuple[list, list]:
    """The trained files copied under tmp_path (same layout), so a test can damage them."""
    import shutil

    cells, paths = trained
    root = paths[0].parents[6]
    out = [tmp_path / p.relative_to(root) for p in paths]
    for src, dst in zip(paths, out):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    return cells, out


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fedrepro aggregate: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def test_metrics_carry_the_cells_identity(trained, tiny_partition):
    from fedrepro.custody import manifest_hash
    from fedrepro.data.shards import read_manifest
    from fedrepro.io import short_hash

    cells, paths = trained
    for cell, path in zip(cells, paths):
        identity = json.loads(path.read_text())["identity"]
        provenance = json.loads((path.parent / "provenance.json").read_text())["identity"]
        assert identity == provenance == {k: cell[k] for k in ("experiment", "dataset", "partition", "partition_id",
                                                               "method", "label", "seed")} | {
            "cell_key": short_hash(cell), "manifest_hash": manifest_hash(read_manifest(tiny_partition[0]))}


def test_aggregating_the_expected_cells_works(trained, tmp_path, capsys):
    cells, paths = trained
    assert _aggregate(tmp_path, paths, cells) == 0
    frame = pd.read_csv(tmp_path / "s.csv")
    assert list(frame["seed"]) == [0, 1] and set(frame["status"]) == {"ok"}


def test_seed_1s_metrics_copied_over_seed_0s_is_an_error_naming_the_file_and_seed(trained, tmp_path, capsys):
    """Before: the table had seed 1 twice and seed 0 not at all."""
    cells, paths = _copies(trained, tmp_path)
    paths[0].write_bytes(paths[1].read_bytes())
    assert _aggregate(tmp_path, paths, cells) == 2
    _one_line_error(capsys, str(paths[0]), "field 'seed' is 1, expected 0", "delete it and rerun")
    assert _aggregate(tmp_path, paths) == 2  # without --expect (`fedrepro aggregate` by hand): a repeated cell
    _one_line_error(capsys, str(paths[1]), "field 'seed'", str(paths[0]))


def test_another_experiments_metrics_is_an_error(trained, tmp_path, capsys):
    cells, paths = _copies(trained, tmp_path)
    doc = json.loads(paths[1].read_text())
    for block in ("cell", "identity"):
        doc[block]["experiment"] = "other"
    paths[1].write_text(json.dumps(doc))
    assert _aggregate(tmp_path, paths, cells) == 2
    _one_line_error(capsys, str(paths[1]), "field 'experiment' is 'other', expected 'unit'")
    assert _aggregate(tmp_path, paths) == 2
    _one_line_error(capsys, str(paths[1]), "field 'experiment'")


def test_metrics_of_an_earlier_configuration_of_the_cell_is_an_error(trained, tmp_path, capsys):
    cells, paths = _copies(trained, tmp_path)
    changed = [cells[0] | {"hparams": {"lr_note": 1}}, cells[1]]  # the config changed since seed 0 was trained
    assert _aggregate(tmp_path, paths, changed) == 2
    _one_line_error(capsys, str(paths[0]), "field 'cell_key'")


@pytest.mark.parametrize("where, value", [(("summary", "global_acc", "weighted_mean"), "0.9"),
                                          (("summary", "global_acc", "std"), True),
                                          (("rounds",), 1.5),
                                          (("communication", "bytes_up_total"), "many")])
def test_a_value_of_the_wrong_type_is_an_error_naming_the_field(trained, tmp_path, capsys, where, value):
    """Before: a string became NaN and the mean silently had one seed less."""
    cells, paths = _copies(trained, tmp_path)
    doc = json.loads(paths[0].read_text())
    parent = doc
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    paths[0].write_text(json.dumps(doc))
    assert _aggregate(tmp_path, paths, cells) == 2
    _one_line_error(capsys, str(paths[0]), f"field '{'.'.join(where)}' has value {value!r}")


@pytest.mark.parametrize("damage", ["truncated", "nan", "binary", "empty"])
def test_a_damaged_metrics_file_is_one_line_naming_it_and_what_to_do(trained, tmp_path, capsys, damage):
    """Before: a JSONDecodeError traceback naming no file, on every rerun."""
    cells, paths = _copies(trained, tmp_path)
    text = paths[0].read_text()
    paths[0].write_bytes({"truncated": text[: len(text) // 2].encode(), "nan": text.replace("0.", "NaN, \"x\": 0.", 1).encode(),
                          "binary": b"\xff\xfe\x00garbage", "empty": b""}[damage])
    assert _aggregate(tmp_path, paths, cells) == 2
    _one_line_error(capsys, str(paths[0]), "delete it and rerun the workflow")


@pytest.mark.parametrize("kind", ["device", "fifo", "directory", "link_out", "link_loop", "too_large"])
def test_a_metrics_path_that_is_not_a_bounded_regular_file_is_refused(trained, tmp_path, capsys, monkeypatch, kind):
    import fedrepro.custody as custody

    cells, paths = _copies(trained, tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    paths[0].unlink()
    if kind == "device":
        paths[0].symlink_to("/dev/zero")
    elif kind == "fifo":  # must not wait for a writer
        os.mkfifo(paths[0])
    elif kind == "directory":
        paths[0].mkdir()
    elif kind == "link_out":
        (tmp_path / "elsewhere.json").write_text(paths[1].read_text())
        paths[0].symlink_to(tmp_path / "elsewhere.json")
    elif kind == "link_loop":
        paths[0].symlink_to(paths[0])
    else:
        paths[0].write_text(paths[1].read_text())
        monkeypatch.setattr(custody, "METRICS_MAX_BYTES", 1000)
        monkeypatch.setattr(custody.read_bounded_json, "__defaults__", (1000, "metrics file"))
    assert _aggregate(tmp_path, paths, cells) == 2
    _one_line_error(capsys, str(paths[0]))


def test_a_link_to_a_regular_file_inside_the_project_is_read(trained, tmp_path, capsys, monkeypatch):
    """A DVC cache with cache.type symlink in the project keeps working."""
    cells, paths = _copies(trained, tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    cache = tmp_path / "work" / ".dvc" / "cache" / "ab12"
    cache.parent.mkdir(parents=True)
    paths[0].rename(cache)
    paths[0].symlink_to(cache)
    assert _aggregate(tmp_path, paths, cells) == 0
def _same_global_model_twice(seeds=(0,)) -> list[dict]:
    """fedavg and fedavg_ft whose global model is the same one (fine-tuning only makes personal
    models), evaluated at rounds 1 and 3 with the training loss of every round."""
    cells = []
    for seed in seeds:
        base = make_cell("fmnist", "dir0.1", "fedavg", seed)
        base["curves"]["round"] = [1, 3]
        base["curves"]["global_acc"] = {"weighted_mean": [0.5 + seed / 100, 0.7]}
        base["train_loss_per_round"] = [1.0, 0.7, 0.5]
        ft = json.loads(json.dumps(base))
        ft["cell"].update(label="fedavg_ft", method="fedavg_ft")
        ft["summary"]["personal_acc"] = _stats(0.9)
        ft["curves"]["personal_acc"] = {"weighted_mean": [0.8, 0.9]}
        cells += [base, ft]
    return cells


def test_an_identical_series_is_drawn_once_every_panel_has_a_legend_and_the_loss_every_round():
    from fedrepro.report.plots import curves_figure

    fig = curves_figure(_same_global_model_twice(), "fmnist", "dir0.1")
    ax_acc, ax_loss = fig.axes[:2]
    plt.close(fig)
    assert [line.get_label() for line in ax_acc.get_lines()] == ["fedavg = fedavg_ft (global)", "fedavg_ft (personal)"]
    assert [line.get_label() for line in ax_loss.get_lines()] == ["fedavg = fedavg_ft"]
    for ax in (ax_acc, ax_loss):
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label() for line in ax.get_lines()]
    assert list(ax_loss.get_lines()[0].get_xdata()) == [1, 2, 3]  # every round, not only the evaluated ones
    assert list(ax_loss.get_lines()[0].get_ydata()) == [1.0, 0.7, 0.5]


def test_one_seed_is_not_captioned_as_a_spread_and_identical_rows_are_noted(tmp_path):
    write_tables(summary_frame(_same_global_model_twice()), tmp_path)
    md = (tmp_path / "accuracy.md").read_text()
    assert md.startswith("Table: Accuracy (%) weighted by client test size, final round, one seed (no spread over seeds)")
    assert "±" not in md and "fedavg_ft (global) is identical to fedavg (global) in every cell and seed" in md
    two = summary_frame(_same_global_model_twice(seeds=(0, 1)))
    two.loc[(two["label"] == "fedavg_ft") & (two["seed"] == 1), "acc_mean"] += 0.01  # differs in one seed
    write_tables(two, tmp_path / "two")
    assert "identical" not in (tmp_path / "two" / "accuracy.md").read_text()


def _render_like_snakemake_report(rst: str) -> str:
    """What `snakemake --report` does with the workflow description: Jinja, then docutils."""
    from docutils.core import publish_parts
    from jinja2 import Environment

    links = "\n\n.. _Tables: javascript:show('Tables')\n.. _Learning curves: javascript:show('Learning curves')\n"
    return publish_parts(Environment(trim_blocks=True, lstrip_blocks=True).from_string(rst + links).render(),
                         writer="html", settings_overrides={"report_level": 2})["html_body"]


def test_the_report_landing_page_shows_the_main_table_the_curves_and_only_what_the_experiment_has(cells, tmp_path):
    from fedrepro.report.landing import console_summary, description_rst

    png = tmp_path / "curves_fmnist_dir0.1.png"
    plot_curves(cells, "fmnist", "dir0.1", png)
    frame = summary_frame(cells)
    spec = {"experiment": "default", "rounds": "3", "seeds": [0, 1], "tuning": False, "paper": None}
    page = _render_like_snakemake_report(description_rst(frame, spec, [png]))
    assert "System Message" not in page and "<table class=\"fedrepro-main\"" in page.replace("'", '"')
    for name, values in EXPECTED.items():
        assert f">{name}</td>" in page and all(f">{v}</td>" in page for v in values)
    assert page.count("data:image/png;base64,") == 1
    assert "tuned" not in page and "Paper" not in page
    page = _render_like_snakemake_report(description_rst(frame, spec | {"tuning": True, "paper": "FedX"}, [png]))
    assert "Hyper-parameters were tuned" in page and "Paper: FedX" in page
    # the console at the end of a run: the same table as text
    write_summary(cells, tmp_path / "summary.csv", tmp_path / "summary.json")
    text = console_summary(tmp_path / "summary.csv")
    assert text.startswith("fedrepro: Accuracy (%)") and "fedavg_ft (personal)" in text and "91.50 ± 2.12" in text
    assert console_summary(tmp_path / "missing.csv") == ""
