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

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from specav.acceptance.features import row_features
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
        slot_probs: list[TokenProbs] = []  # per forward, q_i of the requests it drafted for
        table = [[[math.nan] * k for _ in range(b)] for _ in FEATURE_NAMES]  # [F][B][k], NaN where not drafted
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
            token_list = tokens.tolist()
            slot_probs.append(probs)
            values = self._slot_features(tails, probs, token_list)
            for table_f, values_f in zip(table, values):
                for i, value in zip(active, values_f):
                    table_f[i][slot] = value
            for j, (i, token) in enumerate(zip(active, token_list)):
                drafts[i].append(token)
                slot_rows[i].append(first_row + j)
                if self.keep_hidden:
                    slot_hidden[i].append(out.hidden[j])
                if slot == 0:
                    states[i].pending = []
            first_row += len(active)
            keep = [i for i in active if num_slots[i] > slot + 1]
            if stop_rule is not None and keep:
                more = stop_rule.keep_drafting(slot, active, _SlotFeatures(values)).tolist()
                keep = [i for i, go in zip(active, more) if go and num_slots[i] > slot + 1]
            active = keep
        order = [r for per in slot_rows for r in per]  # request-major, as DraftBatch.layout says
        probs = TokenProbs.cat(slot_probs, self.model.vocab_size)  # slot-major
        if order != list(range(len(order))):
            probs = probs.rows(torch.tensor(order, dtype=torch.int64))
        flat_hidden = [h for per in slot_hidden for h in per]
        drafted = [len(d) for d in drafts]
        width = max(drafted, default=0)
        token_ids = torch.tensor([d + [-1] * (width - len(d)) for d in drafts], dtype=torch.int64).reshape(b, width)
        features = torch.tensor([[row[:width] for row in table_f] for table_f in table], dtype=torch.float32)
        return DraftBatch(token_ids, Ragged.of(drafted), probs, dict(zip(FEATURE_NAMES, features)),
                          torch.stack(flat_hidden) if flat_hidden else None, forwards)

    def pending_tokens(self, requests: Sequence[Request]) -> list[int]:
        return [len(self._states[r.request_id].pending) if r.request_id in self._states else r.num_tokens
                for r in requests]

    def _slot_features(self, tails: Tails, probs: TokenProbs, tokens: list[int]) -> list[list[float]]:
        """Every logged feature of one slot's A rows, in FEATURE_NAMES' order (each a list of A floats):
        the four logit features from temperature-scaled, untruncated logits (their Tails, from the scan
        that gave q_i; acceptance.features.row_features), plus q_sampled (lossy) and q_max after
        top-k/top-p (both logged for evaluation, never scored). In Python floats: a few rows a slot."""
        rows = [row_features(*values, self.feature_clamp)
                for values in zip(tails.tail.tolist(), tails.moment.tolist(), tails.gap.tolist())]
        return [*(list(column) for column in zip(*rows)), probs.at_each(tokens), probs.max_each()]

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


class _SlotFeatures(Mapping):
    """One slot's features as a stop rule reads them (each # [A] float32, as the step's feature table
    holds them), made into a tensor only where the rule asks for it."""

    def __init__(self, values: list[list[float]]) -> None:
        self._lists = dict(zip(FEATURE_NAMES, values))
        self._tensors: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            self._tensors[name] = torch.tensor(self._lists[name], dtype=torch.float32)
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(FEATURE_NAMES)

    def __len__(self) -> int:
        return len(FEATURE_NAMES)
