"""Whole engine steps keep the target's distribution; a lossy planner is caught by the same test.

The toy: a tiny random target and a perturbed drafter over an 8-token vocabulary. Thousands of
seeded requests share one prompt and emit three tokens each (the first step drafts two
slots, so a planner's decision at slot 2 varies with x_1), through the full engine (drafter,
planner, packed verification, rejection sampling, continuous batching). The empirical joint
distribution of the two tokens is compared with the exact target joint (64 cells) by a
chi-square test. The negative control swaps in a planner that trims on q_sampled = q_i(x_i),
which the lossless rules forbid; the same test must reject it.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specav.config import SamplingParams
from specav.verification.sampling_rows import SamplingRows
from specav.request import Request
from specav.types import Plan
from specav.verification.planner import StaticPlanner
from tests.tiny_models import make_engine, tiny_pair

V = 8
PROMPT = [3, 5, 2]
N = 3000


class QSampledPlanner(StaticPlanner):
    """LOSSY on purpose: admits slots while the draft token's own probability is high."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def plan(self, drafts, scores, draft_plan) -> Plan:
        ok = (drafts.features["q_sampled"] >= self.threshold).int()  # NaN (undrafted) compares False
        return Plan.of(drafts, ok.cumprod(1).sum(1))


class QMaxPlanner(StaticPlanner):
    """Lossless: admits slots while q_max (a function of q_i alone) is high; stops at the first miss."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def plan(self, drafts, scores, draft_plan) -> Plan:
        ok = (drafts.features["q_max"] >= self.threshold).int()
        return Plan.of(drafts, ok.cumprod(1).sum(1))


def exact_joint(target, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of the target alone, with the same processing of logits # [V, V]."""
    rows = SamplingRows.of([Request(PROMPT, params)], [1])
    first = rows.distributions(target.forward([PROMPT], [target.new_cache()], [1]).logits).to_dense()[0]
    joint = np.zeros((V, V))
    for t1 in range(V):
        out = target.forward([PROMPT + [t1]], [target.new_cache()], [1]).logits
        joint[t1] = (first[t1] * rows.distributions(out).to_dense()[0]).double().numpy()
    return joint


def empirical_joint(engine, params: SamplingParams, max_tokens: int = 3) -> np.ndarray:
    """Counts of the first two tokens of N seeded requests (max_tokens each, so the first step
    drafts up to max_tokens - 1 slots)."""
    runs = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           max_tokens=max_tokens, seed=seed) for seed in range(N)]
    counts = np.zeros((V, V))
    for r in engine.generate([PROMPT] * N, runs):
        counts[r.output_ids[0], r.output_ids[1]] += 1
    return counts


def p_value(counts: np.ndarray, joint: np.ndarray) -> float:
    expected = joint.flatten() * counts.sum()
    keep = expected > 0
    assert counts.flatten()[~keep].sum() == 0, "a token outside the target's support was emitted"
    obs, exp = counts.flatten()[keep], expected[keep]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=V, noise=0.2, seed=3)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["plain", "temperature-topk-topp"])
def test_engine_output_matches_target_distribution(pair, params):
    target, drafter = pair
    engine = make_engine(target, drafter, k=3, max_batch_size=64)
    counts = empirical_joint(engine, params)
    assert engine.stats.accepted < engine.stats.admitted  # rejections happen: the test is not trivial
    assert p_value(counts, exact_joint(target, params)) > 1e-3


def trimmed_p_value(pair, planner) -> float:
    """Run the engine with `planner`, check that it trims, and test its output against the target."""
    target, drafter = pair
    engine = make_engine(target, drafter, k=3, max_batch_size=64)
    engine.planner = planner
    params = SamplingParams(temperature=1.0)
    counts = empirical_joint(engine, params)
    assert 0 < engine.stats.admitted < engine.stats.drafted  # it does trim
    return p_value(counts, exact_joint(target, params))


def test_trimming_on_q_max_is_lossless(pair):
    assert trimmed_p_value(pair, QMaxPlanner(0.5)) > 1e-3


def test_negative_control_trimming_on_q_sampled_is_caught(pair):
    assert trimmed_p_value(pair, QSampledPlanner(0.5)) < 1e-6
