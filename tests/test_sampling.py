"""Tests for specav.verification.sampling: hand cases, hypothesis properties, seeded draws."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specav.verification import sampling
from specav.verification.sampling import categorical, processed_probs, sample, temperature_logits

PROPERTY = settings(max_examples=80, deadline=None, derandomize=True, database=None)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: on a shared 2-core machine intra-op threads only add wake-up latency."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _probs(logits, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """processed_probs of a single row given as a list, same params: # [V]."""
    row = torch.tensor([logits], dtype=torch.float32)
    return processed_probs(row, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))[0]


def _support(probs: torch.Tensor) -> set[int]:
    return set((probs > 0).nonzero().flatten().tolist())


LOG_DYADIC = [math.log(4.0), math.log(2.0), 0.0, 0.0]  # softmax = [1/2, 1/4, 1/8, 1/8] exactly in float32


# ---------------------------------------------------------------- hand cases


def test_temperature_logits_scales_rows_and_leaves_greedy_rows_unscaled():
    logits = torch.tensor([[2.0, -1.0], [2.0, -1.0], [3.0, 1.0]])  # [N, V]
    out = temperature_logits(logits, torch.tensor([0.5, 0.0, 2.0]))
    assert torch.equal(out, torch.tensor([[4.0, -2.0], [2.0, -1.0], [1.5, 0.5]]))


def test_temperature_matches_softmax_of_scaled_logits():
    logits = [1.0, 0.3, -2.0, 0.9]
    for t in (0.3, 1.0, 2.5):
        expected = np.exp(np.array(logits) / t)
        expected /= expected.sum()
        np.testing.assert_allclose(_probs(logits, temperature=t).numpy(), expected, rtol=1e-6, atol=1e-7)


def test_top_k_keeps_the_k_largest_and_renormalises():
    logits = [1.0, 3.0, 2.0, 0.0]
    probs = _probs(logits, top_k=2)
    expected = np.array([0.0, math.e, 1.0, 0.0]) / (math.e + 1.0)
    np.testing.assert_allclose(probs.numpy(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(_probs(logits, top_k=0), _probs(logits, top_k=4))  # 0 = off; k = V keeps all
    assert torch.equal(_probs(logits, top_k=9), _probs(logits))  # k > V keeps all


def test_top_k_keeps_every_token_tied_with_the_kth():
    assert _support(_probs([3.0, 2.0, 2.0, 1.0], top_k=2)) == {0, 1, 2}
    assert _support(_probs([3.0, 2.0, 2.0, 1.0], top_k=1)) == {0}


def test_top_p_boundary_token_closes_the_nucleus_exactly():
    assert torch.equal(_probs(LOG_DYADIC), torch.tensor([0.5, 0.25, 0.125, 0.125]))  # precondition
    # mass of {0, 1} is exactly 0.75: the boundary token 1 is kept, nothing beyond it
    assert torch.equal(_probs(LOG_DYADIC, top_p=0.75), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    assert _support(_probs(LOG_DYADIC, top_p=0.5)) == {0}  # token 0 alone reaches 0.5
    assert _support(_probs(LOG_DYADIC, top_p=0.3)) == {0}  # always at least one token
    assert _support(_probs(LOG_DYADIC, top_p=0.6)) == {0, 1}


def test_top_p_keeps_tokens_tied_with_the_boundary_token():
    # 0.76 needs token 2 (prob 1/8); token 3 has the same probability, so it stays too
    assert _support(_probs(LOG_DYADIC, top_p=0.76)) == {0, 1, 2, 3}
    assert _support(_probs([0.0, 0.0, 0.0, 0.0], top_p=0.3)) == {0, 1, 2, 3}


def test_top_p_applies_after_top_k():
    logits = [math.log(w) for w in (0.4, 0.3, 0.2, 0.1)]
    # top-k 2 renormalises to [4/7, 3/7]; 4/7 >= 0.5 already, so top-p keeps token 0 alone.
    # (top-p on the raw distribution would have needed tokens 0 and 1.)
    assert _support(_probs(logits, top_k=2, top_p=0.5)) == {0}
    assert _support(_probs(logits, top_p=0.5)) == {0, 1}


def test_greedy_rows_are_one_hot_at_raw_argmax_whatever_the_truncation():
    logits = [0.5, 2.0, -1.0, 1.9]
    for top_k, top_p in ((0, 1.0), (3, 0.2), (1, 0.9)):
        assert torch.equal(_probs(logits, 0.0, top_k, top_p), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(_probs([1.0, 3.0, 3.0], 0.0), torch.tensor([0.0, 1.0, 0.0]))  # first on ties


def test_rows_with_different_params_in_one_batch():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 4)
    probs = processed_probs(logits, torch.tensor([1.0, 0.0, 1.0, 0.5]), torch.tensor([2, 0, 0, 0]),
                            torch.tensor([1.0, 1.0, 0.7, 1.0]))  # 0.7 needs tokens 1 (0.64) and 2
    assert _support(probs[0]) == {1, 2}
    assert torch.equal(probs[1], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert _support(probs[2]) == {1, 2}
    assert _support(probs[3]) == {0, 1, 2, 3}


# ---------------------------------------------------------------- properties


@st.composite
def batches(draw):
    """Random logits (with ties) and per-row params: (logits [N, V], temperature, top_k, top_p)."""
    n, v = draw(st.integers(1, 4)), draw(st.integers(1, 10))
    value = st.floats(-8, 8, allow_nan=False, width=32) | st.integers(-2, 2).map(float)
    logits = torch.tensor(draw(st.lists(st.lists(value, min_size=v, max_size=v), min_size=n, max_size=n)))
    temperature = draw(st.lists(st.just(0.0) | st.floats(0.1, 3.0), min_size=n, max_size=n))
    top_k = draw(st.lists(st.integers(0, v + 2), min_size=n, max_size=n))
    top_p = draw(st.lists(st.just(1.0) | st.floats(0.01, 1.0), min_size=n, max_size=n))
    return logits, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p)


@PROPERTY
@given(batches())
def test_rows_are_distributions(batch):
    probs = processed_probs(*batch)
    assert probs.dtype == torch.float32 and probs.shape == batch[0].shape
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0]), atol=1e-5, rtol=0)


@PROPERTY
@given(batches())
def test_batched_rows_equal_row_by_row(batch):
    probs = processed_probs(*batch)
    for n in range(probs.shape[0]):
        row = processed_probs(*(t[n:n + 1] for t in batch))[0]
        assert torch.equal(probs[n], row)


@PROPERTY
@given(batches())
def test_top_p_candidate_shortcut_equals_the_full_sort(batch):
    # with 2 candidates, rows whose top-2 mass reaches top_p take the shortcut, the others a full sort
    with mock.patch.object(sampling, "_TOP_P_CANDIDATES", 2):
        shortcut = processed_probs(*batch)
    assert torch.equal(shortcut, processed_probs(*batch))


@PROPERTY
@given(batches())
def test_top_k_candidate_path_equals_the_dense_path(batch):
    """Rows with a top-k are computed on their k candidates; the dense path is the reference."""
    with mock.patch.object(sampling, "_SPARSE_TOP_K", 0):  # every row through the dense path
        dense = processed_probs(*batch)
    sparse = processed_probs(*batch)
    torch.testing.assert_close(sparse, dense, atol=1e-6, rtol=0)
    assert torch.equal(sparse > 0, dense > 0)


def test_top_k_candidate_path_on_a_large_vocabulary_and_a_tie_beyond_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 151_936, generator=gen) * 3
    logits[2, :5] = 20.0  # five tokens tie for the top: top-k 3 must keep all five (dense path)
    args = torch.tensor([0.7, 1.0, 1.0]), torch.tensor([20, 50, 3]), torch.tensor([0.8, 1.0, 1.0])
    with mock.patch.object(sampling, "_SPARSE_TOP_K", 0):
        dense = processed_probs(logits, *args)
    sparse = processed_probs(logits, *args)
    torch.testing.assert_close(sparse, dense, atol=1e-7, rtol=0)
    assert int((sparse[1] > 0).sum()) == 50 and int((sparse[2] > 0).sum()) == 5


@PROPERTY
@given(batches(), st.integers(1, 12), st.integers(1, 12))
def test_support_shrinks_with_top_k(batch, k1, k2):
    logits, temperature, _, top_p = batch
    small, large = sorted((k1, k2))
    n = logits.shape[0]
    supports = [processed_probs(logits, temperature, torch.full((n,), k), top_p) > 0 for k in (small, large, 0)]
    assert bool((supports[0] <= supports[1]).all()) and bool((supports[1] <= supports[2]).all())


@PROPERTY
@given(batches(), st.floats(0.01, 1.0), st.floats(0.01, 1.0))
def test_support_shrinks_with_top_p(batch, p1, p2):
    logits, temperature, top_k, _ = batch
    small, large = sorted((p1, p2))
    n = logits.shape[0]
    supports = [processed_probs(logits, temperature, top_k, torch.full((n,), p)) > 0 for p in (small, large, 1.0)]
    assert bool((supports[0] <= supports[1]).all()) and bool((supports[1] <= supports[2]).all())


@PROPERTY
@given(batches())
def test_top_p_keeps_the_smallest_nucleus_up_to_ties(batch):
    logits, temperature, top_k, top_p = batch
    full = processed_probs(logits, temperature.clamp(min=0.1), top_k, torch.ones_like(top_p))
    kept = processed_probs(logits, temperature.clamp(min=0.1), top_k, top_p) > 0
    for row, keep, p in zip(full.double().numpy(), kept.numpy(), top_p.double().numpy()):
        assert row[keep].min() >= row[~keep & (row > 0)].max(initial=0.0)  # highest-probability tokens
        assert row[keep].sum() >= p - 1e-6  # enough mass
        above_boundary = keep & (row > row[keep].min())
        assert row[above_boundary].sum() < p + 1e-6  # dropping the boundary tier would not be enough


@PROPERTY
@given(batches(), st.randoms(use_true_random=False))
def test_sampled_rows_are_permutation_equivariant(batch, rnd):
    logits, temperature, top_k, top_p = batch
    temperature = temperature.clamp(min=0.1)  # greedy argmax breaks ties by index, by design
    perm = list(range(logits.shape[1]))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    out = processed_probs(logits[:, perm], temperature, top_k, top_p)
    torch.testing.assert_close(out, processed_probs(logits, temperature, top_k, top_p)[:, perm],
                               atol=1e-6, rtol=0)


# ---------------------------------------------------------------- sample


def test_sample_one_hot_rows_and_generator_count():
    probs = torch.eye(4)[[2, 0, 3]]  # [N, V]
    g = torch.Generator().manual_seed(0)
    assert sample(probs, [g, g, g]).tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match="3 rows"):
        sample(probs, [g])


def test_sample_draws_each_row_from_its_own_generator_in_row_order():
    probs = torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(1)), -1)
    shared = sample(probs, [torch.Generator().manual_seed(7)] * 5)
    g = torch.Generator().manual_seed(7)
    assert shared.tolist() == [categorical(row, g) for row in probs]
    separate = sample(probs, [torch.Generator().manual_seed(s) for s in range(5)])
    again = sample(probs, [torch.Generator().manual_seed(s) for s in range(5)])
    assert separate.dtype == torch.int64 and torch.equal(separate, again)


def test_sample_histogram_matches_probs():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    g = torch.Generator().manual_seed(3)
    tokens = sample(probs.expand(4000, 4), [g] * 4000)
    counts = np.bincount(tokens.numpy(), minlength=4)
    assert chisquare(counts, 4000 * np.array([0.1, 0.2, 0.3, 0.4])).pvalue > 1e-3
    assert chisquare(counts, 4000 * np.full(4, 0.25)).pvalue < 1e-6  # the test has power


def test_sample_never_draws_a_zero_weight_token_and_matches_a_large_vocabulary():
    """Inverse CDF over V = 151,936 (the packaged pair's vocabulary): zero-weight tokens, among them
    the first and the last, are never drawn, and the draws follow the weights."""
    v = 151_936
    probs = torch.zeros(v)
    support = torch.tensor([1, 7, 50_000, 151_934])
    probs[support] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(11)
    # 4000 draws, 500 rows per call: the float64 CDF of one call is then 0.6 GB, not 4.9 GB (twice over).
    tokens = torch.cat([sample(probs.expand(500, v), [g] * 500) for _ in range(8)])  # [4000]
    assert set(tokens.tolist()) <= set(support.tolist())
    counts = np.array([(tokens == t).sum().item() for t in support])
    assert chisquare(counts, 4000 * np.array([0.1, 0.2, 0.3, 0.4])).pvalue > 1e-3


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.5, -0.1, 0.6], [0.5, float("nan"), 0.5], [float("inf"), 0.0, 1.0]])
def test_sample_refuses_rows_that_are_not_distributions(row):
    with pytest.raises(ValueError, match="non-negative weights with a positive sum"):
        sample(torch.tensor([[0.2, 0.8, 0.0], row]), [torch.Generator()] * 2)


def test_sample_uniform_rounding_up_to_the_total_draws_the_last_token_with_weight(monkeypatch):
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.2, 0.0, 0.0, 0.8]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))  # u * total == total
    assert sample(probs, [torch.Generator()] * 2).tolist() == [2, 3]
    assert categorical(probs[0], torch.Generator()) == 2


@pytest.mark.parametrize("v", [5, 1024, 3000, 151_936])
def test_sample_two_levels_equal_the_one_level_inverse_cdf(v):
    """sample finds the block, then the token in it; for the same uniforms it must pick the token a
    float64 cumulative sum over the whole row picks (sparse rows, supports across block edges, a
    last block shorter than the others)."""
    g = torch.Generator().manual_seed(v)
    probs = torch.rand(6, v, generator=g) * (torch.rand(6, v, generator=g) < 0.3)  # [N, V], ~70% zeros
    probs[:, v // 2] += 0.5  # no row without weight
    probs[0] = 0.0
    probs[0, [0, v - 1]] = 1.0  # only the first and the last token
    probs[1] = 0.0
    probs[1, min(1023, v - 1)] = 2.0
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    for seed in range(40):
        u = torch.rand(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp(max=v - 1)
        drawn = sample(probs, [torch.Generator().manual_seed(seed) for _ in range(6)])
        assert torch.equal(drawn, expected), seed
        assert bool((probs.gather(1, drawn[:, None]) > 0).all())
