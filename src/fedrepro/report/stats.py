"""Statistics over seeds for the paper tables: confidence intervals, the "beyond the seed
spread" rule for our-vs-paper differences, and paired tests of the proposed method against
each baseline.

Rules (also printed under every paper table):

* Per cell: mean, sample std (ddof=1) and a 95 % Student-t confidence interval of the mean
  over the n seeds, mean ± t(0.975, n-1)·s/√n. With one seed there is no interval. `seed_stats`
  is the one function computing them; summary.json and the tables (report.aggregate.seed_table)
  build on it too.
* Our mean vs the paper's value: the difference is *beyond the seed spread* when a two-sided
  t-test at 5 % rejects "same mean". Where the paper gives only a number, that is the
  one-sample test, i.e. the paper's value lies outside our 95 % interval. Where the paper
  gives a ± that is a std over its own k runs, it is Welch's test from the two summaries
  (our n seeds, its k runs): our interval widened by the paper's own spread. A ± that is a
  spread over clients (not over runs) is not used. With one seed nothing is marked.
* Proposed method vs a baseline, same column, paired by seed (the seeds both have):
  Wilcoxon's signed-rank test (exact, two-sided) from 6 common seeds on, below that the
  paired t-test (two-sided); with fewer than 2 common seeds no test. With 5 or fewer pairs
  the signed-rank test cannot reach p < 0.05 (its smallest two-sided p is 2/2^n), hence 6.
  The signed-rank test drops zero differences; its n is the pairs it ranks.
* Degenerate cases get no p: every per-seed difference equal (the paired statistics divide by
  a zero spread), identical values over seeds against the paper's number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping

import numpy as np

LEVEL = 0.95
ALPHA = 0.05
WILCOXON_MIN_SEEDS = 6


@dataclass(frozen=True)
class SeedStats:
    """Mean, sample std, count and the Student-t interval of values over seeds."""

    n: int
    mean: float
    std: float  # ddof=1; NaN for n < 2
    level: float = LEVEL

    # The interval only when asked (the paper tables): summary.json and the tables need no t
    # quantile, so `fedrepro aggregate` and `fedrepro tables` do not import scipy.
    @cached_property
    def _margin(self) -> float:
        return t_quantile(self.n, self.level) * self.std / math.sqrt(self.n) if self.n >= 2 else math.nan

    @property
    def ci_low(self) -> float:  # NaN for n < 2
        return self.mean - self._margin

    @property
    def ci_high(self) -> float:
        return self.mean + self._margin

    @property
    def half_width(self) -> float:
        return (self.ci_high - self.ci_low) / 2


def t_quantile(n: int, level: float = LEVEL) -> float:
    """t(1 - (1 - level)/2, n - 1); NaN for n < 2."""
    if n < 2:
        return math.nan
    from scipy import stats as sps  # here: only the interval and the tests need scipy (about a second to import)

    return float(sps.t.ppf(0.5 + level / 2, n - 1))


def seed_stats(values: Iterable[float], level: float = LEVEL) -> SeedStats:
    """Stats of the finite values (NaNs, e.g. failed seeds, are left out)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    n = len(v)
    if n == 0:
        return SeedStats(0, math.nan, math.nan, level)
    mean = float(v.mean())
    return SeedStats(n, mean, float(v.std(ddof=1)) if n >= 2 else math.nan, level)


@dataclass(frozen=True)
class Deviation:
    """Our mean against the paper's value: the test used, its p-value and the mark."""

    test: str  # "one-sample t" | "Welch t" | "none"
    p: float  # NaN when no test
    beyond: bool | None  # None: not assessed (one seed, no paper value)
    reason: str = ""


def deviation(ours: SeedStats, paper: float | None, paper_std: float | None = None,
              paper_runs: int | None = None, alpha: float = ALPHA) -> Deviation:
    """Is |our mean - paper| more than the seed spread explains? (module docstring)."""
    from scipy import stats as sps  # here: see t_quantile
    if paper is None or not np.isfinite(paper) or ours.n == 0:
        return Deviation("none", math.nan, None, "no paper value" if ours.n else "no runs")
    if ours.n < 2:
        return Deviation("none", math.nan, None, "one seed: no spread to judge by")
    diff = ours.mean - paper
    var = ours.std**2 / ours.n
    use_paper = paper_std is not None and np.isfinite(paper_std) and paper_runs is not None and paper_runs >= 2
    if use_paper:
        var_p = paper_std**2 / paper_runs
        se = math.sqrt(var + var_p)
        if se == 0:  # the t statistic is undefined: no p, no mark
            return Deviation("none", math.nan, None, "no spread on either side")
        # Welch-Satterthwaite degrees of freedom
        df = (var + var_p) ** 2 / ((var**2 / (ours.n - 1) if var else 0.0) + var_p**2 / (paper_runs - 1))
        p = float(2 * sps.t.sf(abs(diff) / se, df))
        return Deviation("Welch t", p, p < alpha)
    se = math.sqrt(var)
    if se == 0:  # the t statistic is undefined: no p, no mark
        return Deviation("none", math.nan, None, "identical values over seeds: no spread to judge by")
    p = float(2 * sps.t.sf(abs(diff) / se, ours.n - 1))
    return Deviation("one-sample t", p, p < alpha)


@dataclass(frozen=True)
class PairedTest:
    """Proposed minus baseline over the common seeds."""

    test: str  # "Wilcoxon signed-rank" | "paired t" | "none"
    n: int
    mean_diff: float
    statistic: float
    p: float
    note: str = ""


def paired_test(proposed: Mapping[int, float], baseline: Mapping[int, float],
                wilcoxon_min: int = WILCOXON_MIN_SEEDS) -> PairedTest:
    """Paired test over the seeds both sides have a finite value for (module docstring)."""
    from scipy import stats as sps  # here: see t_quantile
    seeds = sorted(s for s in proposed if s in baseline and np.isfinite(proposed[s]) and np.isfinite(baseline[s]))
    d = np.asarray([proposed[s] - baseline[s] for s in seeds], dtype=float)
    n = len(d)
    if n < 2:
        return PairedTest("none", n, float(d.mean()) if n else math.nan, math.nan, math.nan,
                          f"{n} common seed(s): no test")
    mean_diff = float(d.mean())
    if np.all(d == d[0]):  # no spread in the differences: neither test is defined, so no p
        what = "all differences zero" if d[0] == 0 else "all differences equal"
        return PairedTest("none", n, mean_diff, math.nan, math.nan, what)
    if n >= wilcoxon_min:
        # the signed-rank test drops zero differences (zero_method="wilcox"): n is the pairs it ranks
        nonzero = d[d != 0]
        dropped = n - len(nonzero)
        note = f"{dropped} zero difference(s) dropped" if dropped else ""
        res = sps.wilcoxon(nonzero, alternative="two-sided", method="auto")
        return PairedTest("Wilcoxon signed-rank", len(nonzero), mean_diff, float(res.statistic), float(res.pvalue), note)
    res = sps.ttest_rel([proposed[s] for s in seeds], [baseline[s] for s in seeds])
    return PairedTest("paired t", n, mean_diff, float(res.statistic), float(res.pvalue))


# -- verdict words tied to the evidence (issue 56) ------------------------------------------------

POWER = 0.80  # the power at which the detectable difference is stated
HOLDS, CONTRADICTED, NOT_SHOWN = "holds", "contradicted", "not shown"


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (NaN entries stay NaN and are not counted)."""
    idx = sorted((i for i, p in enumerate(pvalues) if np.isfinite(p)), key=lambda i: pvalues[i])
    m, out, running = len(idx), [math.nan] * len(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


@dataclass(frozen=True)
class Evidence:
    """What a verdict on "A better than B" rests on, paired by seed, in the metric's unit and direction
    (`gain`: A - B where higher is better, B - A where lower is)."""

    n: int
    gain: float  # the mean paired gain
    ci_low: float  # its 95 % Student-t interval (NaN with fewer than 2 seeds or no spread)
    ci_high: float
    p_better: float  # P(A > B) over seeds: the share of seeds A wins, ties counting half
    detectable: float  # the smallest gain the seeds detect at POWER (two-sided, ALPHA), at least one resolution unit
    seeds_to_decide: int | None  # seeds that would detect the observed gain at the observed spread (None: never)


def evidence(a: Mapping[int, float], b: Mapping[int, float], better: str = "higher",
             resolution: float = 0.0, alpha: float = ALPHA, power: float = POWER) -> Evidence:
    """The paired evidence over the seeds both have (module docstring of issue 56's verdict words).
    `resolution`: one test sample in the metric's unit; a spread below it (identical scores) is taken
    as one resolution unit, so that a tie of 3 seeds does not claim to detect any difference."""
    from scipy import stats as sps  # here: see t_quantile

    seeds = sorted(s for s in a if s in b and np.isfinite(a[s]) and np.isfinite(b[s]))
    sign = 1.0 if better == "higher" else -1.0
    d = np.asarray([sign * (a[s] - b[s]) for s in seeds], dtype=float)
    n = len(d)
    if n == 0:
        return Evidence(0, math.nan, math.nan, math.nan, math.nan, math.nan, None)
    gain = float(d.mean())
    p_better = float((np.sum(d > 0) + 0.5 * np.sum(d == 0)) / n)
    if n < 2:
        return Evidence(n, gain, math.nan, math.nan, p_better, math.nan, None)
    s = float(d.std(ddof=1))
    margin = t_quantile(n) * s / math.sqrt(n)
    low, high = (gain - margin, gain + margin) if s > 0 else (math.nan, math.nan)
    spread = max(s, resolution)

    def detectable_at(k: int) -> float:
        return (float(sps.t.ppf(1 - alpha / 2, k - 1)) + float(sps.t.ppf(power, k - 1))) * spread / math.sqrt(k)

    detect = max(detectable_at(n), resolution) if spread > 0 else math.nan
    need = None
    if spread > 0 and abs(gain) > 0:
        need = next((k for k in range(2, 10_001) if detectable_at(k) <= abs(gain)), None)
    return Evidence(n, gain, low, high, p_better, detect, need)


def verdict_word(gain: float, p_holm: float, alpha: float = ALPHA) -> str:
    """holds (Holm-adjusted p below alpha, the gain positive), contradicted (the same, negative),
    else not shown."""
    if np.isfinite(p_holm) and p_holm < alpha and np.isfinite(gain) and gain != 0:
        return HOLDS if gain > 0 else CONTRADICTED
    return NOT_SHOWN


def holm_alpha(p: float, p_holm: float, alpha: float = ALPHA) -> float:
    """The level a test's own p must reach for its Holm-adjusted p to fall below `alpha`:
    alpha x p / p_holm (Holm multiplies the p by its step's factor), `alpha` where undefined."""
    if not (np.isfinite(p) and np.isfinite(p_holm)) or p <= 0 or p_holm <= 0:
        return alpha
    return alpha * min(1.0, p / p_holm)


def evidence_text(e: Evidence, p_holm: float, decimals: int = 2) -> str:
    """The evidence beside a verdict: gain [95 % interval], P(A > B), Holm p, detectable gain and,
    where not shown, the largest gain not excluded and the seeds that would decide."""
    f = lambda v: "n/a" if not np.isfinite(v) else f"{v:+.{decimals}f}"  # noqa: E731
    parts = [f"gain {f(e.gain)} [{f(e.ci_low)}, {f(e.ci_high)}]", f"P(A > B) {e.p_better:.2f}",
             f"Holm p {'n/a' if not np.isfinite(p_holm) else f'{p_holm:.3g}'}",
             f"detectable at {POWER:.0%} power {'n/a' if not np.isfinite(e.detectable) else f'{e.detectable:.{decimals}f}'}"]
    if verdict_word(e.gain, p_holm) == NOT_SHOWN:
        largest = e.ci_high if np.isfinite(e.ci_high) else e.detectable
        if np.isfinite(largest):
            parts.append(f"a gain up to {largest:.{decimals}f} not excluded")
        # (the t approximation may call n seeds enough where the rank test or Holm did not decide)
        parts.append(f"{max(e.seeds_to_decide, e.n + 1)} seeds would decide at this spread" if e.seeds_to_decide
                     else "no number of seeds decides a zero gain" if e.gain == 0 else "undecidable at this spread")
    return ", ".join(parts)
