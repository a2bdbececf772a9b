"""Counters an engine keeps across steps: acceptance per position, slots, prefill and decode speed.

Owns: aggregation of step records into the figures `specav generate` prints and the
benchmarks report. Must not know models or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specav.types import StepRecord


@dataclass(slots=True)
class DraftCounts:
    """What the requests that drafted for one reason (DraftPlan.reasons) drafted and bought."""

    request_steps: int = 0
    drafted: int = 0
    admitted: int = 0
    accepted: int = 0
    fed: int = 0  # tokens their drafters fed before the first slot (more than 1-2: a catch-up)

    def __add__(self, other: "DraftCounts") -> "DraftCounts":
        return DraftCounts(*(getattr(self, f) + getattr(other, f) for f in self.__slots__))

    def __str__(self) -> str:
        return (f"{self.request_steps} request-steps, {self.drafted} drafted, {self.admitted} verified, "
                f"{self.accepted} accepted, {self.fed - self.request_steps} tokens caught up")


@dataclass(slots=True)
class EngineStats:
    num_slots: int
    steps: int = 0  # engine steps
    request_steps: int = 0  # (request, step) pairs: each verifies at least the bonus token
    emitted_tokens: int = 0
    drafted: int = 0  # slots drafted
    admitted: int = 0  # of those, verified
    accepted: int = 0  # of those, kept
    skipped: int = 0  # (request, step) pairs that could draft but did not (the no-draft decision)
    seconds: float = 0.0
    prefill_steps: int = 0  # steps that prefilled at least one new request's prompt
    prefill_tokens: int = 0  # prompt tokens prefilled
    prefill_seconds: float = 0.0
    prefill_emitted: int = 0  # tokens emitted by prefill steps
    predicted_seconds: float = 0.0  # the planner's prediction of the steps it predicted
    predicted_measured_seconds: float = 0.0  # what those steps measured (same stages)
    drafter_load_seconds: float = 0.0  # a deferred drafter's load, paid in a step but not counted in `seconds`
    drafter_load_step: int | None = None  # the step it was paid in
    by_reason: dict[str, DraftCounts] = field(default_factory=dict)  # why requests drafted -> what they did
    reached: list[int] = field(init=False)  # [K] slots verified with all earlier slots accepted
    accepted_at: list[int] = field(init=False)  # [K] of those, accepted

    def __post_init__(self) -> None:
        self.reached = [0] * self.num_slots
        self.accepted_at = [0] * self.num_slots

    def record(self, record: StepRecord, emitted: int, seconds: float) -> None:
        """One step; emitted: the tokens its requests kept (after EOS, max_tokens, stop strings);
        seconds: its whole time, commit included."""
        # B values as Python ints: each torch op costs tens of us on the caches a forward left cold
        drafted, admitted, accepted = (record.drafts.num_drafted.tolist(), record.num_admitted.tolist(),
                                       record.num_accepted.tolist())
        self.steps += 1
        self.request_steps += len(record.requests)
        self.emitted_tokens += emitted
        self.drafted += sum(drafted)
        self.admitted += sum(admitted)
        self.accepted += sum(accepted)
        self.skipped += record.num_skipped
        self._count_reasons(record, drafted, admitted, accepted)
        self.seconds += seconds
        if record.drafts.setup_seconds:
            self.drafter_load_seconds += record.drafts.setup_seconds
            self.drafter_load_step = record.step
        if record.prefill_tokens:
            self.prefill_steps += 1
            self.prefill_tokens += record.prefill_tokens
            self.prefill_seconds += seconds
            self.prefill_emitted += emitted
        if record.plan.predicted is not None:
            self.predicted_seconds += record.plan.predicted.total
            self.predicted_measured_seconds += record.times.total
        for a, n in zip(admitted, accepted):
            for i in range(min(a, n + 1)):  # slot i + 1 was reached: admitted, and slots 1..i accepted
                self.reached[i] += 1
            for i in range(n):
                self.accepted_at[i] += 1

    def _count_reasons(self, record: StepRecord, drafted: list[int], admitted: list[int],
                       accepted: list[int]) -> None:
        for b, reason in enumerate(record.draft_reasons):
            if not reason or not drafted[b]:
                continue
            counts = self.by_reason.setdefault(reason, DraftCounts())
            counts.request_steps += 1
            counts.drafted += drafted[b]
            counts.admitted += admitted[b]
            counts.accepted += accepted[b]
            counts.fed += record.draft_pending[b] if record.draft_pending else 1

    @property
    def trimmed(self) -> int:
        """Drafted slots the planner did not verify."""
        return self.drafted - self.admitted

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per request per step: accepted draft tokens + 1."""
        return (self.accepted + self.request_steps) / self.request_steps if self.request_steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.emitted_tokens / self.seconds if self.seconds else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the steps that prefilled nothing."""
        seconds = self.seconds - self.prefill_seconds
        return (self.emitted_tokens - self.prefill_emitted) / seconds if seconds > 0 else float("nan")

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else float("nan")

    def summary(self) -> str:
        per_pos = " ".join(f"{x:.2f}" for x in self.acceptance_per_position)
        text = (f"{self.emitted_tokens} tokens in {self.seconds:.2f} s: prefill {self.prefill_tokens} tokens "
                f"{self.prefill_tokens_per_second:.1f} tokens/s, decode {self.decode_tokens_per_second:.2f} tokens/s; "
                f"{self.steps} steps, mean acceptance length {self.mean_acceptance_length:.2f}")
        if self.num_slots:
            text += (f", slots drafted {self.drafted} admitted {self.admitted} trimmed {self.trimmed} "
                     f"accepted {self.accepted}, drafting skipped {self.skipped}x, "
                     f"acceptance per position [{per_pos}]")
        if set(self.by_reason) - {"static"}:
            text += ", drafted for " + "; ".join(f"{reason}: {c}" for reason, c in sorted(self.by_reason.items()))
        if self.predicted_seconds:
            text += f", step time predicted/measured {self.predicted_seconds / self.predicted_measured_seconds:.2f}"
        if self.drafter_load_step is not None:
            text += f"; drafter loaded at step {self.drafter_load_step + 1} in {self.drafter_load_seconds:.1f} s (not counted above)"
        return text
