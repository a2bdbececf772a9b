"""The native layer ops (native/layers.cpp) against torch, op by op and as a whole forward, in every
native variant this machine runs (test ids name the variant; one the CPU lacks is skipped with why)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specav.models import native
from specav.models.layer_ops import NativeLayerOps, TorchLayerOps, layer_ops_for
from specav.models.packed import PackedCausalLM
from tests.tiny_models import VOCAB, tiny_hf_model



def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,width", [(1, 1536), (3, 64), (2, 13)])  # 13: a tail past the 8-wide vectors
def test_rms_norm_and_fused_residual(native_ops, rows, width):
    x = torch.randn(rows, width, generator=gen(0)) * 3
    y = torch.randn(rows, width, generator=gen(1))
    w = torch.randn(width, generator=gen(2))
    reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # transformers' formula
    torch.testing.assert_close(native_ops.rms_norm(x, w, 1e-6), reference, rtol=1e-6, atol=1e-6)
    h = x.clone()
    normed = native_ops.add_rms_norm_(h, y, w, 1e-6)
    assert torch.equal(h, x + y)  # the residual stream is updated in place, exactly
    torch.testing.assert_close(normed, native_ops.rms_norm(x + y, w, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 8960), (3, 17)])
def test_silu_mul(native_ops, shape):
    g = torch.randn(shape, generator=gen(0)) * 6  # reaches both flat ends of the sigmoid
    g[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])
    u = torch.randn(shape, generator=gen(1))
    torch.testing.assert_close(native_ops.silu_mul(g, u), F.silu(g) * u, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("heads,dim", [(12, 128), (2, 16)])
def test_rope_matches_rotate_half(native_ops, heads, dim):
    x = torch.randn(5, heads, dim, generator=gen(0))
    cos, sin = torch.randn(5, dim, generator=gen(1)), torch.randn(5, dim, generator=gen(2))
    half = dim // 2
    reference = x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]
    out = native_ops.rope_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()  # in place
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


def attention_reference(q, keys, values, lengths, scale, peek=0):
    """float64, one query at a time: softmax(q K^T scale) V over the positions the query may see
    (and `peek` more: a wrong causal limit, for the negative control)."""
    out, row = [], 0
    group = q.shape[1] // keys[0].shape[1]
    for k, v, n in zip(keys, values, lengths):
        cached = k.shape[0] - n
        for j in range(n):
            seen = min(cached + j + 1 + peek, k.shape[0])
            kk = k[:seen].double().repeat_interleave(group, dim=1)  # [seen, H, D]
            vv = v[:seen].double().repeat_interleave(group, dim=1)
            p = torch.softmax(torch.einsum("hd,shd->hs", q[row].double(), kk) * scale, dim=-1)
            out.append(torch.einsum("hs,shd->hd", p, vv))
            row += 1
    return torch.stack(out).float()


@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (4, 2, 16), (14, 2, 64), (4, 4, 8)])
def test_attention_varlen_causal_grouped(native_ops, heads, kv_heads, dim):
    lengths, cached = [3, 1, 5, 2], [0, 40, 7, 300]
    keys = [torch.randn(p + n, kv_heads, dim, generator=gen(i)) for i, (p, n) in enumerate(zip(cached, lengths))]
    values = [torch.randn(p + n, kv_heads, dim, generator=gen(10 + i)) for i, (p, n) in enumerate(zip(cached, lengths))]
    q = torch.randn(sum(lengths), heads, dim, generator=gen(20)) * 2
    scale = 1 / math.sqrt(dim)
    out = native_ops.attention(q, keys, values, lengths, scale)
    expected = attention_reference(q, keys, values, lengths, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Negative control: seeing one position too many (the next query's key) is caught.
    peeking = attention_reference(q, keys, values, lengths, scale, peek=1)
    assert not torch.allclose(out, peeking, rtol=1e-3, atol=1e-3)


def test_attention_rows_do_not_depend_on_the_batch(native_ops):
    """Bit for bit: a request's output is the same alone or with others (no padding, no shared softmax)."""
    lengths = [2, 3, 1]
    keys = [torch.randn(10 * (i + 1), 2, 32, generator=gen(i)) for i in range(3)]
    values = [torch.randn(10 * (i + 1), 2, 32, generator=gen(5 + i)) for i in range(3)]
    q = torch.randn(6, 4, 32, generator=gen(9))
    together = native_ops.attention(q, keys, values, lengths, 0.2)
    starts = [0, 2, 5]
    for b, (s, n) in enumerate(zip(starts, lengths)):
        alone = native_ops.attention(q[s:s + n].contiguous(), [keys[b]], [values[b]], [n], 0.2)
        assert torch.equal(alone, together[s:s + n])


def test_bad_inputs_are_refused(native_ops):
    q = torch.randn(2, 4, 16)
    k = torch.randn(3, 2, 16)
    with pytest.raises(RuntimeError, match="sum to q's rows"):
        native_ops.attention(q, [k], [k], [1], 1.0)
    with pytest.raises(RuntimeError, match="cached positions"):
        native_ops.attention(q, [k], [k], [4], 1.0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        native_ops.attention(torch.randn(1, 4, 12), [torch.randn(1, 2, 12)], [torch.randn(1, 2, 12)], [1], 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        native_ops.rms_norm(torch.randn(4, 3).t(), torch.randn(4), 1e-6)


def test_native_ops_are_chosen_only_where_they_apply(monkeypatch):
    assert native.available(), native.unavailable_reason()
    chosen = layer_ops_for(torch.float32, "silu", 128)
    assert isinstance(chosen, NativeLayerOps) and chosen.native is native.ops()  # the machine's variant
    assert isinstance(layer_ops_for(torch.bfloat16, "silu", 128), TorchLayerOps)  # bf16 keeps transformers' rounding
    assert isinstance(layer_ops_for(torch.float32, "gelu", 128), TorchLayerOps)
    assert isinstance(layer_ops_for(torch.float32, "silu", 12), TorchLayerOps)
    monkeypatch.setattr(native, "available", lambda: False)
    assert isinstance(layer_ops_for(torch.float32, "silu", 128), TorchLayerOps)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_forward_with_native_ops_equals_torch_ops(native_ops, family):
    """The same tiny model, the same packed rounds (prefills, varlen verification, rollbacks), run
    with either ops: logits agree to float32 rounding."""
    runs = {}
    for ops in (NativeLayerOps(native_ops), TorchLayerOps()):
        model = PackedCausalLM(tiny_hf_model(family, seed=3))
        model.ops = ops
        caches = [model.new_cache(capacity=4) for _ in range(3)]
        g = gen(4)
        logits = []
        for lengths, rollback in [([6, 1, 3], [0, 0, 0]), ([3, 2, 1], [2, 0, 1]), ([1, 1, 1], [0, 0, 0]),
                                  ([4, 1, 2], [1, 1, 0])]:
            tokens = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
            logits.append(model.forward(tokens, caches, lengths).logits)
            for cache, r in zip(caches, rollback):
                cache.rollback(r)
        runs[ops.name] = torch.cat(logits)
    assert isinstance(PackedCausalLM(tiny_hf_model(family)).ops, NativeLayerOps)  # what float32 models run by default
    torch.testing.assert_close(runs["native"], runs["torch"], rtol=1e-5, atol=1e-5)
