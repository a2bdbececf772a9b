"""Tests for specav.evaluation.metrics: hand cases, scikit-learn as the oracle, properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from specav.evaluation.metrics import (
    auc,
    average_ranks,
    calibration_gap,
    ece,
    log_loss,
    measure,
    reliability_table,
)


# ---- AUC -------------------------------------------------------------------------------------

def test_auc_hand_cases() -> None:
    assert auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    # one tie between an accepted and a rejected slot counts one half: (3 + 0.5) / 4
    assert auc([0.1, 0.5, 0.5, 0.9], [0, 0, 1, 1]) == pytest.approx(3.5 / 4)
    # all scores tied: no information
    assert auc([0.3] * 6, [0, 1, 0, 1, 1, 0]) == 0.5


def test_auc_one_class_is_nan() -> None:
    assert math.isnan(auc([0.1, 0.2, 0.3], [1, 1, 1]))
    assert math.isnan(auc([0.1, 0.2, 0.3], [0, 0, 0]))
    assert math.isnan(auc([], []))


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_sklearn_random(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 5000
    y = rng.integers(0, 2, n)
    # coarse rounding forces many ties
    s = np.round(rng.normal(size=n) + 0.7 * y, 1 if seed % 2 else 3)
    assert auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_average_ranks_ties() -> None:
    np.testing.assert_array_equal(average_ranks([10, 20, 20, 5]), [2.0, 3.5, 3.5, 1.0])


def test_auc_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="labels"):
        auc([0.1, 0.2], [0, 2])
    with pytest.raises(ValueError, match="entries"):
        auc([0.1, 0.2, 0.3], [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        auc([0.1, float("nan")], [0, 1])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-5, 5), st.booleans()), min_size=2, max_size=40),
)
def test_auc_properties(pairs: list[tuple[int, bool]]) -> None:
    s = np.array([p[0] for p in pairs], dtype=float)
    y = np.array([p[1] for p in pairs], dtype=int)
    a = auc(s, y)
    if y.min() == y.max():
        assert math.isnan(a)
        return
    assert 0.0 <= a <= 1.0
    assert a + auc(-s, y) == pytest.approx(1.0)
    assert auc(np.exp(s), y) == pytest.approx(a)  # invariant under monotone maps
    assert a == pytest.approx(roc_auc_score(y, s))


# ---- log-loss --------------------------------------------------------------------------------

def test_log_loss_hand_case() -> None:
    expected = -(math.log(0.8) + math.log(1 - 0.4)) / 2
    assert log_loss([0.8, 0.4], [1, 0]) == pytest.approx(expected)
    # single class is fine for log-loss
    assert log_loss([0.5, 0.5], [1, 1]) == pytest.approx(math.log(2))


def test_log_loss_clips() -> None:
    assert log_loss([0.0], [1], eps=1e-12) == pytest.approx(-math.log(1e-12))
    assert math.isfinite(log_loss([1.0, 0.0], [0, 1]))


@pytest.mark.parametrize("seed", range(5))
def test_log_loss_matches_sklearn_random(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    n = 4000
    p = rng.uniform(0.01, 0.99, n)
    y = (rng.uniform(size=n) < p).astype(int)
    assert log_loss(p, y) == pytest.approx(sk_log_loss(y, p), rel=1e-12)


def test_log_loss_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        log_loss([1.2], [1])


# ---- ECE and calibration ---------------------------------------------------------------------

def test_ece_hand_computation() -> None:
    # 4 bins on [0, 1]: [0, .25), [.25, .5), [.5, .75), [.75, 1]
    p = np.array([0.1, 0.2, 0.3, 0.6, 0.7, 0.9, 1.0])
    y = np.array([0, 1, 0, 1, 1, 1, 0])
    # bin0: conf .15 acc .5 n2; bin1: conf .3 acc 0 n1; bin2: conf .65 acc 1 n2; bin3: conf .95 acc .5 n2
    expected = (2 * 0.35 + 1 * 0.3 + 2 * 0.35 + 2 * 0.45) / 7
    assert ece(p, y, bins=4) == pytest.approx(expected)
    table = reliability_table(p, y, bins=4)
    np.testing.assert_array_equal(table.count, [2, 1, 2, 2])
    np.testing.assert_allclose(table.mean_confidence, [0.15, 0.3, 0.65, 0.95])
    np.testing.assert_allclose(table.observed_acceptance, [0.5, 0.0, 1.0, 0.5])
    assert table.total == 7


def test_ece_empty_bins_and_perfect_calibration() -> None:
    table = reliability_table([0.05, 0.05], [0, 0], bins=10)
    assert table.count[0] == 2 and table.count[1:].sum() == 0
    assert math.isnan(table.mean_confidence[5])
    assert ece([0.05, 0.05], [0, 0], bins=10) == pytest.approx(0.05)
    rng = np.random.default_rng(3)
    p = rng.uniform(size=200_000)
    y = rng.uniform(size=p.size) < p
    assert ece(p, y) < 0.01


def test_ece_rejects_bad_bins() -> None:
    with pytest.raises(ValueError, match="bins"):
        ece([0.5], [1], bins=0)


def test_calibration_gap_and_measure() -> None:
    p = np.array([0.9, 0.8, 0.7, 0.6])
    y = np.array([1, 0, 1, 0])
    assert calibration_gap(p, y) == pytest.approx(0.75 - 0.5)
    m = measure(p, y, bins=5)
    assert m.n == 4
    assert m.auc == pytest.approx(roc_auc_score(y, p))
    assert m.log_loss == pytest.approx(sk_log_loss(y, p))
    assert m.calibration_gap == pytest.approx(0.25)
    assert math.isnan(calibration_gap([], []))
