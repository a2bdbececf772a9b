"""The plan stage: how many of each request's drafted slots the target verifies.

Owns: the admission decision. The static planner admits every drafted slot (classic
speculative decoding with a fixed K). An adaptive planner would trim by survival under a
budget; whatever it does, it must obey the lossless rules of architecture.md: whether slot
i is admitted may not depend on x_i or on anything computed from it.

Must not know: models, requests or the rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specav.types import DraftBatch


@dataclass(slots=True)
class Plan:
    num_admitted: torch.Tensor  # [B] int64, admitted slots per request (a prefix of its drafted slots)

    def admitted_tokens(self, drafts: DraftBatch) -> list[list[int]]:
        return [drafts.token_ids[b, :k].tolist() for b, k in enumerate(self.num_admitted.tolist())]

    def admitted_rows(self, drafts: DraftBatch) -> torch.Tensor:
        """Indices into drafts.probs of the admitted slots, request-major # [S]."""
        rows = [torch.arange(o, o + k) for o, k in zip(drafts.offsets.tolist(), self.num_admitted.tolist())]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


class StaticPlanner:
    """Admit every drafted slot."""

    def plan(self, drafts: DraftBatch, confidences: torch.Tensor) -> Plan:
        return Plan(num_admitted=drafts.num_drafted.clone())
