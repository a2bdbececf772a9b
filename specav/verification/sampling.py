"""Sampling transforms: logits -> the processed distributions q_i and p_i, and categorical draws.

This module owns how a request's SamplingParams (temperature, top-k, top-p) turn raw logits
into probabilities, and how one token is drawn from them with an explicit generator. Every
function is batched over N rows (any rows: slots of many requests, or one row per request),
each row with its own parameters.

`processed_probs` is applied identically to the drafter's logits (giving q_i) and to the
target's logits (giving p_i), with the same request's parameters. Rejection sampling is
lossless with respect to the processed target distribution p_i, so the two sides must go
through this one function; any other transform of q alone would only lower acceptance, any
other transform of p would change what "the target" means.

Non-finite logits. A row with a NaN or +inf logit, or with no finite logit, has no
distribution: argmax over NaN picks an arbitrary token and softmax turns it into NaN weights.
`processed_probs` refuses such rows (`NonFiniteLogitsError`, naming them) and `sample` refuses
weights that are not a distribution; -inf alone only masks a token. The caller that knows which
request owns a row (sampling_rows.py) checks first and fails that request alone.

Per-request logit transforms (`apply_penalties`, `apply_logit_bias`) run before temperature, on
the drafter's and the target's logits alike, for the same reason as above.

It must not know about models, the engine, requests or the rejection sampler, and it never
touches the global RNG.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specav import topk
from specav.token_probs import TokenProbs
from specav.topk import RowScan, Tails, candidate_probs, nucleus_in_sorted, row_tails, scan_rows


class NonFiniteLogitsError(ValueError):
    """Rows of logits with NaN or +inf entries, or no finite entry: there is no distribution to sample."""

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows = list(rows)
        super().__init__(f"logits rows {self.rows} hold NaN or +inf (or no finite value); refusing to sample "
                         "from them")


def non_finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Rows that have no distribution: a NaN or +inf logit, or no finite logit.  # [N, V] -> [N] bool

    One reduction: a row's max is NaN if it holds a NaN, +inf if it holds +inf, -inf if nothing
    in it is finite, and finite otherwise.
    """
    return ~torch.isfinite(logits.amax(dim=-1))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: logit[v] - frequency * count[v] - presence * (count[v] > 0).

    logits:    # [N, V] float32
    counts:    # [N, V] float32, how often each token occurs in the output the row conditions on
    presence:  # [N] float32
    frequency: # [N] float32
    returns:   # [N, V] float32
    """
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """logits # [N, V] with bias # [M] added at token_ids # [M] int64 of every row."""
    out = logits.clone()
    out[:, token_ids] += bias.to(logits.dtype)
    return out


def temperature_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Logits divided by each row's temperature; rows with temperature 0 are returned unscaled.

    logits:      # [N, V] float32
    temperature: # [N] float32, >= 0 (0 = greedy)
    returns:     # [N, V] float32
    """
    t = temperature.to(device=logits.device, dtype=logits.dtype)
    t = torch.where(t > 0, t, torch.ones_like(t))
    return logits / t[:, None]


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """The processed distribution of each row: temperature, then top-k, then top-p, renormalised.

    logits:      # [N, V] float32, raw model logits
    temperature: # [N] float32, >= 0; 0 = greedy
    top_k:       # [N] int64, >= 0; 0 = off. Keeps every token whose logit is >= the k-th
                 #   largest (ties at the boundary are all kept).
    top_p:       # [N] float32 in (0, 1]; 1 = off. Keeps the smallest set of highest-probability
                 #   tokens whose mass is >= top_p (at least one token), plus every token tied in
                 #   probability with the last one kept, so the result does not depend on token order.
    returns:     # [N, V] float32, rows sum to 1

    Greedy rows (temperature 0) are a one-hot at the argmax of the raw logits (first index on
    ties); top-k and top-p do not change them. The same call produces q_i from the drafter's
    logits and p_i from the target's (see the module docstring). Rows without a distribution
    (`non_finite_rows`) raise NonFiniteLogitsError. `processed_distributions` gives the same rows
    as their candidates.
    """
    return processed_distributions(logits, temperature, top_k, top_p).to_dense()


def processed_distributions(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> TokenProbs:
    """processed_probs as a TokenProbs: the rows as their candidates wherever every row has them.

    Greedy rows are one candidate (the argmax of the raw logits, first on ties). Rows with
    0 < top_k <= _SPARSE_TOP_K (< V) are computed on their k candidates only (softmax and nucleus
    over k values), which costs two passes over the vocabulary instead of a dozen; a row with a tie
    at its k-th value beyond k takes the dense path, which keeps all tied tokens. If any row is
    dense, so is the result (the candidates scattered into zeros). Each row's probabilities depend
    on that row alone, so a row's result never depends on the rest of the batch.
    """
    return _distributions(logits, temperature, top_k, top_p, tails=False)[0]


def distributions_and_tails(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[TokenProbs, Tails]:
    """processed_distributions and, from the same scan of each row, the Tails of its temperature-
    scaled, untruncated logits (raw for greedy rows): what the drafter's features read of its slot."""
    probs, tails = _distributions(logits, temperature, top_k, top_p, tails=True)
    assert tails is not None
    return probs, tails


def _distributions(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   tails: bool) -> tuple[TokenProbs, Tails | None]:
    logits32 = logits.float().contiguous()
    n, vocab = logits32.shape
    if n == 0:
        return TokenProbs.dense(logits32), row_tails(logits32) if tails else None
    temperature, top_k, top_p = temperature.float(), top_k.to(torch.int64), top_p.float()
    # Rows grouped on the host: most batches are one group (every request with the same top_k).
    ks = [0 if t == 0 else k if 0 < k <= min(_SPARSE_TOP_K, vocab - 1) else -1
          for t, k in zip(temperature.tolist(), top_k.tolist())]  # 0: greedy, -1: dense, else k
    groups: dict[int, list[int]] = {}
    for row, k in enumerate(ks):
        groups.setdefault(k, []).append(row)
    parts: list[tuple[list[int], TokenProbs]] = []  # rows and their candidates
    tail_parts: list[tuple[list[int], Tails]] = []  # rows and their Tails
    bad: list[int] = []  # rows without a distribution
    dense_rows = groups.pop(-1, [])
    if tails and dense_rows:  # rows without a top-k: their Tails on their own
        index = torch.tensor(dense_rows, dtype=torch.int64)
        tail_parts.append((dense_rows, row_tails(temperature_logits(logits32[index], temperature[index]))))
    for k, rows in groups.items():
        index = None if len(rows) == n else torch.tensor(rows, dtype=torch.int64)  # None: every row, no copies
        x = logits32 if index is None else logits32[index]
        t = temperature if index is None else temperature[index]
        scan = scan_rows(x, t, max(k, 1), tails=tails and vocab > 1)  # greedy: t = 0 leaves the logits raw
        bad += [r for r, b in zip(rows, scan.bad.tolist()) if b]
        if tails:
            tail_parts.append((rows, scan.tails if scan.tails is not None else row_tails(x)))
        if k == 0:  # greedy: the argmax of the raw logits, first on ties
            parts.append((rows, TokenProbs(torch.ones(len(rows), 1), scan.ids, vocab)))
            continue
        ids, part, untied = _top_k_candidate_probs(scan, top_p if index is None else top_p[index])
        if bool(untied.all()):
            parts.append((rows, TokenProbs(part, ids, vocab)))
        else:  # a tie at the k-th value: those rows go dense
            keep = untied.tolist()
            dense_rows += [r for r, u in zip(rows, keep) if not u]
            parts.append(([r for r, u in zip(rows, keep) if u], TokenProbs(part[untied], ids[untied], vocab)))
    if dense_rows:  # checked here: the scans checked every other row
        dense = torch.tensor(sorted(dense_rows), dtype=torch.int64)
        bad += dense[non_finite_rows(logits32[dense])].tolist()
    if bad:
        raise NonFiniteLogitsError(sorted(set(bad)))
    gathered = _in_row_order(tail_parts, Tails.cat) if tails else None
    if not dense_rows:
        return _in_row_order(parts, lambda p: TokenProbs.cat(p, vocab)), gathered
    probs = torch.zeros_like(logits32)
    for rows, part in parts:
        probs[rows] = part.to_dense()
    scaled = temperature_logits(logits32[dense], temperature[dense])
    probs[dense] = _dense_probs(scaled, top_k[dense], top_p[dense])
    return TokenProbs.dense(probs), gathered


def _in_row_order(parts: list, cat):
    """The parts' rows (each part: its rows and a value of them) as one value in row order."""
    if len(parts) == 1:
        return parts[0][1]  # the usual batch: one group, every row in order
    order = torch.tensor([r for rows, _ in parts for r in rows]).argsort()
    return cat([part for _, part in parts]).rows(order)


_SPARSE_TOP_K = 1024  # rows with 0 < top_k <= this are computed on their top-k candidates


def _dense_probs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k mask, softmax over the vocabulary, nucleus: scaled # [n, V] -> probs # [n, V]."""
    return _apply_top_p(torch.softmax(_apply_top_k(scaled, top_k), dim=-1), top_p)


def _top_k_candidate_probs(scan: RowScan, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """processed_probs of rows sharing one top_k = k, from their scan's k largest scaled logits only.

    top_p: # [n]. Returns the candidates' ids in ascending order and their probabilities (# [n, k]
    each; scatter them into zeros for the rows), and which rows they hold (# [n] bool): False where
    a token beyond the k largest ties with the k-th (the dense path keeps every tied token) or
    where fewer than k logits are finite.
    """
    ids, probs = candidate_probs(scan.values, scan.ids, top_p)
    return ids, probs, scan.at_least == scan.values.shape[1]


def sample(probs: torch.Tensor | TokenProbs, generators: Sequence[torch.Generator],
           uniforms: Sequence[float] | None = None) -> torch.Tensor:
    """One token per row, drawn with that row's generator (rows of one request may share one).

    probs:      # [N, V] float32 or a TokenProbs of N rows: non-negative weights with positive sum
                (need not be normalised)
    generators: N generators on probs' device; each row draws one float64 uniform, in row order
    uniforms:   N floats, those uniforms drawn already (`draw_uniforms(generators)`), or None
    returns:    # [N] int64

    Inverse CDF in float64: row n yields the first token whose cumulative weight exceeds
    u_n * (row total), so token v has probability weight_v / total up to float64 rounding, and a
    zero-weight token is never drawn. One uniform per row, where torch.multinomial draws one
    exponential per vocabulary entry (about 4 ms per row at V = 152k on this machine's CPU).

    Rows carried as candidates walk their candidates in ascending token order, as a dense row is
    walked, so a row gives the same token from the same uniform in either form. A dense row walks
    two levels, so it costs one pass of block sums and not a float64 cumulative sum over the whole
    vocabulary: the cumulative block sums (blocks of _SAMPLE_BLOCK tokens) find the block, the
    cumulative sum within it (started from the blocks before it) finds the token. A zero-weight
    token adds nothing to the sum it follows, so it is never the first to exceed the threshold.
    """
    if len(generators) != len(probs):
        raise ValueError(f"sample: got {len(generators)} generators for {len(probs)} rows; "
                         "pass one generator per row")
    if not generators:
        return torch.zeros(0, dtype=torch.int64)
    if isinstance(probs, TokenProbs):
        if probs.ids is not None:
            return _sample_candidates(probs, generators, uniforms)
        probs = probs.probs
    cumulative = _block_sums(probs).cumsum(-1)  # [N, blocks] float64
    totals = cumulative[:, -1]  # [N]
    if not (torch.isfinite(totals).all() and (totals > 0).all() and probs.min() >= 0):
        raise ValueError("sample: every row needs finite, non-negative weights with a positive sum")
    u = torch.tensor(uniforms if uniforms is not None else draw_uniforms(generators), dtype=torch.float64)  # [N]
    threshold = (u * totals)[:, None]  # [N, 1]
    block = torch.searchsorted(cumulative, threshold, right=True)  # [N, 1]: the first block past it
    overflow = block[:, 0] >= cumulative.shape[1]  # u * total rounded up to the total
    block = block.clamp_(max=cumulative.shape[1] - 1)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp_(min=0)), 0.0)  # [N, 1]
    columns = block * _SAMPLE_BLOCK + torch.arange(_SAMPLE_BLOCK, device=probs.device)  # [N, BLOCK]
    inside = columns < probs.shape[1]
    weights = torch.where(inside, probs.gather(1, columns.clamp(max=probs.shape[1] - 1)), 0).double()
    offset = torch.searchsorted(before + weights.cumsum(-1), threshold, right=True)[:, 0]  # [N]
    # Past the block's end only where its own sum rounded above what its entries add up to, or on
    # overflow: then the last token with weight in the block, or in the row.
    short = offset >= _SAMPLE_BLOCK
    if bool(short.any()):
        offset = torch.where(short, _last_positive(weights), offset)
    tokens = columns[:, 0] + offset
    if bool(overflow.any()):
        tokens = torch.where(overflow, _last_positive(probs), tokens)
    return tokens


def _sample_candidates(probs: TokenProbs, generators: Sequence[torch.Generator],
                       uniforms: Sequence[float] | None) -> torch.Tensor:
    """`sample` of rows carried as candidates: the inverse CDF over each row's W candidates, in numpy
    (N x W values: numpy's ops cost a few us where torch's cost tens in a step)."""
    weights = probs.probs.double().numpy()  # [N, W]
    cumulative = weights.cumsum(-1)  # sequential, as torch's float64 cumsum
    totals = cumulative[:, -1]
    if not (np.isfinite(totals).all() and (totals > 0).all() and (weights >= 0).all()):
        raise ValueError("sample: every row needs finite, non-negative weights with a positive sum")
    u = np.array(uniforms if uniforms is not None else draw_uniforms(generators))  # row order
    offset = (cumulative <= (u * totals)[:, None]).sum(-1)  # searchsorted(right): entries <= the threshold
    short = offset >= weights.shape[1]  # u * total rounded up to the total: the last weighted candidate
    if short.any():
        last = weights.shape[1] - 1 - (weights[:, ::-1] > 0).argmax(-1)
        offset = np.where(short, last, offset)
    return probs.ids.gather(1, torch.from_numpy(offset)[:, None]).squeeze(1)


def draw_uniforms(generators: Sequence[torch.Generator]) -> list[float]:
    """One float64 uniform per row from its generator, in row order: what `sample` draws."""
    return [torch.rand(1, generator=g, dtype=torch.float64).item() for g in generators]


def top_k_distributions(logits: torch.Tensor, temperature: Sequence[float], k: int, top_p: Sequence[float]
                        ) -> TokenProbs | None:
    """processed_distributions of rows that share top-k = k (0 < k <= _SPARSE_TOP_K, k < V) and a
    positive temperature: the same candidates and probabilities, from one native call
    (topk.top_k_probs). None where that call cannot answer (no native library, a row without a
    distribution or tied at its k-th value): the caller takes the general path."""
    if not 0 < k <= _SPARSE_TOP_K:
        return None
    rows = topk.top_k_probs(logits, temperature, k, top_p)
    if rows is None or not all(rows[2].tolist()):
        return None
    ids, probs, _ = rows
    return TokenProbs(probs, ids, logits.shape[-1])


def draw_top_k(logits: torch.Tensor, temperature: Sequence[float], k: int, top_p: Sequence[float],
               uniforms: Sequence[float]) -> tuple[TokenProbs, Tails, torch.Tensor] | None:
    """distributions_and_tails, then `sample` with the given uniforms, of rows as top_k_distributions
    takes them: the same candidates, probabilities, Tails and tokens, from one native call
    (topk.draw_top_k); None where it cannot answer, as there (the caller takes the general path
    with the same uniforms)."""
    if not 0 < k <= _SPARSE_TOP_K:
        return None
    drawn = topk.draw_top_k(logits, temperature, k, top_p, uniforms)
    if drawn is None:
        return None
    ids, probs, tokens, ok, tails = drawn
    if not all(ok.tolist()):
        return None
    return TokenProbs(probs, ids, logits.shape[-1]), tails, tokens


_SAMPLE_BLOCK = 1024  # tokens per block of sample's first level


def _block_sums(probs: torch.Tensor) -> torch.Tensor:
    """Float64 sums of each row's consecutive blocks of _SAMPLE_BLOCK entries (# [N, ceil(V / BLOCK)])."""
    n, v = probs.shape
    whole = v - v % _SAMPLE_BLOCK
    sums = probs[:, :whole].reshape(n, -1, _SAMPLE_BLOCK).sum(-1, dtype=torch.float64)
    if whole < v:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True, dtype=torch.float64)], dim=1)
    return sums


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """Index of each row's last positive entry (# [N]); weights # [N, M]."""
    return weights.shape[1] - 1 - (weights.flip(-1) > 0).int().argmax(-1)


def categorical(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index of a weight vector (# [V], non-negative, positive sum), as `sample` draws it."""
    return int(sample(weights[None], [generator])[0])


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every logit below its row's k-th largest; rows with k = 0 are untouched."""
    top_k = top_k.to(device=logits.device, dtype=torch.int64)
    if not bool((top_k > 0).any()):
        return logits
    k_max = min(int(top_k.max()), logits.shape[-1])
    k = top_k.clamp(1, k_max)
    kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])  # [N, 1]
    drop = (logits < kth) & (top_k > 0)[:, None]
    return logits.masked_fill(drop, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail beyond each row's nucleus and renormalise; rows with top_p >= 1 are untouched."""
    rows = (top_p.to(probs.device) < 1).nonzero().flatten()
    if rows.numel() == 0:
        return probs
    sub = probs[rows]  # [n, V]
    boundary = _nucleus_boundary(sub, top_p.to(device=probs.device, dtype=torch.float64)[rows])
    kept = (sub >= boundary) & (sub > 0)
    sub = sub * kept
    out = probs.clone()
    out[rows] = sub / sub.sum(-1, keepdim=True)
    return out


_TOP_P_CANDIDATES = 1024  # the nucleus is first sought among this many most probable tokens


def _nucleus_boundary(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probability of the last token of each row's nucleus (# [n, 1]); probs # [n, V], top_p # [n].

    A top-k of the candidates finds it unless they hold less than top_p of the mass; only those
    rows pay for a full sort. Both paths see the same leading values, so they agree exactly.
    """
    desc = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values
    boundary, reached = nucleus_in_sorted(desc, top_p)
    short = (~reached).nonzero().flatten()
    if short.numel():
        desc = probs[short].sort(dim=-1, descending=True).values
        boundary[short] = nucleus_in_sorted(desc, top_p[short])[0]
    return boundary
