"""specav.topk: the native one-pass top-k (native/topk.cpp) against torch.topk, in every native
variant this machine runs (test ids name the variant; one the CPU lacks is skipped with why)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specav import topk
from specav.models import native
from specav.topk import scaled_top_k, torch_scaled_top_k



def same_as_torch(ops, x: torch.Tensor, t: torch.Tensor, k: int) -> None:
    values, index, at_least = ops.scaled_top_k(x, t, k)
    ref_values, _, ref_at_least = torch_scaled_top_k(x, t, k)
    assert torch.equal(values, ref_values)  # bit for bit: the same IEEE division
    assert torch.equal(at_least, ref_at_least)
    scaled = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    assert torch.equal(scaled.gather(1, index), values)  # the ids point at the values
    assert all(len(set(row)) == k for row in index.tolist())  # k distinct ids


@pytest.mark.parametrize("k", [1, 2, 20, 1024])
def test_native_top_k_equals_torch_on_vocabulary_rows(native_ops, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, 151_936, generator=g) * 3
    same_as_torch(native_ops, x, torch.tensor([0.7, 1.0, 0.0, 1.3, 0.05]), k)


def test_native_top_k_counts_ties_beyond_the_kth(native_ops):
    x = torch.zeros(3, 100)
    x[0, :5] = 2.0  # five tie for the top: k = 3 reaches 5
    x[1, 7] = 3.0
    x[1, 40:43] = 1.0  # the 2nd..4th tie: k = 2 reaches 4
    x[2, :] = 1.0  # all tie
    values, index, at_least = native_ops.scaled_top_k(x, torch.ones(3), 3)
    assert at_least.tolist() == [5, 4, 100]
    assert index[1, 0] == 7 and values[1].tolist() == [3.0, 1.0, 1.0]
    same_as_torch(native_ops, x, torch.ones(3), 3)


def test_native_top_k_handles_minus_inf_and_short_rows(native_ops):
    x = torch.full((2, 13), -float("inf"))  # 13: not a multiple of the 8-wide vector
    x[0, 12] = 1.0  # the last entry, in the scalar tail
    x[1, 3] = 0.5
    x[1, 11] = 0.25
    values, index, at_least = native_ops.scaled_top_k(x, torch.ones(2), 2)
    assert values[0].tolist() == [1.0, -float("inf")] and index[0, 0] == 12
    assert at_least[0] == 13  # every -inf entry reaches the 2nd value: the caller keeps the dense path
    assert values[1].tolist() == [0.5, 0.25] and index[1].tolist() == [3, 11] and at_least[1] == 2
    same_as_torch(native_ops, x, torch.ones(2), 13)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), v=st.integers(1, 300), data=st.data())
def test_native_top_k_equals_torch_on_any_shape(rows, v, data):
    if not native.available():
        pytest.skip(native.unavailable_reason())
    k = data.draw(st.integers(1, v))
    levels = data.draw(st.integers(2, 50))  # few distinct values: many ties
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randint(0, levels, (rows, v), generator=g).float() / 7
    t = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=rows, max_size=rows)))
    same_as_torch(native.ops(), x, t, k)


def test_scaled_top_k_refuses_k_outside_the_row_and_falls_back_without_native(monkeypatch):
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="k = 11"):
        scaled_top_k(x, torch.ones(2), 11)
    monkeypatch.setattr(topk, "_native_ops", lambda: None)
    values, _, at_least = scaled_top_k(x, torch.tensor([2.0, 0.0]), 3)
    assert torch.equal(values, torch_scaled_top_k(x, torch.tensor([2.0, 0.0]), 3)[0])
    assert at_least.tolist() == [3, 3]


def tail_reference(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tail and moment in float64 from first principles (the first maximum left out)."""
    z64 = z.double()
    m, first = z64.max(-1, keepdim=True)
    d = (z64 - m).clamp(min=-100.0)
    e = d.exp().scatter(-1, first, 0.0)
    return e.sum(-1), (e * d).sum(-1)


def same_tail(ops, z: torch.Tensor) -> None:
    values, index, tail, moment = ops.top_two_tail(z)
    assert torch.equal(values, torch_scaled_top_k(z, torch.ones(z.shape[0]), 2)[0])
    assert torch.equal(z.gather(1, index), values) and bool((index[:, 0] != index[:, 1]).all())
    assert torch.equal(index[:, 0], z.argmax(-1))  # the first maximum, the one left out of the tail
    ref_tail, ref_moment = tail_reference(z)
    # float32 against float64: z - m rounded to float32 moves exp(d) by up to |d| x 6e-8 <= 6e-6
    # relative, plus what exp's underflow below d = -87.3 leaves out (at most V x 1.2e-38, far below
    # what any feature can show).
    torch.testing.assert_close(tail, ref_tail, rtol=1e-5, atol=1e-33)
    torch.testing.assert_close(moment, ref_moment, rtol=1e-5, atol=1e-31)


def test_native_top_two_tail_on_vocabulary_rows(native_ops):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, 151_936, generator=g) * 3
    z[1, 12345] = 40.0  # q_max within 1e-12 of 1: the tail is what logit(q_max) reads
    z[2, 151_935] = 25.0  # the maximum in the last vector
    z[3, :140_000] = -float("inf")  # a masked vocabulary
    z[4, 3] = z[4, 9000] = 20.0  # a tie for the maximum: the second copy stays in the tail
    z[5] *= 0.01  # nearly uniform
    same_tail(native_ops, z)
    values, index, tail, _ = native_ops.top_two_tail(z)
    assert index[4].tolist() == [3, 9000] and values[4].tolist() == [20.0, 20.0] and tail[4] >= 1.0


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), v=st.integers(2, 70), data=st.data())
def test_native_top_two_tail_on_any_shape(rows, v, data):
    """Lengths around the 8-wide vectors and the 256-entry blocks, the maximum anywhere, ties."""
    if not native.available():
        pytest.skip(native.unavailable_reason())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    scale = data.draw(st.sampled_from([0.1, 3.0, 30.0]))
    z = torch.randn(rows, v * data.draw(st.sampled_from([1, 37])), generator=g) * scale
    if data.draw(st.booleans()):
        z = (z * 2).round() / 2  # ties
    same_tail(native.ops(), z)


def test_top_two_tail_falls_back_to_torch_without_native(monkeypatch):
    z = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) * 4
    monkeypatch.setattr(topk, "_native_ops", lambda: None)
    values, _, tail, moment = topk.top_two_tail(z)
    assert torch.equal(values, torch_scaled_top_k(z, torch.ones(3), 2)[0])
    ref_tail, ref_moment = tail_reference(z)
    torch.testing.assert_close(tail, ref_tail, rtol=1e-5, atol=0)
    torch.testing.assert_close(moment, ref_moment, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="V >= 2"):
        topk.top_two_tail(torch.zeros(2, 1))
