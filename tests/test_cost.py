"""The cost model (fedrepro.cost), the calibration cache (fedrepro.calibration), what validate and
`cells --cost` print, and the SLURM time limits from the estimates (fedrepro.planning.RuntimeLimits)."""

from __future__ import annotations

import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO, tiny_config
from fedrepro import calibration, cost, planning
from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.methods import METHODS
from fedrepro.registry import ConfigError


def cell_of(exp: dict, label: str) -> dict:
    return next(c for c in exp["cells"] if c["label"] == label)


def work(tmp_path, label: str = "fedavg", methods: dict | None = None, **training) -> cost.Work:
    """The work of `label`'s cell of tiny_config with `training`, clients sized by the dataset's count
    (no shards under tmp_path)."""
    config = tiny_config(**training)
    if methods is not None:
        config["methods"] = methods
    exp = resolve_experiment(config)
    return cost.Estimator(exp, shards_root=tmp_path).work(cell_of(exp, label))


def fake_calibration(root, spec: calibration.ModelSpec, threads: int = 1, device: str = "cpu: test",
                     train: float = 1.0, forward: float = 1e-3, head: float = 1e-2, startup: float = 5.0,
                     client_round: float = 0.0) -> dict:
    path = calibration.calibration_path(device, threads, "9.9", root)
    header = {"device": device, "threads": threads, "torch": "9.9", "startup_s": startup, "client_round_s": client_round}
    return calibration.save_entry(path, header, spec.key, {"train_step_s": train, "forward_sample_s": forward,
                                                           "head_step_s": head})


# -- the estimate grows as it must ---------------------------------------------------------------------

def test_training_work_grows_with_rounds_participation_epochs_and_shrinks_with_the_batch(tmp_path):
    base = work(tmp_path, rounds=2, eval_every=1)
    assert base.train_steps > 0 and not base.derived
    assert work(tmp_path, rounds=4, eval_every=1).train_steps == 2 * base.train_steps  # full participation: exact
    assert work(tmp_path, rounds=2, eval_every=1, local_epochs=3).train_steps == 3 * base.train_steps
    half = work(tmp_path, rounds=2, eval_every=1, participation=0.5)  # 2 of the 4 equal clients a round
    assert half.train_steps == base.train_steps / 2
    bigger = work(tmp_path, rounds=2, eval_every=1, batch_size=64)
    assert bigger.train_steps < base.train_steps
    assert bigger.spec.batch_size == 64 and bigger.spec.key != base.spec.key  # timed at its own batch size
    # evaluation: every eval_every rounds over the test and validation splits
    assert work(tmp_path, rounds=4, eval_every=1).forward_samples == 2 * work(tmp_path, rounds=4, eval_every=2).forward_samples


def test_a_methods_declared_passes_enter_the_estimate(tmp_path, monkeypatch):
    methods = {"fedavg": {}, "ditto": {}, "pfedme": {"hparams": {"K": 3}}, "fedrep": {"hparams": {"head_epochs": 3}}}
    fedavg, ditto, pfedme, fedrep = (work(tmp_path, m, methods) for m in methods)
    assert ditto.train_steps == 2 * fedavg.train_steps  # personal epochs beside the local ones
    assert pfedme.train_steps == 3 * fedavg.train_steps  # K inner steps a batch
    assert fedrep.train_steps == pytest.approx(2 * fedavg.train_steps)  # 3 head epochs at a forward each + 1 body epoch
    monkeypatch.setattr(METHODS.get("fedavg"), "cost_passes", 3.0)  # the declared attribute is what is read
    assert work(tmp_path, "fedavg", methods).train_steps == 3 * fedavg.train_steps


def test_every_method_declares_a_cost_under_its_defaults():
    training = {"local_epochs": 2, "rounds": 10}
    for entry in METHODS:
        hp = {k: p.default for k, p in entry.params.items()}
        passes, personal = entry.obj.cost_passes_for(hp, training), entry.obj.cost_personal_for(hp, training)
        assert passes.model >= 0 and passes.head >= 0 and personal.train_epochs >= 0 and personal.head_epochs >= 0, entry.name


def test_personalization_and_derived_rows(tmp_path):
    every_round = work(tmp_path, "fedavg_ft", rounds=2, eval_every=1)
    plain = work(tmp_path, "fedavg", rounds=2, eval_every=1)
    assert every_round.head_steps > 0 and plain.head_steps == 0  # the head fine-tuning of each personal scoring
    assert every_round.train_steps == plain.train_steps and not every_round.derived
    # scored only after the last round: a row derived from fedavg's final model, its scoring alone
    derived = work(tmp_path, "fedavg_ft", rounds=2, eval_every=1, personal_eval_every=2)
    assert derived.derived and derived.train_steps == 0 and 0 < derived.head_steps < every_round.head_steps


def test_seconds_follow_the_calibration_and_the_manifest_sizes(tiny_partition, tmp_path):
    shards, exp = tiny_partition
    cell = cell_of(exp, "fedavg")
    from_manifest = cost.Estimator(exp, shards_root=shards.parent.parent).sizes  # results/shards/<dataset>/<id>
    (tmp_path / "digits").mkdir()
    os.symlink(shards, tmp_path / "digits" / shards.name)
    sizes = cost.Estimator(exp, shards_root=tmp_path).sizes("digits", "dir")
    assert sizes.source == "manifest" and len(sizes.clients) == 4
    assert from_manifest("digits", "dir").source == "estimate"  # no <dataset> folder level there
    w = cost.Estimator(exp, shards_root=tmp_path).work(cell)
    cal = fake_calibration(tmp_path / "cal", w.spec, train=0.5, forward=0.01, head=0.1, startup=2.0, client_round=0.25)
    assert w.client_rounds == exp["cells"][0]["training"]["rounds"] * 4  # every one of the 4 clients, every round
    assert w.seconds(cal) == pytest.approx(2.0 + 0.5 * w.train_steps + 0.1 * w.head_steps + 0.01 * w.forward_samples
                                           + 0.25 * w.client_rounds)
    assert w.seconds({**cal, "client_round_s": None}) == pytest.approx(w.seconds(cal) - 0.25 * w.client_rounds)  # an older file
    assert w.seconds({**cal, "models": {}}) is None  # a model the calibration lacks: no estimate
    assert cost.wall_seconds([3, 3, 2, 2], 2) == 5 and cost.wall_seconds([3, 3, 2, 2], 1) == 10


def test_estimated_sizes_keep_only_the_scarce_clients_fraction(tmp_path):
    """Before a partition is written, the sizes come from the dataset's count; scarce clients keep their
    fraction there as in the shards (fedcosr_cpu's 3 %: without it its estimate was 43.8 h, not 74 min)."""
    from fedrepro.data.dataset_registry import load_dataset
    from fedrepro.data.shards import resolve_partition_spec, unseen_client_ids, write_partition

    base = {"dataset": "digits", "partitioner": "iid", "num_clients": 6, "unseen_clients": 1, "seed": 0}
    scarce = {**base, "scarcity": {"clients": [0, 1, 2], "fraction": [0.2, 0.4]}}
    full, cut = (cost.estimated_sizes(resolve_partition_spec(s)) for s in (base, scarce))
    assert len(full.clients) == len(cut.clients) == 5 and cut.source == "estimate"
    unseen = set(unseen_client_ids(resolve_partition_spec(scarce)))
    trained = [cid for cid in range(6) if cid not in unseen]
    for cid, (whole, kept) in zip(trained, zip(full.clients, cut.clients)):
        assert kept[0] == pytest.approx(whole[0] * (0.3 if cid < 3 else 1.0), abs=1)
    write_partition(load_dataset("digits", tmp_path / "raw"), scarce, tmp_path / "shards")
    written = cost.manifest_sizes(tmp_path / "shards")
    assert sum(c[0] for c in written.clients) == pytest.approx(sum(c[0] for c in cut.clients), rel=0.15)


def test_held_out_clients_add_their_scoring_update_and_personalization(tmp_path):
    """After the last round the job scores the unseen clients with the global model and, for a method
    with personalized models, runs one local update and its personalization on each (engine.beyond);
    a method without a global model also makes every training client's personal model once more."""
    exp = resolve_experiment(tiny_config(rounds=2, eval_every=2))
    train = ((100, 25, 10),) * 4
    held = ((60, 20, 0), (40, 10, 0))
    alone, with_unseen = cost.Sizes(train, "manifest"), cost.Sizes(train, "manifest", held)

    def both(label):
        cell = cell_of(exp, label)
        return cost.cell_work(cell, alone, exp["datasets"]), cost.cell_work(cell, with_unseen, exp["datasets"])

    before, after = both("fedavg")  # a global model only: its scoring on the 30 unseen test samples
    assert (after.train_steps, after.head_steps) == (before.train_steps, before.head_steps)
    assert after.forward_samples - before.forward_samples == 30
    before, after = both("fedavg_ft")  # global and personal scoring, one local update, the head's fine-tuning
    update = sum(cost.local_steps(n, 16, 1) for n, _, _ in held)
    assert after.train_steps - before.train_steps == update
    assert after.head_steps - before.head_steps == sum(cost.local_steps(n, 32, 1) for n, _, _ in held)
    assert after.forward_samples - before.forward_samples == 2 * 30 + 100  # and the features of their train splits
    exp["cells"].append({**cell_of(exp, "local"), "label": "linear", "method": "local_linear",
                         "hparams": {"epochs": 10, "lr": 0.05, "momentum": 0.9, "batch_size": 32, "tol": 1e-4, "max_epochs": 500}})
    before, after = both("linear")  # no global model: the unseen clients' global score is the mean of the
    fits = [cost.local_steps(n, 32, 10) for n in (100,) * 4 + (60, 40)]  # training clients' models, made once more
    assert after.head_steps - before.head_steps == sum(fits)  # and their own fits


def test_a_fit_to_convergence_is_estimated_at_its_typical_epochs_not_its_bound(tmp_path):
    from fedrepro.methods.local_linear import LocalLinear

    linear = {"name": "mlp", "params": {"hidden": []}}
    fair = work(tmp_path, "fair", methods={"fair": {"method": "local_linear", "model": linear}})
    converge = work(tmp_path, "conv", methods={"conv": {"method": "local_linear", "hparams": {"epochs": None},
                                                         "model": linear}})
    per_epoch = fair.head_steps / 10  # the fair version's 10 epochs
    assert converge.head_steps == pytest.approx(per_epoch * LocalLinear.cost_convergence_epochs)
    assert LocalLinear.cost_convergence_epochs < METHODS.get("local_linear").hparams["max_epochs"].default


# -- calibrate, validate, cells --cost -----------------------------------------------------------------

@pytest.fixture
def quick(monkeypatch, tmp_path):
    """A fresh working folder (results/ under it) and a fast calibration: little timing, a fixed start-up."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibration, "BUDGET_S", 0.05)
    monkeypatch.setattr(calibration, "measure_startup", lambda device, threads: 1.5)
    monkeypatch.setattr(calibration, "measure_client_round", lambda device, threads: 0.002)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return path


def test_validate_says_how_to_calibrate_and_never_measures(quick, tmp_path, capsys):
    assert main(["validate", str(quick)]) == 0
    out = capsys.readouterr().out
    assert "no calibration for this machine" in out and "run `fedrepro calibrate CONFIG`" in out
    assert not (tmp_path / "results").exists()  # validate measured nothing and wrote nothing


def test_calibrate_caches_per_device_threads_and_torch_and_validate_prints_the_estimate(quick, tmp_path, capsys):
    from fedrepro.local_plan import machine_plan

    assert main(["calibrate", str(quick), "--device", "cpu"]) == 0
    threads = machine_plan().threads  # the cells' threads by default: the local profile's
    device = f"cpu: {calibration.cpu_name()}"
    path = calibration.calibration_path(device, threads, calibration.torch_version())
    data = json.loads(path.read_text())
    assert (data["device"], data["threads"], data["torch"], data["startup_s"]) == (device, threads,
                                                                                   calibration.torch_version(), 1.5)
    assert data["client_round_s"] == 0.002
    exp = resolve_experiment(tiny_config())
    key = calibration.model_spec(cell_of(exp, "fedavg"), exp["datasets"]).key
    assert list(data["models"]) == [key]  # one model, input, classes and batch for the whole experiment
    entry = data["models"][key]
    assert all(entry[k] > 0 for k in ("train_step_s", "forward_sample_s", "head_step_s"))
    capsys.readouterr()

    assert main(["calibrate", str(quick), "--device", "cpu"]) == 0  # cached: not measured again
    assert "cached" in capsys.readouterr().err and json.loads(path.read_text())["models"][key] == entry

    assert main(["validate", str(quick)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if ": cost on " in l)
    assert f"cost on {device} ({threads} threads" in line and "3 job(s)" in line and "in all, longest" in line
    assert "wall time here with the local profile" in line

    assert main(["cells", str(quick), "--cost"]) == 0
    rows = [r.split("\t") for r in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(len(r) == 2 and re.fullmatch(r"\d+(\.\d)? (s|min|h|days)", r[1]) for r in rows), rows


def test_cells_cost_says_uncalibrated_without_a_calibration(quick, capsys):
    assert main(["cells", str(quick), "--cost"]) == 0
    captured = capsys.readouterr()
    assert all("\tuncalibrated (" in r for r in captured.out.splitlines()) and "fedrepro calibrate" in captured.err


def test_a_damaged_calibration_file_is_named_not_used(quick, tmp_path, capsys):
    root = tmp_path / calibration.CALIBRATION_DIR
    root.mkdir(parents=True)
    (root / "broken.json").write_text('{"format": "fedrepro-calibration/1", "device": 3}')
    assert main(["validate", str(quick)]) == 0
    out = capsys.readouterr().out
    assert "warning: calibration file" in out and "key 'device' has value 3" in out and "no calibration" in out


# -- SLURM time limits ---------------------------------------------------------------------------------

def limits_setup(tmp_path, train_step_s: float, environ: dict | None = None, **training):
    config = tiny_config(rounds=20, **training)
    config["methods"] = {"fedavg": {}, "ditto": {}}
    exp = resolve_experiment(config)
    spec = calibration.model_spec(exp["cells"][0], exp["datasets"])
    fake_calibration(tmp_path / "cal", spec, threads=1, train=train_step_s)
    return exp, planning.RuntimeLimits(exp, calibration_root=tmp_path / "cal", environ=environ or {}, shards_root=tmp_path)


def test_time_limits_follow_the_estimates_within_the_floor_and_the_cap(tmp_path):
    exp, limits = limits_setup(tmp_path, train_step_s=0.5)
    fedavg, ditto = cell_of(exp, "fedavg"), cell_of(exp, "ditto")
    for cell in (fedavg, ditto):
        est = limits.estimate(cell, threads=1)
        assert limits.minutes("train", cell, 1) == math.ceil(est / 60 * planning.RUNTIME_MARGIN + planning.RUNTIME_FLOOR_MIN)
    assert limits.minutes("train", ditto, 1) > limits.minutes("train", fedavg, 1)  # differ by cell, as the estimates
    assert limits.minutes("train", fedavg, 1, attempt=2) == 2 * limits.minutes("train", fedavg, 1)
    # no calibration at the job's threads: the fixed limits of before
    assert limits.minutes("train", fedavg, threads=8) == 240 and limits.minutes("finetune", fedavg, threads=8) == 60

    _, tiny = limits_setup(tmp_path / "a", train_step_s=1e-6)
    assert tiny.minutes("train", fedavg, 1) == planning.RUNTIME_FLOOR_MIN + 1  # the floor (+ the start-up's share)
    _, huge = limits_setup(tmp_path / "b", train_step_s=1e3)
    assert huge.minutes("train", fedavg, 1) == planning.DEFAULT_MAX_RUNTIME_MIN  # capped
    _, capped = limits_setup(tmp_path / "c", train_step_s=1e3, environ={planning.MAX_RUNTIME_ENV: "2880"})
    assert capped.minutes("train", fedavg, 1) == 2880 and capped.minutes("train", fedavg, 8) == 240


@pytest.mark.parametrize("value", ["0", "ten", "-5", "9" * 9, "1e3"])
def test_a_bad_maximum_is_one_line_naming_the_variable(value):
    with pytest.raises(ConfigError) as exc:
        planning.max_runtime({planning.MAX_RUNTIME_ENV: value})
    assert str(exc.value).startswith(f"environment variable {planning.MAX_RUNTIME_ENV} has value ") and "allowed:" in str(exc.value)


def test_the_train_rules_runtime_is_the_plans_function(tmp_path, monkeypatch):
    """The workflow's training rules take their `runtime` from the plan (no fixed value in the rules or
    in the SLURM profiles' train and finetune blocks); the plan's function answers by wildcards."""
    rules = (REPO / "workflow" / "rules" / "train.smk").read_text() + (REPO / "workflow" / "rules" / "tuning.smk").read_text()
    for rule in ("train", "finetune", "tune_trial", "train_tuned"):
        assert f'runtime(")' not in rules and f'.runtime("{rule}")' in rules, rule
    for profile in ("slurm", "slurm-packed"):
        text = (REPO / "workflow" / "profiles" / profile / "config.yaml").read_text()
        blocks = yaml.safe_load(text)["set-resources"]
        assert "runtime" not in blocks["train"] and "runtime" not in blocks["finetune"], profile
        assert f'os.environ.setdefault("{planning.MAX_RUNTIME_ENV}", "240")' in text
    exp, limits = limits_setup(tmp_path, train_step_s=0.5)
    plan = planning.WorkflowPlan(exp)
    plan.limits = limits
    runtime = plan.runtime("train")
    wildcards = [SimpleNamespace(dataset="digits", partition="dir", label=label, seed="0") for label in ("fedavg", "ditto")]
    minutes = [runtime(w, threads=1, attempt=1) for w in wildcards]
    assert minutes == [limits.minutes("train", cell_of(exp, w.label), 1) for w in wildcards] and minutes[0] != minutes[1]


def test_the_start_up_is_a_whole_training_job_that_trains_next_to_nothing(monkeypatch):
    import torch

    ran = []
    real = calibration.run_bounded  # the job runs through the bounded reader (issue 46)
    monkeypatch.setattr(calibration, "run_bounded", lambda command, **kw: ran.append(command) or real(command, **kw))
    seconds = calibration.measure_startup(torch.device("cpu"), threads=1)
    assert seconds > 0 and len(ran) == 1 and ran[0][1:4] == ["-m", "fedrepro", "train"]  # the job as the workflow runs it
    assert ran[0][ran[0].index("--threads") + 1] == "1"


def test_the_engines_time_per_client_and_round_is_a_whole_job_less_its_steps(monkeypatch):
    import torch

    ran = []
    real = calibration.run_bounded
    monkeypatch.setattr(calibration, "run_bounded", lambda command, **kw: ran.append(command) or real(command, **kw))
    steps = []
    real_measure = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda spec, device, budget=None: steps.append(spec) or
                        real_measure(spec, device))
    seconds = calibration.measure_client_round(torch.device("cpu"), threads=1)
    assert 0 < seconds < 0.1 and len(ran) == 1 and ran[0][1:4] == ["-m", "fedrepro", "train"]
    cell = json.loads(ran[0][ran[0].index("--cell") + 1])
    assert cell["training"]["rounds"] == calibration.CLIENT_ROUND_ROUNDS  # many rounds of one step each
    assert len(steps) == 1 and steps[0].batch_size < cell["training"]["batch_size"]  # a client's one step: its samples
    # a job whose training were all steps leaves nothing beside them
    monkeypatch.setattr(calibration, "measure", lambda spec, device, budget=None: {"train_step_s": 10.0})
    assert calibration.measure_client_round(torch.device("cpu"), threads=1) == 0.0


def test_slow_steps_are_timed_at_a_smaller_batch_and_big_models_lend_their_timings_across_classes():
    # 0.5 s a 2-sample probe: batch 256 would take a minute a step; the largest power of two that fits
    # MIN_REPEATS + 1 steps in 1.5 s is 2 (0.5 s each), 1 ms a probe fits the whole batch
    assert calibration.scaled_batch(256, 2, 0.5, 1.5) == 2
    assert calibration.scaled_batch(256, 2, 0.01, 1.5) == 64
    assert calibration.scaled_batch(256, 2, 0.001, 1.5) == 256
    vit = calibration.ModelSpec({"name": "prompted_vit", "params": {}}, (3, 224, 224), 10, 64, "auto")
    seven = calibration.ModelSpec(vit.model, vit.input_shape, 7, 64, "auto")
    other_batch = calibration.ModelSpec(vit.model, vit.input_shape, 7, 32, "auto")
    slow, fast = {vit.key: {"train_step_s": 3.0}}, {vit.key: {"train_step_s": 0.1}}
    assert calibration.borrowable(seven, slow) == vit
    assert calibration.borrowable(seven, fast) is None  # a small model's head is no rounding error: measured
    assert calibration.borrowable(other_batch, slow) is None  # only the classes may differ


# -- the estimate where people look: the workflow's start, `fedrepro status`, a named calibration --------

def calibration_file(path, exp: dict, device: str, threads: int, torch: str, train: float = 0.01,
                     startup: float = 2.0, updated: str = "2026-11-26T10:00:00+00:00") -> dict:
    """A calibration file at `path` with every model of `exp` (the cache's format, as a GPU run records it)."""
    specs = [calibration.model_spec(c, exp["datasets"]) for c in exp["cells"] + exp["tuning_cells"]]
    data = {"format": calibration.FORMAT, "device": device, "threads": threads, "torch": torch, "startup_s": startup,
            "updated": updated, "models": {s.key: {"train_step_s": train, "forward_sample_s": 1e-5, "head_step_s": 1e-3,
                                                   "label": s.label()} for s in specs}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


def this_machines_calibration(root, exp: dict, **timings) -> dict:
    """A cached calibration of this machine's device, the local profile's threads and this torch under `root`."""
    from fedrepro.local_plan import machine_plan

    device, threads, torch = cost.this_device(), machine_plan().threads, calibration.torch_version()
    return calibration_file(calibration.calibration_path(device, threads, torch, root), exp, device, threads, torch, **timings)


def estimated(exp: dict, cal: dict, shards_root) -> dict[str, float]:
    return cost.estimate(cost.Estimator(exp, shards_root).jobs(), cal).seconds()


def test_the_workflow_says_validates_estimate_when_it_starts(quick, tmp_path, capsys):
    text = (REPO / "workflow" / "rules" / "common.smk").read_text()
    main_block = text[text.index("if workflow.is_main_process:"):text.index("set_job_environment(EXP, OVERRIDES)")]
    assert "for line in workflow_lines(EXP):" in main_block  # printed once, by the main Snakemake process
    exp = resolve_experiment(tiny_config())
    assert main(["validate", str(quick)]) == 0
    said = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines() if ": cost" in line]
    # no calibration here: the hint validate prints, naming the experiment
    assert cost.workflow_lines(exp) == [f"experiment 'unit': {line}" for line in said] and "calibrate" in said[0]
    cal = this_machines_calibration(tmp_path / calibration.CALIBRATION_DIR, exp)
    assert main(["validate", str(quick)]) == 0
    said = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines() if ": cost" in line]
    lines = cost.workflow_lines(exp)
    assert lines == [f"experiment 'unit': {line}" for line in said]
    seconds = estimated(exp, cal, tmp_path / "no-shards")
    assert f"{len(seconds)} job(s), {cost.human(sum(seconds.values()))} in all, longest" in lines[0]
    assert "wall time here with the local profile" in lines[0]


def test_the_workflows_estimate_never_stops_it(quick, tmp_path, monkeypatch):
    exp = resolve_experiment(tiny_config())
    root = tmp_path / calibration.CALIBRATION_DIR
    root.mkdir(parents=True)
    (root / "damaged.json").write_bytes(b"\xff\xfe not json")
    lines = cost.workflow_lines(exp)  # an unreadable cache: named, then the hint
    assert lines[0].startswith("experiment 'unit': warning: calibration file ") and "damaged.json" in lines[0]
    assert lines[1].startswith("experiment 'unit': cost: no calibration for this machine")

    def broken(*a, **k):
        raise OSError(13, "Permission denied", str(root))

    monkeypatch.setattr(calibration, "load_calibrations", broken)
    [line] = cost.workflow_lines(exp)
    assert line.startswith("experiment 'unit': cost: not estimated (PermissionError: ") and "fedrepro validate" in line


@pytest.mark.slow
def test_a_dry_run_prints_the_estimates_hint_past_a_damaged_calibration_cache(tmp_path):
    import subprocess
    import sys

    (tmp_path / "results" / ".calibration").mkdir(parents=True)
    (tmp_path / "results" / ".calibration" / "x.json").write_text("[]")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                           "-n", "--configfile", str(REPO / "config" / "test.yaml")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fedrepro: experiment 'test': warning: calibration file " in proc.stderr
    assert "fedrepro: experiment 'test': cost: no calibration for this machine (" in proc.stderr


# -- status: the time left -----------------------------------------------------------------------------

def status_file(root, cell: dict, **fields) -> None:
    from fedrepro import progress
    from fedrepro.io import write_json_atomic

    who = {k: cell.get(k) for k in ("experiment", "dataset", "partition", "label", "method", "trial", "seed")}
    state = {"schema": progress.STATUS_SCHEMA, "cell": who, "state": "running", "round": 1, "rounds": 2, "eval_round": 1,
             "acc": {}, "train_loss": 1.0, "elapsed_s": 0.0, "eta_s": None, "pid": os.getpid(),
             "host": __import__("socket").gethostname(), "started": "x", "updated": "x", **fields}
    write_json_atomic(progress.status_path(root / "status", cell), state)


def time_left(capsys, root) -> str:
    assert main(["status", str(root)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    [line] = [l for l in captured.out.splitlines() if l.startswith("time left: ")]
    return line


def test_status_estimates_the_time_left_from_the_runs_recorded_config(quick, tmp_path, capsys, monkeypatch):
    from fedrepro import local_plan, progress
    from fedrepro.io import write_json_atomic

    config = tiny_config(rounds=3)
    exp = resolve_experiment(config)
    root = tmp_path / "results" / "unit"  # the workflow's: calibrations and shards beside it, under results/
    progress.write_plan(root, exp["cells"], config)
    cal = this_machines_calibration(tmp_path / "results" / ".calibration", exp, train=0.05)
    seconds = estimated(exp, cal, tmp_path / "results" / "shards")
    local, fedavg, fedavg_ft = (next(c for c in exp["cells"] if c["label"] == label) for label in ("local", "fedavg", "fedavg_ft"))
    write_json_atomic(root / "runs/digits/dir/local/seed0/metrics.json", {"status": "ok", "rounds": 3})  # done
    status_file(root, fedavg, elapsed_s=3.0)  # running 3 s: its estimate less 3 s is left
    monkeypatch.setattr(local_plan, "cells_at_once", lambda plan, cores=None: 2)
    left = seconds["digits/dir/fedavg/seed0"] - 3.0 + seconds["digits/dir/fedavg_ft/seed0"]  # fedavg_ft pending
    line = time_left(capsys, root)
    want = max(left / 2, seconds["digits/dir/fedavg_ft/seed0"])
    assert line == f"time left: about {cost.human(want)} (1 running, 1 pending job(s), 2 side by side with the local profile)"
    status_file(root, fedavg, elapsed_s=1e6)  # running past its estimate: nothing left of it, never less
    assert time_left(capsys, root).startswith(f"time left: about {cost.human(seconds['digits/dir/fedavg_ft/seed0'])} (")
    for cell in (fedavg, fedavg_ft):
        write_json_atomic(root / "runs" / cost.job_name(cell) / "metrics.json", {"status": "ok", "rounds": 3})
    assert time_left(capsys, root) == "time left: none estimated (no pending or running job)"


def test_status_rescales_the_time_left_by_the_pace_of_the_runs_finished_jobs(quick, tmp_path, capsys, monkeypatch):
    """A machine's speed drifts by as much as the estimate's error: once PACE_MIN_JOBS jobs have finished,
    the time left of the others is their estimate less the start-up, times the finished jobs' measured
    over estimated time, plus the start-up."""
    from fedrepro import local_plan, progress
    from fedrepro.io import write_json_atomic

    config = {**tiny_config(rounds=3), "seeds": [0, 1]}
    exp = resolve_experiment(config)
    root = tmp_path / "results" / "unit"
    progress.write_plan(root, exp["cells"], config)
    cal = this_machines_calibration(tmp_path / "results" / ".calibration", exp, train=0.05, startup=2.0)
    seconds = estimated(exp, cal, tmp_path / "results" / "shards")
    monkeypatch.setattr(local_plan, "cells_at_once", lambda plan, cores=None: 1)
    names = list(seconds)
    assert len(names) == 6 > cost.PACE_MIN_JOBS

    def finish(name: str, slower: float) -> None:  # its own recorded time: the estimate less the start-up, x slower
        write_json_atomic(root / "runs" / name / "metrics.json",
                          {"status": "ok", "rounds": 3, "resources": {"wall_time_s": (seconds[name] - 2.0) * slower}})

    for name in names[:cost.PACE_MIN_JOBS - 1]:  # too few to judge the pace by: the estimates as they are
        finish(name, 3.0)
    pending = names[cost.PACE_MIN_JOBS - 1:]
    assert time_left(capsys, root) == f"time left: about {cost.human(sum(seconds[n] for n in pending))} (0 running, " \
                                      f"{len(pending)} pending job(s), one at a time with the local profile)"
    finish(pending.pop(0), 3.0)
    want = sum(2.0 + (seconds[n] - 2.0) * 3.0 for n in pending)
    assert time_left(capsys, root) == f"time left: about {cost.human(want)} (0 running, {len(pending)} pending job(s), " \
                                      f"one at a time with the local profile, at the run's pace: its 3 finished jobs took " \
                                      "3.00x their estimate)"


def test_status_says_why_there_is_no_time_left_in_one_line(quick, tmp_path, capsys):
    from fedrepro import progress
    from fedrepro.io import write_json_atomic

    config = tiny_config()
    exp = resolve_experiment(config)
    root = tmp_path / "results" / "unit"
    root.mkdir(parents=True)
    plan = root / "status" / progress.PLAN_FILE
    assert time_left(capsys, root) == f"time left: no estimate: the run's config is not known: no {plan} (the workflow " \
                                      "writes it when its jobs start)"
    progress.write_plan(root, exp["cells"])  # a plan of before: no config in it
    assert "records none" in time_left(capsys, root)
    write_json_atomic(plan, {"cells": [], "config": {**config, "seeds": "all"}})  # damaged: refused, named
    assert time_left(capsys, root).startswith("time left: no estimate: the config recorded in the run's plan is refused (")
    progress.write_plan(root, exp["cells"], config)
    line = time_left(capsys, root)  # no calibration for this machine: how to make one
    assert line.startswith("time left: no estimate: no calibration for this machine (") and "fedrepro calibrate" in line


# -- a calibration named on the command line: one recorded on a GPU -------------------------------------

H100 = "cuda: NVIDIA H100 80GB HBM3"


def test_a_gpu_calibration_named_for_validate_says_its_device_date_gpu_hours_and_packed_wall_time(quick, tmp_path, capsys):
    exp = resolve_experiment(tiny_config())
    path = tmp_path / "gpu_runs" / "calibration.json"
    cal = calibration_file(path, exp, H100, 2, "2.11.0", train=0.5)
    est = cost.estimate(cost.Estimator(exp, tmp_path / "no-shards").jobs(), cal)
    seconds = est.seconds()
    lines = {}
    for gpus in (1, 2):
        assert main(["validate", str(quick), "--calibration", str(path), "--gpus", str(gpus)]) == 0
        [lines[gpus]] = [l for l in capsys.readouterr().out.splitlines() if ": cost on " in l]
    total = sum(seconds.values())
    assert f"cost on {H100} (2 threads, calibrated 2026-11-26, torch 2.11.0, file {path}): {len(seconds)} job(s), " \
           f"{cost.human(total)} in all" in lines[1]
    assert f"; {total / 3600:.3g} GPU-hours; wall time on 1 GPU with the slurm-packed profile (8 cells a job, in turn): " \
           f"about {cost.human(total)}" in lines[1]  # on one GPU: every job in turn
    assert "wall time here" not in lines[1]  # not this machine's device: no local profile's wall time
    on_two = cost.packed_wall_seconds(est.timed, 2)  # (the packing itself: test_packing_follows_the_slurm_packed_profile)
    assert f"wall time on 2 GPUs with the slurm-packed profile (8 cells a job, in turn): about {cost.human(on_two)}" in lines[2]
    assert main(["cells", str(quick), "--cost", "--calibration", str(path)]) == 0
    captured = capsys.readouterr()
    assert [r.split("\t")[1] for r in captured.out.splitlines()] == [cost.human(seconds[cost.job_name(c)]) for c in exp["cells"]]
    assert f"cost on {H100}" in captured.err and str(path) in captured.err


def test_packing_follows_the_slurm_packed_profile():
    config = yaml.safe_load((REPO / "workflow" / "profiles" / "slurm-packed" / "config.yaml").read_text())
    assert config["group-components"] == [f"train_pack={cost.PACKED_CELLS_PER_JOB}"]
    assert config["groups"] == [f"{cost.PACKED_RULE}=train_pack"]
    exp = resolve_experiment(tiny_config())
    cell = cell_of(exp, "fedavg")
    spec = calibration.model_spec(cell, exp["datasets"])
    packed = [(cost.Job("c", cell, cost.Work(spec, 1, 0, 0)), 1.0)] * 10  # rule train: 8 a job, then 2
    derived = (cost.Job("d", cell, cost.Work(spec, 0, 0, 0, derived=True)), 5.0)  # rule finetune: a job of its own
    trial = (cost.Job("t", {**cell, "trial": "t0123abcd"}, cost.Work(spec, 1, 0, 0)), 3.0)
    assert cost.packed_wall_seconds(packed, 1) == 10 and cost.packed_wall_seconds(packed, 2) == 8
    assert cost.packed_wall_seconds(packed + [derived, trial], 3) == 8  # 8 | 5 | 2 + 3
    assert cost.packed_wall_seconds(packed + [derived, trial], 1) == 18


def test_a_bad_named_calibration_is_one_line_naming_it(quick, tmp_path, capsys):
    exp = resolve_experiment(tiny_config())
    bad = tmp_path / "bad.json"
    stale = tmp_path / "stale.json"  # this very device, another torch: its timings are not this torch's
    calibration_file(stale, exp, cost.this_device(), 2, "0.0.1")
    wrong = {"missing.json": "no such file", "bad.json": "cannot be read", "list.json": "key 'format' has value [",
             "shape.json": "key 'models' has value", "date.json": "key 'updated' has value 5",
             "stale.json": "key 'torch' has value '0.0.1'"}
    bad.write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "shape.json").write_text(json.dumps({"format": calibration.FORMAT, "device": H100, "threads": 2,
                                                     "torch": "2.11.0", "models": []}))
    calibration_file(tmp_path / "date.json", exp, H100, 2, "2.11.0", updated=5)
    for name, what in wrong.items():
        for command in (["validate", str(quick)], ["cells", str(quick), "--cost"]):
            assert main([*command, "--calibration", str(tmp_path / name)]) == 2, name
            captured = capsys.readouterr()
            assert captured.out == "" and "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
            assert str(tmp_path / name) in captured.err and what in captured.err, captured.err
    assert main(["cells", str(quick), "--cost", "--calibration", str(tmp_path / "date.json"), "--threads", "2"]) == 2
    assert "--threads goes without --calibration" in capsys.readouterr().err
