"""A drafter loaded when a plan first drafts, not when the engine starts.

Owns: deferring the load of another drafter until the first `propose` that drafts a slot, and
standing in for it until then (drafting nothing, keeping nothing: a drafter that first sees a
request catches up on its whole sequence, draft_model.py). Under adaptive verification a
request drafts only where drafting is predicted to pay, and a run whose traffic never pays
would otherwise load a drafter it never uses (about 7 s of a 60 s `specav generate` on the
AMD EPYC, docs/adaptive.md). Until it is loaded, `setup_seconds` is the load's expected time
(measured at an earlier load on this machine), which the planner prices into the first draft
like a catch-up; the load itself goes to `DraftBatch.setup_seconds`, so the step's draft stage,
which the cost model learns from, does not count it.

Must not know: the planner, the estimator, how the inner drafter is built.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from specav.drafting.base import Drafter, NoDrafter, StopRule
from specav.request import Request
from specav.types import AcceptResult, DraftBatch


class DeferredDrafter:
    def __init__(self, load: Callable[[], Drafter], name: str, vocab_size: int, expected_seconds: float,
                 max_positions: int | None = None, on_load: Callable[[float], None] | None = None) -> None:
        """load: builds the drafter (called once); expected_seconds: what that is expected to take;
        max_positions: the drafter model's positions, read without loading it (None: unknown);
        on_load(seconds): told what the load took (to keep the next expectation current)."""
        self.name = name
        self.max_positions = max_positions
        self.load_seconds: float | None = None  # what the load took, once it has happened
        self._load, self._on_load = load, on_load
        self._expected = expected_seconds
        self._drafter: Drafter | None = None
        self._idle = NoDrafter(vocab_size)

    @property
    def loaded(self) -> bool:
        return self._drafter is not None

    @property
    def setup_seconds(self) -> float:
        return 0.0 if self._drafter is not None else self._expected

    def propose(self, requests: Sequence[Request], num_slots: Sequence[int],
                stop_rule: StopRule | None = None) -> DraftBatch:
        if self._drafter is not None:
            return self._drafter.propose(requests, num_slots, stop_rule)
        if not any(n > 0 for n in num_slots):
            return self._idle.propose(requests, num_slots)
        start = time.perf_counter()
        drafter = self._load()
        self.load_seconds = time.perf_counter() - start
        self._drafter = drafter
        if self._on_load is not None:
            self._on_load(self.load_seconds)
        drafts = drafter.propose(requests, num_slots, stop_rule)
        drafts.setup_seconds += self.load_seconds
        return drafts

    def pending_tokens(self, requests: Sequence[Request]) -> list[int]:
        if self._drafter is not None:
            return self._drafter.pending_tokens(requests)
        return [r.num_tokens for r in requests]  # all of it: nothing was fed

    def commit(self, requests: Sequence[Request], drafts: DraftBatch, result: AcceptResult) -> None:
        if self._drafter is not None:
            self._drafter.commit(requests, drafts, result)

    def release(self, request: Request) -> None:
        if self._drafter is not None:
            self._drafter.release(request)
