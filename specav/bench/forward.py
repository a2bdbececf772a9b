"""Benchmark: loading the packaged pair, memory, and the packed forward against transformers'.

    python -m specav.bench.forward [--dtype bf16] [--context 200] [--repeats 5]

Prints load times, peak RSS with both models loaded, and the target's forward time for
1..64 new tokens on top of a 200-token context: specav's packed forward (one request) and
transformers' own forward at batch 1 with a DynamicCache, and their ratio, all in one run.
Logits are computed for every new token in both (what verification needs).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from specav.bench.optional import require
from specav.models import load_checkpoint

TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def time_packed(model, context: list[int], new: list[int], repeats: int) -> float:
    cache = model.new_cache(len(context) + len(new))
    model.forward([context], [cache], [0])
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model.forward([new], [cache], [len(new)])
        times.append(time.perf_counter() - start)
        cache.rollback(len(new))
    return statistics.median(times[1:])


@torch.inference_mode()
def time_transformers(hf, context: list[int], new: list[int], repeats: int) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    hf(torch.tensor([context]), cache=cache, use_cache=True)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        hf(torch.tensor([new]), cache=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        cache.crop(-len(new))
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    psutil = require("psutil", "specav bench forward")
    rss0 = psutil.Process().memory_info().rss / 2**30
    start = time.perf_counter()
    target = load_checkpoint("default", args.dtype, role="target")
    t_target = time.perf_counter() - start
    start = time.perf_counter()
    drafter = load_checkpoint("default", args.dtype, role="drafter")
    t_drafter = time.perf_counter() - start
    for m in (target.model, drafter.model):  # touch every weight page (safetensors are memory-mapped)
        m.forward([[1, 2, 3]], [m.new_cache()], [1])
    rss = psutil.Process().memory_info().rss / 2**30
    print(f"dtype {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"load time: target {t_target:.1f} s, drafter {t_drafter:.1f} s (from the converted cache)")
    print(f"RSS with both models loaded and run once: {rss:.2f} GiB (process start {rss0:.2f} GiB), "
          f"peak RSS so far {peak_rss_gib():.2f} GiB")
    del drafter

    gen = torch.Generator().manual_seed(0)
    vocab = target.model.vocab_size
    context = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    print(f"\ntarget forward, {args.context}-token context, logits for every new token (median of {args.repeats})")
    print(f"{'new tokens':>10} {'specav ms':>10} {'transformers ms':>16} {'specav/transformers':>20}")
    for n in TOKEN_COUNTS:
        new = torch.randint(0, vocab, (n,), generator=gen).tolist()
        ours = time_packed(target.model, context, new, args.repeats)
        theirs = time_transformers(target.model.hf_model, context, new, args.repeats)
        print(f"{n:>10} {ours * 1e3:>10.1f} {theirs * 1e3:>16.1f} {ours / theirs:>20.2f}")
    print(f"\npeak RSS of the run: {peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
