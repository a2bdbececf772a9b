"""The planners' rules as units: admission by survival, the draft rule, skip and probe, exploration.

The lossless proofs (distributions) are in tests/test_adaptive_lossless.py; this file checks
what the rules decide on hand-built batches.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specav.acceptance.estimator import OnlineAcceptanceEstimator, survival
from specav.acceptance.features import LossyFeatureError
from specav.config import AdaptiveConfig, SamplingParams
from specav.request import Request
from specav.types import DraftBatch, Ragged, Scores
from specav.verification.adaptive import (_PRIOR_BLOCKS, AdaptivePlanner, BlockSamples, Population, SurvivalSums,
                                          block_survival, select_prefix)
from specav.verification.cost_model import CostCurve, CostModel, CostProfile
from specav.verification.planner import PLANNERS, DraftPlan, StaticPlanner, RequestShape, make_planner

V = 6
FROZEN = math.inf  # a cost-model half-life so long that nothing measured moves it


def cost_model(verify_per_token: float = 0.1, draft_fixed: float = 0.2, draft_per_row: float = 0.02) -> CostModel:
    verify = CostCurve.fit({1: 1.0, 64: 1.0 + 63 * verify_per_token})
    draft = CostCurve.fit({1: draft_fixed + draft_per_row, 64: draft_fixed + 64 * draft_per_row})
    return CostModel(CostProfile(verify, draft), halflife=FROZEN)


def slower_drafting_verify(cost: CostModel, factor: float) -> None:
    """Make the cost model's drafting steps verify `factor` x slower than its plain steps (a premium)."""
    curve = cost.profile.verify
    cost.target.curves["verify"] = CostCurve.fit({t: factor * y for t, y in zip(curve.tokens, curve.seconds)},
                                                 curve.per_context)


def _decoding_record(batch, drafted, admitted, accepted, seconds):
    """What observe reads of a step record: a decoding step (one pending token each, no context)."""
    from specav.types import StageTimes

    class Record:
        requests, times, prefill_tokens, max_slots = batch, StageTimes(0.0, seconds, seconds), 0, [4] * len(batch)
        drafts = type("D", (), {"forwards": [(len(batch), 0)] * max(drafted, default=0), "num_drafted": torch.tensor(drafted)})()
        num_admitted, num_accepted = torch.tensor(admitted), torch.tensor(accepted)
        verify_tokens, verify_attended = len(batch) + sum(admitted), 0
        scores, draft_reasons = Scores.empty(len(batch)), ()
    return Record()


def planner(k: int = 4, exploration: float = 0.0, control_share: float = 0.0, cold_start_after: int = 0,
            **config) -> AdaptivePlanner:
    """The planner on cost_model(); exploration and control steps off, and the cold start allowed at a
    request's first token (these requests emit nothing), unless asked."""
    return AdaptivePlanner(k, OnlineAcceptanceEstimator(k), cost_model(),
                           AdaptiveConfig(exploration=exploration, control_share=control_share,
                                          cold_start_after=cold_start_after, **config))


def drafts_for(counts: list[int], k: int) -> DraftBatch:
    """A DraftBatch with counts[b] drafted slots (tokens and distributions are placeholders)."""
    b = len(counts)
    tokens = torch.full((b, k), -1, dtype=torch.int64)
    for i, n in enumerate(counts):
        tokens[i, :n] = 0
    layout = Ragged.of(counts)
    return DraftBatch(tokens, layout, torch.full((layout.total, V), 1.0 / V), {})


def scores_of(confidences: list[list[float]], k: int) -> Scores:
    c = torch.full((len(confidences), k), math.nan, dtype=torch.float64)
    for i, row in enumerate(confidences):
        c[i, :len(row)] = torch.tensor(row, dtype=torch.float64)
    return Scores(torch.zeros_like(c), c, survival(c))


def admit(confidences: list[list[float]], price: float, k: int = 4, explore: list[bool] | None = None):
    p = planner(k)
    counts = [len(row) for row in confidences]
    explore_mask = torch.tensor(explore if explore else [False] * len(counts), dtype=torch.bool)
    plan = p.plan(drafts_for(counts, k), scores_of(confidences, k),
                  DraftPlan(counts, None, explore_mask, price, tuple(RequestShape(1, 0) for _ in counts)))
    return plan.num_admitted.tolist()


# ---- admission --------------------------------------------------------------------------

def test_registry_holds_both_planners():
    assert set(PLANNERS) == {"static", "adaptive"}
    assert isinstance(make_planner("static"), StaticPlanner)
    with pytest.raises(ValueError, match="unknown planner"):
        make_planner("argmax")


def test_a_confident_requests_deep_slot_outranks_a_doubtful_requests_first_slot():
    # price 5, verify 0.1 s per token: a slot pays when its survival >= 0.5
    assert admit([[0.99] * 4, [0.3, 0.9]], price=5.0) == [4, 0]
    assert admit([[0.6, 0.6, 0.6], [0.9, 0.9]], price=5.0) == [1, 2]  # 0.6 pays, 0.36 does not; 0.81 pays


def test_every_confidence_one_admits_all_and_zero_admits_none():
    assert admit([[1.0] * 4, [1.0] * 2], price=5.0) == [4, 2]
    assert admit([[0.0] * 4, [0.0] * 3], price=1e-3) == [0, 0]


def test_one_request_and_k_one():
    assert admit([[0.7, 0.7]], price=5.0, k=2) == [1]
    assert admit([[0.7]], price=5.0, k=1) == [1]
    assert admit([[0.4]], price=5.0, k=1) == [0]


def test_empty_batch_and_nothing_drafted():
    assert admit([], price=5.0) == []
    assert admit([[], []], price=5.0) == [0, 0]


def test_exploring_requests_verify_their_whole_block():
    assert admit([[0.1, 0.1, 0.1], [0.1, 0.1]], price=5.0, explore=[True, False]) == [3, 0]


def test_ties_break_by_position_so_the_scan_never_skips_a_shallower_slot():
    # equal survival everywhere: request order decides between requests, position within one
    assert admit([[1.0, 1.0], [1.0, 1.0]], price=1.0) == [2, 2]


def test_nan_confidence_never_admits():
    assert admit([[math.nan, 0.99]], price=5.0) == [0]


@given(st.lists(st.lists(st.floats(0, 1), min_size=0, max_size=4), min_size=1, max_size=6),
       st.floats(0.01, 30))
@settings(max_examples=200, deadline=None)
def test_admitted_slots_are_prefixes_and_the_top_of_the_survival_ranking(confidences, price):
    admitted = admit(confidences, price)
    surv = [torch.cumprod(torch.tensor(row, dtype=torch.float64), 0).tolist() for row in confidences]
    kept = [s for row, n in zip(surv, admitted) for s in row[:n]]
    dropped = [s for row, n in zip(surv, admitted) for s in row[n:]]
    assert all(0 <= n <= len(row) for row, n in zip(confidences, admitted))
    if kept and dropped:
        assert min(kept) >= max(dropped)  # nothing trimmed ranks above something admitted


def test_higher_price_never_admits_more():
    confidences = [[0.95, 0.9, 0.8, 0.5], [0.7, 0.6], [0.99, 0.99, 0.99]]
    totals = [sum(admit(confidences, price)) for price in (0.5, 2, 5, 8, 12, 50)]
    assert totals == sorted(totals, reverse=True) and totals[0] == 9 and totals[-1] == 0


# ---- the draft rule ---------------------------------------------------------------------

def linear(fixed: float, per: float):
    return lambda t: fixed + per * t


def test_select_prefix_takes_the_candidates_that_pay_jointly():
    # one forward costs 1 + 0.1 per row, each verified slot 0.1; price 1
    assert select_prefix([0.6, 0.5], [1, 1], 0, 1.0, linear(1.0, 0.1), [0.1] * 2) == 0  # 1.1 < 1.2 + 0.2
    assert select_prefix([0.9, 0.8], [1, 1], 0, 1.0, linear(1.0, 0.1), [0.1] * 2) == 2  # 1.7 > 1.2 + 0.2
    assert select_prefix([0.9] * 4, [1] * 4, 0, 1.0, linear(1.0, 0.1), [0.1] * 4) == 4  # 3.6 > 1.4 + 0.4
    assert select_prefix([0.9, 0.1], [1, 1], 0, 1.0, linear(0.5, 0.1), [0.1] * 2) == 1  # the second does not pay
    assert select_prefix([0.3, 0.25], [1, 1], 2, 1.0, linear(1.0, 0.1), [0.1] * 2) == 2  # forward already paid for
    assert select_prefix([], [], 0, 1.0, linear(1.0, 0.1), []) == 0
    # a candidate's own costs (its slot attends to a long context) count against its gain alone
    assert select_prefix([0.9, 0.8], [1, 1], 0, 1.0, linear(0.5, 0.1), [0.1, 0.8]) == 1  # 0.8 < 0.1 + 0.8


def test_a_slot_of_a_long_request_costs_more_to_draft_and_verify():
    """Attention is priced per attended position: with equal gains, the request with the shorter
    context drafts first, and a long enough context stops a slot that would pay over a short one."""
    verify = CostCurve.fit({1: 1.0, 64: 1.0 + 63 * 0.1}, per_context=0.001)
    draft = CostCurve.fit({1: 0.22, 64: 0.2 + 64 * 0.02}, per_context=0.001)
    p = AdaptivePlanner(4, OnlineAcceptanceEstimator(4), CostModel(CostProfile(verify, draft), halflife=FROZEN),
                        AdaptiveConfig(exploration=0.0, control_share=0.0))
    # price 1 token/s: a slot of gain 0.5 costs 0.02 (row) + 0.1 (verify) + 0.002 * attended
    assert p.choose([0.5, 0.5], [1, 1], 1, 1.0, 4, [1000, 10]) == [1]  # 0.12 + 2.0 > 0.5: the long one stops
    assert p.choose([0.5, 0.5], [1, 1], 1, 1.0, 4, [100, 10]) == [1, 0]  # both pay, the short one first
    model = p.cost
    assert model.verify_added(4, 1, 1000) - model.verify_added(4, 1, 10) == pytest.approx(990 * 0.001)


def requests(n: int) -> list[Request]:
    return [Request([1, 2, 3], SamplingParams(), request_id=f"r{i}") for i in range(n)]


def test_stop_rule_continues_confident_requests_and_stops_doubtful_ones():
    p = planner(4)
    p.population = Population.of([[6.0]])  # the traffic drafts confidently: both new requests draft slot 1
    batch = requests(2)
    plan = p.draft_plan(batch, [4, 4], [RequestShape(1, 10)] * 2)
    assert plan.num_slots == [4, 4]
    # features: request 0 very confident (logit 6 -> q_max ~ 0.998), request 1 doubtful (logit -2)
    keep = plan.stop_rule.keep_drafting(0, [0, 1], {"logit_q_max": torch.tensor([6.0, -2.0])})
    assert keep.tolist() == [True, False]


def test_stop_rule_values_the_block_ahead_not_the_next_slot_alone():
    """Verifying slot 2 costs 1 s, every later slot 0.01 s: slot 2 alone does not pay at price 1
    (its expected 0.8 tokens < 1 s), slots 2..4 together do, so the rule drafts on. With the same
    costs made linear the block is worth no more than its first slot and the rule stops."""
    def drafts_slot_2(verify: CostCurve) -> bool:
        draft = CostCurve.fit({1: 0.01, 64: 0.64})
        p = AdaptivePlanner(4, OnlineAcceptanceEstimator(4), CostModel(CostProfile(verify, draft), halflife=FROZEN),
                            AdaptiveConfig(exploration=0.0, control_share=0.0))
        p.population = Population.of([[6.0]])
        p.target_only_rate = lambda shapes: 1.0  # price 1 token per second
        plan = p.draft_plan(requests(1), [4], [RequestShape(1, 0)])
        assert plan.num_slots == [4]
        feature = torch.tensor([2.2])
        c = p.scorer.score(feature[:, None].expand(1, 4).to(torch.float64))[0]
        assert 0.7 < float(c[0] * c[1]) < 1.0  # slot 2 alone: expected tokens below its cost
        return bool(plan.stop_rule.keep_drafting(0, [0], {"logit_q_max": feature})[0])

    jump = CostCurve.fit({1: 1.0, 2: 1.0, 3: 2.0, 64: 2.0 + 61 * 0.01})
    assert drafts_slot_2(jump)  # the block 2..4 pays
    linear_cost = CostCurve.fit({1: 1.0, 2: 1.0, 64: 1.0 + 62 * 1.0})
    assert not drafts_slot_2(linear_cost)


def test_stop_rule_keeps_exploring_requests_whatever_their_features():
    p = planner(4, exploration=1e9)  # a budget so large that every request explores
    p.population = Population.of([[0.0]])
    plan = p.draft_plan(requests(2), [4, 4], [RequestShape(1, 10)] * 2)
    assert plan.explore.tolist() == [True, True]
    keep = plan.stop_rule.keep_drafting(0, [0, 1], {"logit_q_max": torch.tensor([-9.0, -9.0])})
    assert keep.tolist() == [True, True]


def test_cold_start_drafts_one_whole_block_the_cheapest_catch_up():
    p = planner(4)
    shapes = [RequestShape(1, 50, draft_pending=50), RequestShape(1, 10, draft_pending=10),
              RequestShape(1, 30, draft_pending=30)]
    plan = p.draft_plan(requests(3), [4, 4, 4], shapes)
    assert plan.num_slots == [0, 4, 0]
    # its whole block is drafted and verified whatever its first slot's feature says (as exploring)
    assert plan.explore.tolist() == [False, True, False]
    assert plan.reasons == ("", "cold start", "")  # what the stats count its slots under
    assert plan.stop_rule.keep_drafting(0, [1], {"logit_q_max": torch.tensor([-9.0])}).tolist() == [True]
    p.probe_budget = 0.0  # (the block is paid from the probe budget: the next test)
    assert p.draft_plan(requests(3), [4, 0, 4], shapes).num_slots == [0, 0, 4]  # one at max_tokens
    p.population = Population.of([[6.0]])  # once one has drafted, the population's features stand in for the rest
    assert p.draft_plan(requests(3), [4, 4, 4], shapes).num_slots == [4, 4, 4]


def test_the_cold_start_block_comes_after_an_answers_first_tokens():
    """The one block that stands for all traffic is not drawn at an answer's start, its least
    predictable part: until a request has emitted cold_start_after tokens every request decodes
    target-only, then the cheapest catch-up among those that have drafts it."""
    p = planner(4, cold_start_after=16)
    batch = requests(3)
    shapes = [RequestShape(1, 50, draft_pending=50), RequestShape(1, 10, draft_pending=10),
              RequestShape(1, 30, draft_pending=30)]
    assert p.draft_plan(batch, [4, 4, 4], shapes).num_slots == [0, 0, 0]
    batch[0].output_ids = [7] * 16
    batch[2].output_ids = [7] * 15
    plan = p.draft_plan(batch, [4, 4, 4], shapes)
    assert plan.num_slots == [4, 0, 0] and plan.reasons == ("cold start", "", "")
    batch[2].output_ids.append(7)
    p.probe_budget = 0.0  # (the block is paid from the probe budget)
    assert p.draft_plan(batch, [4, 4, 4], shapes).num_slots == [0, 0, 4]  # the cheaper catch-up of the two


def test_the_cold_start_is_paid_from_the_probe_budget():
    """The cold start is learning, the dearest probe of all: it waits while the probe budget is in
    debt, and takes its whole price from it (its catch-up, and its block drafted and verified), so
    the probes that would follow it wait until the budget has earned it back."""
    p = planner(4)
    shape = RequestShape(1, 10, draft_pending=10)
    p.probe_budget = -1e-6  # in debt: no cold start
    assert p.draft_plan(requests(1), [4], [shape]).num_slots == [0]
    p.probe_budget = 0.0
    assert p.draft_plan(requests(1), [4], [shape]).num_slots == [4]
    block = 4 * p.cost.draft_seconds(1, 10) + p.cost.verify_added(1, 4, 40)
    assert p._catch_up_seconds(shape) > 0
    assert p.probe_budget == pytest.approx(-(p._catch_up_seconds(shape) + block))
    p.population = Population.of([[-6.0]])  # the block failed: its request stops, and its probe waits
    request = requests(1)[0]
    p.history[request.request_id] = type(p._history(request))(samples=BlockSamples.of([[-6.0]], 100.0),
                                                               probing=True)
    assert p.draft_plan([request], [4], [RequestShape(1, 10, draft_pending=2)]).num_slots == [0]
    p.probe_budget = 0.0  # earned back: the probe runs
    assert p.draft_plan([request], [4], [RequestShape(1, 10, draft_pending=2)]).reasons == ("probe",)


def test_the_cold_start_waits_until_a_perfect_drafter_could_repay_it():
    """The cold start is an investment in learning: made only if, with every draft accepted, drafting
    would beat target-only decoding over the batch's remaining tokens by more than the cold start
    costs. A short request (a user's one `generate`) does not repay it; where a verified slot costs
    as much as a target-only step, a perfect drafter cannot beat target-only decoding at any length,
    and nothing drafts."""
    shape = [RequestShape(1, 10, draft_pending=10)]

    def drafted(p: AdaptivePlanner, max_tokens: int) -> list[int]:
        request = Request([1] * 10, SamplingParams(max_tokens=max_tokens), request_id=f"m{max_tokens}")
        return p.draft_plan([request], [4], shape).num_slots

    # cost_model(): 1 s per target-only step, a drafter row 0.22 s, a verified slot 0.1 s
    assert drafted(planner(4), 2) == [0]  # 2 tokens cannot repay a 4-slot block and a catch-up
    assert drafted(planner(4), 400) == [4]
    # the cold start's request drafts alone: a whole drafter forward per slot, however many requests
    # the step holds (priced at the batch's share, it passed where no entry could follow it)
    batch = [Request([1] * 10, SamplingParams(max_tokens=5), request_id=f"b{i}") for i in range(3)]
    assert planner(4).draft_plan(batch[:1], [4], shape).num_slots == [4]
    assert planner(4).draft_plan(batch, [4] * 3, shape * 3).num_slots == [0, 0, 0]
    dear = AdaptivePlanner(4, OnlineAcceptanceEstimator(4), cost_model(verify_per_token=1.0),
                           AdaptiveConfig(exploration=0.0, control_share=0.0, cold_start_after=0))
    assert drafted(dear, 100_000) == [0]  # a verified slot costs a whole step: even a perfect drafter loses
    assert not dear.population.blocks and dear.cost.plain_observations == 0  # nothing learnt, nothing drafted


def test_the_cold_start_prices_a_deferred_drafters_load():
    """A drafter not loaded yet (drafting/deferred.py) costs its load before the first draft: the
    cold start pays it like a catch-up, so a batch that repays the block alone may not repay the load."""
    shape = [RequestShape(1, 10, draft_pending=10)]

    def drafted(draft_setup: float, max_tokens: int) -> list[int]:
        p = planner(4)
        p.cost.draft_setup = draft_setup
        request = Request([1] * 10, SamplingParams(max_tokens=max_tokens), request_id=f"m{max_tokens}")
        return p.draft_plan([request], [4], shape).num_slots

    assert drafted(0.0, 400) == [4]
    assert drafted(1000.0, 400) == [0]  # 1000 s of load: 400 tokens at ~2.7 gained per 5 cannot repay it
    assert drafted(1000.0, 4000) == [4]


def test_a_due_probe_waits_while_the_budget_is_in_debt_and_pays_its_catch_up():
    p = planner(4, probe_interval=1)
    request = requests(1)[0]
    p.history[request.request_id] = type(p._history(request))(samples=BlockSamples.of([[-6.0]], 100.0),
                                                               probing=True)
    shape = RequestShape(1, 10, draft_pending=40)
    price = p.cost.draft_seconds(40, 10) + p.cost.verify_seconds(2, 10) - p.cost.verify_seconds(1, 10)
    p.probe_budget = -0.01 * price
    assert p.draft_plan([request], [4], [shape]).num_slots == [0]  # due, in debt: it waits
    assert p.history[request.request_id].probing
    p.probe_budget = 0.25 * price  # in credit: it pays its whole price, into debt
    plan = p.draft_plan([request], [4], [shape])
    assert plan.num_slots == [4] and plan.reasons == ("probe",)
    assert p.probe_budget == pytest.approx(-0.75 * price)


def test_a_probe_the_traffic_says_pays_runs_whatever_the_budget():
    """A request that stopped on a hard stretch (its own recent blocks failed) falls due for a
    probe; where drafting would repay its catch-up were it like the traffic's recent requests,
    the probe is an investment and runs with the budget in debt. Where the traffic's drafts
    failed too, it is learning, and waits for the budget."""
    def due_probe(population: Population) -> tuple[str, ...]:
        p = planner(4, probe_interval=1)
        p.population = population
        request = Request([1, 2, 3], SamplingParams(max_tokens=400), request_id="r0")
        p.history["r0"] = type(p._history(request))(samples=BlockSamples.of([[-6.0]], 100.0), wait=1)
        p.probe_budget = -10.0  # deep in debt (the cold start's block)
        shape = RequestShape(1, 10, draft_pending=8)
        assert p.draft_plan([request], [4], [shape]).num_slots == [0]  # the wait's last step: it falls due
        return p.draft_plan([request], [4], [shape]).reasons

    assert due_probe(Population.of([[6.0, 6.0, 6.0, 6.0]] * 4)) == ("probe",)
    assert due_probe(Population.of([[-6.0, -6.0]] * 4)) == ("",)


def test_probes_spend_their_share_however_fast_their_price_grows():
    """A probe's price grows with every token its request skips, faster than the budget grows at
    concurrency 1: a due probe still runs, and probes spend the budget's share and one probe more."""
    p = planner(4, probe_interval=1, max_probe_interval=1, probe_share=0.02)
    request = requests(1)[0]
    p.history[request.request_id] = h = type(p._history(request))(samples=BlockSamples.of([[-6.0]], 100.0))
    step, steps, prices, pending = 0.5, 400, [], 2
    for _ in range(steps):
        h.probing, budget = True, p.probe_budget
        shape = RequestShape(1, 200, draft_pending=pending)
        if p.draft_plan([request], [4], [shape]).num_slots[0]:
            prices.append(budget - p.probe_budget)
            pending = 2
        else:
            pending += 1  # skipped: one more token to catch up on
        p.observe(_decoding_record([], [], [], [], step))
    assert (p.cost.draft_seconds(12) - p.cost.draft_seconds(2)) / 10 > 0.02 * step  # the price outgrows the budget
    assert len(prices) >= 2  # yet probes ran
    assert sum(prices) <= 0.02 * steps * step + max(prices)  # at their share, and one probe more


def test_the_probe_budget_grows_by_its_share_of_measured_steps():
    p = planner(4, probe_share=0.05)
    for _ in range(4):
        p.observe(_decoding_record([], [], [], [], 0.1))
    assert p.probe_budget == pytest.approx(4 * 0.05 * 0.1)


def test_no_draft_then_probe_with_a_doubling_wait():
    """A request whose drafts do not pay decodes target-only, probes after probe_interval steps,
    and waits twice as long after each probe that does not lead to slot 2."""
    p = planner(4, probe_interval=2, max_probe_interval=8)
    p.probe_budget = math.inf  # the budget is tested on its own above
    request = requests(1)[0]
    p.history[request.request_id] = h = type(p._history(request))(samples=BlockSamples.of([[-6.0]], 100.0), interval=2, probing=False)
    decided = []
    for step in range(30):
        plan = p.draft_plan([request], [4], [RequestShape(1, 10)])
        decided.append(plan.num_slots[0])
        if plan.num_slots[0]:
            assert not plan.stop_rule.keep_drafting(0, [0], {"logit_q_max": torch.tensor([-6.0])}).item()
            h.probing = False  # what observe does after a probe that drafted one slot
            h.wait, h.interval = h.interval, min(2 * h.interval, 8)
    # step 0 decides not to draft and waits 2 steps; probes at 3, then waits 2, 4, 8, 8 (the cap)
    assert [i for i, n in enumerate(decided) if n] == [3, 6, 11, 20, 29]


def test_a_step_in_which_every_request_waits_prices_nothing():
    """Where drafts do not pay, most steps have every request waiting out its no-draft decision:
    such a step's plan drafts nothing and asks the cost model for no price (the planner's work in it
    is overhead on a target-only step), and its plan stage admits nothing, priced as a plain step."""
    p = planner(4)
    waiting = requests(2)
    for r in waiting:
        p.history[r.request_id] = type(p._history(r))(samples=BlockSamples.of([[-6.0]], 100.0), wait=3)
    asked = []
    p.target_only_rate = lambda shapes: asked.append(shapes) or 1.0
    shapes = [RequestShape(1, 10, draft_pending=5)] * 2
    plan = p.draft_plan(waiting, [4, 4], shapes)
    assert plan.num_slots == [0, 0] and plan.stop_rule is None and not asked
    assert [p.history[r.request_id].wait for r in waiting] == [2, 2]  # the waits count down
    step = p.plan(drafts_for([0, 0], 4), Scores.empty(2), plan)
    assert step.num_admitted.tolist() == [0, 0] and step.draft_rows.numel() == 0
    assert step.predicted.total == pytest.approx(p.cost.plain_seconds(2, 20) + p.cost.overhead)


@pytest.mark.parametrize("halflife", [64.0, 0.0])
def test_the_first_slot_check_scales_predictions_by_what_the_drafted_slot_turned_out_to_be(halflife):
    """The rule drafts where a request's past blocks predict a sure slot 1; where the slots it then
    drafts keep turning out doubtful (their confidence from their own features), predictions are
    scaled down and the request stops drafting. With the check off (half-life 0) it drafts on."""
    from specav.types import StageTimes

    p = planner(4, check_halflife=halflife)
    request = requests(1)[0]
    p.history[request.request_id] = type(p._history(request))(samples=BlockSamples.of([[3.0] * 4], 100.0))
    shape = [RequestShape(1, 10)]
    assert p.draft_plan([request], [4], shape).num_slots == [4]
    predicted = p.history[request.request_id].first_predicted
    assert predicted > 0.5 and p.check.ratio == 1.0

    class Record:  # a decoding step in which the rule's slot 1 was drafted with confidence 0.05
        requests, times, prefill_tokens, max_slots = [request], StageTimes(0.0, 1.0, 1.0), 0, [4]
        drafts = type("D", (), {"forwards": [(1, 0)], "num_drafted": torch.tensor([1])})()
        num_admitted, num_accepted = torch.tensor([0]), torch.tensor([0])
        verify_tokens, verify_attended, draft_reasons = 1, 0, ("rule",)
        scores = Scores(torch.tensor([[3.0] + [math.nan] * 3]), torch.tensor([[0.05] + [math.nan] * 3]),
                        torch.tensor([[0.05] + [math.nan] * 3]))
    for _ in range(20):
        p.history[request.request_id].first_predicted = predicted  # as the rule predicted it each time
        p.observe(Record())
    if halflife:
        assert p.check.ratio == pytest.approx((20 * 0.05 + 1) / (20 * predicted + 1), rel=0.2)
        assert p.draft_plan([request], [4], shape).num_slots == [0]
    else:
        assert p.check.ratio == 1.0 and p.draft_plan([request], [4], shape).num_slots == [4]


def test_a_request_with_confident_history_drafts_and_one_without_does_not():
    p = planner(4)
    good, bad = requests(2)
    p.history[good.request_id] = type(p._history(good))(samples=BlockSamples.of([[6.0]], 100.0), probing=False)
    p.history[bad.request_id] = type(p._history(bad))(samples=BlockSamples.of([[-6.0]], 100.0), probing=False)
    plan = p.draft_plan([good, bad], [4, 4], [RequestShape(1, 10)] * 2)
    assert plan.num_slots == [4, 0]


def test_a_no_draft_decision_is_valued_over_the_wait_it_commits_to():
    """Not drafting commits a request to `interval` target-only steps: where drafting has paid (its
    measured speed-up above min_speedup), those steps forgo tokens, and a doubtful block drafts."""
    p = planner(4)
    request = requests(1)[0]

    def drafts(speedup: float, interval: int) -> bool:
        p.history[request.request_id] = type(p._history(request))(samples=BlockSamples.of([[-6.0]], 100.0),
                                                                   speedup=speedup, interval=interval)
        return p.draft_plan([request], [4], [RequestShape(1, 10)]).num_slots == [4]

    assert not drafts(speedup=1.0, interval=64)  # drafting has not paid: the wait forgoes nothing
    assert not drafts(speedup=1.05, interval=64)  # (min_speedup: the margin asked of predictions)
    assert not drafts(speedup=1.5, interval=1)  # one step's wait forgoes less than the block loses
    assert drafts(speedup=1.5, interval=64)


def test_a_new_requests_wait_is_valued_as_if_it_were_like_the_traffic():
    """Until its own steps are measured, a request's speed-up is expected to be the traffic's (the
    population's requests' mean), less so with every step it measures; its price stays its own."""
    p = planner(4)
    request = requests(1)[0]
    shapes = [RequestShape(1, 10)]

    def drafts(traffic: float, measured: int) -> bool:
        p.population = Population.of([[-6.0]], "earlier")
        p.population.measured("earlier", traffic)
        p.population.measured("never drafted", 9.0)  # not one of the population's requests: not counted
        p.history[request.request_id] = type(p._history(request))(samples=BlockSamples.of([[-6.0]], 100.0),
                                                                   interval=64, measured=measured)
        return p.draft_plan([request], [4], shapes).num_slots == [4]

    assert not drafts(traffic=1.0, measured=0)  # the traffic's drafting has not paid: the wait forgoes nothing
    assert drafts(traffic=1.5, measured=0)  # a doubtful block drafts: requests like it have gained 1.5x
    assert not drafts(traffic=1.5, measured=200)  # its own 200 steps measured 1x: the traffic no longer counts
    assert p.population.speedup() == 1.5 and p.population.speedup(excluding="earlier") == 1.0
    for i in range(8):  # eight later requests draft: "earlier" leaves the population, its speed-up with it
        p.population.add(f"later {i}", [0.0])
    assert "earlier" not in p.population.speedups and p.population.speedup() == 1.0
    assert p.price([request], shapes) == pytest.approx(p.config.min_speedup * p.target_only_rate(shapes))


def test_exploration_draws_come_from_the_planners_own_generator():
    p = planner(4, exploration=2.0, seed=7)
    p.population = Population.of([[0.0]])  # past the cold start (whose request's block is verified whatever the draw)
    shapes = [RequestShape(1, 0)] * 3
    chance = p.exploration_probability(shapes)
    assert 0.1 < chance < 0.9
    plans = [p.draft_plan(requests(3), [4, 4, 4], shapes) for _ in range(20)]
    draws = [[False] * 3 if plan.explore is None else plan.explore.tolist() for plan in plans]  # (None: nobody drafts)
    rng = random.Random(7)
    assert draws == [[rng.random() < chance for _ in range(3)] for _ in range(20)]
    assert 0 < sum(map(sum, draws)) < 60


def test_exploration_costs_its_share_of_compute_at_any_concurrency():
    p = planner(4, exploration=0.01)
    for batch in (1, 4, 16):
        shapes = [RequestShape(1, 0)] * batch
        step = p.cost.verify_seconds(batch) + p.cost.overhead
        block = 4 * p.cost.draft_seconds(1) + p.cost.verify_seconds(batch + 4) - p.cost.verify_seconds(batch)
        assert batch * p.exploration_probability(shapes) * block == pytest.approx(0.01 * step)
    assert planner(4, exploration=0.0).exploration_probability([RequestShape(1, 0)]) == 0.0


def test_requests_at_max_tokens_draft_nothing_and_never_explore():
    p = planner(4, exploration=1e9)
    plan = p.draft_plan(requests(2), [0, 3], [RequestShape(1, 0)] * 2)
    assert plan.num_slots == [0, 3] and plan.explore.tolist() == [False, True]


def test_a_lossy_scorer_is_refused():
    class QSampledScorer:
        name, feature, version = "lossy", "q_sampled", 0

        def score(self, features):
            return features

        def observe(self, features, num_admitted, num_accepted):
            pass

    with pytest.raises(LossyFeatureError, match="q_sampled"):
        AdaptivePlanner(4, QSampledScorer(), cost_model())


def test_price_is_never_below_min_speedup_times_the_target_only_rate():
    p = planner(4)
    shapes = [RequestShape(1, 0)] * 4
    batch = requests(4)
    for r in batch:
        p._history(r).speedup = 0.5  # speculation measured slower than target-only
    assert p.price(batch, shapes) == pytest.approx(1.05 * p.target_only_rate(shapes))  # min_speedup's margin
    for r, speedup in zip(batch, (2.0, 2.0, 1.0, 1.0)):
        p._history(r).speedup = speedup
    assert p.price(batch, shapes) == pytest.approx(1.5 * p.target_only_rate(shapes))  # the batch's mean


def test_one_odd_block_is_shrunk_toward_the_population_and_many_are_not():
    p = AdaptivePlanner(4, OnlineAcceptanceEstimator(4), cost_model(draft_fixed=0.05),
                        AdaptiveConfig(exploration=0.0, control_share=0.0, cold_start_after=0))  # a cheap drafter
    p.population = Population.of([[6.0]])  # the traffic drafts confidently
    odd, doubtful = requests(2)
    p.history[odd.request_id] = type(p._history(odd))(samples=BlockSamples.of([[-6.0]], 1.0))
    p.history[doubtful.request_id] = type(p._history(doubtful))(samples=BlockSamples.of([[-6.0]], 10.0))
    first = p._predicted_blocks([odd])[0][0]
    c = torch.sigmoid(torch.tensor([-6.0, 6.0], dtype=torch.float64))  # the unfitted estimator: raw q_max
    assert float(first) == pytest.approx(float((c[0] + _PRIOR_BLOCKS * c[1]) / (1 + _PRIOR_BLOCKS)))
    plan = p.draft_plan([odd, doubtful], [4, 4], [RequestShape(1, 10)] * 2)
    assert plan.num_slots == [4, 0]


def test_a_request_is_predicted_by_the_mean_confidence_of_its_blocks_not_of_their_mean():
    """Half its blocks sure (+8), half doubtful (-4): slot 1 is accepted about half the time, while
    the mean feature (+2) would say 0.88 (confidence is not linear in the feature), and its deeper
    slots survive as its sure blocks do, not as a chain of coin flips."""
    p = planner(4)
    request = requests(1)[0]
    p.history[request.request_id] = type(p._history(request))(samples=BlockSamples.of([[8.0], [-4.0]] * 8))
    expected = p._predicted_blocks([request])[0]
    sure, doubtful = torch.sigmoid(torch.tensor(8.0, dtype=torch.float64)), torch.sigmoid(torch.tensor(-4.0, dtype=torch.float64))
    survival = [(sure ** n + doubtful ** n) / 2 for n in range(1, 5)]
    assert expected == pytest.approx(torch.tensor(survival).cumsum(0).tolist())
    assert float(expected[0]) < 0.51 < float(torch.sigmoid(torch.tensor(2.0)))


def test_a_blocks_deep_slots_do_not_stand_for_a_slot_1():
    """The population's one block: slot 1 doubtful (-4), slots 2-4 the drafter's sure continuations
    of its own guess (+8). A new request's slot 1 is predicted from the block's slot 1 (about 0.02
    tokens), not from its features pooled (three of four sure: 0.75 tokens, and 2.2 from a block of
    4), which made every new request enter at once on prose and lose."""
    p = planner(4)
    p.population = Population.of([[-4.0, 8.0, 8.0, 8.0]])
    request = requests(1)[0]
    expected = p._predicted_blocks([request])[0]
    doubtful, sure = (torch.sigmoid(torch.tensor(x, dtype=torch.float64)) for x in (-4.0, 8.0))
    survival = torch.stack([doubtful * sure ** n for n in range(4)])  # the block's own slots, each at its position
    assert expected == pytest.approx(survival.cumsum(0).tolist())
    assert float(expected[-1]) < 0.08


def test_deeper_rows_are_priced_at_the_share_of_the_requests_that_draft():
    """Slot 1 accepted half the time, deeper slots nearly always: drafting 4 slots pays if the
    drafter's rows are shared by two requests (4 x 0.12 s), not if one drafts alone (4 x 0.22 s).
    Beside a doubtful request that the rule leaves out, the odd one would draft alone: priced as
    if the doubtful one shared its forwards (before), it drafted; now it does not."""
    def plan(other: float) -> list[int]:
        p = planner(4)
        odd, another = requests(2)
        p.population = Population.of([[6.0]])
        p.history[odd.request_id] = type(p._history(odd))(samples=BlockSamples.of([[-6.0]], 1.0))
        p.history[another.request_id] = type(p._history(another))(samples=BlockSamples.of([[other]], 10.0))
        return p.draft_plan([odd, another], [4, 4], [RequestShape(1, 10)] * 2).num_slots
    assert plan(-6.0) == [0, 0]  # beside a doubtful request, the odd one would draft alone
    assert plan(6.0) == [4, 4]  # beside a sure one, the two share the drafter's forwards


def test_block_samples_decay_per_step_keep_the_latest_and_extend_by_their_last_slot():
    s = BlockSamples()
    s.add([[1.0], [2.0, 5.0]], decay=0.5, keep=3)
    s.add([[3.0], []], decay=0.5, keep=3)  # a request that drafted nothing adds no block
    s.add([[4.0]], decay=0.5, keep=3)
    assert s.blocks == [[2.0, 5.0], [3.0], [4.0]] and s.weights == [0.25, 0.5, 1.0]
    s.add([], decay=1e-200, keep=3)  # a long time without a draft: the ratios stay, the weights do not underflow
    assert s.weights == pytest.approx([0.25, 0.5, 1.0])
    prior = BlockSamples.of([[7.0, 8.0, 9.0]], weight=3.0)
    blocks, weights = s.with_prior(prior, worth=2.0)
    assert blocks == [[2.0, 5.0], [3.0], [4.0], [7.0, 8.0, 9.0]]
    assert weights == pytest.approx([0.25, 0.5, 1.0, 2.0])  # the prior weighs `worth` blocks in all


def test_block_survival_is_the_mean_survival_of_whole_blocks_and_counts_a_stopped_block_to_its_end():
    c = torch.tensor([[0.9, 0.8, 0.7], [0.5, 0.4, 0.3], [0.2, 0.9, 0.9]], dtype=torch.float64)  # [M, K]
    w = torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64)
    whole = torch.ones(3, 3, dtype=torch.bool)
    mean = (w[:, None] * torch.cumprod(c, 1)).sum(0) / w.sum()
    assert block_survival(c, w, whole).tolist() == pytest.approx(mean.tolist())
    # the third block stopped after its doubtful slot 1: slot 1 from all three, deeper from the others
    stopped = whole.clone()
    stopped[2, 1:] = False
    s1 = (0.9 * 1 + 0.5 * 2 + 0.2 * 1) / 4
    s2 = s1 * (0.9 * 0.8 + 2 * 0.5 * 0.4) / (0.9 + 2 * 0.5)
    s3 = s2 * (0.9 * 0.8 * 0.7 + 2 * 0.5 * 0.4 * 0.3) / (0.9 * 0.8 + 2 * 0.5 * 0.4)
    assert block_survival(c, w, stopped).tolist() == pytest.approx([s1, s2, s3])
    # no block drafted past slot 1: all of them stand in, each extended (as the mean of whole blocks)
    first = torch.zeros(3, 3, dtype=torch.bool)
    first[:, 0] = True
    assert block_survival(c, w, first).tolist() == pytest.approx(mean.tolist())
    assert block_survival(c, torch.zeros(3, dtype=torch.float64), whole).tolist() == [0.0] * 3  # nothing known


def _reference_survival(confidences: torch.Tensor, weights: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """block_survival's definition, in tensors: the product-limit ratios over the blocks at risk."""
    s = torch.cumprod(confidences, dim=-1)
    before = torch.cat([torch.ones_like(s[:, :1]), s[:, :-1]], dim=-1)
    seen = drafted & (weights[:, None] > 0)
    risk = torch.where(seen.any(dim=0, keepdim=True), seen, torch.ones_like(seen)).to(s.dtype)
    num, den = (weights[:, None] * risk * s).sum(0), (weights[:, None] * risk * before).sum(0)
    return torch.cumprod(torch.where(den > 0, num / torch.where(den > 0, den, 1.0), torch.zeros_like(num)), dim=0)


_blocks = st.lists(st.tuples(st.lists(st.floats(0.0, 1.0, allow_subnormal=False), min_size=4, max_size=4), st.integers(1, 4),
                             st.sampled_from([0.0, 0.25, 1.0, 3.0])), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(_blocks, _blocks, st.sampled_from([0.5, 1.0, 2.0]))
def test_survival_sums_of_a_union_are_the_sums_of_its_parts(first, second, scale):
    """What the planner's caches rest on: the population's sums kept request by request, added to
    a request's own (its weights scaled), give the survival of all the blocks at once."""
    def sums(blocks, factor=1.0):
        return SurvivalSums.of([c for c, _, _ in blocks], [n for _, n, _ in blocks],
                               [w * factor for _, _, w in blocks], 4)
    union = first + [(c, n, w * scale) for c, n, w in second]
    together = sums(union).survival()
    assert sums(first).plus(sums(second), scale).survival() == pytest.approx(together, abs=1e-12)
    confidences = torch.tensor([c for c, _, _ in union], dtype=torch.float64)
    weights = torch.tensor([w for _, _, w in union], dtype=torch.float64)
    drafted = torch.arange(4)[None, :] < torch.tensor([n for _, n, _ in union])[:, None]
    assert together == pytest.approx(_reference_survival(confidences, weights, drafted).tolist(), abs=1e-12)


def test_the_planners_kept_confidences_follow_the_scorer_and_the_population():
    """The planner keeps its blocks' confidences and the population's sums between steps; after the
    estimator refits, or the population drafts again, it predicts what a planner that keeps nothing
    predicts (one that ignored the scorer's version would go on predicting the old fit)."""
    estimator = OnlineAcceptanceEstimator(4)
    p = AdaptivePlanner(4, estimator, cost_model(), AdaptiveConfig(exploration=0.0, control_share=0.0))
    request = requests(1)[0]
    p.population = Population.of([[1.0, 2.0, -1.0], [0.5]], "a")
    p.history[request.request_id] = type(p._history(request))(samples=BlockSamples.of([[2.0, 2.0], [-1.0]]))

    def fresh() -> list[float]:
        q = AdaptivePlanner(4, estimator, cost_model(), AdaptiveConfig(exploration=0.0, control_share=0.0))
        q.population, q.history = p.population, p.history
        return q._predicted_survival([request])[0]

    before = p._predicted_survival([request])[0]
    assert before == pytest.approx(fresh(), abs=1e-15)
    state = estimator.state_dict()
    estimator.load_state_dict({**state, "slope": torch.tensor(2.5, dtype=torch.float64),
                               "intercepts": torch.tensor([1.0, 0.0, -1.0, -2.0], dtype=torch.float64)})
    after = p._predicted_survival([request])[0]
    assert after == pytest.approx(fresh(), abs=1e-15) and after != pytest.approx(before, abs=1e-6)
    p.population.add("b", [-3.0, -3.0])
    p.population.add("a", [4.0])
    assert p._predicted_survival([request])[0] == pytest.approx(fresh(), abs=1e-15)


def test_only_caught_up_requests_explore():
    p = planner(4, exploration=1e9)
    p.population = Population.of([[0.0]])
    shapes = [RequestShape(1, 10, draft_pending=2), RequestShape(1, 10, draft_pending=7)]
    assert p.draft_plan(requests(2), [4, 4], shapes).explore.tolist() == [True, False]


def test_a_catch_up_is_made_only_when_drafting_is_predicted_to_repay_it():
    p = planner(4)
    p.population = Population.of([[6.0]])  # confident traffic
    long, short = (Request([1] * 40, SamplingParams(max_tokens=n), request_id=f"n{n}") for n in (400, 4))
    shape = RequestShape(1, 10, draft_pending=400)
    assert p.draft_plan([long], [4], [shape]).num_slots == [4]  # 400 tokens to go repay a 400-token catch-up
    assert p.draft_plan([short], [4], [shape]).num_slots == [0]  # 4 tokens to go do not
    assert p.history[short.request_id].wait == p.config.probe_interval  # it is probed later
    p.population = Population.of([[-6.0]])  # doubtful traffic: no remaining length repays it
    doubtful = Request([1] * 40, SamplingParams(max_tokens=400), request_id="d")
    assert p.draft_plan([doubtful], [4], [shape]).num_slots == [0]


def test_a_new_request_enters_where_drafting_would_repay_it_like_some_of_the_traffic_s_requests():
    """A new request may turn out like any of the traffic's recent requests, each alike whatever its
    number of blocks, and entering is an option (drafting stops where it does not pay): one request
    whose many recent blocks failed does not refuse an entry that another's confident blocks would
    repay. The same blocks as one request's (pooled by block, the failing request's outnumber the
    other's seven to one) refuse it, and so does traffic whose every request failed."""
    shape = RequestShape(1, 10, draft_pending=400)

    def enters(population: Population) -> bool:
        p = planner(4)
        p.population = population
        r = Request([1] * 40, SamplingParams(max_tokens=400), request_id="new")
        return p.draft_plan([r], [4], [shape]).num_slots == [4]

    sure, failing = [[6.0] * 4] * 2, [[-6.0]] * 14
    by_request = Population()
    for request_id, blocks in (("sure", sure), ("failing", failing)):
        for block in blocks:
            by_request.add(request_id, block)
    assert enters(by_request)
    assert not enters(Population.of(sure + failing))
    everyone_failing = Population.of(failing, "a")
    everyone_failing.add("b", [-6.0])
    assert not enters(everyone_failing)


def test_an_entry_is_judged_on_the_decoding_steps_it_pays_off_in_not_on_its_prefill():
    """A new request decides to catch up in its prefill step, whose verify is its whole prompt. The
    investment pays off in its decoding steps (one pending token each), so the drafting premium and
    its block are priced there: priced on the 150-token prefill, the premium (30% of the prefill's
    verify here) refused every entry (code at concurrency 1 on the AVX2 machine decoded target-only)."""
    def enters(shape: RequestShape) -> int:
        p = planner(4)
        p.population = Population.of([[6.0]])  # confident traffic
        p.cost.target.observations["plain"] = 1
        slower_drafting_verify(p.cost, 1.3)  # drafting steps verify 1.3x slower than plain ones
        r = Request([1] * 150, SamplingParams(max_tokens=400), request_id="r")
        return p.draft_plan([r], [4], [shape]).num_slots[0]

    assert enters(RequestShape(150, 0, draft_pending=150)) == 4  # in its prefill step
    assert enters(RequestShape(1, 150, draft_pending=150)) == 4  # after 150 skipped tokens: the same decision


def test_each_request_is_credited_its_own_speed_up():
    """A step's time is split as each request's target-only share plus the extra time by the cost of
    its slots: a request that did not draft is credited 1x whatever the others did, and alone a
    request's speed-up is the step's measured rate over the target-only rate."""
    p = planner(4)
    lone = requests(1)
    target_only = p.cost.verify_seconds(1)  # this cost model has no overhead
    assert p._speedups(_decoding_record(lone, [3], [3], [3], 2 * target_only)) == pytest.approx([2.0])
    pair, share = requests(2), p.cost.verify_seconds(2) / 2  # each request's share of a target-only step
    drafter, plain = p._speedups(_decoding_record(pair, [4, 0], [4, 0], [4, 0], 3.0))
    assert plain == pytest.approx(1.0)
    assert drafter == pytest.approx(5 * share / (3.0 - share))


def test_the_price_follows_the_requests_in_the_batch_not_earlier_traffic():
    """A run of confident code lifts its own request's speed-up; a prose request that follows it
    alone is priced at its own (1x for a new request), so drafts that beat plain decoding still pay."""
    p = planner(4, rate_halflife=1.0)
    code, prose = requests(2)
    target_only = p.cost.verify_seconds(1)
    for _ in range(20):
        p.observe(_decoding_record([code], [4], [4], [4], 2 * target_only))  # 5 tokens in 2 steps' time
    shape = [RequestShape(1, 0)]
    assert p.price([code], shape) == pytest.approx(2.5 * p.target_only_rate(shape), rel=1e-3)
    assert p.price([prose], shape) == pytest.approx(p.config.min_speedup * p.target_only_rate(shape))


def test_control_steps_decode_the_whole_batch_target_only_at_their_share():
    from specav.types import StageTimes

    p = planner(4, control_share=0.25, seed=3)
    p.population = Population.of([[6.0]])  # the traffic drafts confidently: outside control steps everyone drafts
    shapes = [RequestShape(1, 0)] * 3
    assert p.draft_plan(requests(3), [4, 4, 4], shapes).num_slots == [0, 0, 0]  # no target-only step measured yet
    p.cost.observe([], 3, 0, StageTimes(0.0, 1.0, 1.0))
    plans = [p.draft_plan(requests(3), [4, 4, 4], shapes) for _ in range(400)]
    control = [plan.num_slots == [0, 0, 0] for plan in plans]
    assert 0.18 < sum(control) / len(control) < 0.32
    assert all(plan.num_slots == [4, 4, 4] for plan, c in zip(plans, control) if not c)
    fresh = planner(4, control_share=1.0)  # before anything is known: the cold start, never a control step
    assert fresh.draft_plan(requests(1), [4], [RequestShape(1, 0)]).num_slots == [4]


def test_target_only_is_priced_from_steps_that_drafted_nothing():
    """A slowdown that is not uniform: verifies of 9 tokens measured 2x their profile, plain
    one-token steps 1.5x. The drafting steps' verify follows the 9-token steps and the target-only
    rate (the price) the plain steps; before any plain step the plain steps follow the drafting
    steps' drift (and the other way round), and once both are measured, many steps of one kind
    leave the other's prediction where it was."""
    from specav.types import StageTimes

    p = planner(4)
    cost, shape = CostModel(p.cost.profile, halflife=2.0, shape_halflife=4.0), [RequestShape(1, 0)]
    p.cost = cost

    def drafting_step() -> None:
        cost.observe([(1, 0)] * 8, 9, 0, StageTimes(0.1, 2.0 * cost.profile.verify(9), 0.1 + 2.0 * cost.profile.verify(9)))

    def plain_step() -> None:
        cost.observe([], 1, 0, StageTimes(0.0, 1.5 * cost.profile.verify(1), 1.5 * cost.profile.verify(1)))

    for _ in range(30):
        drafting_step()
    assert cost.plain_seconds(1) == pytest.approx(2.0 * cost.profile.verify(1), rel=1e-3)  # the stand-in
    for _ in range(60):
        plain_step()
        drafting_step()
    assert cost.plain_seconds(1) == pytest.approx(1.5 * cost.profile.verify(1), rel=1e-3)
    assert p.target_only_rate(shape) == pytest.approx(1 / (1.5 * cost.profile.verify(1) + cost.overhead), rel=1e-3)
    for _ in range(200):  # and the plain steps leave the drafting steps' prediction alone, however many
        plain_step()
    assert cost.verify_seconds(9) == pytest.approx(2.0 * cost.profile.verify(9), rel=1e-3)
    # a drafting step's first slot costs what its verify adds over a plain step's
    first_slot = cost.drafting_premium(1) + cost.verify_added(1, 1)
    assert first_slot == pytest.approx(cost.verify_seconds(2) - cost.plain_seconds(1), rel=1e-6)
    assert cost.predict([], 1, 0).verify == pytest.approx(cost.plain_seconds(1))  # a target-only step
    fresh = CostModel(p.cost.profile, halflife=2.0)  # plain steps only: drafting steps stand in with their level
    for _ in range(30):
        fresh.observe([], 1, 0, StageTimes(0.0, 1.5 * cost.profile.verify(1), 1.5 * cost.profile.verify(1)))
    assert fresh.verify_seconds(9) == pytest.approx(1.5 * cost.profile.verify(9), rel=1e-3)
    assert fresh.drafting_premium(1) == 0.0
    before = cost.target.level, cost.draft.level  # a prompt's prefill teaches the drafter (its catch-up), not the target
    cost.observe([(300, 0)], 300, 0, StageTimes(0.5, 0.1, 0.6), prefill=True)
    assert cost.target.level == before[0] and cost.draft.level != before[1]


def test_drafting_at_all_pays_the_premium_of_a_drafting_step():
    """Where steps that draft verify slower than steps that do not (the verify scale above the plain
    one), slot 1 of a step nothing else drafts in pays that premium: the same confident request
    drafts without it and decodes target-only when the premium exceeds its block's value."""
    def drafts(premium_scale: float, priced: bool = True) -> int:
        p = planner(4)
        p.population = Population.of([[3.0]])
        p.target_only_rate = lambda shapes: 1.0  # the price held at 1 token per second
        p.cost.target.observations["plain"] = 1
        slower_drafting_verify(p.cost, premium_scale)  # plain steps at the profile
        if not priced:
            p.cost.drafting_premium = lambda *args: 0.0
        return p.draft_plan(requests(1), [4], [RequestShape(1, 0)]).num_slots[0]

    assert drafts(1.0) == 4  # no premium (and the verify curve's slots cost 0.1 s each)
    assert drafts(4.0) == 0  # the step's verify costs 3 s more once it drafts
    assert drafts(4.0, priced=False) == 4  # the premium, not the dearer slots, is what stops it


@pytest.mark.parametrize("field, bad", [("min_speedup", 0.9), ("min_speedup", math.nan), ("control_share", 1.5),
                                        ("control_share", -0.1), ("exploration", -1.0), ("probe_interval", 0),
                                        ("check_halflife", -1.0), ("check_halflife", math.nan)])
def test_adaptive_config_refuses_invalid_knobs_by_name(field, bad):
    with pytest.raises(ValueError, match=field):
        AdaptiveConfig(**{field: bad})
