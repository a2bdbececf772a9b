"""Benchmark: the native kernels' variants, the packed forward's verify cost, the drafter against the
target, and the one-row forward's slowdown with a busy process on one core, all in one run.

    python -m specav.bench.native [--threads 2] [--repeats 7] [--skip kernels,forward,schedule,drafter,layers,contention]

Printed (every figure a ratio of times measured in this run, in turns, on this machine; each
section ends with how many cores other processes kept busy meanwhile, bench/load.py):

- kernels: each native variant this machine runs (native/variants.py), on one real tensor of every
  linear shape of the packaged target, one thread, cache-cold, best of --repeats: ms at 1, 5 and 16
  rows, and 5 and 16 rows relative to 1;
- forward: the packaged target in `auto` (the variant the probe chose), 1, 5 and 16 new tokens on a
  128-token context with logits for every new token (verification), --threads threads, median of
  --repeats, and the 5- and 16-row forwards relative to the one-row forward (goals: <= 1.3x and
  <= 2x);
- schedule: the k-quant kernel under each schedule (native/schedule.py), as the schedule's own
  measurement times it (ms per call, one thread, cache-cold), and the same forwards as above, the
  schedules in turns; which one this machine runs;
- drafter: the packaged drafter's one-row forward in `auto` (every layer native) relative to the
  target's (goal <= 0.25x), the share of its output head (151,936 rows), and its forward with the
  zero halves of its K = 896 weights' last blocks read as well as left out (quant_kernels.KQuantWeight),
  forward by forward in turns;
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
from typing import Iterator
from unittest import mock

import gguf
import torch

from specav.bench.load import foreign_load
from specav.bench.quantized import time_forward
from specav.models import load_checkpoint, native, packaged
from specav.models.layer_ops import NativeLayerOps
from specav.models.native import schedule
from specav.models.native.probe import cpu_model
from specav.models.native.variants import VARIANTS
from specav.models.quant_gguf import read_header
from specav.models.quant_kernels import KQuantWeight
from specav.models.threads import ThreadChoice

KERNEL_ROWS = (1, 5, 16)
FORWARD_ROWS = (1, 5, 16)
SCHEDULE_ROWS = (1, 2, 5, 16)  # 2: one drafted slot, where kquant runs every layer
CONTEXT = 128
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
          f"5 and 16 rows relative to 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with foreign_load() as load:
            for key, name in sorted(shapes.items()):
                print(f"  {key:<18} {_kernel_row(header.weight(name), usable, repeats)}", flush=True)
    finally:
        torch.set_num_threads(threads)
    print(f"  ({load})")


def _kernel_row(weight, usable: dict, repeats: int) -> str:
    packed = {v: KQuantWeight.pack(weight, ops=ops) for v, ops in usable.items()}
    xs = [torch.randn(r, weight.shape[1], generator=torch.Generator().manual_seed(r)) for r in KERNEL_ROWS]
    best = {v: [float("inf")] * len(xs) for v in packed}
    for _ in range(repeats):
        for i, x in enumerate(xs):
            for v, p in packed.items():
                _FLUSH.add_(1.0)
                start = time.perf_counter()
                p.matmul(x)
                best[v][i] = min(best[v][i], time.perf_counter() - start)
    return "  ".join(f"{v} {'/'.join(f'{t * 1e3:.2f}' for t in ts)} ({ts[1] / ts[0]:.2f}x, {ts[2] / ts[0]:.2f}x)"
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
    """A model's Q4_K weights that end in half a block, packed (the zero half left out: KQuantWeight)
    or with that half restored (zeros, read for nothing): `use` puts either in place, each layout
    with its own whole-layer calls (KQuantLayer's memo of them)."""

    def __init__(self, model) -> None:
        self.weights = [p for m in model.hf_model.modules() for p in getattr(m, "packed", {}).values()
                        if isinstance(p, KQuantWeight) and p.ends_in_half_block]
        self._layers = [m.kquant for m in model.hf_model.modules() if getattr(m, "kquant", None) is not None]
        self._layouts = {
            "trimmed": ([p.blocks for p in self.weights], [{} for _ in self._layers]),
            "whole": ([torch.cat([p.blocks, p.blocks.new_zeros(p.blocks.shape[0], KQuantWeight.HALF_BYTES)], 1)
                       for p in self.weights],
                      [{} for _ in self._layers])}

    def use(self, layout: str) -> None:
        blocks, memos = self._layouts[layout]
        for p, b in zip(self.weights, blocks):
            p.blocks = b
        for layer, memo in zip(self._layers, memos):
            layer._by_rows = memo


def half_blocks(model, forwards: int) -> tuple[float, float]:
    """Median seconds of `model`'s one-row forward with its half blocks' zero halves left out and
    read (HalfBlockLayouts), the two alternating forward by forward; left out afterwards."""
    layouts = HalfBlockLayouts(model)
    context = torch.randint(0, model.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache(CONTEXT + 1)
    model.forward([context], [cache], [0])
    times = {"trimmed": [], "whole": []}
    try:
        for i in range(forwards + 2):  # the first two of each: warm-up (each layout's calls made)
            for layout in ("trimmed", "whole") if i % 2 == 0 else ("whole", "trimmed"):
                layouts.use(layout)
                times[layout].append(time_forward(model, cache, context[-1:]))
    finally:
        layouts.use("trimmed")
    return statistics.median(times["trimmed"][2:]), statistics.median(times["whole"][2:])


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
    """One-row forwards with each layer as one native call and op by op, in turns."""
    gen = torch.Generator().manual_seed(1)
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())
    print(f"\nlayers: one-row forward, {CONTEXT}-token context, ms (median of {repeats}, in turns)")
    for name, m in models.items():
        context = torch.randint(0, m.vocab_size, (CONTEXT,), generator=gen).tolist()
        cache = m.new_cache(CONTEXT + 1)
        m.forward([context], [cache], [0])
        times = {"whole": [], "op by op": []}
        for i in range(repeats + warmup):
            for way in (("whole", "op by op") if i % 2 == 0 else ("op by op", "whole")):
                with _op_by_op() if way == "op by op" else contextlib.nullcontext():
                    times[way].append(time_forward(m, cache, [int(context[i % CONTEXT])]))
        whole, by_op = (statistics.median(t[warmup:]) for t in times.values())
        fused = sum(m.ops.whole_layer(layer, 1) is not None for layer in m.decoder.layers)
        print(f"  {name}: each layer one call {whole * 1e3:.1f}, op by op {by_op * 1e3:.1f} ({whole / by_op:.2f}x); "
              f"{fused} of {len(m.decoder.layers)} layers run as one call at one row")


def _op_by_op():
    """Every layer op by op (no whole-layer native call)."""
    return mock.patch.object(NativeLayerOps, "whole_layer", staticmethod(lambda layer, rows: None))


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
        models["drafter"] = load_checkpoint("default", "auto", role="drafter").model
    for m in models.values():  # fixed threads for the forward and drafter tables (contention has its own)
        m.threads = None
    if "forward" not in skip or "drafter" not in skip:
        with foreign_load() as load:
            t = forwards(models, FORWARD_ROWS if "forward" not in skip else (1,), args.repeats)
        if "forward" not in skip:
            one = t["target"][1]
            print(f"\nforward: packaged target in auto, {CONTEXT}-token context, ms (median of {args.repeats})")
            print("  " + "  ".join(f"{n} rows {t['target'][n] * 1e3:.1f}" for n in FORWARD_ROWS)
                  + "  ->  " + "  ".join(f"{n} rows {t['target'][n] / one:.2f}x" for n in FORWARD_ROWS[1:]))
        if "drafter" in models:
            head = models["drafter"].lm_head
            x = torch.randn(1, models["drafter"].config.hidden_size)
            head_s = statistics.median(_timed(lambda: head(x)) for _ in range(args.repeats))
            d = t["drafter"][1]
            print(f"\ndrafter: one-row forward {d * 1e3:.1f} ms = {d / t['target'][1]:.2f}x the target's "
                  f"{t['target'][1] * 1e3:.1f} ms; its output head alone {head_s * 1e3:.1f} ms ({head_s / d:.0%} of "
                  f"it; without it {(d - head_s) / t['target'][1]:.2f}x)")
            trimmed, whole = half_blocks(models["drafter"], 10 * args.repeats)
            print(f"  the last blocks' zero halves left out {trimmed * 1e3:.1f} ms, read {whole * 1e3:.1f} ms "
                  f"({trimmed / whole:.3f}x; median of {10 * args.repeats} forwards each, in turns)")
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


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
