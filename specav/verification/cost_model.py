"""The cost model: predicted seconds of a step's stages, profiled at start-up and corrected online.

Owns: the two cost curves the planner prices slots with, and their correction from measured
step times.

    draft(tokens, attended)   one drafter forward feeding `tokens` rows, with its sampling and
                              features (one drafting slot of every request that drafts it)
    verify(tokens, attended)  the target's packed forward over `tokens` tokens, with the
                              processed distributions of every row
    overhead                  the rest of a step (scoring, planning, rejection sampling, commit)
    draft_setup               seconds paid once before the drafter's first forward (a deferred
                              load, drafting/deferred.py), priced like a catch-up; 0 once paid

The verify stage has two online scales: `verify`, learnt from steps that drafted, and `plain`,
from steps that drafted nothing (target-only decoding, the price every rule is held to); until
one of them has been measured it stands in with the other's. A slowdown is not always uniform
over token counts: in the traces the two kinds of step drifted from the profile by different
amounts, in either direction. Code at concurrency 4 on a machine running at about half its
profiled speed: AV's steps were predicted at 0.97x their measured time, yet it drafted 11 slots
per step at 0.76x target-only, because the target-only step its price came from was predicted
with the scale of its own 11-17-token verifies. Prose at concurrency 1, the other way round:
with 612 of 764 decoding steps drafting nothing, one scale learnt from all of them put the
drafting steps' verify at the plain steps' scale, 161 ms predicted against 170 measured.

`attended` is attention's work: the key positions the forward's tokens attend to, summed over
them (`types.attended`: a request's t new tokens over c cached positions attend t * c + t(t-1)/2).
Attention is priced per attended position because it is per token and per cached position
alike: 16 tokens over a 576-token context cost the target 2-4 us per position more than over
64 on this project's AMD EPYC, so a slot of a long request costs more than one of a short one.
A curve is the profile's measured points with attention's share taken out, made monotone
(pool-adjacent-violators, so one noisy point cannot make more tokens look cheaper) and
interpolated linearly, extended past the last point with the last segment's slope, plus
`per_context` seconds per attended position.

Online correction. Each step the engine reports what it measured; each stage keeps a
multiplicative scale, an exponential moving average in log space of measured / profiled
(half-life `halflife` steps), so a uniform slowdown (thermal throttling, a noisy neighbour)
is followed within a few half-lives whatever its size, and a stale profile never stays in
charge. The overhead is an EMA of the measured remainder. The profile itself (running the
models) lives in engine/profile.py; this module never runs a model.

Must not know: models, requests, the engine.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from specav.types import StageTimes


def isotonic(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit of a sequence (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [s / c for s, c in blocks for _ in range(int(c))]


@dataclass(frozen=True, slots=True)
class CostCurve:
    """Seconds of one forward against the tokens it packs (monotone, piecewise linear)."""

    tokens: tuple[int, ...]  # ascending, >= 1
    seconds: tuple[float, ...]  # non-decreasing
    per_context: float = 0.0  # seconds per attended key position (types.attended)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("a cost curve needs one time per token count, and at least one point")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError(f"token counts must be distinct, ascending and >= 1, got {self.tokens}")
        if any(b < a for a, b in zip(self.seconds, self.seconds[1:])) or self.seconds[0] < 0:
            raise ValueError("seconds must be non-negative and non-decreasing: build curves with CostCurve.fit")

    @classmethod
    def fit(cls, measured: Mapping[int, float], per_context: float = 0.0) -> "CostCurve":
        """A monotone curve through measured {tokens: seconds} points."""
        tokens = sorted(measured)
        return cls(tuple(tokens), tuple(isotonic([measured[t] for t in tokens])), max(0.0, per_context))

    def __call__(self, tokens: float, attended: float = 0.0) -> float:
        """Seconds of a forward over `tokens` tokens attending to `attended` key positions (0 tokens: 0)."""
        if tokens <= 0:
            return 0.0
        return self._base(tokens) + self.per_context * max(0.0, attended)

    def added(self, tokens: float, more: float, attended: float = 0.0) -> float:
        """Seconds that `more` tokens, attending to `attended` positions, add to a forward of `tokens`."""
        return (self(tokens + more) - self(tokens) if more > 0 else 0.0) + self.per_context * max(0.0, attended)

    def _base(self, tokens: float) -> float:
        xs, ys = self.tokens, self.seconds
        if len(xs) == 1:
            base = ys[0] * tokens / xs[0] if tokens > xs[0] else ys[0]
        elif tokens <= xs[0]:
            base = ys[0]
        else:
            i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)  # segment (i - 1, i), the last one past the end
            slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
            base = ys[i - 1] + slope * (tokens - xs[i - 1])
        return base

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds), "per_context": self.per_context}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostCurve":
        return cls(tuple(int(t) for t in data["tokens"]), tuple(float(s) for s in data["seconds"]),
                   float(data.get("per_context", 0.0)))


@dataclass(frozen=True, slots=True)
class CostProfile:
    """What a start-up profile measured: the curves, and what they were measured for."""

    verify: CostCurve
    draft: CostCurve | None  # None: target-only engine
    key: str = ""  # machine, models, dtype, threads and kernel build (engine/profile.py)
    draft_load: float | None = None  # seconds the drafter's last load took on this machine (None: unknown)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "verify": self.verify.to_dict(),
                "draft": None if self.draft is None else self.draft.to_dict(), "draft_load": self.draft_load}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostProfile":
        draft, load = data.get("draft"), data.get("draft_load")
        return cls(CostCurve.from_dict(data["verify"]), None if draft is None else CostCurve.from_dict(draft),
                   str(data.get("key", "")), None if load is None else float(load))


def _decay(halflife: float) -> float:
    """Weight of a new observation in an EMA with this half-life (in observations)."""
    return 1.0 - 0.5 ** (1.0 / halflife)


class CostModel:
    """Profiled curves times online scales; predicts stages, learns from measured steps."""

    def __init__(self, profile: CostProfile, halflife: float = 8.0, overhead: float = 0.0,
                 draft_setup: float = 0.0) -> None:
        """draft_setup: seconds the drafter spends once before its first forward (a deferred load,
        drafting/deferred.py); 0 from the first step with a drafter forward on."""
        if not (math.isfinite(halflife) and halflife > 0):
            raise ValueError(f"halflife = {halflife!r} is invalid: a number of steps > 0")
        if not (math.isfinite(draft_setup) and draft_setup >= 0):
            raise ValueError(f"draft_setup = {draft_setup!r} is invalid: seconds >= 0")
        self.draft_setup = draft_setup
        self.profile = profile
        self.alpha = _decay(halflife)
        self.log_scale = {"draft": 0.0, "verify": 0.0, "plain": 0.0}
        self.plain_observations = 0  # steps that drafted nothing (the plain scale's evidence)
        self.verify_observations = 0  # steps that drafted (the verify scale's)
        self.draft_observations = 0  # steps with a drafter forward (the draft scale's)
        self.overhead = overhead  # seconds per step outside the two models' stages
        self.observations = 0

    def scale(self, stage: str) -> float:
        return math.exp(self.log_scale[stage])

    # ---- predictions ------------------------------------------------------------

    def draft_seconds(self, tokens: float, attended: float = 0.0) -> float:
        """One drafter forward (and its sampling) over `tokens` rows."""
        if self.profile.draft is None:
            return 0.0
        return self.profile.draft(tokens, attended) * self.scale("draft")

    def verify_seconds(self, tokens: float, attended: float = 0.0) -> float:
        return self.profile.verify(tokens, attended) * self.scale("verify")

    def plain_seconds(self, tokens: float, attended: float = 0.0) -> float:
        """The verify stage of a step that drafts nothing (target-only decoding), at the plain scale."""
        return self.profile.verify(tokens, attended) * self.scale("plain")

    def draft_added(self, tokens: float, more: float, attended: float = 0.0) -> float:
        """Seconds that `more` rows (attending to `attended` positions) add to a drafter forward of `tokens`."""
        if self.profile.draft is None:
            return 0.0
        return self.profile.draft.added(tokens, more, attended) * self.scale("draft")

    def verify_added(self, tokens: float, more: float, attended: float = 0.0) -> float:
        """Seconds that `more` tokens (attending to `attended` positions) add to a verify of `tokens`."""
        return self.profile.verify.added(tokens, more, attended) * self.scale("verify")

    def drafting_premium(self, tokens: float, attended: float = 0.0) -> float:
        """What a step's verify of `tokens` pending tokens costs more when the step drafts than when it
        does not (the verify scale over the plain one; 0 when the verify scale is the lower): a
        fixed cost of drafting at all, which the first slot of a step must pay."""
        return max(0.0, self.verify_seconds(tokens, attended) - self.plain_seconds(tokens, attended))

    def per_position(self) -> float:
        """Seconds one attended position costs the two stages together (a slot attends in both)."""
        draft = self.profile.draft.per_context * self.scale("draft") if self.profile.draft else 0.0
        return draft + self.profile.verify.per_context * self.scale("verify")

    def predict(self, forwards: Sequence[tuple[int, int]], verify_tokens: int, verify_attended: int) -> StageTimes:
        """Times of a step with these drafter forwards [(tokens, attended), ...] and this verification
        (none: a target-only step, at the plain scale)."""
        draft = sum(self.draft_seconds(t, a) for t, a in forwards)
        verify = (self.verify_seconds if forwards else self.plain_seconds)(verify_tokens, verify_attended)
        return StageTimes(draft, verify, draft + verify + self.overhead)

    # ---- online correction -----------------------------------------------------------

    def observe(self, forwards: Sequence[tuple[int, int]], verify_tokens: int, verify_attended: int,
                measured: StageTimes, prefill: bool = False) -> None:
        """Move each stage's scale toward measured / profiled, and the overhead toward the remainder.
        The verify stage's time teaches the verify scale if the step drafted, else the plain one,
        and neither in a step that prefilled a prompt (a forward over hundreds of tokens, far past
        the profiled points, says nothing of a decoding step's verify: 740 ms measured against
        1506 predicted for code prompts on the AMD EPYC). Its drafter forward, the prompt's
        catch-up, does teach the draft scale: catch-ups are what entries and probes are priced by."""
        if forwards:
            self.draft_setup = 0.0  # paid: the drafter is ready
        profiled_draft = sum(self.profile.draft(t, a) for t, a in forwards) if self.profile.draft else 0.0
        stages = [("draft", profiled_draft, measured.draft)]
        if not prefill:
            stages.append(("verify" if forwards else "plain", self.profile.verify(verify_tokens, verify_attended),
                           measured.verify))
        for stage, profiled, seconds in stages:
            if profiled > 0 and seconds > 0 and math.isfinite(seconds):
                self.log_scale[stage] += self.alpha * (math.log(seconds / profiled) - self.log_scale[stage])
                self.verify_observations += stage == "verify"
                self.plain_observations += stage == "plain"
                self.draft_observations += stage == "draft"
        if not self.verify_observations:  # an unmeasured verify scale stands in with the other's
            self.log_scale["verify"] = self.log_scale["plain"]
        if not self.plain_observations:
            self.log_scale["plain"] = self.log_scale["verify"]
        if not self.draft_observations:  # the machine's drift, measured on the target, is the drafter's too
            self.log_scale["draft"] = self.log_scale["plain"]
        rest = measured.total - measured.draft - measured.verify
        if math.isfinite(rest):
            self.overhead += self.alpha * (max(0.0, rest) - self.overhead)
        self.observations += 1
