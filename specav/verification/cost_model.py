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

The target's stage is learnt from two kinds of step, `verify` (steps that drafted) and `plain`
(steps that drafted nothing: target-only decoding, the price every rule is held to). They drift
together (one model on the same cores) but differ in level and shape: a drafting step's verify is slower
than a plain one of the same tokens on some machines (the drafting premium), and the traffic
measures them at different token counts. In the traces one scale per kind was not enough either
way. Code at concurrency 4 on a machine running at about half its profiled speed: AV drafted 11
slots per step at 0.76x target-only, because the target-only step its price came from was
predicted with the scale of its own 11-17-token verifies. Prose at concurrency 1 on the Zen 4
EPYC, where AV drafted most steps: the plain scale, measured on a few control steps, stayed at
the profile's 54-64 ms for a one-token step while the machine ran them in 36, so the price of
compute sat a third low and drafting looked cheap.

`attended` is attention's work: the key positions the forward's tokens attend to, summed over
them (`types.attended`: a request's t new tokens over c cached positions attend t * c + t(t-1)/2).
Attention is priced per attended position because it is per token and per cached position
alike: 16 tokens over a 576-token context cost the target 2-4 us per position more than over
64 on this project's AMD EPYC, so a slot of a long request costs more than one of a short one.
A curve is the profile's measured points with attention's share taken out, made monotone
(pool-adjacent-violators, so one noisy point cannot make more tokens look cheaper, with each
pooled run placed at its mean size and the runs joined linearly, so noise makes no flat step
where a verified slot would look free: `monotone`) and interpolated linearly, extended past
the last point with the last segment's slope, plus `per_context` seconds per attended position.

Online correction. Each step the engine reports what it measured, and each stage corrects its
profiled curve by a level and a shape (`_Correction`). The level is a multiplicative scale per
stage (the drafter, and the target's two kinds of step), an exponential moving average in log
space of measured / predicted (half-life `halflife` steps, started from the stage's first
measurements rather than from the profile: `_warm`): a uniform slowdown (thermal throttling, a
noisy neighbour) is followed within a few half-lives whatever its size, and a stale profile never
stays in charge. A stage that a step did not run follows the machine's drift as the stage that
did measured it: after a target-only step, the drafter and the drafting steps' verify move by the
plain level's change; after a drafting step, the plain level moves by the drafter's change, not
by the verify's. Not the verify's, because a drafting step's verify can be off for reasons of its
own, and the plain step is the price every rule is held to: with one level for both kinds, on the
Zen 4 EPYC at prose concurrency 1, two-token verifies that ran about 1.4x a one-token step (the profile:
1.07-1.18x) pushed the shared level up through every stretch of drafting steps, the target-only
steps measured in them ran at 32-33 ms against 44-48 predicted, the price of compute sat a third
low and one-slot drafts that lost ~10% looked like gains (docs/adaptive.md). A stage never
measured has the level of the target's kind last measured. The shape is a log factor per kind of
step and profiled point, learnt more slowly (half-life `shape_halflife` observations) from what
the level leaves unexplained where the forward ran, interpolated between points as the profile
is. A start-up profile is a few timings on a noisy machine and its shape can be wrong where the
decisions are made (Zen 4 EPYC, prose at concurrency 1: a one-token step 36 ms against a
profiled 54.5, two tokens 50 against 63.9, so one scale priced a one-slot step's extra verify at
9 ms instead of 14). A point nothing measures keeps its profiled shape under the level. The
overhead is an EMA of the measured remainder. The profile itself (running the models) lives in
engine/profile.py; this module never runs a model.

Must not know: models, requests, the engine.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from specav.types import StageTimes


def _pooled(sizes: Sequence[float], values: Sequence[float]) -> list[tuple[float, float, int]]:
    """Pool adjacent violators: runs of (size, value) points whose values a least-squares
    non-decreasing fit makes equal, as (mean size, mean value, points) in order of size."""
    blocks: list[list[float]] = []  # [sum of sizes, sum of values, count]
    for x, v in zip(sizes, values):
        blocks.append([float(x), float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            sx, sv, count = blocks.pop()
            blocks[-1][0] += sx
            blocks[-1][1] += sv
            blocks[-1][2] += count
    return [(sx / c, sv / c, int(c)) for sx, sv, c in blocks]


def isotonic(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit of a sequence (pool adjacent violators)."""
    return [mean for _, mean, count in _pooled(range(len(values)), values) for _ in range(count)]


def monotone(sizes: Sequence[float], values: Sequence[float]) -> list[float]:
    """A non-decreasing fit of `values` measured at ascending `sizes`, without flat steps: the
    least-squares monotone fit's pooled runs, each placed at its mean size, joined linearly (and
    extended past the first and last run with their segment's slope, never below 0). The plain
    least-squares fit makes a run that noise inverted flat, and on a flat step the planner's
    rules price a verified slot at nothing (three-repeat profiles of the Zen 4 EPYC had two to four
    of them between 1 and 32 tokens)."""
    if len(values) > 1 and all(b > a for a, b in zip(values, values[1:])):  # nothing to pool (a corrected curve, most steps)
        return [max(0.0, v) for v in values]
    runs = _pooled(sizes, values)
    if len(runs) == 1:
        return [runs[0][1]] * len(sizes)
    xs, ys = [x for x, _, _ in runs], [y for _, y, _ in runs]
    fitted = []
    for x in sizes:
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)  # segment (i - 1, i), the nearest one outside
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        fitted.append(max(0.0, ys[i - 1] + slope * (x - xs[i - 1])))
    return list(itertools.accumulate(fitted, max))  # (non-decreasing to the last bit)


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
        """A monotone curve through measured {tokens: seconds} points (`monotone`)."""
        tokens = sorted(measured)
        return cls(tuple(tokens), tuple(monotone(tokens, [measured[t] for t in tokens])), max(0.0, per_context))

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


def _warm(alpha: float, n: int) -> float:
    """Weight of the n-th observation (from 1) in an EMA of weight `alpha` that starts from its first
    observations, not from its prior: the mean of the first ones, until the EMA's own weight is larger.
    An EMA started at the profile would leave a stage the traffic rarely measures near the profile
    for many of its half-lives (prose at concurrency 1, Zen 4 EPYC: one-token steps measured 36 ms
    against a profiled 54.5, and the first target-only step moved the price of compute by 8% of
    that gap; priced a third low, drafting looked cheap, so target-only steps stayed rare)."""
    return max(alpha, 1.0 / n) if alpha > 0 else 0.0  # alpha 0 (an infinite half-life): frozen


class _Correction:
    """One model's online correction of its profiled curve: per kind of step that runs the model, a
    level (log scale) and a shape (a log factor per profiled point). See the module docstring.

    An observation of kind k with error e = log(measured / predicted) moves k's level by w * e (w =
    alpha once warm, counted over k's own observations: `_warm`), and the points the forward falls
    between by a further beta * share * (1 - w) * e (the shape; beta warm per point as the level,
    share the point's part of the prediction: its interpolation weight times its seconds over the
    predicted seconds, the gradient of the log prediction). The shape is stored centred per kind:
    its mean over the kind's measured points, weighted by their recent evidence (the same shares,
    decayed at the shape's rate), is kept in the kind's level, which then reads as the kind's scale
    where the traffic runs (what attention's per-position cost is scaled by); one point carrying all
    of a kind's traffic leaves its shape at 0. A kind never measured has the level of the kind last
    measured; a measured kind that a step did not run is moved by `follow`, the machine's drift as
    the step's other stage measured it (CostModel.observe)."""

    def __init__(self, curve: CostCurve | None, alpha: float, beta: float, kinds: Sequence[str]) -> None:
        self.profiled = curve
        self.alpha, self.beta = alpha, beta
        self.kinds = tuple(kinds)
        self.levels = {kind: 0.0 for kind in kinds}
        points = len(curve.tokens) if curve is not None else 0
        self.observations = {kind: 0 for kind in kinds}
        self.shape = {kind: [0.0] * points for kind in kinds}  # log factor per kind and profiled point
        self.evidence = {kind: [0.0] * points for kind in kinds}  # decayed shares of the kind's observations
        self.counts = {kind: [0] * points for kind in kinds}  # observations that moved each point
        self.curves = {kind: curve for kind in kinds}  # the profiled curve times exp(shape), made monotone (`curve`)
        self._stale: set[str] = set()  # kinds whose shape moved since their curve was fitted

    @property
    def level(self) -> float:
        """The first kind's level (the target's: the plain step's, the price every rule is held to)."""
        return self.levels[self.kinds[0]]

    def curve(self, kind: str) -> CostCurve | None:
        """The kind's corrected curve (the level aside), fitted when first asked for after its shape
        moved: a step that drafts nothing asks for one of them only."""
        if kind in self._stale:
            p = self.profiled
            self.curves[kind] = CostCurve.fit(
                {t: y * math.exp(f) for t, y, f in zip(p.tokens, p.seconds, self.shape[kind])}, p.per_context)
            self._stale.discard(kind)
        return self.curves[kind]

    def seconds(self, kind: str, tokens: float, attended: float = 0.0) -> float:
        curve = self.curve(kind)
        return curve(tokens, attended) * math.exp(self.levels[kind]) if curve is not None else 0.0

    def added(self, kind: str, tokens: float, more: float, attended: float = 0.0) -> float:
        curve = self.curve(kind)
        return curve.added(tokens, more, attended) * math.exp(self.levels[kind]) if curve is not None else 0.0

    def _shares(self, kind: str, tokens: float, predicted: float) -> list[tuple[int, float]]:
        """The profiled points a forward over `tokens` tokens falls between, with their shares of
        the `predicted` seconds."""
        xs, ys = self.profiled.tokens, self.curve(kind).seconds
        if tokens <= xs[0] or tokens >= xs[-1]:
            j = 0 if tokens <= xs[0] else len(xs) - 1
            return [(j, ys[j] / predicted)] if tokens == xs[j] else [(j, 1.0)]
        i = bisect.bisect_left(xs, tokens)
        u = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        return [(j, w * ys[j] / predicted) for j, w in ((i - 1, 1.0 - u), (i, u)) if w > 0]

    def observe(self, kind: str, forwards: Sequence[tuple[float, float]], seconds: float) -> float:
        """Learn from one measured stage of a `kind` of step: `forwards` [(tokens, attended), ...]
        took `seconds` in all. Returns the drift it says the other kinds should follow: the kind's
        level change once it is warm (its first observations set its own level, they say nothing
        of a drift), 0 where nothing was learnt."""
        curve = self.curve(kind)
        if curve is None or not forwards or not (seconds > 0 and math.isfinite(seconds)):
            return 0.0
        predicted = sum(curve(t, a) for t, a in forwards)
        if predicted <= 0:
            return 0.0
        e = math.log(seconds / (predicted * math.exp(self.levels[kind])))
        before = self.levels[kind]
        self.observations[kind] += 1
        weight = _warm(self.alpha, self.observations[kind])
        self.levels[kind] += weight * e
        moved: dict[int, float] = {}
        for t, _ in forwards:
            for j, share in self._shares(kind, t, predicted):
                moved[j] = moved.get(j, 0.0) + share
        decay = 1.0 - self.beta
        evidence = self.evidence[kind] = [n * decay + moved.get(j, 0.0) for j, n in enumerate(self.evidence[kind])]
        step = {}
        for j, share in moved.items():
            self.counts[kind][j] += 1
            step[j] = _warm(self.beta, self.counts[kind][j]) * share * (1.0 - weight) * e
        total = sum(evidence)
        common = sum(evidence[j] * d for j, d in step.items()) / total if total > 0 else 0.0
        shape = self.shape[kind]
        for j, n in enumerate(evidence):  # kept centred: the move's common mode is the level's (no prediction changes)
            if n > 0:
                shape[j] += step.get(j, 0.0) - common
        self.levels[kind] += common
        self._stale.add(kind)
        for other in self.kinds:  # a kind never measured is the one measured, as far as anything knows
            if not self.observations[other]:
                self.levels[other] = self.levels[kind]
        return self.levels[kind] - before if weight <= self.alpha else 0.0

    def follow(self, drift: float, kinds: Sequence[str] | None = None) -> None:
        """Move the levels of `kinds` (default: every kind) that have been measured by `drift` (log),
        the machine's drift as a stage this step measured it."""
        for kind in self.kinds if kinds is None else kinds:
            if self.observations[kind]:
                self.levels[kind] += drift


class CostModel:
    """Profiled curves under online corrections; predicts stages, learns from measured steps."""

    def __init__(self, profile: CostProfile, halflife: float = 8.0, overhead: float = 0.0,
                 draft_setup: float = 0.0, shape_halflife: float | None = None) -> None:
        """halflife: steps, of each model's level (math.inf: frozen); shape_halflife: observations of a
        profiled point, of its shape (default 4 x halflife: the shape is the machine's, the level its drift);
        draft_setup: seconds the drafter spends once before its first forward (a deferred load,
        drafting/deferred.py), 0 from the first step with a drafter forward on."""
        shape_halflife = 4.0 * halflife if shape_halflife is None else shape_halflife
        for name, value in (("halflife", halflife), ("shape_halflife", shape_halflife)):
            if not value > 0:  # math.inf: never corrected (a frozen model, for tests and replays)
                raise ValueError(f"{name} = {value!r} is invalid: a number of observations > 0")
        if not (math.isfinite(draft_setup) and draft_setup >= 0):
            raise ValueError(f"draft_setup = {draft_setup!r} is invalid: seconds >= 0")
        self.draft_setup = draft_setup
        self.profile = profile
        self.alpha = _decay(halflife)
        beta = _decay(shape_halflife)
        self.draft = _Correction(profile.draft, self.alpha, beta, ("draft",))
        self.target = _Correction(profile.verify, self.alpha, beta, ("plain", "verify"))
        self.overhead = overhead  # seconds per step outside the two models' stages
        self.observations = 0

    def scale(self, stage: str) -> float:
        """A stage's level ("draft", or the target's "plain" or "verify"): its measured / profiled
        time, the shape aside."""
        return math.exp(self.draft.level if stage == "draft" else self.target.levels[stage])

    @property
    def plain_observations(self) -> int:
        """Steps that drafted nothing (the plain kind's evidence)."""
        return self.target.observations["plain"]

    # ---- predictions ------------------------------------------------------------

    def draft_seconds(self, tokens: float, attended: float = 0.0) -> float:
        """One drafter forward (and its sampling) over `tokens` rows."""
        return self.draft.seconds("draft", tokens, attended)

    def verify_seconds(self, tokens: float, attended: float = 0.0) -> float:
        return self.target.seconds("verify", tokens, attended)

    def plain_seconds(self, tokens: float, attended: float = 0.0) -> float:
        """The verify stage of a step that drafts nothing (target-only decoding)."""
        return self.target.seconds("plain", tokens, attended)

    def draft_added(self, tokens: float, more: float, attended: float = 0.0) -> float:
        """Seconds that `more` rows (attending to `attended` positions) add to a drafter forward of `tokens`."""
        return self.draft.added("draft", tokens, more, attended)

    def verify_added(self, tokens: float, more: float, attended: float = 0.0) -> float:
        """Seconds that `more` tokens (attending to `attended` positions) add to a verify of `tokens`."""
        return self.target.added("verify", tokens, more, attended)

    def verify_added_each(self, tokens: float, most: int) -> list[float]:
        """Seconds that 1, 2, ..., `most` more tokens add to a verify of `tokens` (attention aside):
        verify_added(tokens, k) for every k at once, one curve evaluation per k."""
        base = self.verify_seconds(tokens)
        return [self.verify_seconds(tokens + k) - base for k in range(1, most + 1)]

    def drafting_premium(self, tokens: float, attended: float = 0.0) -> float:
        """What a step's verify of `tokens` pending tokens costs more when the step drafts than when it
        does not (the verify stage over the plain one; 0 when the verify stage is the cheaper): a
        fixed cost of drafting at all, which the first slot of a step must pay."""
        return max(0.0, self.verify_seconds(tokens, attended) - self.plain_seconds(tokens, attended))

    def per_position(self) -> float:
        """Seconds one attended position costs the two stages together (a slot attends in both)."""
        draft = self.profile.draft.per_context * self.scale("draft") if self.profile.draft else 0.0
        return draft + self.profile.verify.per_context * self.scale("verify")

    def predict(self, forwards: Sequence[tuple[int, int]], verify_tokens: int, verify_attended: int) -> StageTimes:
        """Times of a step with these drafter forwards [(tokens, attended), ...] and this verification
        (none: a target-only step, by the plain stage)."""
        draft = sum(self.draft_seconds(t, a) for t, a in forwards)
        verify = (self.verify_seconds if forwards else self.plain_seconds)(verify_tokens, verify_attended)
        return StageTimes(draft, verify, draft + verify + self.overhead)

    # ---- online correction -----------------------------------------------------------

    def observe(self, forwards: Sequence[tuple[int, int]], verify_tokens: int, verify_attended: int,
                measured: StageTimes, prefill: bool = False) -> None:
        """Correct each stage toward what was measured, and the overhead toward the remainder.
        The verify stage's time teaches the verify stage if the step drafted, else the plain one,
        and neither in a step that prefilled a prompt (a forward over hundreds of tokens, far past
        the profiled points, says nothing of a decoding step's verify: 740 ms measured against
        1506 predicted for code prompts on the AMD EPYC). Its drafter forward, the prompt's
        catch-up, does teach the draft stage: catch-ups are what entries and probes are priced by.

        What a decoding step did not run follows the machine's drift as the step measured it: after
        a plain step, the drafter and the drafting steps' verify follow the plain step's; after a
        drafting step, the plain step follows the drafter's, not the verify's (a drafting step's
        verify can be off for reasons of its own, which would carry into the price every rule is
        held to: the module docstring). A stage never measured has the level of the target's kind
        last measured (a slower machine slows both models)."""
        if forwards:
            self.draft_setup = 0.0  # paid: the drafter is ready
        draft_drift = self.draft.observe("draft", forwards, measured.draft)
        if not prefill:
            kind = "verify" if forwards else "plain"
            drift = self.target.observe(kind, [(verify_tokens, verify_attended)], measured.verify)
            if forwards:
                self.target.follow(draft_drift, ("plain",))
            else:
                self.target.follow(drift, ("verify",))
                self.draft.follow(drift)
        if not self.draft.observations["draft"]:  # the machine's drift, measured on the target, is the drafter's too
            self.draft.levels["draft"] = self.target.levels["verify" if forwards else "plain"]
        rest = measured.total - measured.draft - measured.verify
        if math.isfinite(rest):
            self.overhead += _warm(self.alpha, self.observations + 1) * (max(0.0, rest) - self.overhead)
        self.observations += 1
