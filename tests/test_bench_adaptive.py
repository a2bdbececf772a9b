"""The adaptive benchmark (specav/bench/adaptive.py): the oracle replay, the methods' step order, the trace."""

import collections
import itertools

import pytest

from specav.bench.adaptive import Run, _Step, oracle, oracle_forwards, step_orders
from specav.types import attended
from specav.verification.cost_model import CostCurve, CostProfile

PROFILE = CostProfile(CostCurve.fit({1: 0.040, 8: 0.060, 64: 0.300}, 2e-6),
                      CostCurve.fit({1: 0.010, 8: 0.020, 128: 0.200}, 1e-6))


def k8_step(request_ids, accepted, draft_pending, tokens, target_pending=None) -> _Step:
    """A static K=8 step as the engine records it: every request drafts 8 slots, its first forward
    feeding its drafter's pending tokens."""
    forwards = [(sum(draft_pending), sum(attended(p, n - p) for p, n in zip(draft_pending, tokens)))]
    forwards += [(len(request_ids), sum(attended(1, n + j - 2) for n in tokens)) for j in range(2, 9)]
    pending = len(request_ids) if target_pending is None else target_pending
    return _Step(pending, 100 * (pending + 8 * len(request_ids)), list(accepted), forwards, 8 * len(request_ids),
                 list(request_ids), list(draft_pending), list(tokens))


def test_the_first_forward_feeds_the_prompt_and_every_token_not_drafted_since():
    unseen: dict[str, int] = {}
    # the prompt step: slot 1 rejected, so the oracle does not draft, and its drafter has not seen the prompt
    assert oracle_forwards(k8_step(["a"], [0], [100], [100], 100), unseen) == []
    assert unseen == {"a": 100}
    # the next step drafts 2: the prompt and this step's pending token in one forward, then one row
    forwards = oracle_forwards(k8_step(["a"], [2], [1], [101]), unseen)
    assert forwards == [(101, attended(101, 0)), (1, attended(1, 101))]
    assert unseen == {"a": 0}
    # two requests: b is new and accepted 3, a accepted 1
    forwards = oracle_forwards(k8_step(["a", "b"], [1, 3], [2, 50], [104, 50]), unseen)
    assert forwards == [(52, attended(2, 102) + attended(50, 0)), (1, attended(1, 50)), (1, attended(1, 51))]


def test_an_oracle_accepting_every_slot_costs_what_k8_measured():
    """Every slot accepted: the oracle drafts and verifies what K=8 did, prompt catch-ups included."""
    k8 = Run("static K=8", tokens=2 * 9 + 9, seconds=1.5, steps=3)
    k8.replay = [k8_step(["a", "b"], [8, 8], [120, 80], [120, 80], 200), k8_step(["a", "b"], [8, 8], [2, 2], [129, 89]),
                 k8_step(["c"], [8], [60], [60], 60)]
    assert oracle(k8, PROFILE).seconds == pytest.approx(1.5)


def test_an_oracle_whose_drafts_fail_drafts_nothing():
    k8 = Run("static K=8", tokens=2, seconds=1.0, steps=2)
    k8.replay = [k8_step(["a"], [0], [100], [100], 100), k8_step(["a"], [0], [1], [101])]
    run = oracle(k8, PROFILE)
    assert run.drafted == 0 and run.seconds < 1.0


def test_the_trace_writes_each_requests_decisions_and_counts_its_drafting_steps(tmp_path):
    import json
    import math
    from types import SimpleNamespace

    import torch

    from specav.bench.adaptive import Trace
    from specav.config import SamplingParams
    from specav.request import Request
    from specav.types import StageTimes

    def record(step, drafted, reason, prefill=0):
        features = torch.tensor([[2.5, -0.25, math.nan, math.nan]])
        return SimpleNamespace(step=step, requests=[request], drafts=SimpleNamespace(num_drafted=torch.tensor([drafted])),
                               scores=SimpleNamespace(features=features),
                               num_admitted=torch.tensor([drafted]), num_accepted=torch.tensor([min(drafted, 1)]),
                               draft_reasons=(reason,), times=StageTimes(0.01, 0.03, 0.04), prefill_tokens=prefill,
                               plan=SimpleNamespace(predicted=StageTimes(0.01, 0.025, 0.035)))

    path = tmp_path / "trace.jsonl"
    trace = Trace(str(path))
    trace.start("code", 1, 0)
    request = Request([1, 2, 3], SamplingParams(), request_id="a")
    trace.listen(record(0, 0, "", prefill=3))  # its prefill: not a decoding step
    request.output_ids = [5]
    trace.listen(record(1, 2, "rule"))
    trace.listen(record(2, 0, ""))
    trace.listen(record(3, 0, ""))
    assert trace.summary().endswith("a: 1/2")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4
    assert lines[1] == {"workload": "code", "concurrency": 1, "round": 0, "method": "AV", "step": 1, "request": "a",
                        "output": 1, "reason": "rule", "drafted": 2, "admitted": 2, "accepted": 1,
                        "features": [2.5, -0.25], "seconds": 0.04, "predicted": 0.035}
    assert lines[2]["features"] == []


def test_the_trace_attached_to_an_adaptive_engine_writes_its_planners_and_estimators_state(tmp_path):
    import json

    from specav.bench.adaptive import Trace
    from specav.config import SamplingParams
    from specav.drafting import DraftModelDrafter
    from tests.tiny_models import adaptive_engine, cheap_drafting_profile, tiny_pair

    target, drafter = tiny_pair(noise=0.08)
    engine = adaptive_engine(target, DraftModelDrafter(drafter), cheap_drafting_profile(), max_batch_size=2)
    path = tmp_path / "trace.jsonl"
    trace = Trace(str(path))
    trace.start("code", 2, 0)
    trace.attach(engine)
    batches = []
    engine.step_listeners.append(lambda record: batches.append([r.request_id for r in record.requests]))
    engine.generate([[3, 4, 5], [9, 8, 7, 6]], SamplingParams(temperature=0, max_tokens=120))
    trace.summary()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["request"] for line in lines] == [r for batch in batches for r in batch]  # a line per request-step
    last = lines[-1]
    assert {"wait", "interval", "probing", "speedup", "budget_ms", "population", "plain_ms", "scales", "slope",
            "intercepts", "changes"} <= last.keys()
    assert last["plain_ms"] > 0 and len(last["scales"]) == 3 and last["predicted"] > 0
    assert len(last["intercepts"]) == 4 and last["slope"] == pytest.approx(float(engine.scorer.slope), abs=1e-3)
    assert any(line["drafted"] for line in lines)  # drafting paid, so the trace saw drafts and their reasons
    assert {line["reason"] for line in lines if line["drafted"]} <= {"cold start", "rule", "probe", "explore"}

    # what the estimator observed: replayed from the trace, the same fit as the engine's own estimator
    from specav.bench.estimator_trace import read_streams, replay

    (key, stream), = read_streams(str(path), num_slots=4).items()
    assert key == ("code", 2, 0, "AV") and 0 <= stream.step.min() <= stream.step.max() < engine.stats.steps
    assert engine.scorer.num_refits >= 1 and float(engine.scorer.slope) != 1.0  # a fit to reproduce
    replayed = replay(stream, engine.scorer.config, 0.0)
    assert replayed.slope == pytest.approx(float(engine.scorer.slope), abs=1e-3)


def test_a_variant_changes_adaptive_and_estimator_fields():
    import argparse
    import math

    from specav.bench.adaptive import _variant
    from specav.config import AdaptiveConfig, EstimatorConfig

    parser = argparse.ArgumentParser()
    adaptive, estimator = _variant(parser, "probe_share=0.005,estimator.trust_radius=inf,estimator.change_z=4")
    assert adaptive == AdaptiveConfig(probe_share=0.005)
    assert estimator == EstimatorConfig(trust_radius=math.inf, change_z=4.0)
    for bad in ("estimator.nope=1", "probe_share", "estimator.trust_radius=-1"):
        with pytest.raises(SystemExit):
            _variant(parser, bad)


def test_every_method_steps_in_every_place_and_after_every_other_method_alike():
    """A step's time depends on the step before it, so no method may keep the same neighbour (the
    order listed and reversed every turn put AV next to static K = 8 for a whole cell)."""
    methods, turns = 6, 6000
    orders = list(itertools.islice(step_orders(methods, seed=0), turns))
    assert all(sorted(order) == list(range(methods)) for order in orders)
    places = collections.Counter((m, order.index(m)) for order in orders for m in order)
    assert min(places.values()) > 0.85 * turns / methods and max(places.values()) < 1.15 * turns / methods
    sequence = [m for order in orders for m in order]
    follows = collections.Counter(zip(sequence, sequence[1:]))
    pairs = [(a, b) for a in range(methods) for b in range(methods) if a != b]
    expected = turns / methods * (1 + 1 / methods)  # in a turn, and across its boundary to the next
    assert all(0.8 * expected < follows[pair] < 1.2 * expected for pair in pairs)
    # the reversed order it replaced fails this: AV (listed last) never steps right after target-only (first)
    reversed_orders = [list(range(methods))[:: 1 if t % 2 == 0 else -1] for t in range(turns)]
    sequence = [m for order in reversed_orders for m in order]
    assert collections.Counter(zip(sequence, sequence[1:]))[(0, methods - 1)] == 0
    assert list(itertools.islice(step_orders(methods, seed=1), 3)) != orders[:3]  # each round its own orders
