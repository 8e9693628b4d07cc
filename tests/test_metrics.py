"""Evaluation arithmetic against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedrepro.metrics import STATS, accuracy, macro_f1, summarize, worst_fraction_mean

# A 10-class problem where one client's test split only shows classes 0..3:
#   index   0 1 2 3 4 5
#   y_true  0 0 1 1 1 2
#   y_pred  0 1 1 1 2 3
Y_TRUE = np.array([0, 0, 1, 1, 1, 2])
Y_PRED = np.array([0, 1, 1, 1, 2, 3])
# accuracy: indices 0, 2, 3 are right -> 3/6 = 0.5
# macro-F1 over the classes present in y_true or y_pred = {0, 1, 2, 3} (not all 10):
#   class 0: TP=1 (i0), FP=0, FN=1 (i1)          -> P=1,   R=1/2, F1 = 2*1*(1/2)/(3/2) = 2/3
#   class 1: TP=2 (i2,i3), FP=1 (i1), FN=1 (i4)  -> P=2/3, R=2/3, F1 = 2/3
#   class 2: TP=0, FP=1 (i4), FN=1 (i5)          -> F1 = 0
#   class 3: TP=0, FP=1 (i5), FN=0 (never true)  -> P=0, R=0/0 := 0, F1 = 0
#   mean = (2/3 + 2/3 + 0 + 0) / 4 = 1/3   (averaging over all 10 classes would give 4/30)
HAND_MACRO_F1 = 1 / 3


def test_accuracy_hand_computed():
    assert accuracy(Y_TRUE, Y_PRED) == pytest.approx(0.5)
    assert accuracy(Y_TRUE, Y_TRUE) == 1.0
    assert accuracy(np.array([1, 2, 3, 4]), np.array([1, 0, 0, 0])) == pytest.approx(0.25)


def test_macro_f1_hand_computed():
    assert macro_f1(Y_TRUE, Y_PRED) == pytest.approx(HAND_MACRO_F1, abs=1e-12)
    assert macro_f1(Y_TRUE, Y_TRUE) == pytest.approx(1.0)


def test_macro_f1_second_example():
    # y_true 0 0 0 0 1 1, y_pred 0 0 0 1 1 0
    #   class 0: TP=3, FP=1, FN=1 -> P=3/4, R=3/4, F1=3/4
    #   class 1: TP=1, FP=1, FN=1 -> P=1/2, R=1/2, F1=1/2
    #   mean = 5/8
    assert macro_f1(np.array([0, 0, 0, 0, 1, 1]), np.array([0, 0, 0, 1, 1, 0])) == pytest.approx(5 / 8)


def test_empty_split_scores_are_nan():
    empty = np.array([], dtype=np.int64)
    assert math.isnan(accuracy(empty, empty))
    assert math.isnan(macro_f1(empty, empty))


def test_summarize_hand_computed():
    values = [0.5, 0.8, float("nan"), 0.9, 0.6]
    weights = [10, 30, 50, 20, 40]  # the NaN client's weight must not count
    out = summarize(values, weights)
    assert set(out) == set(STATS)
    # kept: v = .5 .8 .9 .6 with w = 10 30 20 40
    assert out["weighted_mean"] == pytest.approx((0.5 * 10 + 0.8 * 30 + 0.9 * 20 + 0.6 * 40) / 100)  # 0.71
    assert out["weighted_mean"] == pytest.approx(0.71)
    assert out["mean"] == pytest.approx(0.7)
    # deviations -.2 .1 .2 -.1 -> squares sum .10 -> /4 (ddof=0) = .025
    assert out["std"] == pytest.approx(math.sqrt(0.025))
    assert out["std"] != pytest.approx(math.sqrt(0.10 / 3))  # not the sample std
    assert out["min"] == pytest.approx(0.5)
    assert out["max"] == pytest.approx(0.9)
    assert out["worst10"] == pytest.approx(0.5)  # ceil(0.1 * 4) = 1 value


def test_summarize_weighted_differs_from_unweighted():
    out = summarize([1.0, 0.0], [3, 1])
    assert out["weighted_mean"] == pytest.approx(0.75)
    assert out["mean"] == pytest.approx(0.5)
    assert out["std"] == pytest.approx(0.5)


def test_summarize_all_nan():
    out = summarize([float("nan"), float("nan")], [0, 0])
    assert set(out) == set(STATS)
    assert all(math.isnan(v) for v in out.values())


@pytest.mark.parametrize("n,k", [(1, 1), (9, 1), (10, 1), (11, 2), (20, 2), (25, 3), (30, 3), (31, 4)])
def test_worst10_takes_ceil_tenth(n, k):
    # values 1..n shuffled: the lowest k values are 1..k, whose mean is (k + 1) / 2
    values = np.random.default_rng(n).permutation(np.arange(1, n + 1)).astype(float)
    assert worst_fraction_mean(values) == pytest.approx((k + 1) / 2)
    assert summarize(values, np.ones(n))["worst10"] == pytest.approx((k + 1) / 2)


def test_worst10_ignores_nan_clients():
    # 11 scores + 2 NaN: ceil(1.1) = 2 lowest of the 11 -> (0.1 + 0.2) / 2
    values = np.array([0.5, np.nan, 0.2, 0.9, 0.7, 0.1, np.nan, 0.8, 0.6, 0.4, 0.3, 0.95, 0.85])
    assert worst_fraction_mean(values) == pytest.approx(0.15)
    out = summarize(values, np.arange(len(values)) + 1)
    assert out["worst10"] == pytest.approx(0.15)
    assert out["min"] == pytest.approx(0.1)
    assert out["max"] == pytest.approx(0.95)
    assert not math.isnan(out["weighted_mean"]) and not math.isnan(out["std"])


def test_worst_fraction_other_fraction():
    values = np.array([4.0, 1.0, 3.0, 2.0])
    assert worst_fraction_mean(values, fraction=0.5) == pytest.approx(1.5)
    assert math.isnan(worst_fraction_mean(np.array([np.nan])))
