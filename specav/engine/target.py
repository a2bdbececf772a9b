"""The verify stage: one packed target forward over every request's new tokens.

Owns: the target's KV caches and pending tokens per request, the packed forward over
"pending tokens + admitted draft tokens" of every request, the processed target
distributions p_i for each admitted slot plus the bonus row, and the cache rollback after
acceptance.

Cache invariant. Before `verify`, a request's target cache holds its sequence except the
pending tokens (the prompt at first, then the last emitted token). Verifying k admitted
slots feeds pending + x_1..x_k and returns k + 1 distributions: p_1..p_k, then the bonus
distribution. After a of them are accepted, x_{a+1}..x_k are rolled back and the emitted
final token becomes pending.

Must not know: the drafter, the estimator or the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specav.request import Request
from specav.verification.sampling_rows import SamplingRows
from specav.models.kv_cache import KVCache
from specav.models.packed import PackedCausalLM
from specav.token_probs import TokenProbs
from specav.types import AcceptResult
from specav.verification.planner import RequestShape


@dataclass(slots=True)
class _State:
    cache: KVCache
    pending: list[int] = field(default_factory=list)


class TargetVerifier:
    def __init__(self, model: PackedCausalLM) -> None:
        self.model = model
        self._states: dict[str, _State] = {}

    def _state(self, request: Request) -> _State:
        if request.request_id not in self._states:
            self._states[request.request_id] = _State(self.model.new_cache(), list(request.prompt_ids))
        return self._states[request.request_id]

    def shapes(self, requests: Sequence[Request]) -> list[RequestShape]:
        """Per request, what verifying it costs before any slot: pending tokens and cached positions."""
        states = [self._state(r) for r in requests]
        return [RequestShape(len(s.pending), s.cache.length) for s in states]

    def verify(self, requests: Sequence[Request], admitted: Sequence[list[int]]) -> TokenProbs:
        """admitted[b]: request b's admitted draft tokens. Returns p (S + B rows): per request,
        one row per admitted slot, then its bonus row (the layout rejection_sample expects)."""
        states = [self._state(r) for r in requests]
        feed = [s.pending + list(tokens) for s, tokens in zip(states, admitted)]
        num_logits = [len(tokens) + 1 for tokens in admitted]
        out = self.model.forward(feed, [s.cache for s in states], num_logits)
        for s in states:
            s.pending = []
        return SamplingRows.of(requests, num_logits, admitted, model="target").distributions(out.logits)

    def commit(self, requests: Sequence[Request], num_admitted: Sequence[int], result: AcceptResult) -> None:
        for b, request in enumerate(requests):
            state = self._state(request)
            state.cache.rollback(num_admitted[b] - int(result.num_accepted[b]))
            state.pending = [result.output_tokens[b][-1]]

    def release(self, request: Request) -> None:
        self._states.pop(request.request_id, None)
