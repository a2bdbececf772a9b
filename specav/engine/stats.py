"""Counters an engine keeps across steps: acceptance per position, lengths, throughput.

Owns: aggregation of step outcomes into the figures `specav generate` prints and the
benchmarks report. Must not know models or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class EngineStats:
    num_slots: int
    steps: int = 0  # engine steps
    request_steps: int = 0  # (request, step) pairs that verified at least the bonus token
    emitted_tokens: int = 0
    drafted: int = 0
    admitted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    reached: torch.Tensor = field(init=False)  # [K] slots verified with all earlier slots accepted
    accepted_at: torch.Tensor = field(init=False)  # [K] of those, accepted

    def __post_init__(self) -> None:
        self.reached = torch.zeros(self.num_slots, dtype=torch.int64)
        self.accepted_at = torch.zeros(self.num_slots, dtype=torch.int64)

    def record(self, num_drafted: torch.Tensor, num_admitted: torch.Tensor, num_accepted: torch.Tensor,
               emitted: int, seconds: float) -> None:
        """num_drafted, num_admitted, num_accepted: # [B] int64."""
        self.steps += 1
        self.request_steps += int(num_admitted.numel())
        self.emitted_tokens += emitted
        self.drafted += int(num_drafted.sum())
        self.admitted += int(num_admitted.sum())
        self.accepted += int(num_accepted.sum())
        self.seconds += seconds
        pos = torch.arange(1, self.num_slots + 1)  # [K]
        # slot i was reached if it was admitted and slots 1..i-1 were accepted
        reached = (pos[None, :] <= num_admitted[:, None]) & (pos[None, :] <= num_accepted[:, None] + 1)
        self.reached += reached.sum(0)
        self.accepted_at += (pos[None, :] <= num_accepted[:, None]).sum(0)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at.tolist(), self.reached.tolist())]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per request per step: accepted draft tokens + 1."""
        return (self.accepted + self.request_steps) / self.request_steps if self.request_steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.emitted_tokens / self.seconds if self.seconds else float("nan")

    def summary(self) -> str:
        per_pos = " ".join(f"{x:.2f}" for x in self.acceptance_per_position)
        return (f"{self.emitted_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.2f} tokens/s), "
                f"{self.steps} steps, mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"acceptance per position [{per_pos}]")
