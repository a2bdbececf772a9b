"""Shape glossary and the records one engine step passes between stages.

Shape letters, used in every `# [..]` comment of the package:

    B   requests in the step's batch
    K   draft slots per request (the speculative config's num_speculative_tokens)
    S   admitted slots of the whole batch, flattened (S <= S_d <= B * K; S_d = drafted slots)
    V   vocabulary size
    T   packed tokens of one forward pass (all requests' new tokens concatenated)
    L   decoder layers
    H   attention heads, Hkv key/value heads, D head dimension

This module owns no logic beyond offsets; it must not import models, servers or samplers
(token_probs.py, the distributions' type, sits below it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from specav.token_probs import TokenProbs

if TYPE_CHECKING:
    from specav.request import Request


@dataclass(frozen=True, slots=True)
class Ragged:
    """Per-request counts of a ragged batch flattened request-major, with its offsets computed once.

    Request b owns flat rows [starts[b], starts[b] + counts[b]). Every stage that walks a ragged
    batch (the drafter's distributions, the admitted slots, the rejection sampler) reads these
    instead of recomputing cumulative sums.
    """

    counts: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] int64, first flat row of each request
    request: torch.Tensor  # [N] int64, the request of each flat row (N = counts.sum())
    position: torch.Tensor  # [N] int64, 0-based position of each flat row within its request

    @classmethod
    def of(cls, counts: Sequence[int] | torch.Tensor) -> "Ragged":
        k = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
        # Laid out in Python: B counts and a few rows per request, where each torch op would cost tens
        # of us on the caches a forward left cold.
        per = k.tolist()
        if any(c < 0 for c in per):
            raise ValueError(f"ragged counts must be >= 0, got {per}")
        if not any(per):  # no rows (a step that drafted or admitted nothing): nothing to lay out
            none = torch.zeros(0, dtype=torch.int64)
            return cls(k, torch.zeros_like(k), none, none)
        starts, request, position = [], [], []
        for b, c in enumerate(per):
            starts.append(len(request))
            request += [b] * c
            position += range(c)
        return cls(k, torch.tensor(starts), torch.tensor(request), torch.tensor(position))

    @property
    def total(self) -> int:
        return int(self.request.shape[0])

    def __len__(self) -> int:
        return int(self.counts.shape[0])

    def prefix_rows(self, lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Flat rows of the first lengths[b] entries of each request, request-major # [sum(lengths)].

        lengths: # [B] int64, each <= counts[b].
        """
        if not self.total:
            return self.request
        lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
        rows = zip(self.starts.tolist(), lengths, self.counts.tolist())
        return torch.tensor([s + i for s, n, c in rows for i in range(min(n, c))], dtype=torch.int64)


@dataclass(slots=True)
class DraftBatch:
    """What the drafter proposed this step.

    Per-slot scalars are padded to the longest draft of the step (token -1 and NaN features
    past `num_drafted[b]`); distributions are flattened over the S_d drafted slots,
    request-major as `layout` says: request b owns rows [layout.starts[b], ... + num_drafted[b]).
    """

    token_ids: torch.Tensor  # [B, k_max] int64, the draft tokens x_i (-1 = not drafted)
    layout: Ragged  # drafted slots per request (ragged K) and their rows in `probs`
    probs: TokenProbs  # S_d rows: q_i after temperature / top-k / top-p (as candidates where top-k allows)
    features: dict[str, torch.Tensor]  # name -> [B, k_max] float32 (acceptance.features; NaN = not drafted)
    hidden: torch.Tensor | None = None  # [S_d, hidden] drafter hidden state per drafted slot, if kept
    forwards: list[tuple[int, int]] = field(default_factory=list)  # per drafter forward: (tokens fed,
    #   key positions they attended to, `attended` summed over its requests), for the cost model
    setup_seconds: float = 0.0  # of this propose, spent getting the drafter ready (a deferred load), not drafting

    @classmethod
    def empty(cls, batch: int, vocab_size: int, features: Sequence[str] = ()) -> "DraftBatch":
        """A step in which no request drafts (target-only decoding, and most adaptive steps where
        drafts do not pay): no slots and no forwards; each named feature # [B, 0]."""
        # no rows, as candidates: with p as candidates too, verification takes the rejection
        # sampler's native call
        no_rows = TokenProbs(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.int64), vocab_size)
        return cls(torch.full((batch, 0), -1, dtype=torch.int64), Ragged.of([0] * batch), no_rows,
                   {name: torch.zeros(batch, 0) for name in features})

    @property
    def num_drafted(self) -> torch.Tensor:  # [B] int64
        return self.layout.counts

    @property
    def offsets(self) -> torch.Tensor:  # [B] int64, first row of each request in `probs`
        return self.layout.starts


@dataclass(frozen=True, slots=True)
class Scores:
    """The score stage's output: what the scorer expects of every drafted slot."""

    features: torch.Tensor  # [B, K] the scorer's feature per slot (NaN = not drafted)
    confidences: torch.Tensor  # [B, K] P(slot i accepted | slots 1..i-1 were); NaN = not drafted
    survival: torch.Tensor  # [B, K] P(slots 1..i all accepted); NaN = not drafted

    @classmethod
    def empty(cls, batch: int) -> "Scores":
        nothing = torch.zeros(batch, 0, dtype=torch.float64)
        return cls(nothing, nothing, nothing)


def attended(tokens: int, context: int) -> int:
    """Key positions a forward's `tokens` new tokens of one request attend to, over `context`
    cached ones: each attends the cache and the new tokens before it (attention's work, which the
    cost model prices per position)."""
    return tokens * context + tokens * (tokens - 1) // 2


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds one step spent in its stages (measured, or predicted by a cost model)."""

    draft: float
    verify: float
    total: float


@dataclass(frozen=True, slots=True)
class Plan:
    """The plan stage's decision: which drafted slots the target verifies, a prefix of each draft.

    Built once per step; the verifier, the rejection sampler and the estimator read it.
    """

    admitted: Ragged  # admitted slots per request (k_b) and their offsets among the S admitted slots
    draft_rows: torch.Tensor  # [S] int64, row of each admitted slot in DraftBatch.probs
    tokens: torch.Tensor  # [S] int64, the admitted draft tokens, request-major
    predicted: StageTimes | None = None  # the planner's estimate of this step's times (None: no cost model)

    @classmethod
    def of(cls, drafts: DraftBatch, num_admitted: torch.Tensor, predicted: StageTimes | None = None) -> "Plan":
        """Admit the first num_admitted[b] drafted slots of each request (# [B] int64)."""
        num_admitted = torch.as_tensor(num_admitted, dtype=torch.int64)
        # B values, checked in Python: each torch op costs tens of us on the caches a forward left cold
        admitted_list, drafted_list = num_admitted.tolist(), drafts.num_drafted.tolist()
        if len(admitted_list) != len(drafted_list) or any(not 0 <= a <= d for a, d in zip(admitted_list, drafted_list)):
            raise ValueError(f"num_admitted {admitted_list} must lie in [0, num_drafted] per request "
                             f"(num_drafted {drafted_list})")
        if not drafts.layout.total:  # nothing drafted, so nothing admitted: the drafts' empty layout is the plan's
            return cls(drafts.layout, drafts.layout.request, drafts.layout.request, predicted)
        tokens = [t for row, a in zip(drafts.token_ids.tolist(), admitted_list) for t in row[:a]]
        return cls(Ragged.of(num_admitted), drafts.layout.prefix_rows(admitted_list),
                   torch.tensor(tokens, dtype=torch.int64), predicted)

    @property
    def num_admitted(self) -> torch.Tensor:  # [B] int64
        return self.admitted.counts

    def token_lists(self) -> list[list[int]]:
        """Per request, its admitted draft tokens."""
        flat, starts = self.tokens.tolist(), self.admitted.starts.tolist()
        return [flat[d:d + k] for d, k in zip(starts, self.admitted.counts.tolist())]


@dataclass(slots=True)
class AcceptResult:
    """Rejection sampling outcome for a batch."""

    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per request
    output_tokens: list[list[int]]  # per request: accepted draft tokens + one recovered or bonus token


@dataclass(slots=True)
class StepRecord:
    """Everything one step decided and measured, for the planner, metrics and labelled-draft logs."""

    step: int
    requests: list["Request"]
    drafts: DraftBatch
    scores: Scores
    plan: Plan
    result: AcceptResult
    times: StageTimes  # measured
    max_slots: list[int]  # per request, the slots it could have drafted (K, or fewer near max_tokens)
    verify_tokens: int  # tokens packed into the target's forward (pending tokens + admitted slots)
    verify_attended: int  # key positions the target's forward attended to (`attended`, summed over requests)
    prefill_tokens: int = 0  # prompt tokens of requests in their first step (prefilled by this step)
    draft_reasons: tuple[str, ...] = ()  # per request, why the planner let it draft ("" = it did not)
    draft_pending: tuple[int, ...] = ()  # per request, tokens its drafter had to feed before its first slot

    @property
    def confidences(self) -> torch.Tensor:  # [B, K]
        return self.scores.confidences

    @property
    def num_admitted(self) -> torch.Tensor:  # [B]
        return self.plan.num_admitted

    @property
    def num_accepted(self) -> torch.Tensor:  # [B]
        return self.result.num_accepted

    @property
    def num_skipped(self) -> int:
        """Requests that could draft but drafted nothing this step (no-draft decisions)."""
        return sum(1 for m, d in zip(self.max_slots, self.drafts.num_drafted.tolist()) if m > 0 and d == 0)
