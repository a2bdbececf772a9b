"""Tests for specav.evaluation.report on synthetic logs drawn from a known logistic model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from specav.evaluation.report import (
    SCORERS,
    Report,
    build_report,
    fit_position_logistic,
    held_out_requests,
)
from specav.evaluation.slot_log import SlotLogWriter, SyntheticTruth, synthetic_slot_batch, write_synthetic_slot_log

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
