"""SamplingRows.draw, the drafter's slot (q_i, its tails and one token per row), and
SamplingRows.distributions (the verifier's p_i): their one native call gives what the general steps
give (distributions_and_tails, then sample), and leaves every generator where they leave it,
whatever the batch holds."""

from __future__ import annotations

import pytest
import torch

from specav import topk
from specav.config import SamplingParams
from specav.request import Request
from specav.verification import sampling
from specav.verification.sampling_rows import SamplingRows

V = 151_936


def _rows(params: list[SamplingParams]) -> SamplingRows:
    requests = [Request([1, 2, 3], p) for p in params]
    return SamplingRows.of(requests, [1] * len(requests), model="drafter")


def _by_steps(rows: SamplingRows, logits: torch.Tensor):
    probs, tails = rows.distributions_and_tails(logits)
    return probs, tails, sampling.sample(probs, rows.generators)


def _logits(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _same(a, b) -> None:
    (probs, tails, tokens), (ref_probs, ref_tails, ref_tokens) = a, b
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(probs.to_dense(), ref_probs.to_dense())
    for field in ("gap", "tail", "moment"):
        assert torch.equal(getattr(tails, field), getattr(ref_tails, field))


SHARED = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=s) for s in range(3)]
MIXED = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=0),
         SamplingParams(temperature=0.0, seed=1),  # greedy
         SamplingParams(temperature=1.0, top_k=5, top_p=1.0, seed=2),  # another top-k
         SamplingParams(temperature=0.7, top_k=0, top_p=0.9, seed=3),  # dense
         SamplingParams(temperature=0.7, top_k=20, presence_penalty=0.5, seed=4)]  # transforms


@pytest.mark.parametrize("params", [SHARED, MIXED], ids=["one native call", "general steps"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_draw_equals_the_two_steps_and_leaves_the_generators_where_they_do(params, native, monkeypatch):
    if not native:
        monkeypatch.setattr(topk, "_native_ops", lambda: None)
    logits = _logits(len(params), 0)
    drawn, by_steps = _rows(params), _rows(params)
    for _ in range(3):  # the generators advance alike
        _same(drawn.draw(logits), _by_steps(by_steps, logits))
    assert [g.initial_seed() for g in drawn.generators] == [p.seed for p in params]
    assert sampling.draw_uniforms(drawn.generators) == sampling.draw_uniforms(by_steps.generators)


def test_a_row_the_native_call_declines_takes_the_general_path_with_the_same_uniforms(monkeypatch):
    """A tie at the k-th value beyond k, and a row without a distribution (its request fails alone
    and draws from a uniform row, as distributions_and_tails has it)."""
    logits = _logits(3, 1)
    kth = logits[0].topk(20).values[-1]
    logits[0, int(logits[0].argmin())] = kth  # a 21st entry at the 20th value: top_k 20 keeps both
    logits[2, 9] = float("nan")
    drawn, by_steps = _rows(SHARED), _rows(SHARED)
    declined = []
    original = sampling.draw_top_k
    monkeypatch.setattr(sampling, "draw_top_k", lambda *a: (r := original(*a), declined.append(r is None))[0])
    _same(drawn.draw(logits), _by_steps(by_steps, logits))
    assert declined == [True]
    assert drawn.requests[2].error is not None and drawn.requests[0].error is None
    assert sampling.draw_uniforms(drawn.generators) == sampling.draw_uniforms(by_steps.generators)


def test_the_native_call_is_taken_where_every_row_shares_a_top_k(monkeypatch):
    calls = []
    original = sampling.draw_top_k
    monkeypatch.setattr(sampling, "draw_top_k", lambda *a: calls.append(a[2]) or original(*a))
    _rows(SHARED).draw(_logits(3, 2))
    _rows(MIXED).draw(_logits(5, 2))
    assert calls == [20]  # the mixed batch never asks


@pytest.mark.parametrize("params", [SHARED, MIXED], ids=["one native call", "general steps"])
def test_distributions_equal_the_general_path(params, monkeypatch):
    logits = _logits(len(params), 3)
    logits[-1, 4] = float("nan")  # the last request fails alone on either path
    general = _rows(params)._distributions(logits, tails=False)[0]
    calls = []
    original = sampling.top_k_distributions
    monkeypatch.setattr(sampling, "top_k_distributions", lambda *a: calls.append(a[2]) or original(*a))
    rows = _rows(params)
    assert torch.equal(rows.distributions(logits).to_dense(), general.to_dense())
    assert calls == ([20] if params is SHARED else [])
    assert [r.error is not None for r in rows.requests] == [False] * (len(params) - 1) + [True]
