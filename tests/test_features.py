"""Slot features: hand cases, a naive float64 reference, stability, properties, the registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specav.acceptance.features import (
    FEATURES,
    LossyFeatureError,
    SlotFeatures,
    compute_slot_features,
    entropy,
    logit_q_max,
    q_max,
    q_sampled,
    require_lossless,
    top2_margin,
)

INF = math.inf


def naive(logits: np.ndarray) -> dict[str, np.ndarray]:
    """Textbook float64 formulas; accurate only for moderate logits."""
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    top = np.sort(p, -1)[:, ::-1]
    q = top[:, 0]
    return {"logit_q_max": np.log(q) - np.log1p(-q), "q_max": q,
            "entropy": -(p * np.log(p)).sum(-1), "top2_margin": top[:, 0] - top[:, 1]}


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ---- hand cases -------------------------------------------------------------------------

def test_logit_q_max_hand_cases():
    z = t64([[0.0, 0.0, -INF, -INF], [2.0, 0.0, -INF, -INF], [math.log(3), 0.0, 0.0, -INF],
             [1.0, 1.0, 1.0, 1.0]])
    expected = [0.0, 2.0, math.log(3) - math.log(2), -math.log(3)]
    torch.testing.assert_close(logit_q_max(z), t64(expected), rtol=0, atol=1e-12)


def test_other_features_hand_cases():
    z = t64([[0.0, 0.0], [math.log(3), 0.0]])  # p = (1/2, 1/2), (3/4, 1/4)
    torch.testing.assert_close(q_max(z), t64([0.5, 0.75]))
    torch.testing.assert_close(top2_margin(z), t64([0.0, 0.5]))
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    torch.testing.assert_close(entropy(z), t64([math.log(2), h2]))


def test_tie_for_the_maximum_removes_only_one_entry():
    assert logit_q_max(t64([[5.0, 5.0, -INF]])).item() == pytest.approx(0.0, abs=1e-12)


def test_q_sampled_picks_the_draft_token_and_nan_for_padding():
    probs = t64([[0.1, 0.7, 0.2], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    out = q_sampled(probs, torch.tensor([2, 0, -1]))
    assert out[:2].tolist() == [0.2, 0.5] and math.isnan(out[2])


def test_q_sampled_rejects_bad_inputs():
    with pytest.raises(ValueError, match="leading shape"):
        q_sampled(torch.ones(3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        q_sampled(torch.ones(3, 4), torch.zeros(3))


# ---- against a naive float64 computation ------------------------------------------------

@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_features_match_naive_float64(dtype, atol):
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 3.0, size=(64, 50))
    z[:8, 3] += 15.0  # some confident rows
    ref = naive(z)
    zt = torch.from_numpy(z).to(dtype)
    for name, fn in (("logit_q_max", logit_q_max), ("q_max", q_max), ("entropy", entropy),
                     ("top2_margin", top2_margin)):
        got = fn(zt).double().numpy()
        np.testing.assert_allclose(got, ref[name], rtol=1e-4 if dtype == torch.float32 else 1e-9,
                                   atol=atol, err_msg=name)


def test_leading_dimensions_are_kept():
    z = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1))
    assert logit_q_max(z).shape == (2, 3)
    torch.testing.assert_close(logit_q_max(z), logit_q_max(z.reshape(6, 7)).reshape(2, 3))


def test_half_precision_is_computed_in_float32():
    z = torch.tensor([[3.0, 1.0, 0.5]], dtype=torch.bfloat16)
    out = logit_q_max(z)
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(logit_q_max(z.float()).item())


# ---- stability ----------------------------------------------------------------------------

def test_huge_and_very_negative_logits():
    z = t64([[1e4, 1e4 - 1.0, 1e4 - 3.0],
             [-1e4, -1e4 - 2.0, -1e4 - 2.0],
             [1e4, 0.0, -1e4]])
    expected = [1.0 - math.log(1 + math.exp(-2.0)), 2.0 - math.log(2.0), 40.0]
    torch.testing.assert_close(logit_q_max(z), t64(expected))
    torch.testing.assert_close(logit_q_max(z.float()), t64(expected).float())
    for fn in (q_max, entropy, top2_margin):
        assert torch.isfinite(fn(z)).all() and torch.isfinite(fn(z.float())).all()


def test_q_max_near_one_keeps_its_log_odds():
    # 1 - q_max = e^-30 is below float32 resolution; the log-odds must still be 30, not the clamp.
    z = torch.tensor([[30.0, 0.0], [35.0, 0.0]])
    torch.testing.assert_close(logit_q_max(z), torch.tensor([30.0, 35.0]))
    assert logit_q_max(torch.tensor([[50.0, 0.0]])).item() == 40.0
    assert logit_q_max(torch.tensor([[50.0, 0.0]]), clamp=5.0).item() == 5.0
    assert logit_q_max(torch.tensor([[0.0, 50.0, 50.0, 50.0]]), clamp=0.5).item() == -0.5


def test_masked_vocabulary():
    z = t64([[-INF, 3.0, 1.0, -INF], [5.0, -INF, -INF, -INF], [-INF, -INF, -INF, -INF]])
    f = logit_q_max(z)
    assert f[0].item() == pytest.approx(2.0) and f[1].item() == 40.0 and math.isnan(f[2])
    assert entropy(z)[1].item() == 0.0 and q_max(z)[1].item() == 1.0
    assert top2_margin(z)[1].item() == 1.0
    assert entropy(z)[0].item() == pytest.approx(naive(np.array([[3.0, 1.0]]))["entropy"][0])
    assert all(math.isnan(fn(z)[2]) for fn in (q_max, entropy, top2_margin))


def test_vocab_of_one_and_two():
    assert logit_q_max(t64([[7.0]])).item() == 40.0
    assert top2_margin(t64([[7.0]])).item() == 1.0
    assert logit_q_max(t64([[-3.0, 4.0]])).item() == pytest.approx(7.0)


def test_positive_infinity_and_nan():
    z = t64([[INF, 0.0, 0.0], [INF, INF, INF], [math.nan, 1.0, 0.0]])
    f = logit_q_max(z)
    assert f[0].item() == 40.0 and f[1].item() == pytest.approx(-math.log(2)) and math.isnan(f[2])


def test_empty_vocab_is_an_error():
    with pytest.raises(ValueError, match="V >= 1"):
        logit_q_max(torch.zeros(3, 0))


# ---- properties ---------------------------------------------------------------------------

rows = st.lists(st.floats(-50, 50), min_size=2, max_size=40)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rows, st.floats(1e-3, 20.0))
def test_monotone_in_the_max_logit(row, bump):
    z = t64([row])
    higher = z.clone()
    higher[0, int(z.argmax())] += bump
    assert logit_q_max(higher).item() >= logit_q_max(z).item() - 1e-12


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rows, st.floats(-1e3, 1e3))
def test_invariant_to_a_constant_shift(row, shift):
    z = t64([row])
    assert logit_q_max(z + shift).item() == pytest.approx(logit_q_max(z).item(), abs=1e-9)
    assert entropy(z + shift).item() == pytest.approx(entropy(z).item(), abs=1e-9)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(rows)
def test_logit_q_max_is_the_log_odds_of_q_max(row):
    z = t64([row])
    f, q = logit_q_max(z).item(), q_max(z).item()
    if abs(f) < 30:
        assert 1 / (1 + math.exp(-f)) == pytest.approx(q, rel=1e-9)
    assert -40.0 <= f <= 40.0


# ---- registry -----------------------------------------------------------------------------

def test_registry_marks_only_q_sampled_lossy():
    assert {n for n, s in FEATURES.items() if not s.lossless} == {"q_sampled"}
    assert "token_ids" in FEATURES["q_sampled"].inputs
    assert all("token_ids" not in s.inputs for s in FEATURES.values() if s.lossless)
    assert require_lossless("logit_q_max").function is logit_q_max


def test_require_lossless_explains_the_refusal():
    with pytest.raises(LossyFeatureError, match="draft token") as info:
        require_lossless("q_sampled")
    assert isinstance(info.value, ValueError) and "logit_q_max" in str(info.value)
    with pytest.raises(ValueError, match="registered features"):
        require_lossless("nope")


def test_compute_slot_features_agrees_with_the_functions():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 11, generator=g) * 2
    probs = torch.softmax(logits, -1)
    tokens = torch.tensor([0, 3, 10, -1, 5, 5])
    out = compute_slot_features(logits, probs, tokens, clamp=3.0)
    assert isinstance(out, SlotFeatures)
    torch.testing.assert_close(out.logit_q_max, logit_q_max(logits, 3.0))
    torch.testing.assert_close(out.entropy, entropy(logits))
    torch.testing.assert_close(out.q_sampled, q_sampled(probs, tokens), equal_nan=True)
    for name in FEATURES:
        assert getattr(out, name).shape == (6,)
    with pytest.raises(ValueError, match="same shape"):
        compute_slot_features(logits, probs[:, :5], tokens)


special = st.sampled_from([-INF, INF, math.nan, 60.0, -60.0, 0.0])
slot_rows = st.lists(st.floats(-45, 45, width=32) | special, min_size=1, max_size=24)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(slot_rows, min_size=1, max_size=5).filter(lambda r: len({len(x) for x in r}) == 1),
       st.sampled_from([torch.float32, torch.float64]))
def test_compute_slot_features_shared_pass_equals_each_function(batch, dtype):
    """The shared few-pass computation against the one-feature functions: masked entries, huge
    logits, ties, q_max within 1e-30 of 1, +inf and NaN rows, V = 1."""
    logits = torch.tensor(batch, dtype=dtype)
    probs = torch.full_like(logits, 1.0 / logits.shape[1])
    out = compute_slot_features(logits, probs, torch.zeros(len(batch), dtype=torch.int64))
    tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    for name, reference in (("logit_q_max", logit_q_max), ("q_max", q_max), ("entropy", entropy),
                            ("top2_margin", top2_margin)):
        torch.testing.assert_close(getattr(out, name), reference(logits), equal_nan=True, **tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_compute_slot_features_on_a_large_vocabulary():
    logits = torch.randn(4, 151_936, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, 7] = 60.0  # q_max ~ 1 - 1e-20: logit(q_max) at the clamp
    logits[2, 100:] = -INF  # a masked vocabulary
    out = compute_slot_features(logits, torch.softmax(logits, -1), torch.tensor([0, 7, 3, 9]))
    for name, reference in (("logit_q_max", logit_q_max), ("q_max", q_max), ("entropy", entropy),
                            ("top2_margin", top2_margin)):
        torch.testing.assert_close(getattr(out, name), reference(logits), atol=2e-5, rtol=1e-4)
