"""Online acceptance estimator, both modes: recovery of a known model, agreement with the offline
MLE (statsmodels), tracking a change, the Schur-complement solve and the gradient correction,
damping, the cold-start schedule, robustness, merge, memory, state."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import statsmodels.api as sm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specav.acceptance import (
    OnlineAcceptanceEstimator,
    RefitOutcome,
    Scorer,
    make_scorer,
    newton_step,
    survival,
)
from specav.acceptance.estimator import _STATS, corrected, logit_change
from specav.config import ConfigError, EstimatorConfig

TRUE_SLOPE = 0.6
TRUE_INTERCEPTS = np.linspace(1.0, -0.5, 8)  # acceptance falls with depth
B, K = 16, 8
MODES = {"pooled": EstimatorConfig(), "windowed": EstimatorConfig.seed_windowed()}


def mode_config(mode: str, **overrides) -> EstimatorConfig:
    """The mode's configuration (default pooled, or the seed's windowed) with overrides."""
    return dataclasses.replace(MODES[mode], **overrides)


# ---- synthetic drafts from a known logistic model ------------------------------------------

@dataclass
class Step:
    features: np.ndarray  # [B, K]
    num_admitted: np.ndarray  # [B]
    num_accepted: np.ndarray  # [B]
    labelled: np.ndarray  # [B, K] bool, as the generating process reached the slot
    labels: np.ndarray  # [B, K] 0/1 where labelled


def draw_features(rng: np.random.Generator, batch: int, k: int) -> np.ndarray:
    """A mixture of confident and unsure slots: q_max spread over (0.05, 0.999)."""
    confident = rng.random((batch, k)) < 0.6
    f = np.where(confident, rng.normal(4.0, 1.5, (batch, k)), rng.normal(-0.5, 1.5, (batch, k)))
    return np.clip(f, math.log(0.05 / 0.95), math.log(0.999 / 0.001))


def draw_step(rng: np.random.Generator, batch: int = B, slope: float = TRUE_SLOPE,
              intercepts: np.ndarray = TRUE_INTERCEPTS) -> Step:
    """Verify slot by slot: a request stops at its first rejection or at its last admitted slot."""
    k = len(intercepts)
    f = draw_features(rng, batch, k)
    admitted = np.where(rng.random(batch) < 0.7, k, rng.integers(0, k + 1, batch))
    alive = np.ones(batch, bool)
    accepted = np.zeros(batch, np.int64)
    labelled = np.zeros((batch, k), bool)
    labels = np.zeros((batch, k))
    for i in range(k):
        reached = alive & (i < admitted)
        ok = rng.random(batch) < 1 / (1 + np.exp(-(slope * f[:, i] + intercepts[i])))
        labelled[:, i], labels[:, i] = reached, ok
        alive = reached & ok
        accepted += alive
    return Step(f, admitted, accepted, labelled, labels)


def observe(est: OnlineAcceptanceEstimator, step: Step, rows=slice(None)) -> None:
    est.observe(torch.from_numpy(step.features[rows]), torch.from_numpy(step.num_admitted[rows]),
                torch.from_numpy(step.num_accepted[rows]))


def design(steps: list[Step], k: int = K) -> tuple[np.ndarray, np.ndarray]:
    """Labelled slots as a GLM design: feature column + one-hot position columns, no constant."""
    f = np.concatenate([s.features[s.labelled] for s in steps])
    pos = np.concatenate([np.nonzero(s.labelled)[1] for s in steps])
    y = np.concatenate([s.labels[s.labelled] for s in steps])
    x = np.zeros((len(y), k + 1))
    x[:, 0] = f
    x[np.arange(len(y)), 1 + pos] = 1.0
    return x, y


def log_loss(x: np.ndarray, y: np.ndarray, theta: np.ndarray) -> float:
    z = x @ theta
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def params(est: OnlineAcceptanceEstimator) -> np.ndarray:
    return np.r_[est.slope, est.intercepts.numpy()]


@dataclass
class Run:
    est: OnlineAcceptanceEstimator
    steps: list[Step]
    history: np.ndarray  # [refits, K + 1] parameters after each refit


@pytest.fixture(scope="module", params=sorted(MODES))
def online_run(request) -> Run:
    """2,000 steps at B = 16, K = 8 (~116k labels), in each mode."""
    rng = np.random.default_rng(1234)
    est = OnlineAcceptanceEstimator(K, MODES[request.param])
    steps, history = [], []
    for _ in range(2000):
        steps.append(draw_step(rng))
        observe(est, steps[-1])
        if est.steps_since_refit == 0:
            history.append(params(est))
    return Run(est, steps, np.array(history))


@pytest.fixture(scope="module")
def mle(online_run: Run) -> np.ndarray:
    x, y = design(online_run.steps)
    return sm.GLM(y, x, family=sm.families.Binomial()).fit().params


def test_recovers_the_generating_model(online_run: Run):
    final = online_run.history[-1]
    assert abs(final[0] - TRUE_SLOPE) < 0.05
    if online_run.est.config.mode == "windowed":
        assert online_run.history.shape == (20, K + 1)  # every 100 steps, no cold-start refits
        # One refit sees one interval (~160 labels at position 8), so single values are noisy;
        # the mean of the last 10 refits must sit on the truth.
        np.testing.assert_allclose(final[1:], TRUE_INTERCEPTS, atol=0.45)
        recent = online_run.history[-10:].mean(0)
        assert abs(recent[0] - TRUE_SLOPE) < 0.03
        np.testing.assert_allclose(recent[1:], TRUE_INTERCEPTS, atol=0.15)
        assert np.all(np.diff(recent[1:4]) < 0), "intercepts must fall with depth"
    else:
        assert online_run.history.shape[0] > 20  # cold-start refits come first
        np.testing.assert_allclose(final[1:], TRUE_INTERCEPTS, atol=0.12)
        assert np.all(np.diff(final[1:]) < 0.1), "intercepts must fall with depth"


def test_approaches_the_offline_mle(online_run: Run, mle: np.ndarray):
    np.testing.assert_allclose(mle[0], TRUE_SLOPE, atol=0.03)  # the reference itself is sane
    final, recent = online_run.history[-1], online_run.history[-10:].mean(0)
    x, y = design(online_run.steps)
    gap = log_loss(x, y, final) - log_loss(x, y, mle)
    unfitted = np.r_[1.0, np.zeros(K)]  # raw q_max: the test can tell fitted from unfitted
    assert log_loss(x, y, unfitted) - log_loss(x, y, mle) > 0.02
    if online_run.est.config.mode == "windowed":
        assert abs(final[0] - mle[0]) < 0.03
        np.testing.assert_allclose(recent[1:], mle[1:], atol=0.12)
        assert -1e-9 < gap < 0.005
    else:  # pooled: the final parameters themselves sit on the MLE of all the data
        np.testing.assert_allclose(final, mle, atol=0.03)
        assert -1e-9 < gap < 0.0005


def test_windowed_final_parameters_are_noisy_where_pooled_are_not(mle: np.ndarray):
    """The reason for the pooled mode, on the same data: the seed's last refit misses the MLE."""
    rng = np.random.default_rng(1234)
    est = OnlineAcceptanceEstimator(K, MODES["windowed"])
    for _ in range(2000):
        observe(est, draw_step(rng))
    assert np.abs(params(est) - mle).max() > 0.1


def test_tracks_a_change_in_both_modes():
    """Every intercept moves by -0.5 at step 1,500; by step 3,000 each mode has followed."""
    k, shift_at = 4, 1500
    before = np.array([0.8, 0.4, 0.1, -0.2])
    after = before - 0.5
    errors = {}
    configs = {"pooled": MODES["pooled"], "windowed": MODES["windowed"],
               "no forgetting": mode_config("pooled", half_life=math.inf, change_z=math.inf)}
    for name, config in configs.items():
        rng = np.random.default_rng(99)
        est = OnlineAcceptanceEstimator(k, config)
        for t in range(3000):
            observe(est, draw_step(rng, intercepts=before if t < shift_at else after))
        errors[name] = np.abs(est.intercepts.numpy() - after).mean()
    assert errors["pooled"] <= 0.05  # the goal is 0.1
    assert errors["windowed"] <= 0.1  # one interval's labels: it follows, noisily
    assert errors["no forgetting"] > 0.2  # negative control: remembering everything cannot follow


def test_the_first_refit_moves_toward_the_truth():
    rng = np.random.default_rng(7)
    est = OnlineAcceptanceEstimator(K, EstimatorConfig(refit_interval=50, cold_start_labels=0))
    for _ in range(50):
        observe(est, draw_step(rng))
    assert est.last_refit is not None and est.last_refit.applied
    assert abs(est.slope - TRUE_SLOPE) < abs(EstimatorConfig().init_slope - TRUE_SLOPE)


# ---- the Newton step and the carried gradient -------------------------------------------------

def dense_newton(a, b, c, g0, g1, ridge) -> np.ndarray:
    k = len(a)
    h = np.zeros((k + 1, k + 1))
    h[0, 0] = a.sum()
    h[0, 1:] = h[1:, 0] = b
    h[1:, 1:] = np.diag(c)
    g = np.r_[g0.sum(), g1]
    return np.linalg.solve(h + ridge * np.eye(k + 1), g)


def random_statistics(rng: np.random.Generator, k: int) -> np.ndarray:
    n = rng.integers(0, 50, k)  # includes empty positions
    a, b, c, g0, g1 = (np.zeros(k) for _ in range(5))
    for i in range(k):
        f, p = rng.normal(0, 3, n[i]), rng.uniform(0.01, 0.99, n[i])
        w, r = p * (1 - p), (rng.random(n[i]) < 0.7) - p
        a[i], b[i], c[i], g0[i], g1[i] = (w * f * f).sum(), (w * f).sum(), w.sum(), (r * f).sum(), r.sum()
    return np.stack([a, b, c, g0, g1, n.astype(float)])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ridge", [1e-3, 0.5])
def test_schur_complement_equals_dense_solve(seed, ridge):
    rng = np.random.default_rng(seed)
    stats = random_statistics(rng, int(rng.integers(1, 12)))
    step = newton_step(torch.from_numpy(stats), ridge)
    expected = dense_newton(*stats[:5], ridge)
    np.testing.assert_allclose(np.r_[step.slope, step.intercepts.numpy()], expected,
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_the_carried_gradient_is_g_minus_h_d(seed):
    rng = np.random.default_rng(seed)
    k = 5
    stats = random_statistics(rng, k)
    d = rng.normal(0, 0.3, k + 1)
    out = corrected(torch.from_numpy(stats), float(d[0]), torch.from_numpy(d[1:])).numpy()
    a, b, c, g0, g1, _ = stats
    h = np.zeros((k + 1, k + 1))
    h[0, 0] = a.sum()
    h[0, 1:] = h[1:, 0] = b
    h[1:, 1:] = np.diag(c)
    expected = np.r_[g0.sum(), g1] - h @ d
    np.testing.assert_allclose(np.r_[out[3].sum(), out[4]], expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(out[[0, 1, 2, 5]], stats[[0, 1, 2, 5]])  # H and counts are kept
    # after a full undamped Newton step the carried gradient is only the ridge's share
    full = newton_step(torch.from_numpy(stats), 1e-3)
    rest = corrected(torch.from_numpy(stats), full.slope, full.intercepts).numpy()
    np.testing.assert_allclose(np.r_[rest[3].sum(), rest[4]], 1e-3 * np.r_[full.slope, full.intercepts.numpy()],
                               atol=1e-9)


def test_pooled_refits_keep_old_evidence_and_converge_to_the_mle():
    """Refitting often on pooled statistics ends on the MLE of all labels, as one fit would."""
    rng = np.random.default_rng(12)
    steps = [draw_step(rng) for _ in range(400)]
    x, y = design(steps)
    mle = sm.GLM(y, x, family=sm.families.Binomial()).fit().params
    est = OnlineAcceptanceEstimator(K, mode_config("pooled", half_life=math.inf, change_z=math.inf,
                                                   refit_interval=20))
    for s in steps:
        observe(est, s)
    for _ in range(3):  # no new labels: the carried gradient alone finishes the damped steps
        est.observe(torch.zeros(0, K), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                    steps=0)
        est.refit()
    np.testing.assert_allclose(params(est), mle, atol=0.01)
    pooled = est.pooled_statistics
    assert pooled["n"].sum() == design(steps)[1].size  # every label is still counted


def raw_newton(est: OnlineAcceptanceEstimator, steps: list[Step], ridge: float) -> np.ndarray:
    """The undamped Newton step from raw labels, at the estimator's parameters, solved densely."""
    x, y = design(steps)
    p = 1 / (1 + np.exp(-(x @ params(est))))
    h = x.T @ (x * (p * (1 - p))[:, None])
    return np.linalg.solve(h + ridge * np.eye(len(h)), x.T @ (y - p))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_damping_scales_the_newton_step(mode):
    rng = np.random.default_rng(11)
    config = mode_config(mode, refit_interval=10_000, cold_start_labels=0, damping_n0=50.0, trust_radius=math.inf,
                         slope_factor=math.inf)
    est = OnlineAcceptanceEstimator(K, config)
    steps = [draw_step(rng) for _ in range(6)]
    for s in steps:
        observe(est, s)
    before, version = params(est), est.version
    expected = raw_newton(est, steps, config.ridge)
    n_i = design(steps)[0][:, 1:].sum(0)
    result = est.refit()  # the first refit: nothing pooled yet, so both modes take the same step
    assert result.outcome is RefitOutcome.APPLIED and result.applied
    assert est.version != version  # the scores changed: what the planner kept is scored again
    assert result.num_labels == n_i.sum() and result.num_labels_per_slot.tolist() == n_i.tolist()
    assert result.pooled_labels == n_i.sum()
    np.testing.assert_allclose(np.r_[result.newton_slope, result.newton_intercepts.numpy()],
                               expected, rtol=1e-9)
    n = n_i.sum()
    assert result.delta_slope == pytest.approx(expected[0] * n / (n + 50.0), rel=1e-9)
    np.testing.assert_allclose(result.delta_intercepts.numpy(), expected[1:] * n_i / (n_i + 50.0),
                               rtol=1e-9)
    np.testing.assert_allclose(params(est) - before, np.r_[result.delta_slope,
                                                           result.delta_intercepts.numpy()])
    kept = est.pooled_statistics["n"].sum()
    assert kept == (n if mode == "pooled" else 0)


def test_a_position_with_few_labels_moves_less_but_moves():
    k = 3
    est = OnlineAcceptanceEstimator(k, EstimatorConfig(refit_interval=10_000, cold_start_labels=0,
                                                       damping_n0=50.0))
    rng = np.random.default_rng(5)
    f = rng.normal(1.0, 2.0, (200, k))
    admitted = np.array([3] * 4 + [2] * 146 + [1] * 50)  # 200, 150 and 4 labels
    accepted = np.zeros(200, np.int64)
    for row in range(200):  # labels from a model near the initial one
        while accepted[row] < admitted[row] and rng.random() < 1 / (1 + np.exp(-f[row, accepted[row]])):
            accepted[row] += 1
    accepted[:4] = 3
    est.observe(torch.from_numpy(f), torch.from_numpy(admitted), torch.from_numpy(accepted))
    counts = est.statistics["n"].tolist()
    assert counts[0] == 200 and counts[2] == 4
    result = est.refit()
    assert result.applied
    ratio = (result.delta_intercepts / result.newton_intercepts).numpy()
    np.testing.assert_allclose(ratio, [c / (c + 50) for c in counts], rtol=1e-9)
    assert 0 < abs(result.delta_intercepts[2]) < abs(result.newton_intercepts[2])
    assert ratio[2] < ratio[1] < ratio[0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_step_that_would_make_the_slope_negative_is_skipped(mode):
    est = OnlineAcceptanceEstimator(1, mode_config(mode, refit_interval=10_000, cold_start_labels=0,
                                                   init_slope=0.01, trust_radius=math.inf, slope_factor=math.inf))
    f = torch.linspace(-5, 5, 400).unsqueeze(1)
    accepted = (f[:, 0] < 0).long()  # confident slots are the rejected ones
    est.observe(f, torch.ones(400, dtype=torch.long), accepted)
    result = est.refit()
    assert result.outcome is RefitOutcome.NEGATIVE_SLOPE and not result.applied
    assert result.newton_slope < -0.01 and result.delta_slope == 0.0
    assert est.slope == 0.01 and est.num_skipped == 1
    assert all(v.abs().sum() == 0 for v in est.statistics.values())
    assert all(v.abs().sum() == 0 for v in est.pooled_statistics.values())


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_non_finite_step_is_skipped(mode):
    config = mode_config(mode)
    est = OnlineAcceptanceEstimator(2, config)
    state = est.state_dict()
    state["statistics"][:, 0] = torch.tensor([1.0, math.inf, 1.0, 1.0, 1.0, 3.0])
    state["pooled_statistics"][:, 1] = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 3.0])
    est.load_state_dict(state)
    result = est.refit()
    assert result.outcome is RefitOutcome.NON_FINITE
    assert est.slope == config.init_slope and est.intercepts.tolist() == [config.init_intercept] * 2
    assert est.num_skipped == 1 and est.pooled_statistics["n"].sum() == 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_refit_without_labels_changes_nothing(mode):
    config = mode_config(mode, refit_interval=3)
    est = OnlineAcceptanceEstimator(4, config)
    for _ in range(3):
        est.observe(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long),
                    torch.zeros(0, dtype=torch.long))
    assert est.num_refits == 1 and est.last_refit.outcome is RefitOutcome.NO_LABELS
    assert est.steps_since_refit == 0 and est.total_steps == 3 and est.num_skipped == 0
    assert est.slope == config.init_slope


def test_a_step_that_verified_no_slot_adds_nothing_but_counts():
    """Drafted slots that were all trimmed (or no draft at all): no labels, the step still counts."""
    est = OnlineAcceptanceEstimator(4, mode_config("pooled", refit_interval=100))
    features = torch.tensor([[2.0, 1.0, float("nan"), 0.5], [0.3, -1.0, 4.0, 1.0]])
    est.observe(features, torch.tensor([2, 1]), torch.tensor([1, 1]))
    before = est._stats.clone()
    est.observe(features, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert torch.equal(est._stats, before) and est.total_steps == 2 and est.steps_since_refit == 2


def test_pooled_statistics_decay_with_the_half_life():
    est = OnlineAcceptanceEstimator(2, EstimatorConfig(refit_interval=10, half_life=20.0, cold_start_labels=0,
                                                       change_z=math.inf))
    f = torch.tensor([[1.0, 2.0]] * 8)
    est.observe(f, torch.full((8,), 2), torch.full((8,), 1), steps=10)  # 8 labels per position, refit
    assert est.pooled_statistics["n"].tolist() == [8.0, 8.0]
    for _ in range(10):  # an idle interval: nothing new, the old evidence fades by 0.5 ** (10 / 20)
        est.observe(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    np.testing.assert_allclose(est.pooled_statistics["n"].numpy(), 8 * 0.5 ** 0.5, rtol=1e-12)


# ---- schedule ----------------------------------------------------------------------------------

def refit_steps(config: EstimatorConfig, steps: int, batch: int) -> list[int]:
    """Steps (1-based) after which a refit happened, feeding `batch` labels per step (K = 1)."""
    est = OnlineAcceptanceEstimator(1, config)
    out = []
    f = torch.ones(batch, 1)
    for t in range(1, steps + 1):
        est.observe(f, torch.ones(batch, dtype=torch.long), torch.ones(batch, dtype=torch.long))
        if est.steps_since_refit == 0:
            out.append(t)
    return out


def test_cold_start_refits_double_in_labels_until_the_interval_comes_first():
    config = EstimatorConfig(refit_interval=10, cold_start_labels=4)
    # 1 label per step: refits once 4, 4, 8 pending labels are in (4, 8, 16 fitted), then every 10 steps
    assert refit_steps(config, 50, 1) == [4, 8, 16, 26, 36, 46]
    assert refit_steps(config, 40, 3) == [2, 4, 8, 16, 26, 36]  # 6, 12, 24, 48 labels fitted
    assert refit_steps(EstimatorConfig(refit_interval=10, cold_start_labels=0), 40, 3) == [10, 20, 30, 40]
    assert refit_steps(MODES["windowed"], 250, 5) == [100, 200]  # the seed's schedule


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=60),
       st.sampled_from([0, 3]))
def test_no_refit_is_left_due_after_any_step_with_or_without_labels(steps, cold_start_labels):
    """observe checks the labels' schedule only on steps with labels (the others can be due only by
    their count): after every call, labelled or not, neither part of the schedule is overdue."""
    est = OnlineAcceptanceEstimator(2, EstimatorConfig(refit_interval=7, cold_start_labels=cold_start_labels))
    for admitted, count in steps:  # admitted slots of each of 2 requests (0: a step without labels)
        est.observe(torch.ones(2, 2), torch.full((2,), min(admitted, 2)), torch.full((2,), min(admitted, 1)),
                    steps=count)
        nxt = est.next_refit()
        assert nxt.steps > 0 and nxt.labels > 0


def test_next_refit_and_steps_say_when_the_refit_comes():
    est = OnlineAcceptanceEstimator(1, EstimatorConfig(refit_interval=10, cold_start_labels=6))
    nxt = est.next_refit()
    assert (nxt.steps, nxt.labels) == (10, 6)
    f = torch.ones(2, 1)
    est.observe(f, torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long), steps=3)
    assert est.total_steps == 3 and est.next_refit().steps == 7 and est.next_refit().labels == 4
    est.observe(torch.ones(4, 1), torch.ones(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), steps=2)
    assert est.num_refits == 1 and est.steps_since_refit == 0  # six labels: the first refit
    assert est.next_refit().labels == 6  # then as many as already fitted
    est.observe(f, torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long), steps=30)
    assert est.num_refits == 2 and est.total_steps == 35  # one call refits at most once
    assert math.isinf(OnlineAcceptanceEstimator(1, MODES["windowed"]).next_refit().labels)
    with pytest.raises(ValueError, match="steps = -1"):
        est.observe(f, torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long), steps=-1)


def test_refit_happens_every_interval():
    est = OnlineAcceptanceEstimator(2, EstimatorConfig(refit_interval=4, cold_start_labels=0))
    for i in range(1, 10):
        est.observe(torch.ones(3, 2), torch.tensor([2, 1, 0]), torch.tensor([1, 1, 0]))
        assert est.num_refits == i // 4 and est.steps_since_refit == i % 4


# ---- change detection ----------------------------------------------------------------------------

def test_a_change_drops_the_pooled_evidence_and_stationary_traffic_does_not():
    config = mode_config("pooled", change_z=6.0, half_life=math.inf)
    rng = np.random.default_rng(4)
    calm = OnlineAcceptanceEstimator(K, config)
    moved = OnlineAcceptanceEstimator(K, config)
    for t in range(1500):
        observe(calm, draw_step(rng))
        observe(moved, draw_step(rng, intercepts=TRUE_INTERCEPTS - (0.5 if t >= 1000 else 0.0)))
    assert calm.num_changes == 0
    assert moved.num_changes >= 1
    assert np.abs(moved.intercepts.numpy() - (TRUE_INTERCEPTS - 0.5)).mean() < 0.1


# ---- score, labels, validation ----------------------------------------------------------------

def test_score_is_the_logistic_model_and_q_max_when_so_configured():
    est = OnlineAcceptanceEstimator(3, MODES["windowed"])
    f = torch.tensor([[0.0, 2.0, -1.0], [math.nan, math.inf, -math.inf]])
    c = est.score(f)
    assert c.dtype == torch.float64 and c.shape == (2, 3)
    torch.testing.assert_close(c[0], torch.sigmoid(f[0].double()))  # omega 1, beta 0: raw q_max
    assert math.isnan(c[1, 0])
    assert c[1, 1] == torch.sigmoid(torch.tensor(40.0, dtype=torch.float64))
    state = est.state_dict()
    state["slope"] = torch.tensor(0.5, dtype=torch.float64)
    state["intercepts"] = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    est.load_state_dict(state)
    expected = torch.sigmoid(0.5 * f[0].double() + torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64))
    torch.testing.assert_close(est.score(f)[0], expected)
    torch.testing.assert_close(est.survival(c), torch.cumprod(c, dim=1), equal_nan=True)
    assert survival(torch.tensor([[0.5, 0.5, 0.5]])).tolist() == [[0.5, 0.25, 0.125]]
    default = EstimatorConfig()
    start = OnlineAcceptanceEstimator(3).score(f[:1])[0]
    torch.testing.assert_close(start, torch.sigmoid(default.init_slope * f[0].double() + default.init_intercept))


def test_labels_follow_first_rejection_censoring():
    """Statistics count slots 1..a (label 1) and slot a+1 (label 0) only when a < k."""
    est = OnlineAcceptanceEstimator(4, MODES["windowed"])
    f = torch.zeros(4, 4)  # p = 1/2 everywhere, so g1 = #accepted/2 - #rejected/2
    admitted = torch.tensor([4, 4, 2, 0])
    accepted = torch.tensor([1, 4, 2, 0])
    est.observe(f, admitted, accepted)
    s = est.statistics
    assert s["n"].tolist() == [3, 3, 1, 1]
    assert s["g1"].tolist() == [1.5, 0.5, 0.5, 0.5]
    f[1, 3] = math.nan  # an undrafted slot gets no label
    est.observe(f, admitted, accepted)
    assert est.statistics["n"].tolist() == [6, 6, 2, 1]


@pytest.mark.parametrize("batch,k", [(1, 4), (7, 3), (32, 8)])
def test_statistics_are_the_labelled_slots_sums_at_the_current_parameters(batch, k):
    """The six sums of estimator.md over the labelled slots, computed here on arrays (features
    clamped, non-finite ones unlabelled), equal what observe adds, away from the initial
    parameters too."""
    rng = np.random.default_rng(batch)
    config = dataclasses.replace(MODES["windowed"], refit_interval=10**6, feature_clamp=6.0)
    est = OnlineAcceptanceEstimator(k, config)
    est._slope.fill_(1.3)
    est._intercepts.copy_(torch.linspace(-0.5, 1.5, k, dtype=torch.float64))
    f = rng.normal(1.0, 4.0, (batch, k))
    f[rng.random((batch, k)) < 0.1] = np.nan
    f[0, 0], f[-1, -1] = np.inf, -np.inf
    admitted = rng.integers(0, k + 1, batch)
    accepted = np.minimum(rng.integers(0, k + 1, batch), admitted)
    est.observe(torch.tensor(f, dtype=torch.float32), torch.tensor(admitted), torch.tensor(accepted))
    x = torch.tensor(f, dtype=torch.float32).double().numpy()
    pos = np.arange(k)
    m = (pos < np.minimum(accepted + 1, admitted)[:, None]) & np.isfinite(x)
    x = np.clip(np.where(m, x, 0.0), -6.0, 6.0)
    p = 1.0 / (1.0 + np.exp(-(1.3 * x + np.linspace(-0.5, 1.5, k))))
    w, r = p * (1.0 - p) * m, ((pos < accepted[:, None]) - p) * m
    expected = {"a": w * x * x, "b": w * x, "c": w, "g0": r * x, "g1": r, "n": m.astype(float)}
    for name, terms in expected.items():
        np.testing.assert_allclose(est.statistics[name].numpy(), terms.sum(axis=0), rtol=1e-12, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("features,admitted,accepted,match", [
    (torch.zeros(2, 3), [3, 3], [0, 0], r"\[B, K\] tensor with K = 4"),
    (torch.zeros(2, 4, dtype=torch.long), [3, 3], [0, 0], "float tensor"),
    (torch.zeros(2, 4), [3, 3, 3], [0, 0, 0], r"shape \[B\] = \[2\]"),
    (torch.zeros(2, 4), [3.0, 3.0], [0, 0], "integer counts"),
    (torch.zeros(2, 4), [5, 3], [0, 0], r"num_admitted must lie in \[0, K = 4\]"),
    (torch.zeros(2, 4), [2, 3], [3, 0], r"requests \[0\] violate"),
    (torch.zeros(2, 4), [2, 3], [0, -1], r"num_accepted must lie in \[0, num_admitted\]"),
])
def test_observe_rejects_bad_inputs_with_actionable_errors(features, admitted, accepted, match):
    est = OnlineAcceptanceEstimator(4)
    with pytest.raises(ValueError, match=match):
        est.observe(features, torch.tensor(admitted), torch.tensor(accepted))
    assert est.total_steps == 0


def test_constructor_rejects_bad_num_slots():
    with pytest.raises(ValueError, match="num_slots"):
        OnlineAcceptanceEstimator(0)


@pytest.mark.parametrize("field,value", [("mode", "sliding"), ("half_life", 0.0), ("half_life", -5),
                                         ("cold_start_labels", -1), ("cold_start_labels", 2.5),
                                         ("change_z", 0.0), ("refit_interval", 0), ("init_slope", -1.0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"estimator.{field} = "):
        EstimatorConfig(**{field: value})


def test_the_seed_configuration_is_the_seeds():
    seed = EstimatorConfig.seed_windowed()
    assert (seed.mode, seed.cold_start_labels, seed.init_slope, seed.init_intercept) == ("windowed", 0, 1.0, 0.0)
    assert (seed.refit_interval, seed.damping_n0, seed.ridge) == (100, 50.0, 1e-3)
    assert EstimatorConfig.seed_windowed(refit_interval=5).refit_interval == 5


# ---- robustness ----------------------------------------------------------------------------------

feature_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                           st.floats(-60, 60), st.sampled_from([math.nan, math.inf, -math.inf]))


@st.composite
def batches(draw, k: int):
    batch = draw(st.integers(0, 6))
    f = draw(st.lists(st.lists(feature_values, min_size=k, max_size=k), min_size=batch,
                      max_size=batch))
    mode = draw(st.sampled_from(["random", "all_accepted", "all_rejected", "first_only", "none"]))
    admitted, accepted = [], []
    for _ in range(batch):
        adm = {"all_accepted": k, "all_rejected": k, "first_only": 1, "none": 0}.get(
            mode, draw(st.integers(0, k)))
        acc = {"all_accepted": adm, "all_rejected": 0}.get(mode, draw(st.integers(0, adm)))
        admitted.append(adm)
        accepted.append(acc)
    return (torch.tensor(f, dtype=torch.float64).reshape(batch, k),
            torch.tensor(admitted, dtype=torch.long), torch.tensor(accepted, dtype=torch.long))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data(), st.sampled_from(sorted(MODES)), st.integers(1, 5), st.integers(1, 3),
       st.sampled_from([0.0, 50.0]), st.sampled_from([0, 1, 5]))
def test_parameters_stay_finite_and_slope_non_negative(data, mode, k, interval, n0, first):
    config = mode_config(mode, refit_interval=interval, damping_n0=n0, cold_start_labels=first)
    est = OnlineAcceptanceEstimator(k, config)
    for _ in range(data.draw(st.integers(1, 6))):
        features, admitted, accepted = data.draw(batches(k))
        est.observe(features, admitted, accepted)
        assert math.isfinite(est.slope) and est.slope >= 0
        assert torch.isfinite(est.intercepts).all()
        assert all(torch.isfinite(v).all() for v in est.pooled_statistics.values())
        c = est.score(features)
        finite = ~torch.isnan(features)
        assert ((c[finite] >= 0) & (c[finite] <= 1)).all()
        assert torch.isnan(c[~finite]).all()


# ---- merge, memory, state --------------------------------------------------------------------

@pytest.mark.parametrize("mode", sorted(MODES))
def test_merged_halves_equal_one_estimator_fed_everything(mode):
    """Two replicas see half the requests each; before every refit one merges the other's
    statistics, refits, and the other loads its state. That equals one estimator fed all."""
    rng = np.random.default_rng(21)
    config = mode_config(mode, refit_interval=10_000, cold_start_labels=0)  # only refit() refits
    whole, left, right = (OnlineAcceptanceEstimator(K, config) for _ in range(3))
    for interval in range(5):
        for _ in range(20):
            s = draw_step(rng)
            observe(whole, s)
            observe(left, s, slice(0, B // 2))
            observe(right, s, slice(B // 2, B))
        left.merge(right)
        a, b = whole.refit(), left.refit()
        right.load_state_dict(left.state_dict())
        assert a.applied and b.applied and a.num_labels == b.num_labels
        np.testing.assert_allclose(params(left), params(whole), rtol=0, atol=1e-10)
    np.testing.assert_allclose(left.state_dict()["pooled_statistics"], whole.state_dict()["pooled_statistics"],
                               rtol=1e-10, atol=1e-8)


def test_merge_refuses_different_parameters_or_k():
    a, b = OnlineAcceptanceEstimator(3), OnlineAcceptanceEstimator(3)
    b.observe(torch.ones(2, 3), torch.tensor([3, 3]), torch.tensor([1, 3]))
    b.refit()
    with pytest.raises(ValueError, match="different parameters"):
        a.merge(b)
    with pytest.raises(ValueError, match="K = 4"):
        OnlineAcceptanceEstimator(4).merge(a)


def tensor_sizes(est: OnlineAcceptanceEstimator) -> dict[str, int]:
    state = {k: v.numel() for k, v in est.state_dict().items() if isinstance(v, torch.Tensor)}
    state.update({k: v.numel() for k, v in vars(est).items() if isinstance(v, torch.Tensor)})
    return state


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("interval", [1_000, 1_000_000])
def test_memory_does_not_grow_with_batch_or_interval(mode, interval):
    rng = np.random.default_rng(3)
    config = mode_config(mode, refit_interval=interval, cold_start_labels=0)
    small = OnlineAcceptanceEstimator(K, config)
    large = OnlineAcceptanceEstimator(K, config)
    observe(small, draw_step(rng, batch=1))
    for _ in range(30):
        observe(large, draw_step(rng, batch=2048))
    assert large.statistics["n"].sum() > 50_000  # all still pending: no refit yet
    assert tensor_sizes(large) == tensor_sizes(small)
    assert tensor_sizes(large)["statistics"] == tensor_sizes(large)["pooled_statistics"] == 6 * K
    assert sum(v.numel() for v in large.statistics.values()) == 6 * K


@pytest.mark.parametrize("mode", sorted(MODES))
def test_state_dict_round_trips_exactly(mode):
    rng = np.random.default_rng(8)
    config = mode_config(mode, refit_interval=7)
    est = OnlineAcceptanceEstimator(K, config)
    for _ in range(17):  # several refits and some pending steps
        observe(est, draw_step(rng))
    state = est.state_dict()
    assert state["format"] == 2 and (mode == "windowed") == (state["pooled_statistics"].abs().sum() == 0)
    copy = OnlineAcceptanceEstimator(K, config)
    version = copy.version
    copy.load_state_dict(state)
    assert copy.version != version
    for key, value in copy.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state[key]), key
        else:
            assert value == state[key], key
    assert copy.steps_since_refit == est.steps_since_refit and copy.num_refits == est.num_refits
    observe(est, draw_step(rng))  # the state is a copy, not a view
    assert not torch.equal(est.state_dict()["statistics"], state["statistics"])
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    est.load_state_dict(state)
    for _ in range(30):
        observe(est, draw_step(rng_a))
        observe(copy, draw_step(rng_b))
    assert params(est).tolist() == params(copy).tolist()
    with pytest.raises(ValueError, match="num_slots"):
        OnlineAcceptanceEstimator(K - 1).load_state_dict(state)


SEED_FORMAT_KEYS = ("num_slots", "slope", "intercepts", "statistics", "steps_since_refit", "total_steps",
                    "num_refits", "num_skipped")


def test_a_seed_format_state_loads_and_a_saved_state_beats_the_defaults():
    est = OnlineAcceptanceEstimator(3, MODES["windowed"])
    for _ in range(120):
        est.observe(torch.ones(2, 3), torch.tensor([3, 3]), torch.tensor([1, 3]))
    old = {k: v for k, v in est.state_dict().items() if k in SEED_FORMAT_KEYS}  # what the seed saved
    fresh = OnlineAcceptanceEstimator(3)  # the default configuration: pooled, cold start on
    fresh.load_state_dict(old)
    assert fresh.slope == est.slope and torch.equal(fresh.intercepts, est.intercepts)
    assert torch.equal(fresh.state_dict()["statistics"], old["statistics"])
    assert fresh.pooled_statistics["n"].sum() == 0
    assert math.isinf(fresh.next_refit().labels)  # it refitted before: no cold-start refits
    with pytest.raises(ValueError, match=r"lacks \['total_steps'\]"):
        fresh.load_state_dict({k: v for k, v in old.items() if k != "total_steps"})
    with pytest.raises(ValueError, match="format 7"):
        fresh.load_state_dict({**est.state_dict(), "format": 7})


# ---- scorer --------------------------------------------------------------------------------

def test_make_scorer_prefers_the_drafters_head():
    class Head:
        name = "head"
        feature = "logit_q_max"
        version = 0

        def score(self, features):
            return torch.full_like(features, 0.5)

        def observe(self, features, num_admitted, num_accepted):
            return None

    est = make_scorer(4, EstimatorConfig(refit_interval=9))
    assert isinstance(est, OnlineAcceptanceEstimator) and isinstance(est, Scorer)
    assert est.num_slots == 4 and est.config.refit_interval == 9
    head = Head()
    assert make_scorer(4, head=head) is head
    with pytest.raises(TypeError, match="Scorer protocol"):
        make_scorer(4, head=object())


# ---- the trust region ----------------------------------------------------------------------

def pending_statistics(est: OnlineAcceptanceEstimator) -> torch.Tensor:
    return torch.stack([est.statistics[name] for name in _STATS])


def sure_slots_and_one_rejection(est: OnlineAcceptanceEstimator, sure: int = 60) -> None:
    """Code-like labels: slot 1 sure (logit(q_max) 12) and accepted `sure` times, rejected once,
    and a few unsure slots (logit(q_max) 0), half accepted."""
    def one(f: float, accepted: int) -> None:
        est.observe(torch.tensor([[f] + [math.nan] * (K - 1)]), torch.tensor([1]), torch.tensor([accepted]))

    for _ in range(sure):
        one(12.0, 1)
    one(12.0, 0)
    for i in range(10):
        one(0.0, i % 2)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("radius, factor", [(1.0, math.inf), (math.inf, 2.0), (1.0, 2.0)])
def test_the_trust_region_bounds_the_step(mode, radius, factor):
    config = mode_config(mode, refit_interval=10_000, cold_start_labels=0, damping_n0=0.0,
                         trust_radius=radius, slope_factor=factor)
    est = OnlineAcceptanceEstimator(K, config)
    sure_slots_and_one_rejection(est)
    stats = pending_statistics(est)
    result = est.refit()
    # the sure slots' curvature is ~0: the quadratic model asks for omega < 0 (the MLE of these
    # labels is ~0.34: sigmoid(12 omega) = 60/61 with beta_1 = 0 from the unsure slots)
    assert result.newton_slope < -1.0
    asked = logit_change(stats, result.newton_slope, result.newton_intercepts)
    assert asked > 1.0
    if not math.isfinite(factor):  # the radius alone lets omega go below 0: the step is skipped
        assert result.outcome is RefitOutcome.NEGATIVE_SLOPE and est.slope == 1.0
        return
    assert result.applied
    scale = result.delta_slope / result.newton_slope  # the same direction, shortened
    np.testing.assert_allclose(result.delta_intercepts.numpy(), result.newton_intercepts.numpy() * scale, rtol=1e-9)
    assert logit_change(stats, result.delta_slope, result.delta_intercepts) <= radius * (1 + 1e-9)
    assert est.slope == pytest.approx(0.5, rel=1e-9)  # omega halves at most (the bound that binds here)
    assert scale == pytest.approx(min(radius / asked, -0.5 / result.newton_slope), rel=1e-9)


def test_without_the_trust_region_the_whole_step_is_taken():
    def fitted(radius: float, factor: float):
        config = EstimatorConfig(refit_interval=10_000, cold_start_labels=0, damping_n0=0.0, trust_radius=radius,
                                 slope_factor=factor, init_slope=0.1)
        est = OnlineAcceptanceEstimator(K, config)
        f = torch.full((40, K), math.nan)
        f[:, 0] = torch.linspace(-3, 3, 40)
        est.observe(f, torch.ones(40, dtype=torch.long), (f[:, 0] > 0).long())  # separable: omega grows
        return est.refit(), est

    whole, _ = fitted(math.inf, math.inf)
    assert whole.applied and whole.delta_slope == whole.newton_slope and whole.newton_slope > 0.1
    bounded, est = fitted(1.0, 2.0)
    assert bounded.newton_slope == whole.newton_slope and 0 < bounded.delta_slope < whole.delta_slope
    assert est.slope <= 0.2 + 1e-12
    seed = EstimatorConfig.seed_windowed()
    assert seed.trust_radius == math.inf and seed.slope_factor == math.inf


def test_a_step_inside_the_trust_region_is_unchanged():
    rng = np.random.default_rng(5)
    config = EstimatorConfig(refit_interval=10_000, cold_start_labels=0, damping_n0=0.0, trust_radius=1.0,
                             init_slope=TRUE_SLOPE, init_intercept=0.3)
    est = OnlineAcceptanceEstimator(K, config)
    for _ in range(20):
        observe(est, draw_step(rng))
    stats = pending_statistics(est)
    result = est.refit()
    assert logit_change(stats, result.newton_slope, result.newton_intercepts) < 1.0
    assert result.delta_slope == pytest.approx(result.newton_slope, rel=1e-12)
    np.testing.assert_allclose(result.delta_intercepts.numpy(), result.newton_intercepts.numpy(), rtol=1e-12)


def test_the_trust_region_is_validated():
    with pytest.raises(ConfigError, match="trust_radius"):
        EstimatorConfig(trust_radius=0.0)
    with pytest.raises(ConfigError, match="slope_factor"):
        EstimatorConfig(slope_factor=1.0)
    assert EstimatorConfig().trust_radius == 1.0 and EstimatorConfig().slope_factor == 2.0


REAL_CODE_TRACE = Path(__file__).parent / "data" / "code_c1_trace.jsonl.gz"


def test_real_code_traffic_fits_near_the_maximum_likelihood():
    """Code on the real pair at concurrency 1: 94-96% of drafts accepted, most slots sure. What the
    estimators of `specav bench adaptive --workloads code --concurrency 1 --ks none --rounds 4
    --av-variant estimator.trust_radius=inf,estimator.slope_factor=inf --trace` observed on a Zen 4
    EPYC (tests/data/code_c1_trace.jsonl.gz: four rounds each of AV and of the variant without the
    trust region), every stream replayed through the default: its final fit is within 0.01 in
    log-loss of the maximum-likelihood fit of the stream's labels. The negative control, the same
    streams replayed without the trust region: some end with omega 0.10-0.21, 0.05-0.10 above the
    MLE's log-loss (docs/estimator.md, "Near-separable traffic")."""
    from specav.bench.estimator_trace import mle, read_streams, replay

    streams = read_streams(str(REAL_CODE_TRACE))
    assert len(streams) >= 4
    untrusted = EstimatorConfig(trust_radius=math.inf, slope_factor=math.inf)
    trusted_gaps, untrusted_gaps = [], []
    for stream in streams.values():
        _, loss, n, acceptance = mle(stream)
        assert n > 500 and acceptance > 0.9
        trusted_gaps.append(replay(stream, EstimatorConfig(), loss).final_gap)
        untrusted_gaps.append(replay(stream, untrusted, loss).final_gap)
    assert max(trusted_gaps) < 0.01, trusted_gaps
    assert max(untrusted_gaps) > 0.05, untrusted_gaps


def test_the_trace_replay_prints_a_row_per_stream_and_config(capsys):
    from specav.bench.estimator_trace import main, parse_config

    assert parse_config('{"trust_radius": "inf", "change_z": 4}') == EstimatorConfig(trust_radius=math.inf, change_z=4)
    main([str(REAL_CODE_TRACE), "--config", '{"trust_radius": "inf", "slope_factor": "inf"}'])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("code C=1")]
    assert len(rows) == 8  # four rounds of two engines
    for row in rows:  # the stream's name, then labels, acceptance, MLE slope and each config's four figures
        figures = [float(v) for v in row.split()[-(3 + 2 * 4):]]  # (a word that is no number raises)
        assert figures[0] > 500 and 0.9 < figures[1] < 1


def test_the_trace_replay_says_so_where_nothing_was_verified(tmp_path, capsys):
    import json

    from specav.bench.estimator_trace import main

    line = {"workload": "chat", "concurrency": 4, "round": 0, "method": "AV", "admitted": 0, "accepted": 0,
            "features": []}
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({**line, "step": s}) + "\n" for s in range(3)))
    main([str(path)])
    assert "nothing verified" in capsys.readouterr().out
