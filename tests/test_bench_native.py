"""bench native's `layers` section: both ways of running a layer timed in turns, the layers that ran
as one call counted, and the op-by-op switch put back afterwards."""

from __future__ import annotations

import pytest
import torch

from specav.bench import native as bench_native
from specav.models import native
from specav.models.layer_ops import NativeLayerOps
from specav.models.quant import load_quantized
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
