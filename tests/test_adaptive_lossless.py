"""Adaptive verification keeps the target's distribution; two lossy variants are caught by the same tests.

Two layers, as for the rejection sampler (tests/test_rejection.py, whose enumeration harness
this file reuses):

* exact enumeration over every draft and verification outcome of a toy pair (V = 5, K = 3),
  with the real AdaptivePlanner's draft rule (early stop) and admission scan in the loop:
  the first two emitted tokens follow the target's joint to 1e-6;
* whole engine steps on tiny models (V = 8): 3,000 seeded requests, the joint distribution of
  their first two tokens against the exact target joint (chi-square), for each rule alone
  (admission, early stop, no draft and probe, exploration) and all together, each run checking
  that its rule really fired.

Negative controls, which both layers must reject: trimming on q_sampled (the planner built on
a scorer that reads x_i), and a budget chosen by an argmax over budgets that looks at deeper
slots of the same request.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specav.acceptance import features as feature_fns
from specav.acceptance.estimator import OnlineAcceptanceEstimator
from specav.acceptance.scorer import score_drafts
from specav.config import AdaptiveConfig, EstimatorConfig, SamplingParams
from specav.request import Request
from specav.types import DraftBatch, Plan, Ragged
from specav.verification import adaptive
from specav.verification.adaptive import AdaptivePlanner, Population
from specav.verification.planner import DraftPlan, RequestShape
from tests.test_lossless import V as ENGINE_V, empirical_joint, exact_joint, p_value
from specav.verification.cost_model import CostCurve, CostModel, CostProfile
from tests.test_planner import FROZEN, cost_model
from tests.test_rejection import draft_outcomes, first_tokens, target_tokens, deviation, toy_pair
from tests.tiny_models import make_engine, tiny_pair

K = 3
PRICE = 5.0  # tokens per second: with cost_model()'s 0.1 s per verified token a slot pays at survival 0.5


class FixedPricePlanner(AdaptivePlanner):
    """The adaptive planner with its price held fixed, so a test's decisions do not drift with timing."""

    def __init__(self, *args, price: float = PRICE, rate: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fixed_price = price
        self.fixed_rate = price if rate is None else rate

    def price(self, requests, shapes) -> float:
        return self.fixed_price

    def target_only_rate(self, shapes) -> float:  # the catch-up rule's price, held fixed too
        return self.fixed_rate

    def _speedups(self, record) -> list[float]:  # and the requests' measured speed-ups (the wait's value)
        return [1.0] * len(record.requests)


class ArgmaxBudgetPlanner(FixedPricePlanner):
    """LOSSY on purpose: each request's budget is the depth k maximising its expected tokens minus the
    price of verifying k slots, an argmax that looks at all its slots at once, so slot i is admitted
    because of the survival of deeper slots, which depend on x_i. With a convex cost the argmax stops
    where the scan does; with a fixed cost for the first verified slot (jump_cost_model) it does not."""

    def plan(self, drafts, scores, draft_plan):
        survival = torch.nan_to_num(scores.survival, nan=0.0)
        admitted = []
        for b, n in enumerate(drafts.num_drafted.tolist()):
            gains = [0.0] + torch.cumsum(survival[b, :n], 0).tolist()
            values = [g - draft_plan.price * (self.cost.verify_seconds(1 + k) - self.cost.verify_seconds(1))
                      for k, g in enumerate(gains)]
            admitted.append(int(np.argmax(values)))
        return Plan.of(drafts, torch.tensor(admitted, dtype=torch.int64))


def jump_cost_model():
    """Verifying the first slot costs 0.5 s, every further slot 0.02 s (a cost that is not convex)."""
    verify = CostCurve.fit({1: 1.0, 2: 1.5, 64: 1.5 + 62 * 0.02})
    return CostModel(CostProfile(verify, CostCurve.fit({1: 0.22, 64: 1.48})), halflife=FROZEN)


class QSampledEstimator(OnlineAcceptanceEstimator):
    """LOSSY on purpose: the estimator fed q_sampled = q_i(x_i) instead of logit(q_max)."""

    feature = "q_sampled"

    def score(self, features):
        return features.to(torch.float64)  # q_sampled is already a probability


def make_planner(cls=FixedPricePlanner, scorer=None, exploration: float = 0.0, k: int = K, price: float = PRICE,
                 cost=None, rate: float | None = None, control_share: float = 0.0, min_speedup: float = 1.0,
                 cold_start_after: int = 0, **config):
    """The planner at a fixed price (and catch-up rate, times min_speedup); control steps off and the
    cold start at a request's first token (the short requests here) unless asked."""
    scorer = scorer or OnlineAcceptanceEstimator(k, EstimatorConfig())
    config = AdaptiveConfig(exploration=exploration, control_share=control_share, min_speedup=min_speedup,
                            cold_start_after=cold_start_after, **config)
    return cls(k, scorer, cost or cost_model(), config, price=price, rate=rate)


def lossy_q_sampled_planner(cls=FixedPricePlanner, **kw):
    with pytest.MonkeyPatch.context() as m:  # construction refuses a lossy feature: bypass it for the control
        m.setattr(adaptive, "require_lossless", lambda name: None)
        return make_planner(cls, scorer=QSampledEstimator(K), **kw)


# ---- exact enumeration ------------------------------------------------------------------

def slot_features(q: np.ndarray, x: int) -> dict[str, torch.Tensor]:
    """The features the drafter computes for one slot, from its distribution q (# [V]) and token x."""
    logits = torch.log(torch.from_numpy(q).float())[None]  # [1, V], -inf where q = 0
    return {"logit_q_max": feature_fns.logit_q_max(logits), "q_max": feature_fns.q_max(logits),
            "q_sampled": torch.tensor([float(q[x])])}


def planner_policy(planner: AdaptivePlanner, early_stop: bool = True):
    """The enumeration harness's Policy: the planner's draft rule decides how far to draft (from the
    features of the slots drafted so far), then its admission scan decides what is verified."""
    counter = iter(range(10**9))

    def policy(q_rows, drafts) -> int:
        request = Request([0], SamplingParams(), request_id=f"enum-{next(counter)}")
        planner._history(request).probing = True  # a due probe: it drafts slot 1, the rules decide the rest
        planner.probe_budget, planner.population = math.inf, Population.of([[0.0]])
        plan = planner.draft_plan([request], [K], [RequestShape(1, 0)])
        feats = [slot_features(q_rows[i], drafts[i]) for i in range(K)]
        depth = 1
        while early_stop and depth < K and bool(plan.stop_rule.keep_drafting(depth - 1, [0], feats[depth - 1])[0]):
            depth += 1
        if not early_stop:
            depth = K
        batch = DraftBatch(torch.tensor([list(drafts[:depth])]), Ragged.of([depth]),
                           torch.from_numpy(np.stack(q_rows[:depth])).float(),
                           {n: torch.cat([f[n] for f in feats[:depth]])[None] for n in feats[0]})
        admitted = planner.plan(batch, score_drafts(planner.scorer, batch, K), plan)
        planner.release(request)
        return int(admitted.num_admitted[0])

    return policy


def depths(planner: AdaptivePlanner, toy, early_stop: bool = True) -> set[int]:
    policy = planner_policy(planner, early_stop)
    return {policy([toy.q(xs[:i]) for i in range(K)], xs) for xs, _ in draft_outcomes(toy, (), K)}


ENUMERATED = {  # rule -> (price, cost model, early stop); prices chosen so the depth varies with the drafts
    "admission scan": (0.7, cost_model, False),
    "early stop + admission scan": (0.2, cost_model, True),
    "admission scan, non-convex cost": (1.2, jump_cost_model, False),
}


@pytest.mark.parametrize("rule", ENUMERATED)
@pytest.mark.parametrize("variant", ["random", "top-p 0.7", "zeros in p and q"])
def test_adaptive_rules_are_lossless_by_enumeration(variant, rule):
    price, cost, early_stop = ENUMERATED[rule]
    toy = toy_pair(variant, V=5, autoregressive=True, seed=11)
    planner = make_planner(price=price, cost=cost())
    dist = first_tokens(toy, K, planner_policy(planner, early_stop), n=2)
    assert deviation(dist, target_tokens(toy, 2)) < 1e-6


def test_enumerated_rules_admit_a_mix_of_depths():
    """Guard for the test above: on this toy, the rules' depth depends on the drafts."""
    toy = toy_pair("random", V=5, autoregressive=True, seed=11)
    for rule in ("admission scan", "early stop + admission scan"):
        price, cost, early_stop = ENUMERATED[rule]
        assert depths(make_planner(price=price, cost=cost()), toy, early_stop) == {2, 3}, rule


LOSSY = {  # the controls, where they are lossy: q_sampled anywhere; the argmax where the cost is not convex
    "q_sampled": lambda: lossy_q_sampled_planner(price=0.7),
    "argmax budget": lambda: make_planner(ArgmaxBudgetPlanner, price=1.55, cost=jump_cost_model()),
}


@pytest.mark.parametrize("lossy", LOSSY)
def test_lossy_variants_are_caught_by_enumeration(lossy):
    toy = toy_pair("random", V=5, autoregressive=True, seed=11)
    dist = first_tokens(toy, K, planner_policy(LOSSY[lossy](), early_stop=False), n=2)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-9)
    assert deviation(dist, target_tokens(toy, 2)) > 1e-2


# ---- whole engine steps -------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=ENGINE_V, noise=0.2, seed=3)


def only(planner: AdaptivePlanner, rule: str) -> AdaptivePlanner:
    """Switch off every rule of the planner but one (the others then draft and admit everything)."""
    original_draft_plan, original_plan = planner.draft_plan, planner.plan

    def draft_plan(requests, max_slots, shapes):
        plan = original_draft_plan(requests, max_slots, shapes)
        num_slots = plan.num_slots if rule in ("no draft", "control", "all") else list(max_slots)
        stop = plan.stop_rule if rule in ("early stop", "all") else None
        reasons = plan.reasons if rule in ("no draft", "control", "all") else \
            tuple(r or "rule" for r in plan.reasons)  # the others draft everything: say so
        return DraftPlan(num_slots, stop, plan.explore, plan.price, plan.shapes, reasons)

    def plan(drafts, scores, draft_plan):
        if rule in ("admission", "all", "exploration"):
            return original_plan(drafts, scores, draft_plan)
        return Plan.of(drafts, drafts.num_drafted)

    planner.draft_plan, planner.plan = draft_plan, plan
    return planner


def run_engine(pair, planner):
    """3,000 seeded requests of 4 tokens through the engine with this planner (the first step drafts K
    = 3 slots, so decisions at slots 2 and 3 vary with the drafts); the p-value of their first two
    tokens against the target's exact joint, and the engine (for its stats)."""
    target, drafter = pair
    engine = make_engine(target, drafter, k=K, max_batch_size=64)
    engine.planner, engine.scorer = planner, planner.scorer  # the planner trims on the engine's scores
    could_draft = []  # per step: slots the requests that drafted could have drafted
    engine.step_listeners.append(lambda r: could_draft.append(
        sum(m for m, d in zip(r.max_slots, r.drafts.num_drafted.tolist()) if d)))
    params = SamplingParams(temperature=1.0)
    counts = empirical_joint(engine, params, max_tokens=K + 1)
    return engine, sum(could_draft), p_value(counts, exact_joint(target, params))


RULES = {  # rule -> planner settings that make it fire often on the tiny pair
    "admission": dict(price=4.0),
    "early stop": dict(price=3.0),
    "no draft": dict(price=4.5, rate=2.0, probe_interval=1, probe_share=1.0),
    "exploration": dict(price=50.0, exploration=0.3),
    "control": dict(price=0.5, control_share=0.3),
    "all": dict(price=4.0, rate=1.5, exploration=0.1, probe_interval=1, probe_share=1.0, control_share=0.1),
}


@pytest.mark.parametrize("rule", RULES)
def test_engine_output_matches_the_target_with_each_adaptive_rule(pair, rule):
    planner, probes, entries = make_planner(**RULES[rule]), [], []
    pay, entry_pays = planner._pay_learning, planner._entry_pays
    # (a probe pays for one slot; the cold start, paid from the same budget, for a whole block)
    planner._pay_learning = lambda shape, slots: (paid := pay(shape, slots), slots > 1 or probes.append(paid))[0]
    planner._entry_pays = lambda *args: entries.append(entry_pays(*args)) or entries[-1]
    controls, draft_plan = [], planner.draft_plan
    planner.draft_plan = lambda *args: (plan := draft_plan(*args), controls.append(planner._control))[0]
    engine, could_draft, p = run_engine(pair, only(planner, rule))
    stats = engine.stats
    assert stats.accepted < stats.admitted  # rejections happen: the test is not trivial
    if rule in ("admission", "all"):
        assert stats.trimmed > 0, "the admission scan never trimmed"
    if rule in ("early stop", "all"):
        assert stats.drafted < could_draft, "drafting never stopped early"
    if rule in ("no draft", "all"):
        assert stats.skipped > 0, "no request ever skipped drafting"
        assert any(probes), "no request ever probed"
        assert any(entries) and not all(entries), "the catch-up rule never decided both ways"
        assert stats.by_reason["probe"].drafted > 0 and stats.by_reason["rule"].drafted > 0
        assert stats.by_reason["probe"].fed > stats.by_reason["probe"].request_steps  # probes caught up
    if rule == "exploration":
        assert stats.admitted > 0 and stats.trimmed > 0  # explored blocks verified, the rest trimmed
        explored = stats.by_reason["explore"]
        assert explored.admitted == explored.drafted > 0  # whole blocks
    if rule in ("control", "all"):
        assert any(controls) and not all(controls), "control steps never (or always) happened"
    assert p > 1e-3


ENGINE_LOSSY = {
    "q_sampled": lambda: lossy_q_sampled_planner(price=3.0),
    "argmax budget": lambda: make_planner(ArgmaxBudgetPlanner, price=2.0, cost=jump_cost_model()),
}


@pytest.mark.parametrize("lossy", ENGINE_LOSSY)
def test_lossy_variants_are_caught_by_the_engine_test(pair, lossy):
    engine, _, p = run_engine(pair, only(ENGINE_LOSSY[lossy](), "admission"))
    assert engine.stats.trimmed > 0
    assert p < 1e-6


# ---- greedy ---------------------------------------------------------------------------

def test_greedy_with_adaptive_verification_equals_target_only_across_batches():
    target, drafter = tiny_pair(noise=0.08)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, target.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 12, (12,), generator=gen)]
    greedy = [SamplingParams(temperature=0, max_tokens=int(m)) for m in torch.randint(1, 24, (12,), generator=gen)]
    reference = [r.output_ids for r in make_engine(target).generate(prompts, greedy)]
    trimmed = skipped = 0
    for batch, price in [(1, 2.0), (4, 4.0), (12, 3.0), (5, 30.0)]:
        engine = make_engine(target, drafter, k=4, max_batch_size=batch)
        engine.planner = make_planner(k=4, price=price, rate=1.0, exploration=0.05, probe_interval=2)
        # probes (and the cold start) fire whenever due, their slot 1 meeting the trim: a budget that
        # grew by a share of these tiny models' step times could stay in the cost model's debt for a run
        engine.planner.probe_budget = math.inf
        # (rate: target-only decoding at 1 token/s, so the cold start's bound lets these short requests draft)
        engine.scorer = engine.planner.scorer
        assert [r.output_ids for r in engine.generate(prompts, greedy)] == reference, f"batch {batch}"
        assert engine.stats.drafted > 0
        trimmed, skipped = trimmed + engine.stats.trimmed, skipped + engine.stats.skipped
    assert trimmed > 0 and skipped > 0, (trimmed, skipped)  # the rules did change what was drafted and verified
