"""bench native's `layers` section: both ways of running a layer timed in turns, the layers that ran
as one call counted, and the op-by-op switch put back afterwards; the drafter section's half blocks."""

from __future__ import annotations

import pytest
import torch

from specav.bench import native as bench_native
from specav.models import native
from specav.models.layer_ops import NativeLayerOps
from specav.models.quant import load_quantized
from specav.models.quant_kernels import KQuantWeight
from specav.models.threads import ThreadChoice
from tests.test_quant import write_tiny_gguf


def test_layer_calls_times_both_ways_and_counts_the_layers(tmp_path, capsys, monkeypatch):
    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", None, role="drafter")
    model.threads = None
    calls = []
    original = NativeLayerOps.decoder_layer
    monkeypatch.setattr(NativeLayerOps, "decoder_layer", lambda self, *a: calls.append(a[0].index) or original(self, *a))
    whole_layer = NativeLayerOps.__dict__["whole_layer"]
    bench_native.layer_calls({"drafter": model}, repeats=3)
    out = capsys.readouterr().out
    assert "drafter: each layer one call" in out and "op by op" in out
    assert "2 of 2 layers run as one call at one row" in out
    assert NativeLayerOps.__dict__["whole_layer"] is whole_layer  # the switch is undone
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())
    assert calls == [0, 1] * (3 + warmup)  # one-call forwards only in the "whole" turns


def test_a_drafter_whose_width_ends_in_half_a_block_computes_the_same_with_the_zero_halves_read(tmp_path):
    """A drafter of hidden size 384 (1.5 blocks, as the packaged drafter's 896 is 3.5) in `auto`: its
    K = 384 weights, requantised to Q4_K, are packed without their last blocks' zero halves; with
    those halves read again (bench native's comparison) its logits are the same bit for bit, every
    row count, and half_blocks leaves the packed layout in place."""
    if not native.available():
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf", hidden=384), "auto", None, role="drafter")
    model.threads = None
    layouts = bench_native.HalfBlockLayouts(model)
    packed = [p.blocks for p in layouts.weights]
    # q, k, v, o, gate and up of each layer (down's K is 512) and the head, all 2 * 144 - 64 bytes a row
    assert len(packed) == 6 * 2 + 1 and all(b.shape[1] == 2 * 144 - 64 for b in packed)
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0)).tolist()

    def logits():
        cache = model.new_cache(32)
        out = [model.forward([ids[:4]], [cache], [4]).logits]
        out += [model.forward([ids[4 + i:5 + i]], [cache], [1]).logits for i in range(3)]  # the whole-layer calls
        out.append(model.forward([ids[7:12]], [cache], [5]).logits)
        return out

    trimmed = logits()
    layouts.use("whole")
    assert all(p.blocks.shape[1] == 2 * 144 for p in layouts.weights)
    whole = logits()
    assert all(torch.equal(a, b) for a, b in zip(trimmed, whole))
    layouts.use("trimmed")
    seconds = bench_native.half_blocks(model, forwards=3)
    assert all(s > 0 for s in seconds)
    assert all(p.blocks is b for p, b in zip(layouts.weights, packed))  # left out again afterwards
    assert all(torch.equal(a, b) for a, b in zip(trimmed, logits()))
