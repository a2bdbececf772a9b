"""Evaluation report of a slot log: every scorer measured with the four rulers.

`build_report(log_dir, out_dir)` reads a labelled-draft log (slot_log.py), splits it by
request into training and held-out requests, fits the offline scorers on the training
requests, measures every scorer on the held-out requests (metrics.py), and writes
`report.md` with tables and two PNG plots (reliability diagram, AUC by position).

Scorers (a registry, SCORERS): raw q_max; the online estimator's logged confidence;
the online estimator in both modes (pooled, the default, and the seed's windowed one)
replayed over the whole log in log order (replay.py), prequential like the logged one;
offline logistic fits of logit(q_max) with a shared or per-position slope and
per-position intercepts; entropy and top-2 margin (fitted and raw ranking); q_sampled
(LOSSY, reported never used); a trained confidence head on the drafter's hidden states
when the log has them.

This module owns the offline reference fits and the report layout. It reads logs only
through slot_log.py, measures only through metrics.py and runs the estimator only through
replay.py (the one place torch comes in); it must not import models or the engine.
Everything is vectorised over slots (no per-slot Python).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Callable

import numpy as np
import pyarrow as pa

from specav.config import EstimatorConfig
from specav.evaluation.metrics import DEFAULT_BINS, ScorerMetrics, auc, log_loss, measure, reliability_table
from specav.evaluation.replay import ReplayResult, replay_online
from specav.evaluation.slot_log import hidden_matrix, read_meta, read_slot_log

LogDirs = str | os.PathLike | Sequence[str | os.PathLike]  # one slot log directory, or several to pool

HELD_OUT_FRACTION = 0.3
HEAD_MAX_TRAIN_ROWS = 200_000
HEAD_MAX_TRAIN_VALUES = 40_000_000  # rows * (hidden_dim + K) cap, bounds the head fit's memory
LOGIT_CLAMP = 40.0


# ---- data ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SlotData:
    """The columns of a slot log as numpy arrays, N labelled slots (`# [N]` unless noted)."""

    request: np.ndarray  # int64 index into request_names
    request_names: np.ndarray  # [R] str
    log: np.ndarray  # int64, which of the pooled logs the slot comes from
    step: np.ndarray  # int64, engine step (log order is step order within a log)
    workload: np.ndarray  # int64 index into workload_names
    workload_names: tuple[str, ...]
    position: np.ndarray  # int64, 1-based
    label: np.ndarray  # float64 0/1
    q_max: np.ndarray  # float64
    logit_q_max: np.ndarray
    entropy: np.ndarray
    top2_margin: np.ndarray
    q_sampled: np.ndarray
    q_max_truncated: np.ndarray  # q_max after top-k / top-p (1 where one token is left)
    confidence: np.ndarray
    hidden: np.ndarray | None  # [N, hidden_dim] float16

    @property
    def size(self) -> int:
        return int(self.label.size)

    def take(self, mask: np.ndarray) -> "SlotData":
        """The slots where `mask` is true (names kept)."""
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[mask]
        return SlotData(
            request=self.request[mask], request_names=self.request_names, log=self.log[mask],
            step=self.step[mask], workload=self.workload[mask],
            workload_names=self.workload_names, position=self.position[mask], label=self.label[mask],
            q_max=self.q_max[mask], logit_q_max=self.logit_q_max[mask], entropy=self.entropy[mask],
            top2_margin=self.top2_margin[mask], q_sampled=self.q_sampled[mask],
            q_max_truncated=self.q_max_truncated[mask],
            confidence=self.confidence[mask], hidden=pick(self.hidden))


def _encode(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(codes `# [N]` int64, names `# [U]`) of a string column."""
    chunks = column.dictionary_encode().unify_dictionaries().chunks
    names = np.asarray(chunks[0].dictionary.to_pylist(), dtype=str)
    codes = np.concatenate([c.indices.to_numpy(zero_copy_only=False) for c in chunks]).astype(np.int64)
    return codes, names


def load_slots(log_dirs: LogDirs) -> SlotData:
    """Read one or several slot logs into SlotData (hidden states included when the logs have them).

    Several logs (runs of the same pair, e.g. one per workload group) are pooled; request ids
    are prefixed with the log's index so requests of different runs stay apart.
    """
    dirs = _log_list(log_dirs)
    tables = [read_slot_log(d) for d in dirs]
    if len(tables) > 1:
        tables = [t.set_column(t.column_names.index("request_id"), "request_id",
                               pa.array([f"{i}:{r}" for r in t.column("request_id").to_pylist()], pa.string()))
                  for i, t in enumerate(tables)]
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowInvalid as err:
        raise ValueError(f"slot logs {[str(d) for d in dirs]} cannot be pooled ({err}): log the same "
                         "columns in each run (--hidden in all or none)") from err
    if table.num_rows == 0:
        raise ValueError(f"slot log {', '.join(map(str, dirs))} has no labelled slots (no complete part); "
                         "run longer or close the writer so it flushes")
    request, request_names = _encode(table.column("request_id"))
    workload, workload_names = _encode(table.column("workload"))
    order = np.argsort(workload_names)  # stable, readable workload order
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    f64 = {name: table.column(name).to_numpy().astype(np.float64)
           for name in ("label", "q_max", "logit_q_max", "entropy", "top2_margin", "q_sampled", "q_max_truncated",
                        "confidence")}
    log = np.repeat(np.arange(len(tables)), [t.num_rows for t in tables])
    return SlotData(
        request=request, request_names=request_names, log=log,
        step=table.column("step").to_numpy().astype(np.int64), workload=rank[workload],
        workload_names=tuple(workload_names[order]), position=table.column("position").to_numpy().astype(np.int64),
        hidden=hidden_matrix(table) if "hidden" in table.column_names else None, **f64)


def _log_list(log_dirs: LogDirs) -> list[Path]:
    return [Path(log_dirs)] if isinstance(log_dirs, (str, os.PathLike)) else [Path(d) for d in log_dirs]


def held_out_requests(request_names: np.ndarray, seed: int = 0,
                      fraction: float = HELD_OUT_FRACTION) -> np.ndarray:
    """Deterministic split by request: True for held-out requests (`# [R]`), by hash of (seed, id)."""
    def unit(name: str) -> float:
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0**64
    return np.fromiter((unit(str(n)) < fraction for n in request_names), bool, len(request_names))


# ---- offline logistic fits: one feature, per-position intercepts -----------------------------

def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@dataclass(frozen=True, slots=True)
class PositionLogisticFit:
    """P(accept) = sigmoid(slope_i * x + intercept_i) for draft positions i = 1..K.

    With `shared_slope`, slope_i is one value for all positions (K + 1 parameters).
    Positions absent from the fit's data keep slope (shared or 0) and intercept 0.
    """

    feature: str
    shared_slope: bool
    slope: np.ndarray  # [K]
    intercept: np.ndarray  # [K]
    count: np.ndarray  # [K] training slots per position
    iterations: int
    converged: bool

    @property
    def positions(self) -> np.ndarray:
        return np.arange(1, self.slope.size + 1)

    def logit(self, x: np.ndarray, position: np.ndarray) -> np.ndarray:
        idx = np.minimum(position, self.slope.size) - 1
        return self.slope[idx] * x + self.intercept[idx]

    def predict(self, x: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Confidences `# [N]` for feature values x and 1-based positions (deeper than K use K)."""
        return _sigmoid(self.logit(x, position))


def _log_likelihood(eta: np.ndarray, y: np.ndarray) -> float:
    return float(y @ eta - np.logaddexp(0.0, eta).sum())


def _newton_step(x: np.ndarray, idx: np.ndarray, y: np.ndarray, eta: np.ndarray, k: int,
                 shared: bool, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """One Newton step (d_slope `# [K]`, d_intercept `# [K]`) from per-position sufficient statistics.

    Shared slope: the Hessian is arrowhead-shaped and solves by Schur complement (estimator.md);
    per-position slopes: an independent 2x2 system per position. `ridge` damps every pivot.
    """
    p = _sigmoid(eta)
    w = p * (1.0 - p)
    r = y - p
    wx = w * x
    a = np.bincount(idx, wx * x, k) + ridge
    b = np.bincount(idx, wx, k)
    c = np.bincount(idx, w, k) + ridge
    g0 = np.bincount(idx, r * x, k)
    g1 = np.bincount(idx, r, k)
    if shared:
        d_slope = (g0.sum() - (b * g1 / c).sum()) / (a.sum() - ridge * (k - 1) - (b * b / c).sum())
        return np.full(k, d_slope), (g1 - b * d_slope) / c
    det = a * c - b * b
    return (c * g0 - b * g1) / det, (a * g1 - b * g0) / det


def fit_position_logistic(x: np.ndarray, position: np.ndarray, label: np.ndarray, *, feature: str = "x",
                          shared_slope: bool = True, ridge: float = 1e-6, max_iter: int = 50,
                          tol: float = 1e-9) -> PositionLogisticFit:
    """Maximum-likelihood logistic fit, one feature x `# [N]`, intercept per 1-based position.

    Newton (IRLS) from zero with step halving; O(N) per iteration via bincount. float64.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(label, np.float64)
    idx = np.asarray(position, np.int64) - 1
    if x.size == 0:
        raise ValueError(f"cannot fit {feature}: no training slots")
    k = int(idx.max()) + 1
    slope, intercept = np.zeros(k), np.zeros(k)
    eta = np.zeros_like(x)
    ll = _log_likelihood(eta, y)
    converged, it = False, 0
    for it in range(1, max_iter + 1):
        d_slope, d_int = _newton_step(x, idx, y, eta, k, shared_slope, ridge)
        if not (np.all(np.isfinite(d_slope)) and np.all(np.isfinite(d_int))):
            break
        step = 1.0
        for _ in range(30):  # halve until the likelihood does not fall
            new_eta = (slope + step * d_slope)[idx] * x + (intercept + step * d_int)[idx]
            new_ll = _log_likelihood(new_eta, y)
            if new_ll >= ll - 1e-9 * abs(ll):
                break
            step /= 2
        slope, intercept, eta, ll = slope + step * d_slope, intercept + step * d_int, new_eta, new_ll
        if step * max(np.abs(d_slope).max(), np.abs(d_int).max()) < tol:
            converged = True
            break
    count = np.bincount(idx, minlength=k)
    return PositionLogisticFit(feature, shared_slope, slope, intercept, count, it, converged)


# ---- scorers ---------------------------------------------------------------------------------

@dataclass(slots=True)
class ScoringContext:
    """Training and held-out slots of one log, plus the fits scorers made (by scorer key)."""

    train: SlotData
    test: SlotData
    seed: int
    data: SlotData  # every slot, in log order (the online replays run over it)
    test_mask: np.ndarray  # [N] bool, held-out slots of `data`
    fits: dict[str, PositionLogisticFit] = field(default_factory=dict)
    replays: dict[str, ReplayResult] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Scores:
    """A scorer's output on the held-out slots: ranking `# [N]` (higher = accept) and confidences."""

    ranking: np.ndarray
    probs: np.ndarray | None  # None for ranking-only scorers (no log-loss / ECE)


@dataclass(frozen=True, slots=True)
class Reference:
    """Figures reported in estimator.md for the same kind of scorer (None = not reported)."""

    auc: float | None = None
    log_loss: float | None = None
    ece: float | None = None
    auc_excluding_first: float | None = None
    log_loss_excluding_first: float | None = None


@dataclass(frozen=True, slots=True)
class ScorerSpec:
    """One row of the report: how to score, whether it is lossless, what was reported for it."""

    key: str
    name: str
    lossless: bool
    score: Callable[[ScoringContext], Scores | str]  # a str is the reason it is not available
    reference: Reference | None = None


def _logit(q: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.clip(np.log(q) - np.log1p(-q), -LOGIT_CLAMP, LOGIT_CLAMP)


_FEATURES: dict[str, Callable[[SlotData], np.ndarray]] = {
    "logit_q_max": lambda d: d.logit_q_max,
    "entropy": lambda d: d.entropy,
    "top2_margin": lambda d: d.top2_margin,
    "logit_q_sampled": lambda d: _logit(d.q_sampled),
    "logit_q_max_truncated": lambda d: _logit(d.q_max_truncated),
}


def _fitted(key: str, feature: str, shared_slope: bool = True) -> Callable[[ScoringContext], Scores]:
    def score(ctx: ScoringContext) -> Scores:
        fit = fit_position_logistic(_FEATURES[feature](ctx.train), ctx.train.position, ctx.train.label,
                                    feature=feature, shared_slope=shared_slope)
        ctx.fits[key] = fit
        probs = fit.predict(_FEATURES[feature](ctx.test), ctx.test.position)
        return Scores(probs, probs)
    return score


# The two estimator modes the report replays: the default configuration and the seed's.
REPLAYS: dict[str, EstimatorConfig] = {
    "online_pooled": EstimatorConfig(),
    "online_windowed": EstimatorConfig.seed_windowed(),
}


def _replayed(key: str) -> Callable[[ScoringContext], Scores]:
    """The estimator under REPLAYS[key], replayed online over every slot in log order; scored
    on the held-out slots (their confidences are prequential, like the logged ones)."""
    def score(ctx: ScoringContext) -> Scores:
        d = ctx.data
        result = replay_online(d.step, d.request, d.position, d.logit_q_max, d.label, REPLAYS[key], log=d.log)
        ctx.replays[key] = result
        probs = result.confidence[ctx.test_mask]
        return Scores(probs, probs)
    return score


def _raw(getter: Callable[[SlotData], np.ndarray], probs: bool) -> Callable[[ScoringContext], Scores]:
    def score(ctx: ScoringContext) -> Scores:
        values = getter(ctx.test)
        return Scores(values, values if probs else None)
    return score


def _head(ctx: ScoringContext) -> Scores | str:
    """Linear classifier on standardized hidden states + one-hot position (scikit-learn).

    Fitted on at most HEAD_MAX_TRAIN_ROWS training slots (fewer for wide hidden states, so
    rows * (hidden_dim + K) <= HEAD_MAX_TRAIN_VALUES); the subsample is stated in the report.
    """
    if ctx.train.hidden is None:
        return "n/a (log has no hidden states)"
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        return "n/a (scikit-learn not installed: pip install scikit-learn)"
    k = int(max(ctx.train.position.max(), ctx.test.position.max()))
    rows = _head_training_rows(ctx, cap=min(HEAD_MAX_TRAIN_ROWS,
                                            HEAD_MAX_TRAIN_VALUES // (ctx.train.hidden.shape[1] + k)))
    h = ctx.train.hidden[rows].astype(np.float32)
    mean, std = h.mean(axis=0), h.std(axis=0) + 1e-6
    model = LogisticRegression(C=1.0, max_iter=300)
    model.fit(_head_design(h, ctx.train.position[rows], mean, std, k), ctx.train.label[rows])
    chunk = 100_000  # bounds the float32 design matrix of the held-out slots
    logits = [model.decision_function(_head_design(ctx.test.hidden[s:s + chunk].astype(np.float32),
                                                   ctx.test.position[s:s + chunk], mean, std, k))
              for s in range(0, ctx.test.size, chunk)]
    probs = _sigmoid(np.concatenate(logits))
    return Scores(probs, probs)


def _head_training_rows(ctx: ScoringContext, cap: int) -> np.ndarray:
    """Indices of the training slots the head is fitted on: all, or a seeded random `cap` of them."""
    if ctx.train.size <= cap:
        return np.arange(ctx.train.size)
    ctx.notes.append(f"trained confidence head: fitted on a random {cap:,} of {ctx.train.size:,} "
                     "training slots (subsampled for speed and memory); all other fits use every slot")
    return np.sort(np.random.default_rng(ctx.seed).choice(ctx.train.size, cap, replace=False))


def _head_design(h: np.ndarray, position: np.ndarray, mean: np.ndarray, std: np.ndarray, k: int) -> np.ndarray:
    """[standardized hidden | one-hot position] `# [N, hidden_dim + K]` float32."""
    onehot = np.zeros((h.shape[0], k), np.float32)
    onehot[np.arange(h.shape[0]), np.minimum(position, k) - 1] = 1.0
    return np.hstack([(h - mean) / std, onehot])


ESTIMATOR_REFERENCE = Reference(0.8336, 0.4284, 0.0100, 0.8352, 0.4420)
HEAD_REFERENCE = Reference(0.8191, 0.4449, 0.0052, 0.8075, 0.4743)
Q_SAMPLED_REFERENCE = Reference(auc=0.8553)

SCORERS: tuple[ScorerSpec, ...] = (
    ScorerSpec("q_max", "q_max (raw)", True, _raw(lambda d: d.q_max, probs=True)),
    ScorerSpec("online", "logit(q_max), online as logged (prequential)", True,
               _raw(lambda d: d.confidence, probs=True), ESTIMATOR_REFERENCE),
    ScorerSpec("online_pooled", "logit(q_max), online replay: pooled (default)", True,
               _replayed("online_pooled")),
    ScorerSpec("online_windowed", "logit(q_max), online replay: windowed (seed)", True,
               _replayed("online_windowed")),
    ScorerSpec("shared", "logit(q_max), offline shared slope", True, _fitted("shared", "logit_q_max")),
    ScorerSpec("per_position", "logit(q_max), offline per-position slope", True,
               _fitted("per_position", "logit_q_max", shared_slope=False)),
    ScorerSpec("truncated", "logit(q_max) after top-k/top-p, offline shared slope", True,
               _fitted("truncated", "logit_q_max_truncated")),
    ScorerSpec("entropy", "entropy, fitted", True, _fitted("entropy", "entropy")),
    ScorerSpec("entropy_rank", "entropy, raw ranking (-entropy)", True, _raw(lambda d: -d.entropy, probs=False)),
    ScorerSpec("margin", "top-2 margin, fitted", True, _fitted("margin", "top2_margin")),
    ScorerSpec("margin_rank", "top-2 margin, raw ranking", True, _raw(lambda d: d.top2_margin, probs=False)),
    ScorerSpec("q_sampled", "q_sampled (LOSSY), fitted on logit(q_sampled)", False,
               _fitted("q_sampled", "logit_q_sampled"), Q_SAMPLED_REFERENCE),
    ScorerSpec("head", "trained confidence head", True, _head, HEAD_REFERENCE),
)


# ---- results ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ScorerResult:
    """One scorer measured on one set of held-out slots; metrics None when not available."""

    key: str
    name: str
    lossless: bool
    metrics: ScorerMetrics | None
    note: str = ""


@dataclass(frozen=True, slots=True)
class PositionRow:
    """Held-out slots at one draft position, with AUC and log-loss per scorer key."""

    position: int
    slots: int
    acceptance: float
    auc: dict[str, float]
    log_loss: dict[str, float]


@dataclass(frozen=True, slots=True)
class WorkloadFit:
    """The shared-slope model fitted on all slots of one workload."""

    workload: str
    slots: int
    acceptance: float
    mean_entropy: float
    slope: float
    intercepts: np.ndarray  # [K]
    mean_intercept: float  # weighted by labelled slots per position


@dataclass(frozen=True, slots=True)
class Report:
    """Everything build_report computed, and where it wrote the markdown and plots.

    Scorer metrics are on the held-out requests' slots; `per_workload` fits use all slots.
    """

    markdown_path: Path
    plot_paths: dict[str, Path]
    num_slots: int
    num_requests: int
    num_train_requests: int
    num_test_requests: int
    num_test_slots: int
    bins: int
    overall: tuple[ScorerResult, ...]
    excluding_first: tuple[ScorerResult, ...]
    per_position: tuple[PositionRow, ...]
    per_workload: tuple[WorkloadFit, ...]
    slope_entropy_r: float
    intercept_entropy_r: float
    held_out_acceptance: float
    fits: dict[str, PositionLogisticFit]
    online_all_slots: ScorerMetrics
    notes: tuple[str, ...]
    replays: dict[str, "ReplaySummary"] = field(default_factory=dict)

    def result(self, key: str) -> ScorerResult:
        return next(r for r in self.overall if r.key == key)


def _measure_all(scores: dict[str, Scores | str], labels: np.ndarray, mask: np.ndarray,
                 bins: int) -> tuple[ScorerResult, ...]:
    out = []
    for spec in SCORERS:
        s = scores[spec.key]
        if isinstance(s, str):
            out.append(ScorerResult(spec.key, spec.name, spec.lossless, None, s))
            continue
        y = labels[mask]
        if s.probs is not None:
            m = measure(s.probs[mask], y, bins)
        else:
            nan = float("nan")
            m = ScorerMetrics(int(y.size), auc(s.ranking[mask], y), nan, nan, nan)
        note = "" if s.probs is not None else "ranking only"
        out.append(ScorerResult(spec.key, spec.name, spec.lossless, m, note))
    return tuple(out)


def _position_rows(scores: dict[str, Scores | str], test: SlotData) -> tuple[PositionRow, ...]:
    rows = []
    for pos in np.unique(test.position):
        mask = test.position == pos
        y = test.label[mask]
        aucs = {k: auc(s.ranking[mask], y) for k, s in scores.items() if not isinstance(s, str)}
        lls = {k: log_loss(s.probs[mask], y) for k, s in scores.items()
               if not isinstance(s, str) and s.probs is not None}
        rows.append(PositionRow(int(pos), int(mask.sum()), float(y.mean()), aucs, lls))
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """An online replay over the whole log: its prequential metrics on every slot and where its
    parameters ended."""

    config: EstimatorConfig
    all_slots: ScorerMetrics
    slope: float
    intercepts: np.ndarray  # [K]
    num_steps: int
    num_refits: int
    num_changes: int  # refits that dropped the pooled evidence (EstimatorConfig.change_z)


def _replay_summary(result: ReplayResult, data: SlotData, bins: int) -> ReplaySummary:
    est = result.estimator
    return ReplaySummary(est.config, measure(result.confidence, data.label, bins), est.slope,
                         est.intercepts.numpy(), result.num_steps, est.num_refits, est.num_changes)


def _workload_fits(data: SlotData) -> tuple[WorkloadFit, ...]:
    fits = []
    for w, name in enumerate(data.workload_names):
        d = data.take(data.workload == w)
        fit = fit_position_logistic(d.logit_q_max, d.position, d.label, feature="logit_q_max")
        mean_intercept = float(fit.intercept @ fit.count / fit.count.sum())
        fits.append(WorkloadFit(name, d.size, float(d.label.mean()), float(d.entropy.mean()),
                                float(fit.slope[0]), fit.intercept, mean_intercept))
    return tuple(fits)


def _pearson(a: list[float], b: list[float]) -> float:
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def _scoring_context(data: SlotData, seed: int) -> ScoringContext:
    """Split the slots by request into training and held-out sets."""
    held = held_out_requests(data.request_names, seed)
    if held.all() or not held.any():
        raise ValueError(f"the log has {held.size} request(s), all on one side of the "
                         f"{1 - HELD_OUT_FRACTION:.0%}/{HELD_OUT_FRACTION:.0%} request split; "
                         "log more requests (or try another seed)")
    test = held[data.request]
    return ScoringContext(data.take(~test), data.take(test), seed, data, test)


def _assemble(data: SlotData, ctx: ScoringContext, scores: dict[str, Scores | str], out: Path,
              bins: int) -> Report:
    labels = ctx.test.label
    workloads = _workload_fits(data)
    entropy = [w.mean_entropy for w in workloads]
    position_rows = _position_rows(scores, ctx.test)
    num_test_requests = int(np.unique(ctx.test.request).size)
    return Report(
        markdown_path=out / "report.md",
        plot_paths=_write_plots(out, scores, labels, position_rows, bins),
        num_slots=data.size, num_requests=int(data.request_names.size),
        num_train_requests=int(data.request_names.size) - num_test_requests,
        num_test_requests=num_test_requests, num_test_slots=ctx.test.size, bins=bins,
        overall=_measure_all(scores, labels, np.ones(labels.size, bool), bins),
        excluding_first=_measure_all(scores, labels, ctx.test.position > 1, bins),
        per_position=position_rows, per_workload=workloads,
        slope_entropy_r=_pearson([w.slope for w in workloads], entropy),
        intercept_entropy_r=_pearson([w.mean_intercept for w in workloads], entropy),
        held_out_acceptance=float(labels.mean()), fits=dict(ctx.fits),
        online_all_slots=measure(data.confidence, data.label, bins), notes=tuple(ctx.notes),
        replays={k: _replay_summary(r, data, bins) for k, r in ctx.replays.items()})


def build_report(log_dir: LogDirs, out_dir: str | os.PathLike, bins: int = DEFAULT_BINS,
                 seed: int = 0) -> Report:
    """Measure every scorer on a slot log (or several, pooled); write `report.md` and PNG plots into out_dir.

    Offline scorers are fitted on the training requests and every scorer is measured on the
    held-out requests (a deterministic 70/30 split by hash of (seed, request_id)).
    """
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins = {bins!r} is invalid: allowed an integer >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = load_slots(log_dir)
    ctx = _scoring_context(data, seed)
    scores = {spec.key: spec.score(ctx) for spec in SCORERS}
    report = _assemble(data, ctx, scores, out, bins)
    report.markdown_path.write_text(render_markdown(report, _log_list(log_dir)), encoding="utf-8")
    return report


# ---- plots -----------------------------------------------------------------------------------

RELIABILITY_SCORERS = ("q_max", "online", "online_pooled", "shared")
POSITION_PLOT_SCORERS = ("q_max", "online", "online_pooled", "online_windowed", "shared", "per_position", "entropy_rank", "margin_rank",
                         "q_sampled", "head")


def _names() -> dict[str, str]:
    return {spec.key: spec.name for spec in SCORERS}


def _write_plots(out: Path, scores: dict[str, Scores | str], labels: np.ndarray,
                 position_rows: tuple[PositionRow, ...], bins: int) -> dict[str, Path]:
    """Reliability diagram and AUC-by-position plot as PNG files (matplotlib, no pyplot state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:  # plots are optional; the tables still carry every figure
        return {}
    paths = {"reliability": out / "reliability.png", "auc_by_position": out / "auc_by_position.png"}
    _plot_reliability(Figure(figsize=(6, 6)), scores, labels, bins).savefig(paths["reliability"], dpi=110)
    _plot_position_auc(Figure(figsize=(9, 4.5)), position_rows).savefig(paths["auc_by_position"], dpi=110,
                                                                       bbox_inches="tight")
    return paths


def _plot_reliability(fig, scores: dict[str, Scores | str], labels: np.ndarray, bins: int):
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    for key in RELIABILITY_SCORERS:
        s = scores[key]
        if isinstance(s, str) or s.probs is None:
            continue
        table = reliability_table(s.probs, labels, bins)
        keep = table.count > 0
        ax.plot(table.mean_confidence[keep], table.observed_acceptance[keep], marker="o",
                label=f"{_names()[key]} (ECE {table.ece:.4f})")
    ax.set(xlabel="mean confidence", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1),
           title=f"Reliability, held-out slots, {bins} equal-width bins")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def _plot_position_auc(fig, rows: tuple[PositionRow, ...]):
    ax = fig.add_subplot()
    positions = [r.position for r in rows]
    for key in POSITION_PLOT_SCORERS:
        if key not in rows[0].auc:
            continue
        style = "--" if key == "q_sampled" else "-"
        ax.plot(positions, [r.auc[key] for r in rows], style, marker="o", label=_names()[key])
    ax.set(xlabel="draft position i", ylabel="AUC", title="AUC by draft position (held-out slots)")
    ax.set_xticks(positions)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


# ---- markdown --------------------------------------------------------------------------------

def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _lossless(flag: bool) -> str:
    return "yes" if flag else "**no (LOSSY)**"


def _reference(key: str) -> Reference | None:
    return next(spec.reference for spec in SCORERS if spec.key == key)


def _scorer_table(results: tuple[ScorerResult, ...], excluding_first: bool) -> str:
    rows = []
    for r in results:
        ref = _reference(r.key)
        if ref is None:
            ref_text = ""
        elif excluding_first:
            ref_text = " / ".join(_fmt(v) for v in (ref.auc_excluding_first, ref.log_loss_excluding_first)
                                  if v is not None)
        else:
            ref_text = " / ".join(_fmt(v) for v in (ref.auc, ref.log_loss, ref.ece) if v is not None)
        m = r.metrics
        cells = ([_fmt(m.auc), _fmt(m.log_loss), _fmt(m.ece)] if m else [r.note, "—", "—"])
        rows.append([r.name, _lossless(r.lossless), f"{m.n:,}" if m else "—", *cells, ref_text, r.note if m else ""])
    ref_head = "reported (estimator.md): AUC / log-loss" + ("" if excluding_first else " / ECE")
    return _md_table(["scorer", "lossless", "slots", "AUC", "log-loss", "ECE", ref_head, "note"], rows)


def _position_table(rows: tuple[PositionRow, ...], metric: str) -> str:
    keys = [spec.key for spec in SCORERS if any(spec.key in getattr(r, metric) for r in rows)]
    body = [[str(r.position), f"{r.slots:,}", _fmt(r.acceptance),
             *[_fmt(getattr(r, metric).get(k)) for k in keys]] for r in rows]
    return _md_table(["position", "slots", "acceptance", *[_names()[k] for k in keys]], body)


def _workload_table(fits: tuple[WorkloadFit, ...]) -> str:
    k = max(f.intercepts.size for f in fits)
    body = [[f.workload, f"{f.slots:,}", _fmt(f.acceptance), _fmt(f.mean_entropy), _fmt(f.slope),
             _fmt(f.mean_intercept), *[_fmt(v, 3) for v in f.intercepts], *(["—"] * (k - f.intercepts.size))]
            for f in fits]
    return _md_table(["workload", "slots", "acceptance", "mean draft entropy (nats)", "shared slope ω",
                      "mean intercept", *[f"β{i}" for i in range(1, k + 1)]], body)


def _calibration_table(report: Report) -> str:
    reported = {"q_max": ("0.784 / 0.723", "0.0736"), "online": ("—", "0.0100")}
    observed = report.held_out_acceptance
    body = []
    for key in ("q_max", "online", *report.replays, "shared", "per_position"):
        m = report.result(key).metrics
        body.append([_names()[key], _fmt(observed + m.calibration_gap), _fmt(observed),
                     _fmt(m.calibration_gap), _fmt(m.ece), *reported.get(key, ("", ""))])
    return _md_table(["scorer", "mean confidence", "observed acceptance", "gap", "ECE",
                      "reported: mean confidence / acceptance", "reported calibration error"], body)


def _fit_table(report: Report) -> str:
    """Offline fits per position, with the online replays' final parameters beside them."""
    shared, per = report.fits.get("shared"), report.fits.get("per_position")
    if shared is None or per is None:
        return ""
    replays = report.replays.values()
    body = [[str(i + 1), f"{shared.count[i]:,}", _fmt(shared.slope[i]), _fmt(shared.intercept[i]),
             _fmt(per.slope[i]), _fmt(per.intercept[i]),
             *[f"{_fmt(r.slope)} / {_fmt(r.intercepts[i]) if i < r.intercepts.size else '—'}" for r in replays]]
            for i in range(shared.slope.size)]
    names = [f"{_names()[k].split(': ')[-1]}: final ω / β" for k in report.replays]
    return _md_table(["position", "training slots", "shared ω", "β (shared ω)", "per-position slope",
                      "per-position intercept", *names], body)


def _config_text(config: EstimatorConfig) -> str:
    return ", ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))


def _meta_text(meta: dict) -> str:
    """Run metadata on one line, long values shortened."""
    def short(value: object) -> str:
        text = str(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return ", ".join(f"{k}={short(meta[k])}" for k in sorted(meta))


def _summary(report: Report, log_dirs: list[Path]) -> list[str]:
    lines = [f"- log: `{d}`" + (f" ({_meta_text(meta)})" if (meta := read_meta(d)) else "") for d in log_dirs]
    lines += [
        f"- labelled slots: {report.num_slots:,}; requests: {report.num_requests:,}; "
        f"workloads: {len(report.per_workload)}",
        f"- split by request (hash of seed and request_id): {report.num_train_requests:,} training requests, "
        f"{report.num_test_requests:,} held-out requests ({report.num_test_slots:,} held-out slots). "
        "Offline scorers are fitted on the training requests; every table is measured on the held-out "
        "slots unless it says otherwise.",
        f"- binning for ECE and the reliability diagram: {report.bins} fixed, equal-width bins on [0, 1] "
        f"(bin j = [j/{report.bins}, (j+1)/{report.bins}); confidence 1 in the last bin); ECE is the "
        "slot-weighted mean |mean confidence − observed acceptance| over non-empty bins.",
        f"- online (prequential) estimator over all {report.num_slots:,} slots: AUC "
        f"{_fmt(report.online_all_slots.auc)}, log-loss {_fmt(report.online_all_slots.log_loss)}, "
        f"ECE {_fmt(report.online_all_slots.ece)}.",
    ]
    lines += [f"- {_names()[k].split(', ')[-1]} over all {report.num_slots:,} slots ({r.num_steps:,} steps, "
              f"{r.num_refits:,} refits, {r.num_changes:,} changes detected): AUC {_fmt(r.all_slots.auc)}, log-loss {_fmt(r.all_slots.log_loss)}, "
              f"ECE {_fmt(r.all_slots.ece)}; config {_config_text(r.config)}" for k, r in report.replays.items()]
    lines += [f"- subsampling: {note}" for note in report.notes] or ["- subsampling: none"]
    return lines


def _workload_section(report: Report) -> list[str]:
    return [
        "## Per workload (shared-slope model fitted on all slots of each workload)", "",
        _workload_table(report.per_workload), "",
        f"Pearson correlation across workloads with mean draft entropy: slope r = "
        f"{_fmt(report.slope_entropy_r, 3)}, mean intercept r = {_fmt(report.intercept_entropy_r, 3)} "
        "(mean intercept weighted by labelled slots per position). Reported in estimator.md: slope "
        "0.51-0.55 across workloads of one pair, intercepts 0.478 down to -0.089, r = -0.89 between "
        "intercept and mean draft entropy.", "",
    ]


def render_markdown(report: Report, log_dirs: list[Path]) -> str:
    """The report as markdown: summary, the rulers per scorer, positions, workloads, calibration."""
    plots = [f"![{name}]({path.name})" for name, path in report.plot_paths.items()]
    parts = [
        "# Acceptance scorers: evaluation report", "", *_summary(report, log_dirs), "",
        "The four rulers: lossless (may trimming use it without changing the output distribution?), "
        "AUC, log-loss, ECE. Reported figures (estimator.md) come from about 4.5 million labelled "
        "drafts of DeepSeek-V4-Flash with a DSpark drafter; ours are to be compared in kind.", "",
        "## Overall", "", _scorer_table(report.overall, excluding_first=False), "",
        "## Excluding position 1", "", _scorer_table(report.excluding_first, excluding_first=True), "",
        "## Per position: AUC", "", _position_table(report.per_position, "auc"), "",
        "## Per position: log-loss", "", _position_table(report.per_position, "log_loss"), "",
        "## Offline fits of logit(q_max) (training requests) and where the online replays ended", "",
        _fit_table(report), "",
        *_workload_section(report),
        "## Calibration (held-out slots)", "", _calibration_table(report), "",
        "## Plots", "", *plots, "",
    ]
    return "\n".join(parts)
