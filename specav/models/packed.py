"""Packed variable-length forward for the Llama / Qwen2 family.

Owns: one forward pass over the new tokens of many requests concatenated (`# [T]`), each
request with its own query length and its own KV history (a `KVCache`), returning logits
only for the positions asked for. This is what verification needs: every request may
verify a different number of tokens in the same forward.

Linear layers, norms and the MLP run once over all T packed tokens; attention runs in
one call over the batch padded to the longest request, each request seeing its own cached
keys plus its new ones, causally (a boolean mask built once per forward). The weights and the
submodules are transformers' own (embedding, norms, projections, MLP, rotary embedding),
so the numbers match transformers' forward, and a module swapped for a quantized one is
picked up without changes here.

Must not know: sampling, drafting, requests or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from specav.models.kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [R, V] float32, R = sum(num_logits): each request's last num_logits positions
    hidden: torch.Tensor  # [R, hidden] final-normed hidden states at the same positions (model dtype)


class PackedCausalLM:
    """A transformers Llama/Qwen2 causal LM run through the packed varlen forward."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        config = hf_model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported; "
                             f"supported: {SUPPORTED_MODEL_TYPES}")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the packed forward")
        self.hf_model = hf_model.eval()
        self.config = config
        self.decoder = hf_model.model
        self.lm_head = hf_model.lm_head
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.dtype = self.decoder.norm.weight.dtype  # activations and KV caches (quantized linears have no .weight)
        self.vocab_size = config.vocab_size

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, capacity)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[Sequence[int]], caches: Sequence[KVCache],
                num_logits: Sequence[int]) -> ForwardOutput:
        """Append each request's new tokens to its cache and return logits for its last positions.

        token_ids: per request, its new tokens (at least one each); packed into # [T].
        caches: per request, its KV cache; each grows by len(token_ids[b]).
        num_logits: per request, how many of its last positions to return logits for.
        """
        lengths = [len(t) for t in token_ids]
        if not (len(lengths) == len(caches) == len(num_logits)) or min(lengths, default=1) < 1:
            raise ValueError("token_ids, caches and num_logits must have one non-empty entry per request")
        if any(not 0 <= n <= q for n, q in zip(num_logits, lengths)):
            raise ValueError(f"num_logits {list(num_logits)} must be within each request's new tokens {lengths}")
        ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.long)  # [T]
        positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, lengths)])  # [T]
        for cache, n in zip(caches, lengths):
            cache.reserve(n)

        h = self.decoder.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.decoder.rotary_emb(h, positions[None])  # [1, T, D] each
        half = cos.shape[-1] // 2  # rotate-half with the sign folded into sin: x cos + roll(x) sin'
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        rope = (cos[0, :, None, :], signed_sin[0, :, None, :])  # [T, 1, D]
        layout = _PaddedLayout.of([c.length for c in caches], lengths)
        for layer_idx, layer in enumerate(self.decoder.layers):
            h = h + self._attention(layer.self_attn, _rms_norm(layer.input_layernorm, h), rope, caches, layout,
                                    layer_idx)
            h = h + layer.mlp(_rms_norm(layer.post_attention_layernorm, h))
        for cache, n in zip(caches, lengths):
            cache.advance(n)

        ends = torch.tensor(lengths).cumsum(0)
        rows = torch.cat([torch.arange(e - n, e) for e, n in zip(ends.tolist(), num_logits)]).long()
        hidden = _rms_norm(self.decoder.norm, h[rows])  # [R, hidden]
        return ForwardOutput(logits=self.lm_head(hidden).float(), hidden=hidden)

    def _attention(self, attn: torch.nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   caches: Sequence[KVCache], layout: "_PaddedLayout", layer_idx: int) -> torch.Tensor:
        """Projections over all T tokens; one attention call over the batch padded to # [B, *, n_max/P_max, D]."""
        t = x.shape[0]
        q = attn.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = attn.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = attn.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        keys, values = [], []
        for cache, start, n in zip(caches, layout.starts, layout.lengths):
            kb, vb = cache.write(layer_idx, k[start:start + n], v[start:start + n])  # [P + n, Hkv, D]
            keys.append(kb)
            values.append(vb)
        out = F.scaled_dot_product_attention(
            layout.pad_queries(q).transpose(1, 2),  # [B, H, n_max, D]
            _pad(keys).transpose(1, 2),  # [B, Hkv, P_max, D]
            _pad(values).transpose(1, 2),  # [B, Hkv, P_max, D]
            attn_mask=layout.mask, scale=attn.scaling, enable_gqa=True)  # [B, H, n_max, D]
        out = layout.unpad(out.transpose(1, 2))  # [T, H, D]
        return attn.o_proj(out.reshape(t, self.num_heads * self.head_dim))


@dataclass(slots=True)
class _PaddedLayout:
    """Where each request's queries sit in the padded attention batch, and its causal mask."""

    starts: list[int]  # first packed token of each request
    lengths: list[int]  # new tokens per request (n_b)
    rows: torch.Tensor  # [T] row of each packed token in the flattened [B * n_max] padded queries
    n_max: int
    mask: torch.Tensor | None  # [B, 1, n_max, P_max] bool: query j of request b sees keys 0..P_b + j;
    # None for one request with one query (it sees every key)

    @classmethod
    def of(cls, cached: Sequence[int], lengths: Sequence[int]) -> "_PaddedLayout":
        n_max = max(lengths)
        if len(lengths) == 1 and n_max == 1:  # decoding one request: no padding, no causal structure
            return cls([0], [1], torch.zeros(1, dtype=torch.long), 1, None)
        starts = torch.tensor([0, *lengths]).cumsum(0)[:-1].tolist()
        rows = torch.cat([torch.arange(b * n_max, b * n_max + n) for b, n in enumerate(lengths)])
        p = torch.tensor(cached)[:, None, None]  # [B, 1, 1]
        n = torch.tensor(lengths)[:, None, None]
        j = torch.arange(n_max)[None, :, None]  # [1, n_max, 1]
        t = torch.arange(max(c + q for c, q in zip(cached, lengths)))[None, None, :]  # [1, 1, P_max]
        # Padding queries (j >= n_b) see all real keys, so no row is fully masked; they are dropped.
        mask = (t <= p + j) & (t < p + n)
        return cls(list(starts), list(lengths), rows, n_max, mask[:, None])

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


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: # [T, heads, D]; cos, signed_sin: # [T, 1, D]. transformers' rotate-half convention,
    x cos + cat(-x2, x1) sin, written as x cos + roll(x, D/2) sin' with sin' = cat(-sin1, sin2)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm; in float32 the same formula as one fused op (fewer calls per layer)."""
    if x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(x)  # other dtypes keep transformers' own rounding (upcast, normalise, cast, scale)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
