"""Quantized weight path: GGUF blocks -> torch kernels, per layer and for whole models.

Tolerances (relative Frobenius error of y = x W^T against x @ dequantize(W)^T, float32):
  int4     1%  bf16 activations, scales and zeros; the 4-bit codes are exact (measured ~0.3%)
  int8     4%  weights requantised to int8 per row, bf16 activations (measured 0.5-1.5% on random
               weights; on the packaged files' tensors the weights alone move by 0.8-3.2%, worst
               for Q6_K ffn_down, whose rows have outliers)
  int8dyn  7%  int8 weights as above and 7-bit per-row activations (measured 2-4%)
  kquant   2%  Q4_K / Q6_K codes and scales exact, activations int8 per 256 columns (measured
               0.6-0.7%); its arithmetic is also checked exactly against a float64 emulation, in
               every native variant this machine runs (test ids name the variant; a variant the
               CPU lacks is skipped with the reason)
Whole models are compared with transformers' own dequantising GGUF loader on tiny files
written here with the `gguf` package (Q4_K and Q6_K blocks are packed by hand: gguf-py
has no quantiser for them; the packers are checked against gguf-py's dequantiser).
"""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from specav.models import CheckpointError, load_checkpoint, native
from specav.models.quant import FusedLinear, QuantizedEmbedding, QuantizedLinear, load_quantized
from specav.models.quant_choice import DRAFTER_NATIVE_ROWS, ONE_ROW_KQUANT_WITHIN, FixedRule, KernelPlan, MeasuredChoice, machine_key, plan_from_times
from specav.models import quant_formats
from specav.models.quant_formats import GGUFWeight, dequantize, int4_groups, requantize_q4_k
from specav.models.quant_gguf import read_header
from specav.models.native.schedule import SCHEDULES
from specav.models.quant_kernels import (KERNELS, KQuantWeight, KQuantX8Weight, int8dyn_matmuls, int8dyn_rows,
                                         interleave_q4_k, kquant_matmuls)
from tests.tiny_models import save_tiny_checkpoint

T = gguf.GGMLQuantizationType
TOLERANCE = {"int4": 0.01, "int8": 0.04, "int8dyn": 0.07, "kquant": 0.02, "kquant_x8": 0.02}
# Relative error of the logits of a tiny 2-layer model. Measured: q4 1.4%, auto 2.5-3%, a drafter in
# auto 9.1-9.8% (its Q5_0 / Q8_0 layers requantised to 4 bits); the same weights run densely in
# bf16: 0.6%; a wrong tensor mapping: ~100%.
WHOLE_MODEL_TOLERANCE = {"q4": 0.03, "auto": 0.06, "drafter": 0.15}


# ---------------------------------------------------------------- hand packers for K-quants

def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows # [n, K] (K % 256 == 0) -> Q4_K blocks # [n, K / 256 * 144] (simple min/max rounding)."""
    n = x.shape[0]
    b = x.astype(np.float32).reshape(-1, 8, 32)  # [nb, sub-block, 32]
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    d = (((hi - lo) / 15).max(-1, keepdims=True) / 63).astype(np.float16)  # [nb, 1]
    dmin = ((-lo).max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round((hi - lo) / 15 / np.maximum(d.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32) * sc
    q = np.clip(np.round((b + (dmin.astype(np.float32) * m)[..., None]) / np.maximum(scale, 1e-30)[..., None]),
                0, 15).astype(np.uint8)  # [nb, 8, 32]
    packed_scales = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)  # [nb, 12]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low) and 2c+1 (high)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed_scales, qs], axis=1)
    return blocks.reshape(n, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows # [n, K] (K % 256 == 0) -> Q6_K blocks # [n, K / 256 * 210]."""
    n = x.shape[0]
    b = x.astype(np.float32).reshape(-1, 16, 16)  # [nb, sub-block, 16]
    s = np.abs(b).max(-1) / 31  # [nb, 16]
    d = (s.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(s / np.maximum(d.astype(np.float32), 1e-30)), -128, 127).astype(np.int8)
    scale = d.astype(np.float32) * sc
    q = (np.clip(np.round(b / np.maximum(scale, 1e-30)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    lo = (q & 0x0F).reshape(-1, 2, 2, 64)  # element 128 h + 64 s + j -> low nibble of ql[64 h + j] << 4 s
    hi = (q >> 4).reshape(-1, 2, 4, 32)  # element 128 h + 32 t + i -> 2 bits of qh[32 h + i] << 2 t
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=1)
    return blocks.reshape(n, -1)


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    packers = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}
    return packers[qtype](x) if qtype in packers else gguf.quants.quantize(x, qtype)


def random_weight(qtype: T, n: int = 96, k: int = 512, seed: int = 0) -> GGUFWeight:
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return GGUFWeight(f"w.{qtype.name}", qtype, (n, k), quantize(x, qtype))


# ---------------------------------------------------------------- formats

@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_hand_packers_round_trip_through_gguf_dequantiser(qtype):
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize(x, qtype), qtype)
    step = {T.Q4_K: 2 * np.abs(x).max() / 15, T.Q6_K: np.abs(x).max() / 31}[qtype]
    assert np.abs(back - x).max() <= step  # a wrong bit layout gives errors of order |x|


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.Q4_0, T.Q5_K, T.IQ4_NL, T.F16, T.F32])
def test_dequantize_equals_the_gguf_package_bit_for_bit(qtype, monkeypatch):
    """The loader's dequantiser calls the package's block dequantiser on many rows at once; on random
    bytes (every bit pattern of scales and codes, NaN and inf included) and across its row chunks it
    returns exactly the package's own output."""
    monkeypatch.setattr(quant_formats, "_DEQUANT_BLOCKS", 7)  # several chunks, the last one short
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n, k = 13, 4 * 256
    blocks = np.random.default_rng(int(qtype)).integers(0, 256, (n, k // block_size * type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):  # random scales overflow to inf, as they do in the package
        ours = dequantize(GGUFWeight("w", qtype, (n, k), blocks)).numpy()
        theirs = np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32).reshape(n, k)
        picked = dequantize(GGUFWeight("w", qtype, (n, k), blocks), np.array([4, 0])).numpy()
    assert np.array_equal(ours, theirs, equal_nan=True)
    assert np.array_equal(picked, theirs[[4, 0]], equal_nan=True)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_0, T.Q4_1])
def test_int4_groups_reproduce_dequantisation_exactly(qtype):
    weight = random_weight(qtype)
    codes, scales, zeros = int4_groups(weight)
    rebuilt = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    assert codes.max() <= 15
    assert torch.equal(rebuilt, dequantize(weight))


def test_llama_rows_permute_whole_blocks():
    from specav.models.quant import _rotary_row_order

    order = _rotary_row_order(8, heads=1)  # one head of 8 rows: interleaved pairs -> halves
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


# ---------------------------------------------------------------- kernels, per layer

KERNEL_CASES = [(k, q) for q in (T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_1)
                for k in KERNELS if KERNELS[k].fits(q, (96, 512))]  # random_weight's shape


@pytest.mark.parametrize("kernel,qtype", KERNEL_CASES, ids=[f"{k}-{q.name}" for k, q in KERNEL_CASES])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernel_matches_dequantised_reference(kernel, qtype, rows):
    weight = random_weight(qtype, seed=rows)
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))  # [T, K]
    bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(rows + 1))  # [N]
    reference = x @ dequantize(weight).t()  # [T, N]
    packed = KERNELS[kernel].pack(weight)
    y = packed.matmul(x)
    assert y.shape == reference.shape and y.dtype == torch.float32
    error = ((y - reference).norm() / reference.norm()).item()
    assert error < TOLERANCE[kernel], f"{kernel} on {qtype.name}: relative error {error:.4f}"
    torch.testing.assert_close(packed.matmul(x, bias), y + bias, rtol=0, atol=0)  # the bias, added once


def test_native_kernels_build_on_this_machine():
    """The CI machine has AVX2 and g++: kquant must be there, or `auto` silently loses its fast path."""
    assert native.available(), native.unavailable_reason()
    assert "kquant" in [k for k, _ in KERNEL_CASES]



def int8_reconstruction(ops, x: torch.Tensor, k: int) -> torch.Tensor:
    """x # [T, K] as the kernel sees it: its int8 codes times their per-256 scales, float64, # [T, K]."""
    xq, dx = ops.quantize_activations(x)  # [T, K padded to 256], [T, blocks]
    rows, blocks = dx.shape
    return (xq.double().view(rows, blocks, 256) * dx.double()[..., None]).view(rows, -1)[:, :k]


@pytest.fixture(params=SCHEDULES)
def kquant_schedule(request, native_ops):
    """Each loop schedule of kquant.cpp in turn (the test id names it), restored afterwards."""
    saved = native_ops.set_schedule(request.param)
    yield request.param
    native_ops.set_schedule(saved)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("rows,k", [(1, 768), (4, 768), (5, 768), (7, 768), (8, 768), (9, 768), (16, 768),
                                    (17, 768), (5, 4608), (16, 4608)])
def test_kquant_arithmetic_is_exact_on_quantised_activations(native_ops, kquant_schedule, qtype, rows, k):
    """The kernel's only approximation is the int8 activation: with x replaced by its int8
    reconstruction, y equals the float64 product with the exactly dequantised weight (to float32
    accumulation). A wrong nibble, bit pair or scale index would be off by percents. Row counts
    cover one tile, a tile and a remainder, and several tiles of either variant (AVX2: up to 8 rows of Q4_K, 6 of Q6_K; AVX-512: 8);
    K = 4608 (18 blocks) runs in segments of K at 5 and 16 rows under the schedules that have them."""
    weight = random_weight(qtype, n=40, k=k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :256] *= 50  # one 256-block far larger: each block has its own activation scale
    expected = int8_reconstruction(native_ops, x, k) @ dequantize(weight).double().t()
    y = KQuantWeight.pack(weight, ops=native_ops).matmul(x)
    error = ((y.double() - expected).norm() / expected.norm()).item()
    assert error < 1e-5, error
    xq, _ = native_ops.quantize_activations(x)
    assert (xq.abs() <= 127).all() and torch.equal(xq.abs().amax(dim=1), torch.full((rows,), 127, dtype=torch.int8))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("k", [512, 4608])
def test_kquant_rows_are_batch_invariant(native_ops, qtype, k):
    """Bit for bit: a row's output is the same alone or packed with any number of others, in every
    native_ops and under every loop schedule, with K in one pass or in segments (so the verified
    rows of a speculative step round as the decoded row would, and a machine's schedule changes no
    output)."""
    packed = KQuantWeight.pack(random_weight(qtype, n=72, k=k), ops=native_ops)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(0))
    x[3] *= 100
    saved = native_ops.set_schedule(SCHEDULES[0])
    try:
        alone = torch.cat([packed.matmul(x[i:i + 1]) for i in range(19)])
        for schedule in SCHEDULES:
            native_ops.set_schedule(schedule)
            for rows in (2, 3, 4, 5, 6, 7, 8, 9, 16, 19):  # every tile size of either variant and type
                assert torch.equal(packed.matmul(x[:rows]), alone[:rows]), (schedule, rows)
    finally:
        native_ops.set_schedule(saved)


def test_int8_peak_bounds_the_kernel_at_many_rows(native_ops):
    """int8_peak times the tile kernels' own dot step on register operands: no matmul of the variant
    computes faster (16 rows of a 256 x 4608 weight, its activations and weights in the caches, the
    best of 5 calls; with a generous margin for a VM's drift), and it is not a loop the compiler
    shortened (a step shared or hoisted across chains would read many times the kernel's rate)."""
    weight = KQuantWeight.pack(random_weight(T.Q4_K, n=256, k=4608), ops=native_ops)
    x = torch.randn(16, 4608, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weight.matmul(x)
        peak = max(native_ops.int8_peak(200_000, 1) for _ in range(3))
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            weight.matmul(x)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    kernel = 16 * 256 * 4608 / best  # multiply-adds per second
    assert kernel < 1.5 * peak < 1.5 * 12 * kernel, (kernel, peak)
    with pytest.raises(RuntimeError, match="iterations > 0 and threads > 0"):
        native_ops.int8_peak(0, 1)


def test_kquant_refuses_an_unknown_schedule(native_ops):
    with pytest.raises(RuntimeError, match="schedule bits"):
        native_ops.set_schedule(8)


def test_kquant_fused_call_equals_separate_calls(native_ops):
    """q/k/v of mixed types (the packaged target's v is Q4_K in some layers, Q6_K in others) in one
    call: each output, with its bias, bit for bit as in its own call."""
    weights = [KQuantWeight.pack(random_weight(q, n=n, k=512, seed=i), ops=native_ops)
               for i, (q, n) in enumerate([(T.Q4_K, 64), (T.Q4_K, 32), (T.Q6_K, 32)])]
    biases = [torch.randn(w.shape[0], generator=torch.Generator().manual_seed(i)) for i, w in enumerate(weights)]
    biases[1] = None
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5))
    fused = kquant_matmuls(x, weights, biases)
    for w, b, y in zip(weights, biases, fused):
        assert torch.equal(y, w.matmul(x, b))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
def test_kquant_x8_arithmetic_is_exact_on_quantised_activations(native_ops, rows):
    """The interleaved layout computes what kquant computes: with x replaced by its int8
    reconstruction, y equals the float64 product with the exactly dequantised weight (to float32
    accumulation), for every tile size of either variant and a remainder (AVX2 tiles of 2 rows,
    AVX-512 of 4). A code, scale or min moved to another feature, block or sub-block in the repack
    would be off by percents."""
    weight = random_weight(T.Q4_K, n=48, k=768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :256] *= 50  # one 256-block far larger: each block has its own activation scale
    expected = int8_reconstruction(native_ops, x, 768) @ dequantize(weight).double().t()
    bias = torch.randn(48, generator=torch.Generator().manual_seed(7))
    packed = KQuantX8Weight.pack(weight, ops=native_ops)
    y = packed.matmul(x)
    error = ((y.double() - expected).norm() / expected.norm()).item()
    assert error < 1e-5, error
    assert torch.equal(packed.matmul(x, bias), y + bias)  # the bias, added once inside


def test_kquant_x8_rows_are_batch_invariant_and_fused_calls_split(native_ops):
    """Bit for bit: a row's output is the same alone or packed with others (every tile size and
    remainder), and one call for several weights of one input, either layout mixed (q/k in
    kquant_x8, v in kquant's Q6_K), gives each weight's own call."""
    weights = [KQuantX8Weight.pack(random_weight(T.Q4_K, n=n, k=512, seed=n), ops=native_ops) for n in (64, 40)]
    weights.append(KQuantWeight.pack(random_weight(T.Q6_K, n=24, k=512, seed=3), ops=native_ops))
    biases = [torch.randn(w.shape[0], generator=torch.Generator().manual_seed(i)) for i, w in enumerate(weights)]
    biases[1] = None
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(0))
    x[3] *= 100
    alone = torch.cat([weights[0].matmul(x[i:i + 1]) for i in range(11)])
    for rows in range(2, 12):
        assert torch.equal(weights[0].matmul(x[:rows]), alone[:rows]), rows
    assert KQuantX8Weight.family() is KQuantWeight.family()
    for w, b, y in zip(weights, biases, KQuantX8Weight.matmuls(x, weights, biases)):
        assert torch.equal(y, w.matmul(x, b))


def test_kquant_x8_runs_a_k_too_long_for_the_l2_cache_in_segments(native_ops):
    """Where a tile's activations would not fit the L2 cache's share (512 KiB: 341 blocks for
    AVX-512's tiles of 6 rows, 1,024 for AVX2's of 2), K runs in segments, the partial sums kept
    between them: here K = 1,032 blocks, the rows equal their one-row calls (no segments) bit for
    bit, and the float64 emulation."""
    k = 1032 * 256
    weight = random_weight(T.Q4_K, n=16, k=k, seed=3)
    packed = KQuantX8Weight.pack(weight, ops=native_ops)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(3))
    y = packed.matmul(x)  # a tile of 6 rows in segments, then one row
    assert torch.equal(y, torch.cat([packed.matmul(x[i:i + 1]) for i in range(7)]))
    expected = int8_reconstruction(native_ops, x, k) @ dequantize(weight).double().t()
    assert ((y.double() - expected).norm() / expected.norm()).item() < 1e-5


def test_kquant_x8_takes_only_what_it_can_lay_out():
    assert KERNELS["kquant_x8"].fits(T.Q4_K, (8960, 1536)) == native.available()
    assert KERNELS["kquant_x8"].fits(T.Q4_K, (4864, 896)) == native.available()  # the drafter's, K padded
    assert not KERNELS["kquant_x8"].fits(T.Q4_K, (12, 512)) and not KERNELS["kquant_x8"].fits(T.Q6_K, (64, 512))
    with pytest.raises(ValueError, match="kquant_x8 cannot run"):
        KQuantX8Weight.pack(random_weight(T.Q4_K, n=12, k=512))


@pytest.mark.parametrize("k", [896, 640, 928, 736])
def test_kquant_x8_runs_weights_padded_past_k(native_ops, k):
    """A weight requantised with K padded to whole blocks (the drafter's K = 896): exact on quantised
    activations at every tile size, and where K ends in the first half of a block (896, 640) the
    last block keeps only its first 512 bytes of codes, every output the whole padded layout's bit
    for bit (alone and fused with a kquant weight, under every schedule); past the first half (928,
    736) it is kept whole."""
    q4k = requantize_q4_k(random_weight(T.Q8_0, n=40, k=k, seed=k), native_ops.quantize_q4_k)
    blocks = -(-k // 256)
    packed = KQuantX8Weight.pack(q4k, ops=native_ops)
    half = k % 256 <= 128
    assert tuple(packed.blocks.shape) == (5, blocks * 1184 - (512 if half else 0))
    assert packed.ends_in_half_block == half
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(k))
    x[3] *= 100
    expected = int8_reconstruction(native_ops, x, k) @ dequantize(q4k).double().t()
    y = packed.matmul(x)
    assert ((y.double() - expected).norm() / expected.norm()).item() < 1e-5
    whole = torch.from_numpy(interleave_q4_k(GGUFWeight("w", T.Q4_K, (40, blocks * 256), q4k.blocks)))
    assert whole.shape == (5, blocks * 1184) and torch.equal(packed.whole_blocks(), whole)
    other = KQuantWeight.pack(q4k, ops=native_ops)  # kquant in the same call
    bias = torch.randn(40, generator=torch.Generator().manual_seed(2))
    saved = native_ops.set_schedule(SCHEDULES[0])
    try:
        for schedule in SCHEDULES:
            native_ops.set_schedule(schedule)
            for rows in (1, 2, 5, 6, 7, 13):
                full = native_ops.kq_matmul(x[:rows], [whole, other.blocks], [112, other.native_type], [bias, None])
                trimmed = native_ops.kq_matmul(x[:rows], [packed.blocks, other.blocks], [112, other.native_type],
                                               [bias, None])
                assert torch.equal(trimmed[0], full[0]) and torch.equal(trimmed[1], full[1]), (schedule, rows)
                assert torch.equal(trimmed[0], y[:rows] + bias), rows  # batch-invariant, bias once
    finally:
        native_ops.set_schedule(saved)
    refused = [whole[:, :-100]] + ([] if half else [whole[:, :-512]])  # a half block past K's first half too
    for blocks_of_another_width in refused:
        with pytest.raises(RuntimeError, match="must be a contiguous"):
            native_ops.kq_matmul(x[:1], [blocks_of_another_width.contiguous()], [112], [None])


def test_kquant_runs_weights_padded_past_k(native_ops):
    """A weight requantised from a 32-element format with K = 896 (the drafter's hidden size) keeps
    K = 896 and stores 4 Q4_K blocks per row, the last half zeros: the kernel takes x # [T, 896]."""
    weight = random_weight(T.Q8_0, n=48, k=896)
    q4k = requantize_q4_k(weight, native_ops.quantize_q4_k)
    assert q4k.qtype == T.Q4_K and q4k.shape == (48, 896) and q4k.blocks.shape == (48, 4 * 144)
    x = torch.randn(3, 896, generator=torch.Generator().manual_seed(0))
    expected = int8_reconstruction(native_ops, x, 896) @ dequantize(q4k).double().t()
    y = KQuantWeight.pack(q4k, ops=native_ops).matmul(x)
    assert ((y.double() - expected).norm() / expected.norm()).item() < 1e-5
    requant_error = ((dequantize(q4k) - dequantize(weight)).norm() / dequantize(weight).norm()).item()
    assert requant_error < 0.1  # 4 bits from 8: about 0.08 on Gaussian weights


@pytest.mark.parametrize("k", [896, 640, 608])
def test_kquant_leaves_out_the_zero_half_of_a_last_half_block(native_ops, k):
    """Where K ends in the first half of a block (K = 896: 3.5 blocks), the packed Q4_K weight keeps
    only the first 80 bytes of each row's last block, and every output equals the padded blocks'
    bit for bit: alone or fused with a padded Q6_K weight, at every row count, under every schedule."""
    q4k = requantize_q4_k(random_weight(T.Q8_0, n=72, k=k, seed=k), native_ops.quantize_q4_k)
    blocks = -(-k // 256)
    packed = KQuantWeight.pack(q4k, ops=native_ops)
    assert q4k.blocks.shape == (72, blocks * 144) and tuple(packed.blocks.shape) == (72, blocks * 144 - 64)
    assert packed.nbytes == 72 * (blocks * 144 - 64)
    padded = torch.from_numpy(q4k.blocks)
    other = torch.from_numpy(quantize(np.random.default_rng(1).standard_normal((24, blocks * 256)).astype(np.float32),
                                      T.Q6_K))  # a padded weight of another type in the same call
    bias = torch.randn(72, generator=torch.Generator().manual_seed(2))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(k))
    x[3] *= 100
    saved = native_ops.set_schedule(SCHEDULES[0])
    try:
        for schedule in SCHEDULES:
            native_ops.set_schedule(schedule)
            for rows in (1, 2, 4, 5, 8, 9, 16, 19):
                full = native_ops.kq_matmul(x[:rows], [padded, other], [12, 14], [bias, None])
                half = native_ops.kq_matmul(x[:rows], [packed.blocks, other], [12, 14], [bias, None])
                assert torch.equal(half[0], full[0]) and torch.equal(half[1], full[1]), (schedule, rows)
    finally:
        native_ops.set_schedule(saved)


def test_kquant_refuses_a_half_block_it_cannot_leave_out(native_ops):
    """Only a Q4_K weight whose K ends in a block's first half may end in 80 bytes: K = 928 reaches
    into the second half (its 64 bytes hold weights), and a Q6_K weight has no such layout."""
    q4k = requantize_q4_k(random_weight(T.Q8_0, n=8, k=928), native_ops.quantize_q4_k)
    assert tuple(KQuantWeight.pack(q4k, ops=native_ops).blocks.shape) == (8, 4 * 144)  # kept whole
    x = torch.randn(1, 928)
    with pytest.raises(RuntimeError, match="must be a contiguous"):
        native_ops.kq_matmul(x, [torch.from_numpy(q4k.blocks[:, :-64].copy())], [12], [None])
    q6k = torch.zeros(8, 4 * 210 - 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="must be a contiguous"):
        native_ops.kq_matmul(torch.randn(1, 896), [q6k], [14], [None])


@pytest.mark.skipif(not native.available(), reason="the drafter's policy needs the native kernels")
def test_the_drafters_requantised_weights_are_kept_and_served_by_content(tmp_path, monkeypatch):
    """A drafter's requantisation (most of its load) is kept beside the kernel profile: the next load
    reads the very blocks it wrote; another source weight is another file; an unreadable file is
    requantised and written again; another native build keeps its own set and removes the others."""
    from specav.models import quant_choice

    made = []
    requantize = quant_choice.requantize_q4_k
    monkeypatch.setattr(quant_choice, "requantize_q4_k", lambda w, q: made.append(w.name) or requantize(w, q))
    profile = tmp_path / "kernel-profile.json"
    policy = quant_choice.NativeDrafter(profile)
    weight = random_weight(T.Q8_0, n=24, k=896)
    first = policy.convert(weight)
    again = quant_choice.NativeDrafter(profile).convert(weight)
    assert made == [weight.name] and again.qtype == T.Q4_K and np.array_equal(again.blocks, first.blocks)
    assert np.array_equal(first.blocks, requantize(weight, native.ops().quantize_q4_k).blocks)
    kept = policy.cache_dir
    assert kept.parent == tmp_path / quant_choice.REQUANTIZED_DIR and len(list(kept.glob("*.npy"))) == 1
    policy.convert(random_weight(T.Q8_0, n=24, k=896, seed=1))  # other blocks: another file
    assert len(made) == 2 and len(list(kept.glob("*.npy"))) == 2
    (path,) = [f for f in kept.glob("*.npy") if np.array_equal(np.load(f), first.blocks)]
    path.write_bytes(b"not an array")
    assert np.array_equal(policy.convert(weight).blocks, first.blocks) and len(made) == 3
    assert np.array_equal(np.load(path), first.blocks)  # written again
    assert policy.convert(random_weight(T.Q4_K, n=8, k=512)).qtype == T.Q4_K  # k-quants run as stored
    assert len(made) == 3
    monkeypatch.setattr(native, "build_key", lambda: "another-build")
    rebuilt = quant_choice.NativeDrafter(profile)
    assert np.array_equal(rebuilt.convert(weight).blocks, first.blocks) and len(made) == 4  # its own quantiser
    assert [d.name for d in (tmp_path / quant_choice.REQUANTIZED_DIR).iterdir()] == ["another-build"]
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    unkept = quant_choice.NativeDrafter(blocked / "kernel-profile.json")
    with pytest.warns(UserWarning, match="requantised at every load"):  # the load goes on, said once
        assert np.array_equal(unkept.convert(weight).blocks, first.blocks)
    assert np.array_equal(unkept.convert(weight).blocks, first.blocks) and len(made) == 6


def test_q4_k_quantiser_beats_min_max_rounding(native_ops):
    """The native quantiser (llama.cpp's least-squares search) through gguf's own dequantiser: a
    wrong layout would give errors of order 1; the search must beat plain min/max rounding."""
    x = np.random.default_rng(3).standard_normal((16, 1024)).astype(np.float32)
    blocks = native_ops.quantize_q4_k(torch.from_numpy(x)).numpy()
    ours = np.linalg.norm(gguf.quants.dequantize(blocks, T.Q4_K) - x) / np.linalg.norm(x)
    plain = np.linalg.norm(gguf.quants.dequantize(quantize_q4_k(x), T.Q4_K) - x) / np.linalg.norm(x)
    assert ours < 0.1 and ours < 0.95 * plain, (ours, plain)  # measured 0.070 against 0.077


def test_kquant_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="Q4_K and Q6_K"):
        KERNELS["kquant"].pack(random_weight(T.Q5_0))
    with pytest.raises(RuntimeError, match="K = 300"):
        KERNELS["kquant"].pack(random_weight(T.Q4_K, k=256)).matmul(torch.randn(1, 512)[:, :300].contiguous())


def test_auto_works_without_native_kernels(monkeypatch, tmp_path):
    import specav.models.quant_choice as choice

    measured = []
    monkeypatch.setattr(choice, "measure", lambda candidates: measured.append(set(candidates)) or fake_measure(candidates))
    monkeypatch.setattr(native, "available", lambda: False)
    assert not KERNELS["kquant"].supports(T.Q4_K)
    assert "kquant" not in MeasuredChoice(tmp_path / "p.json").plan(random_weight(T.Q4_K, n=64, k=256)).kernels
    assert measured and "kquant" not in measured[0]


def test_measure_times_each_candidate_at_each_row_count():
    """The real timer (cache flushes and all), on one small layer and two row counts only."""
    from specav.models.quant_choice import measure

    weight = random_weight(T.Q4_K, n=64, k=256)
    times = measure({k: KERNELS[k].pack(weight) for k in ("int4", "int8")}, rows=(1, 4))
    assert set(times) == {"int4", "int8"}
    assert all(len(t) == 2 and all(ms > 0 for ms in t) for t in times.values())


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_rows_do_not_depend_on_each_other(kernel):
    """Bit for bit: a row's output is the same alone or packed with others (so with one kernel
    per layer, as in q4, a request's logits do not depend on what else is verified with it)."""
    packed = KERNELS[kernel].pack(random_weight(T.Q4_K, n=256, k=512))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(0))
    x[3] *= 100  # a large row must not change the others (int8dyn quantises each row alone)
    alone = torch.cat([packed.matmul(x[i:i + 1]) for i in range(9)])
    for rows in (2, 5, 9):
        assert torch.equal(packed.matmul(x[:rows]), alone[:rows])


def test_int8dyn_weights_of_one_input_share_its_scaling_and_give_the_same_numbers():
    """FusedLinear's int8dyn path (gate/up at verification's row counts): the rows scaled once for
    both weights, each output bit for bit its own call's; the scaling is max |x| per row."""
    weights = [KERNELS["int8dyn"].pack(random_weight(T.Q4_K, n=n, k=512)) for n in (256, 128)]
    biases = [torch.randn(256), None]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    x[2] = 0.0  # a zero row: scaled by the smallest normal, not divided by zero
    for fused, w, b in zip(int8dyn_matmuls(x, weights, biases), weights, biases, strict=True):
        assert torch.equal(fused, w.matmul(x, b))
    scaled, amax = int8dyn_rows(x)
    assert torch.equal(amax, x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    assert torch.equal(scaled, x / amax)


def test_quantized_linear_routes_rows_and_keeps_shape_and_dtype():
    weight = random_weight(T.Q4_K, n=64, k=256)
    bias = torch.randn(64)
    plan = KernelPlan((1, 4, 16), ("int4", "int8", "int8dyn"))
    layer = QuantizedLinear({k: KERNELS[k].pack(weight) for k in plan.distinct}, plan, bias)
    used = []
    for name, packed in layer.packed.items():
        original = packed.matmul
        packed.matmul = lambda x, b, name=name, original=original: used.append(name) or original(x, b)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)  # 6 rows -> the 4-row plan
    y = layer(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16 and used == ["int8"]
    int8 = layer.packed["int8"]
    expected = type(int8).matmul(int8, x.reshape(6, 256).float()) + bias
    torch.testing.assert_close(y.float(), expected.view(2, 3, 64).bfloat16().float())
    layer(torch.randn(1, 256))
    layer(torch.randn(40, 256))
    assert used == ["int8", "int4", "int8dyn"]
    reference = x.float().reshape(6, 256) @ dequantize(weight).t() + bias
    torch.testing.assert_close(y.float().reshape(6, 64), reference, atol=0.05, rtol=0.05)


def test_quantized_embedding_is_exact():
    weight = random_weight(T.Q4_K, n=50, k=256)
    ids = torch.tensor([[3, 7, 3], [49, 0, 1]])
    out = QuantizedEmbedding(weight)(ids)
    assert out.shape == (2, 3, 256)
    assert torch.equal(out, dequantize(weight)[ids])


def test_quantized_embedding_keeps_recent_rows_and_stays_exact_past_its_memo():
    weight = random_weight(T.Q4_K, n=50, k=256)
    table = dequantize(weight)
    embed = QuantizedEmbedding(weight, memo_rows=3)
    for ids in ([3, 7], [7, 9, 7], [1], [3, 7, 9], [0, 1, 2, 4, 5], [2], [4, 2, 4]):  # evictions, hits, a bypass
        assert torch.equal(embed(torch.tensor(ids)), table[ids])
    assert list(embed._slot) == [3, 2, 4]  # least recently used first; 1, 7 and 9 were evicted
    assert len(set(embed._slot.values())) == len(embed._slot) <= 3


# ---------------------------------------------------------------- kernel choice

def test_plan_keeps_at_most_two_kernels_and_a_second_only_for_real_gains():
    times = {"int4": [1.0, 3.0, 9.0, 30.0], "int8dyn": [1.08, 1.0, 2.0, 5.0]}
    assert plan_from_times(times).kernels == ("int8dyn",) * 4  # 8% slower at 1 row: not worth a copy
    times["int4"][0] = 0.5
    assert plan_from_times(times).kernels == ("int4", "int8dyn", "int8dyn", "int8dyn")
    times["int8"] = [3.0, 3.0, 1.0, 30.0]  # a third kernel fastest at 16 rows: the gain goes unused
    assert len(set(plan_from_times(times).kernels)) == 2


def test_plan_runs_kquant_at_one_row_where_it_is_near_the_fastest():
    """At one row kquant lets a whole layer be one native call, so it runs there when within
    ONE_ROW_KQUANT_WITHIN of the fastest kernel, unless that would keep a third kernel's copy."""
    times = {"kquant": [1.2, 4.0, 15.0, 60.0], "int8dyn": [1.0, 3.0, 12.0, 48.0]}
    assert plan_from_times(times).kernels == ("kquant", "int8dyn", "int8dyn", "int8dyn")
    times["kquant"][0] = 1.0 * ONE_ROW_KQUANT_WITHIN + 0.01  # too far behind at one row
    assert plan_from_times(times).kernels == ("int8dyn",) * 4
    times = {"kquant": [1.2, 9.0, 30.0, 90.0], "int4": [1.0, 9.0, 30.0, 90.0], "int8dyn": [2.0, 1.0, 2.0, 5.0]}
    assert plan_from_times(times).kernels == ("int4", "int8dyn", "int8dyn", "int8dyn")  # no third copy


def test_plan_keeps_the_faster_whole_layer_kernel_at_one_row():
    """kquant_x8 runs in the whole-layer call as kquant does: where it is the fastest at one row it
    stays there (not replaced by kquant), and where neither is fastest the faster of the two runs."""
    times = {"kquant": [1.3, 4.0, 15.0, 60.0], "kquant_x8": [1.0, 2.0, 6.0, 20.0]}
    assert plan_from_times(times).kernels == ("kquant_x8",) * 4
    times = {"kquant": [1.3, 4.0, 15.0, 60.0], "kquant_x8": [1.2, 2.0, 6.0, 20.0], "int8dyn": [1.0, 1.5, 3.0, 10.0]}
    assert plan_from_times(times).kernels == ("kquant_x8", "int8dyn", "int8dyn", "int8dyn")


def test_plan_row_buckets_are_nearest_on_log_scale():
    plan = KernelPlan((1, 4, 16, 64), ("a", "b", "c", "d"))
    assert [plan.kernel_for(t) for t in (1, 2, 3, 7, 8, 9, 31, 33, 1000)] == list("aabbbccdd")


def test_fixed_rule_is_exact_where_it_can_be():
    rule = FixedRule()
    assert rule.plan(random_weight(T.Q4_K)).kernels == ("int4",)
    assert rule.plan(random_weight(T.Q5_0)).kernels == ("int8",)


def test_measured_choice_is_cached_on_disk(tmp_path, monkeypatch):
    import specav.models.quant_choice as choice

    monkeypatch.setattr(choice, "measure", fake_measure)
    path = tmp_path / "profile.json"
    weight = random_weight(T.Q4_K, n=64, k=256)
    first = MeasuredChoice(path).plan(weight)
    assert set(first.kernels) <= set(KERNELS) and path.exists()
    monkeypatch.setattr(choice, "measure", lambda candidates: pytest.fail("measured again despite the cache"))
    again = MeasuredChoice(path)
    assert again.plan(weight) == first
    assert set(again.profile()["Q4_K 64x256"]) == {k for k in KERNELS if KERNELS[k].fits(T.Q4_K, (64, 256))}
    assert machine_key() in path.read_text()


def test_kernel_profile_shows_progress_only_while_it_measures(tmp_path, monkeypatch, capfd):
    import specav.models.quant_choice as choice

    monkeypatch.setattr(choice, "measure", fake_measure)
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    linears = {(t.tensor_type, tuple(t.shape)) for t in gguf.GGUFReader(path).tensors
               if t.name == "output.weight" or t.name.split(".")[2:3] and t.name.split(".")[2] in LINEARS
               and t.name.endswith(".weight")}
    load_quantized(path, "auto", tmp_path / "profile.json")
    err = capfd.readouterr().err
    assert "timing the kernels of each layer shape" in err and f"{len(linears)}/{len(linears)}" in err
    load_quantized(path, "auto", tmp_path / "profile.json")
    assert "timing the kernels" not in capfd.readouterr().err  # all cached: silent


# ---------------------------------------------------------------- whole models from tiny GGUF files

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 96, 2
# Every GGUF type of the packaged pair, rotated over the layers so each sits in several places.
TYPES = [T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0]
LINEARS = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
           "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
           "ffn_down": (HIDDEN, FFN)}


def write_tiny_gguf(path, arch: str = "qwen2", seed: int = 0, tokenizer: bool = False, hidden: int = HIDDEN):
    """hidden: a width that is not a multiple of 256 (the packaged drafter's 896) takes 32-element
    types only (Q5_0, Q8_0), as its file does: k-quants need whole 256-element blocks."""
    rng = np.random.default_rng(seed)
    whole = hidden % 256 == 0
    kv = KV_HEADS * (hidden // HEADS)
    linears = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
               "attn_output": (hidden, hidden), "ffn_gate": (FFN, hidden), "ffn_up": (FFN, hidden),
               "ffn_down": (hidden, FFN)}
    types = TYPES if whole else [T.Q5_0, T.Q8_0]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)  # not the default: a dropped rope_theta would show
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    if arch == "llama":
        writer.add_rope_dimension_count(hidden // HEADS)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([chr(ord("!") + i) for i in range(VOCAB)])
        writer.add_token_types([1] * VOCAB)
        writer.add_token_scores([0.0] * VOCAB)
        writer.add_token_merges([])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)

    def matrix(name, shape, qtype, scale=0.06):
        writer.add_tensor(name, quantize(rng.standard_normal(shape).astype(np.float32) * scale, qtype),
                          raw_dtype=qtype)

    def vector(name, size, mean=0.0, scale=0.1):
        writer.add_tensor(name, (mean + scale * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", (VOCAB, hidden), T.Q4_K if whole else T.Q5_0, scale=1.0)
    matrix("output.weight", (VOCAB, hidden), T.Q6_K if whole else T.Q8_0)
    vector("output_norm.weight", hidden, mean=1.0)
    for i in range(LAYERS):
        for j, (name, shape) in enumerate(linears.items()):
            matrix(f"blk.{i}.{name}.weight", shape, types[(i + j) % len(types)])
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                vector(f"blk.{i}.{name}.bias", shape[0])
        vector(f"blk.{i}.attn_norm.weight", hidden, mean=1.0)
        vector(f"blk.{i}.ffn_norm.weight", hidden, mean=1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()  # [S, V]


def fixed_measure(table: dict[str, list[float]]):
    """A stand-in for quant_choice.measure: each candidate's times from `table` (ms at ROW_BUCKETS)."""
    return lambda candidates: {k: [float(t) for t in table[k]] for k in candidates}


# kquant or int4 fastest at 1 row (where they can run), int8dyn beyond: layers mix kernels by row count.
fake_measure = fixed_measure({"kquant": [0.5, 9, 9, 9], "int4": [1, 9, 9, 9], "int8": [2, 9, 9, 9],
                              "int8dyn": [9, 1, 1, 1], "kquant_x8": [3, 2, 2, 2]})


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("mode", ["q4", "auto"])
def test_whole_model_matches_transformers_dequantised_forward(tmp_path, monkeypatch, arch, mode):
    import specav.models.quant_choice as choice

    monkeypatch.setattr(choice, "measure", fake_measure)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    ids = torch.randint(2, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = transformers_logits(path, ids)  # [12, V]
    model = load_quantized(path, mode, tmp_path / "profile.json")
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.hf_model.modules())
    assert model.dtype == torch.float32

    # The same tokens packed three ways: a 12-token prefill (12 rows), then 1 + 4 rows in two calls.
    whole = model.forward([ids], [model.new_cache()], [12]).logits
    cache = model.new_cache()
    first = model.forward([ids[:7]], [cache], [7]).logits
    then = torch.cat([model.forward([ids[7:8]], [cache], [1]).logits,
                      model.forward([ids[8:]], [cache], [4]).logits])
    for logits in (whole, torch.cat([first, then])):
        error = ((logits - reference).norm() / reference.norm()).item()
        assert error < WHOLE_MODEL_TOLERANCE[mode], f"{arch} {mode}: relative logit error {error:.4f}"
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_drafter_runs_every_layer_natively(tmp_path, monkeypatch, arch):
    """A drafter in auto: its Q5_0 / Q8_0 layers requantised to Q4_K, every linear on a native
    kernel up to DRAFTER_NATIVE_ROWS rows (the head at every row count: here kquant_x8, measured
    faster, where it lays the weight out, else kquant), int8dyn beyond; q/k/v and gate/up fused;
    logits still close to the file's own weights' whichever kernels run."""
    import specav.models.quant_choice as choice

    monkeypatch.setattr(choice, "measure", fixed_measure({"kquant": [0.5, 9.0, 9.0, 9.0], "kquant_x8": [0.4, 2.0, 2.0, 2.0]}))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    ids = torch.randint(2, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = transformers_logits(path, ids)  # [12, V]
    model = load_quantized(path, "auto", None, role="drafter")
    head = model.hf_model.lm_head
    layers = [m for m in model.hf_model.modules() if isinstance(m, QuantizedLinear) and m is not head]
    def native_kernel(m):
        return "kquant_x8" if m.out_features % 8 == 0 and m.packed[m.plan.kernel_for(1)].qtype == T.Q4_K else "kquant"

    assert len(layers) == 7 * LAYERS and set(head.packed) == {native_kernel(head)}
    assert {native_kernel(m) for m in layers} == {"kquant_x8", "kquant"}  # Q6_K layers stay on kquant
    assert all(set(m.packed) == {native_kernel(m), "int8dyn"} for m in layers)
    assert all(m.plan.kernel_for(n) == native_kernel(m) for m in layers for n in range(1, DRAFTER_NATIVE_ROWS + 1))
    assert all(m.plan.kernel_for(DRAFTER_NATIVE_ROWS + 1) == "int8dyn" for m in layers)
    assert all(m.packed[native_kernel(m)].qtype in (T.Q4_K, T.Q6_K) for m in layers + [head])
    for step in (1, 12):  # one token at a time (kquant), then the whole sequence at once (int8dyn)
        cache = model.new_cache()
        logits = torch.cat([model.forward([ids[i:i + step]], [cache], [step]).logits for i in range(0, 12, step)])
        error = ((logits - reference).norm() / reference.norm()).item()
        assert error < WHOLE_MODEL_TOLERANCE["drafter"], f"{arch} drafter, {step} at a time: relative logit error {error:.4f}"


def test_drafter_takes_the_faster_whole_layer_kernel_at_its_row_counts(tmp_path, monkeypatch):
    """NativeDrafter runs, per shape, the faster of kquant and kquant_x8 at one and four rows
    (relative to the faster at each), measured once and kept in the kernel profile."""
    import specav.models.quant_choice as choice

    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    profiles = iter([{"kquant": [1.0, 4.0, 9.0, 9.0], "kquant_x8": [1.2, 2.0, 9.0, 9.0]},  # x8: 1.2 + 1.0 < 1.0 + 2.0
                     {"kquant": [1.0, 2.2, 9.0, 9.0], "kquant_x8": [1.2, 2.0, 9.0, 9.0]}])  # kquant: 1.0 + 1.1 < 1.2 + 1.0
    measured = []
    monkeypatch.setattr(choice, "measure", lambda candidates: measured.append(set(candidates)) or next(profiles))
    policy = choice.NativeDrafter(tmp_path / "kernel-profile.json")
    q4k = random_weight(T.Q4_K, n=64, k=512)
    assert policy.plan(q4k).kernels == ("kquant_x8", "int8dyn") and policy.plan(q4k, head=True).kernels == ("kquant_x8",)
    assert policy.plan(random_weight(T.Q4_K, n=72, k=512)).kernels == ("kquant", "int8dyn")
    assert measured == [{"kquant", "kquant_x8"}] * 2  # once per shape
    assert choice.NativeDrafter(tmp_path / "kernel-profile.json").plan(q4k).kernels[0] == "kquant_x8"  # kept
    assert measured == [{"kquant", "kquant_x8"}] * 2
    monkeypatch.setattr(choice, "measure", fixed_measure({"kquant": [1.0] * 4}))
    assert policy.plan(random_weight(T.Q6_K, n=64, k=512)).kernels == ("kquant", "int8dyn")  # kquant_x8: Q4_K only


def test_fused_projections_equal_separate_ones(tmp_path):
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", None, role="drafter")
    attn, mlp = model.hf_model.model.layers[1].self_attn, model.hf_model.model.layers[1].mlp
    assert isinstance(attn.qkv_proj, FusedLinear) and isinstance(mlp.gate_up_proj, FusedLinear)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    for fused, members in ((attn.qkv_proj, (attn.q_proj, attn.k_proj, attn.v_proj)), (mlp.gate_up_proj, (mlp.gate_proj, mlp.up_proj))):
        for y, member in zip(fused(x), members, strict=True):
            assert torch.equal(y, member(x))


def _packed_runs(model, ids: list[int]) -> tuple[list[torch.Tensor], list]:
    """Forwards of three requests packed several ways (a 19-token prefill, one row, three rows of
    one each, ragged 1 + 4 + 2 rows): every forward's logits and hidden states, and the caches."""
    caches = [model.new_cache() for _ in range(3)]
    plan = [([ids[:9], ids[9:14], ids[14:19]], [2, 1, 3]), ([ids[19:20]], [1]),
            ([ids[20:21], ids[21:22], ids[22:23]], [1, 1, 1]), ([ids[23:24], ids[24:28], ids[28:30]], [1, 4, 2])]
    outputs = []
    for tokens, num_logits in plan:
        out = model.forward(tokens, caches[:len(tokens)], num_logits)
        outputs += [out.logits, out.hidden]
    return outputs, caches


def _assert_same_runs(one, other) -> None:
    """Two _packed_runs results agree bit for bit: every forward's logits and hidden states, and
    each cache's filled positions."""
    (outputs, caches), (other_outputs, other_caches) = one, other
    for a, b in zip(outputs, other_outputs, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(caches, other_caches, strict=True):
        assert a.length == b.length
        assert torch.equal(a.keys[:, :a.length], b.keys[:, :b.length])
        assert torch.equal(a.values[:, :a.length], b.values[:, :b.length])


@pytest.mark.parametrize("role", ["drafter", "target"])
def test_whole_layer_call_equals_the_layer_op_by_op(tmp_path, monkeypatch, role):
    """Where all seven linears of a layer run kquant at the forward's row count (the drafter up to
    DRAFTER_NATIVE_ROWS rows), the packed forward runs the layer as one native call
    (native/decoder.cpp): its logits, hidden states and caches equal the op-by-op path's bit for bit,
    on every packing. A layer with a linear on another kernel at that row count (the drafter's
    prefill on int8dyn; every layer of this target, whose Q5_0 / Q8_0 linears run on torch's
    kernels) runs op by op."""
    import specav.models.quant_choice as choice
    from specav.models.layer_ops import NativeLayerOps

    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(choice, "measure", fake_measure)
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", tmp_path / "profile.json", role=role)
    ids = torch.randint(2, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = []
    original = NativeLayerOps.decoder_layers
    monkeypatch.setattr(NativeLayerOps, "decoder_layers",
                        lambda self, *a: calls.append(tuple(c.index for c in a[0])) or original(self, *a))
    whole, whole_caches = _packed_runs(model, ids)
    fused_layers = list(calls)
    monkeypatch.setattr(NativeLayerOps, "whole_layer", staticmethod(lambda layer, rows: None))
    calls.clear()
    by_op, by_op_caches = _packed_runs(model, ids)
    assert not calls
    if role == "drafter":  # all but the 19-row prefill: three forwards, both layers in one call each
        assert fused_layers == [(0, 1)] * 3
    else:
        assert fused_layers == []
    _assert_same_runs((whole, whole_caches), (by_op, by_op_caches))


def test_attention_half_call_equals_the_attention_op_by_op(tmp_path, monkeypatch):
    """Where q, k, v and o run kquant at the forward's row count but the MLP does not (the target
    verifying a few rows: its large linears on int8dyn), the attention half is one native call and
    the MLP runs op by op: logits, hidden states and caches equal the op-by-op path's bit for bit."""
    import specav.models.quant_choice as choice
    from specav.models.layer_ops import NativeLayerOps

    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(choice, "measure", fake_measure)
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", tmp_path / "profile.json", role="drafter")
    for layer in model.decoder.layers:  # the MLP on int8dyn at the decoding row counts, attention on kquant
        for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            linear._by_rows.update({rows: linear.packed["int8dyn"] for rows in (1, 3, 7)})
    ids = torch.randint(2, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = []
    original = NativeLayerOps.attention_block
    monkeypatch.setattr(NativeLayerOps, "attention_block", lambda self, *a: calls.append(a[0].index) or original(self, *a))
    monkeypatch.setattr(NativeLayerOps, "decoder_layers", lambda self, *a: pytest.fail("no layer runs whole"))
    half, half_caches = _packed_runs(model, ids)
    assert calls == [0, 1] * 3  # all but the 19-row prefill (int8dyn throughout)
    monkeypatch.setattr(NativeLayerOps, "whole_layer", staticmethod(lambda layer, rows: None))
    calls.clear()
    by_op, by_op_caches = _packed_runs(model, ids)
    assert not calls
    _assert_same_runs((half, half_caches), (by_op, by_op_caches))


def test_whole_layers_run_in_one_call_up_to_a_layer_that_is_not_whole(tmp_path, monkeypatch):
    """Consecutive whole layers are one native call (decoder_layers_); a layer whose MLP runs another
    kernel at that row count splits the run: here layer 0's attention half, then layer 1 whole, with
    logits, hidden states and caches equal to the op-by-op path's bit for bit."""
    import specav.models.quant_choice as choice
    from specav.models.layer_ops import NativeLayerOps

    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(choice, "measure", fake_measure)
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", tmp_path / "profile.json", role="drafter")
    layer = model.decoder.layers[0]
    for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        linear._by_rows.update({rows: linear.packed["int8dyn"] for rows in (1, 3, 7)})
    ids = torch.randint(2, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = []
    halves, stacks = NativeLayerOps.attention_block, NativeLayerOps.decoder_layers
    monkeypatch.setattr(NativeLayerOps, "attention_block",
                        lambda self, *a: calls.append(("half", a[0].index)) or halves(self, *a))
    monkeypatch.setattr(NativeLayerOps, "decoder_layers",
                        lambda self, *a: calls.append(("whole", *(c.index for c in a[0]))) or stacks(self, *a))
    mixed, mixed_caches = _packed_runs(model, ids)
    assert calls == [("half", 0), ("whole", 1)] * 3  # all but the 19-row prefill
    monkeypatch.setattr(NativeLayerOps, "whole_layer", staticmethod(lambda layer, rows: None))
    _assert_same_runs((mixed, mixed_caches), _packed_runs(model, ids))


def test_loader_selects_the_quantized_path_by_dtype(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", tokenizer=True)
    checkpoint = load_checkpoint(str(path), dtype="q4")
    assert isinstance(checkpoint.model.lm_head, QuantizedLinear) and checkpoint.gguf_path == path
    assert checkpoint.model.vocab_size == VOCAB
    hf_dir = save_tiny_checkpoint(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="'q4' runs a GGUF file.*Hugging Face directory.*.gguf"):
        load_checkpoint(hf_dir, dtype="q4")
    dense = load_checkpoint(hf_dir, dtype="auto")  # a dense checkpoint: nothing to quantize, bf16
    assert dense.model.dtype == torch.bfloat16


def test_missing_tensor_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("qwen2."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        if t.name != "blk.1.ffn_up.weight":
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no tensor 'blk.1.ffn_up.weight'"):
        load_quantized(tmp_path / "cut.gguf", "q4")


def test_header_reader_matches_gguf_reader_and_refuses_truncated_files(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", tokenizer=True)
    header = read_header(path)
    for t in gguf.GGUFReader(path).tensors:
        info = header.tensors[t.name]
        assert (info.offset, info.nbytes, info.qtype) == (t.data_offset, t.n_bytes, t.tensor_type)
        assert np.array_equal(header.weight(t.name).blocks.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    assert header.field("qwen2.block_count") == LAYERS and header.field("tokenizer.ggml.tokens").length == VOCAB
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="cut.gguf.*truncated.*re-download"):
        read_header(tmp_path / "cut.gguf")
    (tmp_path / "short.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="short.gguf.*(corrupt|truncated)"):
        read_header(tmp_path / "short.gguf")


# ---------------------------------------------------------------- the packaged files' own tensors

@pytest.mark.e2e
def test_packaged_tensors_of_every_type_match_their_dequantisation():
    """One real tensor of each type in the packaged pair, through every kernel that holds it."""
    from specav.models import packaged

    seen = {}
    for model in (packaged.TARGET, packaged.DRAFTER):
        header = read_header(packaged.assembled_gguf(model))
        for info in header.tensors.values():
            if info.name.startswith("blk.1.") and len(info.dims) == 2 and info.qtype not in seen:
                seen[info.qtype] = header.weight(info.name)
    assert {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0} <= set(seen)
    x = torch.randn(4, 8960, generator=torch.Generator().manual_seed(0))
    for qtype, weight in seen.items():
        rows = x[:, :weight.shape[1]]  # [4, K]
        reference = rows @ dequantize(weight).t()
        for kernel in (k for k in KERNELS if KERNELS[k].fits(qtype, weight.shape)):
            y = KERNELS[kernel].pack(weight).matmul(rows)
            error = ((y - reference).norm() / reference.norm()).item()
            print(f"{kernel:8s} {weight.name:24s} {qtype.name:5s} relative error {error:.4f}")
            assert error < TOLERANCE[kernel], f"{kernel} on {weight.name} ({qtype.name}): {error:.4f}"
