"""Live progress of training cells, outside their logs.

The workflow sets FEDREPRO_STATUS_DIR (results/<experiment>/status, fedrepro.planning.set_job_environment,
so the rules' code is unchanged and no finished cell reruns) for every job it starts. A training
process then rewrites a small JSON file atomically after each round,
<dir>/<dataset>/<partition>/<label>[/<trial>]/seed<seed>.json: round r of R, the last evaluated
accuracies, elapsed time, an estimate of the time left, pid and host. Two readers:

- `fedrepro status results/<experiment>`: a table of running, done, failed, stopped and pending cells;
- `ConsoleWatcher`, a thread of the Snakemake process itself (its onstart): one compact console line
  per cell evaluation, start and end, while the verbose per-round lines stay in the job's log.

Side channels only: nothing here is read by training, metrics.json or the cell hashes, and the
status files are no workflow output (nor tracked by DVC or git).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence, TextIO

from .io import FileTooLarge, NotRegularFile, load_json, read_regular, write_json_atomic

STATUS_DIR_ENV = "FEDREPRO_STATUS_DIR"
STATUS_SCHEMA = "fedrepro.status/1"
PLAN_FILE = "plan.json"  # results/<experiment>/status/plan.json: every cell of the run (the workflow's onstart)
_WRITE_EVERY_S = 1.0  # status file rewrites at most this often, besides evaluated and last rounds
_HEARTBEAT_S = 60.0  # a console line for a running cell at least this often, even between evaluations
# The largest status file and plan read (a status file is < 1 KB; a plan about 100 bytes per cell):
# a larger file, a link to a device or a FIFO planted in the folder is named and skipped, never read.
STATUS_MAX_BYTES = 1 << 20
PLAN_MAX_BYTES = 64 << 20


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: The numbers a status file, plan or metrics.json may show (issue 57: a hand-edited elapsed_s of 1e300
#: printed 300 digits, one of 1e308 an 'inf' pace): a duration of at most a year (a job's elapsed
#: time, its time left), a round count of at most ROUNDS_MAX, an accuracy in [0, 1], a loss of at most
#: LOSS_MAX in magnitude. Any other number, or a non-finite one, shows as UNKNOWN and is never computed with.
SECONDS_MAX = 366 * 86400
ROUNDS_MAX = 10_000_000
LOSS_MAX = 1e9
UNKNOWN = "unknown"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def usable_seconds(value: Any) -> float | None:
    """A recorded duration as a float, None where absent or out of bounds (negative, beyond SECONDS_MAX, not finite)."""
    return float(value) if _number(value) and math.isfinite(value) and 0 <= value <= SECONDS_MAX else None


def _shown(value: Any, usable: Any, text) -> str:
    """'-' for an absent value, `text(value)` for a usable one, UNKNOWN for any other."""
    return "-" if value is None else text(value) if usable else UNKNOWN


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= ROUNDS_MAX


def _fraction(value: Any) -> bool:
    return _number(value) and math.isfinite(value) and 0 <= value <= 1


def clock(seconds: float | None) -> str:
    """'1:02:03', '4:05', '-' (absent) or 'unknown' (not a duration of at most SECONDS_MAX)."""
    if seconds is None or (_number(seconds) and math.isnan(seconds)):  # NaN: what no estimate is recorded as
        return "-"
    if usable_seconds(seconds) is None:
        return UNKNOWN
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def cell_name(cell: dict) -> str:
    """dataset/partition/label[/trial]/seed<n>: a tuning trial's cell carries its trial id."""
    trial = f"/{cell['trial']}" if cell.get("trial") else ""
    return f"{cell.get('dataset')}/{cell.get('partition')}/{cell.get('label') or cell.get('method')}{trial}/seed{cell.get('seed')}"


def status_path(status_dir: str | Path, cell: dict) -> Path:
    return Path(status_dir) / f"{cell_name(cell)}.json"


class CellProgress:
    """The status file of one training process (nothing without FEDREPRO_STATUS_DIR)."""

    def __init__(self, cell: dict | None, total: int, initial: int):
        cell = cell or {}
        root = os.environ.get(STATUS_DIR_ENV)
        self.path = status_path(root, cell) if root and cell else None
        self.total, self.initial = total, initial
        self.t0 = time.monotonic()
        self.wrote = -math.inf
        self.state: dict[str, Any] = {
            "schema": STATUS_SCHEMA,
            "cell": {k: cell.get(k) for k in ("experiment", "dataset", "partition", "label", "method", "trial", "seed")},
            "state": "running", "round": initial, "rounds": total, "eval_round": None, "acc": {},
            "train_loss": None, "elapsed_s": 0.0, "eta_s": None, "pid": os.getpid(), "host": socket.gethostname(),
            "started": _now(), "updated": _now(),
        }
        self._write(force=True)

    def update(self, r: int, acc: dict[str, float] | None, loss: float) -> None:
        if self.path is None:
            return
        elapsed = time.monotonic() - self.t0
        done = r - self.initial
        eta = elapsed / done * (self.total - r) if done > 0 else None
        self.state.update(round=r, train_loss=loss, elapsed_s=round(elapsed, 3),
                          eta_s=None if eta is None else round(eta, 3), updated=_now())
        if acc:
            self.state.update(eval_round=r, acc={k: round(v, 6) for k, v in acc.items()})
        self._write(force=bool(acc) or r == self.total)

    def close(self) -> None:
        """The rounds are done: what is left is the final evaluation and writing metrics.json."""
        self.state.update(state="finishing", updated=_now())
        self._write(force=True)

    def _write(self, force: bool) -> None:
        if self.path is None or (not force and time.monotonic() - self.wrote < _WRITE_EVERY_S):
            return
        try:
            write_json_atomic(self.path, self.state)
            self.wrote = time.monotonic()
        except OSError as exc:  # progress must never stop training
            print(f"[fedrepro] status file {self.path} not written: {exc}", file=sys.stderr)
            self.path = None


def console_line(s: dict) -> str:
    """'[fedrepro] d/p/label/seed0: round 40/100, global acc 71.20% (round 40), loss 0.4, 1:02 elapsed, ~1:30 left'."""
    acc = "".join(f", {k} acc {percent(v)}" for k, v in (s.get("acc") or {}).items())
    if acc and s.get("eval_round") != s.get("round"):
        acc += f" (round {round_count(s.get('eval_round'))})"
    loss = s.get("train_loss")
    loss = f", loss {loss:.4f}" if _number(loss) and math.isfinite(loss) and abs(loss) <= LOSS_MAX else \
        f", loss {UNKNOWN}" if _number(loss) else ""
    what = {"running": "round", "finishing": "trained"}.get(s.get("state"), s.get("state"))
    left = f", ~{clock(s.get('eta_s'))} left" if s.get("state") == "running" and s.get("eta_s") is not None else ""
    return (f"[fedrepro] {cell_name(s.get('cell') or {})}: {what} {round_count(s.get('round'))}/"
            f"{round_count(s.get('rounds'))}{acc}{loss}, {clock(s.get('elapsed_s'))} elapsed{left}")


def percent(value: Any) -> str:
    """'71.20%' of an accuracy in [0, 1], '-' absent, 'unknown' any other value."""
    return _shown(value, _fraction(value), lambda v: f"{100 * v:.2f}%")


def round_count(value: Any, absent: str = "-") -> str:
    """A round number of a status file: '-' (or `absent`) where absent, 'unknown' beyond 0..ROUNDS_MAX."""
    return absent if value is None else str(value) if _count(value) else UNKNOWN


class ConsoleWatcher:
    """Prints a compact line whenever a cell's status file shows a new evaluation or state (and
    every _HEARTBEAT_S for a running cell): the console of a Snakemake run, whose jobs write their
    own output to log files. `start()` polls in a daemon thread; `poll()` is one pass."""

    def __init__(self, status_dir: str | Path, stream: TextIO | None = None, every_s: float = 2.0):
        self.root, self.stream, self.every_s = Path(status_dir), stream, every_s
        self.seen: dict[Path, tuple] = {}
        self.said: dict[Path, float] = {}
        self.mtimes: dict[Path, float] = {}
        self.skipped: set[Path] = set()  # unreadable files already named on the console
        self.since = time.time()

    def poll(self) -> list[str]:
        lines = []
        for path in sorted(self.root.rglob("seed*.json")):
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            running = self.seen.get(path, (None,))[0] == "running"
            if mtime < self.since or (mtime == self.mtimes.get(path) and not running):
                continue  # a file of an earlier run, or unchanged
            self.mtimes[path] = mtime
            problems: list[str] = []
            s = _read(path, problems=problems)
            if problems and path not in self.skipped:
                self.skipped.add(path)
                lines.append(f"[fedrepro] status file skipped: {problems[0]}")
            if not _is_status(s):
                continue
            key = (s.get("state"), s.get("eval_round"), s.get("started"))
            beat = s.get("state") == "running" and time.monotonic() - self.said.get(path, -math.inf) >= _HEARTBEAT_S
            if key != self.seen.get(path) or beat:
                self.seen[path], self.said[path] = key, time.monotonic()
                lines.append(console_line(s))
        return lines

    def start(self) -> None:
        def loop():
            while True:
                for line in self.poll():
                    print(line, file=self.stream or sys.stderr, flush=True)
                time.sleep(self.every_s)

        threading.Thread(target=loop, name="fedrepro-progress", daemon=True).start()


# -- reading them back: `fedrepro status` -----------------------------------------------------

def _alive(pid: Any, host: Any) -> bool | None:
    """Whether the process still runs (None: another host, cannot tell)."""
    if host != socket.gethostname() or not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: Path, limit: int = STATUS_MAX_BYTES, problems: list[str] | None = None) -> dict | None:
    """The JSON object in `path`, or None. Read bounded and without blocking (read_regular, load_json):
    a FIFO, a device, a file over `limit` bytes or invalid JSON is never read whole; it adds one line
    naming it to `problems`. A file that vanished (a finished job's cleanup) is no problem."""
    try:
        data = load_json(read_regular(path, limit))
        why = None if isinstance(data, dict) else "not a JSON object"
    except FileNotFoundError:
        return None
    except (NotRegularFile, FileTooLarge) as exc:
        why = exc.strerror
    except OSError as exc:
        why = exc.strerror or str(exc)
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        why = f"not valid JSON ({getattr(exc, 'msg', None) or type(exc).__name__})"
    if why is None:
        return data
    if problems is not None:
        problems.append(f"{path}: {why}")
    return None


def _finished(key: str, metrics: Path, rounds: Any = None, problems: list[str] | None = None) -> dict | None:
    from .custody import METRICS_MAX_BYTES

    m = _read(metrics, METRICS_MAX_BYTES, problems)
    if m is None:
        return None
    acc = {kind: _field(m, "summary", f"{kind}_acc", "weighted_mean") for kind in ("global", "personal")}
    return {"cell": key, "state": "done" if m.get("status") == "ok" else "failed", "round": m.get("rounds"),
            "rounds": rounds or m.get("rounds"), "acc": {k: v for k, v in acc.items() if isinstance(v, (int, float))},
            "elapsed_s": _field(m, "resources", "wall_time_s"), "eta_s": None}


def _field(doc: Any, *keys: str) -> Any:
    """doc[k1][k2]..., None where a level is missing or not a mapping (a damaged file never raises)."""
    for k in keys:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def _is_status(s: Any) -> bool:
    """A status file as CellProgress writes it, as far as the readers rely on its fields' types."""
    return (isinstance(s, dict) and s.get("schema") == STATUS_SCHEMA and isinstance(s.get("cell"), dict)
            and isinstance(s.get("state"), str) and isinstance(s.get("acc") or {}, dict))


def collect(results_dir: str | Path, problems: list[str] | None = None) -> list[dict]:
    """One row per cell of results/<experiment>: state (running, finishing, done, failed, stopped,
    pending), round, rounds, accuracies, elapsed and eta. The cells are the run's plan (written when
    the workflow starts), the status files (tuning trials too) and the finished metrics.json files; a
    metrics.json at least as new as the status file decides done/failed, and a running cell whose
    process is gone (same host) is stopped. A file that cannot be read (not a regular file, too
    large, not JSON) is skipped, with a line naming it in `problems`."""
    root = Path(results_dir)
    rows: dict[str, dict] = {}
    plan = _read(root / "status" / PLAN_FILE, PLAN_MAX_BYTES, problems) or {}
    for c in (plan.get("cells") if isinstance(plan.get("cells"), list) else []):
        if not isinstance(c, dict):
            continue
        rows[cell_name(c)] = {"cell": cell_name(c), "state": "pending", "round": None, "rounds": c.get("rounds"),
                              "acc": {}, "elapsed_s": None, "eta_s": None}
    for metrics in sorted((root / "runs").glob("*/*/*/seed*/metrics.json")):
        key = "/".join(metrics.parent.relative_to(root / "runs").parts)
        rows[key] = _finished(key, metrics, (rows.get(key) or {}).get("rounds"), problems) or rows.get(key)
    for path in sorted((root / "status").rglob("seed*.json")):
        s = _read(path, problems=problems)
        if not _is_status(s):
            continue
        cell = s["cell"]
        key = cell_name(cell)
        metrics = root / ("tuning/runs" if cell.get("trial") else "runs") / key / "metrics.json"
        try:  # (the key comes from the file: a NUL byte in it is a ValueError)
            newer = metrics.exists() and metrics.stat().st_mtime >= path.stat().st_mtime
        except (OSError, ValueError):
            newer = False
        if newer:
            rows[key] = _finished(key, metrics, s.get("rounds"), problems) or rows.get(key)
            continue
        row = {"cell": key, **{k: s.get(k) for k in ("state", "round", "rounds", "acc", "elapsed_s", "eta_s")}}
        if row["state"] in ("running", "finishing") and _alive(s.get("pid"), s.get("host")) is False:
            row["state"], row["eta_s"] = "stopped", None
        rows[key] = row
    order = {"running": 0, "finishing": 0, "stopped": 1, "failed": 2, "pending": 3, "done": 4}
    return sorted((r for r in rows.values() if r), key=lambda r: (order.get(r["state"], 5), r["cell"]))


def render(rows: list[dict], results_dir: str | Path, problems: list[str] | None = None, footer: Sequence[str] = ()) -> str:
    """A compact text table: a count per state, then one line per cell; then the `footer` lines (the time
    left), then a line per file skipped."""
    skipped = [f"skipped: {p}" for p in dict.fromkeys(problems or [])]
    if not rows:
        return "\n".join([f"{results_dir}: no cells yet (no status files, plan or metrics.json under it)", *footer, *skipped])
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    head = f"{results_dir}: {len(rows)} cell(s): " + ", ".join(f"{n} {s}" for s, n in counts.items())
    table = [("cell", "state", "round", "global acc", "personal acc", "elapsed", "left")]
    for r in rows:
        acc = r.get("acc") or {}
        rounds = f"{round_count(r['round'])}/{round_count(r['rounds'], absent='?')}"
        table.append((r["cell"], r["state"], rounds, *(percent(acc.get(k)) for k in ("global", "personal")),
                      clock(r.get("elapsed_s")), clock(r.get("eta_s"))))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()
             for row in table]
    return "\n".join([head, "", *lines, *([""] + list(footer) if footer else []), *([""] + skipped if skipped else [])])


def write_plan(results_dir: str | Path, cells: list[dict], config: dict | None = None) -> None:
    """The cells a workflow run will train (Snakemake's onstart), so `fedrepro status` lists the pending
    ones, and the experiment's merged config (its --set items applied), from which `fedrepro status`
    estimates the time left (fedrepro.cost.TimeLeft): the run's own experiment, whatever config file
    was edited since."""
    keep = ("dataset", "partition", "label", "seed")
    plan = {"cells": [{k: c[k] for k in keep} | {"rounds": c["training"]["rounds"]} for c in cells]}
    try:  # the config is only for the estimate: one JSON cannot hold (a YAML date) leaves it out, never the start
        json.dumps(config, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        config = None
    write_json_atomic(Path(results_dir) / "status" / PLAN_FILE, plan | ({"config": config} if config is not None else {}))


def recorded_config(results_dir: str | Path) -> tuple[dict | None, str]:
    """The experiment config a workflow run recorded in its plan (write_plan), or None and why there is none."""
    path = Path(results_dir) / "status" / PLAN_FILE
    if not path.exists():
        return None, f"the run's config is not known: no {path} (the workflow writes it when its jobs start)"
    problems: list[str] = []
    plan = _read(path, PLAN_MAX_BYTES, problems)
    if plan is None:
        return None, f"the run's config is not known: {problems[0] if problems else f'{path} cannot be read'}"
    if not isinstance(plan.get("config"), dict):
        return None, (f"the run's config is not known: {path} records none (a run started before plans recorded it: "
                      "restarting the workflow records it)")
    return plan["config"], ""
