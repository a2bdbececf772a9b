"""Shape glossary and the records one engine step passes between stages.

Shape letters, used in every `# [..]` comment of the package:

    B   requests in the step's batch
    K   draft slots per request (the speculative config's num_speculative_tokens)
    S   admitted slots of the whole batch, flattened (S <= S_d <= B * K; S_d = drafted slots)
    V   vocabulary size
    T   packed tokens of one forward pass (all requests' new tokens concatenated)
    L   decoder layers
    H   attention heads, Hkv key/value heads, D head dimension

This module owns no logic; it must not import models, servers or samplers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DraftBatch:
    """What the drafter proposed this step.

    Per-slot scalars are padded to K slots per request (token -1 and NaN features past
    `num_drafted[b]`); distributions are flattened over the S_d drafted slots, request-major:
    request b owns rows [offsets[b], offsets[b] + num_drafted[b]).
    """

    token_ids: torch.Tensor  # [B, K] int64, the draft tokens x_i (-1 = not drafted)
    num_drafted: torch.Tensor  # [B] int64, slots actually drafted per request (ragged K)
    probs: torch.Tensor  # [S_d, V] float32, q_i after temperature / top-k / top-p
    features: dict[str, torch.Tensor]  # name -> [B, K] float32 (acceptance.features; NaN = not drafted)
    hidden: torch.Tensor | None = None  # [S_d, hidden] drafter hidden state per drafted slot, if kept

    @property
    def offsets(self) -> torch.Tensor:  # [B] int64, first row of each request in `probs`
        return torch.cumsum(self.num_drafted, 0) - self.num_drafted


@dataclass(slots=True)
class AcceptResult:
    """Rejection sampling outcome for a batch."""

    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per request
    output_tokens: list[list[int]]  # per request: accepted draft tokens + one recovered or bonus token
