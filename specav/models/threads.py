"""How many intra-op threads a forward runs with: the count that runs that forward fastest, now.

Owns: `ThreadChoice`, a per-model policy the packed forward enters around each forward (a scope:
torch's thread count is set for the forward and restored after it; nothing is changed at import).

Why: on a machine whose cores are shared (a server beside other work), a forward split over every
core waits at the end of each of its ~150 parallel regions for a thread that another process has
descheduled: measured on 2 cores with one busy process pinned to one of them, the one-row forward
of the packaged target took 5.3x its quiet time with 2 threads and 1.4x with 1 thread
(docs/quantized.md). Which count wins depends on the load, which changes while a server runs, so
it is measured, not guessed: forwards are grouped by row count on a doubling scale (1, 2, 3-4,
5-8, ..., which differ in how well they split), each group runs the count with the lowest recent
mean time per row (an exponential average over its forwards), and now and then a forward of a
group runs the next best count, so a count that became faster (the other process stopped) is
found again: an exploring forward's time replaces that count's stale mean. Exploring is paid in
time, not counted in forwards: a group explores once the time it has run since its last
exploring forward, times `explore_share`, covers what exploring is predicted to cost (its rows
times the difference of the two means per row, at most one more forward of the best count, since
a mean left from a contended spell may be far too high). One exploring forward in 32, the rule
before, cost a 2-core machine a stall of up to 21 s once per 32 prefills of 4 code prompts (560
rows: about 21 s on 2 threads, up to twice that on one), and put it on whichever benchmark run it
fell in; decode-size forwards, whose counts differ by a few ms, still explore every second or so.
The first forwards of a group try each count twice, and the second time starts its mean (a first
forward at a new row count runs cold: taken as the mean, it kept 16-row forwards on one thread at
1.7x the two-thread time). Doubling groups,
compared per row, so that a group's counts are measured on forwards of like size: with one group
for 9+ rows, a speculative step's 12-token verify and a 200-token prefill were compared as if
alike, and prefills ran on the count the verifies had made look fast (1.5-2x their time on the
AVX2 machine of docs/adaptive.md).

The numbers do not depend on the thread count: every native kernel computes each output on one
thread (quant_kernels.py, layer_ops.py), so this changes speed only. It is used for models on the
native kernels only (quant.py), whose rounding is tested to be independent of the split.

Must not know: what the forward computes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

_WARMUP = 2  # forwards each count runs first; the last of them starts its mean (the first runs cold)


@dataclass(slots=True)
class _Group:
    mean_s: dict[int, float] = field(default_factory=dict)  # thread count -> recent mean seconds per row
    samples: dict[int, int] = field(default_factory=dict)  # thread count -> forwards recorded with it
    since_explore: float = 0.0  # seconds of this group's forwards since its last exploring forward
    exploring: int | None = None  # the count an exploring forward runs, until it is recorded


class ThreadChoice:
    """Per row-count group, the thread count with the lowest recent forward time (see module doc)."""

    def __init__(self, explore_share: float = 0.02, decay: float = 0.7) -> None:
        if not 0.0 <= explore_share < 1.0:
            raise ValueError(f"explore_share must be in [0, 1) (0: never explore), got {explore_share}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.explore_share = explore_share  # of each group's time, spent running its next best count
        self.decay = decay  # weight of the old mean in each update
        self._groups: dict[int, _Group] = {}  # ceil(log2(rows)) -> its group

    @staticmethod
    def group_of(rows: int) -> int:
        """The row-count group of a forward: 1 row 0, 2 rows 1, 3-4 rows 2, 5-8 rows 3, ..."""
        return max(rows - 1, 0).bit_length()

    def _group(self, rows: int) -> _Group:
        return self._groups.setdefault(self.group_of(rows), _Group())

    @staticmethod
    def candidates(available: int) -> tuple[int, ...]:
        """The counts tried when `available` threads are allowed (torch's setting): all, half, one."""
        return tuple(sorted({available, max(1, available // 2), 1}, reverse=True))

    @classmethod
    def warmup_forwards(cls, available: int) -> int:
        """Forwards of one row-count group before it runs its best count (what a benchmark discards)."""
        return _WARMUP * len(cls.candidates(available))

    def choose(self, rows: int, available: int) -> int:
        """The thread count the next forward of `rows` rows runs with, of at most `available`."""
        group = self._group(rows)
        candidates = self.candidates(available)
        untried = [n for n in candidates if group.samples.get(n, 0) < _WARMUP]
        if untried:
            return untried[0]
        ranked = sorted(candidates, key=group.mean_s.get)
        if len(ranked) > 1 and self.explore_share > 0:
            best, runner_up = group.mean_s[ranked[0]], group.mean_s[ranked[1]]
            price = rows * min(runner_up - best, best)  # predicted extra seconds of running the next best
            if group.since_explore * self.explore_share >= price:
                group.exploring = ranked[1]  # now and then the next best, whose mean may be stale
                return ranked[1]
        return ranked[0]

    def record(self, rows: int, threads: int, seconds: float) -> None:
        group = self._group(rows)
        group.since_explore = 0.0 if group.exploring == threads else group.since_explore + seconds
        seconds /= max(rows, 1)  # per row: forwards of one group differ in size up to 2x
        group.samples[threads] = group.samples.get(threads, 0) + 1
        old = group.mean_s.get(threads)
        if group.samples[threads] <= _WARMUP or group.exploring == threads:  # a cold or stale mean is replaced
            group.mean_s[threads] = seconds
        else:
            group.mean_s[threads] = self.decay * old + (1 - self.decay) * seconds
        group.exploring = None

    @contextmanager
    def scope(self, rows: int) -> Iterator[int]:
        """Runs the body with the chosen thread count (restored after) and records its time."""
        saved = torch.get_num_threads()
        threads = self.choose(rows, saved)
        if threads != saved:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield threads
        finally:
            self.record(rows, threads, time.perf_counter() - start)
            if threads != saved:
                torch.set_num_threads(saved)
