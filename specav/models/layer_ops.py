"""The arithmetic between a decoder layer's matmuls: norms, rotary embedding, attention, gated MLP.

Owns: two interchangeable implementations of what the packed forward (packed.py) does
between its linear layers, both with transformers' Llama / Qwen2 semantics:

- `TorchLayerOps`: torch ops, any dtype. RMSNorm is transformers' own module (float32
  as one `F.rms_norm`); attention is one `F.scaled_dot_product_attention` call over the
  requests padded to the longest one, with a causal mask (`_PaddedLayout`).
- `NativeLayerOps`: float32 only, one native call per operation (native/layers.cpp, in the
  native variant this machine runs): residual add fused with the next norm, rotary in place,
  SiLU-gate fused with its product, and attention straight from each request's cache (no
  padding, no mask). On a decoding row these ops cost microseconds where the torch ops cost
  tens, which is about a quarter of a quantized decoding forward (docs/quantized.md). Where
  the MLP has gate and up fused into one call (quant.FusedLinear), it uses that call. Where a
  layer's seven linears all run kquant at the forward's row count (quant.KQuantLayer), the
  whole layer is native (`whole_layer`; native/decoder.cpp), and consecutive such layers are one
  call (`decoder_layers`): the same functions in the same order, so the same numbers, without
  returning to Python between them.

`layer_ops_for(model)` picks the native ops where they apply (float32 activations, SiLU
gate, head dim a multiple of 8, native kernels built) and the torch ops elsewhere; the two
agree to float32 rounding (tests/test_native_layers.py).

Must not know: weights' formats, caches' growth, sampling, requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from specav.models import native


class TorchLayerOps:
    """transformers' arithmetic in torch ops (any dtype)."""

    name = "torch"

    @staticmethod
    def norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm; in float32 the same formula as one fused op (fewer calls per layer)."""
        if x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
            return norm(x)  # other dtypes keep transformers' own rounding (upcast, normalise, cast, scale)
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    @classmethod
    def add_norm(cls, h: torch.Tensor, y: torch.Tensor, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h + y, and its norm."""
        h = h + y
        return h, cls.norm(norm, h)

    @staticmethod
    def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin # [T, D] -> cos, sin' # [T, 1, D] with the rotate-half sign folded in:
        x cos + cat(-x2, x1) sin = x cos + roll(x, D/2) sin', sin' = cat(-sin1, sin2)."""
        half = cos.shape[-1] // 2
        return cos[:, None, :], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None, :]

    @staticmethod
    def rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x # [T, heads, D] rotated."""
        cos, signed_sin = tables
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    @staticmethod
    def layout(cached: Sequence[int], lengths: Sequence[int]) -> "_PaddedLayout":
        return _PaddedLayout.of(cached, lengths)

    @staticmethod
    def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], layout: "_PaddedLayout",
               scale: float) -> torch.Tensor:
        """q # [T, H, D]; keys, values: per request # [P_b + n_b, Hkv, D] -> # [T, H, D]."""
        out = F.scaled_dot_product_attention(
            layout.pad_queries(q).transpose(1, 2),  # [B, H, n_max, D]
            _pad(keys).transpose(1, 2),  # [B, Hkv, P_max, D]
            _pad(values).transpose(1, 2),  # [B, Hkv, P_max, D]
            attn_mask=layout.mask, scale=scale, enable_gqa=True)  # [B, H, n_max, D]
        return layout.unpad(out.transpose(1, 2))

    @staticmethod
    def mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp(x)  # transformers' own (a quantized MLP's projections are modules too)

    @staticmethod
    def whole_layer(layer: torch.nn.Module, rows: int) -> None:
        return None  # torch ops run op by op


class NativeLayerOps:
    """The same arithmetic as `TorchLayerOps` in one native call per operation (float32), from one
    native variant's ops (`native.ops()`: the variant this machine runs, unless told otherwise)."""

    name = "native"

    def __init__(self, ops=None) -> None:
        self.native = ops if ops is not None else native.ops()  # torch.ops.specav_<variant>

    def norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.native.rms_norm(x, norm.weight, norm.variance_epsilon)

    def add_norm(self, h: torch.Tensor, y: torch.Tensor, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """h += y in place (h is the forward's own residual stream), and its norm."""
        return h, self.native.add_rms_norm_(h, y, norm.weight, norm.variance_epsilon)

    @staticmethod
    def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos.contiguous(), sin.contiguous()  # [T, D] each

    def rope(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.native.rope_(x, *tables)  # x is a fresh projection: rotated in place

    @staticmethod
    def layout(cached: Sequence[int], lengths: Sequence[int]) -> list[int]:
        return list(lengths)  # the native attention reads each request's cache as it is: no padding

    def attend(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], layout: list[int],
               scale: float) -> torch.Tensor:
        return self.native.attention(q, keys, values, layout, scale)

    def mlp(self, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)); gate and up in one call where the MLP has them fused."""
        gate_up = getattr(mlp, "gate_up_proj", None)  # quant.FusedLinear, on quantized models
        gate, up = gate_up(x) if gate_up is not None else (mlp.gate_proj(x), mlp.up_proj(x))
        return mlp.down_proj(self.native.silu_mul(gate, up))

    @staticmethod
    def whole_layer(layer: torch.nn.Module, rows: int):
        """The layer as the whole-layer call takes it (quant.WholeLayerCall) where all of its linears
        run kquant at `rows` rows, its attention half where q, k, v and o do (`mlp` False), else None
        (op by op)."""
        kquant = getattr(layer, "kquant", None)  # quant.KQuantLayer, on quantized models
        return None if kquant is None else kquant.at(rows)

    def decoder_layers(self, calls, h: torch.Tensor, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       batch, heads: int) -> torch.Tensor:
        """Consecutive whole layers in one native call, each as decoder_layer_ runs it: h (the
        residual stream) updated in place, each request's new keys and values written into its
        cache; returns the normed input of the layer after the last. calls: the layers'
        quant.WholeLayerCall, in order; batch: the forward's requests (packed._Batch): their caches'
        key and value tensors # [L, capacity, Hkv, D], the positions filled before this forward,
        the new tokens."""
        return self.native.decoder_layers_(
            h, x, [w for c in calls for w in c.blocks], [q for c in calls for q in c.qtypes],
            [b for c in calls for b in c.biases], [c.post_norm for c in calls], [c.post_eps for c in calls],
            [c.next_norm for c in calls], [c.next_eps for c in calls], *rope, batch.keys, batch.values,
            [c.index for c in calls], batch.cached, batch.lengths, heads, [c.scale for c in calls])

    def attention_block(self, call, h: torch.Tensor, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                        batch, heads: int) -> torch.Tensor:
        """The layer's attention half in one native call (call: its quant.WholeLayerCall with `mlp`
        False): h += o_proj(attention) in place, the new keys and values written into the caches;
        returns the post-attention norm of h, the MLP's input."""
        return self.native.attention_block_(
            h, x, call.blocks, call.qtypes, call.biases, call.post_norm, call.post_eps, *rope, batch.keys,
            batch.values, call.index, batch.cached, batch.lengths, heads, call.scale)


LayerOps = TorchLayerOps | NativeLayerOps


def layer_ops_for(dtype: torch.dtype, hidden_act: str, head_dim: int) -> LayerOps:
    """The native ops where they apply (float32, SiLU gate, head dim a multiple of 8, kernels built)."""
    if dtype == torch.float32 and hidden_act == "silu" and head_dim % 8 == 0 and native.available():
        return NativeLayerOps()
    return TorchLayerOps()


@dataclass(slots=True)
class _PaddedLayout:
    """Where each request's queries sit in the padded attention batch, and its causal mask."""

    lengths: list[int]  # new tokens per request (n_b)
    rows: torch.Tensor  # [T] row of each packed token in the flattened [B * n_max] padded queries
    n_max: int
    mask: torch.Tensor | None  # [B, 1, n_max, P_max] bool: query j of request b sees keys 0..P_b + j;
    # None for one request with one query (it sees every key)

    @classmethod
    def of(cls, cached: Sequence[int], lengths: Sequence[int]) -> "_PaddedLayout":
        n_max = max(lengths)
        if len(lengths) == 1 and n_max == 1:  # decoding one request: no padding, no causal structure
            return cls([1], torch.zeros(1, dtype=torch.long), 1, None)
        rows = torch.cat([torch.arange(b * n_max, b * n_max + n) for b, n in enumerate(lengths)])
        p = torch.tensor(cached)[:, None, None]  # [B, 1, 1]
        n = torch.tensor(lengths)[:, None, None]
        j = torch.arange(n_max)[None, :, None]  # [1, n_max, 1]
        t = torch.arange(max(c + q for c, q in zip(cached, lengths)))[None, None, :]  # [1, 1, P_max]
        # Padding queries (j >= n_b) see all real keys, so no row is fully masked; they are dropped.
        mask = (t <= p + j) & (t < p + n)
        return cls(list(lengths), rows, n_max, mask[:, None])

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """# [T, H, D] -> # [B, n_max, H, D] (a view when there is one request)."""
        if len(self.lengths) == 1:
            return q[None]
        padded = q.new_zeros(len(self.lengths) * self.n_max, *q.shape[1:])
        padded[self.rows] = q
        return padded.view(len(self.lengths), self.n_max, *q.shape[1:])

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """# [B, n_max, H, D] -> # [T, H, D]."""
        if len(self.lengths) == 1:
            return out[0]
        return out.reshape(-1, *out.shape[2:])[self.rows]


def _pad(per_request: list[torch.Tensor]) -> torch.Tensor:
    """# B x [P_b, Hkv, D] -> # [B, P_max, Hkv, D]; a single request is a view, not a copy."""
    return per_request[0][None] if len(per_request) == 1 else pad_sequence(per_request, batch_first=True)
