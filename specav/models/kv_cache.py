"""Per-request KV cache with cheap rollback.

Owns: storage of one request's keys and values for every layer, appending new positions,
and rolling back the last n positions (rejected draft tokens).

Layout: one tensor for keys and one for values, each `# [L, capacity, Hkv, D]`, plus a
`length`. Rollback only moves `length` back: nothing is copied or freed, and the stale
entries past `length` are overwritten by the next append.

Growth: when an append does not fit, capacity doubles (at least to the needed size,
rounded up to a multiple of 64), copying the used part once. Appends are amortised O(1)
per position, and the cache holds at most twice the positions in use. Memory per cached
position is 2 * L * Hkv * D * bytes(dtype): for Qwen2.5-1.5B (L=28, Hkv=2, D=128) in
bf16 that is 28 KiB; for Qwen2.5-0.5B (L=24, Hkv=2, D=64) 12 KiB.

Must not know: the model's weights, attention math, or requests.
"""

from __future__ import annotations

import torch

_GRANULE = 64


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 256) -> None:
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.length = 0
        self.keys = torch.empty(num_layers, capacity, num_kv_heads, head_dim, dtype=dtype)  # [L, C, Hkv, D]
        self.values = torch.empty_like(self.keys)  # [L, C, Hkv, D]

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reserve(self, n: int) -> None:
        """Make room for n more positions past `length` (grows by doubling)."""
        need = self.length + n
        if need <= self.capacity:
            return
        new_cap = max(2 * self.capacity, -(-need // _GRANULE) * _GRANULE)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], new_cap, *old.shape[2:], dtype=self.dtype)
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store n new positions for one layer and return that layer's keys/values up to them.

        keys, values: # [n, Hkv, D]. Returns two views # [length + n, Hkv, D].
        `reserve(n)` must have been called; `advance(n)` commits after the last layer.
        """
        end = self.length + keys.shape[0]
        self.keys[layer, self.length:end] = keys
        self.values[layer, self.length:end] = values
        return self.keys[layer, :end], self.values[layer, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, n: int) -> None:
        """Forget the last n positions."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} positions of a cache holding {self.length}")
        self.length -= n
