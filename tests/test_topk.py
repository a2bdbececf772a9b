"""specav.topk: the native one-pass top-k (native/topk.cpp) against torch.topk, in every native
variant this machine runs (test ids name the variant; one the CPU lacks is skipped with why)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specav import topk
from specav.models import native
from specav.topk import scan_rows, torch_scaled_top_k



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


def tied_rows(data, rows: int, v: int, most_levels: int, temperatures: list[float]):
    """Drawn rows of few distinct values (many ties), their temperatures and a k: x # [rows, v], t # [rows],
    k, and the generator that made x (for more of the same draw)."""
    k = data.draw(st.integers(1, v))
    levels = data.draw(st.integers(2, most_levels))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randint(0, levels, (rows, v), generator=g).float() / 7
    t = torch.tensor(data.draw(st.lists(st.sampled_from(temperatures), min_size=rows, max_size=rows)))
    return x, t, k, g


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), v=st.integers(1, 300), data=st.data())
def test_native_top_k_equals_torch_on_any_shape(rows, v, data):
    if not native.available():
        pytest.skip(native.unavailable_reason())
    # temperatures whose quotients are exact, and ones whose quotients round
    x, t, k, _ = tied_rows(data, rows, v, 50, [0.0, 0.5, 1.0, 2.0, 0.7, 1.3, 0.05])
    same_as_torch(native.ops(), x, t, k)


def test_native_top_k_on_a_subset_heads_rows(native_ops):
    """A drafter's vocabulary-subset head (models/vocab_subset.py) gives -inf outside its subset: whole
    chunks of the row hold fewer than k finite entries, or none."""
    g = torch.Generator().manual_seed(3)
    x = torch.full((3, 151_936), -float("inf"))
    subset = torch.randperm(60_000, generator=g)[:30_000]  # the chunks past 60k: all -inf
    x[:, subset] = torch.randn(3, 30_000, generator=g) * 3
    x[1, 100_000:100_005] = 1.0  # a few finite entries in an -inf chunk
    x[2, 140_000] = 50.0  # the largest, in the last chunk
    same_as_torch(native_ops, x, torch.tensor([0.7, 1.0, 1.3]), 20)
    same_scan(native_ops, x, torch.tensor([0.7, 1.0, 1.3]), 20)  # and the tails, -inf vectors left out
    x[:, :60_000] = -float("inf")  # rows 1 and 2: 5 and 1 finite entries, k = 20: the rest of the top is -inf, lowest ids first
    same_as_torch(native_ops, x[1:], torch.tensor([1.0, 1.0]), 20)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), v=st.integers(1, 300), data=st.data())
def test_native_top_k_equals_torch_on_rows_mostly_minus_inf(rows, v, data):
    if not native.available():
        pytest.skip(native.unavailable_reason())
    x, t, k, g = tied_rows(data, rows, v, 20, [1.0, 0.7, 1.3])
    finite = torch.rand(rows, v, generator=g) < data.draw(st.sampled_from([0.0, 0.05, 0.3, 0.9]))
    finite[:, data.draw(st.integers(0, v - 1))] = True  # a row without a finite entry has no distribution (scan_rows)
    same_as_torch(native.ops(), torch.where(finite, x, torch.tensor(-float("inf"))), t, k)


@pytest.mark.parametrize("t", [0.7, 1.3, 3.0, 0.05])
def test_native_top_k_where_neighbouring_floats_divide_to_one_value(native_ops, t):
    """Runs of adjacent floats whose quotients x / t round to one value: the k-th largest of z ties
    with entries above and below it in x, found before and after the first pass's compactions (from
    which on an entry joins only above the k-th so far)."""
    g = torch.Generator().manual_seed(int(t * 100))
    starts = torch.tensor([[1.0], [-2.5], [3e-39], [60.0]])  # a normal, a negative, a subnormal, a large logit
    runs = (starts.view(torch.int32) + torch.arange(4096, dtype=torch.int32)).view(torch.float32)  # 4096 adjacent floats
    x = torch.stack([row[torch.randperm(4096, generator=g)] for row in runs])
    for k in (1, 7, 20, 333):
        same_as_torch(native_ops, x, torch.full((4,), t), k)


def test_scan_rows_refuses_k_outside_the_row_and_falls_back_without_native(monkeypatch):
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="k = 11"):
        scan_rows(x, torch.ones(2), 11)
    with pytest.raises(ValueError, match="V >= 2"):
        scan_rows(x[:, :1], torch.ones(2), 1, tails=True)
    monkeypatch.setattr(topk, "_native_ops", lambda: None)
    scan = scan_rows(x, torch.tensor([2.0, 0.0]), 3, tails=True)
    assert torch.equal(scan.values, torch_scaled_top_k(x, torch.tensor([2.0, 0.0]), 3)[0])
    assert scan.at_least.tolist() == [3, 3] and scan.bad.tolist() == [False, False]
    assert scan.tails.tail.dtype == torch.float64 and bool((scan.tails.gap <= 0).all())


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


def same_scan(ops, x: torch.Tensor, t: torch.Tensor, k: int) -> None:
    """The native scan against torch's, with and without tails: the same top k and tie counts bit
    for bit, the same bad rows, tails to float32 rounding (as top_two_tail's)."""
    for tails in (False, True):
        values, ids, at_least, bad, second, tail, moment = ops.scan_rows(x, t, k, tails)
        ref = topk.torch_scan_rows(x, t, k, tails)
        assert torch.equal(bad, ref.bad)
        good = ~bad
        assert torch.equal(values[good], ref.values[good]) and torch.equal(at_least[good], ref.at_least[good])
        scaled = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
        assert torch.equal(scaled.gather(1, ids)[good], values[good])
        if tails:
            assert torch.equal((second - values[:, 0])[good], ref.tails.gap[good])
            torch.testing.assert_close(tail[good], ref.tails.tail[good], rtol=1e-5, atol=1e-33)
            torch.testing.assert_close(moment[good], ref.tails.moment[good], rtol=1e-5, atol=1e-31)
        else:
            assert second.numel() == tail.numel() == moment.numel() == 0


def test_native_scan_on_vocabulary_rows_with_bad_rows(native_ops):
    """Rows cut into chunks: the maximum, the k-th value and its ties on either side of a cut; rows
    without a distribution flagged and the others untouched by them."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 151_936, generator=g) * 3
    x[1, 38_143:38_145] = 30.0  # a tie for the maximum across the first cut (V / 4 rounded up to 256: 38144)
    x[2, 5] = float("nan")
    x[3, 100_000] = float("inf")
    x[4, :] = -float("inf")
    x[5, 151_935] = 25.0  # the maximum in the scalar tail of the last chunk
    x[6, :140_000] = -float("inf")
    t = torch.tensor([0.7, 1.0, 0.7, 1.0, 1.0, 0.0, 1.3])
    for k in (1, 2, 20):
        same_scan(native_ops, x, t, k)
    bad = native_ops.scan_rows(x, t, 20, True)[3]
    assert bad.tolist() == [False, False, True, True, True, False, False]
    ids = native_ops.scan_rows(x, t, 2, False)[1]
    assert ids[1].tolist() == [38_143, 38_144] and ids[5, 0] == 151_935


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), v=st.integers(2, 3000), data=st.data())
def test_native_scan_on_any_shape(rows, v, data):
    """Lengths across the chunk cuts and the vector widths, ties, any k."""
    if not native.available():
        pytest.skip(native.unavailable_reason())
    k = data.draw(st.integers(1, min(v, 64)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, v, generator=g) * data.draw(st.sampled_from([0.1, 3.0, 30.0]))
    if data.draw(st.booleans()):
        x = (x * 2).round() / 2  # ties
    t = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 0.7, 1.3]), min_size=rows, max_size=rows)))
    same_scan(native.ops(), x, t, k)


def test_native_candidate_probs_agree_with_torch(native_ops):
    """softmax and nucleus over the candidates to float32 rounding, the same kept tokens, ascending ids."""
    g = torch.Generator().manual_seed(5)
    for k in (1, 2, 5, 20, 64):
        x = torch.randn(40, 1000, generator=g) * 2
        x[::4] = (x[::4] * 2).round() / 2  # ties, inside the nucleus and at its boundary
        values, ids, _ = native_ops.scaled_top_k(x, torch.full((40,), 0.7), k)
        top_p = torch.rand(40, generator=g).clamp(min=0.05)
        top_p[::3] = 1.0
        got_ids, got = native_ops.candidate_probs(values, ids, top_p)
        ref_ids, ref = topk.torch_candidate_probs(values, ids, top_p)
        assert torch.equal(got_ids, ref_ids) and bool((got_ids[:, 1:] > got_ids[:, :-1]).all())
        assert torch.equal(got > 0, ref > 0)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_candidate_probs_nucleus_keeps_ties_and_one_token():
    values = torch.tensor([[2.0, 1.0, 1.0, 0.0], [9.0, 0.0, -1.0, -2.0]])
    ids = torch.tensor([[8, 3, 5, 1], [4, 2, 0, 7]])
    for fn in (topk.candidate_probs, topk.torch_candidate_probs):
        got_ids, got = fn(values, ids, torch.tensor([0.75, 0.5]))
        assert got_ids.tolist() == [[1, 3, 5, 8], [0, 2, 4, 7]]
        e = torch.tensor([1.0, 1.0]).exp().tolist()  # the two tied at 1.0 both stay, the 0.0 goes
        assert got[0].tolist() == pytest.approx([0.0, 1 / (2 + e[0]), 1 / (2 + e[0]), e[0] / (2 + e[0])])
        assert got[1].tolist() == pytest.approx([0.0, 0.0, 1.0, 0.0])  # at least the most probable token


def _drawn_by_steps(ops, x: torch.Tensor, t: torch.Tensor, k: int, top_p: torch.Tensor, u: torch.Tensor):
    """What draw_top_k fuses, by its parts: scan_rows with tails, candidate_probs, and
    sampling.sample's inverse CDF over the candidates with the same uniforms."""
    from specav.token_probs import TokenProbs
    from specav.verification import sampling

    values, indices, _, _, second, tail, moment = ops.scan_rows(x, t, k, True)
    ids, probs = ops.candidate_probs(values, indices, top_p)
    tokens = sampling.sample(TokenProbs(probs, ids, x.shape[1]), [None] * len(x), u.tolist())
    return ids, probs, tokens, second - values[:, 0], tail, moment


def test_native_draw_equals_its_parts_bit_for_bit(native_ops):
    """On vocabulary rows: the same candidates, probabilities, tokens and tails as the three calls it
    fuses, and rows it cannot answer (no distribution, a tie at the k-th value beyond k) flagged."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 151_936, generator=g) * 3
    x[2, 7] = float("nan")
    x[3, :] = -float("inf")
    x[4, [10, 20, 30]] = 40.0  # the 2nd and 3rd largest tie: k = 2 cuts through them
    t = torch.tensor([0.7, 1.0, 0.7, 0.7, 0.7, 1.3, 0.05, 0.7])  # float32: the lists below carry their roundings
    top_p = torch.tensor([0.8, 1.0, 0.8, 0.8, 0.8, 0.3, 0.9, 0.999])
    u = torch.rand(8, generator=g, dtype=torch.float64)
    u[7] = 1.0 - 2**-53  # u * total can round up to the total
    for k in (2, 20, 64):
        ids, probs, tokens, ok, gap, tail, moment = native_ops.draw_top_k(x, t.tolist(), k, top_p.tolist(), u.tolist())
        assert ok.tolist() == [True, True, False, False, k != 2, True, True, True]
        ref = _drawn_by_steps(native_ops, x[ok], t[ok], k, top_p[ok], u[ok])
        for got, want in zip((ids[ok], probs[ok], tokens[ok], gap[ok], tail[ok], moment[ok]), ref):
            assert torch.equal(got, want)
        same_ids, same_probs, same_ok = native_ops.top_k_probs(x, t.tolist(), k, top_p.tolist())  # no draw, no tails
        assert torch.equal(same_ok, ok) and torch.equal(same_ids[ok], ids[ok]) and torch.equal(same_probs[ok], probs[ok])
        assert bool((probs[ok].gather(1, (ids[ok] == tokens[ok, None]).int().argmax(1, keepdim=True)) > 0).all())


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), v=st.integers(3, 3000), data=st.data())
def test_native_draw_equals_its_parts_on_any_shape(rows, v, data):
    if not native.available():
        pytest.skip(native.unavailable_reason())
    ops = native.ops()
    k = data.draw(st.integers(1, min(v - 1, 64)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, v, generator=g) * data.draw(st.sampled_from([0.1, 3.0, 30.0]))
    if data.draw(st.booleans()):
        x = (x * 2).round() / 2  # ties
    t = torch.tensor(data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=rows, max_size=rows)))
    top_p = torch.tensor(data.draw(st.lists(st.sampled_from([0.1, 0.5, 0.8, 1.0]), min_size=rows, max_size=rows)))
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    ids, probs, tokens, ok, gap, tail, moment = ops.draw_top_k(x, t.tolist(), k, top_p.tolist(), u.tolist())
    assert torch.equal(ok, ops.scan_rows(x, t, k, False)[2] == k)  # untied (every row here has a distribution)
    ref = _drawn_by_steps(ops, x[ok], t[ok], k, top_p[ok], u[ok])
    for got, want in zip((ids[ok], probs[ok], tokens[ok], gap[ok], tail[ok], moment[ok]), ref):
        assert torch.equal(got, want)
