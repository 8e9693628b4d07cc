"""Live progress of training cells, outside their logs.

A training job started by the workflow gets two environment variables (workflow/rules/train.smk):

- FEDREPRO_STATUS_FILE: a small JSON file the engine rewrites atomically after every round
  (results/<experiment>/status/<dataset>/<partition>/<label>/seed<seed>.json): round r of R,
  the last evaluated accuracies, elapsed time, an estimate of the time left, pid and host.
  `fedrepro status results/<experiment>` renders these files as a table.
- FEDREPRO_CONSOLE_FD: a file descriptor (the console Snakemake runs in) that gets one compact
  line per evaluation while the verbose per-round lines go to the job's log.

Both are side channels: nothing here is read by training, metrics.json or the cell hashes, and
the status files are not workflow outputs (nor tracked by DVC or git).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .io import write_json_atomic

STATUS_ENV = "FEDREPRO_STATUS_FILE"
CONSOLE_ENV = "FEDREPRO_CONSOLE_FD"
STATUS_SCHEMA = "fedrepro.status/1"
PLAN_FILE = "plan.json"  # results/<experiment>/status/plan.json: every cell of the run (the workflow's onstart)
_WRITE_EVERY_S = 1.0  # status file rewrites at most this often, besides evaluated and last rounds
_CONSOLE_EVERY_S = 30.0  # a console line at least this often even between evaluations


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def clock(seconds: float | None) -> str:
    """'1:02:03', '4:05' or '-'."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def cell_name(cell: dict) -> str:
    """dataset/partition/label[/trial]/seed<n>: a tuning trial's cell carries its trial id."""
    trial = f"/{cell['trial']}" if cell.get("trial") else ""
    return f"{cell.get('dataset')}/{cell.get('partition')}/{cell.get('label') or cell.get('method')}{trial}/seed{cell.get('seed')}"


class CellProgress:
    """The status file and console lines of one training process (silent without the variables)."""

    def __init__(self, cell: dict | None, total: int, initial: int):
        path = os.environ.get(STATUS_ENV)
        self.path = Path(path) if path else None
        self.console = None
        fd = os.environ.get(CONSOLE_ENV)
        if fd and fd.isdigit():
            try:
                os.fstat(int(fd))
                self.console = int(fd)
            except OSError:
                pass
        cell = cell or {}
        self.name = cell_name(cell)
        self.total, self.initial = total, initial
        self.t0 = time.monotonic()
        self.wrote = self.said = -math.inf
        self.state: dict[str, Any] = {
            "schema": STATUS_SCHEMA,
            "cell": {k: cell.get(k) for k in ("experiment", "dataset", "partition", "label", "method", "seed")},
            "state": "running", "round": initial, "rounds": total, "eval_round": None, "acc": {},
            "train_loss": None, "elapsed_s": 0.0, "eta_s": None, "pid": os.getpid(), "host": socket.gethostname(),
            "started": _now(), "updated": _now(),
        }
        self._write(force=True)
        self._say(f"started{f' (resumed after round {initial})' if initial else ''}, {total} rounds")

    def update(self, r: int, acc: dict[str, float] | None, loss: float) -> None:
        elapsed = time.monotonic() - self.t0
        done = r - self.initial
        eta = elapsed / done * (self.total - r) if done > 0 else None
        self.state.update(round=r, train_loss=loss, elapsed_s=round(elapsed, 3),
                          eta_s=None if eta is None else round(eta, 3), updated=_now())
        if acc:
            self.state.update(eval_round=r, acc={k: round(v, 6) for k, v in acc.items()})
        self._write(force=bool(acc) or r == self.total)
        if acc or r == self.total or time.monotonic() - self.said >= _CONSOLE_EVERY_S:
            self._say(f"round {r}/{self.total}" + "".join(f", {k} acc {100 * v:.2f}%" for k, v in self.state["acc"].items())
                      + (f" (round {self.state['eval_round']})" if self.state["acc"] and self.state["eval_round"] != r else "")
                      + f", loss {loss:.4f}, {clock(elapsed)} elapsed, ~{clock(eta)} left")

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

    def _say(self, text: str) -> None:
        if self.console is None:
            return
        try:
            os.write(self.console, f"[fedrepro] {self.name}: {text}\n".encode())
            self.said = time.monotonic()
        except OSError:
            self.console = None


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


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _key(c: dict) -> str:
    return f"{c.get('dataset')}/{c.get('partition')}/{c.get('label')}/seed{c.get('seed')}"


def collect(results_dir: str | Path) -> list[dict]:
    """One row per cell of results/<experiment>: state (running, finishing, done, failed, stopped,
    pending), round, rounds, accuracies, elapsed and eta. The cells are the run's plan (written when
    the workflow starts), the status files and the finished metrics.json files; metrics.json newer
    than a status file decides done/failed, a dead process (same host) makes a running cell stopped."""
    root = Path(results_dir)
    rows: dict[str, dict] = {}
    plan = _read(root / "status" / PLAN_FILE) or {}
    for c in plan.get("cells") or []:
        rows[_key(c)] = {"cell": _key(c), "state": "pending", "round": None, "rounds": c.get("rounds"), "acc": {},
                         "elapsed_s": None, "eta_s": None}
    for path in sorted((root / "status").glob("*/*/*/seed*.json")):
        s = _read(path)
        if not s or s.get("schema") != STATUS_SCHEMA:
            continue
        row = {"cell": _key(s.get("cell") or {}), **{k: s.get(k) for k in ("state", "round", "rounds", "acc", "elapsed_s", "eta_s")},
               "_mtime": path.stat().st_mtime}
        if row["state"] in ("running", "finishing") and _alive(s.get("pid"), s.get("host")) is False:
            row["state"], row["eta_s"] = "stopped", None
        rows[row["cell"]] = row
    for metrics in sorted((root / "runs").glob("*/*/*/seed*/metrics.json")):
        m = _read(metrics)
        if not m:
            continue
        key = "/".join(metrics.parent.relative_to(root / "runs").parts)
        row = rows.get(key)
        if row is not None and row.get("_mtime", -math.inf) > metrics.stat().st_mtime:
            continue  # a newer run of the cell (a rerun) is in progress
        acc = {kind: (m.get("summary") or {}).get(f"{kind}_acc", {}).get("weighted_mean") for kind in ("global", "personal")}
        rows[key] = {"cell": key, "state": "done" if m.get("status") == "ok" else "failed", "round": m.get("rounds"),
                     "rounds": (row or {}).get("rounds") or m.get("rounds"),
                     "acc": {k: v for k, v in acc.items() if isinstance(v, (int, float))},
                     "elapsed_s": ((m.get("resources") or {}).get("wall_time_s")), "eta_s": None}
    order = {"running": 0, "finishing": 0, "stopped": 1, "failed": 2, "pending": 3, "done": 4}
    return sorted(rows.values(), key=lambda r: (order.get(r["state"], 5), r["cell"]))


def render(rows: list[dict], results_dir: str | Path) -> str:
    """A compact text table: a count per state, then one line per cell."""
    if not rows:
        return f"{results_dir}: no cells yet (no status files, plan or metrics.json under it)"
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    head = f"{results_dir}: {len(rows)} cell(s): " + ", ".join(f"{n} {s}" for s, n in counts.items())
    table = [("cell", "state", "round", "global acc", "personal acc", "elapsed", "left")]
    for r in rows:
        acc = r.get("acc") or {}
        rounds = f"{r['round'] if r['round'] is not None else '-'}/{r['rounds'] if r['rounds'] is not None else '?'}"
        table.append((r["cell"], r["state"], rounds,
                      *(f"{100 * acc[k]:.2f}%" if isinstance(acc.get(k), (int, float)) else "-" for k in ("global", "personal")),
                      clock(r.get("elapsed_s")), clock(r.get("eta_s"))))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()
             for row in table]
    return "\n".join([head, "", *lines])


def write_plan(results_dir: str | Path, cells: list[dict]) -> None:
    """The cells a workflow run will train (Snakemake's onstart), so `fedrepro status` lists the pending ones."""
    keep = ("dataset", "partition", "label", "seed")
    write_json_atomic(Path(results_dir) / "status" / PLAN_FILE,
                      {"cells": [{k: c[k] for k in keep} | {"rounds": c["training"]["rounds"]} for c in cells]})
