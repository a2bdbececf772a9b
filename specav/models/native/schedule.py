"""The k-quant matmul's schedule on this machine: measured once, kept beside the build.

Owns: the schedule a loaded variant runs (kquant.cpp `set_schedule`, three bits: TILES_OUTER, each
tile of activation rows passes over every weight row of a chunk, else each weight row over every
tile; SEGMENTS, long rows of K in segments so a tile's activations stay in the L1 cache; PREFETCH,
calls of several rows prefetch their weights 2 KiB ahead in software). Every schedule computes the
same results bit for bit (tests/test_quant.py), so the choice changes speed alone, and which is
fastest depends on the CPU's caches, not on its instruction set: segments were written for a Zen 5
EPYC, where they made 5 and 16 rows 10-25% faster, and on a Zen 4 EPYC the same AVX-512 variant ran
the target's K = 8960 weights 7-41% slower with them at 3 to 16 rows, and took 14-40% less time at 2
to 16 rows with the prefetch, which the hardware's prefetchers made useless at one row
(docs/quantized.md). So each schedule is timed here on synthetic weights of a long-K shape
(N = 1536, K = 8960, Q4_K and Q6_K: the packaged target's down projections) and a short one
(N = 8960, K = 1536, Q4_K) at the row counts of verification (`ROWS`), one thread, cache-cold,
the schedules in turns (median of `REPEATS`); the variant's own default stays unless another is
faster by more than `MARGIN` in total. One thread, as the kernel profile (quant_choice.py): the cache effects are per
core, and two-thread timings of millisecond calls on a shared machine measure the scheduler. The
outcome is kept in `schedule.json` in the variant's build directory under the machine's fingerprint
(probe.py), so a machine measures once per build (about 8 s).

Environment: SPECAV_NATIVE_SCHEDULE=<0..7> runs that schedule and measures nothing (to compare).

Must not know: models, or which kernel a layer runs (quant_choice.py).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specav.models.native import probe
from specav.models.native.selftest import Q4_K as _Q4_K, Q6_K as _Q6_K, random_blocks

log = logging.getLogger(__name__)

TILES_OUTER, SEGMENTS, PREFETCH = 1, 2, 4  # the schedule's bits (kquant.cpp)
SCHEDULES = tuple(range(8))
# (ggml type, N, K): a long K (where segments apply) in both types the packaged target's down
# projections use, and a short one
SHAPES = ((_Q4_K, 1536, 8960), (_Q6_K, 1536, 8960), (_Q4_K, 8960, 1536))
ROWS = (2, 3, 5, 8, 16)  # verification at 1, 2, 4, 7 and 15 drafted slots
REPEATS = 9
MARGIN = 0.03  # another schedule replaces the default only when this much faster (medians in turns: noise is below it)
_FILE = "schedule.json"
_FLUSH_BYTES = 64 << 20  # past the last-level cache: weights come from memory, as in a forward


def describe(schedule: int) -> str:
    return (("tiles outer" if schedule & TILES_OUTER else "weight rows outer")
            + (", long K in segments" if schedule & SEGMENTS else ", K in one pass")
            + (", prefetch" if schedule & PREFETCH else ""))


def relative(times: dict[int, list[float]], default: int) -> dict[int, float]:
    """Each schedule's total time over the cases (times[s][i]: seconds of schedule s on case i),
    relative to the default's."""
    return {s: sum(ts) / sum(times[default]) for s, ts in times.items()}


def choose(times: dict[int, list[float]], default: int) -> int:
    """The schedule with the lowest total time, where it is below 1 - MARGIN of the default's; else
    the default."""
    r = relative(times, default)
    best = min(r, key=lambda s: (r[s], s != default))
    return best if r[best] < 1.0 - MARGIN else default


def measure(ops, repeats: int = REPEATS, timer: Callable[[], float] = time.perf_counter) -> dict[int, list[float]]:
    """Median seconds of each schedule on each (shape, rows) case, one thread, the schedules in turns;
    leaves the schedule as it found it."""
    gen = np.random.default_rng(0)
    weights = [(torch.from_numpy(random_blocks(q, n, k, gen)), q, k) for q, n, k in SHAPES]
    cases = [(w, q, torch.from_numpy(gen.standard_normal((rows, k)).astype(np.float32)))
             for w, q, k in weights for rows in ROWS]
    flush = torch.zeros(_FLUSH_BYTES // 4)
    samples = {s: [[] for _ in cases] for s in SCHEDULES}
    saved_threads, saved = torch.get_num_threads(), ops.set_schedule(-1)
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for i, (w, q, x) in enumerate(cases):
                for s in SCHEDULES:
                    ops.set_schedule(s)
                    flush.add_(1.0)
                    start = timer()
                    ops.kq_matmul(x, [w], [q], [None])
                    samples[s][i].append(timer() - start)
    finally:
        ops.set_schedule(saved)
        torch.set_num_threads(saved_threads)
    return {s: [statistics.median(c) for c in per] for s, per in samples.items()}


def apply(ops, directory: Path, flags: set[str], measure_fn: Callable[[object], dict[int, list[float]]] = measure) -> int:
    """Set the schedule of the variant whose op namespace is `ops` and whose build is in `directory`:
    the forced one, the one kept for this machine, or one measured now (and kept). Returns it."""
    forced = os.environ.get("SPECAV_NATIVE_SCHEDULE")
    if forced:
        if forced not in {str(s) for s in SCHEDULES}:
            raise ValueError(f"SPECAV_NATIVE_SCHEDULE={forced!r}: the schedules are {', '.join(map(str, SCHEDULES))}")
        ops.set_schedule(int(forced))
        return int(forced)
    key = probe.fingerprint(flags)
    kept = probe.read_cache(directory, _FILE).get(key)
    if kept is None:
        default = ops.set_schedule(-1)
        times = measure_fn(ops)
        kept = {"schedule": choose(times, default), "default": default,
                "relative": {str(s): round(r, 3) for s, r in relative(times, default).items()}}
        probe.write_cache(directory, _FILE, key, kept)
        log.info("native kernels: schedule %d (%s), measured relative to the default %d: %s",
                 kept["schedule"], describe(kept["schedule"]), default, kept["relative"])
    ops.set_schedule(kept["schedule"])
    return kept["schedule"]
