"""Name -> component registries for datasets, partitioners, models and methods.

Every registered component declares its parameters (`Param`) with defaults and a
one-line doc, so `fedrepro list ...` can print them and configs can be checked
against them before any job runs.
"""

from __future__ import annotations

import math
import os
import reprlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Bad user input: the message names the key, the value and what is allowed."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 12
_REPR.maxdict = 8
_REPR.maxlevel = 2
_REPR.maxlong = 40


def show(value: Any) -> str:
    """repr(value) for error messages, truncated (reprlib): a huge or deeply shared value
    (e.g. a YAML alias bomb) never builds a huge message. Small values print as repr()."""
    return _REPR.repr(value)


#: Environment variable lifting the sanity bounds on budgets (rounds, epochs, clients, cells,
#: parameter magnitudes); `fedrepro validate --allow-large-budgets` sets it for one run.
ALLOW_LARGE_ENV = "FEDREPRO_ALLOW_LARGE_BUDGETS"
#: A number parameter without a declared maximum may not exceed this (unless lifted).
SANITY_MAX = 1_000_000
#: ... nor this, lifted or not: torch computes in float32 (3.4e38 at most) and a method multiplies a
#: few such numbers (1e308 as an lr is an overflow traceback in the job, not a diverged cell).
HARD_NUMBER_MAX = 1e12
#: Cells (final and tuning) one experiment may expand to even with the budgets lifted: the sweep
#: product is checked against it before anything is built, so no config can exhaust memory.
HARD_CELLS_MAX = 1_000_000


def large_budgets_allowed() -> bool:
    return os.environ.get(ALLOW_LARGE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def cells_over(cells: int, budget: int) -> str | None:
    """None if an experiment may expand to `cells` cells, else what is allowed: the `budget` (unless
    lifted) or, lifted or not, HARD_CELLS_MAX."""
    if cells > budget and not large_budgets_allowed():
        return f"at most {budget:,} cells {lift_hint()}"
    if cells > HARD_CELLS_MAX:
        return f"at most {HARD_CELLS_MAX:,} cells even with the budgets lifted"
    return None


def lift_hint() -> str:
    return f"(a sanity bound; set {ALLOW_LARGE_ENV}=1 or pass `fedrepro validate --allow-large-budgets` to lift it)"


@dataclass(frozen=True)
class Param:
    """A declared parameter: default value, allowed type(s) and a short doc."""

    default: Any
    doc: str = ""
    type: type | tuple[type, ...] | None = None
    choices: tuple | None = None
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    items: "Param | None" = None  # for a list value: the Param every element must satisfy
    max_items: int | None = None  # for a list value: at most this many elements

    def check(self, where: str, key: str, value: Any) -> None:
        if value is None and self.default is None:
            return  # an optional parameter left unset (null): resolved cells carry it so, and are checked again
        types = self.type if self.type is not None else _infer_type(self.default)
        if types is not None:
            types_t = types if isinstance(types, tuple) else (types,)
            if float in types_t and int not in types_t:
                types_t = types_t + (int,)
            ok = isinstance(value, types_t) and not (isinstance(value, bool) and bool not in types_t)
            if not ok:
                names = "/".join(t.__name__ for t in types_t)
                raise ConfigError(f"{where}: key '{key}' has value {show(value)} of type {type(value).__name__}; allowed: {names}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: key '{key}' has value {show(value)}; allowed: one of {list(self.choices)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where}: key '{key}' has value {show(value)}; allowed: a finite number")
            if self.minimum is not None and value < self.minimum:
                raise ConfigError(f"{where}: key '{key}' has value {show(value)}; allowed: >= {self.minimum}")
            if self.exclusive_minimum is not None and value <= self.exclusive_minimum:
                raise ConfigError(f"{where}: key '{key}' has value {show(value)}; allowed: > {self.exclusive_minimum}")
            if self.maximum is not None and value > self.maximum:
                raise ConfigError(f"{where}: key '{key}' has value {show(value)}; allowed: <= {self.maximum}")
            if self.maximum is None and abs(value) > SANITY_MAX and not large_budgets_allowed():
                raise ConfigError(f"{where}: key '{key}' has value {show(value)}; allowed: at most {SANITY_MAX:,} in "
                                  f"magnitude {lift_hint()}")
            if self.maximum is None and abs(value) > HARD_NUMBER_MAX:
                raise ConfigError(f"{where}: key '{key}' has value {show(value)}; allowed: at most {HARD_NUMBER_MAX:g} in "
                                  f"magnitude (torch computes in float32; not lifted by {ALLOW_LARGE_ENV})")
        if isinstance(value, (list, tuple)):
            if self.max_items is not None and len(value) > self.max_items:
                raise ConfigError(f"{where}: key '{key}' has value {show(value)} ({len(value)} items); allowed: at most "
                                  f"{self.max_items} items")
            if self.items is not None:
                for i, item in enumerate(value):
                    self.items.check(where, f"{key}[{i}]", item)


def _infer_type(default: Any):
    if default is None:
        return None
    if isinstance(default, bool):
        return bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    if isinstance(default, str):
        return str
    if isinstance(default, (list, tuple)):
        return (list, tuple)
    if isinstance(default, dict):
        return dict
    return None


def resolve_params(where: str, declared: dict[str, Param], given: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults overlaid with `given`; unknown keys and bad values raise ConfigError."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        allowed = ", ".join(sorted(declared)) or "(none)"
        raise ConfigError(f"{where}: unknown parameter(s) {show(unknown)}; allowed parameters: {allowed}")
    out = {}
    for key, param in declared.items():
        value = given.get(key, param.default)
        if key in given:
            param.check(where, key, value)
        out[key] = value
    return out


@dataclass
class Entry(Generic[T]):
    name: str
    obj: T
    summary: str
    params: dict[str, Param] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    origin: str = "built-in"  # where it came from: built-in, or the plugin (fedrepro.plugins)


#: The origin given to entries registered now: fedrepro.plugins sets it while importing a plugin.
_ORIGIN: list[str] = []


@contextmanager
def registering_from(origin: str) -> Iterator[None]:
    """Entries added inside this block record `origin` (`fedrepro list` prints it)."""
    _ORIGIN.append(origin)
    try:
        yield
    finally:
        _ORIGIN.pop()


def _origin_of(obj: Any) -> str:
    if _ORIGIN:
        return _ORIGIN[-1]
    module = getattr(obj, "__module__", None) or ""
    return "built-in" if module == "fedrepro" or module.startswith("fedrepro.") else f"module {module}"


#: What a registry with a plugin group calls, with that group, before each lookup: fedrepro/__init__.py
#: sets it to load the group's built-ins and the plugins (fedrepro.plugins.ensure_loaded). Set from
#: outside, so this module imports none of the components its registries hold (no circle at any depth).
_plugin_loader: Callable[[str], None] | None = None


def set_plugin_loader(loader: Callable[[str], None]) -> None:
    """Make `loader(plugin_group)` run before every lookup of a registry with a plugin group."""
    global _plugin_loader
    _plugin_loader = loader


class Registry(Generic[T]):
    """A named collection of components; `kind` is used in error messages.

    With a `plugin_group`, the first lookup also loads the plugins (fedrepro.plugins: Python
    entry points of that group and the modules named by FEDREPRO_PLUGINS; the loader set by
    `set_plugin_loader`), so a component can live in another package."""

    def __init__(self, kind: str, plugin_group: str | None = None):
        self.kind = kind
        self.plugin_group = plugin_group
        self._entries: dict[str, Entry[T]] = {}

    @property
    def _all(self) -> dict[str, Entry[T]]:
        if self.plugin_group is not None and _plugin_loader is not None:
            _plugin_loader(self.plugin_group)
        return self._entries

    def register(self, name: str, summary: str, params: dict[str, Param] | None = None, **info: Any) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self.add(name, obj, summary, params, **info)
            return obj

        return deco

    def add(self, name: str, obj: T, summary: str, params: dict[str, Param] | None = None, **info: Any) -> None:
        origin = _origin_of(obj)
        if name in self._entries:
            raise ConfigError(f"{self.kind} {name!r} is registered twice: by {self._entries[name].origin} and by {origin}; "
                              f"allowed: one component per name (rename one)")
        self._entries[name] = Entry(name, obj, summary, dict(params or {}), info, origin)

    def remove(self, name: str) -> None:
        """Forget `name` (a component registered at run time, e.g. by a test)."""
        del self._entries[name]

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._all[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._all))}") from None

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def __contains__(self, name: object) -> bool:
        return name in self._all

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(sorted(self._all.values(), key=lambda e: e.name))

    def names(self) -> list[str]:
        return sorted(self._all)
