"""The engine on tiny models: greedy equality, seeds, stop rules, continuous batching, cache sync."""

from __future__ import annotations

import torch

from specav.config import SamplingParams
from tests.tiny_models import VOCAB, make_engine, tiny_pair


def prompts(n, seed=0, lo=1, hi=12):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(2, VOCAB, (m,), generator=gen).tolist() for m in lengths]


def test_greedy_speculative_equals_greedy_target_only():
    target, drafter = tiny_pair(noise=0.08)
    ps = prompts(12, seed=1)
    greedy = [SamplingParams(temperature=0, max_tokens=int(m)) for m in torch.randint(1, 24, (12,)).tolist()]
    reference = [r.output_ids for r in make_engine(target).generate(ps, greedy)]
    for k, batch in [(1, 1), (3, 4), (5, 12), (8, 5)]:
        engine = make_engine(target, drafter, k=k, max_batch_size=batch)
        outputs = [r.output_ids for r in engine.generate(ps, greedy)]
        assert outputs == reference, f"K={k}, batch={batch}"
        assert 0 < engine.stats.accepted < engine.stats.admitted  # the drafter is right sometimes, not always


def test_identical_drafter_is_always_accepted():
    """p == q means every admitted slot is accepted: any drafter/target cache desync would show here."""
    target, _ = tiny_pair()
    for temperature in (0.0, 0.9):
        engine = make_engine(target, target, k=4, max_batch_size=3)
        params = SamplingParams(temperature=temperature, max_tokens=30, seed=5)
        engine.generate(prompts(5, seed=2), params)
        assert engine.stats.accepted == engine.stats.admitted > 0
        assert engine.stats.acceptance_per_position == [1.0] * 4


def test_same_seed_same_output_whatever_else_is_in_the_batch():
    target, drafter = tiny_pair(noise=0.08)
    mine = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=1234)
    alone = make_engine(target, drafter, k=4).generate([[5, 6, 7]], mine)[0].output_ids
    others = [SamplingParams(temperature=t, max_tokens=m, seed=s) for t, m, s in
              [(1.0, 5, 1), (0.0, 17, 2), (0.5, 30, None), (1.3, 2, 4)]]
    engine = make_engine(target, drafter, k=4, max_batch_size=3)
    batch = engine.generate(prompts(4, seed=9) + [[5, 6, 7]], others + [mine])
    assert batch[-1].output_ids == alone
    assert make_engine(target, drafter, k=4).generate([[5, 6, 7]], mine)[0].output_ids == alone


def test_max_tokens_eos_and_stop_strings():
    target, drafter = tiny_pair()
    engine = make_engine(target, drafter, k=4)
    out = engine.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=7))[0]
    assert len(out.output_ids) == 7 and out.finish_reason == "length"

    eos = out.output_ids[3]
    engine = make_engine(target, drafter, k=4, eos_ids=[eos])
    stopped = engine.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=7))[0]
    first = out.output_ids.index(eos)
    assert stopped.output_ids == out.output_ids[: first + 1] and stopped.finish_reason == "stop"
    ignoring = engine.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert ignoring.output_ids == out.output_ids

    word = engine.tokenizer.decode([out.output_ids[2]])
    by_string = make_engine(target, drafter, k=4).generate(
        [[3, 4]], SamplingParams(temperature=0, max_tokens=7, stop=(word,)))[0]
    assert by_string.finish_reason == "stop" and word not in by_string.text


def test_continuous_batching_admits_new_requests_between_steps():
    target, drafter = tiny_pair()
    engine = make_engine(target, drafter, k=3, max_batch_size=2)
    short = engine.add_request([3], SamplingParams(temperature=0, max_tokens=2))
    long = engine.add_request([4], SamplingParams(temperature=0, max_tokens=12))
    late = engine.add_request([5], SamplingParams(temperature=0, max_tokens=3))
    assert [r.request_id for r in engine.scheduler.schedule()] == [short.request_id, long.request_id]
    seen_late_while_long_runs = False
    while engine.has_work():
        engine.step()
        running = {r.request_id for r in engine.scheduler.running}
        seen_late_while_long_runs |= late.request_id in running and long.request_id in running
    assert seen_late_while_long_runs
    assert all(r.finished for r in (short, long, late))
    assert not engine.verifier._states and not engine.drafter._states  # caches released
