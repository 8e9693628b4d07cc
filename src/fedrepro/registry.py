"""Name -> component registries for datasets, partitioners, models and methods.

Every registered component declares its parameters (`Param`) with defaults and a
one-line doc, so `fedrepro list ...` can print them and configs can be checked
against them before any job runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Bad user input: the message names the key, the value and what is allowed."""


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

    def check(self, where: str, key: str, value: Any) -> None:
        types = self.type if self.type is not None else _infer_type(self.default)
        if types is not None:
            types_t = types if isinstance(types, tuple) else (types,)
            if float in types_t and int not in types_t:
                types_t = types_t + (int,)
            ok = isinstance(value, types_t) and not (isinstance(value, bool) and bool not in types_t)
            if not ok:
                names = "/".join(t.__name__ for t in types_t)
                raise ConfigError(f"{where}: key '{key}' has value {value!r} of type {type(value).__name__}; allowed: {names}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: key '{key}' has value {value!r}; allowed: one of {list(self.choices)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.minimum is not None and value < self.minimum:
                raise ConfigError(f"{where}: key '{key}' has value {value!r}; allowed: >= {self.minimum}")
            if self.exclusive_minimum is not None and value <= self.exclusive_minimum:
                raise ConfigError(f"{where}: key '{key}' has value {value!r}; allowed: > {self.exclusive_minimum}")
            if self.maximum is not None and value > self.maximum:
                raise ConfigError(f"{where}: key '{key}' has value {value!r}; allowed: <= {self.maximum}")


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
        raise ConfigError(f"{where}: unknown parameter(s) {unknown}; allowed parameters: {allowed}")
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


class Registry(Generic[T]):
    """A named collection of components; `kind` is used in error messages."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, summary: str, params: dict[str, Param] | None = None, **info: Any) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self.add(name, obj, summary, params, **info)
            return obj

        return deco

    def add(self, name: str, obj: T, summary: str, params: dict[str, Param] | None = None, **info: Any) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = Entry(name, obj, summary, dict(params or {}), info)

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._entries))}") from None

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def names(self) -> list[str]:
        return sorted(self._entries)
