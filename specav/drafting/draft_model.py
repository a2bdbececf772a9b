"""The draft-model drafter: a small autoregressive model of the target's vocabulary.

Owns: the drafter's KV caches and the tokens not yet fed to it ("pending"), drafting slot
by slot through the packed forward (all requests that still draft at slot i share one
forward), probabilistic sampling from q_i (greedy for temperature-0 requests), the
features of each slot, and the cache rollback after verification.

Cache invariant. Before `propose`, a request's drafter cache holds its sequence except the
pending tokens. Drafting k slots feeds pending, x_1, ..., x_{k-1}; x_k is sampled but never
fed. After verification accepted a of them and emitted a final token t:
  a < k:  roll back x_{a+1}..x_{k-1}; pending = [t]
  a = k:  nothing to roll back, but x_k was never fed; pending = [x_k, t]
A request drafting 0 slots feeds nothing and appends its emitted tokens to pending.

Must not know: the target model, rejection sampling or the planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from specav.acceptance.features import features_from_tails, logit_q_max_from_tails
from specav.drafting.base import StopRule, register
from specav.models.kv_cache import KVCache
from specav.models.packed import PackedCausalLM
from specav.request import Request
from specav.token_probs import TokenProbs
from specav.topk import Tails
from specav.types import AcceptResult, DraftBatch, Ragged, attended
from specav.verification.sampling_rows import SamplingRows

FEATURE_NAMES = ("logit_q_max", "q_max", "entropy", "top2_margin", "q_sampled", "q_max_truncated")


@dataclass(slots=True)
class _State:
    cache: KVCache
    pending: list[int] = field(default_factory=list)


@register("draft_model")
class DraftModelDrafter:
    name = "draft_model"
    setup_seconds = 0.0  # loaded: ready to draft

    def __init__(self, model: PackedCausalLM, feature_clamp: float = 40.0, keep_hidden: bool = False) -> None:
        self.model = model
        self.feature_clamp = feature_clamp
        self.keep_hidden = keep_hidden
        self._states: dict[str, _State] = {}

    @property
    def max_positions(self) -> int | None:
        """Positions the drafter model holds (None: it does not say)."""
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None) or None

    def _state(self, request: Request) -> _State:
        if request.request_id not in self._states:
            # Its whole sequence so far: a drafter that first sees a request after the target has
            # decoded some of it (a deferred drafter, loaded mid-run) catches up on all of it.
            self._states[request.request_id] = _State(self.model.new_cache(), [*request.prompt_ids, *request.output_ids])
        return self._states[request.request_id]

    def propose(self, requests: Sequence[Request], num_slots: Sequence[int],
                stop_rule: StopRule | None = None) -> DraftBatch:
        b, k = len(requests), max(num_slots, default=0)
        if k == 0:  # nobody drafts this step: nothing to feed (skipped tokens stay pending)
            return DraftBatch.empty(b, self.model.vocab_size, FEATURE_NAMES)
        drafts: list[list[int]] = [[] for _ in range(b)]  # per request, its draft tokens so far
        slot_active: list[list[int]] = []  # per forward, the requests it drafted for
        slot_probs: list[TokenProbs] = []  # per forward, q_i of the requests it drafted for
        slot_tails: list[Tails] = []  # per forward, the Tails of its rows (what their features read)
        slot_tokens: list[torch.Tensor] = []  # per forward, its rows' draft tokens # [A]
        slot_rows: list[list[int]] = [[] for _ in range(b)]  # per request, its q_i rows in slot_probs' rows
        slot_hidden: list[list[torch.Tensor]] = [[] for _ in range(b)]
        states = [self._state(r) for r in requests]
        forwards: list[tuple[int, int]] = []
        active = [i for i in range(b) if num_slots[i] > 0]
        first_row = 0  # of this forward's rows, counted over all forwards
        for slot in range(k):
            if not active:
                break
            feed = [states[i].pending if slot == 0 else drafts[i][-1:] for i in active]
            forwards.append((sum(len(f) for f in feed),
                             sum(attended(len(f), states[i].cache.length) for f, i in zip(feed, active))))
            out = self.model.forward(feed, [states[i].cache for i in active], [1] * len(active))
            rows = SamplingRows.of([requests[i] for i in active], [1] * len(active), [drafts[i] for i in active],
                                   model="drafter")
            probs, tails, tokens = rows.draw(out.logits)  # A rows, tokens # [A]
            slot_active.append(active)
            slot_probs.append(probs)
            slot_tails.append(tails)
            slot_tokens.append(tokens)
            for j, (i, token) in enumerate(zip(active, tokens.tolist())):
                drafts[i].append(token)
                slot_rows[i].append(first_row + j)
                if self.keep_hidden:
                    slot_hidden[i].append(out.hidden[j])
                if slot == 0:
                    states[i].pending = []
            first_row += len(active)
            keep = [i for i in active if num_slots[i] > slot + 1]
            if stop_rule is not None and keep:
                slot_features = _SlotFeatures({"logit_q_max": logit_q_max_from_tails(tails, self.feature_clamp)},
                                              lambda t=tails, p=probs, x=tokens: self._features(t, p, x))
                more = stop_rule.keep_drafting(slot, active, slot_features).tolist()
                keep = [i for i, go in zip(active, more) if go and num_slots[i] > slot + 1]
            active = keep
        order = [r for per in slot_rows for r in per]  # request-major, as DraftBatch.layout says
        probs = TokenProbs.cat(slot_probs, self.model.vocab_size)  # slot-major
        features = self._features(Tails.cat(slot_tails), probs, torch.cat(slot_tokens))  # every slot's, in one call
        if order != list(range(len(order))):
            probs = probs.rows(torch.tensor(order, dtype=torch.int64))
        flat_hidden = [h for per in slot_hidden for h in per]
        drafted = [len(d) for d in drafts]
        width = max(drafted, default=0)
        token_ids = torch.tensor([d + [-1] * (width - len(d)) for d in drafts], dtype=torch.int64).reshape(b, width)
        return DraftBatch(token_ids, Ragged.of(drafted), probs, _feature_table(features, slot_active, b, width),
                          torch.stack(flat_hidden) if flat_hidden else None, forwards)

    def pending_tokens(self, requests: Sequence[Request]) -> list[int]:
        return [len(self._states[r.request_id].pending) if r.request_id in self._states else r.num_tokens
                for r in requests]

    def _features(self, tails: Tails, probs: TokenProbs, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every logged feature of A slots # [A]: from temperature-scaled, untruncated logits (their
        Tails, from the scan that gave q_i), plus q_sampled (lossy) and q_max after top-k/top-p (both
        logged for evaluation, never scored)."""
        f = features_from_tails(tails, probs, tokens, self.feature_clamp)
        values = {name: getattr(f, name) for name in FEATURE_NAMES if name != "q_max_truncated"}
        values["q_max_truncated"] = probs.max()
        return values

    def commit(self, requests: Sequence[Request], drafts: DraftBatch, result: AcceptResult) -> None:
        for b, request in enumerate(requests):
            state = self._state(request)
            drafted, accepted = int(drafts.num_drafted[b]), int(result.num_accepted[b])
            final = result.output_tokens[b][-1]
            if drafted == 0:
                state.pending.extend(result.output_tokens[b])
            elif accepted < drafted:
                state.cache.rollback(drafted - 1 - accepted)
                state.pending = [final]
            else:
                state.pending = [int(drafts.token_ids[b, drafted - 1]), final]

    def release(self, request: Request) -> None:
        self._states.pop(request.request_id, None)


def _feature_table(features: dict[str, torch.Tensor], slot_active: list[list[int]], b: int, width: int
                   ) -> dict[str, torch.Tensor]:
    """Each feature # [B, width] (NaN where not drafted) from every drafted row's, slot-major (each # [S]):
    one scatter for the step instead of one per feature and forward."""
    table = torch.full((len(FEATURE_NAMES), b, width), float("nan"))
    if slot_active:
        rows = [i for active in slot_active for i in active]
        slots = [s for s, active in enumerate(slot_active) for _ in active]
        table[:, rows, slots] = torch.stack([features[name].float() for name in FEATURE_NAMES])
    return {name: table[f] for f, name in enumerate(FEATURE_NAMES)}


class _SlotFeatures(Mapping):
    """One slot's features (each # [A]) as the stop rule reads them: logit(q_max) (what rules read,
    from the slot's Tails) given, the others computed all at once by `every()` if a rule asks. The
    step's feature table computes every slot's in one call after the last slot."""

    def __init__(self, known: dict[str, torch.Tensor], every: Callable[[], dict[str, torch.Tensor]]) -> None:
        self._values, self._every = dict(known), every

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._values and name in FEATURE_NAMES:
            self._values.update(self._every())
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(FEATURE_NAMES)

    def __len__(self) -> int:
        return len(FEATURE_NAMES)
