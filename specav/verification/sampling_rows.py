"""Per-row sampling parameters for a batch of requests (the bridge from requests to sampling.py).

Owns: expanding each request's SamplingParams and generator to the rows it owns in a
flattened [N, V] batch, for the drafter (q_i) and the verifier (p_i) alike, and the per-request
logit transforms (presence / frequency penalties, logit_bias). Both models' rows go through
this one class, so q_i and p_i see the same transforms and speculation stays lossless.

Rows and their context. A request owns consecutive rows; `draft_tokens[b]` are the draft tokens
its rows condition on past its output so far: its last row sees all of them, each earlier row
one fewer. The verifier passes the admitted slots (k tokens, k + 1 rows: p_1 after none of them,
the bonus row after all); the drafter at slot i passes x_1..x_{i-1} (one row). Penalties count
the output tokens plus the draft tokens a row sees, exactly as if those drafts were accepted.

Faults. A row of logits without a distribution (NaN, +inf; sampling.non_finite_rows) fails the
request that owns it (`Request.fail`, a message naming the request and the model); the row is
replaced by a uniform one so the rest of the batch samples on, and the engine finishes that
request with finish_reason "error" without keeping any of its tokens.

Log-probabilities. For a request that asked for logprobs, the target's rows leave their
log-softmax (of the raw logits, vLLM's default "raw_logprobs") on `Request.target_logprobs`,
for the engine to read once acceptance says which rows' tokens were kept.

Must not know models or verification rules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from specav.request import Request
from specav.token_probs import TokenProbs
from specav.topk import Tails
from specav.verification import sampling
from specav.verification.sampling import NonFiniteLogitsError, apply_logit_bias, apply_penalties

log = logging.getLogger("specav")


@dataclass(slots=True)
class SamplingRows:
    temperature: list[float]  # [N]
    top_k: list[int]  # [N]
    top_p: list[float]  # [N]
    generators: list[torch.Generator]  # [N], each request's own generator on each of its rows
    requests: list[Request]  # [B]
    starts: list[int]  # [B] first row of each request
    counts: list[int]  # [B] rows of each request
    draft_tokens: list[list[int]]  # [B] the draft tokens each request's rows condition on (see the docstring)
    model: str = "target"  # whose logits these rows are ("target" or "drafter"), for messages and logprobs

    @classmethod
    def of(cls, requests: Sequence[Request], rows_per_request: Sequence[int],
           draft_tokens: Sequence[Sequence[int]] | None = None, model: str = "target") -> "SamplingRows":
        temperature, top_k, top_p, generators, starts = [], [], [], [], []
        for request, n in zip(requests, rows_per_request):
            p = request.params
            starts.append(len(temperature))
            temperature += [p.temperature] * n
            top_k += [p.top_k] * n
            top_p += [p.top_p] * n
            generators += [request.generator] * n
        drafts = [list(d) for d in draft_tokens] if draft_tokens is not None else [[] for _ in requests]
        return cls(temperature, top_k, top_p, generators, list(requests), starts, list(rows_per_request), drafts, model)

    def distributions(self, logits: torch.Tensor) -> TokenProbs:
        """logits # [N, V] -> processed distributions, N rows (rows of failed requests: uniform). Where
        every row has a positive temperature, the same top-k and no transforms (most traffic), one
        native call (sampling.top_k_distributions); else, or where it declines a row, the general path."""
        k = self._shared_top_k(logits.shape[-1])
        probs = sampling.top_k_distributions(logits, self.temperature, k, self.top_p) if k else None
        if probs is None:
            return self._distributions(logits, tails=False)[0]
        if self.model == "target":
            self._keep_logprobs(logits)
        return probs

    def distributions_and_tails(self, logits: torch.Tensor) -> tuple[TokenProbs, Tails]:
        """distributions and, from the same scan, the Tails of the transformed, temperature-scaled,
        untruncated logits (what the drafter's features read; a failed request's rows: the uniform row's)."""
        probs, tails = self._distributions(logits, tails=True)
        assert tails is not None
        return probs, tails

    def draw(self, logits: torch.Tensor) -> tuple[TokenProbs, Tails, torch.Tensor]:
        """distributions_and_tails and one token per row, drawn as sampling.sample draws it: one
        uniform per row from its generator in row order (drawn first, so both paths below use the
        same), the inverse CDF of the row's distribution. Where every row has a positive temperature,
        the same top-k and no transforms (most traffic), one native call (sampling.draw_top_k); else,
        or where that call declines a row, the two steps."""
        uniforms = sampling.draw_uniforms(self.generators)
        k = self._shared_top_k(logits.shape[-1])
        drawn = sampling.draw_top_k(logits, self.temperature, k, self.top_p, uniforms) if k else None
        if drawn is not None:
            if self.model == "target":
                self._keep_logprobs(logits)
            return drawn
        probs, tails = self.distributions_and_tails(logits)
        return probs, tails, sampling.sample(probs, self.generators, uniforms)

    def _shared_top_k(self, vocab: int) -> int:
        """The top_k every row shares where each has a positive temperature and no transforms, else 0."""
        params = [r.params for r, n in zip(self.requests, self.counts) if n]
        k = params[0].top_k if params else 0
        if 0 < k < vocab and all(p.top_k == k and p.temperature > 0 and not p.has_transforms for p in params):
            return k
        return 0

    def _distributions(self, logits: torch.Tensor, tails: bool) -> tuple[TokenProbs, Tails | None]:
        if self.model == "target":
            self._keep_logprobs(logits)
        transformed = self.transformed(logits)
        process = (sampling.distributions_and_tails if tails
                   else lambda *args: (sampling.processed_distributions(*args), None))
        params = (torch.tensor(self.temperature, dtype=torch.float32), torch.tensor(self.top_k, dtype=torch.int64),
                  torch.tensor(self.top_p, dtype=torch.float32))  # [N] each
        try:
            return process(transformed, *params)
        except NonFiniteLogitsError as e:
            transformed = self._fail_rows(transformed, e.rows)
            return process(transformed, *params)

    # ---- per-request transforms ------------------------------------------------------------

    def transformed(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after each request's penalties and logit_bias # [N, V] (the input itself if none)."""
        mine = [b for b, r in enumerate(self.requests) if r.params.has_transforms and self.counts[b]]
        if not mine:
            return logits
        out = logits.float().clone()
        for b in mine:
            rows = slice(self.starts[b], self.starts[b] + self.counts[b])
            out[rows] = self._transform(b, out[rows])
        return out

    def _transform(self, b: int, logits: torch.Tensor) -> torch.Tensor:
        """One request's rows # [n, V] with its penalties and logit bias applied."""
        p = self.requests[b].params
        n, vocab = logits.shape
        if p.has_penalties:
            counts = self._output_counts(b, n, vocab)  # [n, V]
            logits = apply_penalties(logits, counts, torch.full((n,), float(p.presence_penalty)),
                                     torch.full((n,), float(p.frequency_penalty)))
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64)
            bias = torch.tensor([v for _, v in p.logit_bias], dtype=torch.float32)
            logits = apply_logit_bias(logits, ids, bias)
        return logits

    def _output_counts(self, b: int, n: int, vocab: int) -> torch.Tensor:
        """How often each token occurs in the output each of request b's n rows conditions on # [n, V]."""
        output = torch.tensor(self.requests[b].output_ids, dtype=torch.int64)
        counts = torch.bincount(output, minlength=vocab)[:vocab].float().expand(n, vocab).clone()  # [n, V]
        drafts = self.draft_tokens[b]
        seen = len(drafts) - n + 1  # draft tokens the first row sees
        for i, token in enumerate(drafts):
            first_row = max(0, i - seen + 1)  # row r sees drafts[:seen + r]
            if first_row < n:
                counts[first_row:, token] += 1
        return counts

    # ---- faults and log-probabilities -----------------------------------------------------

    def _fail_rows(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Fail the requests owning `rows` and give those rows a uniform distribution # [N, V]."""
        out = logits.clone()
        bad = set(rows)
        for b, request in enumerate(self.requests):
            own = [r for r in range(self.starts[b], self.starts[b] + self.counts[b]) if r in bad]
            if not own:
                continue
            message = (f"request {request.request_id}: the {self.model}'s logits hold NaN or inf "
                       f"({len(own)} of its {self.counts[b]} rows); no token is sampled from them and the "
                       "request is finished with finish_reason 'error'")
            log.warning(message)
            request.fail(message)
            out[own] = 0.0
        return out

    def _keep_logprobs(self, logits: torch.Tensor) -> None:
        for b, request in enumerate(self.requests):
            if request.params.logprobs is not None and self.counts[b]:
                rows = logits[self.starts[b]:self.starts[b] + self.counts[b]].float()
                request.target_logprobs = torch.log_softmax(rows, dim=-1)  # [n, V]
