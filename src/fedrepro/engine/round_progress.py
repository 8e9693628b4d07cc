"""What a running cell shows while it trains: the round progress.

Owns the per-round report of the loop: a tqdm bar on a terminal, one line per round in a log
file (Snakemake logs are files), and the side channels fed from the same call: the workflow's
status file and console lines (fedrepro.progress) and, with tracking on, TensorBoard scalars
(fedrepro.tracking). None of it touches the results.
"""

from __future__ import annotations

import sys

from ..progress import CellProgress
from ..tracking import Tracker


class RoundProgress:
    """Round progress with the current accuracy: a tqdm bar on a terminal, one line per
    round in a log file (Snakemake logs are files); under the workflow also a status file and
    compact console lines (fedrepro.progress), and with tracking on, TensorBoard scalars
    (fedrepro.tracking): side channels that never touch the results."""

    def __init__(self, total: int, initial: int, enabled: bool, cell: dict | None = None):
        self.total, self.enabled, self.last = total, enabled, ""
        self.bar = None
        self.live = CellProgress(cell, total, initial)
        self.track = Tracker(cell, initial)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="rounds", file=sys.stderr)

    def update(self, r: int, acc: dict[str, float] | None, loss: float, stats: dict | None = None, up: int = 0,
               down: int = 0) -> None:
        self.live.update(r, acc, loss)
        self.track.round(r, loss, up, down, stats)
        if not self.enabled:
            return
        if acc:
            self.last = ", ".join(f"{kind} acc {v:.4f}" for kind, v in acc.items()) + f" (evaluated at round {r})"
        text = f"loss {loss:.4f}" + (f", {self.last}" if self.last else "")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            print(f"[fedrepro] round {r}/{self.total}: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.live.close()
        if self.bar is not None:
            self.bar.close()
