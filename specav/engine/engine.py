"""The engine: one step is schedule, draft, score, plan, verify, accept, observe, commit.

Owns: wiring the stages together and the request lifecycle (add, step, finish). Each stage
lives in its own module; `Engine.step()` only calls them in order:

    schedule   scheduler.py          running requests, topped up from the waiting queue
    draft      drafting/             up to K slots per request, as far as the planner's stop rule says
    score      acceptance/scorer.py  confidence and survival of every drafted slot
    plan       verification/planner  which slots the target verifies (static: all; adaptive: those that pay)
    verify     target.py             one packed target forward over pending tokens + admitted slots
    accept     verification/rejection.py   lossless rejection sampling over the ragged batch
    observe    labels to the scorer, measured times to the planner, the record to listeners
    commit     caches rolled back past the emitted tokens, text and stop rules, finished requests retired

Request lifecycle. Request ids come from the caller (or are generated); a second live request
with the same id is refused. `abort(request_id)` may be called from any thread: the request is
finished (finish_reason "abort") at the next step boundary and its state freed in the verifier,
the drafter and the planner, as for a request that finished by itself. A request whose logits
turn out non-finite (sampling_rows.py) finishes with "error" in the step that found them; the
other requests of the batch go on. Requests with per-request logit transforms (penalties,
logit_bias) and failed ones are left out of the scorer's statistics: their acceptance outcomes
say nothing about the rest of the traffic.

Stage times (StepRecord.times) run from the plan to the observe stage: what the planner
learns from. The step's whole time, commit included, goes to EngineStats. A deferred drafter's
load (drafting/deferred.py: `from_config` defers it under adaptive verification) is in neither:
EngineStats reports it on its own.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque
from typing import Callable, Sequence

import torch

from specav.acceptance.scorer import Scorer, make_scorer, score_drafts
from specav.config import EngineConfig, SamplingParams
from specav.detokenize import make_detokenizer
from specav.drafting.base import Drafter, NoDrafter, make_drafter
from specav.drafting.deferred import DeferredDrafter
from specav.engine.scheduler import Scheduler
from specav.engine.stats import EngineStats
from specav.engine.target import TargetVerifier
from specav.models.checkpoint_info import inspect_checkpoint
from specav.models.loader import CheckpointError, check_same_vocabulary, load_checkpoint, vocabulary_mismatch
from specav.models.packed import PackedCausalLM
from specav.models.vocab_subset import apply_vocab_subset
from specav.request import Request, StepOutput, TokenLogprob
from specav.token_probs import TokenProbs
from specav.types import AcceptResult, DraftBatch, Plan, Scores, StageTimes, StepRecord
from specav.verification.cost_model import CostModel, CostProfile
from specav.verification.planner import Planner, RequestShape, make_planner
from specav.verification.rejection import rejection_sample


class Engine:
    def __init__(self, target: PackedCausalLM, tokenizer, drafter: Drafter | None,
                 config: EngineConfig = EngineConfig(), eos_ids: Sequence[int] = (),
                 planner: Planner | None = None, cost_profile: CostProfile | None = None) -> None:
        """planner: None builds the one the config names (for "adaptive", from cost_profile, or from
        a profile measured now when none is given)."""
        spec = config.speculative
        self.config = config
        self.tokenizer = tokenizer
        self.num_slots = spec.num_speculative_tokens if (spec and drafter) else 0
        self.drafter = drafter if self.num_slots else NoDrafter(target.vocab_size)
        self.scorer: Scorer | None = make_scorer(self.num_slots, config.estimator) if self.num_slots else None
        self.verifier = TargetVerifier(target)
        self.scheduler = Scheduler(config.max_batch_size)
        self.planner = planner or self._make_planner(cost_profile)
        self.eos_ids = frozenset(eos_ids)
        self.max_positions = _max_positions(target, self.drafter)
        self.vocab_size = target.vocab_size
        self._aborts: deque[str] = deque()  # ids to abort at the next step boundary (any thread appends)
        self.stats = EngineStats(self.num_slots)
        self.step_listeners: list[Callable[[StepRecord], None]] = []

    def _make_planner(self, cost_profile: CostProfile | None) -> Planner:
        name = self.config.speculative.planner if self.num_slots else "static"
        if name == "static":
            return make_planner(name)
        if cost_profile is None:
            from specav.engine.profile import measure_profile

            cost_profile = measure_profile(self.verifier, self.drafter, self.max_verify_tokens,
                                           self.config.max_batch_size, progress=False)
        adaptive = self.config.adaptive
        cost = CostModel(cost_profile, adaptive.cost_halflife, draft_setup=self.drafter.setup_seconds,
                         shape_halflife=adaptive.cost_shape_halflife)
        return make_planner(name, num_slots=self.num_slots, scorer=self.scorer, cost=cost, config=adaptive)

    @property
    def max_verify_tokens(self) -> int:
        """The most tokens a decoding step verifies: every request's pending token and K slots."""
        return self.config.max_batch_size * (self.num_slots + 1)

    @classmethod
    def from_config(cls, config: EngineConfig, refresh_profile: bool = False, defer_drafter: bool = False) -> "Engine":
        """Load the target (and drafter, if speculative) named by the config; profile the stages for
        adaptive verification (cached per machine and models).

        defer_drafter (a one-shot run, `specav generate`): under adaptive verification, spend on the
        drafter only what its drafts may repay. Where the cached profile knows what the drafter's
        load takes, it is loaded when a plan first drafts (drafting/deferred.py), so a run whose
        drafts never pay never loads it; where no profile is cached yet, the run decodes
        target-only (measuring one takes minutes: 97 s for one request, 179 s for 16 on the AVX2
        EPYC, more than a short run could win) and says that `specav profile` measures it. Servers
        and `specav.LLM` load everything at start: a load mid-stream would stall every request.
        Where no load has been recorded for this machine and pair, they load the drafter twice and
        record the second: the first may write what later loads only read."""
        from specav.engine.profile import (PROFILE_FILE, cached_profile, load_or_profile, models_key, profile_key,
                                           record_draft_load)
        from specav.models import packaged

        if config.target.threads:
            torch.set_num_threads(config.target.threads)
        target = load_checkpoint(config.target.path, config.target.dtype, role="target")
        spec = config.speculative
        if spec is None:
            return cls(target.model, target.tokenizer, None, config, eos_token_ids(target))

        def load_drafter() -> Drafter:
            draft = load_checkpoint(spec.model, config.target.dtype, role="drafter")
            check_same_vocabulary(target, draft)
            if spec.draft_vocab_size is not None:
                apply_vocab_subset(draft, spec.draft_vocab_size)
            return make_drafter(spec.method, model=draft.model, feature_clamp=config.estimator.feature_clamp)

        adaptive = spec.planner != "static"
        cache = packaged.cache_root() / PROFILE_FILE
        key = profile_key(models_key(config.target.path, spec.model, config.target.dtype, spec.draft_vocab_size))
        max_verify_tokens = config.max_batch_size * (spec.num_speculative_tokens + 1)
        profile = None
        if adaptive and not refresh_profile:
            profile = cached_profile(key, cache, True, max_verify_tokens, config.max_batch_size)
        if defer_drafter and adaptive and profile is None and not refresh_profile:
            print("specav: adaptive verification has no cost profile for this machine and model pair yet, so "
                  "this run decodes target-only; `specav profile` measures it once (a few minutes), after "
                  "which runs draft where drafts pay", file=sys.stderr, flush=True)
            return cls(target.model, target.tokenizer, None, dataclasses.replace(config, speculative=None),
                       eos_token_ids(target))
        if defer_drafter and profile is not None and profile.draft_load is not None:
            drafter = DeferredDrafter(load_drafter, spec.method, target.model.vocab_size, profile.draft_load,
                                      _drafter_positions(spec.model, target),
                                      on_load=lambda seconds: record_draft_load(cache, key, seconds))
        else:
            drafter, load_seconds = _timed(load_drafter)
            if adaptive and (profile is None or profile.draft_load is None):
                # No load recorded yet: this one may have written what later loads read (the tokenizer's
                # copy, the requantised weights: 48 s against 8 s on the AMD EPYC), and a deferral
                # is priced at a later load, so time one
                drafter, load_seconds = _timed(load_drafter)
        engine = cls(target.model, target.tokenizer, drafter, config, eos_token_ids(target),
                     planner=make_planner("static"))
        if adaptive:
            if profile is None:
                profile = load_or_profile(engine.verifier, engine.drafter, key, cache, engine.max_verify_tokens,
                                          config.max_batch_size, refresh=refresh_profile)
            if not isinstance(drafter, DeferredDrafter):  # what this load took: the next deferral's price
                record_draft_load(cache, key, load_seconds)
                profile = dataclasses.replace(profile, draft_load=load_seconds)
            engine.planner = engine._make_planner(profile)
        return engine

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> Request:
        """Queue a request; refuses a duplicate live id, a prompt + max_tokens beyond the context,
        and logit_bias entries outside the vocabulary (ValueError naming the request)."""
        prompt_ids = list(prompt_ids)
        request = Request(prompt_ids, params, **({"request_id": request_id} if request_id else {}),
                          detokenizer=make_detokenizer(self.tokenizer, prompt_ids))
        if self.scheduler.get(request.request_id) is not None:
            raise ValueError(f"request {request.request_id}: a live request already has this id; "
                             "give each request a unique id (or none, to have one generated)")
        if len(request.prompt_ids) + params.max_tokens > self.max_positions:
            raise ValueError(f"request {request.request_id}: prompt ({len(request.prompt_ids)} tokens) + "
                             f"max_tokens ({params.max_tokens}) exceeds the model's {self.max_positions} "
                             f"positions; shorten the prompt or lower max_tokens")
        outside = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise ValueError(f"request {request.request_id}: logit_bias token ids {outside} are outside the "
                             f"vocabulary (size {self.vocab_size})")
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Finish a live request at the next step boundary (finish_reason "abort") and free its
        caches; an id that is not live by then is ignored. Safe to call from any thread."""
        self._aborts.append(request_id)

    @property
    def num_live_requests(self) -> int:
        """Requests added and not yet finished (waiting or running)."""
        return self.scheduler.num_live

    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._aborts)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[Request]:
        """Run prompts to completion (continuous batching); returns the finished requests in order."""
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, per)]
        while self.has_work():
            self.step()
        return requests

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        ended = self._end_aborted()
        batch = self.scheduler.schedule()
        if not batch:
            return ended
        clock = _Clock()
        shapes, max_slots = self._shapes(batch), self._max_slots(batch)
        draft_plan = self.planner.draft_plan(batch, max_slots, shapes)
        drafts = self.drafter.propose(batch, draft_plan.num_slots, draft_plan.stop_rule)
        clock.lap("draft", excluding=drafts.setup_seconds)
        scores = self._score(drafts)
        plan = self.planner.plan(drafts, scores, draft_plan)
        clock.lap()
        target_probs = self.verifier.verify(batch, plan.token_lists())
        clock.lap("verify")
        result = self._accept(batch, drafts, plan, target_probs)
        record = StepRecord(self.stats.steps, batch, drafts, scores, plan, result, clock.times(), max_slots,
                            sum(s.pending for s in shapes) + plan.admitted.total,
                            sum(s.attended(k) for s, k in zip(shapes, plan.num_admitted.tolist())),
                            sum(s.pending for s, r in zip(shapes, batch) if not r.output_ids),
                            draft_plan.reasons, tuple(s.draft_pending for s in shapes))
        self._observe(record)
        return ended + self._commit(record, clock)

    def _shapes(self, batch: Sequence[Request]) -> list[RequestShape]:
        """What each request costs the two stages before any slot: the target's and the drafter's pending tokens."""
        return [dataclasses.replace(s, draft_pending=d)
                for s, d in zip(self.verifier.shapes(batch), self.drafter.pending_tokens(batch))]

    def _max_slots(self, batch: Sequence[Request]) -> list[int]:
        """K per request, never more than it can still emit (each step also emits one token)."""
        return [max(0, min(self.num_slots, r.remaining - 1)) for r in batch]

    def _score(self, drafts: DraftBatch) -> Scores:
        if self.scorer is None:
            return Scores.empty(len(drafts.layout))
        return score_drafts(self.scorer, drafts, self.num_slots)

    def _accept(self, batch: Sequence[Request], drafts: DraftBatch, plan: Plan,
                target_probs: TokenProbs) -> AcceptResult:
        return rejection_sample(plan.tokens, drafts.probs.rows(plan.draft_rows), target_probs, plan.admitted,
                                [r.generator for r in batch])

    def _observe(self, record: StepRecord) -> None:
        if self.scorer is not None:
            self._observe_scorer(record)
        self.planner.observe(record)
        for listener in self.step_listeners:
            listener(record)

    def _observe_scorer(self, record: StepRecord) -> None:
        """Labels to the scorer, from the representative requests only (see the module docstring)."""
        rows = [b for b, r in enumerate(record.requests) if representative(r)]
        if not rows:
            return
        features, admitted, accepted = record.scores.features, record.num_admitted, record.num_accepted
        if len(rows) < len(record.requests):
            keep = torch.tensor(rows, dtype=torch.int64)
            features, admitted, accepted = features[keep], admitted[keep], accepted[keep]
        self.scorer.observe(features, admitted, accepted)

    def _commit(self, record: StepRecord, clock: "_Clock") -> list[StepOutput]:
        batch, result = record.requests, record.result
        self.verifier.commit(batch, record.num_admitted.tolist(), result)
        self.drafter.commit(batch, record.drafts, result)
        drafted, admitted = record.drafts.num_drafted.tolist(), record.num_admitted.tolist()
        outputs, emitted = [], 0
        for b, (request, tokens) in enumerate(zip(batch, result.output_tokens)):
            shown = len(request.text)
            kept = request.append(tokens, self.eos_ids)
            emitted += len(kept)
            stats = request.stats
            stats.steps += 1
            stats.drafted += drafted[b]
            stats.admitted += admitted[b]
            stats.accepted += int(result.num_accepted[b])
            outputs.append(StepOutput(request.request_id, kept, request.text, request.text[shown:],
                                      request.finished, request.finish_reason, request.error,
                                      _kept_logprobs(request, kept)))
        self._retire([r for r in batch if r.finished])  # freed before they stop counting as live
        self.scheduler.retire()
        self.stats.record(record, emitted, clock.times().total)
        return outputs

    def _retire(self, requests: Sequence[Request]) -> None:
        """Free a finished request's state in every stage that keeps one."""
        for request in requests:
            self.verifier.release(request)
            self.drafter.release(request)
            self.planner.release(request)

    def _end_aborted(self) -> list[StepOutput]:
        """Finish the requests aborted since the last step (the step boundary) and free them."""
        ended = []
        while self._aborts:
            request = self.scheduler.get(self._aborts.popleft())
            if request is None:
                continue
            request.abort()
            self._retire([request])  # its caches are freed before it stops counting as live
            self.scheduler.remove(request.request_id)
            ended.append(StepOutput(request.request_id, [], request.text, "", True, request.finish_reason,
                                    request.error))
        return ended


def representative(request: Request) -> bool:
    """Whether a request's acceptance outcomes may teach the shared scorer: no per-request logit
    transforms, and no fault."""
    return not request.params.has_transforms and request.error is None


def _kept_logprobs(request: Request, kept: Sequence[int]) -> list[TokenLogprob] | None:
    """The target's log-probabilities of the kept tokens (row j of this step's rows: token j)."""
    rows, request.target_logprobs = request.target_logprobs, None
    if request.logprobs is None or rows is None:
        return None
    n = request.params.logprobs
    new = []
    for j, token in enumerate(kept):
        top = rows[j].topk(n) if n else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        new.append(TokenLogprob(int(token), float(rows[j, token]), pairs))
    request.logprobs.extend(new)
    return new


def _max_positions(target: PackedCausalLM, drafter: Drafter) -> int:
    """Positions a request may reach: the target's, and the drafter model's if it has fewer."""
    positions = target.config.max_position_embeddings
    return min(positions, getattr(drafter, "max_positions", None) or positions)


def _drafter_positions(path: str, target) -> int | None:
    """The drafter checkpoint's positions, read from its header without loading it; its vocabulary
    size is checked against the target's now (its tokens, when it loads: check_same_vocabulary)."""
    info = inspect_checkpoint(path, role="drafter")
    if info.vocab_size is not None and info.vocab_size != target.model.vocab_size:
        raise CheckpointError(vocabulary_mismatch(target.source, target.model.vocab_size, path, info.vocab_size))
    return info.context_length


def _timed(load: Callable[[], Drafter]) -> tuple[Drafter, float]:
    start = time.perf_counter()
    drafter = load()
    return drafter, time.perf_counter() - start


class _Clock:
    """Stage times of one step: lap(stage) adds the seconds since the last lap to that stage."""

    __slots__ = ("start", "last", "stages")

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.stages = {"draft": 0.0, "verify": 0.0}

    def lap(self, stage: str | None = None, excluding: float = 0.0) -> None:
        """excluding: seconds of this lap that belong to no stage and not to the step (a deferred
        drafter's load: the cost model learns the step's time, and a load is paid once)."""
        now = time.perf_counter()
        if stage is not None:
            self.stages[stage] += now - self.last - excluding
        self.start += excluding
        self.last = now

    def times(self) -> StageTimes:
        return StageTimes(self.stages["draft"], self.stages["verify"], time.perf_counter() - self.start)


def eos_token_ids(checkpoint) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (chat models have several)."""
    ids = set()
    if checkpoint.tokenizer.eos_token_id is not None:
        ids.add(int(checkpoint.tokenizer.eos_token_id))
    gen = getattr(checkpoint.model.hf_model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)
