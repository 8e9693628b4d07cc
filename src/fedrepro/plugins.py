"""Components from outside the package: methods, datasets, partitioners and models registered by
other Python packages or modules (docs/plugins.md).

Two ways in, both loaded at the first registry lookup (fedrepro.registry.Registry):

* Python entry points of the groups in `GROUPS`, declared by an installed distribution, e.g.
  in its pyproject.toml: `[project.entry-points."fedrepro.methods"] my_method = "my_pkg.my_method"`.
  Loading an entry point imports its module, whose `@register` (or `MODELS.register`, ...)
  does the registering, as in the package itself.
* Importable modules named by the environment variable FEDREPRO_PLUGINS (comma-separated)
  or by an experiment's `plugins:` key (a list of module names). The workflow copies the
  config key into FEDREPRO_PLUGINS, so every training job, local or on SLURM, imports them too.

Every entry records its origin (`fedrepro list` prints it). Plugins change no cell hash: a
cell names its method, and the method's code is recorded in provenance like any other.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import EntryPoint, entry_points
from typing import Iterable

from .registry import ConfigError, registering_from, show

#: `fedrepro list` topic -> entry point group.
GROUPS = {
    "methods": "fedrepro.methods",
    "datasets": "fedrepro.datasets",
    "partitioners": "fedrepro.partitioners",
    "models": "fedrepro.models",
}
#: Comma-separated module names every fedrepro process imports as plugins.
PLUGINS_ENV = "FEDREPRO_PLUGINS"

_started = False
_modules: set[str] = set()


def _builtins() -> None:
    """Import the built-in registries first, so a plugin's name clash is reported against them."""
    from . import methods, models  # noqa: F401
    from .data import datasets, partitioners  # noqa: F401


def ensure_loaded() -> None:
    """Load the entry points and the FEDREPRO_PLUGINS modules, once per process."""
    global _started
    if _started:
        return
    _started = True  # first: a plugin that looks up a registry while it loads must not recurse
    _builtins()
    for group in GROUPS.values():
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            _load_entry_point(group, ep)
    load_modules(env_modules(), f"environment variable {PLUGINS_ENV}")


def _load_entry_point(group: str, ep: EntryPoint) -> None:
    dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an unnamed distribution"
    where = f"plugin {dist} (entry point {group}:{ep.name})"
    try:
        with registering_from(where):
            ep.load()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken plugin must name itself, not crash obscurely
        raise ConfigError(f"{where} = {ep.value!r} failed to load: {type(exc).__name__}: {exc}; allowed: an importable "
                          f"module that registers fedrepro components (or uninstall {dist})") from exc


def env_modules() -> list[str]:
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def load_modules(modules: Iterable[str], source: str) -> None:
    """Import each module (once) as a plugin named by `source` (the env variable, a config key)."""
    ensure_loaded()
    for name in modules:
        if name in _modules:
            continue
        try:
            with registering_from(f"module {name} ({source})"):
                importlib.import_module(name)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"{source}: plugin module {show(name)} failed to import: {type(exc).__name__}: {exc}; "
                              f"allowed: an importable module (on PYTHONPATH or installed) that registers fedrepro "
                              f"components") from exc
        _modules.add(name)


def env_with(modules: Iterable[str]) -> str:
    """FEDREPRO_PLUGINS's value with `modules` added (the workflow passes a config's plugins on)."""
    merged = env_modules()
    merged += [m for m in modules if m not in merged]
    return ",".join(merged)
