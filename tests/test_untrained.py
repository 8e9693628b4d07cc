"""One rule for clients that have not trained yet (`evaluation.untrained`), the same for every
method: each test fails if the rule is dropped, applied to some methods only, or leaks into
training."""

from __future__ import annotations

import pytest
import torch
import yaml

from fedrepro.config import load_config, resolve_experiment
from fedrepro.engine import evaluation
from fedrepro.engine.engine import UNTRAINED_RULES, sampling_schedule, trained_rounds
from fedrepro.methods import METHODS
from fedrepro.planning import untrained_warnings
from fedrepro.registry import ConfigError
from fedrepro.report.aggregate import summary_frame
from fedrepro.report.tables import untrained_note

from conftest import REPO, fit_cell_to_method, tiny_config
from test_engine import engine_for


def run(make_cell, shards, method, rule):
    """A cell where one client trains per round for two rounds, so some of the 4 never train."""
    cell = make_cell("fedavg", participation=1, rounds=2)
    cell.update(method=method, label=method, hparams={k: p.default for k, p in METHODS.get(method).hparams.items()},
                evaluation={"untrained": rule})
    eng = engine_for(fit_cell_to_method(cell, method), shards)
    return eng, eng.run()


def split(metrics):
    rounds = metrics["clients"]["trained_rounds"]
    return [i for i, r in enumerate(rounds) if r], [i for i, r in enumerate(rounds) if not r]


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_scores_untrained_clients_by_the_one_rule(tiny_partition, make_cell, method):
    shards = tiny_partition[0]
    has_personal = METHODS.get(method).has_personal
    out = {rule: run(make_cell, shards, method, rule) for rule in UNTRAINED_RULES}
    eng, m = out["initial"]
    trained, untrained = split(m)
    assert untrained and trained and m["clients"]["untrained"] == len(untrained)
    schedule = sampling_schedule(len(eng.clients), 1, 2, eng.seed)
    assert m["clients"]["trained_rounds"] == [v for v in trained_rounds(schedule, m["clients"]["ids"]).values()]
    for rule, (eng, m) in out.items():
        how = m["clients"]["scored_by"]
        assert m["clients"]["untrained_rule"] == rule
        assert all(how[i] == "trained" for i in trained)
        want = "excluded" if rule == "exclude" else rule if has_personal else "global"
        assert all(how[i] == want for i in untrained)
        assert all(eng.clients[i].state == {} for i in untrained), "scoring an untrained client left state behind"
        # the rule never changes training: the trained clients' scores are the same under every rule
        for kind in ("global", "personal"):
            if m["final"][kind] is not None:
                ref = out["initial"][1]["final"][kind]["acc"]
                assert [m["final"][kind]["acc"][i] for i in trained] == [ref[i] for i in trained], (rule, kind)
    # initial: the personal column of an untrained client is the seeded initial model's score
    eng, m = out["initial"]
    if has_personal:
        for i in untrained:
            c = eng.clients[i]
            assert m["final"]["personal"]["acc"][i] == pytest.approx(float((evaluation.predict(eng, eng.initial_params, c.test.x) == c.test.y.numpy()).mean()))
    # exclude: no score, and the aggregates are over the trained clients only
    eng, m = out["exclude"]
    sizes = m["clients"]["test_size"]
    for kind in ("global", "personal"):
        if m["final"][kind] is not None:
            acc = m["final"][kind]["acc"]
            assert all(acc[i] is None for i in untrained)
            mean = sum(acc[i] * sizes[i] for i in trained) / sum(sizes[i] for i in trained)
            assert m["summary"][f"{kind}_acc"]["weighted_mean"] == pytest.approx(mean)


def test_personalize_scores_the_methods_new_client_personalization(tiny_partition, make_cell):
    """For a personalized method, an untrained client is scored with `personalize_unseen`: one local
    update from the broadcast (here Local: one epoch from the initial model), not the initial model."""
    eng, m = run(make_cell, tiny_partition[0], "local", "personalize")
    _, untrained = split(m)
    c = eng.clients[untrained[0]]
    params = evaluation.personal_model(eng, c, "personalize")
    assert c.state == {}
    acc = float((evaluation.predict(eng, params, c.test.x) == c.test.y.numpy()).mean())
    assert m["final"]["personal"]["acc"][untrained[0]] == pytest.approx(acc)
    assert not all(torch.equal(params[k], eng.initial_params[k]) for k in params)


def test_unknown_rule_is_rejected_before_any_job():
    cfg = tiny_config()
    cfg["evaluation"] = {"untrained": "global"}
    with pytest.raises(ConfigError, match=r"evaluation.untrained.*'global'.*personalize"):
        resolve_experiment(cfg)
    cfg["evaluation"] = {"untrained": "exclude"}
    assert {c["evaluation"]["untrained"] for c in resolve_experiment(cfg)["cells"]} == {"exclude"}


def test_validate_warns_when_a_config_leaves_clients_untrained():
    cfg = load_config(REPO / "config/experiments/baselines_fmnist_quick.yaml")
    cfg["training"].update(participation=0.25, rounds=8)
    cfg["seeds"] = [0]
    lines = untrained_warnings(resolve_experiment(cfg))
    assert len(lines) == 1 and "2 of 20 training clients never train" in lines[0] and "positions [6, 7]" in lines[0]
    cfg["training"].update(participation=1.0, rounds=1)
    assert untrained_warnings(resolve_experiment(cfg)) == []


def test_tables_footnote_the_untrained_clients(tiny_partition, make_cell):
    _, m = run(make_cell, tiny_partition[0], "fedavg", "personalize")
    note = untrained_note(summary_frame([m]))
    assert f"{m['clients']['untrained']} of 4" in note and "'personalize'" in note
    cell = make_cell("fedavg")  # every client every round
    cell["evaluation"] = {"untrained": "exclude"}
    full = engine_for(cell, tiny_partition[0]).run()
    assert untrained_note(summary_frame([full])) == "Every client trained in every cell (evaluation.untrained = 'exclude' was not needed)."


@pytest.mark.slow
def test_snakemake_prints_the_validate_warnings_once(tmp_path):
    """participation: 1 (one client per round) leaves clients untrained: Snakemake's parse prints the
    warning `fedrepro validate` prints (the same function), once, on stderr, before any job."""
    import os
    import subprocess
    import sys

    cfg = load_config(REPO / "config/test.yaml")
    cfg["partitions"] = {"pat2": cfg["partitions"]["pat2"]}
    cfg["methods"], cfg["seeds"] = {"fedavg": {}}, [0]
    cfg["training"].update(participation=1, rounds=2)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    expected = untrained_warnings(resolve_experiment(cfg))
    assert len(expected) == 1 and "4 of 6 training clients never train" in expected[0]
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                           "-n", "--configfile", "c.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"fedrepro: warning: {expected[0]}\n") == 1, proc.stderr[-3000:]
