"""Published paper tables as data, and how an experiment's cells fill them.

A *published file* (config/papers/published/<paper>.yaml, format in the README there) holds
a paper's result tables: per table its caption, layout (row sections, column groups, the
metric of each cell, the paper's bolding rule) and every numeric cell keyed by
(method, dataset, setting, metric) with the paper's ± where it gives one.

An experiment config names its paper and maps the layout onto its own cells with the
optional top-level key `paper_tables` (config/README.md):

    paper_tables:
      paper: fedcrc              # config/papers/published/fedcrc.yaml
      reduced: false             # true: a reduced stand-in; paper values for reference only
      tables:
        table1:
          kind: global           # which model is scored (a kind, or a list: first one present)
          methods: {fedper: {kind: personal}, fedcrc_per: {label: fedcrc, kind: personal}}
                                 # a label per setting where the settings are variants of one method:
                                 # {calibre_simclr: {label: {no_reg: calibre_none, ln_lp: calibre}}}
          datasets: {}           # paper dataset -> experiment dataset (default: the same name)
          settings: {}           # paper setting -> partition label, or {dataset: label}
          metrics: {acc: acc_weighted_mean}   # paper metric -> summary column (or {column, kind})
      figures: {fig3: {}}        # the paper's figures to draw (their table's mapping)

A paper method, dataset or setting not named maps to the experiment's label, dataset or
partition of the same name where there is one; `false` leaves it out. `kind` precedence:
method > metric > table > ["personal", "global"].
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedrepro.registry import ConfigError, show

#: The largest published paper file read (the shipped ones are a few KB).
PUBLISHED_MAX_BYTES = 4 << 20

DIMS = ("method", "dataset", "setting", "metric")
BOLD_RULES = ("best", "rank", "none")
PM_KINDS = ("seed_std", "client_std")
PLOTS = ("curves", "client_bars", "pg_tradeoff", "mean_variance", "metric_bars", "client_cases")
DEFAULT_KINDS = ("personal", "global")
PUBLISHED_DIR = Path("config") / "papers" / "published"


# ---------------------------------------------------------------------------------------------
# The published data


@dataclass(frozen=True)
class Metric:
    id: str
    name: str
    better: str  # higher | lower
    unit: str  # percent | fraction
    decimals: int = 2
    description: str = ""

    @property
    def scale(self) -> float:
        """Factor from fedrepro's fractions to the paper's unit."""
        return 100.0 if self.unit == "percent" else 1.0


@dataclass(frozen=True)
class Row:
    key: dict  # the row's dims (usually {"method": ...})
    section: str | None = None
    derived: str | None = None  # "mean": the mean of the section-less other rows (FedCoSR's "Averaged")


@dataclass(frozen=True)
class Column:
    key: dict  # the column's dims
    header: tuple  # (dim, value) per header level, outermost first


@dataclass(frozen=True)
class PaperCell:
    value: float | None  # None: the paper prints "–" (see note)
    pm: float | None = None
    note: str = ""
    ocr: str | None = None  # what the text reads where it is an OCR error
    mark: str | None = None  # the paper's own mark on the value: "bold", or a rank mark (*, †, ‡)


@dataclass
class Table:
    paper: "Paper"
    id: str
    title: str
    caption: str
    page: int | None
    location: str
    measure: str
    note: str
    pm: dict | None  # {kind: seed_std|client_std, runs, note}
    bold: dict
    rows: list[Row]
    columns: list[Column]
    header: list[str]
    cells: dict[tuple, PaperCell]
    proposed: list[str]
    marks: dict | None = None  # {source, note}: the paper's marks are recorded per cell; None: not recorded
    names: dict = field(default_factory=dict)  # this table's own display names, {dim: {id: name}}
    per_client: bool = False  # values of single clients (GRP-FED Fig. 5): ours only in the figure analogue

    def name(self, dim: str, value: str) -> str:
        """The table's own name for an id (FedGCR Table 5 prints σ_domain), else the paper's."""
        return str(self.names.get(dim, {}).get(value) or self.paper.name(dim, value))

    def key(self, row: Row, col: Column) -> tuple:
        merged = {**row.key, **col.key}
        return tuple(merged[d] for d in DIMS)

    def metric(self, key: tuple) -> Metric:
        return self.paper.metrics[key[3]]

    def row_name(self, row: Row) -> str:
        return " · ".join(self.name(d, v) for d, v in row.key.items())

    @property
    def label(self) -> str:
        return f"{self.paper.short} {self.title}"


@dataclass
class Paper:
    id: str
    short: str
    title: str
    path: Path
    info: dict
    names: dict[str, dict[str, str]]
    metrics: dict[str, Metric]
    tables: dict[str, Table] = field(default_factory=dict)
    figures: dict[str, dict] = field(default_factory=dict)

    def name(self, dim: str, value: str) -> str:
        if dim == "metric":
            return self.metrics[value].name
        return str(self.names.get(dim, {}).get(value, value))


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _expand(entry: dict, order: list[str], where: str) -> list[dict]:
    """Product of the entry's dims (scalars or lists), outermost first in `order`, then DIMS order."""
    dims = [d for d in entry if d in DIMS]
    dims.sort(key=lambda d: (order.index(d) if d in order else len(order) + DIMS.index(d)))
    for d in dims:
        if not _as_list(entry[d]):
            raise ConfigError(f"{where}: '{d}' is empty")
    return [dict(zip(dims, combo)) for combo in itertools.product(*(_as_list(entry[d]) for d in dims))]


def load_published(path: str | Path) -> Paper:
    """Read and check a published file; ConfigError names the file and the key."""
    from fedrepro.configfile import parse_config_text
    from fedrepro.io import read_regular

    path = Path(path)
    try:  # bounded and never blocking (a FIFO or device named as the file); nesting bounded by the parser's recursion
        text = read_regular(path, PUBLISHED_MAX_BYTES).decode("utf-8")
    except OSError as exc:  # NotRegularFile, FileTooLarge name the file themselves
        raise ConfigError(f"published paper file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"published paper file {path}: not UTF-8 text (offset {exc.start}); allowed: a published paper "
                          "file (config/papers/published/README.md)") from None
    # read as strictly as a config (issue 57): a duplicate key (the last value would silently win), a tag,
    # a non-string key, NaN or a date is refused in one line naming the key
    try:
        doc = parse_config_text(text, str(path), source=f"published paper file {path}")
    except ConfigError as exc:
        raise ConfigError(f"published paper file {path}: {exc}" if str(path) not in str(exc) else str(exc)) from None
    where = str(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("paper"), dict) or not isinstance(doc.get("tables"), dict):
        raise ConfigError(f"{where}: not a published paper file (needs 'paper' and 'tables'; see config/papers/published/README.md)")
    info = doc["paper"]
    for key in ("id", "title", "source"):
        if not info.get(key):
            raise ConfigError(f"{where}: paper.{key} is required")
    metrics = {}
    for mid, m in (doc.get("metrics") or {}).items():
        if not isinstance(m, dict) or m.get("better") not in ("higher", "lower") or m.get("unit") not in ("percent", "fraction"):
            raise ConfigError(f"{where}: metrics.{mid} needs name, better (higher|lower) and unit (percent|fraction)")
        metrics[mid] = Metric(mid, str(m.get("name", mid)), m["better"], m["unit"], int(m.get("decimals", 2)),
                              str(m.get("description", "")))
    paper = Paper(id=str(info["id"]), short=str(info.get("short") or info["id"]), title=str(info["title"]), path=path,
                  info=info, names={d: {str(k): str(v) for k, v in (doc.get("names") or {}).get(d, {}).items()} for d in DIMS},
                  metrics=metrics)
    for tid, t in doc["tables"].items():
        paper.tables[str(tid)] = _load_table(paper, str(tid), t, f"{where}: tables.{tid}")
    for fid, f in (doc.get("figures") or {}).items():
        if not isinstance(f, dict) or f.get("plot") not in PLOTS:
            raise ConfigError(f"{where}: figures.{fid}.plot must be one of {list(PLOTS)}")
        if f.get("table") is not None and f["table"] not in paper.tables:
            raise ConfigError(f"{where}: figures.{fid}.table {f['table']!r} is not a table of the paper; allowed: {sorted(paper.tables)}")
        paper.figures[str(fid)] = dict(f)
    return paper


def _load_table(paper: Paper, tid: str, t: Any, where: str) -> Table:
    if not isinstance(t, dict):
        raise ConfigError(f"{where}: must be a mapping")
    for key in ("title", "caption", "rows", "columns"):
        if key not in t:
            raise ConfigError(f"{where}: '{key}' is required")
    header = list((t["columns"] or {}).get("header") or [])
    if any(d not in DIMS for d in header):
        raise ConfigError(f"{where}: columns.header {header}; allowed dims: {list(DIMS)}")
    rows: list[Row] = []
    row_dims: set[str] | None = None
    for i, entry in enumerate(t["rows"] or []):
        w = f"{where}: rows[{i}]"
        unknown = sorted(set(entry) - set(DIMS) - {"section", "derived"})
        if unknown:
            raise ConfigError(f"{w}: unknown key(s) {unknown}; allowed: {list(DIMS)}, section, derived")
        if entry.get("derived") not in (None, "mean"):
            raise ConfigError(f"{w}: derived {entry['derived']!r}; allowed: mean")
        keys = _expand(entry, [], w)
        dims = set(keys[0])
        if row_dims is not None and dims != row_dims:
            raise ConfigError(f"{w}: every row must key the same dims ({sorted(row_dims)}), got {sorted(dims)}")
        row_dims = dims
        rows += [Row(k, entry.get("section"), entry.get("derived")) for k in keys]
    columns: list[Column] = []
    for i, group in enumerate((t["columns"] or {}).get("groups") or []):
        w = f"{where}: columns.groups[{i}]"
        unknown = sorted(set(group) - set(DIMS))
        if unknown:
            raise ConfigError(f"{w}: unknown key(s) {unknown}; allowed: {list(DIMS)}")
        for key in _expand(group, header, w):
            if set(key) & (row_dims or set()) or set(key) | (row_dims or set()) != set(DIMS):
                raise ConfigError(f"{w}: rows ({sorted(row_dims or [])}) and columns ({sorted(key)}) must key each of "
                                  f"{list(DIMS)} exactly once")
            columns.append(Column(key, tuple((d, key[d]) for d in header if d in key)))
    if not rows or not columns:
        raise ConfigError(f"{where}: needs at least one row and one column")
    metrics_used = {({**r.key, **c.key})["metric"] for r in rows for c in columns}
    missing = sorted(metrics_used - set(paper.metrics))
    if missing:
        raise ConfigError(f"{where}: metric(s) {missing} are not defined under 'metrics'")
    bold = dict(t.get("bold") or {"rule": "none"})
    if bold.get("rule") not in BOLD_RULES:
        raise ConfigError(f"{where}: bold.rule {bold.get('rule')!r}; allowed: {list(BOLD_RULES)}")
    pm = t.get("pm")
    if pm is not None and (not isinstance(pm, dict) or pm.get("kind") not in PM_KINDS):
        raise ConfigError(f"{where}: pm must be null or {{kind: seed_std|client_std, runs, assumed, note}}")
    marks = t.get("paper_marks")
    if marks is not None and (not isinstance(marks, dict) or not marks.get("source")):
        raise ConfigError(f"{where}: paper_marks must be null or {{source: where the paper's marks were read, note}}")
    names = t.get("names") or {}
    if not isinstance(names, dict) or set(names) - set(DIMS):
        raise ConfigError(f"{where}: names must map dims {list(DIMS)} to {{id: name}}")
    table = Table(paper=paper, id=tid, title=str(t["title"]), caption=str(t["caption"]), page=t.get("page"),
                  location=str(t.get("location") or ""), measure=str(t.get("measure") or ""), note=str(t.get("note") or ""),
                  pm=pm, bold=bold, rows=rows, columns=columns, header=header, cells={}, proposed=[], marks=marks,
                  names={d: {str(k): str(v) for k, v in m.items()} for d, m in names.items()},
                  per_client=bool(t.get("per_client", False)))
    allowed_marks = ["bold", *(bold.get("marks") or ["*", "†", "‡"])]
    layout = {table.key(r, c) for r in rows for c in columns}
    for i, c in enumerate(t.get("cells") or []):
        w = f"{where}: cells[{i}]"
        if not isinstance(c, dict) or any(d not in c for d in DIMS) or "value" not in c:
            raise ConfigError(f"{w}: needs {', '.join(DIMS)} and value")
        key = tuple(str(c[d]) for d in DIMS)
        if key not in layout:
            raise ConfigError(f"{w}: {dict(zip(DIMS, key))} is not a cell of the table's layout")
        if key in table.cells:
            raise ConfigError(f"{w}: duplicate cell {dict(zip(DIMS, key))}")
        for k in ("value", "pm"):
            v = c.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise ConfigError(f"{w}: {k} {v!r} is not a number")
        mark = c.get("mark")
        if mark is not None and (mark not in allowed_marks or marks is None):
            raise ConfigError(f"{w}: mark {mark!r}; allowed: {allowed_marks}, and only where the table has paper_marks "
                              f"(their source)")
        table.cells[key] = PaperCell(None if c["value"] is None else float(c["value"]),
                                     None if c.get("pm") is None else float(c["pm"]), str(c.get("note") or ""), c.get("ocr"),
                                     mark)
    row_methods = {r.key.get("method") for r in rows} | {c.key.get("method") for c in columns}
    proposed = t.get("proposed", paper.info.get("proposed") or [])
    table.proposed = [m for m in _as_list(proposed) if m in row_methods]
    return table


def published_path(paper: str, root: str | Path | None = None) -> Path:
    """config/papers/published/<paper>.yaml under `root` (the repository; default: found from
    this package or the working directory)."""
    if root is not None:
        return Path(root) / PUBLISHED_DIR / f"{paper}.yaml"
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *here.parents]:
        candidate = base / PUBLISHED_DIR / f"{paper}.yaml"
        if candidate.exists():
            return candidate
    return Path.cwd() / PUBLISHED_DIR / f"{paper}.yaml"


def find_published(paper: str, config_path: str | Path | None = None) -> Path:
    """Look beside the experiment config first (config/papers/x.yaml -> the repo above it)."""
    if config_path is not None:
        for base in Path(config_path).resolve().parents:
            candidate = base / PUBLISHED_DIR / f"{paper}.yaml"
            if candidate.exists():
                return candidate
    return published_path(paper)


# ---------------------------------------------------------------------------------------------
# The mapping onto an experiment


@dataclass(frozen=True)
class Target:
    """Where a layout cell's numbers come from: the experiment's cells and summary column."""

    label: str
    dataset: str
    partition: str
    kinds: tuple[str, ...]
    column: str
    stand_in: bool = False  # the experiment dataset differs from the paper's


@dataclass(frozen=True)
class Inventory:
    """What an experiment produces, enough to resolve a mapping (JSON-able for the rules)."""

    labels: dict[str, str]  # label -> method
    partitions: dict[str, list[str]]  # dataset -> partition labels

    def to_json(self) -> dict:
        return {"labels": self.labels, "partitions": self.partitions}

    @classmethod
    def from_json(cls, d: dict) -> "Inventory":
        return cls(dict(d["labels"]), {k: list(v) for k, v in d["partitions"].items()})

    @classmethod
    def from_experiment(cls, exp: dict) -> "Inventory":
        labels = {c["label"]: c["method"] for c in exp["cells"]}
        parts: dict[str, list[str]] = {}
        for p in exp["partitions"]:
            if p["label"] not in parts.setdefault(p["dataset"], []):  # one label per draw (partitions.<label>.draw)
                parts[p["dataset"]].append(p["label"])
        return cls(labels, parts)


_MAPPING_KEYS = {"kind", "methods", "datasets", "settings", "metrics", "readings"}


def _kinds(v: Any, where: str) -> tuple[str, ...] | None:
    from fedrepro.report.aggregate import KINDS

    if v is None:
        return None
    kinds = tuple(_as_list(v))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError(f"{where}: kind {v!r}; allowed: one of {list(KINDS)} or a list of them (first one present)")
    return kinds


def resolve_targets(table: Table, mapping: dict | None, inv: Inventory, where: str = "paper_tables") -> dict[tuple, Target]:
    """Layout cell key -> Target for every cell the mapping covers (derived rows excluded)."""
    from fedrepro.report.aggregate import TABLE_COLUMNS

    mapping = dict(mapping or {})
    unknown = sorted(set(mapping) - _MAPPING_KEYS)
    if unknown:
        raise ConfigError(f"config key '{where}': unknown key(s) {unknown}; allowed keys: {', '.join(sorted(_MAPPING_KEYS))}")
    values = {d: list(dict.fromkeys(({**r.key, **c.key})[d] for r in table.rows if not r.derived for c in table.columns))
              for d in DIMS}
    for dim, key in (("method", "methods"), ("dataset", "datasets"), ("setting", "settings"), ("metric", "metrics")):
        given = mapping.get(key) or {}
        if not isinstance(given, dict):
            raise ConfigError(f"config key '{where}.{key}' must map the paper's {dim}s; got {given!r}")
        bad = sorted(set(map(str, given)) - set(values[dim]))
        if bad:
            raise ConfigError(f"config key '{where}.{key}': {bad} not in {table.label}; allowed: {values[dim]}")
    table_kinds = _kinds(mapping.get("kind"), f"config key '{where}.kind'")

    # paper method -> (its label, or {paper setting: label} where the paper's settings are variants of
    # one method, Calibre's L_n/L_p ablation rows; its kinds)
    methods: dict[str, tuple[str | dict[str, str], tuple | None]] = {}
    for m in values["method"]:
        v = (mapping.get("methods") or {}).get(m, m if m in inv.labels else False)
        if v is False or v is None and m not in inv.labels:
            continue
        if isinstance(v, str) or v is None:
            v = {"label": v or m}
        if not isinstance(v, dict) or set(v) - {"label", "kind"}:
            raise ConfigError(f"config key '{where}.methods.{m}' has value {v!r}; allowed: a label, false, or {{label, kind}}")
        label = v.get("label", m)
        per_setting = label if isinstance(label, dict) else {None: label}
        bad = sorted(set(map(str, per_setting)) - set(values["setting"]) - {"None"})
        if bad:
            raise ConfigError(f"config key '{where}.methods.{m}.label': settings {bad} not in {table.label}; "
                              f"allowed: {values['setting']}")
        for lab in per_setting.values():
            if str(lab) not in inv.labels:
                raise ConfigError(f"config key '{where}.methods.{m}': label {lab!r} is not a method of the experiment; "
                                  f"allowed: {', '.join(inv.labels)}")
        methods[m] = ({str(k): str(x) for k, x in label.items()} if isinstance(label, dict) else str(label),
                      _kinds(v.get("kind"), f"config key '{where}.methods.{m}.kind'"))
    datasets: dict[str, str] = {}
    for d in values["dataset"]:
        v = (mapping.get("datasets") or {}).get(d, d if d in inv.partitions else False)
        if v is False or v is None:
            continue
        if str(v) not in inv.partitions:
            raise ConfigError(f"config key '{where}.datasets.{d}' has value {v!r}; allowed: the experiment's datasets "
                              f"{list(inv.partitions)}")
        datasets[d] = str(v)
    metrics: dict[str, tuple[str, tuple | None]] = {}
    for mt in values["metric"]:
        v = (mapping.get("metrics") or {}).get(mt)
        if v is None or v is False:
            continue
        if isinstance(v, str):
            v = {"column": v}
        if not isinstance(v, dict) or "column" not in v or set(v) - {"column", "kind"}:
            raise ConfigError(f"config key '{where}.metrics.{mt}' has value {v!r}; allowed: a summary column or {{column, kind}}")
        if v["column"] not in TABLE_COLUMNS:
            raise ConfigError(f"config key '{where}.metrics.{mt}.column' has value {v['column']!r}; allowed: "
                              f"{', '.join(TABLE_COLUMNS)}")
        metrics[mt] = (v["column"], _kinds(v.get("kind"), f"config key '{where}.metrics.{mt}.kind'"))
    settings_map = mapping.get("settings") or {}

    def partition(setting: str, paper_ds: str, exp_ds: str) -> str | None:
        v = settings_map.get(setting, setting)
        if isinstance(v, dict):
            v = v.get(paper_ds, v.get(exp_ds, False))
        if v is False or v is None:
            return None
        if setting in settings_map and str(v) not in inv.partitions[exp_ds]:
            raise ConfigError(f"config key '{where}.settings.{setting}': partition {v!r} is not applied to dataset "
                              f"{exp_ds!r}; allowed: {inv.partitions[exp_ds]}")
        return str(v) if str(v) in inv.partitions[exp_ds] else None

    out: dict[tuple, Target] = {}
    for row in table.rows:
        if row.derived:
            continue
        for col in table.columns:
            key = table.key(row, col)
            m, d, s, mt = key
            if m not in methods or d not in datasets or mt not in metrics:
                continue
            part = partition(s, d, datasets[d])
            if part is None:
                continue
            label, m_kinds = methods[m]
            if isinstance(label, dict):  # a label per setting
                if s not in label:
                    continue
                label = label[s]
            column, mt_kinds = metrics[mt]
            kinds = m_kinds or mt_kinds or table_kinds or DEFAULT_KINDS
            out[key] = Target(label, datasets[d], part, kinds, column, stand_in=datasets[d] != d)
    return out


def producible_kinds(method: str, spec: dict, training: dict) -> set[str]:
    """The kinds a cell of `method` on a partition `spec` with `training` writes (engine rules)."""
    from fedrepro.methods import METHODS

    cls = METHODS.entry(method).obj
    has_g, has_p = bool(getattr(cls, "has_global", True)), bool(getattr(cls, "has_personal", False))
    kinds = {k for k, ok in (("global", has_g), ("personal", has_p)) if ok}
    if spec.get("unseen_clients", 0):
        kinds |= {"unseen_global", "unseen_all_global"}
        if has_p:
            kinds.add("unseen_personal")
    for where in training.get("global_test") or []:
        kinds |= {f"{where}_global", f"{where}_hm"} | ({f"{where}_personal"} if has_p else set())
    return kinds


@dataclass
class TablePlan:
    table: Table
    mapping: dict
    targets: dict[tuple, Target]
    layout_cells: int  # non-derived layout cells
    reading: str | None = None  # a reading of the table: its mapping's `readings.<name>` (table_readings)

    @property
    def runs(self) -> list[tuple[str, str, str]]:
        """(dataset, partition, label) of every experiment cell the table needs, in layout order."""
        return list(dict.fromkeys((t.dataset, t.partition, t.label) for t in self.targets.values()))


@dataclass
class FigurePlan:
    id: str
    figure: dict
    table: Table | None
    mapping: dict
    targets: dict[tuple, Target]

    @property
    def runs(self) -> list[tuple[str, str, str]]:
        return list(dict.fromkeys((t.dataset, t.partition, t.label) for t in self.targets.values()))


@dataclass
class PaperPlan:
    paper: Paper
    reduced: bool
    inventory: Inventory
    seeds: list[int]
    tables: dict[str, TablePlan]
    figures: dict[str, FigurePlan]

    def spec(self, table: str | None = None, figure: str | None = None) -> dict:
        """The JSON the rules hand to `fedrepro paper-table` / `paper-figure`."""
        out = {"paper": self.paper.id, "reduced": self.reduced, "seeds": self.seeds,
               "inventory": self.inventory.to_json()}
        if table is not None:
            tp = self.tables[table]
            out |= {"table": tp.table.id, "mapping": tp.mapping} | ({"reading": tp.reading} if tp.reading else {})
        if figure is not None:
            fp = self.figures[figure]
            out |= {"figure": figure, "table": fp.table.id if fp.table else None, "mapping": fp.mapping}
        return out


def _figure_table_and_mapping(paper: Paper, fid: str, given: Any, tables_cfg: dict, where: str) -> tuple[Table | None, dict]:
    fig = paper.figures[fid]
    given = dict(given or {})
    tid = given.pop("table", fig.get("table"))
    if tid is not None and tid not in paper.tables:
        raise ConfigError(f"config key '{where}.table' has value {tid!r}; allowed: {sorted(paper.tables)}")
    if tid is None:
        raise ConfigError(f"config key '{where}': figure {fid} of {paper.short} has no table; name one (table: ...)")
    if tid not in tables_cfg:
        raise ConfigError(f"config key '{where}': figure {fid} draws from {tid}, which paper_tables.tables does not map")
    if given:
        raise ConfigError(f"config key '{where}': unknown key(s) {sorted(given)}; allowed keys: table")
    return paper.tables[tid], tables_cfg[tid] or {}


def plan_from_spec(paper: Paper, spec: dict) -> PaperPlan:
    """The plan a rule's --spec describes (one table or one figure)."""
    inv = Inventory.from_json(spec["inventory"])
    tables, figures = {}, {}
    tid = spec.get("table")
    if tid is not None:
        if tid not in paper.tables:
            raise ConfigError(f"--spec: table {tid!r} is not a table of {paper.short}; allowed: {sorted(paper.tables)}")
        t = paper.tables[tid]
        tables[tid] = TablePlan(t, spec["mapping"], resolve_targets(t, spec["mapping"], inv),
                                sum(1 for r in t.rows if not r.derived) * len(t.columns), spec.get("reading"))
    fid = spec.get("figure")
    if fid is not None:
        if fid not in paper.figures:
            raise ConfigError(f"--spec: figure {fid!r} is not a figure of {paper.short}; allowed: {sorted(paper.figures)}")
        t = tables[tid].table if tid in tables else None
        figures[fid] = FigurePlan(fid, paper.figures[fid], t, spec["mapping"], _figure_targets(paper.figures[fid], tables[tid].targets))
    return PaperPlan(paper, bool(spec.get("reduced")), inv, list(spec.get("seeds") or []), tables, figures)


def table_readings(tid: str, mapping: Any, paper: Paper, where: str) -> dict[str, dict]:
    """{'<table>_<name>': its mapping} of a table mapping's `readings: {<name>: {kind: K}}`: the same
    table read from another model kind (FedCRC Table II's unseen clients scored on all of their data,
    kind unseen_all_global), built and judged as a table of its own. The reading's kind replaces the
    table's `kind`; a method's own kind stays."""
    given = (mapping or {}).get("readings")
    if given is None:
        return {}
    if not isinstance(given, dict) or not given:
        raise ConfigError(f"config key '{where}.readings' has value {show(given)}; allowed: {{name: {{kind: K}}}}")
    out = {}
    for name, entry in given.items():
        w = f"{where}.readings.{name}"
        key = f"{tid}_{name}"
        if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_]{0,31}", name) or name == "tests" or key in paper.tables:
            raise ConfigError(f"config key '{w}': name {show(name)}; allowed: lower-case letters, digits and _ (at most 32), "
                              f"not 'tests' and not making another table's id")
        if not isinstance(entry, dict) or set(entry) != {"kind"}:
            raise ConfigError(f"config key '{w}' has value {show(entry)}; allowed: {{kind: K}}")
        _kinds(entry["kind"], f"config key '{w}.kind'")
        out[key] = {k: v for k, v in mapping.items() if k != "readings"} | {"kind": entry["kind"]}
    return out


def _figure_targets(fig: dict, targets: dict[tuple, Target]) -> dict[tuple, Target]:
    only = fig.get("methods")
    return {k: t for k, t in targets.items() if only is None or k[0] in only}


def plan_paper_tables(config: dict, exp: dict, published: str | Path | None = None, root: str | Path | None = None,
                      config_path: str | Path | None = None) -> PaperPlan | None:
    """Resolve and check the config's `paper_tables` (None when it has none).

    Raises ConfigError where a mapped cell is not produced by the experiment (unknown label,
    a partition not applied to the dataset, a kind the method or partition does not write)
    and, unless `reduced: true`, where a layout cell is not mapped at all.
    """
    pt = config.get("paper_tables")
    if not pt:
        return None
    where = "paper_tables"
    paper_id = pt.get("paper")
    if published is None:
        published = published_path(paper_id, root) if root is not None else find_published(paper_id, config_path)
    if not Path(published).exists():
        raise ConfigError(f"config key '{where}.paper' has value {paper_id!r}: no published file {published}; "
                          f"the papers are in {PUBLISHED_DIR}/")
    paper = load_published(published)
    if paper.id != paper_id:
        raise ConfigError(f"config key '{where}.paper' has value {paper_id!r} but {published} is paper {paper.id!r}")
    reduced = bool(pt.get("reduced", False))
    inv = Inventory.from_experiment(exp)
    cells = {(c["dataset"], c["partition"], c["label"]): c for c in exp["cells"]}
    specs = {(p["dataset"], p["label"]): p["spec"] for p in exp["partitions"]}
    tables_cfg = pt.get("tables") or {}
    tables: dict[str, TablePlan] = {}
    for tid, mapping in tables_cfg.items():
        w = f"{where}.tables.{tid}"
        if tid not in paper.tables:
            raise ConfigError(f"config key '{w}': {paper.short} has no table {tid!r}; allowed: {', '.join(paper.tables)}")
        table = paper.tables[tid]

        def produced(targets: dict[tuple, Target], w: str) -> dict[tuple, Target]:
            for key, t in targets.items():
                c = cells.get((t.dataset, t.partition, t.label))
                if c is None:  # resolve_targets checked label, dataset and partition separately
                    raise ConfigError(f"config key '{w}': cell {dict(zip(DIMS, key))} needs {t.dataset}/{t.partition}/{t.label}, "
                                      f"which the experiment does not run")
                have = producible_kinds(c["method"], specs[(t.dataset, t.partition)], c["training"])
                if not set(t.kinds) & have:
                    raise ConfigError(f"config key '{w}': cell {dict(zip(DIMS, key))} reads kind {list(t.kinds)} of "
                                      f"{t.dataset}/{t.partition}/{t.label} (method {c['method']}), which writes only {sorted(have)}")
            return targets

        targets = produced(resolve_targets(table, mapping, inv, w), w)
        n_layout = sum(1 for r in table.rows if not r.derived) * len(table.columns)
        if not reduced and len(targets) < n_layout:
            missing = [dict(zip(DIMS, table.key(r, c))) for r in table.rows if not r.derived for c in table.columns
                       if table.key(r, c) not in targets]
            raise ConfigError(f"config key '{w}': {len(missing)} of {n_layout} cells of {table.label} are not produced by "
                              f"the experiment, e.g. {missing[:3]}; map them, or set paper_tables.reduced: true")
        if not targets:
            raise ConfigError(f"config key '{w}': no cell of {table.label} is produced by the experiment")
        tables[tid] = TablePlan(table, mapping or {}, targets, n_layout)
        for key, variant in table_readings(tid, mapping, paper, w).items():
            reading = key[len(tid) + 1:]
            rw = f"{w}.readings.{reading}"
            tables[key] = TablePlan(table, variant, produced(resolve_targets(table, variant, inv, rw), rw), n_layout, reading)
    if not tables:
        raise ConfigError(f"config key '{where}.tables': name at least one of {', '.join(paper.tables)}")
    figures: dict[str, FigurePlan] = {}
    for fid, given in (pt.get("figures") or {}).items():
        w = f"{where}.figures.{fid}"
        if fid not in paper.figures:
            raise ConfigError(f"config key '{w}': {paper.short} has no figure {fid!r}; allowed: {', '.join(paper.figures) or '(none)'}")
        table, mapping = _figure_table_and_mapping(paper, fid, given, tables_cfg, w)
        targets = _figure_targets(paper.figures[fid], tables[table.id].targets)
        if not targets:
            raise ConfigError(f"config key '{w}': none of the figure's methods {paper.figures[fid].get('methods')} is mapped")
        figures[fid] = FigurePlan(fid, paper.figures[fid], table, mapping, targets)
    unknown = sorted(set(pt) - {"paper", "reduced", "tables", "figures"})
    if unknown:
        raise ConfigError(f"config key '{where}': unknown key(s) {unknown}; allowed keys: figures, paper, reduced, tables")
    return PaperPlan(paper, reduced, inv, list(config.get("seeds") or []), tables, figures)


def coverage_lines(plan: PaperPlan) -> list[str]:
    """One line per table: how many of its cells the experiment produces."""
    lines = []
    for tid, tp in plan.tables.items():
        what = "reduced stand-in, paper values for reference" if plan.reduced else "every cell"
        lines.append(f"paper table {plan.paper.id}_{tid} ({tp.table.label}): {len(tp.targets)} of {tp.layout_cells} cells "
                     f"from {len(tp.runs)} run(s) x {len(plan.seeds)} seed(s) ({what})")
    for fid, fp in plan.figures.items():
        lines.append(f"paper figure {plan.paper.id}_{fid}: from {fp.table.label if fp.table else '-'}, {len(fp.runs)} run(s)")
    return lines
