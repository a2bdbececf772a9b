"""The Drafter protocol and the registry of drafting methods.

Owns: the contract between the engine and any drafter. A drafter proposes up to
`num_slots[b]` draft tokens for each request, returning for every drafted slot the token,
its processed distribution q_i and its features, and afterwards keeps its own state in
sync with what verification kept. An autoregressive drafter may stop a request early: after
each slot it asks a `StopRule` (given by whoever plans the step) which requests go on; the
rule sees the features of the slot just drafted, never the estimator behind it.

Must not know: the target model, rejection sampling, the estimator or the planner.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from specav.request import Request
from specav.types import AcceptResult, DraftBatch


class StopRule(Protocol):
    """Decides, slot by slot, which requests keep drafting."""

    def keep_drafting(self, slot: int, rows: Sequence[int], features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Slot `slot` (0-based) was just drafted for batch rows `rows`, with these features of it
        (each # [A]); returns which of them draft slot + 1 (# [A] bool). Requests that reached
        their num_slots stop whatever it says."""
        ...


class Drafter(Protocol):
    name: str
    # Seconds its next drafting `propose` will spend before any forward (a deferred drafter's load:
    # drafting/deferred.py), 0.0 once it is ready; a planner prices it like a catch-up.
    setup_seconds: float

    def propose(self, requests: Sequence[Request], num_slots: Sequence[int],
                stop_rule: StopRule | None = None) -> DraftBatch:
        """Draft up to num_slots[b] tokens for request b (0 = none this step), stopping a request
        early where stop_rule says so; DraftBatch.forwards records each forward's shape, and
        DraftBatch.setup_seconds the time spent getting ready (a deferred load), not drafting."""
        ...

    def pending_tokens(self, requests: Sequence[Request]) -> list[int]:
        """Per request, the tokens its first drafting forward would feed: what the drafter has not
        seen yet (the whole prompt for a new request, the skipped tokens for one that resumes)."""
        ...

    def commit(self, requests: Sequence[Request], drafts: DraftBatch, result: AcceptResult) -> None:
        """Sync state with verification: request b kept result.num_accepted[b] draft tokens, then
        emitted result.output_tokens[b][-1] (a recovered or bonus token)."""
        ...

    def release(self, request: Request) -> None:
        """Forget a finished request."""
        ...


DRAFTERS: dict[str, Callable[..., Drafter]] = {}


def register(name: str):
    def wrap(factory):
        DRAFTERS[name] = factory
        return factory
    return wrap


def make_drafter(method: str, **kwargs) -> Drafter:
    if method not in DRAFTERS:
        raise ValueError(f"unknown drafting method {method!r}; available: {sorted(DRAFTERS)}")
    return DRAFTERS[method](**kwargs)


class NoDrafter:
    """Target-only decoding: drafts nothing, so every step verifies just the bonus token."""

    name = "none"
    setup_seconds = 0.0

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, requests: Sequence[Request], num_slots: Sequence[int],
                stop_rule: StopRule | None = None) -> DraftBatch:
        return DraftBatch.empty(len(requests), self.vocab_size)

    def pending_tokens(self, requests: Sequence[Request]) -> list[int]:
        return [0] * len(requests)

    def commit(self, requests: Sequence[Request], drafts: DraftBatch, result: AcceptResult) -> None:
        pass

    def release(self, request: Request) -> None:
        pass
