"""Tests for specav.token_probs and the distributions sampling.py hands out as candidates.

The engine carries q_i and p_i as their top-k candidates; everything that reads them (sample, the
rejection sampler, the features) must see the same distribution as the dense row: checked here
against `processed_probs` and dense sampling, draw for draw. The rejection sampler's forms are in
tests/test_rejection.py.
"""

from __future__ import annotations

import pytest
import torch

from specav.token_probs import TokenProbs
from specav.verification.sampling import processed_distributions, processed_probs, sample

V = 50


def rows_of(n: int, seed: int, ties: bool = False) -> torch.Tensor:
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2
    if ties:
        logits = logits.round()  # many equal logits, some at a row's k-th value
    return logits


def processed(logits, temperature, top_k, top_p):
    n = logits.shape[0]
    args = (logits, torch.as_tensor(temperature, dtype=torch.float32).expand(n),
            torch.as_tensor(top_k, dtype=torch.int64).expand(n), torch.as_tensor(top_p, dtype=torch.float32).expand(n))
    return processed_distributions(*args), processed_probs(*args)


def test_candidates_sort_by_token_and_densify():
    dist = TokenProbs.candidates(torch.tensor([[7, 2, 9], [4, 5, V]]),
                                 torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0]]), V)
    assert dist.ids.tolist() == [[2, 7, 9], [4, 5, V]]
    dense = dist.to_dense()
    assert dense.shape == (2, V)
    assert dense[0, 7] == 0.5 and dense[0, 2] == pytest.approx(0.3) and dense[1, 5] == pytest.approx(0.4)
    assert dense.sum().item() == pytest.approx(2.0)
    assert dist.at(torch.tensor([9, 7])).tolist() == pytest.approx([0.2, 0.0])
    assert dist.at(torch.tensor([5, 4]), rows=torch.tensor([1, 1])).tolist() == pytest.approx([0.4, 0.6])
    torch.testing.assert_close(dist.lookup(torch.tensor([[9, 3], [V, 4]])), torch.tensor([[0.2, 0.0], [0.0, 0.6]]))
    assert torch.equal(dist.lookup(None), dense)
    assert dist.max().tolist() == pytest.approx([0.5, 0.6])
    assert dist.at_each([9, 5]) == dist.at(torch.tensor([9, 5])).tolist()  # the drafter's per-slot form
    assert dist.at_each([2, 7]) == [dist.probs[0, 0].item(), 0.0]  # a token not among the candidates: 0
    assert dist.max_each() == dist.max().tolist()


def test_dense_rows_answer_the_same_questions():
    probs = torch.softmax(rows_of(3, 0), dim=-1)
    dense = TokenProbs.dense(probs)
    ids = torch.tensor([[1, 2, V], [0, 49, 3], [V, V, 7]])
    expected = torch.where(ids < V, probs.gather(1, ids.clamp(max=V - 1)), 0.0)
    assert torch.equal(dense.lookup(ids), expected)
    assert torch.equal(dense.at(torch.tensor([4, 5, 6])), probs[[0, 1, 2], [4, 5, 6]])
    assert dense.at_each([4, 5, 6]) == probs[[0, 1, 2], [4, 5, 6]].tolist()
    assert dense.max_each() == dense.max().tolist()
    assert torch.equal(TokenProbs.of(probs).probs, probs) and TokenProbs.of(dense) is dense


def test_cat_pads_to_the_widest_and_goes_dense_with_a_dense_part():
    narrow = TokenProbs.candidates(torch.tensor([[3]]), torch.tensor([[1.0]]), V)
    wide = TokenProbs.candidates(torch.tensor([[1, 2]]), torch.tensor([[0.25, 0.75]]), V)
    both = TokenProbs.cat([narrow, wide], V)
    assert both.ids.tolist() == [[3, V], [1, 2]]
    assert torch.equal(both.to_dense(), torch.cat([narrow.to_dense(), wide.to_dense()]))
    dense = TokenProbs.cat([narrow, TokenProbs.dense(wide.to_dense())], V)
    assert dense.is_dense and torch.equal(dense.probs, both.to_dense())
    assert len(TokenProbs.cat([], V)) == 0


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.8), (1.0, 5, 1.0), (0.5, 1, 1.0), (0.0, 20, 0.8)],
                         ids=["topk-topp", "topk", "k1", "greedy"])
def test_top_k_rows_come_as_their_candidates_and_equal_the_dense_rows(temperature, top_k, top_p):
    logits = rows_of(6, 1)
    dist, dense = processed(logits, temperature, top_k, top_p)
    assert not dist.is_dense and dist.probs.shape[1] <= top_k
    assert torch.equal(dist.to_dense(), dense)
    assert bool((dist.ids[:, 1:] > dist.ids[:, :-1]).all())  # ascending, distinct


def test_mixed_rows_keep_their_order():
    """Greedy, two values of k and a plain row in one batch: dense (the plain row has no candidates);
    greedy and two ks alone: candidates of two widths, each row where it was."""
    logits = rows_of(4, 2)
    args = (logits, torch.tensor([0.0, 0.7, 0.9, 1.0]), torch.tensor([0, 3, 8, 0]), torch.tensor([1.0, 0.9, 1.0, 1.0]))
    dist = processed_distributions(*args)
    assert dist.is_dense and torch.equal(dist.probs, processed_probs(*args))
    args = (logits, torch.tensor([0.0, 0.7, 0.9, 0.8]), torch.tensor([0, 3, 8, 3]), torch.tensor([1.0, 0.9, 1.0, 1.0]))
    dist = processed_distributions(*args)
    assert not dist.is_dense and dist.probs.shape[1] == 8
    assert torch.equal(dist.to_dense(), processed_probs(*args))


def test_a_tie_at_the_kth_logit_takes_the_dense_path():
    logits = torch.zeros(2, V)
    logits[:, :3] = torch.tensor([3.0, 2.0, 1.0])  # k = 4: the 4th value (0) ties with 47 more tokens
    dist, dense = processed(logits, 1.0, 4, 1.0)
    assert dist.is_dense and torch.equal(dist.probs, dense)
    assert int((dense[0] > 0).sum()) == V


def test_sample_draws_the_same_token_from_candidates_as_from_dense_rows():
    logits = rows_of(8, 3)
    for params in ((0.7, 20, 0.8), (1.3, 40, 1.0), (0.0, 20, 1.0)):
        dist, dense = processed(logits, *params)
        for seed in range(200):
            generators = [torch.Generator().manual_seed(seed * 8 + i) for i in range(8)]
            twins = [torch.Generator().manual_seed(seed * 8 + i) for i in range(8)]
            assert torch.equal(sample(dist, generators), sample(dense, twins))


def test_sample_never_draws_padding_or_a_dropped_candidate():
    dist = TokenProbs.candidates(torch.tensor([[4, 9, V]]), torch.tensor([[0.0, 1.0, 0.0]]), V)
    tokens = {int(sample(dist, [torch.Generator().manual_seed(s)])[0]) for s in range(300)}
    assert tokens == {9}
    with pytest.raises(ValueError, match="positive sum"):
        sample(TokenProbs.candidates(torch.tensor([[4]]), torch.tensor([[0.0]]), V), [torch.Generator()])
