"""One Scorer protocol for every source of slot confidences, and the factory that picks one.

This module owns the contract the engine uses (`score` before planning, `observe` after
verification) and the rule for choosing: a confidence head the drafter provides wins,
otherwise the online estimator. It must not know about models, the planner or the engine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specav.acceptance.estimator import OnlineAcceptanceEstimator
from specav.config import EstimatorConfig


@runtime_checkable
class Scorer(Protocol):
    """Turns slot features into confidences and learns from verification outcomes.

    score: features # [B, K] (NaN for undrafted slots) -> confidences # [B, K] in [0, 1].
    observe: the same features # [B, K], num_admitted # [B] int, num_accepted # [B] int.
    """

    name: str

    def score(self, features: torch.Tensor) -> torch.Tensor: ...

    def observe(self, features: torch.Tensor, num_admitted: torch.Tensor,
                num_accepted: torch.Tensor) -> None: ...


def make_scorer(num_slots: int, config: EstimatorConfig = EstimatorConfig(),
                head: Scorer | None = None) -> Scorer:
    """The drafter's confidence head if it provides one, else an online estimator over K slots."""
    if head is None:
        return OnlineAcceptanceEstimator(num_slots, config)
    if not isinstance(head, Scorer):
        raise TypeError(f"head {type(head).__name__} does not satisfy the Scorer protocol: it needs "
                        "a `name` and methods score(features) and observe(features, num_admitted, "
                        "num_accepted); pass head=None to use the online estimator")
    return head
