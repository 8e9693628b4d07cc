"""Components from outside the package: methods, datasets, partitioners and models registered by
other Python packages or modules (docs/plugins.md).

No config runs code (docs/security.md): an experiment config never names a module to import.
Two ways in, both the operator's own act, loaded at the first registry lookup
(fedrepro.registry.Registry):

* Python entry points of the groups in `GROUPS`, declared by an installed distribution, e.g.
  in its pyproject.toml: `[project.entry-points."fedrepro.methods"] my_method = "my_pkg.my_method"`.
  Loading an entry point imports its module, whose `@register` (or `MODELS.register`, ...)
  does the registering, as in the package itself. Installing the package is the opt-in.
* Modules named by the environment variable FEDREPRO_PLUGINS (comma-separated), looked up only
  on PYTHONPATH's absolute folders and in the installed packages (`search_path`): never in the
  current directory (an empty or '.' entry of PYTHONPATH included), a script's folder or
  Snakemake's workflow folder, which some processes put on sys.path and others do not. So
  `fedrepro validate`, Snakemake and every training job (which inherits the variable, locally
  and on SLURM) decide the same.

An experiment's `plugins:` key only names the installed plugins it requires (`require`): a name
that is not installed is refused, with what to do instead, and nothing is imported for it.
Any exit inside a plugin while it loads (SystemExit included) is a ConfigError naming it.

Every entry records its origin (`fedrepro list` prints it). Plugins change no cell hash: a
cell names its method, and the method's code is recorded in provenance like any other.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Iterable

from .bounded_run import ProgramFailed, run_bounded
from .registry import ConfigError, registering_from, show

#: `fedrepro list` topic -> entry point group.
GROUPS = {
    "methods": "fedrepro.methods",
    "datasets": "fedrepro.datasets",
    "partitioners": "fedrepro.partitioners",
    "models": "fedrepro.models",
}
#: Comma-separated module names every fedrepro process imports as plugins (the operator's opt-in).
PLUGINS_ENV = "FEDREPRO_PLUGINS"
#: Seconds the interpreter may take to say its search path (a cold start on a loaded cluster node is slow).
PROBE_TIMEOUT_S = 120
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

#: Entry point group -> the module whose import registers that group's built-in components.
BUILTINS = {
    "fedrepro.methods": "fedrepro.methods",
    "fedrepro.datasets": "fedrepro.data.datasets",
    "fedrepro.partitioners": "fedrepro.data.partitioners",
    "fedrepro.models": "fedrepro.models",
}

_started = False
_modules: set[str] = set()


def ensure_loaded(group: str | None = None) -> None:
    """Before a lookup of `group`'s registry: its built-in components, and, once per process, the
    entry points and FEDREPRO_PLUGINS modules. Where there are plugins, every group's built-ins
    are imported before them, so a plugin's name clash is reported against the built-ins; where
    there are none, a lookup imports its own group's only (the partition job imports no torch)."""
    global _started
    if not _started:
        _started = True  # first: a plugin that looks up a registry while it loads must not recurse
        points = {g: sorted(entry_points(group=g), key=lambda e: e.name) for g in GROUPS.values()}
        modules = env_modules()
        if modules or any(points.values()):
            for name in BUILTINS.values():
                importlib.import_module(name)
            for g, eps in points.items():
                for ep in eps:
                    _load_entry_point(g, ep)
            load_modules(modules, f"environment variable {PLUGINS_ENV}")
    if group is not None:
        importlib.import_module(BUILTINS[group])


def _dist_label(ep: EntryPoint) -> str:
    return f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an unnamed distribution"


def _failure(exc: BaseException) -> str:
    stop = " (a plugin may not end the process)" if not isinstance(exc, Exception) else ""
    return f"{type(exc).__name__}: {exc}{stop}"


def _load_entry_point(group: str, ep: EntryPoint) -> None:
    dist = _dist_label(ep)
    where = f"plugin {dist} (entry point {group}:{ep.name})"
    try:
        with registering_from(where):
            ep.load()
    except (ConfigError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - a broken or exiting plugin must name itself, not end fedrepro silently
        raise ConfigError(f"{where} = {ep.value!r} failed to load: {_failure(exc)}; allowed: an importable "
                          f"module that registers fedrepro components (or uninstall {dist})") from exc


def env_modules() -> list[str]:
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def relative_pythonpath() -> list[str]:
    """PYTHONPATH's empty and relative entries ('', '.', 'src'): Python reads them as the current
    directory (or a folder in it), which differs between processes; the plugins' search ignores them."""
    raw = os.environ.get("PYTHONPATH", "")
    return [entry for entry in raw.split(os.pathsep) if not os.path.isabs(entry)] if raw else []


def search_path() -> list[str]:
    """The folders FEDREPRO_PLUGINS modules are looked up in: the sys.path a fresh interpreter of
    this environment starts with under -P, i.e. PYTHONPATH's absolute entries and the installed
    packages. Not the entries a process start adds on its own (the current directory for `python
    -m`, a script's folder, Snakemake's workflow folder and .snakemake/pip-deployments), on which
    processes differ, nor PYTHONPATH's empty or relative ones (`relative_pythonpath`), for the same reason."""
    probe = "import json, sys; print(json.dumps(sys.path))"
    env = dict(os.environ)
    absolute = [entry for entry in env.pop("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(entry)]
    if absolute:
        env["PYTHONPATH"] = os.pathsep.join(absolute)
    try:
        path = json.loads(run_bounded([sys.executable, "-P", "-c", probe], timeout=PROBE_TIMEOUT_S, env=env).stdout)
    except (ProgramFailed, ValueError) as exc:
        raise ConfigError(f"environment variable {PLUGINS_ENV}: cannot determine the module search path of "
                          f"{sys.executable!r} ({exc}); allowed: a working Python interpreter") from exc
    return [p for p in path if isinstance(p, str)]


def _top_spec(top: str, path: list[str] | None) -> importlib.machinery.ModuleSpec | None:
    """`top`'s spec as an import would find it, with the path finder limited to `path` (None: sys.path)."""
    if path is None:
        return importlib.util.find_spec(top)
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = None if find is None else find(top, path) if finder is importlib.machinery.PathFinder else find(top, None)
        if spec is not None:
            return spec
    return None


def _location(spec: importlib.machinery.ModuleSpec | None) -> tuple | None:
    return None if spec is None else (spec.origin, tuple(spec.submodule_search_locations or ()))


def _check_findable(name: str, source: str, path: list[str]) -> None:
    """Refuse `name` unless its top-level package comes from `path` (the same in every process)."""
    top = name.partition(".")[0]
    if top in sys.modules:  # already imported by this process (fedrepro itself, the standard library)
        return
    allowed, found = _top_spec(top, path), _top_spec(top, None)
    relative = relative_pythonpath()
    ignored = (f"; PYTHONPATH's relative or empty entries {show(relative)} are ignored too: name folders by absolute path"
               if relative else "")
    if allowed is None:
        raise ConfigError(f"{source}: plugin module {show(name)} is not on PYTHONPATH nor installed; allowed: a "
                          f"module there (the current directory and the workflow folder are not searched: put "
                          f"the module's folder on PYTHONPATH, or install it{ignored})")
    if _location(found) != _location(allowed):
        where = found.origin if found is not None and found.origin else _location(found)
        raise ConfigError(f"{source}: plugin module {show(name)} would be imported from {show(where)}, outside "
                          f"PYTHONPATH and the installed packages (it shadows {show(allowed.origin)}); allowed: a "
                          f"module name found first on PYTHONPATH or installed (rename or remove the other{ignored})")


def load_modules(modules: Iterable[str], source: str) -> None:
    """Import each module (once) as a plugin named by `source` (the environment variable)."""
    ensure_loaded()
    modules = [name for name in modules if name not in _modules]
    if not modules:
        return
    path = search_path()
    for name in modules:
        if not _MODULE_NAME.fullmatch(name):
            raise ConfigError(f"{source} has value {show(name)}; allowed: comma-separated module names "
                              f"(letters, digits, '_', joined by '.')")
        _check_findable(name, source, path)
        try:
            with registering_from(f"module {name} ({source})"):
                importlib.import_module(name)
        except (ConfigError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: a plugin that exits is an error, not a silent stop
            raise ConfigError(f"{source}: plugin module {show(name)} failed to import: {_failure(exc)}; allowed: an "
                              f"importable module (on PYTHONPATH or installed) that registers fedrepro components") from exc
        _modules.add(name)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # distribution names compare so (PEP 503)


def installed() -> dict[str, str]:
    """The installed plugins: {normalized distribution name: 'name version (group:entry point, ...)'}."""
    found: dict[str, tuple[str, list[str]]] = {}
    for group in GROUPS.values():
        for ep in entry_points(group=group):
            name = ep.dist.name if ep.dist is not None else ""
            found.setdefault(_normalized(name), (_dist_label(ep), []))[1].append(f"{group}:{ep.name}")
    return {key: f"{label} ({', '.join(sorted(eps))})" for key, (label, eps) in sorted(found.items())}


def require(names: Iterable[str], key: str = "plugins") -> None:
    """Check a config's `plugins:` key: each name is an installed plugin distribution (or one of
    its entry points' names). Nothing is imported for it: a config selects, it never loads code."""
    names = list(names)
    if not names:  # nothing to check: no scan of the installed distributions (slow with many)
        return
    plugins = installed()
    entry_names = {e.name for group in GROUPS.values() for e in entry_points(group=group)}
    for name in names:
        if _normalized(name) in plugins or name in entry_names:
            continue
        have = "; ".join(plugins.values()) or "none is installed"
        raise ConfigError(f"config key {key!r} has value {show(name)}; allowed: an installed fedrepro plugin "
                          f"({have}). A config never imports a module: install it as a package with a fedrepro "
                          f"entry point (docs/plugins.md), or name the module for a run in the environment, "
                          f"FEDREPRO_PLUGINS={name} with its folder on PYTHONPATH")
