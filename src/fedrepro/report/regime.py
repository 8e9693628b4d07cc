"""Is a stand-in in its paper's regime? A stand-in can only test a paper's claim if its baselines
behave as the paper's do, so before any verdict on the proposed method the baselines' means are
held against the paper's published values for the same baseline rows of the headline column:

* four or more baselines: the rank agreement, Spearman ρ ≥ 0.6 or Kendall τ ≥ 0.45, and Local and
  FedAvg (where both sides have them) rank where the paper ranks them, within one place;
* two or three baselines: the order is the paper's, exactly (a rank correlation over so few
  points says nothing);
* one or none: nothing to order, the regime is unchecked and nothing is judged.

Ties take their average place (scipy's rankdata), print as "=", and enter ρ and τ as ties. Every
baseline left out is named with why: no value on one side, or (the caller's `moving`) a row that
has not reached its plateau, whose place is not yet its own.

The thresholds are this project's conventions (issue 45), not a statistical test; how easily they
are met by chance is said beside them: the permutation p-value (issue 56) is the share of the n!
orderings of the stand-in's baselines whose Spearman ρ with the paper's values is at least the
observed one (1/120 for a perfect order of five). Above WEAK_P the check is printed "weak". Where the check
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
WEAK_P = 0.05  # a permutation p above this: the check is "weak"
EXACT_UP_TO = 8  # every ordering enumerated up to this many baselines (8! = 40320), sampled above
SAMPLED_ORDERINGS = 20_000
ANCHORS = ("local", "fedavg")  # the baselines whose place is checked on its own
REGIME_DIFFERS = "not judged: regime differs"
REGIME_UNCHECKED = "not judged: regime unchecked"
NO_OURS, NO_PAPER = "no stand-in value", "no paper value"  # why a baseline row leaves the check


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
    agrees: bool | None  # None: fewer than two baselines with both values, unchecked
    reason: str  # why it differs (or is unchecked); "" where it agrees
    perm_p: float = math.nan  # the permutation p-value of ρ (module docstring); NaN: undefined
    dropped: tuple[tuple[str, str], ...] = ()  # (name, why) of every baseline left out

    @property
    def weak(self) -> bool:
        """Agrees, but an ordering this good arises by chance more often than WEAK_P."""
        return bool(self.agrees) and not (self.perm_p <= WEAK_P)

    @property
    def missing(self) -> tuple[tuple[str, str], ...]:
        """The dropped baselines that lack a value on one side (not those left out unconverged)."""
        return tuple((name, why) for name, why in self.dropped if why in (NO_OURS, NO_PAPER))

    @property
    def switched(self) -> bool:
        """Did the missing values take the check below MIN_BASELINES, so that the stricter
        few-baseline rule (the paper's order exactly) replaced the correlation rule?"""
        n = len(self.baselines)
        return n >= 2 and n < MIN_BASELINES <= n + len(self.missing)

    def strength(self) -> str:
        """What a verdict line adds (issue 57: never a silent verdict): '' for a full check; ', on a
        weak regime check (p = 0.12)' where it is weak; the baselines it ran without, and a switch of
        rule they caused, where values are missing."""
        parts = [f"p = {self.perm_p:.2g}"] if self.weak else []
        if self.missing:
            parts.append("without " + ", ".join(f"{name} ({why})" for name, why in self.missing)
                         + (f", so the {len(self.baselines)}-baseline rule" if self.switched else ""))
        if not parts:
            return ""
        return f", on a {'weak ' if self.weak else ''}regime check ({'; '.join(parts)})"

    @property
    def verdict_block(self) -> str | None:
        """What replaces a verdict: None where the regime agrees."""
        if self.agrees:
            return None
        block = REGIME_UNCHECKED if self.agrees is None else REGIME_DIFFERS
        # the rows that left it say why it could not be checked (a row nulled in the published file)
        return block + (" (without " + ", ".join(f"{n}: {w}" for n, w in self.missing) + ")" if self.missing else "")

    def order(self, side: str) -> str:
        """The baselines' names, best first, by our means or by the paper's values; ties joined by '='."""
        sign = -1.0 if self.better == "higher" else 1.0
        ranked = sorted(self.baselines, key=lambda b: sign * getattr(b, side))
        out = ""
        for i, b in enumerate(ranked):
            if i:
                out += " = " if getattr(b, side) == getattr(ranked[i - 1], side) else " > "
            out += b.name
        return out

    def dropped_text(self) -> str:
        return "; left out: " + ", ".join(f"{name} ({why})" for name, why in self.dropped) if self.dropped else ""

    def text(self) -> str:
        """One line: the statistics, the two orders, the anchors' places, the outcome and its strength."""
        n = len(self.baselines)
        if n < 2:
            return f"unchecked: {self.reason}{self.dropped_text()}"
        corr = (f"Spearman ρ = {_num(self.rho)}, Kendall τ = {_num(self.tau)}, permutation p = {_p(self.perm_p)} "
                f"over {n} baselines")
        orders = f"ours {self.order('ours')}; the paper's {self.order('paper')}"
        places = "; ".join(f"{_anchor_name(self, a)} {_place(o)} (paper {_place(p)})" for a, (o, p) in self.places.items())
        outcome = ("agrees" + (f", weak (p = {_p(self.perm_p)} > {WEAK_P})" if self.weak else "")) if self.agrees \
            else f"differs: {self.reason}"
        if self.switched:
            outcome += (f" (the rows left out took it from {n + len(self.missing)} baselines to {n}: below "
                        f"{MIN_BASELINES} the order must be the paper's)")
        return f"{corr} ({orders}{'; places: ' + places if places else ''}{self.dropped_text()}): {outcome}"


def _num(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:+.2f}"


def _p(p: float) -> str:
    return "n/a" if not math.isfinite(p) else f"{p:.2g}"


def _place(v: float) -> str:
    return f"{v:g}"


def _anchor_name(r: Regime, anchor: str) -> str:
    return next(b.name for b in r.baselines if b.id == anchor)


def places(values: list[float], better: str) -> list[float]:
    """1-based places, best first; ties take their average place."""
    sign = -1.0 if better == "higher" else 1.0
    return [float(x) for x in stats.rankdata([sign * v for v in values], method="average")]


def permutation_p(ours: list[float], paper: list[float]) -> float:
    """The share of orderings of `ours` whose Spearman ρ with `paper` is at least the observed ρ:
    every ordering up to EXACT_UP_TO values, SAMPLED_ORDERINGS seeded draws above (NaN where ρ is
    undefined)."""
    import itertools

    import numpy as np

    r_ours, r_paper = stats.rankdata(ours), stats.rankdata(paper)
    if np.ptp(r_ours) == 0 or np.ptp(r_paper) == 0:
        return math.nan

    def rho(r: np.ndarray) -> float:
        return float(np.corrcoef(r, r_paper)[0, 1])

    observed = rho(r_ours) - 1e-12  # ties in floating point count as "at least as well"
    n = len(ours)
    if n <= EXACT_UP_TO:
        orderings = (r_ours[list(p)] for p in itertools.permutations(range(n)))
        hits = total = 0
        for r in orderings:
            hits += rho(r) >= observed
            total += 1
        return hits / total
    rng = np.random.default_rng(0)
    return float(np.mean([rho(rng.permutation(r_ours)) >= observed for _ in range(SAMPLED_ORDERINGS)]))


def check(baselines: list[Baseline], better: str, decimals: int | None = None,
          moving: frozenset[str] | set[str] = frozenset()) -> Regime:
    """The regime check of one headline column (module docstring). `decimals`: both sides are
    compared as printed (the paper's decimals), so that means equal to the printed digit tie, and
    a table and a ledger of the same runs rank them alike. `moving`: the ids of baselines that have
    not reached their plateau, left out and named."""
    if decimals is not None:
        baselines = [Baseline(b.id, b.name, round(b.ours, decimals), round(b.paper, decimals)) for b in baselines]
    dropped = []
    for b in baselines:
        if not math.isfinite(b.ours) or not math.isfinite(b.paper):
            dropped.append((b.name, NO_OURS if not math.isfinite(b.ours) else NO_PAPER))
        elif b.id in moving:
            dropped.append((b.name, "not converged"))
    bs = tuple(b for b in baselines if math.isfinite(b.ours) and math.isfinite(b.paper) and b.id not in moving)
    dropped = tuple(dropped)
    n = len(bs)
    if n == 0:
        return Regime(bs, better, math.nan, math.nan, {}, None, "no baseline with both our value and the paper's",
                      dropped=dropped)
    if n == 1:  # one baseline has no order to agree or disagree with
        return Regime(bs, better, math.nan, math.nan, {}, None, f"one baseline ({bs[0].name}): no order to check",
                      dropped=dropped)
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
                reasons.append(f"{next(b.name for b in bs if b.id == a)} is {_place(o)}, the paper's {_place(p)} (more than "
                               f"{RANK_SLACK} place apart)")
    return Regime(bs, better, rho, tau, anchor_places, not reasons, "; ".join(reasons), permutation_p(ours, paper), dropped)
