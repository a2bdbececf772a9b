"""The packed varlen forward equals transformers' own forward on the same weights."""

from __future__ import annotations

import pytest
import torch

from specav.models.packed import PackedCausalLM
from tests.tiny_models import VOCAB, tiny_hf_model


def reference_logits(hf_model, sequence: list[int], last: int) -> torch.Tensor:
    with torch.inference_mode():
        out = hf_model(torch.tensor([sequence]), use_cache=False)
    return out.logits[0, -last:].float()


def run_packed(packed, caches, histories, new_tokens, num_logits):
    out = packed.forward(new_tokens, caches, num_logits)
    for hist, toks in zip(histories, new_tokens):
        hist.extend(toks)
    return out.logits


# Both families, in float32 (native layer ops) and bf16 (torch ops). bf16: logits of magnitude ~4
# round to 1/32 steps; 0.05 allows about one and a half bf16 ulps.
FAMILIES = pytest.mark.parametrize("family", ["qwen2", "llama"])
DTYPES = pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])


@FAMILIES
@DTYPES
def test_packed_matches_transformers_with_rollbacks(family, dtype, tol):
    hf = tiny_hf_model(family, seed=1, dtype=dtype)
    packed = PackedCausalLM(hf)
    gen = torch.Generator().manual_seed(0)
    prefix_lens = [5, 1, 17, 9]
    histories = [[] for _ in prefix_lens]
    caches = [packed.new_cache(capacity=8) for _ in prefix_lens]  # small capacity: exercises growth

    def rand(n):
        return torch.randint(2, VOCAB, (n,), generator=gen).tolist()

    # Round 1: prefill of different lengths in one packed call, logits for the last 1..3 positions.
    new = [rand(n) for n in prefix_lens]
    nlog = [1, 1, 3, 2]
    logits = run_packed(packed, caches, histories, new, nlog)
    check(hf, histories, nlog, logits, tol)

    # Rounds 2..4: different query lengths, then roll back some of each request's tokens.
    for rnd, (qlens, rollbacks) in enumerate([([4, 1, 3, 6], [2, 0, 3, 1]),
                                             ([1, 5, 2, 3], [1, 4, 0, 3]),
                                             ([3, 2, 1, 4], [0, 1, 1, 2])]):
        new = [rand(n) for n in qlens]
        logits = run_packed(packed, caches, histories, new, qlens)
        check(hf, histories, qlens, logits, tol)
        for cache, hist, r in zip(caches, histories, rollbacks):
            cache.rollback(r)
            del hist[len(hist) - r:]
        assert [c.length for c in caches] == [len(h) for h in histories]


@FAMILIES
@DTYPES
def test_single_request_paths_match_transformers(family, dtype, tol):
    """One request alone: with torch ops the unpadded path (no mask for one new token, a causal
    mask for several); with native ops the same attention call as for a batch."""
    hf = tiny_hf_model(family, seed=2, dtype=dtype)
    packed = PackedCausalLM(hf)
    gen = torch.Generator().manual_seed(1)
    history, cache = [], packed.new_cache(capacity=4)
    for n, nlog in [(7, 2), (1, 1), (1, 1), (3, 3), (1, 1)]:
        logits = run_packed(packed, [cache], [history], [torch.randint(2, VOCAB, (n,), generator=gen).tolist()],
                            [nlog])
        check(hf, [history], [nlog], logits, tol)


def check(hf, histories, nlog, logits, tol):
    start = 0
    for hist, n in zip(histories, nlog):
        if n:
            ref = reference_logits(hf, hist, n)
            torch.testing.assert_close(logits[start:start + n], ref, atol=tol, rtol=0)
        start += n
    assert logits.shape[0] == start


def test_zero_logits_and_errors():
    packed = PackedCausalLM(tiny_hf_model("qwen2"))
    caches = [packed.new_cache(), packed.new_cache()]
    out = packed.forward([[3, 4], [5]], caches, [0, 1])
    assert out.logits.shape == (1, VOCAB)
    with pytest.raises(ValueError, match="num_logits"):
        packed.forward([[3]], caches[:1], [2])
    with pytest.raises(ValueError, match="non-empty"):
        packed.forward([[]], caches[:1], [0])


def test_kv_cache_rollback_bounds():
    packed = PackedCausalLM(tiny_hf_model("llama"))
    cache = packed.new_cache(capacity=4)
    packed.forward([[2, 3, 4, 5, 6, 7]], [cache], [1])
    assert cache.length == 6 and cache.capacity >= 6
    cache.rollback(6)
    assert cache.length == 0
    with pytest.raises(ValueError, match="roll back 1"):
        cache.rollback(1)


@FAMILIES
@DTYPES
def test_rotary_tables_are_the_rotary_embeddings_own_numbers(family, dtype, tol):
    """The forward reads cos / sin from tables made once (grown by doubling): bit for bit what the
    model's rotary embedding computes at those positions."""
    packed = PackedCausalLM(tiny_hf_model(family, seed=1, dtype=dtype))
    for positions, end in (([0, 5, 255], 256), ([300, 17, 511], 600), ([1023, 2], 1024)):
        index = torch.tensor(positions)
        cos, sin = packed.decoder.rotary_emb(torch.empty(0, dtype=dtype), index[None])
        for table, expected in zip(packed._rope(index, end, dtype), packed.ops.rope_tables(cos[0], sin[0])):
            assert torch.equal(table, expected)
    assert packed._rope_tables[dtype][0].shape[0] == 1024  # 256, then 1024 (the next power of two >= 600)
