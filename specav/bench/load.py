"""How much of the machine other processes used while a benchmark section ran.

A shared machine's other work slows a measurement in a way a ratio measured in turns only partly
cancels, so benchmark programs print, per section, the mean number of cores that processes other
than theirs kept busy (from /proc/stat's busy time of all CPUs minus the CPU time of the given
processes, /proc/<pid>/stat). 0.0 is a quiet machine; 1.0 on 2 cores is half of it taken.

Must not know: what is measured.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class ForeignLoad:
    cores: float = float("nan")  # mean cores busy with other processes over the section

    def __str__(self) -> str:
        return f"other processes kept {self.cores:.2f} of {os.cpu_count()} cores busy meanwhile"


def _busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICK


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


@contextmanager
def foreign_load(pids: Sequence[int] = ()) -> Iterator[ForeignLoad]:
    """Measures the section; `pids`: processes besides this one whose CPU time is ours."""
    ours = (os.getpid(), *pids)
    result = ForeignLoad()
    start, busy0, own0 = time.monotonic(), _busy_s(), sum(_cpu_s(p) for p in ours)
    try:
        yield result
    finally:
        wall = time.monotonic() - start
        foreign = (_busy_s() - busy0) - (sum(_cpu_s(p) for p in ours) - own0)
        result.cores = max(0.0, foreign / wall) if wall > 0 else float("nan")
