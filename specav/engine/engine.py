"""The engine: one step is schedule, draft, score, plan, verify, accept, observe, commit.

Owns: wiring the stages together and the request lifecycle (add, step, finish). Each stage
lives in its own module; `Engine.step()` only calls them in order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specav.acceptance.scorer import Scorer, make_scorer
from specav.config import EngineConfig, SamplingParams
from specav.drafting.base import Drafter, NoDrafter, make_drafter
from specav.engine.request import Request, RequestOutput
from specav.engine.scheduler import Scheduler
from specav.engine.stats import EngineStats
from specav.engine.target import TargetVerifier
from specav.models.loader import check_same_vocabulary, load_checkpoint
from specav.models.packed import PackedCausalLM
from specav.types import AcceptResult, DraftBatch
from specav.verification.planner import Plan, StaticPlanner
from specav.verification.rejection import rejection_sample


@dataclass(slots=True)
class StepRecord:
    """Everything one step decided, for metrics and labelled-draft logs."""

    step: int
    requests: list[Request]
    drafts: DraftBatch
    confidences: torch.Tensor  # [B, K] estimator confidence per slot (NaN = not drafted)
    num_admitted: torch.Tensor  # [B] int64
    num_accepted: torch.Tensor  # [B] int64


class Engine:
    def __init__(self, target: PackedCausalLM, tokenizer, drafter: Drafter | None,
                 config: EngineConfig = EngineConfig(), eos_ids: Sequence[int] = ()) -> None:
        spec = config.speculative
        if spec is not None and spec.enable_adaptive_verification:
            raise NotImplementedError("enable_adaptive_verification: the adaptive planner is not in this "
                                      "version yet; set it to false (static K) for now")
        self.config = config
        self.tokenizer = tokenizer
        self.num_slots = spec.num_speculative_tokens if (spec and drafter) else 0
        self.drafter = drafter if self.num_slots else NoDrafter(target.vocab_size)
        self.scorer: Scorer | None = make_scorer(self.num_slots, config.estimator) if self.num_slots else None
        self.planner = StaticPlanner()
        self.verifier = TargetVerifier(target)
        self.scheduler = Scheduler(config.max_batch_size)
        self.eos_ids = frozenset(eos_ids)
        self.max_positions = target.config.max_position_embeddings
        self.stats = EngineStats(self.num_slots)
        self.step_listeners: list[Callable[[StepRecord], None]] = []

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Load the target (and drafter, if speculative) named by the config."""
        if config.target.threads:
            torch.set_num_threads(config.target.threads)
        target = load_checkpoint(config.target.path, config.target.dtype, role="target")
        drafter = None
        if config.speculative is not None:
            draft = load_checkpoint(config.speculative.model, config.target.dtype, role="drafter")
            check_same_vocabulary(target, draft)
            drafter = make_drafter(config.speculative.method, model=draft.model,
                                   feature_clamp=config.estimator.feature_clamp)
        return cls(target.model, target.tokenizer, drafter, config, eos_token_ids(target))

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> Request:
        request = Request(list(prompt_ids), params, **({"request_id": request_id} if request_id else {}))
        if len(request.prompt_ids) + params.max_tokens > self.max_positions:
            raise ValueError(f"request {request.request_id}: prompt ({len(request.prompt_ids)} tokens) + "
                             f"max_tokens ({params.max_tokens}) exceeds the model's {self.max_positions} "
                             f"positions; shorten the prompt or lower max_tokens")
        self.scheduler.add(request)
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[Request]:
        """Run prompts to completion (continuous batching); returns the finished requests in order."""
        per = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, per)]
        while self.has_work():
            self.step()
        return requests

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        drafts = self.drafter.propose(batch, self._draft_lengths(batch))
        confidences = self._score(drafts)
        plan = self.planner.plan(drafts, confidences)
        target_probs = self.verifier.verify(batch, plan.admitted_tokens(drafts))
        result = self._accept(batch, drafts, plan, target_probs)
        self._observe(batch, drafts, confidences, plan, result)
        return self._commit(batch, drafts, plan, result, time.perf_counter() - start)

    def _draft_lengths(self, batch: Sequence[Request]) -> list[int]:
        """K per request, never more than it can still emit (each step also emits one token)."""
        return [max(0, min(self.num_slots, r.remaining - 1)) for r in batch]

    def _feature(self, drafts: DraftBatch) -> torch.Tensor:
        """The scorer's feature, logit(q_max), padded with NaN to K slots # [B, K]."""
        f = drafts.features.get("logit_q_max", torch.zeros(len(drafts.num_drafted), 0))
        return torch.nn.functional.pad(f, (0, self.num_slots - f.shape[1]), value=float("nan"))

    def _score(self, drafts: DraftBatch) -> torch.Tensor:
        if self.scorer is None:
            return torch.zeros(len(drafts.num_drafted), 0)
        return self.scorer.score(self._feature(drafts))

    def _accept(self, batch: Sequence[Request], drafts: DraftBatch, plan: Plan,
                target_probs: torch.Tensor) -> AcceptResult:
        tokens = torch.tensor([t for row in plan.admitted_tokens(drafts) for t in row], dtype=torch.int64)
        return rejection_sample(tokens, drafts.probs[plan.admitted_rows(drafts)], target_probs,
                                plan.num_admitted, [r.generator for r in batch])

    def _observe(self, batch: list[Request], drafts: DraftBatch, confidences: torch.Tensor, plan: Plan,
                 result: AcceptResult) -> None:
        if self.scorer is not None:
            self.scorer.observe(self._feature(drafts), plan.num_admitted, result.num_accepted)
        record = StepRecord(self.stats.steps, batch, drafts, confidences, plan.num_admitted, result.num_accepted)
        for listener in self.step_listeners:
            listener(record)

    def _commit(self, batch: list[Request], drafts: DraftBatch, plan: Plan, result: AcceptResult,
                seconds: float) -> list[RequestOutput]:
        self.verifier.commit(batch, plan.num_admitted.tolist(), result)
        self.drafter.commit(batch, drafts, result)
        outputs, emitted = [], 0
        for request, tokens in zip(batch, result.output_tokens):
            kept = request.append(tokens, self.eos_ids)
            emitted += len(kept)
            request.update_text(self.tokenizer.decode(request.output_ids, skip_special_tokens=True))
            outputs.append(RequestOutput(request.request_id, kept, request.text, request.finished,
                                         request.finish_reason))
        for request in self.scheduler.retire():
            self.verifier.release(request)
            self.drafter.release(request)
        self.stats.record(drafts.num_drafted, plan.num_admitted, result.num_accepted, emitted, seconds)
        return outputs


def eos_token_ids(checkpoint) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (chat models have several)."""
    ids = set()
    if checkpoint.tokenizer.eos_token_id is not None:
        ids.add(int(checkpoint.tokenizer.eos_token_id))
    gen = getattr(checkpoint.model.hf_model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)
