"""Verification by recomputation (issue 46): `fedrepro verify` retrains recorded cells and names every
field that differs; `fedrepro aggregate` refuses a summary that contradicts its per-client scores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fedrepro.cli import main
from fedrepro.config import load_and_resolve
from fedrepro.data.datasets import load_dataset
from fedrepro.data.shards import write_partition
from fedrepro.verify import CUDA_REL_TOL, UNCOMPARED, check_summaries, choose, diff

from test_protocols import images_with_test_set, protocol_partition, run  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
#: three cells of the default test experiment (config/test.yaml: digits, 6 clients, 3 rounds)
CELLS = [("dir0.5", "local", 0), ("dir0.5", "fedavg", 0), ("dir0.5", "fedavg", 1)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """results/test of config/test.yaml with the three CELLS trained by `fedrepro train`, as the
    workflow lays them out (shards in results/shards/<dataset>/<partition id>)."""
    root = tmp_path_factory.mktemp("project") / "results"
    _, exp = load_and_resolve([REPO / "config" / "test.yaml"])
    raw = load_dataset("digits", tmp_path_factory.mktemp("raw"))
    for partition, label, seed in CELLS:
        cell = next(c for c in exp["cells"] if (c["partition"], c["label"], c["seed"]) == (partition, label, seed))
        shards = root / "shards" / "digits" / cell["partition_id"]
        if not shards.exists():
            spec = next(p["spec"] for p in exp["partitions"] if p["id"] == cell["partition_id"])
            write_partition(raw, spec, shards)
        out = root / "test" / "runs" / "digits" / partition / label / f"seed{seed}"
        assert main(["train", "--cell", json.dumps(cell), "--shards", str(shards), "--out-dir", str(out),
                     "--threads", "1"]) == 0
    return root / "test"


@pytest.fixture
def copy(trained, tmp_path) -> Path:
    """A copy of the trained results folder (its shards beside it), for a test to edit."""
    shutil.copytree(trained.parent, tmp_path / "results")
    return tmp_path / "results" / "test"


def _edit(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2))


def _run(capsys, *argv: str) -> tuple[int, list[str], str]:
    rc = main([*argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out.splitlines(), err


def test_provenance_records_the_thread_count_and_device_of_the_run(trained):
    prov = json.loads((trained / "runs/digits/dir0.5/fedavg/seed0/provenance.json").read_text())
    assert prov["torch"]["num_threads"] == 1 and prov["device"]["type"] == "cpu"


def test_verify_recomputes_every_cell_exactly(trained, capsys):
    before = {p: p.read_bytes() for p in trained.rglob("*") if p.is_file()}
    rc, out, _ = _run(capsys, "verify", str(trained))
    assert rc == 0, out
    assert sorted(line for line in out if line.endswith(": exact")) == [
        "digits/dir0.5/fedavg/seed0: exact", "digits/dir0.5/fedavg/seed1: exact", "digits/dir0.5/local/seed0: exact"]
    assert out[-1] == f"{trained}: 3 of 3 cell(s) exact, 0 differ, 0 cannot be reproduced here"
    assert {p: p.read_bytes() for p in trained.rglob("*") if p.is_file()} == before  # retrained elsewhere
    assert torch.get_num_threads() == 1  # the recorded count was set for the retraining only


def test_verify_retrains_through_fedrepro_train_with_the_recorded_threads_and_device(copy, monkeypatch, capsys):
    import fedrepro.cli as cli
    from fedrepro.registry import ConfigError

    seen = []

    def spy(args):
        seen.append((json.loads(json.dumps(args.cell)), args.threads, args.device, Path(args.shards), args.out_dir))
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(cli, "cmd_train", spy)
    run = copy / "runs/digits/dir0.5/fedavg/seed0"
    _edit(run / "provenance.json", lambda d: d["torch"].update(num_threads=3))
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "*/fedavg/seed0")
    assert rc == 3 and "digits/dir0.5/fedavg/seed0: cannot reproduce here: stopped by the test" in out
    [(cell, threads, device, shards, out_dir)] = seen
    assert cell == json.loads((run / "provenance.json").read_text())["cell"] and (threads, device) == (3, "cpu")
    assert shards == copy.parent / "shards/digits" / cell["partition_id"]
    assert not Path(out_dir).is_relative_to(copy.parent.parent) and not Path(out_dir).parent.exists()  # scratch, removed


def test_a_hand_edited_number_is_named_with_its_cell_and_field(copy, capsys):
    metrics = copy / "runs/digits/dir0.5/fedavg/seed1/metrics.json"
    recorded = json.loads(metrics.read_text())["final"]["global"]["acc"][2]
    _edit(metrics, lambda d: d["final"]["global"]["acc"].__setitem__(2, 0.123))
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "digits/dir0.5/fedavg/*")
    assert rc == 1
    assert f"digits/dir0.5/fedavg/seed1: final.global.acc[2]: recorded 0.123, recomputed {json.dumps(recorded)}" in out
    assert "digits/dir0.5/fedavg/seed1: differs in 1 field(s)" in out
    assert "digits/dir0.5/fedavg/seed0: exact" in out and not any("local" in line for line in out)
    assert out[-1].endswith("1 of 2 cell(s) exact, 1 differ, 0 cannot be reproduced here")


def test_what_cannot_be_recomputed_here_is_said_in_the_cells_verdict(copy, capsys):
    run = copy / "runs/digits/dir0.5"
    _edit(run / "fedavg/seed0/provenance.json", lambda d: d["torch"].pop("num_threads"))
    if not torch.cuda.is_available():
        _edit(run / "fedavg/seed1/provenance.json", lambda d: d["device"].update(type="cuda", name="NVIDIA H100"))
    shutil.copytree(run / "local/seed0", run / "local/seed5")  # a cell's files copied into another cell's folder
    shutil.rmtree(copy.parent / "shards")
    rc, out, _ = _run(capsys, "verify", str(copy))
    assert rc == 3, out
    assert ("digits/dir0.5/fedavg/seed0: cannot reproduce here: provenance.json records no torch thread count "
            "(torch.num_threads), on which a cell's numbers depend (written by an older fedrepro)") in out
    if not torch.cuda.is_available():
        assert ("digits/dir0.5/fedavg/seed1: cannot reproduce here: recorded on CUDA (NVIDIA H100), and no CUDA GPU "
                "is visible here") in out
    pid = json.loads((run / "local/seed0/metrics.json").read_text())["cell"]["partition_id"]
    missing = [line for line in out if line.startswith("digits/dir0.5/local/seed0: ")]
    assert missing == [f"digits/dir0.5/local/seed0: cannot reproduce here: its shards {copy.parent}/shards/digits/{pid} "
                       "are missing (make them with the workflow: snakemake --cores 1 "
                       f"{copy.parent}/shards/digits/{pid} --configfile <the experiment's config>)"]
    assert ("digits/dir0.5/local/seed5: cannot reproduce here: provenance.json records the cell ['digits', 'dir0.5', "
            "'local', 0], not this folder's") in out
    assert out[-1].endswith("0 of 4 cell(s) exact, 0 differ, 4 cannot be reproduced here")


def _cell(label: str, seed: int = 0, sets: tuple[str, ...] = ()) -> dict:
    _, exp = load_and_resolve([REPO / "config" / "test.yaml"], sets)
    return next(c for c in exp["cells"] if (c["partition"], c["label"], c["seed"]) == ("dir0.5", label, seed))


def test_a_tuned_cell_is_recomputed_with_its_selected_values(copy, tmp_path, capsys):
    """provenance.json keeps the cell after `--tuned` applied the selection (a per_seed one here)."""
    runs = copy / "runs/digits/dir0.5"
    winner = {"id": "t1", "values": {"lr": 0.1}}
    selection = tmp_path / "selection.json"
    selection.write_text(json.dumps({"dataset": "digits", "partition": "dir0.5", "label": "fedavg", "winner": winner,
                                     "select": "per_seed", "winners_by_seed": {"seed1": winner}}))
    cell = _cell("fedavg", 1) | {"tuned": True}
    assert main(["train", "--cell", json.dumps(cell), "--shards", str(copy.parent / "shards/digits" / cell["partition_id"]),
                 "--out-dir", str(runs / "fedavg/seed1"), "--threads", "1", "--tuned", str(selection)]) == 0
    capsys.readouterr()
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "*/fedavg/seed1")
    assert rc == 0, out
    assert out[-2] == ("digits/dir0.5/fedavg/seed1: exact (identity.cell_key not recomputed: a tuned cell's key is the "
                       "hash of its cell before the selection)")
    _edit(runs / "fedavg/seed1/provenance.json", lambda d: d["cell"]["tuned"]["values"].update(lr=0.05))
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "*/fedavg/seed1")
    assert rc == 1 and "digits/dir0.5/fedavg/seed1: differs in" in out[-2]


def test_a_fine_tuning_row_scored_from_its_base_is_recomputed_by_training_it_in_full(copy, capsys):
    runs = copy / "runs/digits/dir0.5"
    # scored after the last round only, so derived from fedavg's final model (`fedrepro validate` says so)
    row, base = _cell("fedavg_ft", sets=("methods.fedavg_ft.training.personal_eval_every=3",)), _cell("fedavg")
    assert main(["finetune", "--cell", json.dumps(row), "--base-cell", json.dumps(base), "--final-model",
                 str(runs / "fedavg/seed0/final_model.pt"), "--shards", str(copy.parent / "shards/digits" / row["partition_id"]),
                 "--out-dir", str(runs / "fedavg_ft/seed0"), "--threads", "1"]) == 0
    capsys.readouterr()
    rc, out, _ = _run(capsys, "verify", str(copy), "--cells", "*/fedavg_ft/*")
    assert rc == 0, out
    assert out[-2] == ("digits/dir0.5/fedavg_ft/seed0: exact (a fine-tuning row scored from its base cell's final "
                       "model: recomputed by training it in full)")


@pytest.mark.parametrize("argv, needle", [
    (["{empty}"], "no trained cells"),
    (["{results}", "--cells", "digits/*/fedprox/*"], "argument --cells: 'digits/*/fedprox/*' matches none of the 3 cell(s)"),
    (["{results}", "--seed", "1"], "--seed goes with --sample"),
    (["{results}", "--sample", "0"], "argument --sample"),
    (["{missing}"], "{missing}"),
])
def test_bad_arguments_are_one_line(trained, tmp_path, capsys, argv, needle):
    (tmp_path / "empty").mkdir()
    paths = {"empty": tmp_path / "empty", "results": trained, "missing": tmp_path / "nothing"}
    rc, out, err = _run(capsys, "verify", *(a.format(**paths) for a in argv))
    assert rc == 2 and not out
    assert len(err.splitlines()) == 1 and err.startswith("fedrepro verify: error:") and needle.format(**paths) in err, err


def test_sample_draws_k_cells_reproducibly(trained):
    runs = choose(trained, None, None, 0)
    assert len(runs) == 3
    one = choose(trained, None, 2, 7)
    assert len(one) == 2 and set(one) <= set(runs) and choose(trained, None, 2, 7) == one
    assert {tuple(choose(trained, None, 1, s)) for s in range(20)} == {(r,) for r in runs}  # the seed changes the draw
    assert choose(trained, ["digits/dir0.5/local/*"], 5, 0) == [trained / "runs/digits/dir0.5/local/seed0"]


def test_only_timing_and_memory_fields_are_left_out_and_cuda_compares_within_its_tolerance():
    recorded = {"resources": {"wall_time_s": 1.0, "peak_rss_mb": 10.0, "resumed_from_round": 2, "device": "cuda:1"},
                "summary": {"acc": 0.5}, "communication": {"bytes_up_total": 100}, "curves": {"round": [1, 2]}}
    again = {"resources": {"wall_time_s": 9.0, "peak_rss_mb": 20.0, "resumed_from_round": 0, "device": "cuda:0"},
             "summary": {"acc": 0.5 * (1 + CUDA_REL_TOL / 2)}, "communication": {"bytes_up_total": 101},
             "curves": {"round": [1, 2, 3]}}
    assert {"resources.wall_time_s", "resources.peak_rss_mb", "resources.resumed_from_round"} <= UNCOMPARED
    assert list(diff(recorded, again)) == [("summary.acc", 0.5, again["summary"]["acc"], False),
                                           ("communication.bytes_up_total", 100, 101, False),
                                           ("curves.round", 2, 3, False)]
    assert [d[3] for d in diff(recorded, again, CUDA_REL_TOL)] == [True, False, False]  # integers stay exact
    assert repr(list(diff(recorded, again))[-1][1]) == "2 item(s)"
    assert [d[0] for d in diff({"a": 1, "identity": {"seed": 0}}, {"a": 2, "identity": {"seed": 1}})] == ["identity.seed", "a"]


# -- aggregate: a summary must be what its per-client scores give ---------------------------------

def _aggregate(capsys, results: Path) -> tuple[int, str]:
    paths = sorted(map(str, results.rglob("metrics.json")))
    out = [f"--{k}={results / k}.out" for k in ("csv", "json", "curves")]
    rc = main(["aggregate", *paths, *out])
    return rc, capsys.readouterr().err


def test_aggregate_accepts_the_summaries_training_wrote(trained, tmp_path, capsys):
    rc, err = _aggregate(capsys, trained)
    assert rc == 0, err
    for out in trained.glob("*.out"):
        out.unlink()


@pytest.mark.parametrize("label, field, edit", [
    ("fedavg", "summary.global_acc.mean", lambda d: d["summary"]["global_acc"].__setitem__("mean", 0.99)),
    ("local", "summary.personal_f1.weighted_mean", lambda d: d["final"]["personal"]["f1"].__setitem__(0, 0.0)),
    ("fedavg", "summary.global_acc.std", lambda d: d["summary"]["global_acc"].pop("std")),
], ids=["summary-edited", "per-client-score-edited", "statistic-removed"])
def test_aggregate_refuses_a_summary_that_contradicts_its_per_client_scores(copy, capsys, label, field, edit):
    metrics = copy / f"runs/digits/dir0.5/{label}/seed0/metrics.json"
    _edit(metrics, edit)
    rc, err = _aggregate(capsys, copy)
    assert rc == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("fedrepro aggregate: error:")]
    assert len(lines) == 1 and f"{metrics}: field '{field}' is " in lines[0], err
    assert "but the per-client scores it summarises" in lines[0] and "delete it and rerun" in lines[0]


def test_a_summary_without_its_per_client_scores_is_refused(trained):
    from fedrepro.custody import ResultsError

    doc = json.loads((trained / "runs/digits/dir0.5/fedavg/seed0/metrics.json").read_text())
    check_summaries(doc, "m.json")
    doc["final"]["global"]["acc"] = doc["final"]["global"]["acc"][:-1]
    with pytest.raises(ResultsError, match=r"^m.json: field 'final.global.acc' has 5 score\(s\) but 'clients.test_size' has 6"):
        check_summaries(doc, "m.json")
    doc["final"]["global"] = None
    with pytest.raises(ResultsError, match="^m.json: field 'summary.global_acc' has no per-client scores"):
        check_summaries(doc, "m.json")


def test_scores_after_training_are_checked_with_the_engines_weights(protocol_partition, tmp_path):
    """Unseen clients (weighted by their test sizes), the union and official test sets and the
    harmonic means (their clients weighted equally), as engine/record.py summarises them."""
    from fedrepro.custody import ResultsError

    doc = json.loads(json.dumps(run(protocol_partition, "fedavg_ft", tmp_path)))  # as metrics.json holds it
    kinds = {"unseen_global", "unseen_personal", "union_global", "union_personal", "union_hm", "official_hm"}
    assert kinds <= {k.rsplit("_", 1)[0] for k in doc["summary"]}
    check_summaries(doc, "m.json")
    for kind, weighted in [("union_hm", "weighted equally"), ("unseen_global", "weighted by clients.unseen_test_size")]:
        edited = json.loads(json.dumps(doc))
        edited["final"][kind]["acc"][0] = 1.0 - (edited["final"][kind]["acc"][0] or 0.0)
        with pytest.raises(ResultsError, match=rf"^m.json: field 'summary.{kind}_acc.\w+' is .*'final.{kind}.acc', {weighted}"):
            check_summaries(edited, "m.json")
