"""bench step_overhead's timing of the per-slot calls inside a step (`--calls`)."""

from __future__ import annotations

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
