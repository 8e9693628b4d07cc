"""Overrides of an experiment from the command line: `KEY=VALUE` items with dotted keys.

One syntax everywhere:

    fedrepro validate config/test.yaml --set 'training.rounds=1 seeds=[0,1]'
    fedrepro cells config/test.yaml --set training.rounds=1 --set methods.fedavg_ft.hparams.ft_epochs=1
    snakemake --config set='training.rounds=1 seeds=[0,1]' ...

A `--set` argument (or Snakemake's `--config set=...`) holds one or more items separated by
spaces (spaces inside quotes or brackets belong to the value: `seeds=[0, 1]`). KEY is a path of
config keys joined by dots; a name that itself contains dots (a partition label `dir0.5`) is
found as it is in the config, or written in brackets (`partitions[dir0.5].num_clients=8`).
VALUE is read by the strict config reader (fedrepro.configfile: JSON first, then YAML; no
tags, finite numbers), so a value means what it would mean in a config file. Each item is
deep-merged into the experiment as one more `--configfile` holding just that key would be
(a mapping value is merged into the mapping there; any other value replaces it), and the
result is validated exactly as a config file is.

Not OmegaConf (`from_dotlist`): its value parser accepts YAML tags (`!!binary`), `.nan` and
`1e400` (inf), its key parser accepts `a..b` (an empty key), and it cannot know that `dir0.5`
is one label. Merging uses Snakemake's own rule (fedrepro.config._deep_update).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Sequence

from .configfile import parse_config_text
from .io import load_json
from .registry import ConfigError, show

#: Snakemake's `--config` key that carries the items (`--config set='a.b=1 c=2'`).
SET_KEY = "set"
#: The items of the run, as JSON, for provenance.json (set by the Snakefile and `fedrepro train`).
OVERRIDES_ENV = "FEDREPRO_OVERRIDES"

_PLAIN = r"[A-Za-z0-9_][A-Za-z0-9_-]*"
_BRACKETED = r"\[[A-Za-z0-9_][A-Za-z0-9_.-]*\]"
_KEY_RE = re.compile(rf"(?:{_PLAIN}|{_BRACKETED})(?:\.{_PLAIN}|{_BRACKETED})*")
_PIECE_RE = re.compile(rf"({_PLAIN})|\[([^\]]*)\]")
SYNTAX = ("KEY=VALUE items such as training.rounds=1 seeds=[0,1] methods.fedprox.hparams.mu=0.1 (KEY: config keys "
          "joined by '.', a name containing '.' in brackets: partitions[dir0.5].num_clients=8)")


def split_items(text: str) -> list[str]:
    """The items of one `--set` argument: split at spaces outside quotes and brackets."""
    items, buf, quote, depth = [], [], "", 0
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch.isspace() and depth == 0:
            if buf:
                items.append("".join(buf))
                buf = []
            continue
        buf.append(ch)
    if buf:
        items.append("".join(buf))
    return items


def parse_item(item: str) -> tuple[list[tuple[str, bool]], Any]:
    """(key pieces [(name, bracketed)], value) of one `KEY=VALUE` item; ConfigError if malformed."""
    key, eq, text = item.partition("=")
    if not eq:
        raise ConfigError(f"override {item!r} has no '='; allowed: {SYNTAX}")
    if not _KEY_RE.fullmatch(key):
        raise ConfigError(f"override {item!r}: the key {key!r} is not a path of config keys; allowed: {SYNTAX}")
    if not text.strip():
        raise ConfigError(f"override {item!r} has no value after '='; allowed: {SYNTAX}; a null value: {key}=null")
    try:
        value = parse_config_text(text, source=f"the value {text!r}")
    except ConfigError as exc:  # key paths in the message are relative to the value: make them the config's
        msg = _WHERE_RE.sub(lambda m: f"config key '{key}{'' if m.group(1) == '(top level)' else '.' + m.group(1)}'", str(exc))
        raise ConfigError(f"override {item!r}: {msg}") from None
    pieces = [(plain, False) if plain else (bracketed, True) for plain, bracketed in _PIECE_RE.findall(key)]
    return pieces, value


def key_path(config: Any, pieces: list[tuple[str, bool]]) -> list[str]:
    """The config keys named by `pieces`: consecutive plain pieces are joined with '.' where the
    config already has such a key (the label `dir0.5` of `partitions.dir0.5.num_clients`)."""
    path, node, i = [], config, 0
    while i < len(pieces):
        name, j = pieces[i][0], i + 1
        if not pieces[i][1] and isinstance(node, dict):
            for k in range(len(pieces), i + 1, -1):  # the longest existing dotted name wins
                joined = ".".join(p for p, _ in pieces[i:k])
                if all(not b for _, b in pieces[i:k]) and joined in node:
                    name, j = joined, k
                    break
        path.append(name)
        node = node.get(name) if isinstance(node, dict) else None
        i = j
    return path


def nested(path: Sequence[str], value: Any) -> dict:
    """{path[0]: {path[1]: ... value}}."""
    for key in reversed(path[1:]):
        value = {key: value}
    return {path[0]: value}


def cli_items(arguments: Iterable[str] | None) -> list[str]:
    """The items of repeated `--set` arguments, in order."""
    return [item for arg in arguments or () for item in split_items(arg)]


def snakemake_items(config_settings) -> list[str]:
    """The items of Snakemake's `--config set=...` (repeatable). Read from the raw command-line
    strings where Snakemake keeps them (its own parse reads a value with a ': ' as a YAML
    mapping); any other `--config` key is refused: Snakemake reads nested `--config` values
    with YAML's BaseLoader, which keeps every number a string."""
    parsed = dict(getattr(config_settings, "config", None) or {})
    other = sorted(set(parsed) - {SET_KEY})
    if other:
        raise ConfigError(f"--config {other[0]}={show(parsed[other[0]])}: not an override; allowed: --config "
                          f"{SET_KEY}='KEY=VALUE ...', e.g. {SET_KEY}='training.rounds=1 seeds=[0,1]' (Snakemake reads other "
                          "--config values with YAML's BaseLoader: numbers arrive as strings)")
    raw = getattr(config_settings, "config_args", None)
    if SET_KEY not in parsed:
        texts = []
    elif isinstance(raw, (list, tuple)) and all(isinstance(a, str) for a in raw) and list(raw) != _api_args(parsed):
        texts = [a.partition("=")[2] for a in raw if a.partition("=")[0] == SET_KEY]  # the command line's own strings
    else:  # Snakemake's API (ConfigSettings(config=...)), whose config_args it derives from the mapping
        texts = [parsed[SET_KEY]]
    for text in texts:
        if not isinstance(text, str):
            raise ConfigError(f"--config {SET_KEY}={show(text)}: not a string of KEY=VALUE items; allowed: {SYNTAX}")
    return cli_items(texts)


def _api_args(parsed: dict) -> list[str] | None:
    try:
        from snakemake.common import dict_to_key_value_args
    except ImportError:
        return None
    return dict_to_key_value_args(parsed, repr_obj=True)


def record(items: Sequence[str]) -> None:
    """Leave the items of this run to provenance.json (the training jobs inherit the variable)."""
    if items:
        os.environ[OVERRIDES_ENV] = json.dumps(list(items))
    else:
        os.environ.pop(OVERRIDES_ENV, None)


def recorded() -> list[str]:
    """The items recorded by `record` in this process or its parent; [] when none."""
    try:
        items = load_json(os.environ.get(OVERRIDES_ENV) or "[]")  # depth-bounded like every JSON read
    except json.JSONDecodeError:
        return []
    return [i for i in items if isinstance(i, str)] if isinstance(items, list) else []


_WHERE_RE = re.compile(r"config key '([^']*)'")


def blame(exc: ConfigError, applied: list[tuple[str, str]]) -> ConfigError:
    """`exc` prefixed with the override whose key it names (applied: [(item, dotted path)])."""
    text = str(exc)
    m = _WHERE_RE.search(text)
    if m:
        where = m.group(1)
        for item, path in applied:
            parent, _, last = path.rpartition(".")
            if where == path or where.startswith(path + ".") or (parent == where and f"'{last}'" in text):
                return ConfigError(f"override {item!r}: {text}")
    return exc
