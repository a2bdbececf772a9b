"""bench ceiling: what rules that stop on the drafter's confidence could gain at most, priced by a
cost profile, on logged K = 8 situations."""

from __future__ import annotations

import numpy as np
import pytest

from specav.bench import ceiling
from specav.bench.ceiling import K, Rule, Situation, oracle_slots, speed
from specav.verification.cost_model import CostCurve, CostModel, CostProfile

# A target token 60 ms, each verified token 5 ms more; a drafter slot 20 ms (catch-up rows 2 ms each).
PROFILE = CostProfile(verify=CostCurve.fit({1: 0.060, 9: 0.100}), draft=CostCurve.fit({1: 0.020, 9: 0.036}))


def test_static_k_and_the_oracle_price_what_they_draft():
    cost = CostModel(PROFILE)
    requests = [[Situation(3, (2.0, 2.0, 2.0, -1.0)), Situation(8, (3.0,) * 8)]]
    target_only = speed(requests, Rule("target-only", min_previous=K + 1).slots, cost)
    assert target_only == pytest.approx(2 / (2 * cost.plain_seconds(1, ceiling.attended(1, ceiling.CONTEXT))))
    # the oracle: 3 then 8 slots drafted and verified, 4 then 9 tokens
    oracle = speed(requests, oracle_slots, cost)
    by_hand = sum(cost.predict([(1, ceiling.attended(1, ceiling.CONTEXT))] + [(1, ceiling.CONTEXT + j) for j in range(1, a)],
                               a + 1, ceiling.attended(a + 1, ceiling.CONTEXT)).total for a in (3, 8))
    assert oracle == pytest.approx(13 / by_hand)
    for k in range(1, K + 1):  # no static K beats the oracle on the same situations
        assert speed(requests, Rule(f"K={k}", static=k).slots, cost) <= oracle


def test_a_stop_rule_drafts_while_the_feature_passes_and_stops_cheapest_past_the_log():
    rule = Rule("t", theta=1.0)
    assert rule.slots(Situation(3, (2.0, 2.0, 0.5, -1.0)), K) == (3, 3)  # slot 3 fails: drafted, not continued
    assert rule.slots(Situation(1, (2.0, 1.5)), K) == (3, 3)  # both logged pass: the unlogged slot 3 stops it
    assert Rule("t", theta=1.0, trim_last=True).slots(Situation(3, (2.0, 2.0, 0.5, -1.0)), K) == (3, 2)
    assert rule.slots(Situation(8, (2.0,) * 8), K) == (8, 8)  # never past K
    assert Rule("gate", min_previous=2, theta=1.0).slots(Situation(3, (2.0,) * 4), 1) == (0, 0)
    # on survival: slots 1..j's confidences sigmoid(f) multiplied, 0.88, 0.78, 0.69, 0.0067 here
    fit = (np.ones(K), np.zeros(K))
    s = Situation(3, (2.0, 2.0, 2.0, -5.0))
    assert Rule("s", theta=0.75, fit=fit).slots(s, K) == (3, 3)  # slot 3's survival 0.69 < 0.75: its last
    assert Rule("s", theta=0.75, fit=fit, trim_last=True).slots(s, K) == (3, 2)
    assert Rule("s", theta=0.5, fit=fit).slots(s, K) == (4, 4)


def test_the_stop_rules_bound_stays_at_or_below_the_oracle_and_at_or_above_target_only():
    """The grid's best, however chosen, drafts no less wastefully than the oracle, and the grid
    holds the rule that never drafts: where drafting never pays, the bound is target-only."""
    cost = CostModel(PROFILE)
    doubtful = [[Situation(0, (-2.0,)), Situation(1, (1.0, -1.0)), Situation(0, (0.5,))] * 5]
    base = speed(doubtful, Rule("target-only", min_previous=K + 1).slots, cost)
    best = max(speed(doubtful, r.slots, cost) for r in ceiling.stop_rules(doubtful))
    oracle = speed(doubtful, oracle_slots, cost)
    assert best == pytest.approx(base) and best <= oracle


def test_a_log_becomes_each_requests_situations_in_step_order(tmp_path):
    """Each (request, step) of the log is one situation: its accepted prefix (the labels' leading
    ones) and its slots' features up to the first rejection. Under PROFILE every accepted slot pays
    (25 ms for a token where decoding one costs 60), so no rule of the grid beats the oracle."""
    from specav.evaluation.report import load_slots
    from specav.evaluation.slot_log import write_synthetic_slot_log

    write_synthetic_slot_log(tmp_path / "log", 3_000, seed=3)
    data = load_slots(tmp_path / "log")
    by_workload, fit = ceiling.situations_by_workload([tmp_path / "log"])
    situations = [s for requests in by_workload.values() for r in requests for s in r]
    assert len(situations) == len({(int(r), int(s)) for r, s in zip(data.request, data.step)})
    assert sum(len(s.features) for s in situations) == data.label.size
    assert sum(s.accepted for s in situations) == int(data.label.sum())
    assert all(len(s.features) in (s.accepted, s.accepted + 1) for s in situations)
    assert fit[0].shape == fit[1].shape == (K,)
    cost = CostModel(PROFILE)
    for requests in by_workload.values():
        oracle = speed(requests, oracle_slots, cost)
        assert max(speed(requests, r.slots, cost) for r in ceiling.stop_rules(requests, fit)) <= oracle
