"""The score stage: one Scorer protocol for every source of slot confidences.

This module owns the contract the engine uses (`score` before planning, `observe` after
verification), the rule for choosing a scorer (a confidence head the drafter provides wins,
otherwise the online estimator), and the score stage itself: a step's drafts -> confidence and
survival of every slot. A scorer declares the feature it reads, so whoever trims on its
confidences can refuse a lossy one (`features.require_lossless`).

It must not know about models, the planner or the engine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specav.acceptance.estimator import OnlineAcceptanceEstimator, survival
from specav.config import EstimatorConfig
from specav.types import DraftBatch, Scores


@runtime_checkable
class Scorer(Protocol):
    """Turns slot features into confidences and learns from verification outcomes.

    feature: the name of the slot feature it reads (a key of `DraftBatch.features`).
    version: changes whenever `score`'s mapping may have changed (a head that does not learn keeps
        one); what scores features once and keeps the confidences (the planner's past blocks)
        scores them again when it changes.
    score: features # [B, K] (NaN for undrafted slots) -> confidences # [B, K] in [0, 1].
    observe: the same features # [B, K], num_admitted # [B] int, num_accepted # [B] int.
    """

    name: str
    feature: str
    version: int

    def score(self, features: torch.Tensor) -> torch.Tensor: ...

    def observe(self, features: torch.Tensor, num_admitted: torch.Tensor,
                num_accepted: torch.Tensor) -> None: ...


def slot_features(drafts: DraftBatch, feature: str, num_slots: int) -> torch.Tensor:
    """The named feature of every slot, NaN-padded to K columns # [B, K]."""
    f = drafts.features.get(feature)
    if f is None:
        f = torch.zeros(len(drafts.layout), 0)
    return torch.nn.functional.pad(f, (0, num_slots - f.shape[1]), value=float("nan"))


def score_drafts(scorer: Scorer, drafts: DraftBatch, num_slots: int) -> Scores:
    """Confidence and survival of every drafted slot (NaN for the others, without asking the scorer
    in a step that drafted nothing: most steps where drafts do not pay, at concurrency 1)."""
    if not drafts.layout.total:
        nothing = torch.full((len(drafts.layout), num_slots), float("nan"), dtype=torch.float64)
        return Scores(nothing, nothing, nothing)
    features = slot_features(drafts, scorer.feature, num_slots)
    confidences = scorer.score(features)
    return Scores(features, confidences, survival(confidences))


def make_scorer(num_slots: int, config: EstimatorConfig = EstimatorConfig(),
                head: Scorer | None = None) -> Scorer:
    """The drafter's confidence head if it provides one, else an online estimator over K slots."""
    if head is None:
        return OnlineAcceptanceEstimator(num_slots, config)
    if not isinstance(head, Scorer):
        raise TypeError(f"head {type(head).__name__} does not satisfy the Scorer protocol: it needs "
                        "`name`, `feature` and `version` attributes and methods score(features) and "
                        "observe(features, num_admitted, num_accepted); pass head=None to use the "
                        "online estimator")
    return head
