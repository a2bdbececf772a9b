"""The rulers for an acceptance scorer: AUC, log-loss, ECE and calibration gap.

Each is implemented once here, in numpy float64, over flat arrays of labelled
slots (label 1 = accepted, 0 = rejected; see architecture.md). The fourth ruler,
lossless, is a property of the feature, not of data, and is stated by the report.

This module owns the arithmetic only: it must not know about slot logs, scorers,
models or the engine, and it never reads files.

Conventions shared by every function:
- `scores` / `probs` and `labels` are 1-D arrays of equal length N (`# [N]`).
- labels must be 0 or 1 (any integer or boolean dtype).
- An empty input returns NaN: there is nothing to judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_BINS = 15


def _as_pair(values: np.ndarray, labels: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate and convert to (float64 values, float64 0/1 labels)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel()
    if x.shape != y.shape:
        raise ValueError(f"{what} has {x.size} entries but labels has {y.size}; pass one per labelled slot")
    if x.size and not np.all(np.isfinite(x)):
        raise ValueError(f"{what} contains NaN or infinite values; drop unscored slots before measuring")
    y = y.astype(np.float64)
    if y.size and not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 (rejected) or 1 (accepted); got other values")
    return x, y


def _check_probs(p: np.ndarray) -> None:
    if p.size and (p.min() < 0 or p.max() > 1):
        raise ValueError(f"probs must lie in [0, 1]; got range [{p.min():.4g}, {p.max():.4g}]")


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of `values` (`# [N]`), ties sharing their average rank. O(N log N)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    order = np.argsort(x)  # stability not needed: tied values share one average rank
    sorted_x = x[order]
    new_group = np.empty(x.size, dtype=bool)
    new_group[:1] = True
    np.not_equal(sorted_x[1:], sorted_x[:-1], out=new_group[1:])
    group = np.cumsum(new_group) - 1  # [N] tie-group index in sorted order
    starts = np.flatnonzero(new_group)  # 0-based first sorted index of each group
    ends = np.append(starts[1:], x.size)  # exclusive
    mean_rank = (starts + 1 + ends) / 2.0  # average of ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = mean_rank[group]
    return ranks


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a random accepted slot > a random rejected one).

    Rank-based (Mann-Whitney U) with ties counted as one half, O(N log N); equals
    scikit-learn's `roc_auc_score`. Higher scores must mean "more likely accepted"
    (pass -entropy, not entropy).

    Returns NaN when the labels hold only one class (all accepted or all rejected)
    or are empty: AUC is undefined without both an accepted and a rejected slot.
    """
    s, y = _as_pair(scores, labels, "scores")
    n_pos = float(y.sum())
    n_neg = float(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum = float(average_ranks(s) @ y)
    u = rank_sum - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


def log_loss(probs: np.ndarray, labels: np.ndarray, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood (natural log) of the labels under the confidences.

    Confidences are clipped to [eps, 1 - eps] so a confident miss costs a large but
    finite amount. Defined for a single class too; NaN for empty input.
    """
    p, y = _as_pair(probs, labels, "probs")
    _check_probs(p)
    if p.size == 0:
        return float("nan")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def calibration_gap(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean confidence minus observed acceptance rate (> 0: overconfident). NaN if empty."""
    p, y = _as_pair(probs, labels, "probs")
    _check_probs(p)
    if p.size == 0:
        return float("nan")
    return float(p.mean() - y.mean())


@dataclass(frozen=True, slots=True)
class ReliabilityTable:
    """Slots binned by confidence into fixed, equal-width bins on [0, 1].

    Bin j covers [j / bins, (j + 1) / bins); the last bin also holds confidence 1.
    Empty bins have count 0 and NaN means. All arrays are `# [bins]`.
    """

    lower: np.ndarray
    upper: np.ndarray
    count: np.ndarray  # int64
    mean_confidence: np.ndarray
    observed_acceptance: np.ndarray

    @property
    def total(self) -> int:
        return int(self.count.sum())

    @property
    def ece(self) -> float:
        """Count-weighted mean |mean confidence - observed acceptance| over non-empty bins."""
        nonempty = self.count > 0
        if not nonempty.any():
            return float("nan")
        gap = np.abs(self.mean_confidence[nonempty] - self.observed_acceptance[nonempty])
        return float(gap @ self.count[nonempty] / self.count[nonempty].sum())


def reliability_table(probs: np.ndarray, labels: np.ndarray, bins: int = DEFAULT_BINS) -> ReliabilityTable:
    """Bin slots by confidence (fixed equal-width bins on [0, 1]) for ECE and reliability plots."""
    if not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"bins = {bins!r} is invalid: allowed an integer >= 1")
    p, y = _as_pair(probs, labels, "probs")
    _check_probs(p)
    index = np.minimum((p * bins).astype(np.int64), bins - 1)  # [N]
    count = np.bincount(index, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(index, weights=p, minlength=bins) / count
        observed = np.bincount(index, weights=y, minlength=bins) / count
    edges = np.linspace(0.0, 1.0, bins + 1)
    return ReliabilityTable(edges[:-1], edges[1:], count.astype(np.int64), mean_conf, observed)


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error with `bins` fixed, equal-width bins on [0, 1].

    Bin j covers confidences [j / bins, (j + 1) / bins) (confidence 1 falls in the last
    bin). ECE = sum over non-empty bins of (slots in bin / N) * |mean confidence in bin -
    observed acceptance in bin|. NaN for empty input.
    """
    return reliability_table(probs, labels, bins).ece


@dataclass(frozen=True, slots=True)
class ScorerMetrics:
    """The data rulers for one scorer on one set of labelled slots."""

    n: int
    auc: float
    log_loss: float
    ece: float
    calibration_gap: float


def measure(probs: np.ndarray, labels: np.ndarray, bins: int = DEFAULT_BINS) -> ScorerMetrics:
    """AUC, log-loss, ECE and calibration gap of confidences `probs` against `labels`."""
    y = np.asarray(labels)
    return ScorerMetrics(
        n=int(y.size),
        auc=auc(probs, y),
        log_loss=log_loss(probs, y),
        ece=ece(probs, y, bins),
        calibration_gap=calibration_gap(probs, y),
    )
