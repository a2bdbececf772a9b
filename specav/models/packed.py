"""Packed variable-length forward for the Llama / Qwen2 family.

Owns: one forward pass over the new tokens of many requests concatenated (`# [T]`), each
request with its own query length and its own KV history (a `KVCache`), returning logits
only for the positions asked for. This is what verification needs: every request may
verify a different number of tokens in the same forward.

Linear layers, norms and the MLP run once over all T packed tokens; attention runs in
one call over the batch, each request seeing its own cached keys plus its new ones,
causally. The weights and the submodules are transformers' own (embedding, norms,
projections, MLP, rotary embedding), so the numbers match transformers' forward, and a
module swapped for a quantized one is picked up without changes here. The arithmetic
between the linear layers (norms, rotary, attention, the MLP's gate) comes from
layer_ops.py: torch ops, or one native call each for float32 activations; where a layer's
linear layers all run the native k-quant kernel at this row count, the whole layer is one native
call (the same functions, the same numbers); where only its attention's do, that half is.

Threads: a model on the native kernels runs each forward with the intra-op thread count that
has been fastest for forwards of its size (threads.py: on shared cores, fewer threads can be
much faster), set for the forward and restored after it.

Must not know: sampling, drafting, requests or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specav.models.kv_cache import KVCache
from specav.models.layer_ops import layer_ops_for
from specav.models.threads import ThreadChoice

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# transformers' RoPE types whose frequencies are fixed at init (the dynamic ones recompute them from the
# sequence length in the forward): their cos / sin per position can be tabled once (PackedCausalLM._rope).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
        self.ops = layer_ops_for(self.dtype, config.hidden_act, self.head_dim)
        self.threads: ThreadChoice | None = None  # set by quant.py for models on the native kernels
        self._rope_tables: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}  # _rope's tables, per activation dtype

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
        if self.threads is None:
            return self._forward(token_ids, caches, lengths, num_logits)
        with self.threads.scope(sum(lengths)):
            return self._forward(token_ids, caches, lengths, num_logits)

    def _forward(self, token_ids: Sequence[Sequence[int]], caches: Sequence[KVCache], lengths: list[int],
                 num_logits: Sequence[int]) -> ForwardOutput:
        ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.long)  # [T]
        positions = torch.tensor([p for c, n in zip(caches, lengths) for p in range(c.length, c.length + n)],
                                 dtype=torch.int64)  # [T]
        for cache, n in zip(caches, lengths):
            cache.reserve(n)

        ops, layers = self.ops, self.decoder.layers
        h = self.decoder.embed_tokens(ids)  # [T, hidden]: the residual stream
        rope = self._rope(positions, max(c.length + n for c, n in zip(caches, lengths)), h.dtype)
        batch = _Batch(caches, lengths, ops)
        x = ops.norm(layers[0].input_layernorm, h)
        calls = [ops.whole_layer(layer, h.shape[0]) for layer in layers]  # each layer, or its attention half, native
        i = 0
        while i < len(layers):  # each norm is fused with the residual add before it
            end = i
            while end < len(layers) and calls[end] is not None and calls[end].mlp:
                end += 1
            if end > i:  # whole layers i .. end - 1 in one native call
                x = ops.decoder_layers(calls[i:end], h, x, rope, batch, self.num_heads)
                i = end
                continue
            layer = layers[i]
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.decoder.norm
            if calls[i] is not None:
                x = ops.attention_block(calls[i], h, x, rope, batch, self.num_heads)
            else:
                h, x = ops.add_norm(h, self._attention(layer.self_attn, x, rope, batch, i),
                                    layer.post_attention_layernorm)
            h, x = ops.add_norm(h, ops.mlp(layer.mlp, x), next_norm)
            i += 1
        for cache, n in zip(caches, lengths):
            cache.advance(n)

        rows, end = [], 0  # each request's last num_logits positions in the packed # [T]
        for length, n in zip(lengths, num_logits):
            end += length
            rows += range(end - n, end)
        hidden = x.index_select(0, torch.tensor(rows, dtype=torch.int64))  # [R, hidden], final-normed
        return ForwardOutput(logits=self.lm_head(hidden).float(), hidden=hidden)

    def _rope(self, positions: torch.Tensor, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The rotary tables (ops.rope_tables of the rotary embedding's cos and sin) at positions # [T],
        all below `end`. Where the frequencies are fixed (every RoPE type but the dynamic ones), rows
        of tables made once for positions 0 .. 2^n - 1 >= end by the model's own rotary embedding:
        each entry is the cos or sin of one product position x frequency, so the same numbers, where
        computing them per forward cost 0.15-0.2 ms (the AMD EPYC) and a lookup costs microseconds."""
        rotary = self.decoder.rotary_emb
        if getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES:
            cos, sin = rotary(torch.empty(0, dtype=dtype), positions[None])  # [1, T, D] each
            return self.ops.rope_tables(cos[0], sin[0])
        tables = self._rope_tables.get(dtype)
        if tables is None or tables[0].shape[0] < end:
            size = max(256, 1 << (end - 1).bit_length())
            cos, sin = rotary(torch.empty(0, dtype=dtype), torch.arange(size)[None])
            tables = self._rope_tables[dtype] = self.ops.rope_tables(cos[0], sin[0])
        return tuple(t[positions] for t in tables)

    def _attention(self, attn: torch.nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   batch: "_Batch", layer_idx: int) -> torch.Tensor:
        """Projections over all T tokens; one attention call over every request's cache."""
        t = x.shape[0]
        qkv = getattr(attn, "qkv_proj", None)  # quant.FusedLinear: one call for the three, on quantized models
        q, k, v = qkv(x) if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.ops.rope(q, rope), self.ops.rope(k, rope)
        keys, values = [], []
        for cache, start, n in zip(batch.caches, batch.starts, batch.lengths):
            kb, vb = cache.write(layer_idx, k[start:start + n], v[start:start + n])  # [P + n, Hkv, D]
            keys.append(kb)
            values.append(vb)
        out = self.ops.attend(q, keys, values, batch.layout, attn.scaling)  # [T, H, D]
        return attn.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class _Batch:
    """The requests of one forward: their caches (room already reserved for the new tokens), where
    their tokens sit in the packed # [T], and what the layer ops read of them."""

    __slots__ = ("caches", "lengths", "starts", "cached", "keys", "values", "layout")

    def __init__(self, caches: Sequence[KVCache], lengths: list[int], ops) -> None:
        self.caches = caches
        self.lengths = lengths
        self.starts = [0]
        for n in lengths[:-1]:
            self.starts.append(self.starts[-1] + n)
        self.cached = [c.length for c in caches]  # positions filled before this forward
        self.keys = [c.keys for c in caches]  # [L, capacity, Hkv, D] each: the whole-layer call writes into them
        self.values = [c.values for c in caches]
        self.layout = ops.layout(self.cached, lengths)  # what attention needs (padding and mask, or the lengths)
