"""Readings ledgers: per seed paper, every [RECON] (the paper is silent) and [PAPER≠CODE] (paper
and authors' code disagree) choice of its method, with the paper's words, the readings
considered, the default and why, and the measured effect of each alternative on the paper's
headline comparison.

Data: config/papers/published/readings/<paper>.yaml (format: config/papers/published/README.md,
"Readings ledgers"). `fedrepro readings` checks a ledger (`load_ledger`), writes the per-seed
values of its headline metric from a results folder into its `measured:` block (`record`),
recomputes that block from the results where they are present (`verify`, the same code), and
renders it as Markdown and HTML (`to_markdown`, `to_html`; the workflow's paper_readings rule,
docs/papers.md). Statistics: report/stats.py (mean ± std over seeds, paired tests by seed).
"""

from __future__ import annotations

import ast
import math
import datetime
import html
import importlib.util
import os
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedrepro.configfile import read_config_file
from fedrepro.io import write_text_atomic
from fedrepro.registry import ConfigError, show
from fedrepro.report.paper_tables import number_text, paired_text, signed_text
from fedrepro.report.papers import PUBLISHED_DIR, Metric, Paper, Target, load_published, published_path
from fedrepro.report.plateau import (NOT_CONVERGED, PLATEAU_TOLERANCE, Movement, by_cell, movement, resolution, rounds_text,
                                     seed_changes)
from fedrepro.report.regime import Baseline, Regime
from fedrepro.report.regime import check as regime_check
from fedrepro.report.stats import (ALPHA, CONTRADICTED, HOLDS, NOT_SHOWN, WILCOXON_MIN_SEEDS, Evidence, PairedTest, SeedStats,
                                   evidence, evidence_text, holm, holm_alpha, paired_test, seed_stats, verdict_word)

MARKS = ("RECON", "PAPER≠CODE")
#: a mark in source text: [RECON], [PAPER≠CODE], also "[RECON: ...]" and "[PAPER≠CODE, ...]"
MARK_RE = re.compile(r"\[(RECON|PAPER≠CODE)(?=[\]:,;\s])")
READINGS_DIR = PUBLISHED_DIR / "readings"
DOCS_BEGIN, DOCS_END = "<!-- readings:begin -->", "<!-- readings:end -->"
TOP_KEYS = ("paper", "methods", "headline", "readings", "measured")
HEADLINE_KEYS = ("experiment", "table", "metric", "proposed", "fedavg", "baselines")
HEADLINE_OPTIONAL = ("dataset", "setting")  # the table column, where the experiment maps several
READING_KEYS = ("id", "mark", "question", "paper", "code", "options", "default", "why")
READING_OPTIONAL = ("effects", "not_measured", "stand_in")
NOT_JUDGED = "not judged"
#: why an entry has no measured alternative: it provably cannot act on the stand-in, every run of it
#: failed on the stand-in over at least MIN_SEEDS seeds (no score to compare: the entry says where and
#: why), or the measurement is still to be made (listed by `fedrepro readings --check`, refused by --complete)
CANNOT_ACT, FAILS, PENDING = "cannot act: ", "fails: ", "pending: "
MIN_SEEDS = 3  # an alternative counts as measured over at least this many seeds


# ---------------------------------------------------------------------------------------------
# The data


@dataclass(frozen=True)
class Effect:
    option: str
    label: str  # the experiment label that runs this option (all else default)


@dataclass
class Reading:
    id: str  # <method>.<hparam>
    marks: tuple[str, ...]
    question: str
    paper: str
    code: str
    options: dict[str, str]  # value (as text) -> one-line reading
    default: str
    why: str
    effects: list[Effect]
    not_measured: str | None
    stand_in: str | None = None  # the option the headline stand-in runs where its config departs from the default

    @property
    def runs(self) -> str:
        """The option the headline's proposed label runs: the alternatives are measured against it."""
        return self.stand_in or self.default

    @property
    def method(self) -> str:
        return self.id.split(".", 1)[0]

    @property
    def hparam(self) -> str:
        return self.id.split(".", 1)[1]


@dataclass
class Headline:
    experiment: str
    table: str
    metric: str
    proposed: str
    fedavg: str
    baselines: list[str]
    dataset: str | None = None
    setting: str | None = None


@dataclass
class Ledger:
    path: Path
    root: Path  # the repository the ledger's paths are relative to
    paper: Paper
    methods: list[str]
    headline: Headline
    readings: list[Reading]
    measured: dict | None
    targets: dict[str, Target] = field(default_factory=dict)  # name -> its cells (effect labels too)
    keys: dict[str, tuple] = field(default_factory=dict)  # name -> its cell's layout key in the paper's table
    exp: dict = field(default_factory=dict, repr=False)  # the resolved headline experiment

    @property
    def rel(self) -> str:
        """The ledger's path relative to its repository (what the renderings print)."""
        return _rel(self.path, self.root)

    @property
    def metric(self) -> Metric:
        return self.paper.metrics[self.headline.metric]


def text(v: Any) -> str:
    """An option value as YAML writes it (true, null, 0.5, power): how values are compared."""
    if isinstance(v, bool) or v is None:
        return yaml.safe_dump(v).split("\n")[0]
    return str(v)


def is_option(value: Any, option: str) -> bool:
    """Is a hyper-parameter value the option (its text; numbers compare as numbers: 1 = 1.0)?"""
    if text(value) == option:
        return True
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and float(option) == float(value)
    except ValueError:
        return False


def ledger_path(paper: str, root: str | Path | None = None) -> Path:
    """config/papers/published/readings/<paper>.yaml beside the paper's published file."""
    return published_path(paper, root).parent / "readings" / f"{paper}.yaml"


def seed_papers(root: str | Path | None = None) -> list[str]:
    """The ids of the published papers (the seed papers), sorted."""
    bases = [Path(root)] if root is not None else [Path.cwd(), *Path(__file__).resolve().parents]
    folder = next((b / PUBLISHED_DIR for b in bases if (b / PUBLISHED_DIR).is_dir()), bases[0] / PUBLISHED_DIR)
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _root(path: Path, paper: Any, where: str) -> Path:
    """The repository above `path` that holds the published file of `paper`."""
    for base in path.resolve().parents:
        if (base / PUBLISHED_DIR / f"{paper}.yaml").is_file():
            return base
    raise ConfigError(f"{where}: key 'paper' has value {show(paper)}: no published file {PUBLISHED_DIR}/{paper}.yaml "
                      f"above the ledger; allowed: a paper of {PUBLISHED_DIR}/")


def _need(d: dict, keys: tuple, optional: tuple, where: str) -> None:
    missing = [k for k in keys if k not in d]
    unknown = sorted(set(d) - set(keys) - set(optional))
    if missing or unknown:
        raise ConfigError(f"{where}: {'missing key(s) ' + str(missing) if missing else 'unknown key(s) ' + str(unknown)}; "
                          f"allowed keys: {', '.join(keys + optional)}")


def _str(v: Any, where: str, key: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{where}: key '{key}' has value {show(v)}; allowed: a non-empty string")
    return v


def load_ledger(path: str | Path, resolve: bool = True) -> Ledger:
    """Read and check a ledger (ConfigError names the file, the key, the value and what is allowed);
    with `resolve`, also resolve the headline experiment and check the ledger's labels against it."""
    from fedrepro.methods import METHODS

    path = Path(path)
    where = _shown(path)
    doc = read_config_file(path)  # a ledger lives under config/: the configs' rules (string keys, no tags, bounds)
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: not a readings ledger (a mapping with keys {', '.join(TOP_KEYS)}; "
                          f"config/papers/published/README.md)")
    _need(doc, TOP_KEYS[:4], ("measured",), where)
    root = _root(path, doc["paper"], where)
    if path.stem != doc["paper"]:
        raise ConfigError(f"{where}: key 'paper' has value {show(doc['paper'])}; allowed: {path.stem!r} (the file's name)")
    paper = load_published(root / PUBLISHED_DIR / f"{doc['paper']}.yaml")
    methods = doc["methods"]
    if not isinstance(methods, list) or not methods:
        raise ConfigError(f"{where}: key 'methods' has value {show(methods)}; allowed: a list of registered methods")
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"{where}: key 'methods' names {show(m)}, which is not a registered method; allowed: "
                              f"{', '.join(METHODS.names())}")
    if not isinstance(doc["readings"], list):
        raise ConfigError(f"{where}: key 'readings' has value {show(doc['readings'])}; allowed: a list of readings")
    readings = [_reading(r, f"{where}: readings[{i}]", methods) for i, r in enumerate(doc["readings"])]
    ids = [r.id for r in readings]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ConfigError(f"{where}: key 'readings' repeats id(s) {dup}; allowed: one entry per hyper-parameter")
    ledger = Ledger(path, root, paper, list(methods), _headline(doc["headline"], paper, f"{where}: headline"), readings,
                    _measured(doc.get("measured"), f"{where}: measured"))
    if resolve:
        _resolve(ledger)
    return ledger


def _shown(path: Path) -> str:
    """`path` relative to the working directory where it is below it (error messages)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def _reading(r: Any, where: str, methods: list[str]) -> Reading:
    from fedrepro.methods import METHODS

    if not isinstance(r, dict):
        raise ConfigError(f"{where}: must be a mapping with keys {', '.join(READING_KEYS)}")
    _need(r, READING_KEYS, READING_OPTIONAL, where)
    rid = _str(r["id"], where, "id")
    method, _, hparam = rid.partition(".")
    if method not in methods:
        raise ConfigError(f"{where}: key 'id' has value {rid!r}; allowed: <method>.<hparam> with a method of the "
                          f"ledger's methods {methods}")
    params = METHODS.entry(method).params
    if hparam not in params:
        raise ConfigError(f"{where}: key 'id' has value {rid!r}: {hparam!r} is not a hyper-parameter of {method}; "
                          f"allowed: {', '.join(f'{method}.{h}' for h in params)}")
    marks = tuple(r["mark"]) if isinstance(r["mark"], list) else (r["mark"],)
    if not marks or any(m not in MARKS for m in marks) or len(set(marks)) != len(marks):
        raise ConfigError(f"{where}: key 'mark' has value {show(r['mark'])}; allowed: RECON, PAPER≠CODE or a list of both")
    options = r["options"]
    if not isinstance(options, dict) or len(options) < 2:
        raise ConfigError(f"{where}: key 'options' has value {show(options)}; allowed: a mapping value -> one-line reading "
                          f"with at least two values (the default and an alternative)")
    options = {text(k): _str(v, where, f"options.{text(k)}") for k, v in options.items()}
    default = next((o for o in options if is_option(r["default"], o)), None)  # 1e-06 is the option "1.0e-6"
    if default is None:
        raise ConfigError(f"{where}: key 'default' has value {show(r['default'])}; allowed: one of the options "
                          f"{list(options)}")
    if not is_option(params[hparam].default, default):
        raise ConfigError(f"{where}: key 'default' has value {show(r['default'])}, but {method}'s {hparam} defaults to "
                          f"{show(params[hparam].default)}; allowed: the registered default")
    stand_in = None
    if r.get("stand_in") is not None:  # e.g. a value the stand-in's config selects by tuning
        stand_in = next((o for o in options if is_option(r["stand_in"], o) and o != default), None)
        if stand_in is None:
            raise ConfigError(f"{where}: key 'stand_in' has value {show(r['stand_in'])}; allowed: the option the headline "
                              f"stand-in runs where it is not the default: {[o for o in options if o != default]}")
    runs = stand_in or default
    effects = []
    for j, e in enumerate(r.get("effects") or []):
        w = f"{where}: effects[{j}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{w}: must be a mapping {{option, label}}")
        _need(e, ("option", "label"), (), w)
        option = text(e["option"])
        if option not in options or option == runs:
            raise ConfigError(f"{w}: key 'option' has value {show(e['option'])}; allowed: an option other than the one "
                              f"the stand-in runs: {[o for o in options if o != runs]}")
        effects.append(Effect(option, _str(e["label"], w, "label")))
    not_measured = r.get("not_measured")
    if not effects and not (isinstance(not_measured, str) and not_measured.strip()):
        raise ConfigError(f"{where}: key 'not_measured' has value {show(not_measured)}; allowed: why no alternative is "
                          f"measured (a non-empty string), where 'effects' is empty")
    if isinstance(not_measured, str) and not not_measured.startswith((CANNOT_ACT, FAILS, PENDING)):
        raise ConfigError(f"{where}: key 'not_measured' has value {show(not_measured)}; allowed: {CANNOT_ACT!r} and why "
                          f"the alternatives provably cannot act on the headline stand-in, {FAILS!r} and how every run "
                          f"of the alternative failed on it, or {PENDING!r} and why the "
                          f"measurement is still to be made")
    return Reading(rid, marks, _str(r["question"], where, "question"), _str(r["paper"], where, "paper"),
                   _str(r["code"], where, "code"), options, default, _str(r["why"], where, "why"), effects,
                   not_measured if isinstance(not_measured, str) else None, stand_in)


def _headline(h: Any, paper: Paper, where: str) -> Headline:
    if not isinstance(h, dict):
        raise ConfigError(f"{where}: must be a mapping with keys {', '.join(HEADLINE_KEYS)}")
    _need(h, HEADLINE_KEYS, HEADLINE_OPTIONAL, where)
    if h["table"] not in paper.tables:
        raise ConfigError(f"{where}: key 'table' has value {show(h['table'])}; allowed: {', '.join(paper.tables)}")
    table = paper.tables[h["table"]]
    used = {({**r.key, **c.key})["metric"] for r in table.rows for c in table.columns}
    if h["metric"] not in used:
        raise ConfigError(f"{where}: key 'metric' has value {show(h['metric'])}; allowed: a metric of {table.label}: "
                          f"{', '.join(sorted(used))}")
    if not isinstance(h["baselines"], list) or not h["baselines"]:
        raise ConfigError(f"{where}: key 'baselines' has value {show(h['baselines'])}; allowed: a list of labels")
    names = [_str(h[k], where, k) for k in ("experiment", "proposed", "fedavg")]
    return Headline(names[0], h["table"], h["metric"], names[1], names[2], [_str(b, where, "baselines") for b in h["baselines"]],
                    h.get("dataset"), h.get("setting"))


def _measured(m: Any, where: str) -> dict | None:
    if m is None:
        return None
    labels = m.get("labels") if isinstance(m, dict) else None
    if not isinstance(labels, dict):
        raise ConfigError(f"{where}: must be a mapping with 'labels' (written by `fedrepro readings --record`)")
    for name, values in labels.items():
        _seed_keys(values, f"{where}: labels.{name}")
        ok = isinstance(values, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in values.values())
        if not ok:
            raise ConfigError(f"{where}: labels.{name} has value {show(values)}; allowed: {{seed: value}} "
                              f"(rerun `fedrepro readings --record`)")
    r = m.get("resolution")  # optional: recorded before issue 56
    if r is not None and (not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 <= r < 1):
        raise ConfigError(f"{where}: key 'resolution' has value {show(r)}; allowed: one scored sample as a fraction "
                          f"in [0, 1), as `fedrepro readings --record` writes it")
    if m.get("kernels") is not None and not isinstance(m["kernels"], str):  # optional: recorded before issue 56
        raise ConfigError(f"{where}: key 'kernels' has value {show(m['kernels'])}; allowed: the CPU kernel levels "
                          f"of the cells, as `fedrepro readings --record` writes them (e.g. 'AVX2')")
    changes = m.get("changes")  # optional: a block recorded before the plateau check has none
    if changes is not None and not isinstance(changes, dict):
        raise ConfigError(f"{where}: key 'changes' has value {show(changes)}; allowed: {{name: {{seed: [round before, "
                          f"last round, change]}}}} (rerun `fedrepro readings --record`)")
    for name, per_seed in (changes or {}).items():
        _seed_keys(per_seed, f"{where}: changes.{name}")
        ok = isinstance(per_seed, dict) and all(
            isinstance(c, list) and len(c) == 3 and all(isinstance(x, int) for x in c[:2])
            and isinstance(c[2], (int, float)) and not isinstance(c[2], bool) for c in per_seed.values())
        if not ok:
            raise ConfigError(f"{where}: changes.{name} has value {show(per_seed)}; allowed: {{seed: [round before, "
                              f"last round, change]}} (rerun `fedrepro readings --record`)")
    # seeds are written as string keys (a config's keys are strings) and read back as ints
    return {**m, "labels": {n: {int(s): v for s, v in vals.items()} for n, vals in labels.items()},
            **({"changes": {n: {int(s): c for s, c in per.items()} for n, per in changes.items()}} if changes else {})}


#: a seed key of `measured:` as --record writes it: str(seed), ASCII digits only ('²'.isdigit() is True)
SEED_KEY = re.compile(r"0|[1-9][0-9]{0,17}")


def _seed_keys(per_seed: Any, where: str) -> None:
    """ConfigError naming the first key of a {seed: ...} mapping that is not a seed as --record writes it."""
    for s in per_seed if isinstance(per_seed, dict) else ():
        if not (isinstance(s, str) and SEED_KEY.fullmatch(s)):
            raise ConfigError(f"{where} has seed key {show(s)}; allowed: a seed in ASCII digits without leading zeros "
                              f"(0, 1, 42; at most 18 digits), as `fedrepro readings --record` writes it")


def _resolve(ledger: Ledger) -> None:
    """Where each name's numbers come from in the headline experiment (ConfigError where a name has none)."""
    from fedrepro.config import load_and_resolve
    from fedrepro.report.papers import plan_paper_tables

    h, where = ledger.headline, f"{_shown(ledger.path)}: headline"
    config_path = ledger.root / h.experiment
    if not config_path.resolve().is_relative_to(ledger.root.resolve()):  # never read (or quote) a foreign file
        raise ConfigError(f"{where}: key 'experiment' has value {h.experiment!r}, which is outside the repository "
                          f"{ledger.root}; allowed: an experiment config relative to the repository "
                          f"(config/papers/<paper>_cpu.yaml)")
    if not config_path.is_file():
        raise ConfigError(f"{where}: key 'experiment' has value {h.experiment!r}: no such file; allowed: an experiment "
                          f"config relative to the repository (config/papers/<paper>_cpu.yaml)")
    config, exp = load_and_resolve([str(config_path)], [])
    ledger.exp = exp
    plan = plan_paper_tables(config, exp, root=ledger.root)
    if plan is None or plan.paper.id != ledger.paper.id or h.table not in plan.tables:
        raise ConfigError(f"{where}: key 'table' has value {h.table!r}, which {h.experiment} does not map "
                          f"(paper_tables.tables); allowed: a table the experiment maps")
    targets = {k: t for k, t in plan.tables[h.table].targets.items() if k[3] == h.metric
               and h.dataset in (None, k[1]) and h.setting in (None, k[2])}

    def matches(name: str) -> dict[tuple, Target]:
        """The cells of `name`: a paper method id (a row) first, else an experiment label."""
        return {k: t for k, t in targets.items() if k[0] == name} or {k: t for k, t in targets.items() if t.label == name}

    columns = sorted({k[1:3] for k in matches(h.proposed)})
    if len(columns) != 1:
        raise ConfigError(f"{where}: key 'proposed' has value {h.proposed!r}, which has {len(columns)} cells of metric "
                          f"{h.metric!r} in {h.table} of {h.experiment} (columns (dataset, setting) {columns}); allowed: a "
                          f"name with one cell there, or headline.dataset / headline.setting naming the column (e.g. "
                          f"setting: {columns[0][1] if columns else '...'})")
    column = columns[0]
    for key, name in [("proposed", h.proposed), ("fedavg", h.fedavg), *(("baselines", b) for b in h.baselines)]:
        found = {k: t for k, t in matches(name).items() if k[1:3] == column}
        if len(found) != 1:
            allowed = sorted({t.label for k, t in targets.items() if k[1:3] == column})
            raise ConfigError(f"{where}: key '{key}' names {name!r}, which has {len(found)} cells in column {column} of "
                              f"{h.table} in {h.experiment}; allowed: {', '.join(allowed)}")
        (key_, target), = found.items()
        ledger.targets[name], ledger.keys[name] = target, key_
    labels = {c["label"]: c for c in exp["cells"]}
    base = ledger.targets[h.proposed]
    for r in ledger.readings:
        for e in r.effects:
            w = f"{_shown(ledger.path)}: readings {r.id}: effects option {e.option!r}: key 'label' has value {e.label!r}"
            cell = labels.get(e.label)
            if cell is None:
                raise ConfigError(f"{w}, which is not a method label of {h.experiment}; allowed: {', '.join(labels)}")
            if cell["method"] != r.method or not is_option(cell["hparams"].get(r.hparam), e.option):
                raise ConfigError(f"{w}, which runs {cell['method']} with {r.hparam} = {show(cell['hparams'].get(r.hparam))}; "
                                  f"allowed: a label running {r.method} with {r.hparam}: {e.option}")
            ledger.targets.setdefault(e.label, replace(base, label=e.label))


# ---------------------------------------------------------------------------------------------
# The effects


@dataclass
class Side:
    """One label on the headline metric: its seeds, its paired tests and the verdict."""

    label: str
    values: dict[int, float]  # seed -> value in the paper's unit
    stats: SeedStats
    vs_fedavg: PairedTest | None
    vs_best: PairedTest | None
    verdict: str
    movement: Movement | None = None  # its last change between evaluations (None: not recorded)
    p_holm: float | None = None  # the Holm-adjusted p against the strongest baseline (verdict)
    evidence: Evidence | None = None  # against the strongest baseline (stats.evidence)


def values(ledger: Ledger, name: str) -> dict[int, float]:
    """Per seed, `name`'s measured value in the paper's unit ({} where not measured)."""
    raw = ((ledger.measured or {}).get("labels") or {}).get(name) or {}
    return {int(s): float(v) * ledger.metric.scale for s, v in raw.items() if v is not None and np.isfinite(v)}


def moved(ledger: Ledger, name: str) -> Movement | None:
    """`name`'s last change between evaluations over its seeds (None: not recorded: an older block)."""
    raw = ((ledger.measured or {}).get("changes") or {}).get(name) or {}
    return movement(raw.values())


def still_moving(ledger: Ledger, name: str | None) -> bool:
    """Is `name`'s mean |change| above the tolerance (not converged)?"""
    m = moved(ledger, name) if name else None
    return m is not None and not m.converged


def strongest(ledger: Ledger) -> str | None:
    """The baseline with the best mean on the metric (None: no baseline measured)."""
    sign = 1.0 if ledger.metric.better == "higher" else -1.0
    means = {b: seed_stats(values(ledger, b).values()).mean for b in ledger.headline.baselines if b != ledger.headline.proposed}
    means = {b: m for b, m in means.items() if np.isfinite(m)}
    return max(means, key=lambda b: sign * means[b]) if means else None


def incomplete(ledger: Ledger) -> list[str]:
    """The entries not yet measured: a `pending:` entry, or an alternative measured over fewer than
    MIN_SEEDS seeds ([] where every entry is measured or cannot act on the stand-in)."""
    out = []
    for r in ledger.readings:
        if not r.effects and (r.not_measured or "").startswith(PENDING):
            out.append(f"{r.id}: {r.not_measured}")
        for e in r.effects:
            n = len(values(ledger, e.label))
            if n < MIN_SEEDS:
                out.append(f"{r.id}: option {e.option} (`{e.label}`) measured over {n} seed(s); allowed: at least "
                           f"{MIN_SEEDS} (`fedrepro readings {ledger.paper.id} --record results/<experiment>`)")
    return out


def regime(ledger: Ledger) -> Regime | None:
    """The regime check (report/regime.py) of the headline column: the measured baselines' means
    against the paper's values for the same rows (None: not measured, or the names unresolved)."""
    if not ledger.measured or not ledger.keys:
        return None
    table = ledger.paper.tables[ledger.headline.table]
    base, moving = [], set()
    for name in dict.fromkeys(ledger.headline.baselines):
        key, mean = ledger.keys.get(name), seed_stats(values(ledger, name).values()).mean
        cell = table.cells.get(key) if key else None
        if name != ledger.headline.proposed and key:  # one without a value on either side is named as dropped
            paper = cell.value if cell is not None and cell.value is not None else math.nan
            base.append(Baseline(key[0], ledger.paper.name("method", key[0]), mean, paper))
            if still_moving(ledger, name):  # left out and named, as a paper table's check does (issue 56)
                moving.add(key[0])
    return regime_check(base, ledger.metric.better, ledger.metric.decimals, moving=moving)


def verdict(test: PairedTest | None, better: str, p_holm: float | None = None) -> str:
    """holds / contradicted (above / below the strongest baseline: the Holm-adjusted p of the test,
    over this label's tests against every headline baseline, below ALPHA) or not shown (issue 56).
    `p_holm` None: the test's own p (a family of one)."""
    if test is None:
        return f"{NOT_JUDGED} (no baseline measured)"
    if test.test == "none" or not np.isfinite(test.p):
        return f"{NOT_JUDGED} ({test.note})"
    p = test.p if p_holm is None else p_holm
    gain = test.mean_diff if better == "higher" else -test.mean_diff
    word = verdict_word(gain, p)
    if word == NOT_SHOWN:
        return f"{NOT_SHOWN} against the strongest baseline (Holm p ≥ {ALPHA})"
    return f"{word}: {'above' if word == HOLDS else 'below'} the strongest baseline (Holm p < {ALPHA})"


def holm_vs_best(ledger: Ledger, label: str, v: dict[int, float], best: str | None) -> float | None:
    """The Holm-adjusted p of `label` against `best` within the family of its paired tests against
    every measured headline baseline (the column's comparisons); None without a best."""
    if not best:
        return None
    others = [b for b in dict.fromkeys(ledger.headline.baselines) if b not in (label, ledger.headline.proposed)]
    tests = {b: paired_test(v, values(ledger, b)) for b in others if values(ledger, b)}
    if best not in tests:
        return None
    names = list(tests)
    return holm([tests[b].p for b in names])[names.index(best)]


def side(ledger: Ledger, label: str, best: str | None) -> Side:
    v = values(ledger, label)
    fedavg = ledger.headline.fedavg
    with warnings.catch_warnings():  # scipy on nearly equal differences: the test says so in its note or p
        warnings.simplefilter("ignore", RuntimeWarning)
        vs_fedavg = paired_test(v, values(ledger, fedavg)) if label != fedavg else None
        vs_best = paired_test(v, values(ledger, best)) if best else None
        p_holm = holm_vs_best(ledger, label, v, best) if v else None
    judged = verdict(vs_best, ledger.metric.better, p_holm) if v else "not measured"
    if v and (still_moving(ledger, label) or still_moving(ledger, best)):
        judged = NOT_CONVERGED
    check = regime(ledger)
    if v and check is not None and check.verdict_block:  # out of the paper's regime: nothing is judged
        judged = check.verdict_block + (f"; {NOT_CONVERGED}" if judged == NOT_CONVERGED else "")
    elif v and check is not None and judged.startswith((HOLDS, CONTRADICTED, NOT_SHOWN)):  # weak, or rows missing
        judged += check.strength()
    step = float((ledger.measured or {}).get("resolution") or 0.0) * ledger.metric.scale  # one scored sample
    e = (evidence(v, values(ledger, best), ledger.metric.better, step, holm_alpha(vs_best.p, p_holm))
         if v and best and best != label and vs_best is not None and p_holm is not None else None)
    return Side(label, v, seed_stats(v.values()), vs_fedavg, vs_best, judged, moved(ledger, label), p_holm, e)


def flips(default: Side, option: Side) -> str:
    """yes / no: does the option's verdict differ from the default's; n/a where either is not judged
    (not converged included)."""
    if any(s.verdict.startswith((NOT_JUDGED, "not measured", NOT_CONVERGED)) for s in (default, option)):
        return "n/a"
    return "yes" if option.verdict != default.verdict else "no"


# ---------------------------------------------------------------------------------------------
# Rendering: one table per paper, cells as lists of lines


def _stats_text(ledger: Ledger, s: Side) -> str:
    d = ledger.metric.decimals
    if s.stats.n == 0:
        return "not measured"
    spread = f" ± {number_text(s.stats.std, d)}" if s.stats.n >= 2 else ""
    return f"{number_text(s.stats.mean, d)}{spread} (n={s.stats.n})"


def _side_lines(ledger: Ledger, s: Side, best: str | None) -> list[str]:
    name = ledger.paper.name("method", best) if best else "-"
    d = ledger.metric.decimals
    out = [_stats_text(ledger, s)]
    if s.stats.n and s.movement is not None:
        m, scale = s.movement, ledger.metric.scale
        both = f", mean |change| {number_text(m.moved * scale, d)}" if abs(m.change) < m.moved - 1e-9 else ""
        out.append(f"last change {signed_text(m.change * scale, d)}{both} between {rounds_text(m.rounds)}")
    fedavg = ledger.headline.fedavg
    if s.stats.n:
        if s.vs_fedavg is not None and best != fedavg:
            out.append(f"− {ledger.paper.name('method', fedavg)}: {paired_text(s.vs_fedavg, d)}")
        if s.vs_best is not None:
            shown = s.evidence is not None and s.p_holm is not None and np.isfinite(s.p_holm)
            # the evidence (stats.evidence_text) says the Holm p with the gain's interval and power
            more = f"; {evidence_text(s.evidence, s.p_holm, d)}" if shown else ""
            out.append(f"− {name} (the strongest baseline): {paired_text(s.vs_best, d)}{more}")
    out.append(f"verdict: {s.verdict}")
    return out


def _resolution_text(ledger: Ledger) -> str:
    """', one scored sample being X points' where the block records it (issue 56)."""
    r = (ledger.measured or {}).get("resolution")
    return f"; one scored sample is {number_text(r * ledger.metric.scale, 4)} of the metric" if r else ""


def verification(ledger: Ledger) -> tuple[str, bool]:
    """(the line, reproduced?) every rendering of a measured ledger carries (issue 57): --md / --html
    read the block as --check does (`verify`). A block that does not recompute from the results
    here is marked, not rendered as if it held; one whose results are absent says so."""
    source, problems, notes = verify(ledger)
    check = f"`fedrepro readings {ledger.paper.id} --check`"
    if problems:
        return (f"NOT REPRODUCED HERE: the measured block does not recompute from the results here, {len(problems)} "
                f"problem(s) ({check} lists them), the first: {problems[0]}. The values and verdicts below are the "
                f"ledger's, not these results'.", False)
    if source is None:
        return (f"Not verified here: {notes[0] if notes else 'no results of its cells here'}; {check} recomputes the "
                f"block where results/{ledger.exp.get('experiment')} is present.", True)
    return f"Verified here: the measured block recomputes from {source}{f' ({notes[0]})' if notes else ''}.", True


def _header(ledger: Ledger, verified: bool = True) -> tuple[str, list[str], Side | None, str | None]:
    """(title, intro lines, the default's side, the strongest baseline); `verified`: recompute the
    measured block from the results here and say the outcome (docs/papers.md, a page of the
    committed ledgers, does not: its text must not depend on the machine)."""
    h, p = ledger.headline, ledger.paper
    t = p.tables[h.table]
    target = ledger.targets.get(h.proposed)
    where = f", {target.dataset}/{target.partition}" if target else ""
    lines = [f"Ledger `{ledger.rel}` (methods: {', '.join(ledger.methods)}). Headline: {t.title}, "
             f"{p.name('metric', h.metric)} ({ledger.metric.better} is better), from `{h.experiment}`{where}: the default "
             f"reading is `{h.proposed}`, FedAvg is `{h.fedavg}`, the strongest baseline is the best mean of "
             f"{', '.join(f'`{b}`' for b in h.baselines)}."]
    m = ledger.measured
    if not m:
        lines.append(f"Not measured yet: `fedrepro readings {p.id} --record results/<experiment>` writes the values.")
        return f"{p.short}: readings ledger", lines, None, None
    title = f"{p.short}: readings ledger"
    if verified:
        line, reproduced = verification(ledger)
        lines.append(line)
        title += "" if reproduced else " (not reproduced here)"
    else:
        lines.append(f"Verification: `fedrepro readings {p.id} --check` recomputes the measured block from "
                     f"results/{ledger.exp.get('experiment')} where it is present.")
    kinds = m.get("kinds") or {}
    kind = ", ".join(sorted({str(k) for k in kinds.values() if k})) or "-"
    lines.append(f"Measured: `{m.get('source')}`, {m.get('date')}, seeds {', '.join(map(str, m.get('seeds') or []))}, "
                 f"column {m.get('column')} (kind {kind}); values in the paper's unit; paired tests over common seeds "
                 f"(paired t below {WILCOXON_MIN_SEEDS} seeds, Wilcoxon signed-rank from {WILCOXON_MIN_SEEDS}; two-sided, "
                 f"the verdict reads the Holm-adjusted p over each name's tests against every headline baseline, and "
                 f"the gain detectable at 80 % power at that level{_resolution_text(ledger)}).")
    if m.get("changes"):
        tol = number_text(PLATEAU_TOLERANCE * ledger.metric.scale, ledger.metric.decimals)
        lines.append(f"Plateau: the last change of each name's value between its last two evaluations, mean over seeds; "
                     f"where the default, the strongest baseline or an alternative moved by more than {tol} (mean "
                     f"|change|, a convention of this project), its verdict is '{NOT_CONVERGED}' and whether it flips "
                     f"is n/a.")
    check = regime(ledger)
    if check is not None:
        lines.append(f"Regime check of the headline column (the measured baselines against the paper's values for the same "
                     f"rows, src/fedrepro/report/regime.py): {check.text()}"
                     + (f"; every verdict below is '{check.verdict_block}'." if check.verdict_block else "."))
    best = strongest(ledger)
    default = side(ledger, h.proposed, best)
    lines.append(f"Default (`{h.proposed}`): " + "; ".join(_side_lines(ledger, default, best)) + ".")
    return title, lines, default, best


HEAD = ["Reading", "Mark", "The paper's words; the authors' code", "Options (what the stand-in runs in bold)", "Default: why",
        "Measured effect of each alternative", "Flips the verdict"]


def rows(ledger: Ledger, default: Side | None, best: str | None) -> list[list[list[tuple[str, bool]]]]:
    """Per reading, per column, the lines of the cell as (text, bold)."""
    out = []
    for r in ledger.readings:
        effect, flip = [], []
        for e in r.effects:
            head = f"{e.option} (`{e.label}`)"
            if default is None:
                effect.append((f"{head}: not measured yet", False))
                continue
            s = side(ledger, e.label, best)
            effect.append((f"{head}: " + "; ".join(_side_lines(ledger, s, best)), False))
            flip.append((f"{e.option}: {flips(default, s)}", False))
        if not r.effects:
            effect.append((f"not measured: {r.not_measured}", False))
        out.append([[(f"`{r.id}`", False), (r.question, False)], [(" + ".join(r.marks), False)],
                    [(r.paper, False), (f"code: {r.code}", False)],
                    [(f"{k}: {v}", k == r.runs) for k, v in r.options.items()],
                    [(f"{r.default}" + (f" (registered; the stand-in runs {r.stand_in})" if r.stand_in else "")
                      + f": {r.why}", False)], effect, flip or [("-", False)]])
    return out


def to_markdown(ledger: Ledger, level: int = 3, verified: bool = True) -> str:
    title, intro, default, best = _header(ledger, verified)
    esc = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    cell = lambda lines: "<br>".join(f"**{esc(t)}**" if b else esc(t) for t, b in lines)  # noqa: E731
    out = [f"{'#' * level} {title}", "", *[f"{x}\n" for x in intro],
           "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows(ledger, default, best)]
    return "\n".join(out) + "\n"


def to_html(ledger: Ledger) -> str:
    """A standalone page: the intro and the ledger's table (the report's entry)."""
    title, intro, default, best = _header(ledger)
    e = lambda s: re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(s))  # noqa: E731
    cell = lambda lines: "<br>".join(f"<b>{e(t)}</b>" if b else e(t) for t, b in lines)  # noqa: E731
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title><style>",
           "body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse;margin:8px 0;"
           "border-top:2px solid #000;border-bottom:2px solid #000}th,td{padding:3px 6px;text-align:left;"
           "vertical-align:top;border-bottom:1px solid #ddd}th{border-bottom:1px solid #000}",
           "</style></head><body>", f"<h3>{html.escape(title)}</h3>", *[f"<p>{e(x)}</p>" for x in intro],
           "<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in HEAD) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in rows(ledger, default, best)]
    out.append("</tbody></table></body></html>")
    return "\n".join(out) + "\n"


def write(ledger: Ledger, md: str | Path | None = None, out_html: str | Path | None = None) -> list[Path]:
    paths = []
    for path, render in ((md, to_markdown), (out_html, to_html)):
        if path is not None:
            write_text_atomic(path, render(ledger))
            paths.append(Path(path))
    return paths


# ---------------------------------------------------------------------------------------------
# --record: the measured block


class UnreadableCells(ConfigError):
    """--record: cells of the ledger's labels that could not be read (`lines`: one per cell, and why)."""

    def __init__(self, lines: list[str]):
        super().__init__(f"{len(lines)} cell(s) of the ledger's labels could not be read (above); nothing recorded; "
                         f"allowed: every cell readable, or --skip-unreadable to record without them")
        self.lines = lines


@dataclass(frozen=True)
class Unread:
    """A cell of the ledger's labels whose metrics.json could not be read."""

    label: str
    seed: int
    why: str
    absent: bool  # no file at all (a cell not run yet), rather than a damaged or foreign one

    def __str__(self) -> str:
        return f"{self.label} seed {self.seed}: {self.why}"


def read_cells(ledger: Ledger, results: str | Path) -> tuple[list[dict], list[Unread]]:
    """The metrics.json of the ledger's cells under results/<experiment>/runs (the workflow's layout),
    each read bounded (a FIFO or device never hangs) and checked to belong to the experiment's current
    cell; and every cell that could not be read, with why."""
    from fedrepro.custody import ResultsError, check_unique, expected_token, parse_token, read_metrics, warn_unchecked

    results = Path(results)
    wanted = {(t.dataset, t.partition, t.label) for t in ledger.targets.values()}
    docs, paths, unread = [], [], []
    for c in ledger.exp["cells"]:
        if (c["dataset"], c["partition"], c["label"]) in wanted:
            p = results / "runs" / c["dataset"] / c["partition"] / c["label"] / f"seed{c['seed']}" / "metrics.json"
            try:
                docs.append(read_metrics(p, parse_token(expected_token(c))))
                paths.append(p)
            except ResultsError as exc:
                unread.append(Unread(c["label"], int(c["seed"]), str(exc), not os.path.lexists(p)))
    check_unique(docs, paths)
    warn_unchecked([p for p, d in zip(paths, docs) if d.get("identity") is None])
    return docs, unread


def measured_block(ledger: Ledger, results: str | Path, cells: list[dict]) -> dict:
    """The `measured:` block of the cells read (read_cells): what --record writes and --check recomputes."""
    from fedrepro.report.aggregate import summary_frame
    from fedrepro.report.paper_tables import target_per_seed

    frame = summary_frame(cells)
    runs = by_cell(cells)
    labels, kinds, changes = {}, {}, {}
    for name, t in ledger.targets.items():
        _, kind, raw, _ = target_per_seed(frame, t)
        labels[name] = {str(s): round(float(v), 6) for s, v in sorted(raw.items())}
        kinds[name] = kind
        # the last change of its curve (report/plateau.py), where it has one
        changes[name] = {str(s): [a, b, round(c, 6)] for s, (a, b, c) in seed_changes(runs, t, kind, raw).items()}
    column = next(iter(ledger.targets.values())).column
    # one scored sample as a fraction (plateau.resolution), the coarsest of the labels'
    res = max([resolution(runs, t, kinds[name], [int(s) for s in labels[name]]) for name, t in ledger.targets.items()],
              default=0.0)
    return {"source": Path(results).as_posix(), "date": datetime.date.today().isoformat(),
            "seeds": sorted({int(c["seed"]) for c in ledger.exp["cells"]}), "column": column,
            "kernels": kernel_levels(ledger, results), "resolution": round(res, 8), "kinds": kinds, "labels": labels,
            "changes": changes}


def kernel_levels(ledger: Ledger, results: str | Path) -> str:
    """The CPU kernel levels (fedrepro/kernels.py) the ledger's cells under `results` recorded in their
    provenance.json, joined by ', ' ('unrecorded' for a cell written before issue 56)."""
    from fedrepro.custody import ResultsError, read_bounded_json
    from fedrepro.kernels import capability

    wanted = {(t.dataset, t.partition, t.label) for t in ledger.targets.values()}
    found = set()
    for c in ledger.exp["cells"]:
        if (c["dataset"], c["partition"], c["label"]) in wanted:
            p = Path(results) / "runs" / c["dataset"] / c["partition"] / c["label"] / f"seed{c['seed']}" / "provenance.json"
            try:
                prov = read_bounded_json(p, what="provenance file") if p.is_file() else None
            except (ResultsError, OSError, ValueError):
                prov = None
            if isinstance(prov, dict):
                found.add(capability(prov) or "unrecorded")
    return ", ".join(sorted(found)) or "unrecorded"


def measure(ledger: Ledger, results: str | Path, skip_unreadable: bool = False) -> tuple[dict, list[Unread]]:
    """The `measured:` block from the cells under `results`, and the cells skipped; UnreadableCells
    where a cell could not be read, unless `skip_unreadable`."""
    cells, unread = read_cells(ledger, results)
    if not cells and all(u.absent for u in unread):
        raise ConfigError(f"--record {results}: no metrics.json of the ledger's labels under {results}/runs; allowed: the "
                          f"results folder of {ledger.headline.experiment} (results/{ledger.exp.get('experiment')})")
    if unread and not skip_unreadable:
        raise UnreadableCells([f"cannot read {u}" for u in unread])
    if not cells:
        raise ConfigError(f"--record {results}: no metrics.json of the ledger's labels could be read ({len(unread)} "
                          f"skipped); allowed: a results folder with readable cells")
    return measured_block(ledger, results, cells), unread


#: recorded and recomputed values agree within one unit of the 6 decimals --record writes
AGREE = 1e-6


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return (np.isnan(a) and np.isnan(b)) or abs(a - b) <= AGREE
    return a == b


def verify(ledger: Ledger) -> tuple[str | None, list[str], list[str]]:
    """--check: the ledger's `measured:` block recomputed from results/<experiment> of its repository
    where those results are present (read_cells and measured_block, as --record computes it).
    Returns (the results folder recomputed from, or None; problems: one line per disagreement or
    unreadable cell; notes: what was not recomputed)."""
    m = ledger.measured
    if not m or not ledger.targets:
        return None, [], []
    rel = f"results/{ledger.exp['experiment']}"
    results = ledger.root / rel
    if not (results / "runs").is_dir():
        return None, [], [f"not recomputed: {rel}/runs is absent (the results it names are not here)"]
    cells, unread = read_cells(ledger, results)
    problems = [f"{ledger.rel}: measured: cannot read {u} (not recomputed)" for u in unread if not u.absent]
    absent: dict[str, list[int]] = {}
    for u in unread:
        if u.absent:
            absent.setdefault(u.label, []).append(u.seed)
    notes = [f"not recomputed for {sum(map(len, absent.values()))} cell(s) whose metrics.json is absent: "
             + "; ".join(f"{label} seed{'s' * (len(s) > 1)} {', '.join(map(str, s))}" for label, s in absent.items())
             ] if absent else []
    if not cells:  # nothing of its names here to compare with
        return None, problems, notes
    new = measured_block(ledger, results, cells)
    skip = {(u.label, u.seed) for u in unread}

    def differ(what: str, got: Any, want: Any) -> None:
        if not _same(got, want):
            shown = lambda v: "none" if v is None else show(v)  # noqa: E731
            problems.append(f"{ledger.rel}: measured: {what}: recorded {shown(got)}, the results give {shown(want)} "
                            f"(rerun `fedrepro readings {ledger.paper.id} --record {rel}`)")

    for key in ("seeds", "column", "resolution"):
        if key in m:
            differ(key, m[key], new[key])
    # values recorded under another CPU kernel level may differ by a test sample or two without being wrong
    level = kernel_note(m.get("kernels"), new["kernels"])
    count = len(problems)
    for name, t in ledger.targets.items():
        if new["kinds"][name] is not None and name in (m.get("kinds") or {}):
            differ(f"kinds.{name}", m["kinds"][name], new["kinds"][name])
        for block in ("labels", "changes"):
            got = (m.get(block) or {}).get(name) or {}
            want = {int(s): v for s, v in new[block][name].items()}
            for seed in sorted(set(got) | set(want)):
                if (t.label, seed) not in skip:
                    differ(f"{block}.{name} seed {seed}", got.get(seed), want.get(seed))
    if level and len(problems) > count:
        problems[count:] = [f"{line} ({level})" for line in problems[count:]]
    return rel, problems, notes


def kernel_note(recorded: Any, here: str) -> str:
    """'recorded under another kernel level (X, here Y)' where the ledger names its level and the results
    another; '' where they agree or the ledger names none (recorded before issue 56)."""
    if not isinstance(recorded, str) or recorded == here:
        return ""
    return f"recorded under another kernel level ({recorded}, here {here})"


def replace_measured(source: str, measured: dict) -> str:
    """`source` with its trailing `measured:` block replaced (or appended): every byte before it kept."""
    lines = source.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(r"measured\s*:", line)), None)
    if start is None:
        head = source if source.endswith("\n") or not source else source + "\n"
    else:
        after = [line for line in lines[start + 1:] if line.strip() and not line[0].isspace() and not line.startswith("#")]
        if after:
            raise ConfigError(f"the ledger's 'measured:' block is followed by {after[0].strip()!r}; allowed: measured: as "
                              f"the last top-level key (it is rewritten by `fedrepro readings --record`)")
        head = "".join(lines[:start])
    block = yaml.safe_dump({"measured": measured}, sort_keys=False, default_flow_style=None, allow_unicode=True, width=10**6)
    first, _, rest = block.partition("\n")
    return head + first + "\n  # written by `fedrepro readings --record`; not by hand\n" + rest


def record(path: str | Path, results: str | Path, skip_unreadable: bool = False) -> tuple[Ledger, list[Unread]]:
    """Write the measured block of the ledger at `path` from `results` (atomically); the ledger re-read
    and the cells skipped (measure: UnreadableCells where a cell cannot be read, unless `skip_unreadable`)."""
    path = Path(path)
    ledger = load_ledger(path)
    source = path.read_text(encoding="utf-8")
    measured, skipped = measure(ledger, results, skip_unreadable)
    new = replace_measured(source, measured)
    before, after = yaml.safe_load(source), yaml.safe_load(new)
    before.pop("measured", None)
    after.pop("measured", None)
    if before != after:  # never expected: the text before `measured:` is kept byte for byte
        raise ConfigError(f"{_shown(path)}: recording would change more than the measured: block; nothing written")
    write_text_atomic(path, new)
    return load_ledger(path), skipped


# ---------------------------------------------------------------------------------------------
# docs/papers.md


def docs_markdown(root: str | Path | None = None) -> str:
    """Every seed paper's ledger as Markdown (a paper without one says so)."""
    parts = []
    for paper in seed_papers(root):
        path = ledger_path(paper, root)
        if path.is_file():
            parts.append(to_markdown(load_ledger(path), verified=False))
        else:
            short = load_published(published_path(paper, root)).short
            parts.append(f"### {short}: readings ledger\n\nNo ledger yet (`{READINGS_DIR.as_posix()}/{paper}.yaml`).\n")
    return "\n".join(parts)


def replace_between_markers(doc: str, body: str, where: str = "the docs file") -> str:
    b, e = doc.find(DOCS_BEGIN), doc.find(DOCS_END)
    if b < 0 or e < b:
        raise ConfigError(f"{where}: needs the markers {DOCS_BEGIN} and {DOCS_END} (in that order) around the generated "
                          f"readings ledgers")
    return doc[: b + len(DOCS_BEGIN)] + "\n\n" + body.strip("\n") + "\n\n" + doc[e:]


def update_docs(docs: str | Path, root: str | Path | None = None) -> bool:
    """Rewrite the ledgers between the markers of `docs`; True where the file changed."""
    docs = Path(docs)
    old = docs.read_text(encoding="utf-8")
    replace_between_markers(old, "", str(docs))  # the markers first, before any ledger is read
    new = replace_between_markers(old, docs_markdown(root), str(docs))
    if new != old:
        write_text_atomic(docs, new)
    return new != old


# ---------------------------------------------------------------------------------------------
# Marks in the source: every [RECON] / [PAPER≠CODE] of a method and its helpers in its ledger


def _module_file(name: str) -> Path | None:
    import fedrepro

    base = Path(fedrepro.__file__).parent.joinpath(*name.split(".")[1:])
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _is_helper(name: str) -> bool:
    return name.startswith("fedrepro.methods._") or name == "fedrepro.ssl" or name.startswith("fedrepro.ssl.")


def source_files(method: str) -> list[Path]:
    """The module of a registered method and the helpers it imports (fedrepro.methods._*,
    fedrepro.ssl.*), transitively through the helpers."""
    from fedrepro.methods import METHODS

    first = METHODS.get(method).__module__
    todo, seen = [first], {}
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if _is_helper(a.name)]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
                todo += [n for n in [base, *(f"{base}.{a.name}" for a in node.names)] if _is_helper(n) and _module_file(n)]
    return list(seen.values())


def _param_spans(tree: ast.AST) -> list[tuple[int, int, str | None]]:
    """(first line, last line, doc) of every Param(...) call."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Param":
            doc = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "doc"), None)
            value = doc.value if isinstance(doc, ast.Constant) and isinstance(doc.value, str) else None
            out.append((node.lineno, node.end_lineno or node.lineno, value))
    return out


def marked_lines(source: str, spans: list | None = None) -> list[tuple[int, set[str], list[str]]]:
    """(line number, its marks, the names leading its `backtick` spans) of every marked line of
    `source` outside a Param(...) call."""
    spans = _param_spans(ast.parse(source)) if spans is None else spans
    inside = {i for a, b, _ in spans for i in range(a, b + 1)}
    out = []
    for i, line in enumerate(source.splitlines(), 1):
        marks = set(MARK_RE.findall(line))
        if marks and i not in inside:
            out.append((i, marks, [re.match(r"\s*(\w*)", s).group(1) for s in re.findall(r"`([^`]*)`", line)]))
    return out


def mark_violations(ledger: Ledger) -> list[str]:
    """Every mark of the ledger's methods not in the ledger, as `file:line: what`: a marked Param doc
    needs an entry <method>.<hparam> with the same mark(s); a marked line elsewhere in the method's
    module or its helpers must name, in backticks, a hyper-parameter with an entry carrying its mark(s)."""
    from fedrepro.methods import METHODS

    entries = {r.id: r for r in ledger.readings}
    files = list(dict.fromkeys(f for m in ledger.methods for f in source_files(m)))
    trees = {f: ast.parse(f.read_text(encoding="utf-8")) for f in files}
    spans = {f: _param_spans(t) for f, t in trees.items()}
    docs = {doc: f"{_rel(f, ledger.root)}:{a}" for f in files for a, _, doc in spans[f] if doc}
    out = []
    for m in ledger.methods:
        for hp, p in METHODS.entry(m).params.items():
            marks = set(MARK_RE.findall(p.doc))
            if not marks:
                continue
            where = docs.get(p.doc, _rel(files[0], ledger.root))
            r = entries.get(f"{m}.{hp}")
            if r is None:
                out.append(f"{where}: {m}'s `{hp}` is marked {' + '.join(sorted(marks))} but {ledger.rel} has no entry {m}.{hp}")
            elif set(r.marks) != marks:
                out.append(f"{where}: {m}'s `{hp}` is marked {' + '.join(sorted(marks))} but its entry in {ledger.rel} "
                           f"has mark {' + '.join(r.marks)}")
    params = {m: METHODS.entry(m).params for m in ledger.methods}
    for f in files:
        lines = f.read_text(encoding="utf-8").splitlines()
        for i, marks, named in marked_lines("\n".join(lines), spans[f]):
            ids = [f"{m}.{n}" for n in named for m in ledger.methods if n in params[m]]
            have = [entries[x] for x in ids if x in entries]
            where, shown = f"{_rel(f, ledger.root)}:{i}", lines[i - 1].strip()
            if not have:
                what = (f"names {', '.join(f'`{x}`' for x in ids)} without an entry in {ledger.rel}" if ids else
                        "names no hyper-parameter in backticks (`hparam: value`)")
                out.append(f"{where}: {' + '.join(sorted(marks))} {what}: {shown}")
            elif not marks <= {x for r in have for x in r.marks}:
                out.append(f"{where}: {' + '.join(sorted(marks))} but the entries {[r.id for r in have]} in {ledger.rel} "
                           f"are marked {sorted({x for r in have for x in r.marks})}: {shown}")
    return out


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()
