"""Online acceptance estimator: recovery of a known model, agreement with the offline MLE
(statsmodels), the Schur-complement solve, damping, robustness, merge, memory, state."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
from specav.config import EstimatorConfig

TRUE_SLOPE = 0.6
TRUE_INTERCEPTS = np.linspace(1.0, -0.5, 8)  # acceptance falls with depth
B, K = 16, 8


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


def design(steps: list[Step]) -> tuple[np.ndarray, np.ndarray]:
    """Labelled slots as a GLM design: feature column + one-hot position columns, no constant."""
    f = np.concatenate([s.features[s.labelled] for s in steps])
    pos = np.concatenate([np.nonzero(s.labelled)[1] for s in steps])
    y = np.concatenate([s.labels[s.labelled] for s in steps])
    x = np.zeros((len(y), K + 1))
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


@pytest.fixture(scope="module")
def online_run() -> Run:
    """2,000 steps at B = 16, K = 8 under the default config (20 refits, ~116k labels)."""
    rng = np.random.default_rng(1234)
    est = OnlineAcceptanceEstimator(K)
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
    assert online_run.history.shape == (20, K + 1)
    final = online_run.history[-1]
    assert abs(final[0] - TRUE_SLOPE) < 0.05
    # One refit sees one interval (~160 labels at position 8), so single values are noisy;
    # the mean of the last 10 refits must sit on the truth.
    np.testing.assert_allclose(final[1:], TRUE_INTERCEPTS, atol=0.45)
    recent = online_run.history[-10:].mean(0)
    assert abs(recent[0] - TRUE_SLOPE) < 0.03
    np.testing.assert_allclose(recent[1:], TRUE_INTERCEPTS, atol=0.15)
    assert np.all(np.diff(recent[1:4]) < 0), "intercepts must fall with depth"


def test_approaches_the_offline_mle(online_run: Run, mle: np.ndarray):
    np.testing.assert_allclose(mle[0], TRUE_SLOPE, atol=0.03)  # the reference itself is sane
    final, recent = online_run.history[-1], online_run.history[-10:].mean(0)
    assert abs(final[0] - mle[0]) < 0.03
    np.testing.assert_allclose(recent[1:], mle[1:], atol=0.12)
    x, y = design(online_run.steps)
    gap = log_loss(x, y, final) - log_loss(x, y, mle)
    assert -1e-9 < gap < 0.005
    unfitted = np.r_[1.0, np.zeros(K)]  # raw q_max: the test can tell fitted from unfitted
    assert log_loss(x, y, unfitted) - log_loss(x, y, mle) > 0.02


def test_the_first_refit_moves_toward_the_truth():
    rng = np.random.default_rng(7)
    est = OnlineAcceptanceEstimator(K, EstimatorConfig(refit_interval=50))
    for _ in range(50):
        observe(est, draw_step(rng))
    assert est.last_refit is not None and est.last_refit.applied
    assert abs(est.slope - TRUE_SLOPE) < abs(1.0 - TRUE_SLOPE)


# ---- the Newton step ------------------------------------------------------------------------

def dense_newton(a, b, c, g0, g1, ridge) -> np.ndarray:
    k = len(a)
    h = np.zeros((k + 1, k + 1))
    h[0, 0] = a.sum()
    h[0, 1:] = h[1:, 0] = b
    h[1:, 1:] = np.diag(c)
    g = np.r_[g0.sum(), g1]
    return np.linalg.solve(h + ridge * np.eye(k + 1), g)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ridge", [1e-3, 0.5])
def test_schur_complement_equals_dense_solve(seed, ridge):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 12))
    n = rng.integers(0, 50, k)  # includes empty positions
    a, b, c, g0, g1 = (np.zeros(k) for _ in range(5))
    for i in range(k):
        f, p = rng.normal(0, 3, n[i]), rng.uniform(0.01, 0.99, n[i])
        w, r = p * (1 - p), (rng.random(n[i]) < 0.7) - p
        a[i], b[i], c[i], g0[i], g1[i] = (w * f * f).sum(), (w * f).sum(), w.sum(), (r * f).sum(), r.sum()
    stats = torch.from_numpy(np.stack([a, b, c, g0, g1, n.astype(float)]))
    step = newton_step(stats, ridge)
    expected = dense_newton(a, b, c, g0, g1, ridge)
    np.testing.assert_allclose(np.r_[step.slope, step.intercepts.numpy()], expected,
                               rtol=1e-10, atol=1e-12)


def raw_newton(est: OnlineAcceptanceEstimator, steps: list[Step], ridge: float) -> np.ndarray:
    """The undamped Newton step from raw labels, at the estimator's parameters, solved densely."""
    x, y = design(steps)
    p = 1 / (1 + np.exp(-(x @ params(est))))
    h = x.T @ (x * (p * (1 - p))[:, None])
    return np.linalg.solve(h + ridge * np.eye(len(h)), x.T @ (y - p))


def test_damping_scales_the_newton_step():
    rng = np.random.default_rng(11)
    config = EstimatorConfig(refit_interval=10_000, damping_n0=50.0)
    est = OnlineAcceptanceEstimator(K, config)
    steps = [draw_step(rng) for _ in range(6)]
    for s in steps:
        observe(est, s)
    before = params(est)
    expected = raw_newton(est, steps, config.ridge)
    n_i = design(steps)[0][:, 1:].sum(0)
    result = est.refit()
    assert result.outcome is RefitOutcome.APPLIED and result.applied
    assert result.num_labels == n_i.sum() and result.num_labels_per_slot.tolist() == n_i.tolist()
    np.testing.assert_allclose(np.r_[result.newton_slope, result.newton_intercepts.numpy()],
                               expected, rtol=1e-9)
    n = n_i.sum()
    assert result.delta_slope == pytest.approx(expected[0] * n / (n + 50.0), rel=1e-9)
    np.testing.assert_allclose(result.delta_intercepts.numpy(), expected[1:] * n_i / (n_i + 50.0),
                               rtol=1e-9)
    np.testing.assert_allclose(params(est) - before, np.r_[result.delta_slope,
                                                           result.delta_intercepts.numpy()])


def test_a_position_with_few_labels_moves_less_but_moves():
    k = 3
    est = OnlineAcceptanceEstimator(k, EstimatorConfig(refit_interval=10_000, damping_n0=50.0))
    rng = np.random.default_rng(5)
    f = rng.normal(1.0, 2.0, (200, k))
    admitted = np.array([3] * 4 + [2] * 146 + [1] * 50)  # 200, 150 and 4 labels
    accepted = np.zeros(200, np.int64)
    for row in range(200):  # labels from the unfitted model itself: sigmoid(f)
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


def test_a_step_that_would_make_the_slope_negative_is_skipped():
    est = OnlineAcceptanceEstimator(1, EstimatorConfig(refit_interval=10_000, init_slope=0.01))
    f = torch.linspace(-5, 5, 400).unsqueeze(1)
    accepted = (f[:, 0] < 0).long()  # confident slots are the rejected ones
    est.observe(f, torch.ones(400, dtype=torch.long), accepted)
    result = est.refit()
    assert result.outcome is RefitOutcome.NEGATIVE_SLOPE and not result.applied
    assert result.newton_slope < -0.01 and result.delta_slope == 0.0
    assert est.slope == 0.01 and est.num_skipped == 1
    assert all(v.abs().sum() == 0 for v in est.statistics.values())


def test_a_non_finite_step_is_skipped():
    est = OnlineAcceptanceEstimator(2)
    state = est.state_dict()
    state["statistics"][:, 0] = torch.tensor([1.0, math.inf, 1.0, 1.0, 1.0, 3.0])
    est.load_state_dict(state)
    result = est.refit()
    assert result.outcome is RefitOutcome.NON_FINITE
    assert est.slope == 1.0 and est.intercepts.tolist() == [0.0, 0.0] and est.num_skipped == 1


def test_a_refit_without_labels_changes_nothing():
    est = OnlineAcceptanceEstimator(4, EstimatorConfig(refit_interval=3))
    for _ in range(3):
        est.observe(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long),
                    torch.zeros(0, dtype=torch.long))
    assert est.num_refits == 1 and est.last_refit.outcome is RefitOutcome.NO_LABELS
    assert est.steps_since_refit == 0 and est.total_steps == 3 and est.num_skipped == 0
    assert est.slope == 1.0


# ---- score, labels, validation ----------------------------------------------------------------

def test_score_is_the_logistic_model_and_starts_at_q_max():
    est = OnlineAcceptanceEstimator(3)
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


def test_labels_follow_first_rejection_censoring():
    """Statistics count slots 1..a (label 1) and slot a+1 (label 0) only when a < k."""
    est = OnlineAcceptanceEstimator(4, EstimatorConfig(refit_interval=10_000))
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


def test_refit_happens_every_interval():
    est = OnlineAcceptanceEstimator(2, EstimatorConfig(refit_interval=4))
    for i in range(1, 10):
        est.observe(torch.ones(3, 2), torch.tensor([2, 1, 0]), torch.tensor([1, 1, 0]))
        assert est.num_refits == i // 4 and est.steps_since_refit == i % 4


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
@given(st.data(), st.integers(1, 5), st.integers(1, 3), st.sampled_from([0.0, 50.0]))
def test_parameters_stay_finite_and_slope_non_negative(data, k, interval, n0):
    est = OnlineAcceptanceEstimator(k, EstimatorConfig(refit_interval=interval, damping_n0=n0))
    for _ in range(data.draw(st.integers(1, 6))):
        features, admitted, accepted = data.draw(batches(k))
        est.observe(features, admitted, accepted)
        assert math.isfinite(est.slope) and est.slope >= 0
        assert torch.isfinite(est.intercepts).all()
        c = est.score(features)
        finite = ~torch.isnan(features)
        assert ((c[finite] >= 0) & (c[finite] <= 1)).all()
        assert torch.isnan(c[~finite]).all()


# ---- merge, memory, state --------------------------------------------------------------------

def test_merged_halves_equal_one_estimator_fed_everything():
    rng = np.random.default_rng(21)
    config = EstimatorConfig(refit_interval=10_000)
    whole, left, right = (OnlineAcceptanceEstimator(K, config) for _ in range(3))
    for _ in range(40):
        s = draw_step(rng)
        observe(whole, s)
        observe(left, s, slice(0, B // 2))
        observe(right, s, slice(B // 2, B))
    left.merge(right)
    a, b = whole.refit(), left.refit()
    assert a.applied and b.applied and a.num_labels == b.num_labels
    np.testing.assert_allclose(params(left), params(whole), rtol=0, atol=1e-10)


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


@pytest.mark.parametrize("interval", [1_000, 1_000_000])
def test_memory_does_not_grow_with_batch_or_interval(interval):
    rng = np.random.default_rng(3)
    small = OnlineAcceptanceEstimator(K, EstimatorConfig(refit_interval=interval))
    large = OnlineAcceptanceEstimator(K, EstimatorConfig(refit_interval=interval))
    observe(small, draw_step(rng, batch=1))
    for _ in range(30):
        observe(large, draw_step(rng, batch=2048))
    assert large.statistics["n"].sum() > 50_000  # all still pending: no refit yet
    assert tensor_sizes(large) == tensor_sizes(small)
    assert tensor_sizes(large)["statistics"] == 6 * K
    assert sum(v.numel() for v in large.statistics.values()) == 6 * K


def test_state_dict_round_trips_exactly():
    rng = np.random.default_rng(8)
    config = EstimatorConfig(refit_interval=7)
    est = OnlineAcceptanceEstimator(K, config)
    for _ in range(17):  # two refits and three pending steps
        observe(est, draw_step(rng))
    state = est.state_dict()
    copy = OnlineAcceptanceEstimator(K, config)
    copy.load_state_dict(state)
    for key, value in copy.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state[key]), key
        else:
            assert value == state[key], key
    assert copy.steps_since_refit == 3 and copy.num_refits == 2
    observe(est, draw_step(rng))  # the state is a copy, not a view
    assert not torch.equal(est.state_dict()["statistics"], state["statistics"])
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    est.load_state_dict(state)
    for _ in range(10):
        observe(est, draw_step(rng_a))
        observe(copy, draw_step(rng_b))
    assert params(est).tolist() == params(copy).tolist()
    with pytest.raises(ValueError, match="num_slots"):
        OnlineAcceptanceEstimator(K - 1).load_state_dict(state)


# ---- scorer --------------------------------------------------------------------------------

def test_make_scorer_prefers_the_drafters_head():
    class Head:
        name = "head"
        feature = "logit_q_max"

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
