"""The forward's thread-count policy: it follows the measured times, explores, and never changes the numbers."""

from __future__ import annotations

import pytest
import torch

from specav.models.threads import ThreadChoice


def drive(policy: ThreadChoice, seconds_for, calls: int, rows: int = 1, available: int = 2) -> list[int]:
    """Run `calls` forwards of `rows` rows whose time is seconds_for(threads, call); the counts used."""
    used = []
    for call in range(calls):
        threads = policy.choose(rows, available)
        policy.record(rows, threads, seconds_for(threads, call))
        used.append(threads)
    return used


def test_tries_each_count_then_keeps_the_faster_and_explores_now_and_then():
    policy = ThreadChoice(explore_share=0.05)
    used = drive(policy, lambda n, call: {2: 0.036, 1: 0.052}[n], 64)
    assert used[:4] == [2, 2, 1, 1]  # each count twice first
    # then one exploring forward once 5% of the time since the last covers its extra 0.016 s: every 10th
    explored = [i for i, n in enumerate(used) if n == 1][2:]
    assert explored and all(b - a == 10 for a, b in zip(explored, explored[1:]))


@pytest.mark.parametrize("rows,seconds", [(1, {2: 0.036, 1: 0.052}), (560, {2: 21.0, 1: 42.0})],
                         ids=["decode", "prefill"])
def test_exploring_costs_its_share_of_the_time_whatever_the_forward_size(rows, seconds):
    """A 560-row prefill explores about once per 50 (its 1-thread forward costs 21 s more); a
    one-row decode forward, whose counts differ by 16 ms, every few dozen."""
    policy = ThreadChoice(explore_share=0.02)
    calls = 3000 if rows == 1 else 300
    used = drive(policy, lambda n, call: seconds[n], calls, rows=rows)[4:]
    extra = used.count(1) * (seconds[1] - seconds[2])
    total = sum(seconds[n] for n in used)
    assert used.count(1) >= 2
    assert 0.5 * 0.02 <= extra / total <= 0.02


def test_a_cold_first_forward_does_not_decide():
    policy = ThreadChoice(explore_share=0.0)
    used = drive(policy, lambda n, call: 0.2 if call == 0 else {2: 0.036, 1: 0.052}[n], 12)
    assert used[4:] == [2] * 8  # the 2-thread count's cold first forward (0.2 s) is not its mean


def test_moves_to_one_thread_when_another_process_takes_a_core_and_back_when_it_stops():
    policy = ThreadChoice(explore_share=0.1)
    busy = range(40, 120)  # calls during which one core is taken: 2 threads 5x slower, 1 thread as before

    def seconds(n, call):
        return {2: 0.19, 1: 0.051}[n] if call in busy else {2: 0.036, 1: 0.052}[n]

    used = drive(policy, seconds, 200)
    assert used[30:40].count(2) >= 8  # quiet: mostly 2
    assert used[45:120].count(1) >= 0.8 * 75  # contended: moved to 1 within a few forwards
    assert used[140:200].count(2) >= 0.8 * 60  # quiet again: found 2 at an exploring forward


def test_row_count_groups_learn_apart():
    policy = ThreadChoice(explore_share=0.0)
    drive(policy, lambda n, call: {2: 1.0, 1: 2.0}[n], 4, rows=1)
    drive(policy, lambda n, call: {2: 2.0, 1: 1.0}[n], 4, rows=16)
    assert policy.choose(1, 2) == 2 and policy.choose(16, 2) == 1


def test_scope_sets_and_restores_torch_threads():
    saved = torch.get_num_threads()
    policy = ThreadChoice()
    try:
        torch.set_num_threads(2)
        for _ in range(3):
            with policy.scope(rows=1) as n:
                assert torch.get_num_threads() == n
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="explore_share"):
        ThreadChoice(explore_share=1.0)
    with pytest.raises(ValueError, match="decay"):
        ThreadChoice(decay=1.0)


def test_the_numbers_do_not_depend_on_the_thread_count(tmp_path):
    """A quantized model on the native kernels: logits bit for bit the same with 1 and 2 threads."""
    from specav.models.quant import load_quantized
    from tests.test_quant import write_tiny_gguf

    model = load_quantized(write_tiny_gguf(tmp_path / "tiny.gguf"), "auto", None, role="drafter")
    model.threads = None
    saved = torch.get_num_threads()
    logits = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            logits[n] = model.forward([list(range(2, 40)), [5, 6, 7]], [model.new_cache(), model.new_cache()],
                                      [38, 3]).logits
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(logits[1], logits[2])


def test_a_prefill_is_not_judged_by_the_small_verifies_beside_it():
    """A 200-token prefill and a 12-token verify fell in one group (9+ rows): the verify's 1-thread time
    (0.36 s) beat the prefill's 2-thread time (2.5 s), and prefills ran on 1 thread at 1.8x. Groups on
    a doubling scale keep them apart."""
    policy = ThreadChoice(explore_share=0.0)
    prefill = lambda n, call: {2: 2.5, 1: 4.5}[n]  # noqa: E731
    drive(policy, prefill, 2, rows=200)
    drive(policy, lambda n, call: {2: 0.30, 1: 0.36}[n], 2, rows=12)
    assert drive(policy, prefill, 6, rows=200) == [1, 1, 2, 2, 2, 2]  # its own trial of 1 thread, then 2


def test_forwards_of_one_group_are_compared_per_row():
    """Within a group sizes differ up to 2x: 2 threads measured on 16-row forwards (0.10 s a row) and
    1 thread on 9-row ones (0.13 s a row) compare by time per row, not by time (1.6 s against 1.2 s)."""
    policy = ThreadChoice(explore_share=0.0)
    drive(policy, lambda n, call: {2: 1.6, 1: 2.9}[n], 2, rows=16)
    drive(policy, lambda n, call: {2: 0.9, 1: 1.2}[n], 2, rows=9)
    assert policy.choose(12, 2) == 2
