"""Generate docs/bad_configs.md: malformed experiment configs and the exact messages that reject them.

The cases are the malformed configs of tests/test_config.py (its `BAD` list: one
mutation each of the valid config/test.yaml, either of the parsed config or, for what
only the file shows -- duplicate keys, tags, YTE, aliases, encoding --, of its text).
For each, this script applies the mutation, reads the file with the strict reader
(fedrepro.config.load_config) where the mutation is textual, validates the result with
the same function the workflow calls at parse time (fedrepro.config.resolve_experiment,
from workflow/rules/common.smk) and records the ConfigError message. Snakemake prints it as
`fedrepro: invalid experiment config: <message>` and stops before any job runs.

    .venv/bin/python workflow/scripts/bad_configs_doc.py            # rewrite docs/bad_configs.md
    .venv/bin/python workflow/scripts/bad_configs_doc.py --check    # exit 1 if the doc is stale

tests/test_bad_configs.py regenerates the document and compares it with the file.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "bad_configs.md"
BASE_CONFIG = REPO / "config" / "test.yaml"
CASES_FROM = REPO / "tests" / "test_config.py"
SNAKEMAKE_PREFIX = "fedrepro: invalid experiment config: "


def load_cases() -> list[tuple[str, Callable[[dict], Any], list[str]]]:
    """The BAD list of tests/test_config.py: (id, mutation, substrings its message must contain)."""
    spec = importlib.util.spec_from_file_location("_fedrepro_test_config_cases", CASES_FROM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.BAD)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{'a.b.c': leaf} for nested dicts; empty dicts and non-dicts are leaves."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _show(value: Any) -> str:
    if isinstance(value, str) and len(value) > 40:
        return f"'{value[:12]}…' ({len(value)} characters)"
    if isinstance(value, str) and not value.isprintable():
        return repr(value)
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(_show(v) for v in value[:3])}, …] ({len(value)} items)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
    return text.replace("\n", "\\n").replace("|", "\\|")


def describe_change(base: dict, bad: dict) -> list[str]:
    """What the mutation did to the base config, one line per changed key (dotted paths)."""
    a, b = _flatten(base), _flatten(bad)
    lines = []
    for key in sorted(set(a) | set(b)):
        if key not in b:
            if not any(k.startswith(key + ".") for k in b):
                lines.append(f"`{key}` removed")
        elif key not in a:
            if not any(k.startswith(key + ".") for k in a):
                lines.append(f"`{key}: {_show(b[key])}` added")
        elif a[key] != b[key] or type(a[key]) is not type(b[key]):
            lines.append(f"`{key}: {_show(a[key])}` → `{_show(b[key])}`")
    return lines or ["(no visible change)"]


@contextlib.contextmanager
def _in_temp_dir():
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(old)


def collect() -> list[dict[str, Any]]:
    """Every case with its change and the exact message; raises if a case is accepted.

    A row has `config` (the mutated config, for dict mutations) or `text` (the bad file's
    bytes, for textual mutations, read as `bad.yaml` in the current folder)."""
    sys.path.insert(0, str(REPO / "src"))
    from fedrepro.config import load_config, resolve_experiment
    from fedrepro.registry import ConfigError

    base = load_config(BASE_CONFIG)
    base_text = BASE_CONFIG.read_text()
    rows = []
    for case_id, mutate, _expected in load_cases():
        text = bad = None
        try:
            if hasattr(mutate, "content"):  # a malformed file (tests/test_config.py TextCase)
                text = mutate.content(base_text)
                with _in_temp_dir():
                    Path("bad.yaml").write_bytes(text)
                    resolve_experiment(load_config("bad.yaml"))
            else:
                bad = copy.deepcopy(base)
                mutate(bad)
                resolve_experiment(copy.deepcopy(bad))
        except ConfigError as exc:
            message = str(exc)
        else:
            raise SystemExit(f"case {case_id}: the config was accepted")
        change = [mutate.change] if getattr(mutate, "change", None) else describe_change(base, bad)
        rows.append({"id": case_id, "change": change, "message": message, "doc_message": for_doc(message), "config": bad,
                     "text": text})
    return rows


def for_doc(message: str) -> str:
    """`message` as documented: a list of every registered method (dataset, ...) becomes a pointer to
    `fedrepro list`, so adding a component (in the package or as a plugin) leaves this file as it is."""
    from fedrepro.cli import _registry
    from fedrepro.plugins import GROUPS

    for topic in GROUPS:
        registry, _ = _registry(topic)
        message = message.replace(", ".join(registry.names()), f"<every registered {registry.kind}: `fedrepro list {topic}`>")
    return message


def render(rows: list[dict[str, Any]]) -> str:
    out = [
        "# Malformed experiment configs and their messages",
        "",
        "<!-- Generated by workflow/scripts/bad_configs_doc.py; do not edit by hand.",
        "     Regenerate: .venv/bin/python workflow/scripts/bad_configs_doc.py -->",
        "",
        "A bad experiment config stops the workflow while Snakemake parses it, before any job",
        "runs (`workflow/rules/common.smk` reads it with the strict reader `fedrepro.config.load_config`",
        "and validates it with `fedrepro.config.resolve_experiment`; `fedrepro validate <config>` does",
        "the same without Snakemake, and the workflow profiles make Snakemake's own `--configfile`",
        "reading use the strict reader too, see [security.md](security.md)). The message names the",
        "key (or, for a file that cannot be read at all, the file), the value and what is allowed.",
        "Snakemake prints it as",
        "",
        "```",
        f"{SNAKEMAKE_PREFIX}<message>",
        "```",
        "",
        f"Each case below changes one thing in the valid `config/test.yaml`; the {len(rows)} cases",
        "are those of `tests/test_config.py` (`BAD`), and the messages are the exact text",
        "produced by the current code (`tests/test_bad_configs.py` checks that this file is",
        "in sync, that `fedrepro validate bad.yaml` prints each message and that",
        "`snakemake -n --configfile bad.yaml` fails with it before any job). Changes to the",
        f"file's text ({sum(r['text'] is not None for r in rows)} cases: duplicate keys, tags, YTE, aliases,",
        "encoding, ...) are read from a file named `bad.yaml`; the others change the parsed config.",
        "Budgets marked as sanity bounds are lifted with `FEDREPRO_ALLOW_LARGE_BUDGETS=1`. Where a",
        "message lists every registered method (dataset, partitioner, model), this file shows",
        "`<every registered method: ...>` instead, so adding one changes nothing here.",
        "",
        "| # | case | change to `config/test.yaml` |",
        "|---|------|------------------------------|",
    ]
    for i, row in enumerate(rows, 1):
        out.append(f"| {i} | [{row['id']}](#{row['id']}) | {'<br>'.join(row['change'])} |")
    out.append("")
    for i, row in enumerate(rows, 1):
        out += [
            f"## {row['id']}",
            "",
            f"Case {i}. Change: {'; '.join(row['change'])}.",
            "",
            "```",
            row["doc_message"],
            "```",
            "",
        ]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if docs/bad_configs.md is stale")
    ap.add_argument("--out", type=Path, default=DOC)
    args = ap.parse_args(argv)
    text = render(collect())
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date; regenerate with: python {Path(__file__).relative_to(REPO)}", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
