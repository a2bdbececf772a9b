"""The predictor replay (specav.bench.predictor) on a synthetic labelled-draft log."""

from __future__ import annotations

import sys

import numpy as np

from specav.bench import predictor
from specav.evaluation.report import fit_position_logistic, load_slots
from specav.evaluation.slot_log import write_synthetic_slot_log


def test_the_replay_predicts_every_block_once_the_population_has_one(tmp_path, monkeypatch, capsys):
    write_synthetic_slot_log(tmp_path / "log", 3_000, seed=3)
    data = load_slots(tmp_path / "log")
    fit = fit_position_logistic(data.logit_q_max, data.position, data.label)
    k = fit.slope.size
    rows = predictor.predictions(data, np.asarray(fit.slope), np.asarray(fit.intercept))
    steps = {(int(r), int(s)) for r, s in zip(data.request, data.step)}
    assert len(rows) == sum(1 for _, s in steps if s > data.step.min())  # (every request drafts from the first step)
    for row in rows:
        for name in predictor.PREDICTORS:
            curve = np.asarray(row[name])
            assert curve.shape == (k,)
            assert np.all((curve >= 0) & (curve <= 1)) and np.all(np.diff(curve) <= 1e-12)  # a survival
        assert 0 <= row["accepted"] <= k
    monkeypatch.setattr(sys, "argv", ["predictor", str(tmp_path / "log")])
    predictor.main()
    out = capsys.readouterr().out
    assert "slot samples" in out and "block samples" in out
