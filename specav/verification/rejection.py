"""Lossless rejection sampling over a ragged batch (in the style of vLLM v1's rejection sampler).

Words (architecture.md):
    accepted token   an admitted draft token x_i that is kept. Slot i (reached only when slots
                     1..i-1 were accepted) is accepted iff u_i * q_i(x_i) < p_i(x_i) with
                     u_i ~ U[0, 1), i.e. with probability min(1, p_i(x_i) / q_i(x_i)).
    recovered token  at the first rejected slot i, a token drawn from
                     norm(max(0, p_i - q_i)); the request stops there.
    bonus token      when all k admitted slots are accepted, a token drawn from p_{k+1}, the
                     target's distribution after the last admitted slot.
Each request emits its accepted tokens plus exactly one recovered or bonus token. With draft
tokens x_i ~ q_i, the emitted tokens are distributed exactly as sampling from p alone, provided
the number of admitted slots did not depend on any x_i (the planner's duty; not checked here).

Layout. The batch is ragged and flattened with cumulative offsets: request b owns draft rows
[d_b, d_b + k_b) of the S admitted slots and target rows [d_b + b, d_b + b + k_b] of the S + B
target rows (its k_b slots, then its bonus distribution), where d_b = k_0 + ... + k_{b-1}.

Draw order (fixed, shared by both implementations so they agree exactly for equal seeds):
    1. for b = 0..B-1: k_b uniforms u_1..u_{k_b} from generators[b], one call, float64; uniforms
       past the first rejection are drawn and ignored, so the draw count never depends on the
       outcome;
    2. for b = 0..B-1: one categorical draw (sampling.sample: one float64 uniform) from
       generators[b], from the recovered distribution or the bonus distribution.
A request touches only its own generator, so with distinct generators its outcome never
depends on the other requests in the batch. Requests sharing one generator object draw in the
order above.

Residual guard. The residual max(0, p_i - q_i) has mass TV(p_i, q_i), which is also the
probability of rejecting slot i. When that mass is <= RESIDUAL_EPS the recovered token falls
back to p_i. This is still exact: the mass is ~0 only when p_i == q_i up to rounding, where a
rejection has probability ~0 anyway; in general the fallback changes the output distribution
by at most RESIDUAL_EPS in total variation, and it never emits a token outside p_i's support.

Greedy requests need no special case: with one-hot p_i and q_i, x_i is accepted iff it is the
target's argmax (the strict inequality never accepts a token with p_i(x_i) = 0), and the
recovered and bonus tokens are the target's argmax.

This module owns the accept / recover / bonus rule and nothing else: no models, no engine, no
planner. It never touches the global RNG.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specav.token_probs import TokenProbs
from specav.types import AcceptResult, Ragged
from specav.verification.sampling import categorical, draw_uniforms, sample

RESIDUAL_EPS = 1e-6  # residual mass below which the recovered token is drawn from p_i


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [S] int64, admitted draft tokens of all requests, concatenated
    draft_probs: TokenProbs | torch.Tensor,  # S rows: q_i of those slots (processed); a tensor is [S, V]
    target_probs: TokenProbs | torch.Tensor,  # S + B rows: p_i (processed); request b: k_b slot rows,
    #                                           then its bonus row
    admitted: Ragged,  # k_b admitted slots per request (may be 0) and their offsets d_b
    generators: Sequence[torch.Generator],  # [B], one per request
) -> AcceptResult:
    """Vectorised rejection sampling of a ragged batch (see the module docstring for the rule).

    Rows carried as candidates (TokenProbs) are used as they are: p_i(x) and q_i(x) are looked up
    among a row's candidates, and the residual max(0, p - q) lives on p's candidates, since it is
    zero wherever p is. Where both q and p are candidates and the native library is built, one
    native call (native/rejection.cpp) follows the same steps with the same uniforms."""
    q, p = TokenProbs.of(draft_probs), TokenProbs.of(target_probs)
    counts = _check_inputs(draft_token_ids, q, p, admitted, generators)
    uniforms = _draw_uniforms(counts, generators)  # [S], draw order phase 1
    ops = _native_ops() if q.ids is not None and p.ids is not None else None
    if ops is not None:  # the same rule in one call (native/rejection.cpp)
        num_accepted, last = ops.rejection_candidates(
            draft_token_ids.to(torch.int64).contiguous(), q.ids.contiguous(), q.probs.float().contiguous(),
            p.ids.contiguous(), p.probs.float().contiguous(), counts, uniforms, draw_uniforms(generators),
            RESIDUAL_EPS)  # draw order phase 2: one uniform per request
        last_tokens = last.tolist()
    else:
        num_accepted = _count_accepted(draft_token_ids, q, p, uniforms, admitted)  # [B]
        weights = _last_token_weights(q, p, num_accepted, admitted)  # B rows
        last_tokens = sample(weights, generators).tolist()  # draw order phase 2

    drafts, starts = draft_token_ids.tolist(), admitted.starts.tolist()
    output_tokens = [drafts[d:d + n] + [t] for d, n, t in zip(starts, num_accepted.tolist(), last_tokens)]
    return AcceptResult(num_accepted=num_accepted, output_tokens=output_tokens)


def _count_accepted(draft_token_ids: torch.Tensor, q: TokenProbs, p: TokenProbs, uniforms: torch.Tensor,
                    admitted: Ragged) -> torch.Tensor:
    """Accepted draft tokens per request (# [B]): the index of its first rejected slot, else k_b."""
    request, position = admitted.request, admitted.position  # [S] each
    slot = torch.arange(draft_token_ids.shape[0])  # [S]
    x = draft_token_ids.to(torch.int64)  # [S]
    p_x = p.at(x, rows=slot + request).double()  # [S]: slot s of request b is row s + b
    q_x = q.at(x).double()  # [S]
    rejected = ~(uniforms * q_x < p_x)  # [S]
    return admitted.counts.clone().scatter_reduce_(0, request[rejected], position[rejected], reduce="amin")


def _last_token_weights(q: TokenProbs, p: TokenProbs, num_accepted: torch.Tensor, admitted: Ragged) -> TokenProbs:
    """Per request, the unnormalised distribution of its recovered or bonus token (B rows, on p's candidates)."""
    starts = admitted.starts  # [B] d_b
    rejected = num_accepted < admitted.counts  # [B]
    p_last = p.rows(starts + torch.arange(len(admitted)) + num_accepted)  # p at the stop row (d_b + b + n_b)
    if not bool(rejected.any()):
        return p_last
    at_q = torch.zeros_like(p_last.probs)  # q on p's candidates (or on every token where p is dense)
    rows = rejected.nonzero().flatten()
    q_rejected = q.rows((starts + num_accepted)[rows])  # q at the rejected slot
    at_q[rows] = q_rejected.lookup(None if p_last.ids is None else p_last.ids[rows])
    return TokenProbs(_residual_weights(p_last.probs, at_q), p_last.ids, p.vocab)


def rejection_sample_reference(
    draft_token_ids: torch.Tensor,  # [S] int64
    draft_probs: TokenProbs | torch.Tensor,  # [S, V]
    target_probs: TokenProbs | torch.Tensor,  # [S + B, V]
    admitted: Ragged,  # k_b per request
    generators: Sequence[torch.Generator],  # [B]
) -> AcceptResult:
    """Plain per-request, per-slot loop over dense rows; same rule and draw order as `rejection_sample`."""
    draft_probs, target_probs = TokenProbs.of(draft_probs).to_dense(), TokenProbs.of(target_probs).to_dense()
    counts = _check_inputs(draft_token_ids, TokenProbs.dense(draft_probs), TokenProbs.dense(target_probs),
                           admitted, generators)
    uniforms = [torch.rand(k, generator=g, dtype=torch.float64)
                for k, g in zip(counts, generators)]  # draw order, phase 1
    num_accepted, output_tokens = [], []
    d = 0  # first draft row of request b; its first target row is d + b
    for b, k in enumerate(counts):
        t = d + b
        tokens: list[int] = []
        weights = target_probs[t + k]  # bonus distribution unless a slot is rejected
        for i in range(k):
            x = int(draft_token_ids[d + i])
            p, q = target_probs[t + i], draft_probs[d + i]
            if uniforms[b][i] * q[x].double() < p[x].double():
                tokens.append(x)
                continue
            weights = _residual_weights(p, q)
            break
        num_accepted.append(len(tokens))
        output_tokens.append(tokens + [categorical(weights, generators[b])])
        d += k
    return AcceptResult(num_accepted=torch.tensor(num_accepted, dtype=torch.int64),
                        output_tokens=output_tokens)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The recovered-token distribution norm(max(0, p - q)), or p where that mass is <= RESIDUAL_EPS.

    target_probs: # [N, V] p_i
    draft_probs:  # [N, V] q_i
    returns:      # [N, V], rows sum to 1
    """
    weights = _residual_weights(target_probs, draft_probs)
    return weights / weights.sum(-1, keepdim=True)


def _residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual max(0, p - q) (# [..., V]), replaced by p where its mass is ~0."""
    residual = torch.clamp(p - q, min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > RESIDUAL_EPS, residual, p)


def _draw_uniforms(counts: list[int], generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Phase 1 of the draw order: k_b float64 uniforms per request, concatenated (# [S])."""
    parts = [torch.rand(k, generator=g, dtype=torch.float64) for k, g in zip(counts, generators)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _check_inputs(draft_token_ids: torch.Tensor, draft_probs: TokenProbs, target_probs: TokenProbs,
                  admitted: Ragged, generators: Sequence[torch.Generator]) -> list[int]:
    """Validate the ragged layout; return the admitted counts as a list of ints."""
    counts = [int(k) for k in admitted.counts.tolist()]
    B, S = len(counts), sum(counts)
    if any(k < 0 for k in counts):
        raise ValueError(f"admitted counts must be >= 0, got {counts}")
    if draft_token_ids.shape != (S,) or len(draft_probs) != S:
        raise ValueError(f"the admitted counts sum to S = {S}, but draft_token_ids has shape "
                         f"{tuple(draft_token_ids.shape)} and draft_probs {len(draft_probs)} rows; "
                         "both need S rows")
    if len(target_probs) != S + B or target_probs.vocab != draft_probs.vocab:
        raise ValueError(f"target_probs has {len(target_probs)} rows over V = {target_probs.vocab}; expected "
                         f"(S + B, V) = ({S + B}, {draft_probs.vocab}): each request needs "
                         "its slot rows plus one bonus row")
    if len(generators) != B:
        raise ValueError(f"got {len(generators)} generators for B = {B} requests; pass one per request")
    return counts


def _native_ops():
    """The native kernels' ops, or None where none is built (results are the same either way)."""
    from specav.models import native

    return native.ops_or_none()
