"""Kernel choice: which quantized kernel runs each linear layer at each packed row count.

Owns: the precision policies behind `--dtype q4` and `--dtype auto`, and the measured
kernel profile that `auto` chooses from.

- `q4` (`FixedRule`): the closest kernel to the file's own weights, whatever the speed:
  int4 for the 4-bit types (exact codes), int8 weight-only for the rest.
- `auto` (`MeasuredChoice`): for each (GGUF type, N x K) met while loading, every kernel
  that can hold the type is timed at 1, 4, 16 and 64 rows (cache-cold, best of 5); the
  kernel fastest overall runs every row count where it is within 10% of the fastest, and
  the fastest runs the others (a second kernel costs a second packed copy of the layer). Times are measured once per machine and kept in
  `<cache>/kernel-profile.json` under a key naming the CPU, torch version and thread
  count (delete the file to measure again); `profile()` returns them for cost models and
  benchmarks.

A layer called with T rows uses the plan of the measured row count nearest T on a log
scale (T = 2 -> 1, T = 3..7 -> 4, ...).

Must not know: models, modules, or the packed forward.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from specav.models.quant_formats import GGUFWeight, T
from specav.models.quant_kernels import KERNELS, Int4Weight, PackedWeight

ROW_BUCKETS = (1, 4, 16, 64)
_REPEATS = 5
_FLUSH_BYTES = 64 << 20  # larger than the last-level cache: timings see weights coming from memory


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """The kernel a layer uses at each measured row count (`rows` ascending)."""

    rows: tuple[int, ...]
    kernels: tuple[str, ...]

    def kernel_for(self, num_rows: int) -> str:
        distance = [abs(math.log(max(num_rows, 1)) - math.log(r)) for r in self.rows]
        return self.kernels[distance.index(min(distance))]

    @property
    def distinct(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.kernels))


class Policy(Protocol):
    def plan(self, weight: GGUFWeight) -> KernelPlan: ...


class FixedRule:
    """`q4`: int4 where the type is 4-bit (exact), int8 weight-only elsewhere; one kernel per layer."""

    def __init__(self, cache_path: Path | None = None) -> None:
        del cache_path  # nothing is measured

    def plan(self, weight: GGUFWeight) -> KernelPlan:
        kernel = "int4" if Int4Weight.supports(weight.qtype) else "int8"
        return KernelPlan((1,), (kernel,))


class MeasuredChoice:
    """`auto`: the fastest kernel per (type, shape, row count), measured once and cached on disk."""

    def __init__(self, cache_path: Path | None, candidates: tuple[str, ...] = tuple(KERNELS)) -> None:
        self.cache_path = cache_path
        self.candidates = candidates
        self.machine = machine_key()
        self._times = _read_profile(cache_path).get(self.machine, {}) if cache_path else {}

    def plan(self, weight: GGUFWeight) -> KernelPlan:
        return plan_from_times(self.times(weight))

    def times(self, weight: GGUFWeight) -> dict[str, list[float]]:
        key = profile_key(weight)
        usable = [k for k in self.candidates if KERNELS[k].supports(weight.qtype)]
        times = self._times.get(key, {})
        if not all(k in times for k in usable):
            times = {k: measure(KERNELS[k].pack(weight)) for k in usable}
            self._times[key] = times
            if self.cache_path is not None:
                _write_profile(self.cache_path, self.machine, self._times)
        return {k: times[k] for k in usable}

    def profile(self) -> dict[str, dict[str, list[float]]]:
        """Milliseconds per call: {"Q4_K 8960x1536": {"int4": [ms at 1, 4, 16, 64 rows], ...}}."""
        return dict(self._times)


POLICIES = {"q4": FixedRule, "auto": MeasuredChoice}
SECOND_KERNEL_GAIN = 1.10  # a row count gets its own kernel only if that is >10% faster than the main one


def plan_from_times(times: dict[str, list[float]]) -> KernelPlan:
    """The fastest kernel per row bucket, preferring one main kernel (one packed copy) within 10%.

    times: kernel -> milliseconds at each of ROW_BUCKETS. The main kernel is the one with the
    smallest sum of times relative to the fastest at each bucket.
    """
    buckets = range(len(ROW_BUCKETS))
    fastest = [min(t[i] for t in times.values()) for i in buckets]
    main = min(times, key=lambda k: sum(times[k][i] / fastest[i] for i in buckets))
    kernels = [main if times[main][i] <= SECOND_KERNEL_GAIN * fastest[i]
               else min(times, key=lambda k: times[k][i]) for i in buckets]
    return KernelPlan(ROW_BUCKETS, tuple(kernels))
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def dense_auto_dtype() -> str:
    """`auto` for a dense (non-GGUF) checkpoint: bf16 only where the CPU multiplies bf16 natively.

    Measured on an AVX2-only EPYC (one 8960 x 1536 layer, 1 thread): bf16 emulated costs
    2.7 / 10.5 / 58 ms at 1 / 4 / 16 rows against 2.6 / 7.9 / 18 ms for float32.
    """
    flags = _cpu_field("flags").split()
    return "bf16" if any(f in flags for f in _NATIVE_BF16_FLAGS) else "fp32"


def profile_key(weight: GGUFWeight) -> str:
    n, k = weight.shape
    return f"{weight.qtype.name} {n}x{k}"


def machine_key() -> str:
    return (f"{_cpu_name()} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"threads {torch.get_num_threads()}")


def measure(packed: PackedWeight, rows: tuple[int, ...] = ROW_BUCKETS) -> list[float]:
    """Best-of-5 milliseconds of one matmul at each row count, with the caches flushed first."""
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(_FLUSH_BYTES // 4) if packed.nbytes < _FLUSH_BYTES else None
    result = []
    for num_rows in rows:
        x = torch.randn(num_rows, packed.shape[1], generator=gen)  # [T, K]
        packed.matmul(x)  # warm-up (first-call allocations)
        best = math.inf
        for _ in range(_REPEATS):
            if flush is not None:
                flush.add_(1.0)  # evicts the weight from the caches
            start = time.perf_counter()
            packed.matmul(x)
            best = min(best, time.perf_counter() - start)
        result.append(round(best * 1e3, 4))
    return result


def _cpu_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_name() -> str:
    return _cpu_field("model name") or "unknown cpu"


def _read_profile(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_profile(path: Path, machine: str, times: dict) -> None:
    data = _read_profile(path)
    data[machine] = times
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
