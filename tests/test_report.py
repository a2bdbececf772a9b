"""Tests for specav.evaluation.report (and its online replays, evaluation/replay.py) on synthetic
logs drawn from a known logistic model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from specav.acceptance.estimator import OnlineAcceptanceEstimator
from specav.config import EstimatorConfig
from specav.evaluation.replay import replay_online
from specav.evaluation.report import (
    SCORERS,
    Report,
    build_report,
    fit_position_logistic,
    held_out_requests,
    load_slots,
)
from specav.evaluation.slot_log import (
    SlotLogWriter,
    SlotRecordBatch,
    SyntheticTruth,
    synthetic_slot_batch,
    write_synthetic_slot_log,
)

NO_SHIFT = SyntheticTruth(workload_shift=(0.0, 0.0, 0.0, 0.0, 0.0))


@pytest.fixture(scope="module")
def with_hidden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path]:
    root = tmp_path_factory.mktemp("with_hidden")
    write_synthetic_slot_log(root / "log", 40_000, seed=11, hidden_dim=16, flush_rows=10_000)
    return build_report(root / "log", root / "out", bins=10, seed=0), root / "out"


@pytest.fixture(scope="module")
def no_hidden(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path]:
    root = tmp_path_factory.mktemp("no_hidden")
    write_synthetic_slot_log(root / "log", 40_000, NO_SHIFT, seed=12)
    return build_report(root / "log", root / "out"), root / "out"


def test_report_files_and_counts(with_hidden: tuple[Report, Path]) -> None:
    report, out = with_hidden
    assert (out / "report.md").is_file()
    for path in report.plot_paths.values():
        assert path.is_file() and path.read_bytes()[:4] == b"\x89PNG"
    assert set(report.plot_paths) == {"reliability", "auc_by_position"}
    assert report.num_slots == 40_000 and report.bins == 10
    assert report.num_train_requests + report.num_test_requests == report.num_requests
    assert 0.15 < report.num_test_slots / report.num_slots < 0.45
    text = (out / "report.md").read_text()
    assert "labelled slots: 40,000" in text and f"requests: {report.num_requests:,}" in text
    assert "10 fixed, equal-width bins on [0, 1]" in text


def test_every_scorer_reported(with_hidden: tuple[Report, Path]) -> None:
    report, _ = with_hidden
    assert [r.key for r in report.overall] == [s.key for s in SCORERS]
    for r in report.overall:
        assert r.metrics is not None and 0.5 < r.metrics.auc < 1.0, r.name
    head = report.result("head").metrics
    assert head.auc > 0.7 and head.log_loss < 0.6
    # fitted logit(q_max) is calibrated on held-out requests; raw q_max is not
    assert report.result("shared").metrics.ece < report.result("q_max").metrics.ece
    # ranking-only rows have AUC but no log-loss
    assert math.isnan(report.result("entropy_rank").metrics.log_loss)


def test_lossy_row_is_marked(with_hidden: tuple[Report, Path]) -> None:
    report, out = with_hidden
    assert [r.key for r in report.overall if not r.lossless] == ["q_sampled"]
    lines = [l for l in (out / "report.md").read_text().splitlines() if l.startswith("| q_sampled")]
    assert lines and all("**no (LOSSY)**" in l for l in lines)


def test_reference_figures_beside_ours(with_hidden: tuple[Report, Path]) -> None:
    text = (with_hidden[1] / "report.md").read_text()
    for figure in ("0.8336 / 0.4284 / 0.0100", "0.8191 / 0.4449 / 0.0052", "0.8352 / 0.4420",
                   "0.8075 / 0.4743", "0.0736", "0.784 / 0.723"):
        assert figure in text


def test_per_position_tables(with_hidden: tuple[Report, Path]) -> None:
    report, out = with_hidden
    k = SyntheticTruth().num_slots
    assert [r.position for r in report.per_position] == list(range(1, k + 1))
    assert sum(r.slots for r in report.per_position) == report.num_test_slots
    excluding = report.excluding_first[0].metrics.n
    assert excluding == report.num_test_slots - report.per_position[0].slots
    assert set(report.per_position[0].auc) == {s.key for s in SCORERS}
    assert "entropy_rank" not in report.per_position[0].log_loss
    text = (out / "report.md").read_text()
    assert "## Excluding position 1" in text and "## Per position: AUC" in text


def test_per_workload_slopes_near_truth(with_hidden: tuple[Report, Path]) -> None:
    report, _ = with_hidden
    truth = SyntheticTruth()
    assert [w.workload for w in report.per_workload] == sorted(truth.workloads)
    for w in report.per_workload:
        assert w.slope == pytest.approx(truth.omega, abs=0.1), w.workload
    # intercepts move with content: the hardest workload has the lowest mean intercept and highest entropy
    worst = min(report.per_workload, key=lambda w: w.mean_intercept)
    assert worst.workload == "unpredictable"
    assert worst.mean_entropy == max(w.mean_entropy for w in report.per_workload)
    assert report.intercept_entropy_r < -0.5


def test_no_hidden_log_still_reports(no_hidden: tuple[Report, Path]) -> None:
    report, out = no_hidden
    head = report.result("head")
    assert head.metrics is None and head.note == "n/a (log has no hidden states)"
    assert "n/a (log has no hidden states)" in (out / "report.md").read_text()
    assert "auc_by_position" in report.plot_paths


def test_offline_fit_recovers_truth(no_hidden: tuple[Report, Path]) -> None:
    report, _ = no_hidden
    shared = report.fits["shared"]
    assert shared.shared_slope and np.all(shared.slope == shared.slope[0])
    assert shared.slope[0] == pytest.approx(NO_SHIFT.omega, abs=0.05)
    np.testing.assert_allclose(shared.intercept[:4], NO_SHIFT.beta[:4], atol=0.12)
    per = report.fits["per_position"]
    np.testing.assert_allclose(per.slope[:3], NO_SHIFT.omega, atol=0.1)


def test_fit_matches_statsmodels() -> None:
    sm = pytest.importorskip("statsmodels.api")
    b = synthetic_slot_batch(6_000, NO_SHIFT, seed=5)
    x, pos, y = b.logit_q_max.astype(float), b.position.astype(int), b.label.astype(float)
    onehot = (pos[:, None] == np.arange(1, pos.max() + 1)[None, :]).astype(float)
    ref = sm.GLM(y, np.column_stack([x, onehot]), family=sm.families.Binomial()).fit()
    fit = fit_position_logistic(x, pos, y)
    assert fit.converged
    np.testing.assert_allclose(fit.slope[0], ref.params[0], atol=1e-5)
    np.testing.assert_allclose(fit.intercept, ref.params[1:], atol=1e-4)
    per = fit_position_logistic(x, pos, y, shared_slope=False)
    ref2 = sm.GLM(y, np.column_stack([onehot * x[:, None], onehot]), family=sm.families.Binomial()).fit()
    np.testing.assert_allclose(per.slope, ref2.params[: pos.max()], atol=1e-4)
    np.testing.assert_allclose(per.intercept, ref2.params[pos.max():], atol=1e-4)


def test_split_is_deterministic_by_request() -> None:
    names = np.array([f"req-{i}" for i in range(5_000)])
    held = held_out_requests(names, seed=0)
    np.testing.assert_array_equal(held, held_out_requests(names, seed=0))
    assert 0.27 < held.mean() < 0.33
    assert not np.array_equal(held, held_out_requests(names, seed=1))


def test_errors_name_the_problem(tmp_path: Path) -> None:
    SlotLogWriter(tmp_path / "empty").close()
    with pytest.raises(ValueError, match="no labelled slots"):
        build_report(tmp_path / "empty", tmp_path / "out")
    one = synthetic_slot_batch(50, seed=1)  # a single request
    with SlotLogWriter(tmp_path / "one") as log:
        log.append(one)
    with pytest.raises(ValueError, match="request split"):
        build_report(tmp_path / "one", tmp_path / "out")


def test_several_logs_are_pooled_with_requests_kept_apart(tmp_path: Path) -> None:
    """Two runs whose request ids collide: pooled, they count as different requests."""
    write_synthetic_slot_log(tmp_path / "a", 6_000, NO_SHIFT, seed=3, hidden_dim=8)
    write_synthetic_slot_log(tmp_path / "b", 6_000, NO_SHIFT, seed=3, hidden_dim=8)  # same ids as a
    one = build_report(tmp_path / "a", tmp_path / "one")
    both = build_report([tmp_path / "a", tmp_path / "b"], tmp_path / "both")
    assert both.num_slots == 2 * one.num_slots and both.num_requests == 2 * one.num_requests
    text = (tmp_path / "both" / "report.md").read_text()
    assert f"`{tmp_path / 'a'}`" in text and f"`{tmp_path / 'b'}`" in text
    from specav.cli import main

    assert main(["eval", "report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2  # where would it go?
    assert main(["eval", "report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "report.md").exists()
    write_synthetic_slot_log(tmp_path / "c", 6_000, NO_SHIFT, seed=4)  # no hidden column
    with pytest.raises(ValueError, match="cannot be pooled"):
        build_report([tmp_path / "a", tmp_path / "c"], tmp_path / "bad")


# ---- online replays of the estimator ---------------------------------------------------------

def simulate_engine_log(directory: Path, config: EstimatorConfig, steps: int, seed: int) -> Path:
    """A slot log written the way the engine writes one: per step, the requests in the batch are
    scored by a live estimator, verified slot by slot, logged (labelled slots only) and observed.
    Some steps label nothing (they leave a gap in the step column)."""
    rng = np.random.default_rng(seed)
    k, truth = 4, np.array([0.6, 0.3, 0.0, -0.3])
    est = OnlineAcceptanceEstimator(k, config)
    with SlotLogWriter(directory, flush_rows=500) as log:
        for step in range(steps):
            batch = 0 if rng.random() < 0.05 else int(rng.integers(1, 7))
            f = np.clip(rng.normal(2.0, 2.5, (batch, k)), -40, 40)
            admitted = rng.integers(0, k + 1, batch)
            accept = rng.random((batch, k)) < 1 / (1 + np.exp(-(0.6 * f + truth)))
            accepted = np.array([int(np.cumprod(a[:m]).sum()) for a, m in zip(accept, admitted)], np.int64)
            conf = est.score(torch.from_numpy(f)).numpy()
            rows = [(b, i) for b in range(batch) for i in range(min(accepted[b] + 1, admitted[b]))]
            if rows:
                b, i = np.array(rows).T
                n = b.size
                log.append(SlotRecordBatch(
                    request_id=np.array([f"r{(step // 20) * 7 + x}" for x in b]), workload=np.full(n, "chat"),
                    step=np.full(n, step), position=i + 1, temperature=np.full(n, 0.7),
                    q_max=1 / (1 + np.exp(-f[b, i])), logit_q_max=f[b, i], entropy=np.ones(n),
                    top2_margin=np.ones(n), q_sampled=np.ones(n), q_max_truncated=np.ones(n),
                    confidence=conf[b, i], label=(i < accepted[b]).astype(np.int8)))
            est.observe(torch.from_numpy(f), torch.from_numpy(admitted), torch.from_numpy(accepted))
    return directory


@pytest.mark.parametrize("config", [EstimatorConfig(), EstimatorConfig.seed_windowed(refit_interval=7),
                                    EstimatorConfig(refit_interval=5, cold_start_labels=3)],
                         ids=["default", "windowed", "short"])
def test_replay_reproduces_the_live_estimator(tmp_path: Path, config: EstimatorConfig) -> None:
    log = simulate_engine_log(tmp_path / "log", config, steps=600, seed=2)
    data = load_slots(log)
    r = replay_online(data.step, data.request, data.position, data.logit_q_max, data.label, config)
    np.testing.assert_allclose(r.confidence, data.confidence, rtol=0, atol=2e-7)  # logged as float32
    assert r.estimator.num_refits > 5
    other = EstimatorConfig.seed_windowed(refit_interval=3)  # negative control: another config differs
    moved = replay_online(data.step, data.request, data.position, data.logit_q_max, data.label, other)
    assert np.abs(moved.confidence - data.confidence).max() > 1e-3


def test_report_replays_both_modes_beside_the_offline_fits(tmp_path: Path) -> None:
    log = simulate_engine_log(tmp_path / "log", EstimatorConfig(), steps=1500, seed=3)
    report = build_report(log, tmp_path / "out")
    logged, pooled = report.result("online").metrics, report.result("online_pooled").metrics
    assert pooled.log_loss == pytest.approx(logged.log_loss, abs=1e-6)  # the log ran the default config
    assert pooled.auc == pytest.approx(logged.auc, abs=1e-6)
    windowed = report.result("online_windowed").metrics
    assert windowed.log_loss != pytest.approx(pooled.log_loss, abs=1e-6)
    assert set(report.replays) == {"online_pooled", "online_windowed"}
    assert report.replays["online_windowed"].config == EstimatorConfig.seed_windowed()
    assert report.replays["online_pooled"].all_slots.n == report.num_slots
    shared = report.fits["shared"]
    assert report.replays["online_pooled"].slope == pytest.approx(shared.slope[0], abs=0.1)
    text = (tmp_path / "out" / "report.md").read_text()
    assert "online replay: pooled (default)" in text and "online replay: windowed (seed)" in text
    assert "pooled (default): final ω / β" in text and "mode=windowed" in text


def test_replay_counts_gaps_and_logs_as_steps() -> None:
    """Steps numbered from 0 per log; gaps are empty steps; a new log starts its own count."""
    one = dict(request=np.array([0, 0, 1]), position=np.array([1, 2, 1]), feature=np.zeros(3),
               label=np.array([1, 0, 1]))
    r = replay_online(np.array([4, 4, 9]), **one, config=EstimatorConfig.seed_windowed())
    assert r.num_steps == 10  # steps 0..9
    r = replay_online(np.array([4, 4, 2]), **one, log=np.array([0, 0, 1]), config=EstimatorConfig.seed_windowed())
    assert r.num_steps == 5 + 3
    empty = replay_online(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), num_slots=3)
    assert empty.confidence.size == 0 and empty.num_steps == 0 and empty.estimator.num_slots == 3
    with pytest.raises(ValueError, match=r"positions must lie in \[1, K = 1\]"):
        replay_online(np.array([0]), np.array([0]), np.array([2]), np.zeros(1), np.ones(1), num_slots=1)


def test_replay_goes_on_through_label_free_steps_after_the_last_label() -> None:
    """An engine steps on after its last draft, and a refit due by steps falls there: with the
    trailing steps the replay makes it too, equal to an estimator fed step by step."""
    config = EstimatorConfig(refit_interval=5, cold_start_labels=0)
    f, admitted, accepted = np.array([[1.5, -0.5]]), np.array([2]), np.array([1])
    live = OnlineAcceptanceEstimator(2, config)
    for step in range(9):  # one labelled step (step 1), then label-free steps 2..8
        empty = step != 1
        live.observe(torch.from_numpy(f[:0] if empty else f), torch.from_numpy(admitted[:0] if empty else admitted),
                     torch.from_numpy(accepted[:0] if empty else accepted))
    assert live.num_refits == 1 and live.slope != 1.0  # the refit fell at step 4, after the last label
    args = (np.array([1, 1]), np.array([0, 0]), np.array([1, 2]), f[0], np.array([1, 0]), config)
    assert replay_online(*args).estimator.num_refits == 0  # the log alone ends at step 1
    r = replay_online(*args, trailing_steps=7)
    assert r.num_steps == 9 and r.estimator.num_refits == 1
    assert r.estimator.slope == pytest.approx(live.slope, abs=1e-12)
    np.testing.assert_allclose(r.estimator.intercepts.numpy(), live.intercepts.numpy(), atol=1e-12)
    with pytest.raises(ValueError, match="trailing_steps"):
        replay_online(*args, trailing_steps=-1)
