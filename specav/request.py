"""Requests: what a caller asked for and what has been generated so far.

A neutral module: the engine, the drafters and the verifier all read requests, so the type
lives below all of them (drafting must not import the engine it serves).

Owns: a request's prompt, sampling parameters, its own random generator (seeded per
request so its output never depends on what else is in the batch), its output tokens and
text, the stop rules (EOS, stop strings, max_tokens), how it finished (stop, length, abort,
error), and its per-request speculation counts.

Text. Each kept token goes through the request's incremental detokenizer (detokenize.py), so
a step costs the same however long the output is, and a character split across tokens appears
once it is whole. Stop strings are searched in the decoded text as it grows; `text` is what may
be shown so far: while the request runs, a tail that could still become the start of a stop
string is held back, so no part of a stop string is ever streamed. When a stop string appears,
the text ends before it and the tokens after the one that completed it are dropped: they are
in neither the output nor its token count.

Must not know: models, caches, drafting or verification.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from specav.config import SamplingParams
from specav.detokenize import Detokenizer

_ids = itertools.count()


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the caller aborted it (Engine.abort)
    ERROR = "error"  # the engine could not go on with it (Request.error says why)


@dataclass(slots=True)
class RequestStats:
    """What speculation did for one request."""

    steps: int = 0  # engine steps it took part in (each emits accepted tokens + 1)
    drafted: int = 0  # slots drafted for it
    admitted: int = 0  # of those, verified
    accepted: int = 0  # of those, kept

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per step: accepted draft tokens + 1."""
        return (self.accepted + self.steps) / self.steps if self.steps else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted / admitted slots."""
        return self.accepted / self.admitted if self.admitted else float("nan")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the target, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; SamplingParams.logprobs of them


@dataclass(slots=True, eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    detokenizer: Detokenizer | None = None  # None: no text (token ids only)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output that may be shown: cut before a stop string, held back near one
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None  # the stop string that ended it
    error: str | None = None  # why it finished with FinishReason.ERROR
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] | None = None  # per kept token, when params.logprobs is not None
    target_logprobs: torch.Tensor | None = None  # [rows, V] this step's target log-softmax (sampling_rows.py)
    generator: torch.Generator = field(init=False)
    _decoded: str = ""  # all text decoded so far (cut at a stop string)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty; give at least one token")
        seed = self.params.seed
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Its sequence so far: prompt and output tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    # ---- output -----------------------------------------------------------------------------

    def append(self, tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
        """Append emitted tokens one by one, applying EOS, stop strings and max_tokens; returns the
        tokens actually kept (none after the one that finished the request)."""
        kept: list[int] = []
        for token in tokens:
            if self.finished:
                break
            self.output_ids.append(token)
            kept.append(token)
            if token in eos_ids and not self.params.ignore_eos:
                self.finish_reason = FinishReason.STOP
            elif self.detokenizer is not None:
                self._add_text(self.detokenizer.push(token))
            if self.finish_reason is None and self.remaining <= 0:
                self.finish_reason = FinishReason.LENGTH
        if self.finished and self.stop_reason is None and self.detokenizer is not None:
            self._add_text(self.detokenizer.finish())
        self.text = self._visible()
        return kept

    def _add_text(self, chunk: str) -> None:
        """Extend the decoded text; at the first stop string, cut it there and finish."""
        stops = self.params.stop
        if not chunk or self.stop_reason is not None:
            return
        start = max(0, len(self._decoded) - max((len(s) for s in stops), default=0) + 1)
        self._decoded += chunk
        hits = [(i, s) for s in stops if (i := self._decoded.find(s, start)) >= 0]
        if hits:
            cut, stop = min(hits)
            self._decoded = self._decoded[:cut]
            self.stop_reason = stop
            self.finish_reason = FinishReason.STOP

    def _visible(self) -> str:
        """The decoded text less, while running, its longest tail that begins some stop string."""
        text = self._decoded
        if self.finished:
            return text
        held = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return text[:len(text) - held]

    # ---- ending early -------------------------------------------------------------------------

    def fail(self, message: str) -> None:
        """Finish with FinishReason.ERROR (the engine keeps none of this step's tokens)."""
        if not self.finished:
            self.error = message
            self.finish_reason = FinishReason.ERROR

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = FinishReason.ABORT


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request (for streaming)."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the whole output text that may be shown so far
    new_text: str  # what `text` gained in this step
    finished: bool
    finish_reason: FinishReason | None
    error: str | None = None
    new_logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked for logprobs
