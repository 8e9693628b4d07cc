"""Opt-in experiment tracking: every per-round value a cell records, as TensorBoard event files.

The experiment's `tracking: {tensorboard: true}` makes the workflow set FEDREPRO_TENSORBOARD_DIR
(results/<experiment>/tensorboard, fedrepro.planning.set_job_environment, beside the status folder) for every
job it starts, locally or on SLURM; a training process then writes its cell's scalars, live, to
<dir>/<dataset>/<partition>/<label>[/<trial>]/seed<seed>/ (`tensorboard --logdir results/<experiment>`
shows every cell as one run). `fedrepro train` by hand: set the variable yourself.

Series (step = round), the same numbers as metrics.json:
- `train_loss` and `comm/bytes_up`, `comm/bytes_down` every round (train_loss_per_round, communication);
- `test/<kind>_<acc|f1>/<stat>` at every evaluated round (curves; a round whose personalized model
  was not scored has no point, as its `null` in metrics.json);
- `final/<key>/<stat>` once, at the last round: the summary entries that have no curve (unseen
  clients, global test sets, client types).

A side channel like fedrepro.progress: nothing here is read by training, metrics.json or the cell
hashes. Event files are written with tensorboardX (a writer only; view them with `tensorboard`).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from .progress import cell_name
from .registry import ConfigError

TENSORBOARD_DIR_ENV = "FEDREPRO_TENSORBOARD_DIR"
TRACKING_DEFAULTS = {"tensorboard": False}


def check_available(where: str = "config key 'tracking.tensorboard'") -> None:
    """ConfigError before any job runs when the event-file writer is not installed."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        raise ConfigError(f"{where} is true but tensorboardX is not installed; allowed: false, or install it "
                          f"(`pip install 'fedrepro[tracking]'`; workflow/envs/requirements.lock pins it)") from None


class Tracker:
    """The TensorBoard run of one training process (does nothing without FEDREPRO_TENSORBOARD_DIR)."""

    def __init__(self, cell: dict | None, initial: int = 0):
        root = os.environ.get(TENSORBOARD_DIR_ENV)
        self.writer = None
        if not root or not cell:
            return
        from tensorboardX import SummaryWriter

        # purge_step: a resumed cell's rounds after its checkpoint replace those the killed process logged
        self.writer = SummaryWriter(logdir=str(Path(root) / cell_name(cell)), purge_step=initial + 1 if initial else None,
                                    flush_secs=10)

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            self.writer.add_scalar(tag, float(value), step)

    def round(self, r: int, train_loss: float, bytes_up: int, bytes_down: int,
              stats: dict[str, dict[str, float]] | None) -> None:
        """Round r's values; `stats` (fedrepro.engine.record.summaries of the test split) at an evaluated round."""
        if self.writer is None:
            return
        try:
            self._scalar("train_loss", train_loss, r)
            self._scalar("comm/bytes_up", bytes_up, r)
            self._scalar("comm/bytes_down", bytes_down, r)
            for name, by_stat in (stats or {}).items():
                for stat, v in by_stat.items():
                    self._scalar(f"test/{name}/{stat}", v, r)
            if stats:
                self.writer.flush()  # live: an evaluation is on disk at once
        except OSError as exc:  # tracking must never stop training
            self._give_up(exc)

    def final(self, metrics: dict) -> None:
        """The summary entries without a curve, at the last round; then the files are closed."""
        if self.writer is None:
            return
        try:
            for key, by_stat in metrics["summary"].items():
                if key not in metrics["curves"] and isinstance(by_stat, dict):
                    for stat, v in by_stat.items():
                        self._scalar(f"final/{key}/{stat}", v, metrics["rounds"])
            self.writer.close()
        except OSError as exc:
            self._give_up(exc)
        self.writer = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _give_up(self, exc: OSError) -> None:
        print(f"[fedrepro] TensorBoard events not written: {exc}", file=sys.stderr)
        self.writer = None
