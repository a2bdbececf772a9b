"""Per-row sampling parameters for a batch of requests (the bridge from requests to sampling.py).

Owns: expanding each request's SamplingParams and generator to the rows it owns in a
flattened [N, V] batch, for the drafter (q_i) and the verifier (p_i) alike. Must not know
models or verification rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specav.request import Request
from specav.verification.sampling import processed_probs, temperature_logits


@dataclass(slots=True)
class SamplingRows:
    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64
    top_p: torch.Tensor  # [N] float32
    generators: list[torch.Generator]  # [N], each request's own generator on each of its rows

    @classmethod
    def of(cls, requests: Sequence[Request], rows_per_request: Sequence[int]) -> "SamplingRows":
        temperature, top_k, top_p, generators = [], [], [], []
        for request, n in zip(requests, rows_per_request):
            p = request.params
            temperature += [p.temperature] * n
            top_k += [p.top_k] * n
            top_p += [p.top_p] * n
            generators += [request.generator] * n
        return cls(torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k, dtype=torch.int64),
                   torch.tensor(top_p, dtype=torch.float32), generators)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits # [N, V] -> processed distributions # [N, V]."""
        return processed_probs(logits, self.temperature, self.top_k, self.top_p)

    def scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits # [N, V] -> temperature-scaled, untruncated logits # [N, V] (for features)."""
        return temperature_logits(logits, self.temperature)
