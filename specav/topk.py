"""Passes over vocabulary rows: what top-k sampling (verification/sampling.py) and the drafter's
features (acceptance/features.py) need of a 152k-entry row, once per drafted slot.

Owns `scan_rows`, the one scan of a row that sampling and the features share: the k largest
entries of the temperature-scaled row, whether the row has a distribution at all, and where asked
its `Tails` (what the features read: the gap between the top two and the sums of the softmax tail).
Also `top_two_tail`, the tails of rows already scaled, and `candidate_probs`, the
processed probabilities of top-k candidates (softmax over k values and the nucleus: the top-p rule,
`nucleus_in_sorted`, lives here for the dense path of sampling.py too). Each is the native kernel
(specav/models/native/topk.cpp) where the native library is built and torch's ops otherwise (the
same values bit for bit for the top k, the same to float32 rounding for the tail sums). It sits
below sampling and acceptance so that neither imports the other.

Must not know: models, requests, sampling parameters beyond temperature and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True)
class Tails:
    """What the drafter's features need of N rows of z (temperature-scaled, untruncated logits);
    acceptance/features.py turns them into logit(q_max), q_max, entropy and the top-2 margin. With m
    the largest entry of a row, d_j = max(z_j - m, -100) over every entry but the first maximum."""

    gap: torch.Tensor  # [N] second largest minus largest, <= 0 (-inf where V = 1)
    tail: torch.Tensor  # [N] float64, sum_j exp(d_j)
    moment: torch.Tensor  # [N] float64, sum_j exp(d_j) d_j

    def rows(self, index: torch.Tensor) -> "Tails":
        return Tails(self.gap[index], self.tail[index], self.moment[index])

    @staticmethod
    def cat(parts: "list[Tails]") -> "Tails":
        return Tails(*(torch.cat([getattr(p, f) for p in parts]) for f in ("gap", "tail", "moment")))


@dataclass(frozen=True, slots=True)
class RowScan:
    """scan_rows' result for N rows."""

    values: torch.Tensor  # [N, k] float32, the k largest of logits / t, descending
    ids: torch.Tensor  # [N, k] int64, their token ids
    at_least: torch.Tensor  # [N] int64, entries >= the k-th value (k unless it ties beyond k)
    bad: torch.Tensor  # [N] bool, rows without a distribution (NaN, +inf, no finite entry)
    tails: Tails | None  # where asked


def scan_rows(logits: torch.Tensor, temperature: torch.Tensor, k: int, tails: bool = False) -> RowScan:
    """The top k of each row of logits / temperature (rows with temperature <= 0 unscaled), which
    rows have no distribution, and with `tails` the features' Tails of the same scaled rows.

    logits: # [N, V] float32; temperature: # [N]; 1 <= k <= V (V >= 2 with tails).

    Two native passes over each row where built (the top k and the check; the tie count and the
    tail sums), else torch's ops. Values equal torch_scaled_top_k's bit for bit, tails top_two_tail's of
    the scaled rows. A bad row's other fields mean nothing: callers refuse it. Tied values may come
    in another order of token ids on the two paths.
    """
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"scan_rows: k = {k} must be in [1, V = {logits.shape[-1]}]")
    if tails and logits.shape[-1] < 2:
        raise ValueError(f"scan_rows: the tail sums need V >= 2, got {logits.shape[-1]}")
    logits, temperature = logits.float().contiguous(), temperature.float().contiguous()
    ops = _native_ops()
    if ops is not None and logits.ndim == 2:
        values, ids, at_least, bad, second, tail, moment = ops.scan_rows(logits, temperature, k, tails)
        gaps = Tails(second - values[:, 0], tail, moment) if tails else None
        return RowScan(values, ids, at_least, bad, gaps)
    return torch_scan_rows(logits, temperature, k, tails)


def torch_scan_rows(logits: torch.Tensor, temperature: torch.Tensor, k: int, tails: bool = False) -> RowScan:
    """scan_rows on torch's ops (the reference, and the path without native kernels)."""
    values, ids, at_least = torch_scaled_top_k(logits, temperature, k)
    bad = ~torch.isfinite(logits.amax(dim=-1))
    gaps = None
    if tails:
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        top, _, tail, moment = torch_top_two_tail(logits / t[:, None])
        gaps = Tails(top[:, 1] - top[:, 0], tail, moment)
    return RowScan(values, ids, at_least, bad, gaps)


def candidate_probs(values: torch.Tensor, ids: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The processed distribution of rows from their top-k candidates, in ascending token order.

    values: # [N, k] float32, a row's k largest scaled logits, descending (scan_rows' values);
    ids: # [N, k] int64, their token ids; top_p: # [N] (1 = off).
    returns: ids # [N, k] ascending per row, and their probabilities # [N, k]: softmax over the k
    values, then the nucleus (nucleus_in_sorted: zero below its boundary, renormalised).

    One native call where built; torch_candidate_probs otherwise. The two agree to float32
    rounding (softmax's exp and sums are not torch's), so a token whose mass sits within rounding
    of top_p could be kept by one and not the other: a process uses one of them for q and p alike.
    """
    ops = _native_ops()
    if ops is not None:
        return ops.candidate_probs(values.float().contiguous(), ids.contiguous(), top_p.float().contiguous())
    return torch_candidate_probs(values, ids, top_p)


def draw_top_k(logits: torch.Tensor, temperature: Sequence[float], k: int, top_p: Sequence[float],
               uniforms: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Tails] | None:
    """scan_rows with tails, candidate_probs and an inverse-CDF draw from each row's candidates, in one
    native call: rows of logits # [N, V] that share top-k = k, with per row a temperature > 0, a top_p
    (both as their float32 tensors hold them) and a uniform in [0, 1).

    Returns ids and probs # [N, k] (as candidate_probs gives them), tokens # [N] int64 (the first
    candidate, in ascending id order, whose float64 running weight exceeds u * total:
    verification/sampling.sample's draw), which rows those hold (# [N] bool: false where a row has no
    distribution or ties at its k-th value beyond k; the caller takes the general path) and the Tails;
    None where no native library is built. One call instead of four (the per-slot glue cost the
    drafter about 1 ms a slot in a step, with the caches cold after a forward).
    """
    ops = _native_ops()
    if ops is None or logits.ndim != 2 or not 1 <= k < logits.shape[-1]:
        return None
    ids, probs, tokens, ok, gap, tail, moment = ops.draw_top_k(logits.float().contiguous(), temperature, k, top_p,
                                                                uniforms)
    return ids, probs, tokens, ok, Tails(gap, tail, moment)


def top_k_probs(logits: torch.Tensor, temperature: Sequence[float], k: int, top_p: Sequence[float]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """draw_top_k without the draw and the Tails: ids and probs # [N, k] and which rows they hold
    (# [N] bool), in one native call; None where no native library is built."""
    ops = _native_ops()
    if ops is None or logits.ndim != 2 or not 1 <= k < logits.shape[-1]:
        return None
    return ops.top_k_probs(logits.float().contiguous(), temperature, k, top_p)


def torch_candidate_probs(values: torch.Tensor, ids: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """candidate_probs on torch's ops (the reference, and the path without native kernels)."""
    probs = torch.softmax(values.float(), dim=-1)  # [N, k]
    nucleus = top_p < 1  # [N]
    if bool(nucleus.any()):
        boundary, _ = nucleus_in_sorted(probs, top_p.double())
        sub = probs * ((probs >= boundary) & (probs > 0))
        probs = torch.where(nucleus[:, None], sub / sub.sum(-1, keepdim=True), probs)
    ids, order = ids.sort(dim=-1)
    return ids, probs.gather(1, order)


def nucleus_in_sorted(desc: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p rule on descending probabilities (# [N, m]): the probability of the last token of
    each row's nucleus (# [N, 1]; keep every token >= it), and whether the m hold top_p of the mass
    (# [N] bool). The nucleus is the tokens whose mass strictly above them is < top_p (at least one),
    plus every token tied with the last, so the result does not depend on token order."""
    cumulative = desc.double().cumsum(-1)
    mass_before = cumulative - desc.double()  # mass strictly above each rank
    num_kept = (mass_before < top_p[:, None]).sum(-1).clamp(min=1)
    return desc.gather(1, (num_kept - 1)[:, None]), cumulative[:, -1] >= top_p


def row_tails(z: torch.Tensor) -> Tails:
    """The Tails of rows of z # [..., V] (any leading shape; rows with NaN or +inf give meaningless
    numbers: callers replace them): the native passes for [N, V] float32 without such rows, else
    torch's ops."""
    special = z.ndim != 2 or z.dtype != torch.float32 or z.shape[-1] < 2 or not bool(torch.isfinite(z.amax(-1)).all())
    values, _, tail, moment = torch_top_two_tail(z) if special else top_two_tail(z)
    return Tails(values[..., 1] - values[..., 0], tail, moment)


def torch_scaled_top_k(logits: torch.Tensor, temperature: torch.Tensor, k: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k largest of each row of logits / temperature (rows with temperature <= 0 unscaled) on
    torch's ops: values # [N, k] descending, their ids # [N, k], and how many entries of each row
    reach the k-th value # [N] (scan_rows' reference: the native kernel divides with the same IEEE
    division, so the values are the same bit for bit)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / t[:, None]
    values, index = scaled.max(-1, keepdim=True) if k == 1 else scaled.topk(k, dim=-1)  # max: the first on ties
    return values, index, (scaled >= values[:, -1:]).sum(-1)


def top_two_tail(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two largest entries of each row and the sums of the softmax tail below the largest.

    z:       # [N, V] float32 without NaN or +inf (temperature-scaled logits), V >= 2
    returns: values # [N, 2] descending, their ids # [N, 2] int64 (the first maximum first), and with
             m the largest value and d_j = max(z_j - m, -100) over every entry but the first maximum:
             tail = sum_j exp(d_j) # [N] and moment = sum_j exp(d_j) d_j # [N], both float64

    One pass for the top two and one for the sums where the native library is built (a fifth of
    torch's six passes here); torch_top_two_tail otherwise, equal to float32 rounding.
    """
    if z.ndim != 2 or z.shape[-1] < 2:
        raise ValueError(f"top_two_tail: z must be [N, V] with V >= 2, got {tuple(z.shape)}")
    z = z.float().contiguous()
    ops = _native_ops()
    if ops is not None:
        return ops.top_two_tail(z)
    return torch_top_two_tail(z)


def torch_top_two_tail(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_two_tail on torch's ops, for any leading shape and V (the second value is -inf where
    V = 1), and rows with NaN or +inf (whose results mean nothing: callers replace them)."""
    top = z.topk(min(2, z.shape[-1]), dim=-1)
    values, indices = top.values, top.indices
    if z.shape[-1] == 1:
        values = torch.cat([values, torch.full_like(values, -torch.inf)], dim=-1)
        indices = torch.cat([indices, indices], dim=-1)
    d = (z - values[..., :1]).clamp_(min=-100.0)  # exp(-100) is far below what the clamp of logit(q_max) can see
    e = d.exp()
    e.scatter_(-1, indices[..., :1], 0.0)  # the first maximum out of the sums
    return values, indices, e.sum(-1, dtype=torch.float64), torch.linalg.vecdot(e, d).double()


def _native_ops():
    """The native kernels' ops (speed only, never results), or None where none is built
    (SPECAV_NO_NATIVE, no compiler, a CPU without AVX2)."""
    from specav.models import native

    return native.ops_or_none()
