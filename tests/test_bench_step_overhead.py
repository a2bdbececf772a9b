"""bench step_overhead: its timing of the per-slot calls inside a step (`--calls`) and of the kernels inside the forwards."""

from __future__ import annotations

import time

import torch

from specav.bench import step_overhead
from specav.config import SamplingParams
from specav.models import native
from specav.request import Request
from specav.verification.sampling_rows import SamplingRows


def test_timed_calls_count_each_call_and_put_the_originals_back():
    request = Request([1, 2], SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=0))
    before = {name: owner.__dict__[name] for _, owner, name in step_overhead._CALLS}
    seconds, counts = {}, {}
    with step_overhead._timed_calls(seconds, counts):
        rows = SamplingRows.of([request], [1], model="drafter")  # a classmethod, still bound to the class
        probs, _, tokens = rows.draw(torch.randn(1, 50, generator=torch.Generator().manual_seed(0)))
    # without native kernels draw_top_k declines and the two steps run
    general = {} if native.available() else {"  distributions_and_tails": 1, "  scan_rows (both models)": 1,
                                                "  candidate_probs (both models)": 1}
    assert counts == {"SamplingRows.of (both models)": 1, "drafter: draw (q_i, tails, tokens)": 1,
                      "  draw_top_k (one native call)": 1, **general}
    assert all(s > 0 for s in seconds.values()) and len(probs) == 1 and tokens.shape == (1,)
    assert {name: owner.__dict__[name] for _, owner, name in step_overhead._CALLS} == before


def test_the_kernel_clock_counts_the_outermost_call_only():
    clock = step_overhead._KernelClock()
    inner = clock.timed(lambda: time.sleep(0.02))
    outer = clock.timed(lambda: (time.sleep(0.02), inner()))
    outer()
    assert 0.04 <= clock.seconds < 0.06  # 0.04 s of calls, not 0.06 (the inner call counted twice)
