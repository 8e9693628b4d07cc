"""Issue 37's silent and late cases: each is refused with one line before any work.

Config cases (1-3) are refused by `resolve_experiment`, so `fedrepro validate`, `fedrepro cells` and
the workflow's parse-time check agree; command cases (4-7) go through `fedrepro.cli.main` in-process
and must exit non-zero with a single `fedrepro <cmd>: error: ...` line and no traceback.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from fedrepro.cli import main
from fedrepro.config import load_and_resolve, resolve_experiment
from fedrepro.data.datasets import load_dataset
from fedrepro.data.shards import MANIFEST_HASH, write_partition
from fedrepro.io import write_json_atomic
from fedrepro.registry import ConfigError
from fedrepro.report.aggregate import load_cells, write_summary

from conftest import REPO
from test_report import make_cell

BASE = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
SHIPPED = sorted(p for p in (REPO / "config").rglob("*.yaml") if "published" not in p.parts)


def one_line_error(capsys, argv: list[str], *named: str) -> str:
    """Run `fedrepro argv`; assert a non-zero exit and one stderr line naming `named`; return it."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0, err
    lines = [line for line in err.strip().splitlines() if not line.startswith("[fedrepro] warning:")]  # the fixtures' age
    assert "Traceback" not in err and len(lines) == 1, err
    err = lines[0]
    assert err.startswith(f"fedrepro {argv[0]}: error: "), err
    for part in named:
        assert part in err, (part, err)
    return err


# ------------------------------------------------------------------ 1: augmentation that does not fit the images

def test_crop_flip_on_images_too_small_for_its_padding_is_refused():
    """crop_flip pads by 4 and crops back: on 8x8 digits that keeps a quarter of an image (it trained at
    chance, 0.087, status ok). Refused naming the key, value, the sample shape and what is allowed."""
    cfg = copy.deepcopy(BASE)
    cfg["training"]["augment"] = "crop_flip"
    with pytest.raises(ConfigError) as err:
        resolve_experiment(cfg)
    text = str(err.value)
    for part in ("'training.augment'", "'crop_flip'", "allowed: 'none' for digits", "(1, 8, 8)", "16 pixels"):
        assert part in text, (part, text)
    # the most specific key given is named: a dataset's own training block
    cfg = copy.deepcopy(BASE)
    cfg["datasets"]["digits"]["training"] = {"augment": "crop_flip"}
    with pytest.raises(ConfigError, match=r"'datasets\.digits\.training\.augment' has value 'crop_flip'"):
        resolve_experiment(cfg)


def test_crop_flip_on_images_large_enough_still_resolves():
    """The rule refuses small images only: 16x16 (usps) and 32x32 (cifar10, the shipped configs' use) pass."""
    from fedrepro.engine.data import CROP_PADDING, augment_problem

    assert augment_problem("crop_flip", (1, 4 * CROP_PADDING, 4 * CROP_PADDING)) is None
    assert augment_problem("crop_flip", (3, 32, 32)) is None
    assert augment_problem("crop_flip", (1, 4 * CROP_PADDING - 1, 32))  # one side too short is enough
    assert augment_problem("none", (1, 8, 8)) is None
    _, exp = load_and_resolve([REPO / "config" / "papers" / "fedcrc.yaml"])
    assert {c["training"]["augment"] for c in exp["cells"] if c["dataset"] == "cifar10"} == {"crop_flip"}


# ------------------------------------------------------------------ 2: a label that shadows another method

def test_a_label_named_after_another_method_is_refused():
    cfg = copy.deepcopy(BASE)
    cfg["methods"] = {"fedavg": {"method": "local"}, "fedavg_ft": {}}
    with pytest.raises(ConfigError) as err:
        resolve_experiment(cfg)
    for part in ("'methods.fedavg.method'", "'local'", "allowed: 'fedavg'", "labels"):
        assert part in str(err.value), (part, str(err.value))
    # a label equal to its own method, or to no method's name, is fine
    cfg["methods"] = {"fedavg": {"method": "fedavg"}, "local_as_fedavg": {"method": "local"}}
    labels = {c["label"]: c["method"] for c in resolve_experiment(cfg)["cells"]}
    assert labels == {"fedavg": "fedavg", "local_as_fedavg": "local"}


# ------------------------------------------------------------------ 3: two labels, one resolved setup

def test_two_labels_with_identical_resolved_cells_are_refused():
    """`fedavg_copy` differs only in spelling: lr 0.05 given where the base training already sets it."""
    cfg = copy.deepcopy(BASE)
    lr = cfg["training"]["optimizer"]["lr"]
    cfg["methods"]["fedavg_copy"] = {"method": "fedavg", "training": {"optimizer": {"lr": lr}}}
    with pytest.raises(ConfigError) as err:
        resolve_experiment(cfg)
    for part in ("'methods.fedavg_copy'", "'methods.fedavg'", "train twice", "allowed"):
        assert part in str(err.value), (part, str(err.value))
    cfg["methods"]["fedavg_copy"]["training"]["optimizer"]["lr"] = lr / 2  # a real difference resolves
    assert "fedavg_copy" in {c["label"] for c in resolve_experiment(cfg)["cells"]}


def test_two_tuned_labels_with_one_plan_are_refused_and_a_tuned_twin_of_a_plain_label_is_not():
    cfg = copy.deepcopy(BASE)
    cfg["methods"]["ft_tuned"] = {"method": "fedavg_ft", "hparams": dict(cfg["methods"]["fedavg_ft"].get("hparams") or {})}
    cfg["tuning"] = {"training": {"rounds": 1}, "methods": {"ft_tuned": {"ft_epochs": [1, 2]}}}
    resolve_experiment(cfg)  # its hyper-parameters come from the selection: not fedavg_ft's cells
    cfg["tuning"]["methods"]["fedavg_ft"] = {"ft_epochs": [1, 2]}
    with pytest.raises(ConfigError, match=r"'methods\.ft_tuned' resolves to the same cells as 'methods\.fedavg_ft'"):
        resolve_experiment(cfg)


def test_shipped_configs_resolve_but_a_duplicated_shipped_label_is_refused():
    """Cases 2 and 3 are errors because no shipped config has either: each resolves, and each with its
    first label copied under a new name is refused."""
    for path in SHIPPED:
        config, exp = load_and_resolve([path])
        assert exp["cells"], path
        label, entry = next(iter(config["methods"].items()))
        twin = {**config, "methods": {**config["methods"], f"{label}_twin": {"method": label, **(entry or {})}}}
        if label in ((config.get("tuning") or {}).get("methods") or {}):  # a tuned label's twin is tuned alike
            twin["tuning"] = {**config["tuning"], "methods": {**config["tuning"]["methods"],
                                                              f"{label}_twin": config["tuning"]["methods"][label]}}
        with pytest.raises(ConfigError, match=rf"'methods\.{re.escape(label)}_twin' resolves to the same cells"):
            resolve_experiment(twin)


# ------------------------------------------------------------------ 4: plots of a dataset the metrics lack

@pytest.fixture
def metrics_files(tmp_path) -> list[str]:
    paths = []
    for method in ("fedavg", "fedavg_ft"):
        for seed in (0, 1):
            path = tmp_path / "runs" / method / str(seed) / "metrics.json"
            write_json_atomic(path, make_cell("fmnist", "dir0.1", method, seed))
            paths.append(str(path))
    return paths


def test_plots_of_a_dataset_or_partition_the_metrics_lack_are_refused(metrics_files, tmp_path, capsys):
    out = tmp_path / "plots"
    one_line_error(capsys, ["plots", *metrics_files, "--dataset", "cifar100", "--partition", "dir0.1",
                            "--curves", str(out / "c.png"), "--clients", str(out / "d.png")],
                   "--dataset", "'cifar100'", "allowed: 'fmnist'")
    one_line_error(capsys, ["plots", *metrics_files, "--dataset", "fmnist", "--partition", "dir9",
                            "--curves", str(out / "c.png")], "--partition", "'dir9'", "allowed: 'dir0.1'")
    assert not out.exists()  # nothing drawn
    assert main(["plots", *metrics_files, "--dataset", "fmnist", "--partition", "dir0.1", "--curves", str(out / "c.png")]) == 0
    assert (out / "c.png").stat().st_size > 0


# ------------------------------------------------------------------ 5: a partition plot of a swapped folder

@pytest.fixture(scope="module")
def two_partitions(tmp_path_factory) -> tuple[Path, Path]:
    """Two small digits partitions (different seeds), each in a folder named by its id."""
    raw = load_dataset("digits", tmp_path_factory.mktemp("raw"))
    root = tmp_path_factory.mktemp("shards") / "digits"
    out = []
    for seed in (0, 1):
        spec = {"partitioner": "iid", "num_clients": 3, "seed": seed}
        exp_spec = resolve_experiment({**copy.deepcopy(BASE), "partitions": {"p": spec}})["partitions"][0]
        folder = root / exp_spec["id"]
        write_partition(raw, exp_spec["spec"], folder)
        out.append(folder)
    return out[0], out[1]


def test_plot_partition_refuses_a_folder_holding_another_partition(two_partitions, tmp_path, capsys):
    first, second = two_partitions
    swapped = tmp_path / first.name  # first's id, second's content: the swap before the restore
    shutil.copytree(second, swapped)
    png = tmp_path / f"{first.name}.png"
    one_line_error(capsys, ["plot-partition", str(swapped), str(png)], str(swapped), second.name, first.name, "allowed")
    assert not png.exists()  # no picture of the foreign partition under the original id


def test_partition_plot_names_the_manifest_it_drew(two_partitions, tmp_path):
    from fedrepro.report.plots import read_png_stamp

    first, _ = two_partitions
    png = tmp_path / f"{first.name}.png"
    assert main(["plot-partition", str(first), str(png)]) == 0
    manifest = json.loads((first / "manifest.json").read_text())
    assert read_png_stamp(png) == {"fedrepro.partition_id": first.name, "fedrepro.manifest_sha256": manifest[MANIFEST_HASH]}


# ------------------------------------------------------------------ 6: select with an incomplete spec

def test_select_with_missing_spec_keys_is_one_line(tmp_path, capsys):
    out = tmp_path / "sel.json"
    one_line_error(capsys, ["select", "--spec", "{}", "--out", str(out)], "--spec", "missing key(s)", "runs", "trials",
                   "allowed")
    spec = {"dataset": "digits", "partition": "p", "label": "fedprox", "method": "fedprox", "space": {"mu": [0.1]},
            "trials": [{"id": "t1", "values": {"mu": 0.1}}], "metric": {"model": "auto", "stat": "weighted_mean"},
            "runs": [{"trial": "t9", "seed": 0, "metrics": str(tmp_path / "m.json")}]}
    one_line_error(capsys, ["select", "--spec", json.dumps(spec), "--out", str(out)], "'runs[0]'", "'t1'")
    spec["runs"] = []
    spec["metric"] = {"model": "auto", "stat": "median"}
    one_line_error(capsys, ["select", "--spec", json.dumps(spec), "--out", str(out)], "'metric'", "weighted_mean")
    assert not out.exists()


# ------------------------------------------------------------------ 7: tables from a file that is not a summary CSV

NOT_A_SUMMARY = {
    "ragged": (b'a,b\n1,2\n3,4,5,6\n"unclosed', "not a CSV file"),  # pandas' ParserError traceback before
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not a CSV file"),
    "empty": (b"", "not a CSV file"),
    "other-columns": (b"dataset,partition\nd,p\n", "without the column(s)"),
    "text-in-numbers": (b"dataset,partition,label,kind,seed,status," + ",".join(
        f"{m}_{s}" for m in ("acc", "f1") for s in ("weighted_mean", "mean", "std", "min", "max", "worst10")).encode()
        + b",num_clients,untrained_clients,untrained_rule\nd,p,l,global,0,ok," + b",".join([b"high"] * 12) + b",3,0,\n",
        "not numbers"),
}


def test_tables_from_a_non_summary_file_is_one_line(metrics_files, tmp_path, capsys):
    for name, (content, named) in NOT_A_SUMMARY.items():
        bad = tmp_path / f"{name}.csv"
        bad.write_bytes(content)
        one_line_error(capsys, ["tables", "--summary", str(bad), "--out-dir", str(tmp_path / "t")], str(bad), named, "allowed")
        assert not (tmp_path / "t" / "accuracy.md").exists(), name
    # the summary.csv `fedrepro aggregate` writes is read as before
    write_summary(load_cells(metrics_files), tmp_path / "summary.csv", tmp_path / "summary.json")
    assert main(["tables", "--summary", str(tmp_path / "summary.csv"), "--out-dir", str(tmp_path / "t")]) == 0
    assert "fedavg" in (tmp_path / "t" / "accuracy.md").read_text()


def test_report_page_from_a_non_summary_file_is_one_line(tmp_path, capsys):
    """The report's landing page reads summary.csv through the same reader as `tables`."""
    bad = tmp_path / "ragged.csv"
    bad.write_bytes(NOT_A_SUMMARY["ragged"][0])
    one_line_error(capsys, ["report-page", "--summary", str(bad), "--spec", "{}", "--out", str(tmp_path / "d.rst")],
                   str(bad), "not a CSV file", "allowed")
    assert not (tmp_path / "d.rst").exists()


def test_select_when_every_trial_failed_is_one_line(tmp_path, capsys):
    """A well-formed spec whose every trial diverged: nothing to select, one line (a ValueError traceback before)."""
    failed = make_cell("digits", "p", "fedprox", 0, failed=True)
    write_json_atomic(tmp_path / "m.json", failed)
    spec = {"dataset": "digits", "partition": "p", "label": "fedprox", "method": "fedprox", "space": {"mu": [0.1]},
            "trials": [{"id": "t1", "values": {"mu": 0.1}}], "metric": {"model": "auto", "stat": "weighted_mean"},
            "runs": [{"trial": "t1", "seed": 0, "metrics": str(tmp_path / "m.json")}]}
    out = tmp_path / "sel.json"
    one_line_error(capsys, ["select", "--spec", json.dumps(spec), "--out", str(out)], "every tuning trial", "'fedprox'",
                   "allowed")
    assert not out.exists()
