"""Benchmark: the native kernels' variants, the packed forward's verify cost, the drafter against the
target, and the one-row forward's slowdown with a busy process on one core, all in one run.

    python -m specav.bench.native [--threads 2] [--repeats 7] [--skip kernels,forward,schedule,drafter,layers,contention]

Printed (every figure a ratio of times measured in this run, in turns, on this machine; each
section ends with how many cores other processes kept busy meanwhile, bench/load.py):

- kernels: each native variant this machine runs (native/variants.py), on one real tensor of every
  linear shape of the packaged target, kquant and on Q4_K kquant_x8 ("<variant> x8", the interleaved
  layout), one thread, cache-cold, best of --repeats: ms at 1, 5 and 16
  rows, and 5 and 16 rows relative to 1; beside them the floor of those ratios at the variant's
  arithmetic rate (its dot products on register operands, native int8_peak): n rows cost at least
  n times the multiply-adds at that rate, however well the one pass over the weights is shared;
- forward: the packaged target in `auto` (the variant the probe chose), 1, 5 and 16 new tokens on a
  128-token context with logits for every new token (verification), --threads threads, median of
  --repeats, and the 5- and 16-row forwards relative to the one-row forward (goals: <= 1.3x and
  <= 2x), beside the floor of those ratios at the variant's arithmetic rate on --threads threads at
  once (their multiply-adds in the linears at that rate, against this run's one-row forward); and
  the one-row forward against the time its weights take to read at the machine's read rate on
  --threads threads (torch's amax over 512 MiB, in turns with the forward, medians of 10 x
  --repeats): the floor of a decoding step;
- schedule: the k-quant kernel under each schedule (native/schedule.py), as the schedule's own
  measurement times it (ms per call, one thread, cache-cold), and the same forwards as above, the
  schedules in turns; which one this machine runs;
- drafter: the packaged drafter's one-row forward in `auto` (every layer native) relative to the
  target's (goal <= 0.25x), with its full output head (151,936 rows) and with the packaged default's
  vocabulary-subset head (`draft_vocab_size`), the three forwards in turns; the bytes of weights
  each one-row forward reads (what bounds a forward that streams its weights from memory), and the
  drafter's forward with the zero halves of its K = 896 weights' last blocks read as well as left
  out (quant_kernels.KQuantWeight), forward by forward in turns;
- layers: both models' one-row forward with each layer as one native call where its linears all run
  kquant (layer_ops.NativeLayerOps.whole_layer, native/decoder.cpp) and op by op, in turns, and how
  many layers ran as one call;
- contention: the target's one-row forward with a busy process (`while True: pass`) pinned to the
  last core, relative to the quiet --threads-thread forward: with fixed thread counts and with the
  model's own policy (threads.ThreadChoice), forward by forward in turns, each by its mean time; the
  busy process is stopped before the program ends (goal: slowdown <= 2x).

Row counts, models and schedules are measured in rounds (every one of them once a round), so
that drift within the run, 10-30% within seconds on these VMs, falls on all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator
from unittest import mock

import gguf
import torch
from torch import nn

from specav.bench.load import foreign_load
from specav.bench.quantized import time_forward
from specav.config import PACKAGED_SPECULATIVE
from specav.models import load_checkpoint, native, packaged
from specav.models.layer_ops import NativeLayerOps
from specav.models.native import schedule
from specav.models.native.probe import cpu_model
from specav.models.native.variants import VARIANTS
from specav.models.quant import QuantizedLinear, quantized_nbytes
from specav.models.quant_gguf import read_header
from specav.models.quant_kernels import KQuantWeight, KQuantX8Weight
from specav.models.threads import ThreadChoice
from specav.models.vocab_ranking import load_ranking
from specav.models.vocab_subset import set_head, subset_head

KERNEL_ROWS = (1, 5, 16)
FORWARD_ROWS = (1, 5, 16)
SCHEDULE_ROWS = (1, 2, 5, 16)  # 2: one drafted slot, where kquant runs every layer
CONTEXT = 128
PEAK_ITERATIONS = 2_000_000  # int8_peak: 768 M multiply-adds, tens of ms
READ_BYTES, READ_WARMUP = 512 << 20, 5  # read_pass's tensor and its passes before it is timed
_FLUSH = torch.zeros(64 << 18)  # 64 MiB, past the last-level cache


def kernel_table(repeats: int) -> None:
    header = read_header(packaged.assembled_gguf(packaged.TARGET))
    shapes = {}
    for info in header.tensors.values():
        if len(info.dims) == 2 and info.name != "token_embd.weight" and info.qtype.name in ("Q4_K", "Q6_K"):
            shapes.setdefault(f"{info.qtype.name} {info.dims[1]}x{info.dims[0]}", info.name)
    usable = {}
    for v in VARIANTS:
        try:
            usable[v.name] = native.variant_ops(v.name)
        except native.VariantUnavailable as err:
            print(f"  {v.name}: not run ({err})")
    print(f"\nkernels: ms per call at {KERNEL_ROWS} rows (one thread, cache-cold, best of {repeats}); "
          f"5 and 16 rows relative to 1, and the least they could be at the variant's arithmetic rate")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with foreign_load() as load:
            peaks = {v: max(ops.int8_peak(PEAK_ITERATIONS, 1) for _ in range(repeats)) for v, ops in usable.items()}
            print("  arithmetic on register operands (int8_peak, one thread, best of "
                  f"{repeats}): " + ", ".join(f"{v} {p / 1e9:.1f} G multiply-adds/s" for v, p in peaks.items()))
            for key, name in sorted(shapes.items()):
                print(f"  {key:<18} {_kernel_row(header.weight(name), usable, peaks, repeats)}", flush=True)
    finally:
        torch.set_num_threads(threads)
    print(f"  ({load})")


def read_pass() -> Callable[[], float]:
    """A callable timing one read of READ_BYTES from memory on torch's threads (torch's amax over a
    float32 tensor past the last-level cache), after READ_WARMUP passes (the first passes over a new
    tensor read 30% slower on the Zen 4 EPYC): the rate a forward that streams its weights from
    memory can reach at most. Timed in turns with the forward: this VM's read rate swings from 25
    to 54 GB/s within a minute on two threads."""
    x = torch.ones(READ_BYTES // 4)
    for _ in range(READ_WARMUP):
        x.amax()
    return lambda: _timed(x.amax)


def arithmetic_floor(one_row_seconds: float, rows: int, multiply_adds: int, peak: float) -> float:
    """The least `rows` rows can cost relative to one: each row's multiply-adds at the variant's peak
    rate, overlapped perfectly with the one-row call's time (its pass over the weights)."""
    return max(1.0, rows * multiply_adds / peak / one_row_seconds)


def _kernel_row(weight, usable: dict, peaks: dict, repeats: int) -> str:
    """kquant in each variant, and on Q4_K kquant_x8 (the interleaved layout) beside it."""
    packed = {v: KQuantWeight.pack(weight, ops=ops) for v, ops in usable.items()}
    if KQuantX8Weight.fits(weight.qtype, weight.shape):
        packed |= {f"{v} x8": KQuantX8Weight.pack(weight, ops=ops) for v, ops in usable.items()}
    peaks = peaks | {f"{v} x8": p for v, p in peaks.items()}
    xs = [torch.randn(r, weight.shape[1], generator=torch.Generator().manual_seed(r)) for r in KERNEL_ROWS]
    best = {v: [float("inf")] * len(xs) for v in packed}
    for _ in range(repeats):
        for i, x in enumerate(xs):
            for v, p in packed.items():
                _FLUSH.add_(1.0)
                start = time.perf_counter()
                p.matmul(x)
                best[v][i] = min(best[v][i], time.perf_counter() - start)
    macs = weight.shape[0] * weight.shape[1]
    return "  ".join(f"{v} {'/'.join(f'{t * 1e3:.2f}' for t in ts)} ({ts[1] / ts[0]:.2f}x, {ts[2] / ts[0]:.2f}x; "
                     f"floor {arithmetic_floor(ts[0], 5, macs, peaks[v]):.2f}x, "
                     f"{arithmetic_floor(ts[0], 16, macs, peaks[v]):.2f}x)"
                     for v, ts in best.items())


def forwards(models: dict, rows: tuple[int, ...], repeats: int) -> dict[str, dict[int, float]]:
    """Median seconds per forward of each model at each row count, measured in turns."""
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).vocab_size
    context = torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist()
    caches = {name: m.new_cache(CONTEXT + max(rows)) for name, m in models.items()}
    for name, m in models.items():
        m.forward([context], [caches[name]], [0])
    times = {name: {n: [] for n in rows} for name in models}
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())  # the models' policy tries each count first
    news = {n: torch.randint(0, vocab, (n,), generator=gen).tolist() for n in rows}
    for _ in range(repeats + warmup):  # rounds of every (row count, model): the VM's drift falls on all alike
        for n, new in news.items():
            for name, m in models.items():
                times[name][n].append(time_forward(m, caches[name], new))
    return {name: {n: statistics.median(t[warmup:]) for n, t in per.items()} for name, per in times.items()}


class HalfBlockLayouts:
    """A model's Q4_K weights that end in half a block, packed (the zero half left out: KQuantWeight,
    KQuantX8Weight) or with that half restored (zeros, read for nothing): `use` puts either in place, each layout
    with its own whole-layer calls (KQuantLayer's memo of them)."""

    def __init__(self, model) -> None:
        self.weights = [p for m in model.hf_model.modules() for p in getattr(m, "packed", {}).values()
                        if isinstance(p, KQuantWeight) and p.ends_in_half_block]
        self._layers = [m.kquant for m in model.hf_model.modules() if getattr(m, "kquant", None) is not None]
        self._layouts = {
            "trimmed": ([p.blocks for p in self.weights], [{} for _ in self._layers]),
            "whole": ([p.whole_blocks() for p in self.weights],
                      [{} for _ in self._layers])}

    def use(self, layout: str) -> None:
        blocks, memos = self._layouts[layout]
        for p, b in zip(self.weights, blocks):
            p.blocks = b
        for layer, memo in zip(self._layers, memos):
            layer._by_rows = memo


def in_turns(settings: dict[str, Callable[[], float]], forwards: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each setting's forward (each callable puts its setting in place and returns
    the seconds of one forward), the settings taking turns forward by forward, their order reversed
    every other turn; the first `warmup` turns (each setting's calls made) left out."""
    names = list(settings)
    times = {name: [] for name in names}
    for i in range(forwards + warmup):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(settings[name]())
    return {name: statistics.median(t[warmup:]) for name, t in times.items()}


def one_row(model) -> Callable[[], float]:
    """A callable timing `model`'s one-row forward on a CONTEXT-token context of its own."""
    context = torch.randint(0, model.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache(CONTEXT + 1)
    model.forward([context], [cache], [0])
    return lambda: time_forward(model, cache, context[-1:])


def half_blocks(model, forwards: int) -> tuple[float, float]:
    """Median seconds of `model`'s one-row forward with its half blocks' zero halves left out and
    read (HalfBlockLayouts), the two alternating forward by forward; left out afterwards."""
    layouts = HalfBlockLayouts(model)
    forward = one_row(model)

    def timed(layout: str) -> Callable[[], float]:
        return lambda: (layouts.use(layout), forward())[1]

    try:
        t = in_turns({layout: timed(layout) for layout in ("trimmed", "whole")}, forwards)
    finally:
        layouts.use("trimmed")
    return t["trimmed"], t["whole"]


def one_row_bytes(model) -> int:
    """Bytes of weights a one-row forward reads: the model's weights (quant.quantized_nbytes) less the
    embedding (a row of it is read) and each linear's packings for other row counts than one."""
    other_packings = sum(p.nbytes for m in model.hf_model.modules() if isinstance(m, QuantizedLinear)
                         for p in m.packed.values() if p is not m.packed_for(1))
    return quantized_nbytes(model) - model.hf_model.get_input_embeddings().nbytes - other_packings


def multiply_adds(model) -> int:
    """Multiply-adds of one row through the model's quantized linears (attention left out)."""
    return sum(m.in_features * m.out_features for m in model.hf_model.modules() if isinstance(m, QuantizedLinear))


def drafter_heads(target, drafter, size: int, forwards: int) -> tuple[dict[str, float], dict[str, int]]:
    """The target's one-row forward and the drafter's (a Checkpoint) with its full head and with a
    head over its `size` most frequent tokens (vocab_subset), in turns: median seconds and the bytes
    of weights each reads (one_row_bytes). The drafter keeps its full head afterwards."""
    model = drafter.model
    full = model.lm_head
    sub = subset_head(full, load_ranking(drafter.tokenizer).top(size, model.vocab_size), model.vocab_size,
                      drafter.gguf_path)
    sizes = {"target": one_row_bytes(target)}
    for name, head in (("full head", full), ("subset head", sub)):
        set_head(model, head)
        sizes[name] = one_row_bytes(model)
    target_forward, drafter_forward = one_row(target), one_row(model)

    def timed(head: nn.Module) -> Callable[[], float]:
        return lambda: (set_head(model, head), drafter_forward())[1]

    try:
        times = in_turns({"target": target_forward, "full head": timed(full), "subset head": timed(sub)}, forwards)
    finally:
        set_head(model, full)
    return times, sizes


def schedule_table(target, repeats: int) -> None:
    """The kernel and the target's packed forwards under each schedule, in turns (the chosen one
    restored)."""
    ops = native.ops()
    chosen = ops.set_schedule(-1)
    kernel = schedule.measure(ops, repeats)
    cases = [f"{gguf.GGMLQuantizationType(q).name} {n}x{k}, {r} rows" for q, n, k in schedule.SHAPES
             for r in schedule.ROWS]
    print(f"\nschedule: the k-quant kernel, ms per call (one thread, cache-cold, median of {repeats}, the schedules "
          f"in turns); this machine runs schedule {chosen}")
    for s in schedule.SCHEDULES:
        print(f"  {s}: {schedule.describe(s)}")
    print(f"  {'':<28}" + "".join(f"{s:>9}" for s in schedule.SCHEDULES))
    for i, case in enumerate(cases):
        print(f"  {case:<28}" + "".join(f"{kernel[s][i] * 1e3:>9.3f}" for s in schedule.SCHEDULES))
    totals = schedule.relative(kernel, chosen)
    print(f"  {'total, relative to ' + str(chosen):<28}" + "".join(f"{totals[s]:>8.2f}x" for s in schedule.SCHEDULES))
    gen = torch.Generator().manual_seed(2)
    context = torch.randint(0, target.vocab_size, (CONTEXT,), generator=gen).tolist()
    cache = target.new_cache(CONTEXT + max(SCHEDULE_ROWS))
    target.forward([context], [cache], [0])
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())
    times = {s: {n: [] for n in SCHEDULE_ROWS} for s in schedule.SCHEDULES}
    news = {n: torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in SCHEDULE_ROWS}
    try:
        for _ in range(repeats + warmup):  # rounds of every (row count, schedule), as in forwards()
            for n, new in news.items():
                for s in schedule.SCHEDULES:
                    ops.set_schedule(s)
                    times[s][n].append(time_forward(target, cache, new))
    finally:
        ops.set_schedule(chosen)
    print(f"  packaged target in auto (its kernel plan as measured under schedule {chosen}), {CONTEXT}-token "
          f"context, ms (median of {repeats}, the schedules in turns)")
    for s, per in times.items():
        t = {n: statistics.median(v[warmup:]) for n, v in per.items()}
        print(f"  {s}  " + "  ".join(f"{n} rows {t[n] * 1e3:6.1f}" for n in SCHEDULE_ROWS)
              + "  ->  " + "  ".join(f"{n} rows {t[n] / t[1]:.2f}x" for n in SCHEDULE_ROWS[1:])
              + ("  (chosen)" if s == chosen else ""))


def layer_calls(models: dict, repeats: int) -> None:
    """One-row forwards with the layers in one native call (consecutive whole layers,
    decoder_layers_), one call per layer, and op by op, in turns."""
    gen = torch.Generator().manual_seed(1)
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())
    ways = {"one call": contextlib.nullcontext, "a call per layer": _call_per_layer, "op by op": _op_by_op}
    print(f"\nlayers: one-row forward, {CONTEXT}-token context, ms (median of {repeats}, in turns)")
    for name, m in models.items():
        context = torch.randint(0, m.vocab_size, (CONTEXT,), generator=gen).tolist()
        cache = m.new_cache(CONTEXT + 1)
        m.forward([context], [cache], [0])
        times = {way: [] for way in ways}
        for i in range(repeats + warmup):
            for way in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
                with ways[way]():
                    times[way].append(time_forward(m, cache, [int(context[i % CONTEXT])]))
        ms = {way: statistics.median(t[warmup:]) * 1e3 for way, t in times.items()}
        fused = sum(m.ops.whole_layer(layer, 1) is not None for layer in m.decoder.layers)
        print(f"  {name}: the layers in one call {ms['one call']:.1f}, a call per layer {ms['a call per layer']:.1f}, "
              f"op by op {ms['op by op']:.1f} ({ms['one call'] / ms['a call per layer']:.3f}x and "
              f"{ms['one call'] / ms['op by op']:.2f}x); {fused} of {len(m.decoder.layers)} layers run whole at one row")


def _op_by_op():
    """Every layer op by op (no whole-layer native call)."""
    return mock.patch.object(NativeLayerOps, "whole_layer", staticmethod(lambda layer, rows: None))


def _call_per_layer():
    """Each whole layer its own native call (decoder_layers_ of one layer), as before consecutive
    layers shared one."""
    run = NativeLayerOps.decoder_layers

    def per_layer(self, calls, h, x, *rest):
        for call in calls:
            x = run(self, [call], h, x, *rest)
        return x

    return mock.patch.object(NativeLayerOps, "decoder_layers", per_layer)


@contextmanager
def busy_core(core: int) -> Iterator[subprocess.Popen]:
    """A process spinning on `core` (taskset) for the duration; always stopped."""
    proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def contention(target, repeats: int, threads: int) -> None:
    """One-row forwards with fixed thread counts (no policy) and with a fresh ThreadChoice, quiet and
    then with a busy core (the policy carries what it learnt quietly into the busy part, as a server
    would when another process starts). The settings take turns forward by forward, so the VM's
    drift falls on all alike (the policy's state sees only its own forwards); each is summed up by
    its mean, the time a server spends, which for the policy includes its switch to the busy core
    and its exploring forwards, with the median beside it."""
    core = os.cpu_count() - 1
    policy = ThreadChoice()
    settings = {f"{n} threads": n for n in sorted({threads, 1}, reverse=True)} | {"ThreadChoice": None}
    rounds = 4 * repeats  # the policy's switch to a busy core (two forwards) and, at one row, an exploring forward
                          # every few seconds (threads.py: a share of its time)
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache(CONTEXT + 1)
    target.forward([torch.randint(0, target.vocab_size, (CONTEXT,), generator=gen).tolist()], [cache], [0])
    print(f"\ncontention: target one-row forward, ms over {rounds} forwards of each setting in turns (mean, and "
          f"median), quiet, then with a busy process pinned to core {core}")

    def forward(setting: int | None) -> float:
        target.threads = policy if setting is None else None
        torch.set_num_threads(threads if setting is None else setting)
        return time_forward(target, cache, [7])

    def run() -> dict[str, list[float]]:
        for setting in settings.values():  # warm-up
            forward(setting)
        per = {name: [] for name in settings}
        for _ in range(rounds):
            for name, setting in settings.items():
                per[name].append(forward(setting))
        return per

    saved = torch.get_num_threads()
    try:
        with foreign_load() as quiet_load:
            quiet = run()
        with busy_core(core) as busy_proc, foreign_load() as busy_load:
            busy = run()
    finally:
        target.threads = None
        torch.set_num_threads(saved)
    base = statistics.mean(quiet[f"{threads} threads"])
    for name in settings:
        q, b = quiet[name], busy[name]
        print(f"  {name:<14} quiet {statistics.mean(q) * 1e3:6.1f} ({statistics.median(q) * 1e3:5.1f}), busy core "
              f"{statistics.mean(b) * 1e3:6.1f} ({statistics.median(b) * 1e3:5.1f})  ->  "
              f"{statistics.mean(b) / base:.2f}x the quiet {threads}-thread forward")
    print(f"  (quiet part: {quiet_load}; busy part: {busy_load.cores:.2f} cores, the busy process's included)")
    del busy_proc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specav.bench.native", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(args.threads)
    variant = native.selected()
    print(f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads; native variant "
          f"{variant.name if variant else 'none'} ({native.ops().isa() if variant else native.unavailable_reason()})")
    if "kernels" not in skip:
        kernel_table(args.repeats)
    if skip >= {"forward", "schedule", "drafter", "layers", "contention"}:
        return
    target = load_checkpoint("default", "auto", role="target").model
    models = {"target": target}
    if "drafter" not in skip:
        drafter = load_checkpoint("default", "auto", role="drafter")
        models["drafter"] = drafter.model
    for m in models.values():  # fixed threads for the forward and drafter tables (contention has its own)
        m.threads = None
    if "forward" not in skip:
        with foreign_load() as load:
            t = forwards({"target": target}, FORWARD_ROWS, args.repeats)
        one = t["target"][1]
        print(f"\nforward: packaged target in auto, {CONTEXT}-token context, ms (median of {args.repeats})")
        print("  " + "  ".join(f"{n} rows {t['target'][n] * 1e3:.1f}" for n in FORWARD_ROWS)
              + "  ->  " + "  ".join(f"{n} rows {t['target'][n] / one:.2f}x" for n in FORWARD_ROWS[1:]))
        if native.selected() is not None:
            peak = max(native.ops().int8_peak(PEAK_ITERATIONS, args.threads) for _ in range(args.repeats))
            macs = multiply_adds(target)
            print(f"  the least they could be at the variant's arithmetic rate on {args.threads} threads at once "
                  f"({peak / 1e9:.1f} G multiply-adds/s, int8_peak; {macs / 1e9:.2f} G a row in the linears): "
                  + "  ".join(f"{n} rows {arithmetic_floor(one, n, macs, peak):.2f}x" for n in FORWARD_ROWS[1:]))
        with foreign_load() as read_load:
            t = in_turns({"forward": one_row(target), "read": read_pass()}, 10 * args.repeats)
        rate, weights = READ_BYTES / t["read"], one_row_bytes(target)
        print(f"  one row reads {weights / 1e6:.0f} MB of weights; in turns with the one-row forward "
              f"({t['forward'] * 1e3:.1f} ms, median of {10 * args.repeats}), the machine read {rate / 1e9:.1f} GB/s "
              f"on {args.threads} threads (read_pass, median), at which the weights take {weights / rate * 1e3:.1f} ms: "
              f"the forward took {t['forward'] * rate / weights:.2f}x that ({read_load})")
        print(f"  ({load})")
    if "drafter" in models:
        with foreign_load() as load:
            drafter_section(target, drafter, 10 * args.repeats)
        print(f"  ({load})")
    if "schedule" not in skip and native.selected() is not None:
        with foreign_load() as load:
            schedule_table(target, args.repeats)
        print(f"  ({load})")
    if "layers" not in skip:
        with foreign_load() as load:
            layer_calls(models, args.repeats)
        print(f"  ({load})")
    if "contention" not in skip:
        del models
        contention(target, args.repeats, args.threads)


def drafter_section(target, drafter, forwards: int) -> None:
    """The drafter's one-row forward against the target's, both heads, and its half blocks (main)."""
    size = PACKAGED_SPECULATIVE.draft_vocab_size
    t, sizes = drafter_heads(target, drafter, size, forwards)
    one, full, sub = t["target"], t["full head"], t["subset head"]
    head, x = drafter.model.lm_head, torch.randn(1, drafter.model.config.hidden_size)
    head_s = statistics.median(_timed(lambda: head(x)) for _ in range(forwards))
    print(f"\ndrafter: one-row forward, median of {forwards} each, in turns with the target's ({one * 1e3:.1f} ms):")
    print(f"  its full head ({head.out_features:,} rows) {full * 1e3:.1f} ms = {full / one:.2f}x the target's "
          f"(the head alone {head_s * 1e3:.1f} ms, {head_s / full:.0%} of it)")
    print(f"  the packaged default's {size:,}-token head (draft_vocab_size) {sub * 1e3:.1f} ms = {sub / one:.2f}x "
          f"the target's ({sub / full:.2f}x the full head's)")
    mb = {name: n / 1e6 for name, n in sizes.items()}
    print(f"  weights a one-row forward reads: target {mb['target']:.0f} MB; drafter {mb['full head']:.0f} MB "
          f"({sizes['full head'] / sizes['target']:.2f}x) with its full head, {mb['subset head']:.0f} MB "
          f"({sizes['subset head'] / sizes['target']:.2f}x) with the {size:,}-token head: where forwards stream "
          f"their weights from memory, what the drafter's can cost relative to the target's")
    trimmed, whole = half_blocks(drafter.model, forwards)
    print(f"  the last blocks' zero halves left out {trimmed * 1e3:.1f} ms, read {whole * 1e3:.1f} ms "
          f"({trimmed / whole:.3f}x; median of {forwards} forwards each, in turns)")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
