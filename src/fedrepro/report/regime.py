"""Is a stand-in in its paper's regime? A stand-in can only test a paper's claim if its baselines
behave as the paper's do, so before any verdict on the proposed method the baselines' means are
held against the paper's published values for the same baseline rows of the headline column:

* four or more baselines: the rank agreement, Spearman ρ ≥ 0.6 or Kendall τ ≥ 0.45, and Local and
  FedAvg (where both sides have them) rank where the paper ranks them, within one place;
* two or three baselines: the order is the paper's, exactly (a rank correlation over so few
  points says nothing);
* one: its order is trivially the paper's; none (no row with both values): the regime is
  unchecked and nothing is judged.

The thresholds are this project's conventions (issue 45), not a statistical test. Where the check
disagrees, the paper tables (report/paper_tables.py) and the readings ledgers (report/readings.py)
print "not judged: regime differs" instead of a verdict.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from scipy import stats

RHO_MIN = 0.6  # Spearman ρ at least this ...
TAU_MIN = 0.45  # ... or Kendall τ at least this
RANK_SLACK = 1  # Local and FedAvg within this many places of the paper's rank
MIN_BASELINES = 4  # below this, the order must be the paper's
ANCHORS = ("local", "fedavg")  # the baselines whose place is checked on its own
REGIME_DIFFERS = "not judged: regime differs"
REGIME_UNCHECKED = "not judged: regime unchecked"


@dataclass(frozen=True)
class Baseline:
    """One baseline row of the headline column: its id (the paper's method id), name, our mean
    and the paper's value, both in the paper's unit."""

    id: str
    name: str
    ours: float
    paper: float


@dataclass(frozen=True)
class Regime:
    baselines: tuple[Baseline, ...]
    better: str  # higher | lower
    rho: float  # Spearman ρ of ours against the paper's (NaN: undefined)
    tau: float  # Kendall τ
    places: dict  # anchor id -> (our place, the paper's place), 1 = best
    agrees: bool | None  # None: no baseline with both values, unchecked
    reason: str  # why it differs (or is unchecked); "" where it agrees

    @property
    def verdict_block(self) -> str | None:
        """What replaces a verdict: None where the regime agrees."""
        if self.agrees:
            return None
        return REGIME_UNCHECKED if self.agrees is None else REGIME_DIFFERS

    def order(self, side: str) -> list[str]:
        """The baselines' names, best first, by our means or by the paper's values."""
        sign = -1.0 if self.better == "higher" else 1.0
        return [b.name for b in sorted(self.baselines, key=lambda b: sign * getattr(b, side))]

    def text(self) -> str:
        """One line: the statistics, the two orders, the anchors' places and the outcome."""
        n = len(self.baselines)
        if n == 0:
            return f"unchecked: {self.reason}"
        if n == 1:
            return f"one baseline ({self.baselines[0].name}): its order is trivially the paper's: agrees"
        corr = f"Spearman ρ = {_num(self.rho)}, Kendall τ = {_num(self.tau)} over {n} baselines"
        orders = f"ours {' > '.join(self.order('ours'))}; the paper's {' > '.join(self.order('paper'))}"
        places = "; ".join(f"{_anchor_name(self, a)} {o} (paper {p})" for a, (o, p) in self.places.items())
        outcome = "agrees" if self.agrees else f"differs: {self.reason}"
        return f"{corr} ({orders}{'; places: ' + places if places else ''}): {outcome}"


def _num(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:+.2f}"


def _anchor_name(r: Regime, anchor: str) -> str:
    return next(b.name for b in r.baselines if b.id == anchor)


def places(values: list[float], better: str) -> list[int]:
    """1-based places, best first; ties share the better place."""
    sign = -1.0 if better == "higher" else 1.0
    return [1 + sum(1 for w in values if sign * w < sign * v) for v in values]


def check(baselines: list[Baseline], better: str, decimals: int | None = None) -> Regime:
    """The regime check of one headline column (module docstring). `decimals`: both sides are
    compared as printed (the paper's decimals), so that means equal to the printed digit tie, and
    a table and a ledger of the same runs rank them alike."""
    if decimals is not None:
        baselines = [Baseline(b.id, b.name, round(b.ours, decimals), round(b.paper, decimals)) for b in baselines]
    bs = tuple(b for b in baselines if math.isfinite(b.ours) and math.isfinite(b.paper))
    n = len(bs)
    if n == 0:
        return Regime(bs, better, math.nan, math.nan, {}, None, "no baseline with both our value and the paper's")
    if n == 1:  # one baseline's order is trivially the paper's: nothing can disagree
        return Regime(bs, better, math.nan, math.nan, {}, True, "")
    ours, paper = [b.ours for b in bs], [b.paper for b in bs]
    with warnings.catch_warnings():  # constant input: the correlation is undefined (NaN), said below
        warnings.simplefilter("ignore")
        rho = float(stats.spearmanr(ours, paper).statistic)
        tau = float(stats.kendalltau(ours, paper).statistic)
    ours_places, paper_places = places(ours, better), places(paper, better)
    anchor_places = {b.id: (ours_places[i], paper_places[i]) for i, b in enumerate(bs) if b.id in ANCHORS}
    reasons = []
    if n < MIN_BASELINES:
        if ours_places != paper_places:
            reasons.append(f"with {n} baselines (< {MIN_BASELINES}) the order must be the paper's")
    else:
        if not (rho >= RHO_MIN or tau >= TAU_MIN):  # NaN fails both
            reasons.append(f"ρ < {RHO_MIN} and τ < {TAU_MIN}")
        for a, (o, p) in anchor_places.items():
            if abs(o - p) > RANK_SLACK:
                reasons.append(f"{next(b.name for b in bs if b.id == a)} is {o}, the paper's {p} (more than {RANK_SLACK} place apart)")
    return Regime(bs, better, rho, tau, anchor_places, not reasons, "; ".join(reasons))
