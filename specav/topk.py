"""Passes over vocabulary rows: what top-k sampling (verification/sampling.py) and the drafter's
features (acceptance/features.py) need of a 152k-entry row, once per drafted slot.

Owns two functions, each the native kernel (specav/models/native/topk.cpp) where the native
library is built and torch's ops otherwise: `scaled_top_k`, the k largest entries (both paths the
same values bit for bit), and `top_two_tail`, the top two with the sums of the softmax tail
(the same to float32 rounding). It sits below sampling and acceptance so that neither imports the
other.

Must not know: models, requests, sampling parameters beyond temperature.
"""

from __future__ import annotations

import torch


def scaled_top_k(logits: torch.Tensor, temperature: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k largest of each row of logits / temperature (rows with temperature <= 0 unscaled).

    logits:      # [N, V] float32 without NaN
    temperature: # [N] float32
    k:           1 <= k <= V
    returns:     values # [N, k] descending; their token ids # [N, k] int64; and how many entries of
                 each row reach the k-th value # [N] int64 (k unless it ties with entries beyond it)

    One pass of the native kernel where it is built (about a tenth of torch.topk's time on a
    152k-entry row), else torch.topk; both divide by the temperature with one IEEE division, so
    the values are the same bit for bit. Tied values may come in another order of token ids.
    """
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"scaled_top_k: k = {k} must be in [1, V = {logits.shape[-1]}]")
    logits, temperature = logits.float().contiguous(), temperature.float().contiguous()
    ops = _native_ops()
    if ops is not None and logits.ndim == 2:
        return ops.scaled_top_k(logits, temperature, k)
    return torch_scaled_top_k(logits, temperature, k)


def torch_scaled_top_k(logits: torch.Tensor, temperature: torch.Tensor, k: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scaled_top_k on torch's ops (the reference, and the path without native kernels)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / t[:, None]
    values, index = scaled.topk(k, dim=-1)
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

    return native.ops() if native.available() else None
