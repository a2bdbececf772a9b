"""Adaptive verification: draft only as far as drafts pay, and verify only the slots that pay.

Owns the adaptive planner: its price of compute, its per-request history, and its three rules.
Every rule compares an expected gain in tokens with a cost in seconds converted to tokens by
the price lambda (tokens per second): maximising the long-run rate tokens / seconds is
maximising tokens - lambda * seconds at the optimal rate, and lambda is re-estimated from
measured steps (Dinkelbach's iteration). lambda = max(`min_speedup`, the batch's measured
speed-up over target-only decoding) x the target-only rate of the current batch, so nothing is
drafted or verified unless it buys tokens faster than plain decoding would, by a margin
(min_speedup, default 1.05) against the errors of the predictions: with AV on, speculation is
meant to never be slower. The speed-up is each request's own (an EMA over its steps, 1 for a
new request), averaged over the batch: every request must be served, so the time a step takes
is worth what the requests in it could do with it, not what other traffic did (one global
rate, lifted by a run of code, would price a prose request's drafts that beat plain decoding
out; only the wait's value, below, expects a new request to be like the traffic). A request's
share of a step's measured time is its target-only share plus the step's extra time split over
the requests by the predicted cost of their slots.

Rules (survival s_i = product of a request's confidences 1..i, architecture.md):

* Draft (before each drafter forward j = 1..K, the early stop). Each request that may draft
  slot j expects gain g = the value of its best block from slot j on: sum over i = j..n of
  s_{j-1} * c_j * ... * c_i, less the price of its slots past j, maximised over n, where the
  confidences are the estimator's at each position for the request's latest feature (slot
  j-1's, or for j = 1 its recent blocks and the population's, their survivals averaged and
  scaled by what such predictions of slot 1 have turned out to be: the no-draft decision,
  BlockSamples, FirstSlotCheck). A block, not slot j alone, because the first verified slot
  costs more than the next ones and a drafted slot opens the deeper ones: valued alone, slots
  that pay as a block would stop (deeper slots are priced at a row's share of a forward, shared
  by the requests that draft: at slot 1, by those the rule chooses, and for a catch-up, by the
  requests drafting now). Sorted by net gain (g less the price of its slot's own costs), the
  requests drafting slot j are the prefix n that maximises sum(g) - lambda * (drafter forward
  over their tokens + their n verified slots + attention to their contexts in both models),
  and at slot 1 of a step nothing else drafts in, once, the drafting premium
  (cost_model.py: a step that drafts verifies slower than one that does not); n = 0 stops
  drafting. Lossless: it reads q_1..q_{j-1} of the request and anything of the others, never
  x_j or what follows from it.
* Skip and probe. A request the rule leaves out at slot 1 (its block valued beside the wait
  that not drafting commits it to: `_wait_value`) does not draft for `probe_interval` steps (it
  decodes target-only; its drafter catches up on the skipped tokens in one packed forward when
  it drafts again), then drafts slot 1 whatever the rule says, so fresh features can bring it
  back (a code block in a chat answer). A probe that does not lead to slot 2 doubles the wait,
  up to `max_probe_interval`. Probes are paid from a budget, `probe_share` of the measured step
  time: a probe's catch-up costs the drafter a forward over every token skipped, so probing on
  a timer alone would cost a fixed share of compute (about 1.5-4 ms per skipped token on this
  project's CPUs) however rarely it ran (the cold start, below, is paid from it too). A due
  probe waits while the budget is in debt; out of debt, it pays its price (the drafter forward
  over its pending tokens and one verified slot), into debt if need be: the price grows by a
  skipped token's catch-up every step it waits, faster than the budget at concurrency 1, so
  waiting for the whole price would be waiting for ever. A probe is no learning where the
  traffic says it pays: if, the step it falls due, drafting would repay the request's catch-up
  were the request like the traffic's recent requests (the catch-up rule's value of a new
  request, below), it runs outside the budget (a code request that stopped on a hard stretch
  was held by the cold start's debt for the rest of its answer: 73 of 93 steps target-only).
* Catch-up. A request whose drafter has more than the usual one or two tokens to catch up on
  (a new request's prompt) joins the draft rule only if drafting is predicted to beat
  target-only decoding, over its remaining tokens, by more than the catch-up costs (the value
  per step of drafting its best number of slots, predicted from its recent blocks, at the
  target-only rate, times its expected remaining steps; for a new request, the mean of that
  value over the traffic's recent requests, each counted only where drafting would gain: an
  entry is an option, as the rules stop drafting where it does not pay); otherwise it decodes
  target-only and is probed later like a request that stopped.
* Cold start. With nothing known (no request has drafted yet), one request drafts and has
  verified its whole block, as an exploring request does: of the requests that have emitted
  `cold_start_after` tokens (an answer's first tokens are its least predictable, and this one
  block stands for all traffic until more is drafted), the one whose drafter has the fewest
  tokens to catch up on. Until one has, every request decodes target-only; after the block, the
  others wait one step for the population's blocks, which then stand in for a new request's
  own history. A whole block, because one slot's feature would stand for the whole population:
  a first slot rejected made every later request's catch-up look unpaid (code at concurrency 1:
  the first two requests never drafted). Only where learning could pay: if every draft were
  accepted, drafting the best block (its rows a whole drafter forward each, as an entrant's are
  where nothing else drafts) must beat target-only decoding over the batch's remaining
  tokens by more than the cold start costs (the catch-up, the whole block, and the drafter's
  load where it is deferred until a plan first drafts: `CostModel.draft_setup`). Where even a
  perfect drafter would not repay it (a short request, or a machine whose verification costs
  several one-token forwards), nothing drafts, and a deferred drafter is never loaded; the bound
  is checked every step with that step's cost model. The cold start is learning like a probe,
  and the dearest: it waits while the probe budget is in debt and takes its price (catch-up and
  block) from it, so the probes after it wait until the budget has earned it back.
* Admit (the plan stage, the trim). Drafting is sunk by then, so a slot pays if its survival
  s >= lambda * (marginal verify seconds, attention to the request's context included). All
  drafted slots of the batch are scanned in descending survival (ties by position, then by
  request), admitting each slot that pays; the first of a request's slots that does not pay
  closes the request (its deeper slots survive less and cost as much). A request's survival
  never rises along its draft, so its admitted slots are a prefix; whether slot i is admitted
  depends only on slots ranked above it, which are other requests' slots and its own shallower
  ones: lossless. (An argmax over budgets would look at the request's deeper slots and is
  lossy: tests/test_adaptive_lossless.py shows the distribution tests catch it.)
* Control. In a share of steps (`control_share`, drawn from the planner's own generator), and
  in the first step after the cold start until one has been measured, the whole batch decodes
  target-only, so the cost model's target-only step, the price every rule is held to, stays
  measured while every request drafts (cost_model.py: the plain kind of step).
* Explore. Each step every request, with a probability drawn from the planner's own generator
  (never from the drafts), drafts and verifies its whole block, so deep positions keep getting
  labels while the rules above trim. The probability is set from the cost model so exploring
  takes the configured share of compute (`exploration`) at any concurrency. Only requests
  whose drafter is caught up explore (a catch-up is a probe's, paid from its budget).

Must not know: models, the rejection sampler, the engine, the server.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from specav.acceptance.features import require_lossless
from specav.acceptance.scorer import Scorer
from specav.config import AdaptiveConfig
from specav.request import Request
from specav.types import DraftBatch, Plan, Scores, StepRecord, attended
from specav.verification.cost_model import CostModel, _decay
from specav.verification.planner import DraftPlan, RequestShape, register

HISTORY_DECAY = 0.7  # per step: how much of a request's evidence carries into the next step it drafts
HISTORY_BLOCKS = 8  # a request's latest drafted blocks kept (older ones weigh < 0.7 ** 8)
POPULATION_REQUESTS = 8  # the population: the latest requests that drafted ...
REQUEST_BLOCKS = 16  # ... each with its latest drafted blocks
_PRIOR_BLOCKS = 1.0  # the population's blocks count as this many of the request's own blocks
_SCORED_BLOCKS = 4096  # blocks whose confidences the planner keeps (a bound: it forgets all past it)
_CAUGHT_UP = 2  # drafter pending tokens of a request that drafted last step (its final token, maybe x_K)


@dataclass(slots=True)
class BlockSamples:
    """Recent drafted blocks (each its slots' features, slot 1 first), each with a weight that
    decays per step: samples of the next block, what predicts a request's slots before it drafts.

    A block, not its slots one by one: a block's deeper slots continue the drafter's own guesses,
    which it is surer of than of the target's next token, so a deep slot's feature is no sample
    of a slot 1 (on prose at concurrency 4, a cold start whose slot 1 was doubtful and rejected
    but whose slots 2-8 were sure made every new request expect 0.9 tokens from slot 1 and 6.7
    from a block of 8; all four entered and lost). Each block is scored at its own positions and
    its survivals are averaged with the others' (a confidence is not linear in the feature: the
    mean feature's would overstate it; docs/adaptive.md, "Predicting a request's next slots")."""

    blocks: list[list[float]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, blocks: Iterable[Sequence[float]], weight: float = 1.0) -> "BlockSamples":
        blocks = [list(b) for b in blocks]
        return cls(blocks, [weight] * len(blocks))

    def add(self, blocks: Iterable[Sequence[float]], decay: float, keep: int) -> None:
        """A step passed (older weights times `decay`) and drafted `blocks`; keep the latest `keep`."""
        new = [list(b) for b in blocks if len(b)]
        self.blocks = (self.blocks + new)[-keep:]
        self.weights = ([w * decay for w in self.weights] + [1.0] * len(new))[-keep:]
        if self.weights and max(self.weights) < 1e-100:  # long without a draft: keep the ratios, not underflow
            top = max(self.weights)
            self.weights = [w / top for w in self.weights]

    @property
    def total(self) -> float:
        return sum(self.weights)

    def with_prior(self, prior: "BlockSamples", worth: float) -> tuple[list[list[float]], list[float]]:
        """These blocks and the prior's, the prior's weights scaled to weigh `worth` blocks in all."""
        blocks, weights = self.blocks, self.weights
        if prior.blocks and prior.total > 0:
            scale = worth / prior.total
            blocks, weights = blocks + prior.blocks, weights + [w * scale for w in prior.weights]
        return list(blocks), list(weights)


@dataclass(slots=True)
class Population:
    """The traffic's drafted blocks, request by request: the latest `POPULATION_REQUESTS` requests
    that drafted (live or finished), each with its latest `REQUEST_BLOCKS` blocks, every request
    weighing alike, whatever its number of blocks or steps. What a new request is predicted to be
    like (any of them: `AdaptivePlanner._entry_pays`), and the prior of a request's own blocks.

    By request, not by step: the next request is drawn from the traffic's requests, not from its
    latest steps. Decayed per step, at concurrency 1 the traffic was the last request's last
    blocks, and one code request whose drafts failed (an answer's first tokens) made the next
    four refuse entries that would have paid (code at concurrency 1, 0.98x target-only in two runs
    of the same command that read 1.23-1.32x in others: docs/adaptive.md)."""

    requests: dict[str, list[list[float]]] = field(default_factory=dict)  # oldest drafting first
    speedups: dict[str, float] = field(default_factory=dict)  # of those requests, the latest measured speed-up

    @classmethod
    def of(cls, blocks: Iterable[Sequence[float]], request_id: str = "traffic") -> "Population":
        """One request's blocks (tests and replays)."""
        population = cls()
        for block in blocks:
            population.add(request_id, block)
        return population

    def add(self, request_id: str, block: Sequence[float]) -> None:
        """Request `request_id` drafted `block` (its slots' features, slot 1 first)."""
        if not len(block):
            return
        blocks = self.requests.pop(request_id, [])  # re-inserted: the latest to draft
        self.requests[request_id] = (blocks + [list(block)])[-REQUEST_BLOCKS:]
        while len(self.requests) > POPULATION_REQUESTS:
            self.speedups.pop(oldest := next(iter(self.requests)), None)
            del self.requests[oldest]

    def measured(self, request_id: str, speedup: float) -> None:
        """Request `request_id`'s measured speed-up is now `speedup` (kept if it is one of the population's)."""
        if request_id in self.requests:
            self.speedups[request_id] = speedup

    def speedup(self, excluding: str = "") -> float:
        """The mean measured speed-up of the population's requests (but `excluding`); 1 with none."""
        values = [v for r, v in self.speedups.items() if r != excluding]
        return sum(values) / len(values) if values else 1.0

    @property
    def blocks(self) -> list[list[float]]:
        return [block for blocks in self.requests.values() for block in blocks]

    def prior(self) -> BlockSamples:
        """Every request's blocks, each request's weighing 1 / (number of requests)."""
        n = len(self.requests)
        return BlockSamples([b for blocks in self.requests.values() for b in blocks],
                            [1.0 / (n * len(blocks)) for blocks in self.requests.values() for _ in blocks])


def block_features(blocks: Sequence[Sequence[float]], num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks as the inputs of `block_survival`: their features # [M, K], past a block's end its
    last slot's, and which of their slots were drafted # [M, K] bool."""
    features = torch.tensor([(list(b) + list(b[-1:]) * num_slots)[:num_slots] for b in blocks],
                            dtype=torch.float64).reshape(len(blocks), num_slots)
    drafted = torch.arange(num_slots)[None, :] < torch.tensor([len(b) for b in blocks])[:, None]
    return features, drafted


@dataclass(slots=True)
class SurvivalSums:
    """What `block_survival` sums over a set of weighted blocks, per slot i: over the blocks that
    drafted slot i (with weight > 0), their weighted survival to slot i and to slot i - 1, and the
    same over every block (extended past its end by its last slot's confidence), for the slots no
    block drafted. The sums of a union of sets are the sums of their sums, so the population's are
    kept request by request and only a request that drafted again is summed again: gathered into
    tensors and reduced every step, the slot-1 prediction took 1 ms a step at concurrency 1 (chat,
    2% of a step with the stop rule's share). Plain Python: a handful of numbers per slot."""

    drafted_num: list[float]
    drafted_den: list[float]
    all_num: list[float]
    all_den: list[float]
    seen: list[bool]

    @classmethod
    def zero(cls, num_slots: int) -> "SurvivalSums":
        return cls([0.0] * num_slots, [0.0] * num_slots, [0.0] * num_slots, [0.0] * num_slots,
                   [False] * num_slots)

    @classmethod
    def of(cls, confidences: Sequence[Sequence[float]], lengths: Sequence[int], weights: Sequence[float],
           num_slots: int) -> "SurvivalSums":
        """Blocks' confidences # [M][K] (scored at their positions; past a block's end, its last
        slot's feature), how many slots each drafted # [M] and their weights # [M]."""
        sums = cls.zero(num_slots)
        for c, n, w in zip(confidences, lengths, weights):
            if w <= 0:
                continue
            before = 1.0
            for i in range(num_slots):
                after = before * c[i]
                sums.all_num[i] += w * after
                sums.all_den[i] += w * before
                if i < n:
                    sums.drafted_num[i] += w * after
                    sums.drafted_den[i] += w * before
                    sums.seen[i] = True
                before = after
        return sums

    def plus(self, other: "SurvivalSums", scale: float = 1.0) -> "SurvivalSums":
        """These blocks and `other`'s, its weights times `scale`."""
        def add(x: list[float], y: list[float]) -> list[float]:
            return [a + scale * b for a, b in zip(x, y)]
        return SurvivalSums(add(self.drafted_num, other.drafted_num), add(self.drafted_den, other.drafted_den),
                            add(self.all_num, other.all_num), add(self.all_den, other.all_den),
                            [a or (b and scale > 0) for a, b in zip(self.seen, other.seen)])

    def survival(self) -> list[float]:
        """The next block's survival of slots 1..K (`block_survival`)."""
        out, s = [], 1.0
        for i, seen in enumerate(self.seen):
            num, den = (self.drafted_num[i], self.drafted_den[i]) if seen else (self.all_num[i], self.all_den[i])
            s *= num / den if den > 0 else 0.0
            out.append(s)
        return out


def block_survival(confidences: torch.Tensor, weights: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """The next block's survival of slots 1..K # [K], from past blocks' confidences # [M, K]
    (each slot scored at its position; past a block's end, its last slot's feature stands for the
    deeper slots), their weights # [M] and which of their slots were drafted # [M, K] bool (a
    prefix of each block). The planner keeps the sums (`SurvivalSums`); this is their meaning.

    A product-limit estimate: slot i survives slot i - 1 with the ratio, over the blocks that drafted
    slot i, of their weighted survival to slot i and to slot i - 1, so a block the stop rule ended
    at slot j counts up to slot j (its doubtful last slot included) and not past it, where the next
    block's stop rule would end it too: extended by that doubtful feature, such blocks made a code
    request's blocks of 8 worth 4.5 tokens where they yield 6-7, and refused entries that pay. Where
    no block drafted slot i, all of them stand in, extended. With every block drafted to K it is
    the weighted mean of their survivals (a confidence is not linear in the feature: the survival
    of a mean feature would overstate it)."""
    k = confidences.shape[-1]
    sums = SurvivalSums.of(confidences.tolist(), drafted.sum(-1).tolist(), weights.tolist(), k)
    return torch.tensor(sums.survival(), dtype=torch.float64)


@dataclass(slots=True)
class FirstSlotCheck:
    """The draft rule's predictions of slot 1 against what the drafted slot 1 turned out to be.

    Before a request's first drafter forward its slot 1 is predicted from its past blocks, and the
    rule drafts where that prediction is high: over the decisions that drafted, the prediction
    overstates the slot (regression to the mean under selection; on prose at concurrency 1 the rule
    drafted at a loss, docs/adaptive.md). What the slot turned out to be is its confidence from its
    own feature (the estimator's, calibrated against labels), known for every slot 1 drafted, where
    a label exists only for the slots the trim then admits (those the feature already says are
    sure). The ratio of the two, summed over recent decisions (decayed by half-life, with one token
    of evidence for a ratio of 1), scales every block predicted from past blocks. Lossless: it is
    read before a step's drafts, from earlier steps' drafts."""

    halflife: float  # decisions; 0: no check (the ratio stays 1), math.inf: never forgets
    predicted: float = 0.0  # decayed sums over decisions of slot 1's predicted confidence ...
    realized: float = 0.0  # ... and of its confidence once drafted
    prior: float = 1.0  # tokens of evidence for a ratio of 1

    @property
    def ratio(self) -> float:
        return (self.realized + self.prior) / (self.predicted + self.prior)

    def add(self, predicted: float, realized: float) -> None:
        if self.halflife > 0 and math.isfinite(predicted) and math.isfinite(realized):
            decay = 0.5 ** (1.0 / self.halflife)
            self.predicted = self.predicted * decay + predicted
            self.realized = self.realized * decay + realized


@dataclass(slots=True)
class _History:
    """What the planner remembers of one request between steps."""

    samples: BlockSamples = field(default_factory=BlockSamples)  # its drafted blocks' features
    wait: int = 0  # steps left before it may draft again
    interval: int = 1  # the wait after its next probe that does not pay
    probing: bool = False  # its next slot 1 is drafted whatever the rule says (after a wait)
    invest: bool = False  # that probe repays its catch-up if the request is like the traffic: unbudgeted
    speedup: float = 1.0  # EMA of its measured rate / its target-only rate (the price of compute)
    measured: int = 0  # decoding steps that EMA has measured
    first_predicted: float = math.nan  # slot 1's confidence as the draft rule last predicted it (unscaled)


def select_prefix(gains: Sequence[float], tokens: Sequence[int], committed_tokens: int, price: float,
                  forward_seconds, slot_seconds: Sequence[float], fixed_seconds: float = 0.0) -> int:
    """How many of the candidates (in the order given: best first) join a forward.

    gains: expected tokens of each candidate's next slot; tokens: what each feeds the forward;
    committed_tokens: tokens already in the forward (0: the forward's whole cost is at stake);
    forward_seconds(tokens) -> seconds; slot_seconds: what each candidate's slot costs beyond its
    tokens' share of the forward (verifying it, and attention in both models); fixed_seconds: paid
    once if any candidate joins (the drafting premium of a step nothing else drafts in).
    Maximises sum(gains[:n]) - price * (forward(committed + tokens[:n]) - forward(committed)
    + sum(slot_seconds[:n]) + fixed_seconds [n > 0]) over n.
    """
    base = forward_seconds(committed_tokens) if committed_tokens else 0.0
    best_n, best, gain, fed, extra = 0, 0.0, 0.0, committed_tokens, fixed_seconds
    for n, (g, t, e) in enumerate(zip(gains, tokens, slot_seconds), start=1):
        gain += g
        fed += t
        extra += e
        value = gain - price * (forward_seconds(fed) - base + extra)
        if value > best:
            best_n, best = n, value
    return best_n


def _no_draft(batch: int, shapes: Sequence[RequestShape]) -> DraftPlan:
    """A step in which no request drafts (nothing is priced: no rule has anything to decide)."""
    return DraftPlan([0] * batch, None, None, math.nan, tuple(shapes), ("",) * batch)


class _Prices:
    """One step's prices, each computed when a rule first asks for it: in a step where every request
    waits (most steps where drafts do not pay) no rule asks, and the planner's work stays small
    beside the one-token forward it plans (an AV step that drafts nothing costs target-only's)."""

    def __init__(self, planner: "AdaptivePlanner", requests: Sequence[Request],
                 shapes: Sequence[RequestShape]) -> None:
        self._planner, self._requests, self._shapes = planner, requests, shapes

    @functools.cached_property
    def price(self) -> float:
        """lambda, what a second of this batch's compute must buy (`AdaptivePlanner.price`)."""
        return self._planner.price(self._requests, self._shapes)

    @functools.cached_property
    def catch_up(self) -> float:
        """Tokens per second a catch-up (an entry, the cold start) must beat: min_speedup x target-only."""
        return self._planner.config.min_speedup * self._planner.target_only_rate(self._shapes)

    @functools.cached_property
    def entry_row(self) -> float:
        """An entrant's drafter row: shared by the requests drafting now (caught up: they drafted last
        step), and so is the cold start's, whose request drafts alone."""
        return self._planner._draft_row(1 + sum(1 for s in self._shapes if s.draft_pending <= _CAUGHT_UP))


class _SurvivalStop:
    """The draft rule for one step: after each slot, which requests draft the next one.

    Runs after every drafter forward, so its per-request state is plain Python (at concurrency 1 a
    step asks it up to K - 1 times, and tensor ops on a handful of numbers cost more than the math)."""

    def __init__(self, planner: "AdaptivePlanner", forced: Sequence[bool], price: float, verify_tokens: int,
                 shapes: Sequence[RequestShape]) -> None:
        self.planner = planner
        self.forced = list(forced)  # [B] bool: exploring requests draft every slot
        self.price = price
        self.survival = [1.0] * len(self.forced)  # [B] s_j of the last drafted slot
        self.verify_tokens = verify_tokens  # tokens verification will pack if every drafted slot is admitted
        self.shapes = shapes

    def keep_drafting(self, slot: int, rows: Sequence[int], features: dict[str, torch.Tensor]) -> torch.Tensor:
        p = self.planner
        f = features[p.scorer.feature].to(torch.float64)  # [A]
        # each request's feature scored at every position: its slot's confidence, and what it
        # predicts of the deeper slots (nothing of this step's drafts past it)
        confidences = torch.nan_to_num(p.scorer.score(f[:, None].expand(-1, p.num_slots)), nan=0.0).tolist()
        for r, c in zip(rows, confidences):
            self.survival[r] *= c[slot]
        self.verify_tokens += len(rows)
        keep = [self.forced[r] for r in rows]  # [A]
        free = [j for j, forced in enumerate(keep) if not forced]
        if slot + 1 < p.num_slots and free:
            attended = [self.shapes[rows[j]].slot_attended + slot + 1 for j in free]
            expected = []  # per free request, expected accepted tokens of drafting 1, 2, ... more slots
            for j in free:
                survival, total, row = self.survival[rows[j]], 0.0, []
                for c in confidences[j][slot + 1:]:
                    survival *= c
                    total += survival
                    row.append(total)
                expected.append(row)
            gains = p.best_blocks(expected, self.price, self.verify_tokens, p._draft_row(len(rows)), attended)
            for j in p.choose(gains, [1] * len(free), len(rows) - len(free), self.price, self.verify_tokens,
                              attended):
                keep[free[j]] = True
        return torch.tensor(keep, dtype=torch.bool)


@register("adaptive")
class AdaptivePlanner:
    """Survival-ranked drafting and admission under a price of compute (see the module docstring)."""

    name = "adaptive"
    uses_confidences = True

    def __init__(self, num_slots: int, scorer: Scorer, cost: CostModel,
                 config: AdaptiveConfig = AdaptiveConfig(), **_: object) -> None:
        require_lossless(scorer.feature)  # trimming on a feature that reads x_i would be lossy
        self.num_slots = num_slots
        self.scorer = scorer
        self.cost = cost
        self.config = config
        # exploration and control steps only, never the drafts; Python's, not a torch generator: drawn
        # every step, where a torch op costs tens of us on the caches a forward left cold
        self.random = random.Random(config.seed)
        self.rate_alpha = _decay(config.rate_halflife)
        self.history: dict[str, _History] = {}
        self.population = Population()  # the traffic's drafted blocks, by request (new requests' prior)
        self.probe_budget = 0.0  # seconds of compute probes may still spend (probe_share of measured steps)
        self.check = FirstSlotCheck(config.check_halflife)  # the draft rule's slot 1, predicted against drafted
        self._control = False  # this step is a control step (the whole batch target-only)
        self._scored: dict[tuple[float, ...], list[float]] = {}  # blocks' confidences (_block_confidences)
        self._scored_version = scorer.version
        self._population_cache: dict[str, tuple[list[list[float]], SurvivalSums]] = {}  # _population_sums

    # ---- the price of compute -------------------------------------------------------

    def target_only_rate(self, shapes: Sequence[RequestShape]) -> float:
        """Tokens per second of target-only decoding of these requests, as the cost model predicts it:
        one token each over their contexts (a prefill step's slow rate is not the price of time)."""
        seconds = self.cost.plain_seconds(len(shapes), sum(s.context + s.pending - 1 for s in shapes))
        return len(shapes) / max(seconds + self.cost.overhead, 1e-9)

    def price(self, requests: Sequence[Request], shapes: Sequence[RequestShape]) -> float:
        """lambda: tokens per second a second of this batch's compute is worth (see the module docstring)."""
        speedup = sum(self._history(r).speedup for r in requests) / max(len(requests), 1)
        return max(self.config.min_speedup, speedup) * self.target_only_rate(shapes)

    def exploration_probability(self, shapes: Sequence[RequestShape]) -> float:
        """Per request this step: exploring then costs `exploration` x the step's time on average
        (a block is K drafter forwards and K more verified tokens, priced as if nothing else drafted)."""
        if self.config.exploration <= 0 or not shapes:
            return 0.0
        pending = sum(s.pending for s in shapes)
        slot_attended = sum(s.slot_attended for s in shapes) / len(shapes)
        step = len(shapes) / self.target_only_rate(shapes)  # a decoding step, not this step's prefill
        block = self.num_slots * self.cost.draft_seconds(1, slot_attended) + \
            self.cost.verify_added(pending, self.num_slots, self.num_slots * slot_attended)
        return min(1.0, self.config.exploration * step / (len(shapes) * max(block, 1e-12)))

    def choose(self, gains: list[float], tokens: list[int], committed_tokens: int, price: float,
               verify_tokens: int, attended: list[int], fixed_seconds: float = 0.0) -> list[int]:
        """Indices of the candidates that join the next drafter forward (the draft rule); attended:
        the positions each candidate's slot attends to (in both models); fixed_seconds: see select_prefix."""
        verify_marginal, per_position = self.cost.verify_added(verify_tokens, 1), self.cost.per_position()
        extra = [verify_marginal + per_position * a for a in attended]
        order = sorted(range(len(gains)), key=lambda i: (-(gains[i] - price * extra[i]), i))  # best net gain first
        n = select_prefix([gains[i] for i in order], [tokens[i] for i in order], committed_tokens, price,
                          self.cost.draft_seconds, [extra[i] for i in order], fixed_seconds)
        return order[:n]

    # ---- draft ---------------------------------------------------------------------------

    def draft_plan(self, requests: Sequence[Request], max_slots: Sequence[int],
                   shapes: Sequence[RequestShape]) -> DraftPlan:
        b = len(requests)
        prices = _Prices(self, requests, shapes)
        self._control = self.config.control_share > 0 and b > 0 and bool(self.population.requests) and (
            not self.cost.plain_observations  # the first step after the cold start, until one is measured
            or self.random.random() < self.config.control_share)
        if self._control:  # the whole batch decodes target-only (see the module docstring)
            return _no_draft(b, shapes)
        cold_start = self._cold_start(requests, max_slots, shapes, prices)
        if not cold_start and not any(self._known(self._history(r)) for r in requests):
            return _no_draft(b, shapes)  # nothing known, and learning would not pay: nothing to draw
        draws = [self.random.random() for _ in range(b)]  # drawn every step, used or not
        eligible = [m > 0 and s.draft_pending <= _CAUGHT_UP for m, s in zip(max_slots, shapes)]
        probability = self.exploration_probability(shapes) if any(eligible) else 0.0
        explore = [e and u < probability for u, e in zip(draws, eligible)]  # [B]
        num_slots = [0] * b
        reasons = [""] * b
        forced: list[int] = []
        candidates: list[int] = []
        pending = sum(s.pending for s in shapes)  # tokens the target verifies before any slot
        for i in cold_start:
            forced.append(i)
            num_slots[i] = max_slots[i]
            reasons[i] = "cold start"
            explore[i] = True  # its whole block is drafted and verified
        for i, (request, m) in enumerate(zip(requests, max_slots)):
            h = self._history(request)
            if m == 0 or i in forced or not self._known(h):
                continue
            if explore[i]:
                forced.append(i)
                reasons[i] = "explore"
            elif h.probing:
                if not (h.invest or self._pay_learning(shapes[i], 1)):
                    continue  # due, but the budget is in debt
                forced.append(i)
                reasons[i] = "probe"
            elif h.wait > 0:
                h.wait -= 1
                if h.wait == 0:  # due: valued once, the step it falls due
                    h.probing = True
                    h.invest = self._traffic_repays(request, shapes[i], len(shapes), prices.catch_up,
                                                    prices.entry_row)
                continue
            elif shapes[i].draft_pending > _CAUGHT_UP and \
                    not self._entry_pays(request, shapes[i], len(shapes), prices.catch_up, prices.entry_row):
                h.wait = h.interval  # catching up would not pay: decode target-only, probe later
                continue
            else:
                candidates.append(i)
                reasons[i] = "rule"
            num_slots[i] = m
        chosen = self._choose_first_slot(requests, candidates, forced, prices, shapes)
        for i in candidates:
            if i not in chosen:  # the no-draft decision: decode target-only for a while
                num_slots[i] = 0
                reasons[i] = ""
                h = self._history(requests[i])
                h.wait = h.interval
        if not any(num_slots):
            return _no_draft(b, shapes)
        stop = _SurvivalStop(self, explore, prices.price, pending, shapes)
        return DraftPlan(num_slots, stop, torch.tensor(explore, dtype=torch.bool), prices.price, tuple(shapes),
                         tuple(reasons))

    def _cold_start(self, requests: Sequence[Request], max_slots: Sequence[int],
                    shapes: Sequence[RequestShape], prices: _Prices) -> list[int]:
        """With nothing known yet, the one request that drafts: the cheapest catch-up, if learning
        could pay at all (see the module docstring)."""
        if self.population.requests:
            return []
        unknown = [i for i, (r, m) in enumerate(zip(requests, max_slots))
                   if m > 0 and not self._known(self._history(r))]
        ready = [i for i in unknown if len(requests[i].output_ids) >= self.config.cold_start_after]
        if not ready:
            return []  # (an answer's first tokens are its least predictable: AdaptiveConfig.cold_start_after)
        first = min(ready, key=lambda i: (shapes[i].draft_pending, i))
        remaining = sum(requests[i].remaining for i in unknown)
        pays = self._cold_start_pays(shapes[first], remaining, len(shapes), prices.catch_up, prices.entry_row)
        return [first] if pays and self._pay_learning(shapes[first], max_slots[first]) else []

    def _cold_start_pays(self, shape: RequestShape, remaining: int, pending: int, rate: float,
                         draft_row: float) -> bool:
        """Whether the cold start could repay its price if every draft were accepted: drafting the
        best block with nothing rejected must beat target-only decoding (`rate` tokens per second),
        over the batch's `remaining` tokens, by more than the cold start costs (the request's
        catch-up and its whole block drafted and verified). Optimism bounds what learning can buy:
        where even a perfect drafter would not repay the block that teaches the population, nothing
        is drafted, and the bound is checked again every step, by the cost model of that step."""
        perfect = [list(range(1, self.num_slots + 1))]  # accepted tokens of blocks 1..K
        return self._drafting_repays(perfect, shape, remaining, pending, rate, draft_row, whole_block=True)

    def _entry_pays(self, request: Request, shape: RequestShape, pending: int, rate: float,
                    draft_row: float) -> bool:
        """Whether a request's drafter should catch up (a new request's prompt, or tokens skipped):
        an investment, worth it when drafting is predicted to beat target-only decoding (`rate`
        tokens per second) by more over the request's remaining tokens than the catch-up costs.
        Priced at `draft_row` seconds per drafted row, after the `pending` tokens of the batch's
        decoding steps (one per request: the steps the investment pays off in, not this one, which
        may be a prompt's prefill: a block and a drafting premium priced on a 150-token prefill
        refused every entry on code). A request that drafted before is predicted from its recent
        blocks and the population's, as at slot 1. A new one may turn out like any of the traffic's
        recent requests (`Population`), and entering buys an option: the rules go on drafting only
        while drafting pays, so it is worth the mean over those requests of what drafting would
        gain were it like each, nothing where it would gain nothing (valued at the traffic's mean
        block, one request whose drafts failed refused the next ones whose drafts would have paid)."""
        if not self._history(request).samples.blocks:
            return self._traffic_repays(request, shape, pending, rate, draft_row)
        expected = self._predicted_blocks([request])
        return self._drafting_repays(expected, shape, request.remaining, pending, rate, draft_row)

    def _traffic_repays(self, request: Request, shape: RequestShape, pending: int, rate: float,
                        draft_row: float) -> bool:
        """Whether drafting would repay the request's catch-up were it like the traffic's recent
        requests (the population, as `_entry_pays` values a new request)."""
        expected = self._blocks([sums.survival() for sums in self._population_sums().values()])
        return self._drafting_repays(expected, shape, request.remaining, pending, rate, draft_row)

    def _drafting_repays(self, expected: Sequence[Sequence[float]], shape: RequestShape, remaining: int, pending: int,
                         rate: float, draft_row: float, whole_block: bool = False) -> bool:
        """Whether drafting the best block beats `rate` by more over `remaining` tokens than the
        request's catch-up costs (and, with whole_block, its whole block drafted and verified once),
        and the drafter's setup where it has not drafted yet (its deferred load: drafting/deferred.py);
        blocks priced as if nothing else drafted in their steps, after `pending` tokens. expected:
        # [R][K] accepted tokens of blocks of 1..K slots, one row per outcome the request may turn
        out like, equally likely; each outcome gains nothing where no block pays (drafting stops)."""
        if not expected:
            return False
        expected = torch.tensor(expected, dtype=torch.float64)  # [R, K]
        block_seconds = torch.tensor(self._block_seconds(pending, draft_row, [shape.slot_attended])[0],
                                     dtype=torch.float64) + self.cost.drafting_premium(pending)
        values, best = (expected - rate * block_seconds).max(dim=1)  # [R]: each outcome's best block
        if not len(values) or not bool((values > 0).any()):
            return False
        steps_left = remaining / (1.0 + expected.gather(1, best[:, None])[:, 0])
        gain = float((values.clamp(min=0.0) * steps_left).mean())
        price = self._catch_up_seconds(shape) + self.cost.draft_setup + \
            (float(block_seconds[-1]) if whole_block else 0.0)
        return gain >= rate * price

    def _catch_up_seconds(self, shape: RequestShape) -> float:
        """What feeding a request's pending tokens adds to its first drafter forward, beyond one row."""
        d, context = shape.draft_pending, shape.draft_context
        return self.cost.draft_seconds(d, attended(d, context)) - self.cost.draft_seconds(1, context + d - 1)

    def _pay_learning(self, shape: RequestShape, slots: int) -> bool:
        """Whether the probe budget is not in debt (and if so, take from it the price of this
        request's catch-up and `slots` slots drafted and verified, into debt if need be). Learning
        is paid from it, a probe's slot and the cold start's whole block alike: the cold start is
        the dearest probe there is (on chat at concurrency 1, 0.5 s of compute where a probe took
        0.1-0.5), and outside the budget, learning spent three times `probe_share` in the first
        minute of traffic. A probe's price grows with every token its request skips, by more than
        the budget grows in a step at concurrency 1, so a probe that waited for its whole price to
        be covered never ran (code at concurrency 1 decoded most of its requests target-only after
        one refused entry): learning spends at most `probe_share` of compute, and one price more."""
        if self.probe_budget < 0:
            return False
        self.probe_budget -= self._catch_up_seconds(shape) + slots * self.cost.draft_seconds(1, shape.slot_attended) + \
            self.cost.verify_added(shape.pending, slots, slots * shape.slot_attended)
        return True

    def _choose_first_slot(self, requests: Sequence[Request], candidates: list[int], forced: list[int],
                           prices: _Prices, shapes: Sequence[RequestShape]) -> set[int]:
        """Which candidates draft slot 1, predicted from their recent blocks (no drafter forward
        yet). A candidate's gain is the value of its best block, not of slot 1 alone: the first
        verified slot costs the most (measured costs are not convex), so a myopic slot-1 rule would
        stop requests whose blocks pay."""
        if not candidates:
            return set()
        price = prices.price
        verify_tokens = sum(s.pending for s in shapes) + len(forced)
        slot_attended = [shapes[i].slot_attended for i in candidates]
        survival = self._predicted_survival([requests[i] for i in candidates])
        for i, s in zip(candidates, survival):
            self._history(requests[i]).first_predicted = s[0]
        expected = self._blocks(survival)
        waits = [self._wait_value(requests[i]) for i in candidates]
        # nothing forced: the first candidate makes this a drafting step, whose verify costs more; the
        # premium is measured on decoding steps (a prefill teaches neither kind of verify), so it is
        # priced on their tokens, one per request, not on a prompt being prefilled in this step
        premium = 0.0 if forced else self.cost.drafting_premium(len(shapes), sum(s.context for s in shapes))
        # deeper slots' rows are shared by the requests that draft: priced first as if every candidate
        # did, then at the number chosen until that holds (fewer rows cost more each, so it only falls)
        drafting = len(candidates)
        while True:
            gains = [g + w for g, w in zip(self.best_blocks(expected, price, verify_tokens,
                                                            self._draft_row(drafting + len(forced)), slot_attended),
                                           waits)]
            chosen = self.choose(gains, [1] * len(candidates), len(forced), price, verify_tokens, slot_attended,
                                 premium)
            if len(chosen) >= drafting:
                return {candidates[j] for j in chosen}
            drafting = len(chosen)

    def _wait_value(self, request: Request) -> float:
        """Tokens a no-draft decision forgoes beyond this step: it commits the request to `interval`
        target-only steps, each a token short of what drafting has been yielding it (its measured
        speed-up over target-only, less `min_speedup`, the margin the rules ask of predictions: a
        request that has not drafted measures 1 give or take the machine's noise, and one whose
        drafts turned to failing loses its speed-up as they fail). Valued on this step alone, one
        doubtful block of a code request (its predicted slot 1 from ~0.95 to ~0.75) stopped it for
        8 steps (a per-step trace of code at concurrency 1); measured end to end, once probes ran,
        its effect was within the noise (docs/adaptive.md, at 6c7b781).

        A new request's speed-up is not yet measured: until its own steps are, it is expected to be
        like the traffic's (the population's requests' mean measured speed-up), its EMA as if started
        there (the traffic's weight falls by the EMA's decay with each step it measures). The price
        of compute still starts at 1 for it (`price`): only the wait is valued from the traffic. With
        the EMA's 1 alone, a code request whose first block (an answer's first token) failed was
        stopped for 8 steps at its second, its probes then unpaid for the rest of the request: in
        one round of code at concurrency 1, four of eight requests decoded 118 of 128 tokens
        target-only (docs/adaptive.md, "Zen 4 EPYC, commit 54b0e80")."""
        h = self._history(request)
        traffic = (1.0 - self.rate_alpha) ** h.measured * (self.population.speedup(request.request_id) - 1.0)
        return h.interval * max(0.0, h.speedup + traffic - self.config.min_speedup)

    def best_blocks(self, expected: list[list[float]], price: float, verify_tokens: int, draft_row: float,
                    slot_attended: Sequence[int]) -> list[float]:
        """Per request, the value of its best block, from expected # [A][n] accepted tokens of blocks
        of 1..n slots, less what its slots beyond the first cost (the first slot's cost is the draft
        rule's to price, jointly with the other requests'): the first verified slot costs the most
        (measured costs are not convex), so a rule that valued the next slot alone would stop
        requests whose blocks pay."""
        seconds = self._block_seconds(verify_tokens, draft_row, slot_attended)  # [A][K]
        return [max(e - price * (s - row[0]) for e, s in zip(tokens, row)) for tokens, row in zip(expected, seconds)]

    def _predicted_blocks(self, requests: Sequence[Request]) -> list[list[float]]:
        """Expected accepted tokens of drafting slots 1..n, n = 1..K, per request # [A][K], from its
        predicted survival (`_predicted_survival`), scaled by the first-slot check. The stop rule
        predicts from one feature per request, standing for all deeper slots (_SurvivalStop)."""
        return self._blocks(self._predicted_survival(requests))

    def _predicted_survival(self, requests: Sequence[Request]) -> list[list[float]]:
        """Survival of slots 1..K per request # [A][K] as past blocks predict it (unscaled, by
        `block_survival`): its own recent blocks, and the population's, which together weigh
        _PRIOR_BLOCKS of its own, so one odd block does not stop a request."""
        population = self._population_sums()
        prior = SurvivalSums.zero(self.num_slots)
        for sums in population.values():  # every request's weighing 1
            prior = prior.plus(sums)
        scale = _PRIOR_BLOCKS / max(len(population), 1)
        own = [self._history(request).samples for request in requests]
        return [self._sums(samples.blocks, samples.weights).plus(prior, scale).survival() for samples in own]

    def _population_sums(self) -> dict[str, SurvivalSums]:
        """Each of the population's requests' blocks as `SurvivalSums`, each request weighing 1;
        summed again only where its blocks (or the scorer: `_forget_rescored`) changed."""
        self._forget_rescored()
        kept = {}
        for request_id, blocks in self.population.requests.items():
            cached = self._population_cache.get(request_id)
            kept[request_id] = cached if cached is not None and cached[0] is blocks else \
                (blocks, self._sums(blocks, [1.0 / len(blocks)] * len(blocks)))
        self._population_cache = kept
        return {request_id: sums for request_id, (_, sums) in kept.items()}

    def _sums(self, blocks: Sequence[Sequence[float]], weights: Sequence[float]) -> SurvivalSums:
        return SurvivalSums.of(self._block_confidences(blocks), [len(b) for b in blocks], weights, self.num_slots)

    def _block_confidences(self, blocks: Sequence[Sequence[float]]) -> list[list[float]]:
        """Each block's confidences # [M][K], scored at their positions (past a block's end, its last
        slot's feature), as the scorer scores them now: kept by the block's features until the
        scorer's `version` changes, so a block is scored once, not every step it predicts."""
        self._forget_rescored()
        if len(self._scored) > _SCORED_BLOCKS:
            self._scored = {}
        keys = [tuple(b) for b in blocks]
        missing = [key for key in dict.fromkeys(keys) if key not in self._scored]
        if missing:
            features, _ = block_features(missing, self.num_slots)
            scored = torch.nan_to_num(self.scorer.score(features), nan=0.0).tolist()
            self._scored.update(zip(missing, scored))
        return [self._scored[key] for key in keys]

    def _forget_rescored(self) -> None:
        """Drop what was computed from the scorer's confidences once its `version` has changed."""
        if self._scored_version != self.scorer.version:
            self._scored, self._population_cache, self._scored_version = {}, {}, self.scorer.version

    def _blocks(self, survival: Sequence[Sequence[float]]) -> list[list[float]]:
        """Expected accepted tokens of blocks of 1..K slots # [A][K] from predicted survival # [A][K],
        scaled by what predictions of slot 1 have turned out to be (`FirstSlotCheck`)."""
        ratio = self.check.ratio
        return [list(itertools.accumulate(min(s * ratio, 1.0) for s in row)) for row in survival]

    def _block_seconds(self, verify_tokens: int, draft_row: float, slot_attended: Sequence[int]) -> list[list[float]]:
        """Seconds that drafting and verifying 1..K slots add to the step, per request # [A][K]
        (slot_attended: what each of its slots attends to; attention is linear in it)."""
        verify = self.cost.verify_added_each(verify_tokens, self.num_slots)  # [K]
        block = [n * draft_row + v for n, v in enumerate(verify, start=1)]
        per_position = self.cost.per_position()
        return [[b + a * n * per_position for n, b in enumerate(block, start=1)] for a in slot_attended]

    def _draft_row(self, rows: int) -> float:
        """A row's share of a drafter forward of `rows` rows (for one row: the whole forward). Deeper
        slots are priced at their share, not at the marginal row: each deeper forward is paid in
        full by the rows that draft it, so marginal rows alone would value deep blocks for free."""
        rows = max(1, rows)
        return self.cost.draft_seconds(rows) / rows

    # ---- admit ---------------------------------------------------------------------------

    def plan(self, drafts: DraftBatch, scores: Scores, draft_plan: DraftPlan) -> Plan:
        counts = drafts.num_drafted  # [B]
        admitted = counts  # nothing drafted, nothing to rank (and no tensor ops: the caches are cold)
        if drafts.layout.total:
            explore = torch.zeros_like(counts, dtype=torch.bool) if draft_plan.explore is None else draft_plan.explore
            admitted = torch.where(explore, counts, torch.zeros_like(counts))  # [B]
            self._admit(admitted, scores, draft_plan, counts, explore)
        num_admitted = admitted.tolist()
        verify_tokens = draft_plan.pending_tokens + sum(num_admitted)
        verify_attended = sum(s.attended(k) for s, k in zip(draft_plan.shapes, num_admitted))
        return Plan.of(drafts, admitted, self.cost.predict(drafts.forwards, verify_tokens, verify_attended))

    def _admit(self, admitted: torch.Tensor, scores: Scores, draft_plan: DraftPlan, counts: torch.Tensor,
               explore: torch.Tensor) -> None:
        """The scan (see the module docstring): admits, in `admitted` # [B], each slot of the
        non-exploring requests that pays, in descending survival."""
        verify_tokens = draft_plan.pending_tokens + int(admitted.sum())
        survival = torch.nan_to_num(scores.survival.to(torch.float64), nan=0.0)  # [B, K]
        shapes = draft_plan.shapes
        closed: set[int] = set()
        for b, i, s in self._ranked_slots(survival, counts, explore):
            if b in closed:
                continue
            marginal = self.cost.verify_added(verify_tokens, 1, shapes[b].slot_attended + i)
            if s < draft_plan.price * marginal:
                closed.add(b)  # its deeper slots rank lower and cost as much: none of them is admitted
                continue
            admitted[b] = i + 1
            verify_tokens += 1

    @staticmethod
    def _ranked_slots(survival: torch.Tensor, counts: torch.Tensor,
                      explore: torch.Tensor) -> list[tuple[int, int, float]]:
        """Drafted slots of non-exploring requests as (request, 0-based position, survival), in
        descending survival; ties by position, then by request."""
        s, exploring = survival.tolist(), explore.tolist()
        slots = [(b, i, s[b][i]) for b, n in enumerate(counts.tolist()) if not exploring[b] for i in range(n)]
        return sorted(slots, key=lambda slot: (-slot[2], slot[1], slot[0]))

    # ---- observe -------------------------------------------------------------------------

    def observe(self, record: StepRecord) -> None:
        if record.times.total > 0 and record.requests and not record.prefill_tokens and not self._control:
            # (a control step says nothing of the requests' own rates; each rate is against the
            # target-only step the cost model predicted before it learnt from this one)
            for request, speedup in zip(record.requests, self._speedups(record)):
                h = self._history(request)
                h.speedup += self.rate_alpha * (speedup - h.speedup)
                h.measured += 1
                self.population.measured(request.request_id, h.speedup)
        self.cost.observe(record.drafts.forwards, record.verify_tokens, record.verify_attended, record.times,
                          prefill=bool(record.prefill_tokens))
        if math.isfinite(record.times.total):
            self.probe_budget += self.config.probe_share * max(0.0, record.times.total)
        num_drafted = record.drafts.num_drafted.tolist()
        if not any(num_drafted):
            return  # (nothing to learn of blocks or probes)
        features = record.scores.features.tolist()  # [B][K]
        for b, (request, drafted) in enumerate(zip(record.requests, num_drafted)):
            h = self._history(request)
            if drafted:
                block = [f for f in features[b][:drafted] if not math.isnan(f)]
                h.samples.add([block], HISTORY_DECAY, HISTORY_BLOCKS)
                self.population.add(request.request_id, block)
                if record.draft_reasons and record.draft_reasons[b] == "rule":  # the rule chose it, as predicted
                    self.check.add(h.first_predicted, float(record.scores.confidences[b, 0]))
            if h.probing and drafted:
                h.probing = False
                if drafted >= 2 or drafted >= record.max_slots[b]:
                    h.interval = self.config.probe_interval  # drafting pays again
                else:
                    h.wait = h.interval
                    h.interval = min(2 * h.interval, self.config.max_probe_interval)

    def _speedups(self, record: StepRecord) -> list[float]:
        """Each request's measured rate over its target-only rate in a decoding step: its tokens
        over its share of the step's time, which is its share of a target-only step (what the cost
        model predicts for the pending tokens alone) plus the step's extra time split by the
        predicted cost of its drafted and admitted slots."""
        b = len(record.requests)
        drafted, admitted = record.drafts.num_drafted.tolist(), record.num_admitted.tolist()
        pending = record.verify_tokens - sum(admitted)
        pending_attended = record.verify_attended * pending / max(record.verify_tokens, 1)
        target_only = (self.cost.plain_seconds(pending, pending_attended) + self.cost.overhead) / b
        weights = [0.0] * b
        if any(drafted):
            row, slot = self._draft_row(sum(1 for d in drafted if d)), self.cost.verify_added(pending, 1)
            weights = [d * row + a * slot for d, a in zip(drafted, admitted)]
        total_weight = sum(weights)
        extra = record.times.total - b * target_only
        shares = [target_only + extra * (w / total_weight if total_weight > 0 else 1 / b) for w in weights]
        tokens = [1 + int(a) for a in record.num_accepted.tolist()]
        return [t * target_only / max(share, 1e-9) for t, share in zip(tokens, shares)]

    def release(self, request: Request) -> None:
        self.history.pop(request.request_id, None)

    def _known(self, h: _History) -> bool:
        """Whether anything predicts the request's next slots (nothing before the cold start drafted)."""
        return bool(h.samples.blocks or self.population.requests)

    def _history(self, request: Request) -> _History:
        h = self.history.get(request.request_id)
        if h is None:
            h = self.history[request.request_id] = _History(interval=self.config.probe_interval)
        return h
