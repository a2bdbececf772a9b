"""Requests: what a caller asked for and what has been generated so far.

A neutral module: the engine, the drafters and the verifier all read requests, so the type
lives below all of them (drafting must not import the engine it serves).

Owns: a request's prompt, sampling parameters, its own random generator (seeded per
request so its output never depends on what else is in the batch), its output tokens,
and the stop rules (EOS, stop strings, max_tokens).

Must not know: models, caches, drafting or verification.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from specav.config import SamplingParams

_ids = itertools.count()


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached


@dataclass(slots=True, eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output, cut before a stop string
    finish_reason: FinishReason | None = None
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty; give at least one token")
        seed = self.params.seed
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def append(self, tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
        """Append emitted tokens, applying EOS and max_tokens; returns the tokens actually kept."""
        kept = tokens[: self.remaining]
        if not self.params.ignore_eos:
            for i, t in enumerate(kept):
                if t in eos_ids:
                    kept = kept[: i + 1]
                    self.finish_reason = FinishReason.STOP
                    break
        self.output_ids.extend(kept)
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = FinishReason.LENGTH
        return kept

    def update_text(self, text: str) -> None:
        """Set the decoded output; stop at the first stop string, which is not included."""
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
            self.finish_reason = FinishReason.STOP
        self.text = text


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (for streaming)."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the whole decoded output so far
    finished: bool
    finish_reason: FinishReason | None
