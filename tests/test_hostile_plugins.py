"""No config runs code (issue 37): the `plugins:` key only names installed plugins and never
imports a module, so a `.py` file planted under results/ is never run, by `fedrepro validate` nor
by Snakemake; modules of the working tree come only from the operator's FEDREPRO_PLUGINS, looked
up on PYTHONPATH and the installed packages alone, so every process decides the same; and a
plugin that exits while it loads is a ConfigError naming it (docs/security.md, docs/plugins.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from fedrepro import plugins
from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.data.datasets import DATASETS
from fedrepro.data.partitioners import PARTITIONERS
from fedrepro.methods import METHODS
from fedrepro.models import MODELS
from fedrepro.registry import ConfigError
from test_security import TEST_CONFIG, run_snakemake

PLANTED = "results.test.partitions.p0123456789.evil"
#: The modules these tests write (forgotten after each test).
TEST_MODULES = {"results", "lab_plugin", "lab_methods", "tree_plugin", "shadowed_plugin", "exiting_plugin", "exiting_ep",
                "env_plugin"}
REGISTERS_A_METHOD = ("from fedrepro.methods import register\nfrom fedrepro.methods.fedavg import FedAvg\n\n"
                      "@register\nclass Mine(FedAvg):\n    name = 'mine_from_env'\n    summary = 'FedAvg under another name'\n")


def plant(root: Path, module: str, marker: Path, extra: str = "") -> None:
    """A module file at `root`/<module path> whose import writes `marker`."""
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n{extra}")


def config_file(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump({**yaml.safe_load(TEST_CONFIG.read_text()), **keys}))
    return path


def fake_distribution(site: Path, name: str, entry_points: str) -> None:
    """An installed distribution as importlib.metadata sees one: a .dist-info folder on sys.path."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def fresh_plugins(monkeypatch):
    """The plugins loaded again by the next registry lookup (as in a new process); whatever they
    register or import is forgotten afterwards."""
    registries = (METHODS, DATASETS, PARTITIONERS, MODELS)
    before = [set(r._entries) for r in registries]
    monkeypatch.setattr(plugins, "_started", False)
    monkeypatch.setattr(plugins, "_modules", set(plugins._modules))
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    yield
    for registry, names in zip(registries, before):
        for name in set(registry._entries) - names:
            if registry._entries[name].origin != "built-in":  # a lazily imported built-in module stays imported
                registry.remove(name)
    for name in list(sys.modules):
        if name.partition(".")[0] in TEST_MODULES:
            del sys.modules[name]


def validate(capsys, *args) -> tuple[int, str]:
    rc = main(["validate", *map(str, args)])
    err = capsys.readouterr().err.strip()
    return rc, err.removeprefix("fedrepro validate: error: ")


def snakemake_message(proc) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("fedrepro: invalid experiment config: ")]
    assert proc.returncode != 0 and len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    return lines[0].removeprefix("fedrepro: invalid experiment config: ")


# ----------------------------------------------------------- the config key imports nothing


def test_a_module_planted_under_results_is_never_imported_by_validate(tmp_path, monkeypatch, capsys, fresh_plugins):
    """The working tree on sys.path, as Snakemake puts its workflow folder there: still nothing runs."""
    marker = tmp_path / "MARKER"
    plant(tmp_path, PLANTED, marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, message = validate(capsys, config_file(tmp_path / "cfg.yaml", plugins=[PLANTED]))
    assert not marker.exists(), "the config imported a module"
    assert rc == 2 and message.startswith(f"config key 'plugins' has value '{PLANTED}'; allowed: an installed "
                                          f"fedrepro plugin (none is installed). A config never imports a module")
    assert f"FEDREPRO_PLUGINS={PLANTED} with its folder on PYTHONPATH" in message and "\n" not in message


def test_an_old_config_naming_a_module_is_told_what_to_do_instead(fresh_plugins):
    with pytest.raises(ConfigError) as exc:
        resolve_experiment({**tiny_config(), "plugins": ["fedrepro.methods.fedavg"]})  # importable, still refused
    message = str(exc.value)
    assert message.startswith("config key 'plugins' has value 'fedrepro.methods.fedavg'; allowed: an installed fedrepro plugin")
    assert "install it as a package with a fedrepro entry point (docs/plugins.md)" in message
    assert "FEDREPRO_PLUGINS=fedrepro.methods.fedavg" in message


def test_the_config_selects_installed_plugins_by_name(tmp_path, monkeypatch, fresh_plugins):
    """An installed distribution's entry points load (installing it was the opt-in); the key names
    the distribution, or one of its entry points, and a missing one is refused with what is installed."""
    (tmp_path / "lab_plugin.py").write_text(REGISTERS_A_METHOD)
    fake_distribution(tmp_path, "Lab-Plugin", "[fedrepro.methods]\nlab_method = lab_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("lab-plugin", "lab_plugin", "Lab.Plugin", "lab_method"):  # PEP 503 spellings, or the entry point
        exp = resolve_experiment({**tiny_config(), "plugins": [name], "methods": {"mine": {"method": "mine_from_env"}}})
        assert {c["method"] for c in exp["cells"]} == {"mine_from_env"}
    assert METHODS.entry("mine_from_env").origin == "plugin Lab-Plugin 0.1 (entry point fedrepro.methods:lab_method)"
    with pytest.raises(ConfigError, match=r"value 'other-plugin'; allowed: an installed fedrepro plugin "
                                          r"\(Lab-Plugin 0\.1 \(fedrepro\.methods:lab_method\)\)\."):
        resolve_experiment({**tiny_config(), "plugins": ["lab-plugin", "other-plugin"]})


# ------------------------------------------------- FEDREPRO_PLUGINS: the operator's opt-in


def test_fedrepro_plugins_still_loads_a_module_from_pythonpath(tmp_path, monkeypatch, capsys, fresh_plugins):
    (tmp_path / "lab_methods.py").write_text(REGISTERS_A_METHOD)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))  # what PYTHONPATH does at a process start
    monkeypatch.setenv(plugins.PLUGINS_ENV, "lab_methods")
    exp = resolve_experiment({**tiny_config(), "methods": {"mine": {"method": "mine_from_env"}}})
    assert {c["method"] for c in exp["cells"]} == {"mine_from_env"}
    assert METHODS.entry("mine_from_env").origin == "module lab_methods (environment variable FEDREPRO_PLUGINS)"


def test_fedrepro_plugins_never_searches_the_working_tree(tmp_path, monkeypatch, capsys, fresh_plugins):
    """A folder on sys.path but not on PYTHONPATH (the current directory of `python -m`, Snakemake's
    workflow folder) is not searched: the console script, which lacks it, decides the same."""
    marker = tmp_path / "MARKER"
    plant(tmp_path, "tree_plugin", marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.PLUGINS_ENV, "tree_plugin")
    rc, message = validate(capsys, TEST_CONFIG)
    assert not marker.exists()
    assert rc == 2 and message == ("environment variable FEDREPRO_PLUGINS: plugin module 'tree_plugin' is not on PYTHONPATH "
                                   "nor installed; allowed: a module there (the current directory and the workflow folder "
                                   "are not searched: put the module's folder on PYTHONPATH, or install it)")


@pytest.mark.parametrize("pythonpath,folder,ignored", [(".", "", "['.']"), (":{lib}", "", "['']"), ("{lib}:", "", "['']"),
                                                      ("sub", "sub", "['sub']")])
def test_pythonpath_entries_naming_the_working_folder_are_not_searched(tmp_path, monkeypatch, capsys, fresh_plugins,
                                                                          pythonpath, folder, ignored):
    """Issue 46: an empty, '.' or relative PYTHONPATH entry made the working folder (or one in it)
    searchable, though docs/security.md says it never is: each is ignored, and the refusal says so."""
    marker = tmp_path / "MARKER"
    plant(tmp_path / folder, "tree_plugin", marker)
    (tmp_path / "lib").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", pythonpath.format(lib=tmp_path / "lib"))
    monkeypatch.syspath_prepend(str(tmp_path / folder))  # what such an entry does at a process start
    monkeypatch.setenv(plugins.PLUGINS_ENV, "tree_plugin")
    rc, message = validate(capsys, TEST_CONFIG)
    assert not marker.exists()
    assert rc == 2 and message == ("environment variable FEDREPRO_PLUGINS: plugin module 'tree_plugin' is not on PYTHONPATH "
                                   "nor installed; allowed: a module there (the current directory and the workflow folder "
                                   "are not searched: put the module's folder on PYTHONPATH, or install it; PYTHONPATH's "
                                   f"relative or empty entries {ignored} are ignored too: name folders by absolute path)")


def test_an_absolute_pythonpath_entry_beside_a_relative_one_still_loads(tmp_path, monkeypatch, fresh_plugins):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "lab_methods.py").write_text(REGISTERS_A_METHOD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f".{os.pathsep}{tmp_path / 'lib'}")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setenv(plugins.PLUGINS_ENV, "lab_methods")
    exp = resolve_experiment({**tiny_config(), "methods": {"mine": {"method": "mine_from_env"}}})
    assert {c["method"] for c in exp["cells"]} == {"mine_from_env"}


def test_a_module_on_pythonpath_shadowed_from_the_working_tree_is_refused(tmp_path, monkeypatch, fresh_plugins):
    marker = tmp_path / "MARKER"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "shadowed_plugin.py").write_text("")
    plant(tmp_path / "tree", "shadowed_plugin", marker)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.syspath_prepend(str(tmp_path / "tree"))  # first, as a process start puts its own folder
    with pytest.raises(ConfigError, match=r"plugin module 'shadowed_plugin' would be imported from '.*tree/shadowed_plugin\.py', "
                                          r"outside PYTHONPATH and the installed packages \(it shadows '.*lib/shadowed_plugin\.py'\)"):
        plugins.load_modules(["shadowed_plugin"], "environment variable FEDREPRO_PLUGINS")
    assert not marker.exists()


# ------------------------------------------------------------- a plugin may not end the process


def test_a_module_plugin_that_exits_is_a_config_error(tmp_path, monkeypatch, capsys, fresh_plugins):
    (tmp_path / "exiting_plugin.py").write_text("raise SystemExit(0)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.PLUGINS_ENV, "exiting_plugin")
    rc, message = validate(capsys, TEST_CONFIG)
    assert rc == 2 and message == ("environment variable FEDREPRO_PLUGINS: plugin module 'exiting_plugin' failed to import: "
                                   "SystemExit: 0 (a plugin may not end the process); allowed: an importable module (on "
                                   "PYTHONPATH or installed) that registers fedrepro components")


def test_an_entry_point_plugin_that_exits_is_a_config_error(tmp_path, monkeypatch, fresh_plugins):
    (tmp_path / "exiting_ep.py").write_text("import sys\nsys.exit('bye')\n")
    fake_distribution(tmp_path, "exiting-dist", "[fedrepro.models]\nbye = exiting_ep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as exc:
        resolve_experiment(tiny_config())
    assert str(exc.value) == ("plugin exiting-dist 0.1 (entry point fedrepro.models:bye) = 'exiting_ep' failed to load: "
                              "SystemExit: bye (a plugin may not end the process); allowed: an importable module that "
                              "registers fedrepro components (or uninstall exiting-dist 0.1)")


# ------------------------------------------------------- Snakemake decides as `fedrepro validate`


@pytest.mark.slow
def test_snakemake_never_imports_a_module_planted_under_results(tmp_path, monkeypatch, capsys, fresh_plugins):
    """`python -m snakemake` run from the working tree (on sys.path there) with a config naming the
    planted module: refused before any job, with `fedrepro validate`'s message, and nothing ran."""
    marker = tmp_path / "MARKER"
    plant(tmp_path, PLANTED, marker)
    config = config_file(tmp_path / "cfg.yaml", plugins=[PLANTED])
    proc = run_snakemake(tmp_path, "--configfile", str(config), "--workflow-profile", "none")
    assert not marker.exists(), "snakemake -n imported a module a config named"
    monkeypatch.chdir(tmp_path)
    assert snakemake_message(proc) == validate(capsys, config)[1]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["exits", "working-tree", "opt-in"])
def test_snakemake_loads_fedrepro_plugins_as_validate_does(tmp_path, monkeypatch, capsys, fresh_plugins, case):
    marker = tmp_path / "MARKER"
    lib = tmp_path / "lib"
    lib.mkdir()
    if case == "exits":
        (lib / "env_plugin.py").write_text("raise SystemExit(0)\n")
    elif case == "working-tree":
        plant(tmp_path, "env_plugin", marker)  # the folder snakemake is started from: on its sys.path
    else:
        (lib / "env_plugin.py").write_text(REGISTERS_A_METHOD)
    monkeypatch.setenv("PYTHONPATH", str(lib))
    monkeypatch.setenv(plugins.PLUGINS_ENV, "env_plugin")
    config = config_file(tmp_path / "cfg.yaml", methods={"mine": {"method": "mine_from_env"}})
    proc = run_snakemake(tmp_path, "--configfile", str(config), "--workflow-profile", "none")
    monkeypatch.syspath_prepend(str(lib))
    rc, message = validate(capsys, config)
    assert not marker.exists()
    if case == "opt-in":
        assert proc.returncode == 0 and rc == 0, (proc.stdout + proc.stderr)[-3000:] + message
        assert "training cell digits/dir0.5/mine/seed0" in proc.stdout + proc.stderr  # the plugin's method, planned
    else:
        assert rc == 2 and snakemake_message(proc) == message
