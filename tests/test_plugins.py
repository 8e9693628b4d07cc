"""Extending fedrepro from outside: a method from a separately installed package (entry point),
required by name in the config key `plugins`, modules named by FEDREPRO_PLUGINS, and a method
added at run time that needs no other file (no search space entry, no regenerated doc).
(A config never imports a module: tests/test_hostile_plugins.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, tiny_config
from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.methods import METHODS, register
from fedrepro.methods.fedavg import FedAvg
from fedrepro.registry import ConfigError, Param

EXAMPLE = REPO / "examples" / "plugin_method"


def run_fedrepro(args: list[str], pythonpath: list, **env) -> subprocess.CompletedProcess:
    """`python -m fedrepro ARGS` in a fresh process whose path holds `pythonpath` and this checkout."""
    paths = [str(p) for p in pythonpath] + [str(REPO / "src")]
    return subprocess.run([sys.executable, "-m", "fedrepro", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(paths), **env})


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """examples/plugin_method installed by pip (a real wheel build, entry point metadata and all)
    into a folder of its own, so the test environment itself is left as it was."""
    target, source = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("src") / "plugin_method"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))  # the build writes beside it
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                          "--target", str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (target / "fedrepro_example_plugin" / "fedavg_slr.py").exists()
    return target


def test_plugin_method_from_an_installed_package_is_listed_and_trains_a_cell(installed_plugin, tiny_partition, make_cell,
                                                                             tmp_path):
    listed = run_fedrepro(["list", "methods", "fedavg_slr"], [installed_plugin])
    assert listed.returncode == 0, listed.stderr
    assert "origin: plugin fedrepro-example-plugin 0.1.0 (entry point fedrepro.methods:fedavg_slr)" in listed.stdout
    assert "server_lr = 1.0" in listed.stdout and "tuning space: lr in" in listed.stdout and "server_lr in [0.5" in listed.stdout
    assert "fedavg_slr" not in METHODS  # this process lacks the package: the entry point provides it
    config = tmp_path / "requires.yaml"
    config.write_text(yaml.safe_dump({**tiny_config(), "plugins": ["fedrepro-example-plugin"],
                                      "methods": {"slr": {"method": "fedavg_slr"}}}))
    validated = run_fedrepro(["validate", str(config)], [installed_plugin])
    assert validated.returncode == 0, validated.stderr
    missing = run_fedrepro(["validate", str(config)], [])
    assert missing.returncode == 2 and ("config key 'plugins' has value 'fedrepro-example-plugin'; allowed: an installed "
                                        "fedrepro plugin (none is installed)") in missing.stderr, missing.stderr

    cell = make_cell("fedavg")
    cell.update(method="fedavg_slr", label="slr", hparams={"server_lr": 0.5})
    out_dir = tmp_path / "run"
    trained = run_fedrepro(["train", "--cell", json.dumps(cell), "--shards", str(tiny_partition[0]), "--out-dir",
                            str(out_dir), "--threads", "1"], [installed_plugin])
    assert trained.returncode == 0, trained.stderr[-3000:]
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["cell"]["method"] == "fedavg_slr" and metrics["rounds"] == cell["training"]["rounds"]
    assert metrics["summary"]["global_acc"]["weighted_mean"] is not None


def test_plugins_environment_variable_and_config_key(tmp_path, monkeypatch):
    """FEDREPRO_PLUGINS loads a module on PYTHONPATH in any process (how the workflow's jobs, local
    or SLURM, get the operator's plugins); the config key `plugins` names installed plugins only
    and never imports the module it names."""
    (tmp_path / "my_plugins.py").write_text(
        "from fedrepro.methods import register\nfrom fedrepro.methods.fedavg import FedAvg\n\n"
        "@register\nclass Mine(FedAvg):\n    name = 'mine_from_config'\n    summary = 'FedAvg under another name'\n")
    listed = run_fedrepro(["list", "methods", "mine_from_config"], [tmp_path], FEDREPRO_PLUGINS="my_plugins")
    assert "origin: module my_plugins (environment variable FEDREPRO_PLUGINS)" in listed.stdout, listed.stderr

    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny_config()
    cfg["methods"] = {"mine": {"method": "mine_from_config"}}
    with pytest.raises(ConfigError, match="config key 'plugins' has value 'my_plugins'; allowed: an installed fedrepro "
                                          "plugin .* FEDREPRO_PLUGINS=my_plugins with its folder on PYTHONPATH"):
        resolve_experiment({**cfg, "plugins": ["my_plugins"]})
    assert "my_plugins" not in sys.modules and "mine_from_config" not in METHODS


def test_plugins_do_not_change_cell_hashes(monkeypatch):
    from fedrepro import plugins
    from fedrepro.io import short_hash

    plugins.load_modules(["fedrepro.methods.fedavg"], "test")  # an importable module that adds nothing new
    monkeypatch.setattr(plugins, "installed", lambda: {"some-plugin": "some-plugin 1.0 (fedrepro.methods:x)"})
    plain = resolve_experiment(tiny_config())
    with_key = resolve_experiment({**tiny_config(), "plugins": ["some-plugin"]})
    assert plain["cells"] and [short_hash(c) for c in plain["cells"]] == [short_hash(c) for c in with_key["cells"]]
    assert [p["id"] for p in plain["partitions"]] == [p["id"] for p in with_key["partitions"]]


@pytest.fixture
def throwaway_method():
    """A method defined here, at run time: one class, registered, nothing else anywhere."""

    @register
    class Throwaway(FedAvg):
        name = "throwaway_avg"
        summary = "FedAvg whose server takes `mix` of the average (defined by a test at run time)"
        hparams = {"mix": Param(1.0, "share of the average taken by the server", float, minimum=0, maximum=1)}

        def aggregate(self, updates):
            old, mix = self.server["global"], self.hp["mix"]
            super().aggregate(updates)
            self.server["global"] = {k: mix * v + (1 - mix) * old[k] if v.is_floating_point() else v
                                     for k, v in self.server["global"].items()}

    try:
        yield Throwaway.name
    finally:
        METHODS.remove(Throwaway.name)


def test_a_method_added_at_run_time_passes_the_registry_wide_checks(throwaway_method, tiny_partition, make_cell, tmp_path,
                                                                     capsys):
    import test_bad_configs
    import test_cli
    import test_engine
    import test_tuning
    import test_untrained

    name = throwaway_method
    assert METHODS.entry(name).origin == "module test_plugins"
    test_engine.test_every_method_runs_two_rounds_with_valid_metrics(tiny_partition, make_cell, tmp_path, name)
    test_untrained.test_every_method_scores_untrained_clients_by_the_one_rule(tiny_partition, make_cell, name)
    test_tuning.check_default_space(name)  # no search_spaces.yaml entry: the shared lr grid only
    test_cli.test_list_prints_every_entry_with_parameters_and_defaults(capsys, "methods", METHODS)
    assert main(["list", "methods", name]) == 0
    out = capsys.readouterr().out
    assert "origin: module test_plugins" in out and "tuning source: no search space declared" in out
    # the documented bad-config messages list no method names: docs/bad_configs.md stays as it is
    cfg = tiny_config()
    cfg["methods"] = {"fedfoo": {"method": "fedfoo"}}
    with pytest.raises(ConfigError) as exc:
        resolve_experiment(cfg)
    assert name in str(exc.value)
    assert test_bad_configs.doc.for_doc(str(exc.value)) in test_bad_configs.doc.DOC.read_text()
