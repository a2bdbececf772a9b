"""Online replay: run the acceptance estimator over a labelled-draft log in log order.

`replay_online(slots, config)` feeds the log's labelled slots to a fresh
`OnlineAcceptanceEstimator` step by step, as the engine would have, and returns each
slot's prequential confidence (scored with the parameters in force before its label was
learned) and the estimator at the end. The report uses it to measure both estimator
modes on any log, whatever estimator the log was collected with.

How a log becomes engine steps: rows come in log order (the collector writes them step
by step, request-major within a step); consecutive rows with the same (log, step) form
one engine step, and consecutive rows of one request within it form that request's draft
row: positions 1..m labelled, so m slots were verified and the accepted count is the
number of leading 1 labels. Steps are numbered from 0 in each log; a gap in the step
column (steps where nothing was labelled) counts as that many empty steps, and a step
number that does not increase (a synthetic log whose requests run one after another)
counts as one step. `trailing_steps` adds label-free steps after the last labelled one (an
engine goes on stepping after its last draft, and a refit can fall in those steps).

Speed: parameters change only at refits, so the steps between two refits are scored and
observed in one call (`OnlineAcceptanceEstimator.next_refit` says where the next refit
falls); the confidences equal those of a step-by-step replay. Work is O(N) numpy plus
one estimator call per refit.

This module owns only the replay; it must not know about models, the engine or the
report's layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from specav.acceptance.estimator import NextRefit, OnlineAcceptanceEstimator
from specav.config import EstimatorConfig


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Prequential confidences `# [N]` (NaN where a slot's feature is not finite) and the
    estimator after the whole log."""

    confidence: np.ndarray
    estimator: OnlineAcceptanceEstimator
    num_steps: int


@dataclass(frozen=True, slots=True)
class _Steps:
    """The log as engine steps: G steps holding R draft rows of K slots."""

    features: np.ndarray  # [R, K] float64, NaN where unlabelled
    num_admitted: np.ndarray  # [R] int64
    num_accepted: np.ndarray  # [R] int64
    row_start: np.ndarray  # [G + 1] first draft row of each step (cumulative)
    steps: np.ndarray  # [G] decode steps each stands for (its gap plus itself)
    labels: np.ndarray  # [G] labelled slots with a finite feature
    slot_row: np.ndarray  # [N] draft row of each slot
    slot_col: np.ndarray  # [N] position - 1


def _starts(*keys: np.ndarray) -> np.ndarray:
    """True where any key differs from the previous row (and at row 0).  # [N] bool"""
    n = keys[0].size
    new = np.zeros(n, bool)
    if n:
        new[0] = True
        for k in keys:
            new[1:] |= k[1:] != k[:-1]
    return new


def _as_steps(step: np.ndarray, request: np.ndarray, position: np.ndarray, feature: np.ndarray,
              label: np.ndarray, log: np.ndarray, num_slots: int) -> _Steps:
    new_step = _starts(log, step)
    new_row = new_step | _starts(request)
    row = np.cumsum(new_row) - 1  # [N]
    num_rows = int(row[-1]) + 1 if row.size else 0
    col = position.astype(np.int64) - 1
    features = np.full((num_rows, num_slots), np.nan)
    features[row, col] = feature
    finite = np.isfinite(feature)
    admitted = np.bincount(row, minlength=num_rows).astype(np.int64)
    # accepted = leading 1 labels of the row: the first 0 (if any) ends the accepted prefix
    first = np.flatnonzero(new_row)
    zero_at = np.where(label == 0, col, num_slots)
    first_zero = np.minimum.reduceat(zero_at, first) if num_rows else np.zeros(0, np.int64)
    accepted = np.minimum(first_zero, admitted)
    step_of_row = np.cumsum(new_step)[first] - 1  # [R]
    g_first = np.flatnonzero(new_step)
    s = step[g_first].astype(np.int64)
    first_of_log = _starts(log[g_first])
    gap = np.where(first_of_log, s + 1, np.r_[0, np.diff(s)])  # a log's steps are numbered from 0
    steps = np.maximum(gap, 1)
    labels = np.bincount(np.cumsum(new_step) - 1, finite, minlength=g_first.size)
    row_start = np.r_[np.searchsorted(step_of_row, np.arange(g_first.size)), num_rows]
    return _Steps(features, admitted, accepted, row_start, steps.astype(np.int64),
                  labels.astype(np.float64), row, col)


def replay_online(step: np.ndarray, request: np.ndarray, position: np.ndarray, feature: np.ndarray,
                  label: np.ndarray, config: EstimatorConfig = EstimatorConfig(),
                  log: np.ndarray | None = None, num_slots: int | None = None,
                  trailing_steps: int = 0) -> ReplayResult:
    """Replay the estimator over labelled slots in log order (all arrays `# [N]`).

    step: engine step of each slot; request: any per-request code (ints or strings);
    position: 1-based draft position; feature: logit(q_max); label: 1 accepted / 0 rejected;
    log: which pooled log a slot comes from (None: one log); num_slots: K (default: the
    largest position); trailing_steps: label-free decode steps after the last labelled one.
    """
    if not isinstance(trailing_steps, int) or trailing_steps < 0:
        raise ValueError(f"trailing_steps = {trailing_steps!r} is invalid: decode steps, an integer >= 0")
    n = np.asarray(label).size
    position = np.asarray(position, np.int64)
    k = int(num_slots or (position.max() if n else 1))
    if n and (position.min() < 1 or position.max() > k):
        raise ValueError(f"positions must lie in [1, K = {k}], got [{position.min()}, {position.max()}]")
    if n == 0:
        return ReplayResult(np.zeros(0), OnlineAcceptanceEstimator(k, config), 0)
    log = np.zeros(n, np.int64) if log is None else np.asarray(log)
    s = _as_steps(np.asarray(step, np.int64), np.asarray(request), position,
                  np.asarray(feature, np.float64), np.asarray(label), log, k)
    if trailing_steps:  # one more step group: its gap, and a last step with no draft row
        s = dataclasses.replace(s, steps=np.r_[s.steps, trailing_steps], labels=np.r_[s.labels, 0.0],
                                row_start=np.r_[s.row_start, s.row_start[-1]])
    est = OnlineAcceptanceEstimator(k, config)
    confidence = np.full((s.features.shape[0], k), np.nan)
    clock = _Clock(np.r_[0, np.cumsum(s.steps)], np.r_[0.0, np.cumsum(s.labels)])
    while (batch := clock.next_batch(est.next_refit())) is not None:
        first, stop, steps = batch
        rows = slice(int(s.row_start[first]), int(s.row_start[stop]))
        f = torch.from_numpy(s.features[rows])
        confidence[rows] = est.score(f).numpy()
        est.observe(f, torch.from_numpy(s.num_admitted[rows]), torch.from_numpy(s.num_accepted[rows]),
                    steps=steps)
    return ReplayResult(confidence[s.slot_row, s.slot_col], est, int(est.total_steps))


@dataclass(slots=True)
class _Clock:
    """Where the replay stands on the log's timeline of decode steps.

    Step group j covers steps (step_end[j], step_end[j + 1]]: its gap steps, then its
    labelled step at step_end[j + 1]. `group` is the next group to feed and `done` how many
    of its gap steps were fed already (a refit fell inside its gap).
    """

    step_end: np.ndarray  # [G + 1] cumulative steps
    label_end: np.ndarray  # [G + 1] cumulative labels
    group: int = 0
    done: int = 0

    def next_batch(self, nxt: NextRefit) -> tuple[int, int, int] | None:
        """(first group, stop group, steps) to feed in one call, ending at the next refit or at
        the end of the log; None when the log is used up."""
        last = self.step_end.size - 1
        if self.group >= last:
            return None
        first, now = self.group, int(self.step_end[self.group]) + self.done
        by_steps = now + nxt.steps
        j = int(np.searchsorted(self.label_end, self.label_end[first] + nxt.labels, "left")) - 1
        if j < last and self.step_end[j + 1] <= by_steps:  # enough labels first (or together)
            return self._feed(first, j + 1, 0, int(self.step_end[j + 1]) - now)
        if by_steps >= self.step_end[last]:  # no refit before the end
            return self._feed(first, last, 0, int(self.step_end[last]) - now)
        j = int(np.searchsorted(self.step_end, by_steps, "left")) - 1  # the group by_steps falls in
        if self.step_end[j + 1] == by_steps:
            return self._feed(first, j + 1, 0, nxt.steps)
        return self._feed(first, j, by_steps - int(self.step_end[j]), nxt.steps)

    def _feed(self, first: int, stop: int, done: int, steps: int) -> tuple[int, int, int]:
        self.group, self.done = stop, done
        return first, stop, steps
