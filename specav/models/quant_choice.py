"""Kernel choice: which quantized kernel runs each linear layer at each packed row count.

Owns: the precision policies behind `--dtype q4` and `--dtype auto`, and the measured
kernel profile that `auto` chooses from.

- `q4` (`FixedRule`): the closest kernel to the file's own weights, whatever the speed:
  int4 for the 4-bit types (exact codes), int8 weight-only for the rest.
- `auto` (`MeasuredChoice`), for a target: for each (GGUF type, N x K) of the file, every
  kernel that can hold the type is timed at 1, 4, 16 and 64 rows (cache-cold, one thread, the
  kernels taking turns, best of 7 taken in two passes over the row counts), before the layers
  are built, with a progress bar on stderr (none when every shape is cached). The kernel
  fastest overall runs every row count, except that one second kernel may take the row
  counts where it is more than 10% faster (a second kernel costs a second packed copy of the
  layer; docs/quantized.md gives the memory). Times are measured once per machine and kept
  in `<cache>/kernel-profile.json` under a key naming the CPU, the torch version and the
  native kernels' build (variant and source hash; delete the file to measure again);
  `profile()` returns them.
- `auto` for a drafter (`NativeDrafter`, where the native kernels run): every layer on a native
  kernel of the whole-layer call (kquant or kquant_x8, the faster at one and four rows, measured
  and kept as the target's are), int8dyn beyond 8 rows, the file's Q5_0 / Q8_0 weights
  requantised to Q4_K at load (drafter precision never touches losslessness).

Why one thread: on a shared 2-core machine, a 2-thread kernel call of about a millisecond
waits for a descheduled thread most of the time, so 2-thread timings come out as
multiples of the scheduler's time slice (4 or 8 ms) whatever the kernel. One thread ranks
the kernels reproducibly; the times are per-core costs, not the forward's wall time.

A layer called with T rows uses the plan of the measured row count nearest T on a log
scale (T = 2 -> 1, T = 3..7 -> 4, ...). Every kernel is batch-invariant, so a layer with
one kernel gives a row the same result whatever else is packed with it; a layer whose
plan switches kernels (auto, where a second kernel pays) gives slightly different numbers
at different packed row counts. q4 has one kernel per layer.

Must not know: models, modules, or the packed forward.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import gguf
import numpy as np
import torch
from tqdm import tqdm

from specav.models import native
from specav.models.cache import atomic_write, write_error
from specav.models.native.probe import cpu_model
from specav.models.quant_formats import GGUFWeight, requantize_q4_k
from specav.models.quant_kernels import KERNELS, Int4Weight, KQuantWeight, PackedWeight

ROW_BUCKETS = (1, 4, 16, 64)
_PASSES = (4, 3)  # repeats per pass: 7 samples of each (kernel, rows), in two bursts seconds apart
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
    def convert(self, weight: GGUFWeight) -> GGUFWeight:
        """The weight as the plan's kernels take it (itself, unless the policy requantises)."""
        ...

    def plan(self, weight: GGUFWeight, head: bool = False) -> KernelPlan:
        """head: the output head, whose rows per call are the logits rows (the layers': every token)."""
        ...


class FixedRule:
    """`q4`: int4 where the type is 4-bit (exact), int8 weight-only elsewhere; one kernel per layer."""

    def __init__(self, cache_path: Path | None = None) -> None:
        del cache_path  # nothing is measured

    def convert(self, weight: GGUFWeight) -> GGUFWeight:
        return weight

    def plan(self, weight: GGUFWeight, head: bool = False) -> KernelPlan:
        kernel = "int4" if Int4Weight.supports(weight.qtype) else "int8"
        return KernelPlan((1,), (kernel,))


DRAFTER_NATIVE_ROWS = 8  # a drafter's layers run the native kernels up to this many rows, int8dyn beyond
DRAFTER_KERNELS = ("kquant", "kquant_x8")  # the whole-layer call's: the faster runs a drafter's layer (NativeDrafter)


REQUANTIZED_DIR = "requantized"  # under the cache root: drafter weights requantised to Q4_K (NativeDrafter)


def requantized_digest(weight: GGUFWeight) -> str:
    """Names a requantised weight by what made it: the source type and shape, and the stored blocks
    themselves (a changed file cannot be served a stale weight); the native build that made it (its
    quantiser) names the directory it is kept in."""
    h = hashlib.blake2b(f"{weight.qtype.name} | {weight.shape}".encode(), digest_size=20)
    h.update(np.ascontiguousarray(weight.blocks).data)
    return h.hexdigest()


def _remove_other_builds(directory: Path) -> None:
    """Remove the requantised weights of other native builds beside `directory` (each build's set is
    the size of a drafter: kept, every rebuild would add one). A process of another build that
    still reads its set requantises what it then misses."""
    for other in directory.parent.iterdir():
        if other != directory and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)


class NativeDrafter:
    """`auto` for a drafter: the native kernel (kquant_x8 or kquant) for the head and for every layer up to
    DRAFTER_NATIVE_ROWS rows (drafting: one row per drafting request), its Q5_0 / Q8_0 (and any
    other non-k-quant) weights requantised to Q4_K at load; fbgemm's int8dyn for the layers beyond
    (the prefill of a prompt, the catch-up of a request that resumes drafting: on kquant alone the
    drafter's 393-token prefill at batch 8 took 0.87x the target's). Drafter precision never
    touches losslessness (the rejection sampler uses whatever q the drafter produced); what it
    costs in acceptance is measured in docs/quantized.md. Needs the native kernels."""

    def __init__(self, cache_path: Path | None = None) -> None:
        # Nothing is measured (one kernel runs everything), but requantising is most of a drafter's
        # load (10 of 18 s for the packaged one on the AMD EPYC), so its results are kept beside the
        # kernel profile, one file per weight named by a digest of what it was made from.
        self.cache_dir = None if cache_path is None else Path(cache_path).parent / REQUANTIZED_DIR / native.build_key()
        self._pruned = False  # other builds' sets are removed at this policy's first write
        self._warned = False  # a cache that cannot be written is said once
        self._choice = MeasuredChoice(cache_path, candidates=DRAFTER_KERNELS)  # kept beside the target's times

    def convert(self, weight: GGUFWeight) -> GGUFWeight:
        if weight.qtype in KQuantWeight.exact_types and weight.shape[1] % 256 == 0:
            return weight  # runs as stored
        if self.cache_dir is None:
            return requantize_q4_k(weight, native.ops().quantize_q4_k)
        path = self.cache_dir / f"{requantized_digest(weight)}.npy"
        try:
            blocks = np.load(path)
            if blocks.dtype == np.uint8 and blocks.shape == (weight.shape[0], -(-weight.shape[1] // 256) * 144):
                return GGUFWeight(weight.name, gguf.GGMLQuantizationType.Q4_K, weight.shape, blocks)
        except (OSError, ValueError, EOFError):
            pass  # not kept yet, or unreadable: requantised and written again
        q4k = requantize_q4_k(weight, native.ops().quantize_q4_k)
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            if not self._pruned:
                _remove_other_builds(self.cache_dir)
                self._pruned = True
            atomic_write(path, lambda f: np.save(f, q4k.blocks))
        except OSError as e:  # a cache that cannot keep it costs the next load this requantisation, nothing more
            if not self._warned:
                warnings.warn(f"{write_error(e, self.cache_dir, 'requantised drafter weights')}; "
                              "the drafter is requantised at every load", stacklevel=2)
                self._warned = True
        return q4k

    def plan(self, weight: GGUFWeight, head: bool = False) -> KernelPlan:
        """The faster of the whole-layer call's kernels (DRAFTER_KERNELS) at the drafter's row counts,
        one and four rows of the profile's, summed relative to the faster at each; int8dyn beyond
        DRAFTER_NATIVE_ROWS. Measured once per machine and shape (one thread, as the target's), as
        the AVX-512 build of kquant_x8 ran the drafter's forward 1.01x kquant's time at one row
        and 0.87x / 0.83x / 0.76x at 2 / 4 / 8 rows on the Zen 4 EPYC (docs/quantized.md), where
        the AVX2 build ran q/o-sized shapes 1.3x slower than kquant at one row."""
        times = self._choice.times(weight)
        cost = relative_cost(times, (0, 1))
        kernel = min(times, key=lambda k: cost([k, k]))
        if head:
            return KernelPlan((1,), (kernel,))
        return KernelPlan((1, DRAFTER_NATIVE_ROWS ** 2), (kernel, "int8dyn"))  # nearest in log rows


class MeasuredChoice:
    """`auto`: the fastest kernel per (type, shape, row count), measured once and cached on disk."""

    def __init__(self, cache_path: Path | None, candidates: tuple[str, ...] = tuple(KERNELS)) -> None:
        self.cache_path = cache_path
        self.candidates = candidates
        self.machine = machine_key()
        self._times = _read_profile(cache_path).get(self.machine, {}) if cache_path else {}

    def convert(self, weight: GGUFWeight) -> GGUFWeight:
        return weight

    def plan(self, weight: GGUFWeight, head: bool = False) -> KernelPlan:
        return plan_from_times(self.times(weight))

    def measure_missing(self, weights: dict[str, tuple[gguf.GGMLQuantizationType, Callable[[], GGUFWeight]]]) -> None:
        """Time every shape the profile lacks, with a progress bar on stderr (none when all are
        cached). weights: profile key -> (its GGUF type, a function reading one weight of it)."""
        missing = {key: read for key, (qtype, read) in weights.items() if not self._measured(key, qtype)}
        for key in tqdm(missing, desc="specav: timing the kernels of each layer shape (once per machine)",
                        unit="shape", file=sys.stderr, disable=not missing):
            self.times(missing[key]())

    def _measured(self, key: str, qtype: gguf.GGMLQuantizationType) -> bool:
        times = self._times.get(key, {})
        return all(k in times for k in self._usable(qtype, shape_of(key)))

    def _usable(self, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> list[str]:
        return [k for k in self.candidates if KERNELS[k].fits(qtype, shape)]

    def times(self, weight: GGUFWeight) -> dict[str, list[float]]:
        key = profile_key(weight)
        usable = self._usable(weight.qtype, weight.shape)
        times = self._times.get(key, {})
        if not self._measured(key, weight.qtype):
            times = measure({k: KERNELS[k].pack(weight) for k in usable})
            self._times[key] = times
            if self.cache_path is not None:
                _write_profile(self.cache_path, self.machine, self._times)
        return {k: times[k] for k in usable}

    def profile(self) -> dict[str, dict[str, list[float]]]:
        """Milliseconds per call: {"Q4_K 8960x1536": {"int4": [ms at 1, 4, 16, 64 rows], ...}}."""
        return dict(self._times)


POLICIES = {"q4": FixedRule, "auto": MeasuredChoice}


def policy_for(mode: str, role: str, cache_path: Path | None) -> Policy:
    """The policy of `mode` for a model of `role` ("target" or "drafter")."""
    if mode == "auto" and role == "drafter" and native.available():
        return NativeDrafter(cache_path)
    return POLICIES[mode](cache_path)
SECOND_KERNEL_GAIN = 1.1  # a second kernel takes a row count only where it is >10% faster
ONE_ROW_KQUANT_WITHIN = 1.5  # at one row, kquant (or kquant_x8) runs where within this factor of the fastest


def relative_cost(times: dict[str, list[float]], buckets) -> Callable[[list[str]], float]:
    """The cost of running kernels[j] at row bucket buckets[j] (indices into the times' lists): each
    kernel's time relative to the fastest kernel's at that bucket, summed."""
    fastest = {i: min(t[i] for t in times.values()) for i in buckets}
    return lambda kernels: sum(times[k][i] / fastest[i] for k, i in zip(kernels, buckets))


def plan_from_times(times: dict[str, list[float]]) -> KernelPlan:
    """At most two kernels: the main one (smallest total of times relative to the fastest at
    each row count) and the one second kernel that lowers that total most.

    At one row (decoding, drafting) a kernel of the whole-layer call (kquant or kquant_x8, the
    faster of them) runs wherever it is within ONE_ROW_KQUANT_WITHIN of the fastest kernel and no
    third kernel would be kept for it: where all seven linears of a layer run these, the layer is
    one native call (layer_ops.py, native/decoder.cpp), a saving per layer that the per-shape
    timings do not see (on the AVX2 EPYC, whose one-thread timings put kquant within 1-21% of
    int8dyn at one row on the MLP shapes, the target's one-row forward took 0.59-0.67x the time it
    took with the per-shape choice; docs/quantized.md).

    times: kernel -> milliseconds at each of ROW_BUCKETS.
    """
    buckets = range(len(ROW_BUCKETS))
    cost = relative_cost(times, buckets)
    main = min(times, key=lambda k: cost([k] * len(ROW_BUCKETS)))
    plans = [[main] * len(ROW_BUCKETS)] + [
        [alt if times[main][i] > SECOND_KERNEL_GAIN * times[alt][i] else main for i in buckets]
        for alt in times if alt != main]
    kernels = min(plans, key=cost)
    whole_layer = [k for k in times if issubclass(KERNELS[k], KQuantWeight)]  # what KQuantLayer takes
    if whole_layer and kernels[0] not in whole_layer:
        one_row = min(whole_layer, key=lambda k: times[k][0])
        within = times[one_row][0] <= ONE_ROW_KQUANT_WITHIN * min(t[0] for t in times.values())
        if within and len({*kernels, one_row}) <= 2:
            kernels = [one_row, *kernels[1:]]
    return KernelPlan(ROW_BUCKETS, tuple(kernels))


def profile_key(weight: GGUFWeight) -> str:
    return shape_key(weight.qtype, weight.shape)


def shape_key(qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> str:
    """The profile's key of a weight of type `qtype` and (N, K) `shape`: "Q4_K 8960x1536"."""
    return f"{qtype.name} {shape[0]}x{shape[1]}"


def shape_of(key: str) -> tuple[int, int]:
    """(N, K) of a profile key ("Q4_K 8960x1536" -> (8960, 1536))."""
    n, k = key.split()[-1].split("x")
    return int(n), int(k)


def machine_key() -> str:
    """CPU, torch and native-kernel build: timings taken with another kernel build are not reused."""
    return (f"{cpu_model()} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"kquant {native.build_key()} | 1 thread")


def measure(candidates: dict[str, PackedWeight], rows: tuple[int, ...] = ROW_BUCKETS) -> dict[str, list[float]]:
    """Milliseconds of one matmul per kernel at each row count: one thread, caches flushed before
    each call, the kernels taking turns (so a burst of load elsewhere hits them alike), best of 7.

    The 7 samples are taken in two passes over all row counts, so a burst of memory traffic from
    another process, which slows the memory-bound kernels more than the others, has to last the
    whole measurement of a shape to change its ranking."""
    shape = next(iter(candidates.values())).shape
    gen = torch.Generator().manual_seed(0)
    small = max(p.nbytes for p in candidates.values()) < _FLUSH_BYTES
    flush = torch.zeros(_FLUSH_BYTES // 4) if small else None
    inputs = [torch.randn(num_rows, shape[1], generator=gen) for num_rows in rows]  # [T, K] each
    best = {k: [math.inf] * len(rows) for k in candidates}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x in inputs:
            for packed in candidates.values():
                packed.matmul(x)  # warm-up (first-call allocations)
        for repeats in _PASSES:
            for i, x in enumerate(inputs):
                for _ in range(repeats):
                    for name, packed in candidates.items():
                        if flush is not None:
                            flush.add_(1.0)  # evicts the weight from the caches
                        start = time.perf_counter()
                        packed.matmul(x)
                        best[name][i] = min(best[name][i], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return {k: [round(t * 1e3, 4) for t in v] for k, v in best.items()}



def _read_profile(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_profile(path: Path, machine: str, times: dict) -> None:
    data = _read_profile(path)
    data[machine] = times
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(data, indent=1, sort_keys=True)
        atomic_write(path, lambda f: f.write(text.encode()))
    except OSError as e:  # a read-only or full cache: the times still serve this run
        print(f"specav: could not keep the kernel profile in {path} ({e.strerror or e}); set SPECAV_CACHE to a "
              f"writable directory, or the kernels are timed again next run", file=sys.stderr)
