"""bench quantized's agreement with bf16 and its noise floor: teacher-forced logits under a seeded
perturbation of the input embeddings, the perturbation undone afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specav.bench import quantized as bench_quantized
from specav.models.quant import load_quantized
from tests.test_quant import fake_measure, write_tiny_gguf


def test_perturbed_teacher_forcing_is_seeded_small_and_undone(tmp_path, monkeypatch):
    import specav.models.quant_choice as choice

    # A fixed kernel plan (kquant at one row, int8dyn beyond, as auto runs the packaged target):
    # one timed on the spot may put int4 on the tiny model's layers, whose bf16 activations can
    # round a 1e-6 perturbation away for both seeds.
    monkeypatch.setattr(choice, "measure", fake_measure)
    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", None, role="target")
    checkpoint = SimpleNamespace(model=model)
    prompt, tokens = [1, 5, 9, 2, 7], [3, 8, 4, 6]
    plain = bench_quantized.forced_logits(checkpoint, prompt, tokens)
    first = bench_quantized.forced_logits(checkpoint, prompt, tokens, perturbation_seed=0)
    again = bench_quantized.forced_logits(checkpoint, prompt, tokens, perturbation_seed=0)
    other = bench_quantized.forced_logits(checkpoint, prompt, tokens, perturbation_seed=1)
    assert plain.shape == (len(tokens), model.vocab_size)
    assert torch.equal(first, again) and not torch.equal(first, other)  # a seed names one perturbation
    assert not torch.equal(first, plain)
    assert ((first - plain).norm() / plain.norm()).item() < 0.5  # noise, not another model
    assert torch.equal(bench_quantized.forced_logits(checkpoint, prompt, tokens), plain)  # the hook is gone
    line = bench_quantized.agreement(tokens, tokens, plain, plain, [first, other])
    assert line.startswith("identical prefix   4/4, teacher-forced argmax ")
    assert "KL 0.0000; perturbed x 2: argmax " in line and "(mean " in line
