"""The plan stage's contract: how far each request drafts, and which drafted slots the target verifies.

Owns: the `Planner` protocol, the registry the engine picks a planner from by config
(`SpeculativeConfig.planner`: "static" or "adaptive"), the `DraftPlan` a planner hands the
drafter, and the static planner (classic speculative decoding with a fixed K).

A planner makes three decisions per step, in this order, and every one of them must obey the
lossless rules of architecture.md (whether slot i is drafted or admitted may depend on
q_1..q_i, x_1..x_{i-1} of its request, anything of other requests and of earlier steps, and
never on x_i or on anything computed from it):

    draft_plan   before drafting: the most slots each request may draft (0 = it does not draft
                 this step) and a stop rule the drafter consults after every slot
    plan         after scoring: how many of each request's drafted slots are admitted (a prefix)
    observe      after the step: what was measured (times, outcomes), for the next decisions

Must not know: models, the rejection sampler, the server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from specav.drafting.base import StopRule
from specav.request import Request
from specav.types import DraftBatch, Plan, Scores, StepRecord
from specav.types import attended as _attended


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What a request costs the two stages before any slot is added."""

    pending: int  # tokens the target verifies whatever is admitted (its pending tokens)
    context: int  # positions cached in the target
    draft_pending: int = 1  # tokens the drafter's first forward would feed (a catch-up when > 2)

    def attended(self, slots: int = 0) -> int:
        """Key positions the target's forward attends to for this request with `slots` admitted."""
        return _attended(self.pending + slots, self.context)

    @property
    def slot_attended(self) -> int:
        """What one more verified slot (or drafted row) of this request attends to (about)."""
        return self.context + self.pending

    @property
    def draft_context(self) -> int:
        """Positions cached in the drafter (it lags the target by the tokens it has still to feed)."""
        return max(0, self.context + self.pending - self.draft_pending)


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """What the planner decided before drafting."""

    num_slots: list[int]  # per request, the most slots it may draft this step (0: no draft)
    stop_rule: StopRule | None = None  # None: every request drafts num_slots[b] slots
    explore: torch.Tensor | None = None  # [B] bool, requests that draft and verify their whole block (None: none)
    price: float = math.nan  # tokens per second a second of compute must buy (the planner's lambda)
    shapes: tuple[RequestShape, ...] = ()  # the batch's requests before any slot (what verifying them costs)
    # per request, why it may draft: "static", "rule", "probe", "explore", "cold start" ("": it does
    # not draft); the stats count the slots each reason bought (EngineStats.by_reason)
    reasons: tuple[str, ...] = ()

    @property
    def pending_tokens(self) -> int:
        """Tokens the target verifies before any slot is admitted."""
        return sum(s.pending for s in self.shapes)


class Planner(Protocol):
    name: str
    uses_confidences: bool  # True: it trims on the scorer's confidences, which must then be lossless

    def draft_plan(self, requests: Sequence[Request], max_slots: Sequence[int],
                   shapes: Sequence[RequestShape]) -> DraftPlan: ...

    def plan(self, drafts: DraftBatch, scores: Scores, draft_plan: DraftPlan) -> Plan: ...

    def observe(self, record: StepRecord) -> None: ...

    def release(self, request: Request) -> None: ...


PLANNERS: dict[str, Callable[..., Planner]] = {}


def register(name: str):
    def wrap(factory):
        PLANNERS[name] = factory
        return factory
    return wrap


def make_planner(name: str, **kwargs) -> Planner:
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}; available: {sorted(PLANNERS)}")
    return PLANNERS[name](**kwargs)


@register("static")
class StaticPlanner:
    """Classic speculative decoding: every request drafts K slots (fewer near max_tokens), all verified."""

    name = "static"
    uses_confidences = False

    def __init__(self, **_: object) -> None:
        pass

    def draft_plan(self, requests: Sequence[Request], max_slots: Sequence[int],
                   shapes: Sequence[RequestShape]) -> DraftPlan:
        return DraftPlan(list(max_slots), reasons=tuple("static" if m else "" for m in max_slots))

    def plan(self, drafts: DraftBatch, scores: Scores, draft_plan: DraftPlan) -> Plan:
        return Plan.of(drafts, drafts.num_drafted)

    def observe(self, record: StepRecord) -> None:
        pass

    def release(self, request: Request) -> None:
        pass
