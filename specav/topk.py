"""The k largest entries of each vocabulary row: what top-k sampling (verification/sampling.py)
and the drafter's features (acceptance/features.py: the top two) need of a 152k-entry row.

Owns one function, `scaled_top_k`: the native one-pass kernel (specav/models/native/topk.cpp)
where the native library is built, torch.topk otherwise; both compute the same values. It sits
below sampling and acceptance so that neither imports the other.

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


def _native_ops():
    """The native kernels' ops (speed only, never results), or None where none is built
    (SPECAV_NO_NATIVE, no compiler, a CPU without AVX2)."""
    from specav.models import native

    return native.ops() if native.available() else None
