"""bench native's `layers` section: the three ways of running the layers timed in turns, the layers
that ran whole counted, and the switches put back afterwards; the drafter section's half blocks,
its turns and the bytes a one-row forward reads."""

from __future__ import annotations

import pytest
import torch

from specav.bench import native as bench_native
from specav.models import native, quant_choice
from specav.models.layer_ops import NativeLayerOps
from specav.models.quant import QuantizedLinear, load_quantized, quantized_nbytes
from specav.models.quant_kernels import KQuantWeight
from specav.models.threads import ThreadChoice
from specav.models.vocab_subset import set_head, subset_head
from tests.test_quant import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, fake_measure, fixed_measure, write_tiny_gguf


def test_layer_calls_times_three_ways_and_counts_the_layers(tmp_path, capsys, monkeypatch):
    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", None, role="drafter")
    model.threads = None
    calls = []
    original = NativeLayerOps.decoder_layers
    monkeypatch.setattr(NativeLayerOps, "decoder_layers",
                        lambda self, *a: calls.append(tuple(c.index for c in a[0])) or original(self, *a))
    whole_layer, recording = NativeLayerOps.__dict__["whole_layer"], NativeLayerOps.__dict__["decoder_layers"]
    bench_native.layer_calls({"drafter": model}, repeats=3)
    out = capsys.readouterr().out
    assert "drafter: the layers in one call" in out and "a call per layer" in out and "op by op" in out
    assert "2 of 2 layers run whole at one row" in out
    assert NativeLayerOps.__dict__["whole_layer"] is whole_layer  # the switches are undone
    assert NativeLayerOps.__dict__["decoder_layers"] is recording
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())
    # per round: both layers in one call, then one call each (the patched per-layer way calls through)
    assert sorted(calls) == sorted([(0, 1)] * (3 + warmup) + [(0,), (1,)] * (3 + warmup))


def test_a_drafter_whose_width_ends_in_half_a_block_computes_the_same_with_the_zero_halves_read(tmp_path, monkeypatch):
    """A drafter of hidden size 384 (1.5 blocks, as the packaged drafter's 896 is 3.5) in `auto`: its
    K = 384 weights, requantised to Q4_K, are packed without their last blocks' zero halves; with
    those halves read again (bench native's comparison) its logits are the same bit for bit, every
    row count, and half_blocks leaves the packed layout in place."""
    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(quant_choice, "measure",  # kquant_x8 measured faster: its half blocks
                        fixed_measure({"kquant": [1.0, 4.0, 9.0, 9.0], "kquant_x8": [0.9, 2.0, 9.0, 9.0]}))
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf", hidden=384), "auto", None, role="drafter")
    model.threads = None
    layouts = bench_native.HalfBlockLayouts(model)
    packed = [p.blocks for p in layouts.weights]
    # q, k, v, o, gate and up of each layer (down's K is 512) and the head, on kquant_x8 (N % 8 == 0):
    # each group of 8 rows 2 * 1184 - 512 bytes
    assert len(packed) == 6 * 2 + 1 and all(b.shape[1] == 2 * 1184 - 512 for b in packed)
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0)).tolist()

    def logits():
        cache = model.new_cache(32)
        out = [model.forward([ids[:4]], [cache], [4]).logits]
        out += [model.forward([ids[4 + i:5 + i]], [cache], [1]).logits for i in range(3)]  # the whole-layer calls
        out.append(model.forward([ids[7:12]], [cache], [5]).logits)
        return out

    trimmed = logits()
    layouts.use("whole")
    assert all(p.blocks.shape[1] == 2 * 1184 for p in layouts.weights)
    whole = logits()
    assert all(torch.equal(a, b) for a, b in zip(trimmed, whole))
    layouts.use("trimmed")
    seconds = bench_native.half_blocks(model, forwards=3)
    assert all(s > 0 for s in seconds)
    assert all(p.blocks is b for p, b in zip(layouts.weights, packed))  # left out again afterwards
    assert all(torch.equal(a, b) for a, b in zip(trimmed, logits()))


def test_in_turns_alternates_the_settings_and_leaves_the_warmup_out():
    calls, seconds = [], {"a": iter([9.0, 9.0, 1.0, 2.0, 3.0]), "b": iter([9.0, 9.0, 5.0, 7.0, 6.0])}

    def setting(name):
        return lambda: calls.append(name) or next(seconds[name])

    t = bench_native.in_turns({"a": setting("a"), "b": setting("b")}, forwards=3, warmup=2)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # the order reversed every other turn
    assert t == {"a": 2.0, "b": 6.0}  # medians of the turns after the warm-up


def test_one_row_bytes_counts_the_one_row_kernels_weights_and_a_subset_heads_rows(tmp_path, monkeypatch):
    """What a one-row forward reads: not the embedding, not a second packing of a weight for other
    row counts; a vocabulary-subset head reads its rows only (the drafter section's byte ratios);
    and the multiply-adds of a row in the linears (the forward section's arithmetic floor). The
    kernel times are fixed (fake_measure: one kernel at one row, int8dyn beyond), not measured: a
    plan with two kernels a layer must not hang on this machine's timings."""
    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(quant_choice, "measure", fake_measure)
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = load_quantized(path, "auto", None, role="target")
    linears = [m for m in model.hf_model.modules() if isinstance(m, QuantizedLinear)]
    assert any(len(m.packed) > 1 for m in linears)  # weights packed for two kernels: one is read at one row
    embedding = model.hf_model.get_input_embeddings()
    everything = quantized_nbytes(model)
    one_row = bench_native.one_row_bytes(model)
    second_packings = sum(p.nbytes for m in linears for k, p in m.packed.items() if k != m.plan.kernel_for(1))
    assert one_row == everything - embedding.nbytes - second_packings
    kv = KV_HEADS * HIDDEN // HEADS
    per_layer = 2 * HIDDEN * HIDDEN + 2 * kv * HIDDEN + 3 * FFN * HIDDEN  # q, o; k, v; gate, up, down
    assert bench_native.multiply_adds(model) == LAYERS * per_layer + VOCAB * HIDDEN  # and the head
    head = model.lm_head
    rows = head.packed_for(1)
    sub = subset_head(head, torch.arange(0, head.out_features, 4), head.out_features, path)
    set_head(model, sub)
    dropped = rows.nbytes - rows.nbytes // head.out_features * sub.rows.out_features
    assert bench_native.one_row_bytes(model) == one_row - dropped


def test_the_arithmetic_floor_is_rows_times_the_multiply_adds_at_the_peak_or_one():
    # 1 ms for one row of 1e6 multiply-adds at 1e9 a second: the arithmetic alone takes one row's time
    assert bench_native.arithmetic_floor(1e-3, 5, 10**6, 1e9) == pytest.approx(5.0)
    assert bench_native.arithmetic_floor(1e-3, 16, 10**6, 4e9) == pytest.approx(4.0)
    assert bench_native.arithmetic_floor(1e-3, 5, 10**6, 1e10) == 1.0  # the pass over the weights bounds it


def test_a_read_pass_times_a_plausible_rate(monkeypatch):
    monkeypatch.setattr(bench_native, "READ_BYTES", 64 << 20)
    read = bench_native.read_pass()
    rates = [bench_native.READ_BYTES / read() for _ in range(3)]
    assert all(1e8 < rate < 1e12 for rate in rates)  # bytes a second: between 0.1 GB/s and 1 TB/s
