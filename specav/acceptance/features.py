"""Slot features: numbers computed from the drafter's logits at one slot alone.

This module owns the feature functions and their registry (`FEATURES`), including
which features are lossless. A feature used to trim slots must be a function of the
drafter's logits at slot i alone, never of the draft token x_i (architecture.md,
lossless rules); `q_sampled` = q_i(x_i) breaks that rule and is kept only for logging
and evaluation.

Inputs. The logit features take the drafter's logits after the request's temperature
only, over the full vocabulary, before top-k / top-p truncation (estimator.md): the
caller passes logits already divided by the temperature, and raw logits for greedy
rows. Masked vocabulary entries may be -inf.

Shapes: `# [N, V]` logits give `# [N]` features; any leading shape works (`[B, K, V]`
gives `[B, K]`). float64 inputs are computed in float64, everything else in float32.

Edge cases (all features): a row with no finite logit (every entry -inf) has no
distribution and gives NaN; NaN logits give NaN. A row with a single finite entry
(or V = 1) has q_max = 1, so logit(q_max) is +clamp.

This module must not know about estimators, planners, models or the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from specav.token_probs import TokenProbs
from specav.topk import Tails, row_tails

DEFAULT_CLAMP = 40.0  # EstimatorConfig.feature_clamp's default


class LossyFeatureError(ValueError):
    """A feature that depends on the draft token was asked for where trimming needs a lossless one."""


def _as_float(logits: torch.Tensor) -> torch.Tensor:
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [N, V] with V >= 1, got {tuple(logits.shape)}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.to(dtype)


def _no_distribution(z: torch.Tensor) -> torch.Tensor:
    """Rows with no finite logit (all -inf) or with a NaN logit.  # [N, V] -> [N]"""
    return (z == -math.inf).all(-1) | torch.isnan(z).any(-1)


def logit_q_max(logits: torch.Tensor, clamp: float = DEFAULT_CLAMP) -> torch.Tensor:
    """logit(q_max) = z_max - logsumexp(z without its max entry), clamped to [-clamp, clamp].

    logits: # [N, V] temperature-scaled, untruncated -> # [N]

    Computed without forming 1 - q_max, so it stays exact when q_max is within 1e-30 of 1
    and for logits of any magnitude. Only the argmax entry is removed, so a tie for the
    maximum gives logit(q_max) <= 0 as it should. +inf logits: the distribution is uniform
    over them, so c of them give logit(1/c) = -log(c - 1).
    """
    z = _as_float(logits)
    top, idx = z.max(dim=-1, keepdim=True)
    # Shift first: z - z_max is exact for nearby entries, so huge logits lose nothing.
    f = -torch.logsumexp((z - top).scatter(-1, idx, -math.inf), dim=-1)  # +inf: one finite entry
    num_posinf = (z == math.inf).sum(-1)
    f = torch.where(num_posinf > 0, -torch.log((num_posinf - 1).to(z.dtype)), f)
    f = f.clamp(-clamp, clamp)
    return torch.where(_no_distribution(z), math.nan, f)


def q_max(logits: torch.Tensor) -> torch.Tensor:
    """Largest probability of softmax(logits).  # [N, V] -> [N]"""
    z = _as_float(logits)
    q = torch.softmax(z, dim=-1).amax(dim=-1)
    return torch.where(_no_distribution(z), math.nan, q)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits); masked (-inf) entries contribute 0.  # [N, V] -> [N]"""
    z = _as_float(logits)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    h = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    return torch.where(_no_distribution(z), math.nan, h)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """q_max - q_2nd in probability (q_2nd = 0 when V = 1).  # [N, V] -> [N]"""
    z = _as_float(logits)
    p = torch.softmax(z, dim=-1)
    top = p.topk(min(2, p.shape[-1]), dim=-1).values
    second = top[..., 1] if top.shape[-1] > 1 else torch.zeros_like(top[..., 0])
    return torch.where(_no_distribution(z), math.nan, top[..., 0] - second)


def q_sampled(probs: torch.Tensor | TokenProbs, token_ids: torch.Tensor) -> torch.Tensor:
    """q_i(x_i): the drafter's probability of its own draft token. LOSSY: never trim on it.

    probs: # [N, V] q_i after temperature / top-k / top-p, or those N rows as a TokenProbs;
    token_ids: # [N] int, -1 for padding -> # [N] (NaN at padding).
    """
    if isinstance(probs, TokenProbs):
        if (len(probs),) != tuple(token_ids.shape):
            raise ValueError(f"probs has {len(probs)} rows and token_ids shape {tuple(token_ids.shape)}; "
                             "they must agree ([N] tokens for N rows)")
    elif probs.shape[:-1] != token_ids.shape:
        raise ValueError(f"probs {tuple(probs.shape)} and token_ids {tuple(token_ids.shape)} "
                         "must agree on the leading shape ([N, V] and [N])")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    pad = token_ids < 0
    if isinstance(probs, TokenProbs):
        picked = probs.at(token_ids.clamp(min=0).long())
        picked = picked if picked.dtype == torch.float64 else picked.float()
    else:
        picked = _as_float(probs).gather(-1, token_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(pad, math.nan, picked)


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """One registered feature.

    inputs names the arguments `function` takes, among "logits" (temperature-scaled,
    untruncated), "probs" (q_i) and "token_ids" (x_i). lossless is False exactly when
    the feature reads the draft token.
    """

    name: str
    function: Callable[..., torch.Tensor]
    lossless: bool
    inputs: tuple[str, ...]
    description: str


FEATURES: dict[str, FeatureSpec] = {
    s.name: s
    for s in (
        FeatureSpec("logit_q_max", logit_q_max, True, ("logits",),
                    "log-odds of the drafter's largest probability (the estimator's feature)"),
        FeatureSpec("q_max", q_max, True, ("logits",), "the drafter's largest probability"),
        FeatureSpec("entropy", entropy, True, ("logits",), "entropy of q_i in nats"),
        FeatureSpec("top2_margin", top2_margin, True, ("logits",),
                    "largest minus second-largest probability"),
        FeatureSpec("q_sampled", q_sampled, False, ("probs", "token_ids"),
                    "q_i(x_i), the probability of the draft token (lossy)"),
    )
}


def require_lossless(name: str) -> FeatureSpec:
    """Return the registered feature `name`, refusing one that may not be used for trimming."""
    spec = FEATURES.get(name)
    if spec is None:
        raise ValueError(f"unknown feature {name!r}; registered features: {sorted(FEATURES)}")
    if not spec.lossless:
        allowed = sorted(n for n, s in FEATURES.items() if s.lossless)
        raise LossyFeatureError(
            f"feature {name!r} depends on the draft token x_i, so admitting slot i by it would "
            "make verification depend on x_i and rejection sampling would no longer reproduce "
            "the target's distribution (architecture.md, lossless rules). Log and evaluate it, "
            f"but trim on a lossless feature: {allowed}")
    return spec


@dataclass(frozen=True, slots=True)
class SlotFeatures:
    """Every registered feature for N slots, each # [N]."""

    logit_q_max: torch.Tensor
    q_max: torch.Tensor
    entropy: torch.Tensor
    top2_margin: torch.Tensor
    q_sampled: torch.Tensor  # lossy: evaluation only


def compute_slot_features(logits: torch.Tensor, probs: torch.Tensor | TokenProbs, token_ids: torch.Tensor,
                          clamp: float = DEFAULT_CLAMP) -> SlotFeatures:
    """All features of N slots, in a few passes over the vocabulary.

    logits: # [N, V] temperature-scaled, untruncated; probs: # [N, V] q_i (truncated), or its N rows
    as a TokenProbs;
    token_ids: # [N] draft tokens, -1 for padding.

    The four logit features come from the rows' Tails (`features_from_tails`); rows the shared form
    cannot take (a NaN, a +inf, no finite logit) use the functions above.
    """
    shape = (len(probs), probs.vocab) if isinstance(probs, TokenProbs) else tuple(probs.shape)
    if tuple(logits.shape) != shape:
        raise ValueError(f"logits {tuple(logits.shape)} and probs {shape} must have the same shape [N, V]")
    z = _as_float(logits)
    features = features_from_tails(row_tails(z), probs, token_ids, clamp)
    special = ~torch.isfinite(z.amax(-1))  # [N]: a NaN, a +inf or no finite logit (amax propagates NaN)
    if bool(special.any()):
        z_special = logits[special]
        for name, reference in (("logit_q_max", lambda x: logit_q_max(x, clamp)), ("q_max", q_max),
                                ("entropy", entropy), ("top2_margin", top2_margin)):
            getattr(features, name)[special] = reference(z_special).to(getattr(features, name).dtype)
    return features


def row_features(tail: float, moment: float, gap: float, clamp: float = DEFAULT_CLAMP
                 ) -> tuple[float, float, float, float]:
    """logit(q_max), q_max, entropy and the top-2 margin of one row from its Tails' three numbers
    (S = tail, moment, gap), in Python floats: the one place their formulas live.

    With m the largest logit and S = sum over the other entries of exp(z - m): q_max = 1 / (1 + S),
    logit(q_max) = -log S clamped to [-clamp, clamp] (S = 0, one finite logit: +clamp), entropy =
    log(1 + S) - sum_j exp(z_j - m) (z_j - m) / (1 + S), and the top-2 margin (1 - exp(z_2 - m)) /
    (1 + S). Only the argmax entry is left out of S, as in logit_q_max. NaN in, NaN out; rows whose
    logits held NaN or +inf are meaningless here. Python floats rather than tensors: the drafter
    computes a few rows per slot, where each torch op costs tens of microseconds on the caches a
    forward leaves cold; float64 throughout, as exact as the float64 sums they read.
    """
    total = 1.0 + tail
    logit = -math.log(tail) if tail > 0 else (math.inf if tail == 0 else math.nan)
    return (min(max(logit, -clamp), clamp),  # NaN stays NaN (min / max return their first argument)
            1.0 / total,
            math.log1p(tail) - moment / total,
            (1.0 - math.exp(min(gap, 0.0))) / total)


def features_from_tails(tails: Tails, probs: torch.Tensor | TokenProbs, token_ids: torch.Tensor,
                        clamp: float = DEFAULT_CLAMP) -> SlotFeatures:
    """Every feature of N slots from their Tails (row_features, row by row) and q_i for q_sampled;
    each # [N] in the dtype of tails.gap."""
    rows = [row_features(*values, clamp) for values in
            zip(tails.tail.tolist(), tails.moment.tolist(), tails.gap.tolist())]
    columns = list(zip(*rows)) if rows else [()] * 4
    dtype = tails.gap.dtype
    return SlotFeatures(*(torch.tensor(c, dtype=torch.float64).to(dtype) for c in columns),
                        q_sampled=q_sampled(probs, token_ids))
