"""Strict reading of experiment config files: YAML or JSON data, never code.

`read_config_file(path)` is the one reader of experiment configs: `fedrepro validate`,
`fedrepro cells`, the Snakefile (workflow/rules/common.smk) and, through the workflow
profiles, Snakemake's own `--configfile` loading (fedrepro.snakemake_guard) all use it.
It refuses, with a one-line message naming the key, the value and what is allowed:

* files that are missing, unreadable, not regular files (a directory; a FIFO is refused without
  blocking on it), larger than `MAX_BYTES` or not UTF-8;
* YAML tags of any kind (`!!python/...`, `!!binary`, `!foo`, ...): a config is plain data;
* YTE templates (`__use_yte__`, `__definitions__`, `__variables__`): Snakemake would run
  them as Python;
* duplicate keys (YAML and JSON), where the last one would silently win;
* keys that are not strings (YAML 1.1 reads `on:`, `yes:`, `~:`, `1:` as a bool, None, int);
* more than `MAX_ALIASES` aliases, recursive aliases, or a document that expands to more
  than `MAX_VALUES` values (the "billion laughs" alias bomb), or is nested deeper than
  `MAX_DEPTH`;
* NaN and infinite numbers (YAML `.nan`/`.inf`, JSON `NaN`/`Infinity`/`1e400`), dates and
  other values that are not strings, numbers, booleans, null, lists or mappings.

`check_plain(obj)` applies the value-level rules to an already loaded object (a dict that
Snakemake or a test built); `resolve_experiment` calls it first.
"""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import Any

import yaml

from .io import FileTooLarge, NotRegularFile, read_regular
from .registry import ConfigError, show

MAX_BYTES = 1 << 20  # 1 MiB: the largest shipped config is a few KB
MAX_ALIASES = 64  # YAML alias uses (`*name`) per document; the paper configs use <= 5
MAX_VALUES = 100_000  # values after expanding every alias
MAX_DEPTH = 32  # nesting of mappings / lists
YTE_KEYS = ("__use_yte__", "__definitions__", "__variables__")
_PLAIN_TAGS = {"tag:yaml.org,2002:" + t for t in ("str", "int", "float", "bool", "null", "seq", "map")}


def _where(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _file(name: str) -> str:
    return f"config file {name!r}"


class _JsonObject(dict):
    """A JSON object that remembers the keys it saw more than once."""

    duplicates: list[str]


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    obj = _JsonObject()
    obj.duplicates = []
    for k, v in pairs:
        if k in obj and k not in obj.duplicates:
            obj.duplicates.append(k)
        obj[k] = v
    return obj


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that counts aliases and remembers which nodes carry an explicit tag."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.aliases = 0
        self.tagged: dict[int, str] = {}  # id(node) -> explicit tag

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise ConfigError(f"config key '(document)' uses more than {MAX_ALIASES} YAML aliases (line {event.start_mark.line + 1}); "
                                  f"allowed: at most {MAX_ALIASES} aliases ('*name') per file")
            return super().compose_node(parent, index)
        node = super().compose_node(parent, index)
        if getattr(event, "tag", None) not in (None, "!"):
            self.tagged[id(node)] = event.tag
        return node


def _check_nodes(root: yaml.Node, tagged: dict[int, str]) -> None:
    """Tags, keys and expansion size of a composed YAML document, reported by key path."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def visit(node: yaml.Node, path: tuple, depth: int) -> int:
        nid = id(node)
        if nid in sizes:
            return sizes[nid]
        if nid in active:
            raise ConfigError(f"config key '{_where(path)}' refers to itself through a YAML alias (line {node.start_mark.line + 1}); "
                              "allowed: aliases of finished values only")
        if depth > MAX_DEPTH:
            raise ConfigError(f"config key '{_where(path)}' is nested more than {MAX_DEPTH} levels deep; allowed: at most {MAX_DEPTH}")
        if nid in tagged:
            raise ConfigError(f"config key '{_where(path)}' has a value with the YAML tag {tagged[nid]!r} (line "
                              f"{node.start_mark.line + 1}); allowed: plain values without tags (a config is data, never code)")
        active.add(nid)
        size = 1
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                size += visit(item, path + (i,), depth + 1)
        elif isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for knode, vnode in node.value:
                if knode.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: explicit keys of this mapping win over merged ones
                    key = "<<"
                elif not isinstance(knode, yaml.ScalarNode) or knode.tag != "tag:yaml.org,2002:str" or id(knode) in tagged:
                    text = knode.value if isinstance(knode, yaml.ScalarNode) else "a " + type(knode).__name__.replace("Node", "").lower()
                    raise ConfigError(f"config key '{_where(path)}' has the key {show(text)} (line {knode.start_mark.line + 1}) "
                                      f"that YAML reads as {_yaml_type(knode)}, not a string; allowed: string keys (quote "
                                      f"it: \"{text}\")")
                else:
                    key = knode.value
                if key in seen:
                    raise ConfigError(f"config key '{_where(path + (key,))}' appears twice (lines {seen[key]} and "
                                      f"{knode.start_mark.line + 1}); allowed: each key once per mapping (YAML would silently "
                                      "keep only the last)")
                seen[key] = knode.start_mark.line + 1
                size += visit(vnode, path + (key,), depth + 1)
        active.discard(nid)
        sizes[nid] = size
        if size > MAX_VALUES:
            raise ConfigError(f"config key '{_where(path)}' expands to more than {MAX_VALUES:,} values through YAML aliases; "
                              f"allowed: at most {MAX_VALUES:,} values in a config")
        return size

    visit(root, (), 0)


def _yaml_type(node: yaml.Node) -> str:
    if not isinstance(node, yaml.ScalarNode):
        return "a " + type(node).__name__.replace("Node", "").lower()
    return {"tag:yaml.org,2002:bool": "a boolean", "tag:yaml.org,2002:null": "null", "tag:yaml.org,2002:int": "an integer",
            "tag:yaml.org,2002:float": "a number", "tag:yaml.org,2002:timestamp": "a date"}.get(node.tag, f"type {node.tag}")


def _parse_yaml(text: str, name: str, source: str | None = None) -> Any:
    label = source or _file(name)
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = " ".join(filter(None, [exc.context, exc.problem])) or "syntax error"
            raise ConfigError(f"{label}: not valid YAML or JSON: {problem}{where}; allowed: a YAML or JSON mapping "
                              "(indent with spaces, quote values containing ': ' or '#')") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{label}: not valid YAML or JSON: {show(str(exc))}; allowed: a YAML or JSON mapping") from None
        except RecursionError:
            raise ConfigError(f"config key '(document)' is nested too deeply; allowed: at most {MAX_DEPTH} levels") from None
        if node is None:
            return None
        _check_nodes(node, loader.tagged)
        try:
            return loader.construct_document(node)
        except (yaml.YAMLError, ValueError, TypeError) as exc:  # e.g. an integer of more than 4300 digits
            raise ConfigError(f"{label}: a value cannot be read: {show(str(exc))}; allowed: plain YAML values") from None
    finally:
        loader.dispose()


def parse_config_text(text: str, name: str = "<string>", source: str | None = None) -> Any:
    """Parse config text (JSON first, as Snakemake does, else YAML) with every rule above;
    `source` names the text in messages (default: "config file <name>")."""
    try:
        obj = json.loads(text, object_pairs_hook=_json_pairs)
    except json.JSONDecodeError:
        obj = _parse_yaml(text, name, source)
    except (ValueError, RecursionError) as exc:  # an integer too long to convert, nesting too deep
        raise ConfigError(f"{source or _file(name)}: not valid JSON: {show(str(exc))}; allowed: a JSON or YAML mapping") from None
    check_plain(obj)
    return obj


def read_config_file(path: str | Path) -> Any:
    """The parsed content of a config file; ConfigError (never a traceback) for anything unsafe."""
    name = str(path)
    try:  # a FIFO, socket or device named as the config never blocks the reader (read_regular)
        data = read_regular(path, MAX_BYTES)
    except NotRegularFile as exc:
        mode = exc.st_mode
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise ConfigError(f"{_file(name)}: {kind}; allowed: the path of a regular YAML or JSON file") from None
    except FileTooLarge:
        raise ConfigError(f"{_file(name)}: larger than {MAX_BYTES:,} bytes; allowed: at most {MAX_BYTES:,} bytes") from None
    except FileNotFoundError:
        raise ConfigError(f"{_file(name)}: not found; allowed: the path of an existing YAML or JSON file") from None
    except IsADirectoryError:
        raise ConfigError(f"{_file(name)}: a directory; allowed: the path of a regular YAML or JSON file") from None
    except OSError as exc:
        raise ConfigError(f"{_file(name)}: cannot be read ({exc.strerror or exc}); allowed: a readable YAML or JSON file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{_file(name)}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "allowed: a UTF-8 encoded YAML or JSON file") from None
    return parse_config_text(text.removeprefix("\ufeff"), name)


def check_plain(obj: Any) -> None:
    """Refuse, by key path, what no experiment config may hold: YTE keys, non-string keys,
    duplicate JSON keys, non-finite numbers, non-plain values, cycles, too deep or too large."""
    if isinstance(obj, dict):
        for key in YTE_KEYS:
            if key in obj:
                raise ConfigError(f"config key '{key}' has value {show(obj[key])}; allowed: plain data only (YTE templates are "
                                  "refused: a config file is never executed)")
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def visit(value: Any, path: tuple, depth: int) -> int:
        if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
            return 1
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ConfigError(f"config key '{_where(path)}' has value {value}; allowed: a finite number")
            return 1
        if not isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{_where(path)}' has value {show(value)} of type {type(value).__name__}; allowed: "
                              "strings, numbers, booleans, null, lists and mappings (quote dates and other special values)")
        vid = id(value)
        if vid in sizes:
            return sizes[vid]
        if vid in active:
            raise ConfigError(f"config key '{_where(path)}' contains itself; allowed: finite, non-recursive values")
        if depth > MAX_DEPTH:
            raise ConfigError(f"config key '{_where(path)}' is nested more than {MAX_DEPTH} levels deep; allowed: at most {MAX_DEPTH}")
        active.add(vid)
        size = 1
        if isinstance(value, dict):
            for dup in getattr(value, "duplicates", ()):
                raise ConfigError(f"config key '{_where(path + (dup,))}' appears twice; allowed: each key once per object "
                                  "(JSON would silently keep only the last)")
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(f"config key '{_where(path)}' has the key {show(k)} of type {type(k).__name__}, not a "
                                      f"string; allowed: string keys (in YAML quote it: \"{k}\")")
                size += visit(v, path + (k,), depth + 1)
        else:
            for i, v in enumerate(value):
                size += visit(v, path + (i,), depth + 1)
        active.discard(vid)
        sizes[vid] = size
        if size > MAX_VALUES:
            raise ConfigError(f"config key '{_where(path)}' holds more than {MAX_VALUES:,} values; allowed: at most "
                              f"{MAX_VALUES:,} values in a config")
        return size

    visit(obj, (), 0)


def plain_copy(obj: Any) -> Any:
    """A deep copy as plain dicts and lists (after check_plain: no cycles, bounded size)."""
    if isinstance(obj, dict):
        return {k: plain_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain_copy(v) for v in obj]
    return obj
