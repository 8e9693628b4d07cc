"""Readings ledgers (fedrepro.report.readings): validation, the effect math (differences, paired
tests, verdicts, flips) on constructed values, --record on a tiny results folder, the docs
markers, and that every [RECON] / [PAPER≠CODE] mark of a seed method is in its ledger."""

from __future__ import annotations

import copy

import pytest
import yaml
from scipy import stats as sps

from conftest import REPO
from fedrepro.cli import main
from fedrepro.io import write_json_atomic
from fedrepro.methods import METHODS
from fedrepro.registry import ConfigError
from fedrepro.report import readings as rd
from test_papers import metrics, snakemake

Q_DEFAULT = METHODS.entry("qffl").params["q"].default

PAPER = {
    "paper": {"id": "toy", "short": "Toy", "title": "A toy paper", "source": "none", "proposed": ["qffl"]},
    "names": {"method": {"fedavg": "FedAvg", "qffl": "q-FFL", "local": "Local"}},
    "metrics": {"acc": {"name": "Acc. (%)", "better": "higher", "unit": "percent", "decimals": 2}},
    "tables": {"t1": {"title": "Table 1", "caption": "toy", "rows": [{"method": ["qffl", "fedavg", "local"]}],
                      "columns": {"header": ["setting"], "groups": [{"dataset": "d", "setting": "s", "metric": "acc"}]},
                      # the paper's baselines in RUNS' order (FedAvg above Local): the regime check agrees
                      "cells": [{"method": "fedavg", "dataset": "d", "setting": "s", "metric": "acc", "value": 62.0},
                                {"method": "local", "dataset": "d", "setting": "s", "metric": "acc", "value": 50.0}]}},
}
EXPERIMENT = {
    "experiment": "toy",
    "datasets": {"digits": {"model": {"name": "mlp", "params": {"hidden": [8]}}}},
    "partitions": {"dir": {"partitioner": "dirichlet", "num_clients": 4, "seed": 0, "params": {"alpha": 0.5}}},
    "methods": {"fedavg": {}, "local": {}, "qffl": {}, "qffl_q5": {"method": "qffl", "hparams": {"q": 5.0}}},
    "seeds": [0, 1, 2],
    "training": {"rounds": 2, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.05}},
    "paper_tables": {"paper": "toy", "reduced": True, "tables": {"t1": {
        "kind": ["global", "personal"], "datasets": {"d": "digits"}, "settings": {"s": "dir"},
        "metrics": {"acc": "acc_weighted_mean"}}}},
}
LEDGER = {
    "paper": "toy",
    "methods": ["qffl"],
    "headline": {"experiment": "config/papers/toy_cpu.yaml", "table": "t1", "metric": "acc", "proposed": "qffl",
                 "fedavg": "fedavg", "baselines": ["fedavg", "local"]},
    "readings": [{"id": "qffl.q", "mark": "RECON", "question": "the fairness power", "paper": '"q" (§4)',
                  "code": "q = 1", "options": {str(Q_DEFAULT): "the code's", "5.0": "a fairer one"}, "default": Q_DEFAULT,
                  "why": "the code's value", "effects": [{"option": 5.0, "label": "qffl_q5"}]},
                 {"id": "qffl.loss_at", "mark": ["RECON", "PAPER≠CODE"], "question": "which loss", "paper": "F_k",
                  "code": "start", "options": {"start": "before training", "train": "while training"},
                  "default": "start", "why": "q-FFL's F_k(w^t)", "not_measured": "pending: no label runs it here"}],
}
# per label, accuracy (fraction) of seeds 0, 1, 2
RUNS = {"qffl": [0.70, 0.72, 0.74], "fedavg": [0.60, 0.61, 0.65], "local": [0.50, 0.55, 0.52],
        "qffl_q5": [0.55, 0.58, 0.56]}


def make_repo(tmp_path, ledger=None, measured=None):
    """A repository with the toy paper, its experiment and its ledger; returns the ledger path."""
    pub = tmp_path / "config" / "papers" / "published"
    (pub / "readings").mkdir(parents=True)
    (pub / "toy.yaml").write_text(yaml.safe_dump(PAPER, allow_unicode=True))
    (tmp_path / "config" / "papers" / "toy_cpu.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    doc = copy.deepcopy(ledger or LEDGER)
    if measured is not None:
        doc["measured"] = {"source": "results/toy", "date": "2026-01-01", "seeds": [0, 1, 2], "column": "acc_weighted_mean",
                           "labels": {k: {str(i): x for i, x in enumerate(v)} for k, v in measured.items()}}
    path = pub / "readings" / "toy.yaml"
    path.write_text("# the toy ledger\n" + yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    return path


def write_results(root, runs=RUNS, skip=()):
    """root/results/toy/runs/... with one metrics.json per (label, seed) of `runs` but those in `skip`."""
    results = root / "results" / "toy"
    for label, accs in runs.items():
        for seed, acc in enumerate(accs):
            if (label, seed) in skip:
                continue
            method = "qffl" if label.startswith("qffl") else label
            kinds = {"personal": acc - 0.1} if label == "local" else {"global": acc}
            write_json_atomic(results / "runs" / "digits" / "dir" / label / f"seed{seed}" / "metrics.json",
                              {**metrics("digits", "dir", label, seed, kinds, method),
                               "cell": {"experiment": "toy", "dataset": "digits", "partition": "dir", "partition_id": "0",
                                        "method": method, "label": label, "model": "mlp", "seed": seed}})
    return results


# ---------------------------------------------------------------------------------------------
# validation


def test_a_valid_ledger_loads(tmp_path):
    ledger = rd.load_ledger(make_repo(tmp_path))
    assert [r.id for r in ledger.readings] == ["qffl.q", "qffl.loss_at"]
    assert ledger.readings[1].marks == ("RECON", "PAPER≠CODE") and ledger.measured is None
    assert {n: (t.label, t.dataset, t.partition) for n, t in ledger.targets.items()} == {
        n: (n, "digits", "dir") for n in ("qffl", "fedavg", "local", "qffl_q5")}


def _edit(path, edit):
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(paper="nope"), "key 'paper' has value 'nope': no published file"),
    (lambda d: d.update(methods=["qffl", "nosuch"]), "'nosuch', which is not a registered method"),
    (lambda d: d["readings"][0].update(id="qffl.nosuch"), "'nosuch' is not a hyper-parameter of qffl; allowed: qffl.q"),
    (lambda d: d["readings"][0].update(id="fedavg.q"), "allowed: <method>.<hparam> with a method of the ledger's"),
    (lambda d: d["readings"][0].update(default=3.0), "key 'default' has value 3.0; allowed: one of the options"),
    (lambda d: d["readings"][0].update(options={"3.0": "a", "5.0": "b"}, default=3.0), "but qffl's q defaults to"),
    (lambda d: d["readings"][0].update(mark="GUESS"), "key 'mark' has value 'GUESS'; allowed: RECON, PAPER≠CODE"),
    (lambda d: d["readings"][0]["effects"][0].update(label="ghost"), "'ghost', which is not a method label"),
    (lambda d: d["readings"][0]["effects"][0].update(label="fedavg"), "which runs fedavg with q = None; allowed: a label "
                                                                      "running qffl with q: 5.0"),
    (lambda d: d["readings"][0]["effects"][0].update(option=Q_DEFAULT), "allowed: an option other than the one the "
                                                                         "stand-in runs: ['5.0']"),
    (lambda d: d["readings"][0].update(stand_in=Q_DEFAULT), "key 'stand_in' has value 1.0; allowed: the option the "
                                                             "headline stand-in runs where it is not the default: ['5.0']"),
    (lambda d: d["readings"][0].update(stand_in=5.0), "effects[0]: key 'option' has value 5.0; allowed: an option other "
                                                      f"than the one the stand-in runs: ['{Q_DEFAULT}']"),
    (lambda d: d["readings"][1].pop("not_measured"), "key 'not_measured' has value None"),
    (lambda d: d["readings"][1].update(not_measured="not this session"),
     "key 'not_measured' has value 'not this session'; allowed: 'cannot act: ' and why"),
    (lambda d: d["readings"][1].pop("why"), "missing key(s) ['why']"),
    (lambda d: d["headline"].update(table="t9"), "key 'table' has value 't9'; allowed: t1"),
    (lambda d: d["headline"].update(metric="f1"), "key 'metric' has value 'f1'; allowed: a metric of Toy Table 1: acc"),
    (lambda d: d["headline"].update(baselines=["fedavg", "qffl_q5"]), "key 'baselines' names 'qffl_q5', which has 0 cells"),
    (lambda d: d.update(measured={"labels": {"qffl": [0.7]}}), "labels.qffl has value [0.7]; allowed: {seed: value}"),
    (lambda d: d.update(measured={"labels": {}, "changes": {"qffl": {"0": 0.1}}}),
     "changes.qffl has value {'0': 0.1}; allowed: {seed: [round before, last round, change]}"),
])
def test_validation_errors_name_file_key_value_and_allowed(tmp_path, edit, message):
    path = make_repo(tmp_path)
    _edit(path, edit)
    with pytest.raises(ConfigError) as err:
        rd.load_ledger(path)
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------
# the effect math


def test_differences_paired_tests_verdicts_and_flips(tmp_path):
    ledger = rd.load_ledger(make_repo(tmp_path, measured=RUNS))
    assert rd.strongest(ledger) == "fedavg"
    default = rd.side(ledger, "qffl", "fedavg")
    assert default.stats.mean == pytest.approx(72.0) and default.stats.n == 3
    want = sps.ttest_rel([70, 72, 74], [60, 61, 65])
    assert default.vs_best.mean_diff == pytest.approx(10.0) and default.vs_best.p == pytest.approx(want.pvalue)
    assert default.verdict.startswith("holds: above the strongest baseline (Holm p < 0.05)")
    option = rd.side(ledger, "qffl_q5", "fedavg")
    assert option.vs_fedavg.mean_diff == pytest.approx(-17 / 3)
    assert option.verdict.startswith("contradicted: below the strongest baseline" if option.p_holm < 0.05
                                      else "not shown against the strongest baseline (Holm p ≥ 0.05)")
    assert rd.flips(default, option) == "yes"
    md = rd.to_markdown(ledger)
    assert "`qffl.q`" in md and "5.0 (`qffl_q5`): 56.33 ± 1.53 (n=3)" in md and "5.0: yes" in md
    assert "not measured: pending: no label runs it here" in md and "**start: before training**" in md
    assert "<td><code>qffl.q</code>" in rd.to_html(ledger)


def test_a_stand_in_departing_from_the_default_is_measured_against_it(tmp_path):
    """GRP-FED's λ: the stand-in runs the value its tuning selects, not the registered default, so the
    default is an alternative measured against what the stand-in runs, and the table bolds the latter."""
    ledger = copy.deepcopy(LEDGER)
    ledger["readings"][0].update(stand_in=5.0, effects=[{"option": Q_DEFAULT, "label": "qffl_registered"}])
    path = make_repo(tmp_path, ledger=ledger, measured={**RUNS, "qffl_registered": [0.60, 0.62, 0.64]})
    experiment = copy.deepcopy(EXPERIMENT)  # the headline's qffl runs q = 5, a label the registered q
    experiment["methods"].update(qffl={"hparams": {"q": 5.0}}, qffl_registered={"method": "qffl"})
    experiment["methods"]["qffl_q5"]["hparams"]["q"] = 6.0  # not the same cells as qffl
    (tmp_path / "config" / "papers" / "toy_cpu.yaml").write_text(yaml.safe_dump(experiment))
    ledger = rd.load_ledger(path)
    reading = ledger.readings[0]
    assert (reading.default, reading.stand_in, reading.runs) == (str(Q_DEFAULT), "5.0", "5.0")
    md = rd.to_markdown(ledger)
    assert "**5.0: a fairer one**" in md and f"**{Q_DEFAULT}:" not in md
    assert f"{Q_DEFAULT} (registered; the stand-in runs 5.0): the code's value" in md
    assert f"{Q_DEFAULT} (`qffl_registered`): 62.00 ± 2.00 (n=3)" in md  # the registered default, the alternative


def test_undefined_tests_and_lower_is_better(tmp_path):
    runs = {"qffl": [0.70, 0.72, 0.74], "fedavg": [0.60, 0.62, 0.64], "local": [0.1, 0.1, 0.1], "qffl_q5": [0.5]}
    ledger = rd.load_ledger(make_repo(tmp_path, measured=runs))
    default = rd.side(ledger, "qffl", "fedavg")
    assert default.verdict == "not judged (all differences equal)" and default.vs_best.test == "none"
    option = rd.side(ledger, "qffl_q5", "fedavg")
    assert option.verdict == "not judged (1 common seed(s): no test)" and rd.flips(default, option) == "n/a"
    assert "n/a (1 common seed(s): no test)" in rd.to_markdown(ledger)
    ledger.paper.metrics["acc"] = rd.Metric("acc", "Error", "lower", "percent")
    assert rd.strongest(ledger) == "local"
    assert rd.verdict(rd.paired_test({0: 1.0, 1: 2.0, 2: 3.5}, {0: 2.0, 1: 3.1, 2: 4.0}), "lower") == \
        "holds: above the strongest baseline (Holm p < 0.05)"


def test_unmeasured_ledger_says_how_to_measure(tmp_path):
    md = rd.to_markdown(rd.load_ledger(make_repo(tmp_path)))
    assert "Not measured yet: `fedrepro readings toy --record" in md and "5.0 (`qffl_q5`): not measured yet" in md


# ---------------------------------------------------------------------------------------------
# --record


def test_record_writes_only_the_measured_block(tmp_path, capsys):
    path = make_repo(tmp_path)
    results = write_results(tmp_path, skip={("local", 2)})
    before = path.read_text()
    # local's seed 2 was not run: named, and recorded without it only when told to skip (issue 46)
    assert main(["readings", "toy", "--ledger", str(path), "--record", str(results)]) == 2
    assert "cannot read local seed 2" in capsys.readouterr().err and path.read_text() == before
    assert main(["readings", "toy", "--ledger", str(path), "--record", str(results), "--skip-unreadable",
                 "--md", str(tmp_path / "r.md")]) == 0
    assert "skipped local seed 2" in capsys.readouterr().err
    after = path.read_text()
    assert after.startswith(before) and after[len(before):].startswith("measured:\n  # written by")
    doc = yaml.safe_load(after)["measured"]
    assert doc["labels"]["qffl"] == {"0": 0.7, "1": 0.72, "2": 0.74} and doc["labels"]["local"] == {"0": 0.4, "1": 0.45}
    assert doc["kinds"] == {"qffl": "global", "fedavg": "global", "local": "personal", "qffl_q5": "global"}
    assert doc["column"] == "acc_weighted_mean" and doc["seeds"] == [0, 1, 2]
    # the last change of each headline cell's curve (the fixture's rises by 0.1 a round): not converged
    assert doc["changes"]["qffl"] == {str(s): [2, 3, 0.1] for s in range(3)} and list(doc["changes"]["local"]) == ["0", "1"]
    assert rd.side(rd.load_ledger(path), "qffl", "fedavg").verdict == "not judged: regime unchecked; not converged: ordering not judged"  # the moving baseline leaves the check (issue 56)
    assert "`qffl.q`" in (tmp_path / "r.md").read_text()
    # a second record replaces the block, nothing else
    assert main(["readings", "toy", "--ledger", str(path), "--record", str(results), "--skip-unreadable"]) == 0
    assert path.read_text() == after
    with pytest.raises(ConfigError, match="allowed: measured: as the last top-level key"):
        rd.replace_measured(after + "extra: 1\n", {"labels": {}})


def test_record_without_results_is_an_error(tmp_path, capsys):
    path = make_repo(tmp_path)
    assert main(["readings", "toy", "--ledger", str(path), "--record", str(tmp_path / "none")]) == 2
    assert "no metrics.json of the ledger's labels" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# docs/papers.md and the marks in the source


def test_docs_markers():
    doc = f"intro\n{rd.DOCS_BEGIN}\nold\n{rd.DOCS_END}\nrest\n"
    assert rd.replace_between_markers(doc, "new\n") == f"intro\n{rd.DOCS_BEGIN}\n\nnew\n\n{rd.DOCS_END}\nrest\n"
    with pytest.raises(ConfigError, match="needs the markers"):
        rd.replace_between_markers("no markers", "x")


def test_docs_papers_md_shows_the_committed_ledgers():
    docs = REPO / "docs" / "papers.md"
    text = docs.read_text()
    assert text == rd.replace_between_markers(text, rd.docs_markdown(REPO)), \
        "docs/papers.md is out of date with the ledgers: run `fedrepro readings --docs docs/papers.md`"


def test_marked_lines_outside_param_docs():
    source = ('x = 1  # `lam` [RECON] and `q: 2` [PAPER≠CODE, code form]\n'
              'P = Param(1, "[RECON] a doc\\n"\n'
              '          "on two lines")\n'
              '"""[RECON: prose] without names"""\n')
    assert rd.marked_lines(source) == [(1, {"RECON", "PAPER≠CODE"}, ["lam", "q"]), (4, {"RECON"}, [])]


@pytest.mark.parametrize("paper", rd.seed_papers(REPO))
def test_every_seed_paper_has_a_valid_ledger(paper):
    path = rd.ledger_path(paper, REPO)
    assert path.is_file(), f"{path.relative_to(REPO)}: no readings ledger for {paper}"
    rd.load_ledger(path)  # its labels against the headline experiment too


@pytest.mark.parametrize("paper", rd.seed_papers(REPO))
def test_every_mark_of_a_seed_method_is_in_its_ledger(paper):
    path = rd.ledger_path(paper, REPO)
    assert path.is_file(), f"{path.relative_to(REPO)}: no readings ledger for {paper}"
    violations = rd.mark_violations(rd.load_ledger(path, resolve=False))
    assert not violations, f"{len(violations)} mark(s) not in the ledger:\n" + "\n".join(violations)


def test_the_paper_targets_render_the_ledger(tmp_path):
    config = str(REPO / "config" / "papers" / "fedcrc_cpu.yaml")
    text = snakemake("-n", "fedcrc_table1", "--configfile", config, cwd=tmp_path)
    has = rd.ledger_path("fedcrc", REPO).is_file()
    assert ("rule paper_readings" in text) == has and ("results/fedcrc_cpu/paper/readings.html" in text) == has


def test_entries_not_yet_measured_are_listed_and_refused_by_complete(tmp_path, capsys):
    """An entry counts as measured over >= 3 seeds of each alternative, or says why it cannot act."""
    path = make_repo(tmp_path, measured=RUNS)
    ledger = rd.load_ledger(path)
    assert rd.incomplete(ledger) == ["qffl.loss_at: pending: no label runs it here"]
    assert main(["readings", "--check", "--ledger", str(path)]) == 0
    assert "1 entry(ies) not yet measured" in capsys.readouterr().out
    assert main(["readings", "--check", "--complete", "--ledger", str(path)]) == 2
    assert "qffl.loss_at: pending: no label runs it here" in capsys.readouterr().err
    # an alternative measured over two seeds is not yet measured either
    two = {k: v[:2] for k, v in RUNS.items()}
    assert "measured over 2 seed(s); allowed: at least 3" in rd.incomplete(rd.load_ledger(make_repo(tmp_path / "b", measured=two)))[0]
    # cannot act on the stand-in: complete
    _edit(path, lambda d: d["readings"][1].update(not_measured="cannot act: the stand-in has one local epoch"))
    assert rd.incomplete(rd.load_ledger(path)) == []
    assert main(["readings", "--check", "--complete", "--ledger", str(path)]) == 0


#: the ledgers whose every entry is measured over at least 3 seeds or cannot act on the stand-in (issue 45)
COMPLETE_LEDGERS = ("calibre", "fedcrc", "fedcosr", "fedgcr", "grp_fed")


@pytest.mark.parametrize("paper", COMPLETE_LEDGERS)
def test_complete_ledgers_have_no_entry_left_to_measure(paper):
    ledger = rd.load_ledger(rd.ledger_path(paper))
    assert rd.incomplete(ledger) == []
    for r in ledger.readings:
        assert r.effects or r.not_measured.startswith((rd.CANNOT_ACT, rd.FAILS)), r.id


def test_an_alternative_whose_every_run_failed_counts_as_measured(tmp_path):
    """A reading that diverges on the stand-in (FedGCR's unnormalised sum) has no score to compare: its
    entry says so with `fails:` and is not left to measure; a bare reason is still refused."""
    path = make_repo(tmp_path)
    _edit(path, lambda d: d["readings"][1].update(not_measured="fails: every seed diverges in round 3"))
    ledger = rd.load_ledger(path)
    assert ledger.readings[1].not_measured.startswith(rd.FAILS)
    assert not any(line.startswith("qffl.loss_at") for line in rd.incomplete(ledger))
    _edit(path, lambda d: d["readings"][1].update(not_measured="it diverges"))
    with pytest.raises(ConfigError, match="'fails: ' and how every run of the alternative failed on it"):
        rd.load_ledger(path)
