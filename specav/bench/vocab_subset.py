"""Benchmark: the drafter's vocabulary-subset head, what it saves in time and costs in acceptance.

    python -m specav.bench.vocab_subset [--sizes 8192,16384,32768,65536] [--parts timing,acceptance,engine]
                                        [--prompts 4] [--tokens 96] [--k 4] [--threads 2] [--dtype auto]

The packaged pair in --dtype; every N of --sizes (and the full head) on the same drafter, in
one run. Three parts (`timing` and `engine` measure time; `acceptance` does not):

- timing: the drafter's output head alone and its whole one-row forward on a 128-token
  context, per N, the heads taking turns (median of --repeats), as a ratio to the full head;
  and the target's one-row forward, so the drafter's cost reads as a fraction of it.
- acceptance (teacher-forced, paired): the target samples a continuation of each prompt
  (temperature 0.7, top-k 20, top-p 0.8, seeded); at every position of it, p from the target
  and q_N from the drafter (its full logits with -inf outside the N-token subset, which equals
  the subset head's output: tests/test_vocab_subset.py), both after the same sampling
  transforms; rows "N id" take the N lowest token ids instead of the shipped ranking (a BPE
  vocabulary's ids follow its merge order, itself a frequency ranking of the tokenizer's corpus). Printed per workload (code, chat, prose) and N: the expected acceptance of a
  draft token, alpha = sum_x min(p(x), q_N(x)), averaged over positions, its ratio to the
  full head's, and the target's probability mass inside the subset. Every N sees the same
  positions, so the differences are not sampling noise.
- engine: speculative decoding at batch 1 through the engine with static K = --k and the real
  subset heads, every prompt run with each head in turns, same seeds: acceptance rate
  (accepted / admitted), slot-1 acceptance, mean acceptance length (tokens per request per
  step) and tokens/s after the prefill step (timed: run it under an exclusive lock too); requests
  stop at EOS, as in use (past EOS a chat model writes text no ranking expects).

This program owns no model logic; it loads and decodes like the engine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from specav.cli import encode_prompt
from specav.config import EngineConfig, SamplingParams, SpeculativeConfig
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine, eos_token_ids
from specav.request import Request
from specav.verification.sampling_rows import SamplingRows
from specav.evaluation.workloads import load_workload
from specav.models import Checkpoint, load_checkpoint
from specav.models.vocab_ranking import load_ranking
from specav.models.vocab_subset import set_head, subset_head

WORKLOADS = ("code", "chat", "prose")
CONTEXT = 128
FULL = "full"
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.8)


@dataclass(slots=True)
class Heads:
    """The drafter's full head and one subset head per N (name -> module; token ids per N)."""

    modules: dict[str, torch.nn.Module]
    token_ids: dict[str, torch.Tensor]


def build_heads(drafter: Checkpoint, sizes: list[int]) -> Heads:
    ranking = load_ranking(drafter.tokenizer)
    vocab = drafter.model.vocab_size
    modules, ids = {FULL: drafter.model.lm_head}, {}
    for n in sizes:
        ids[str(n)] = ranking.top(n, vocab)
        modules[str(n)] = subset_head(drafter.model.lm_head, ids[str(n)], vocab, drafter.gguf_path)
    return Heads(modules, ids)


# ---- timing --------------------------------------------------------------------------------------

def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_heads(drafter: Checkpoint, target: Checkpoint, heads: Heads, repeats: int) -> dict[str, dict[str, float]]:
    """name -> {"head_ms", "forward_ms"} for the drafter, plus "target" -> {"forward_ms"}; medians, in turns."""
    model, gen = drafter.model, torch.Generator().manual_seed(0)
    context = torch.randint(0, model.vocab_size, (CONTEXT,), generator=gen).tolist()
    caches = {"drafter": model.new_cache(CONTEXT + 2), "target": target.model.new_cache(CONTEXT + 2)}
    model.forward([context], [caches["drafter"]], [0])
    target.model.forward([context], [caches["target"]], [0])
    x = torch.randn(1, model.config.hidden_size, generator=gen).to(model.dtype)  # [1, hidden]
    samples: dict[str, dict[str, list[float]]] = {n: {"head_ms": [], "forward_ms": []} for n in heads.modules}
    samples["target"] = {"forward_ms": []}

    def one_row(m, cache) -> None:
        m.forward([[7]], [cache], [1])
        cache.rollback(1)

    full = model.lm_head
    for r in range(repeats + 1):  # the first round warms up
        for name, head in heads.modules.items():
            set_head(model, head)
            samples[name]["head_ms"].append(1e3 * _seconds(lambda: head(x)))
            samples[name]["forward_ms"].append(1e3 * _seconds(lambda: one_row(model, caches["drafter"])))
        samples["target"]["forward_ms"].append(1e3 * _seconds(lambda: one_row(target.model, caches["target"])))
    set_head(model, full)
    return {name: {k: statistics.median(v[1:]) for k, v in s.items()} for name, s in samples.items()}


def subset_logits_equal(heads: Heads, hidden_size: int, dtype: torch.dtype) -> dict[str, bool]:
    """Whether each subset head's logits equal the full head's on its subset, at 1 and 5 rows."""
    out = {}
    for rows in (1, 5):
        x = torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(rows)).to(dtype)
        full = heads.modules[FULL](x)
        for name, ids in heads.token_ids.items():
            out[name] = out.get(name, True) and torch.equal(heads.modules[name](x)[:, ids], full[:, ids])
    return out


def print_timing(times: dict[str, dict[str, float]], heads: Heads) -> None:
    target_ms, full = times["target"]["forward_ms"], times[FULL]
    print(f"\ndrafter one-row forward on a {CONTEXT}-token context, per output head (median, heads in turns); "
          f"target one-row forward {target_ms:.1f} ms")
    print(f"  {'head':<8}{'head ms':>9}{'vs full':>9}{'forward ms':>12}{'vs full':>9}{'vs target':>11}")
    for name in heads.modules:
        t = times[name]
        print(f"  {name:<8}{t['head_ms']:>9.2f}{t['head_ms'] / full['head_ms']:>9.2f}{t['forward_ms']:>12.2f}"
              f"{t['forward_ms'] / full['forward_ms']:>9.2f}{t['forward_ms'] / target_ms:>11.2f}")


# ---- teacher-forced acceptance ---------------------------------------------------------------------

def sample_continuations(target: Checkpoint, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The target's own sampled continuation of each prompt (target-only, seeded by prompt index)."""
    engine = Engine(target.model, target.tokenizer, None, EngineConfig(speculative=None), eos_token_ids(target))
    params = [SamplingParams(max_tokens=tokens, seed=i, **SAMPLING) for i in range(len(prompts))]
    return [list(r.output_ids) for r in engine.generate(prompts, params)]


def forced_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits predicting each continuation token # [n, V] (teacher forcing)."""
    n = len(continuation)
    return model.forward([prompt + continuation[:-1]], [model.new_cache(len(prompt) + n)], [n]).logits


def processed(logits: torch.Tensor, prompt: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
    """The request's sampling transforms of logits # [n, V] (-inf outside `mask` first) -> probs # [n, V]."""
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    rows = SamplingRows.of([Request(prompt, SamplingParams(**SAMPLING))], [logits.shape[0]])
    return rows.distributions(logits).to_dense()


def forced_acceptance(target: Checkpoint, drafter: Checkpoint, heads: Heads, prompts: list[list[int]],
                      continuations: list[list[int]]) -> dict[str, dict[str, float]]:
    """name -> {"alpha": mean sum min(p, q_N), "coverage": mean p-mass inside the subset} over all positions."""
    vocab = drafter.model.vocab_size
    masks = {FULL: torch.ones(vocab, dtype=torch.bool)}
    for name, ids in heads.token_ids.items():
        masks[name] = torch.zeros(vocab, dtype=torch.bool)
        masks[name][ids] = True
    for name, ids in list(heads.token_ids.items()):  # the baseline ranking: token ids (BPE merge order)
        masks[f"{name} id"] = torch.arange(vocab) < len(ids)
    sums = {name: {"alpha": 0.0, "coverage": 0.0} for name in masks}
    positions = 0
    for prompt, continuation in zip(prompts, continuations):
        p = processed(forced_logits(target.model, prompt, continuation), prompt)  # [n, V]
        q_logits = forced_logits(drafter.model, prompt, continuation)  # [n, V], the full head
        for name, mask in masks.items():
            q = processed(q_logits, prompt, None if name == FULL else mask)  # [n, V]
            sums[name]["alpha"] += float(torch.minimum(p, q).sum())
            sums[name]["coverage"] += float(p[:, mask].sum())
        positions += len(continuation)
    return {name: {k: v / positions for k, v in s.items()} for name, s in sums.items()}


# ---- engine runs ---------------------------------------------------------------------------------

def engine_runs(target: Checkpoint, drafter: Checkpoint, heads: Heads, prompts: list[list[int]],
                tokens: int, k: int) -> dict[str, dict[str, float]]:
    """name -> acceptance rate, slot-1 acceptance, mean acceptance length and tokens/s after the prefill
    step of static-K speculative decoding at batch 1, each prompt run with every head in turns."""
    full = drafter.model.lm_head
    engines = {name: Engine(target.model, target.tokenizer, DraftModelDrafter(drafter.model),
                            EngineConfig(speculative=SpeculativeConfig(num_speculative_tokens=k)),
                            eos_token_ids(target)) for name in heads.modules}
    emitted, seconds = dict.fromkeys(heads.modules, 0), dict.fromkeys(heads.modules, 0.0)
    for i, prompt in enumerate(prompts):
        for name, engine in engines.items():
            set_head(drafter.model, heads.modules[name])
            request = engine.add_request(prompt, SamplingParams(max_tokens=tokens, seed=i,
                                                                **SAMPLING))
            engine.step()  # the prefill step: not timed
            first = len(request.output_ids)
            start = time.perf_counter()
            while engine.has_work():
                engine.step()
            seconds[name] += time.perf_counter() - start
            emitted[name] += len(request.output_ids) - first
    set_head(drafter.model, full)
    out = {}
    for name, engine in engines.items():
        s = engine.stats
        out[name] = {"rate": s.accepted / s.admitted, "first": s.acceptance_per_position[0],
                     "length": s.mean_acceptance_length, "tps": emitted[name] / seconds[name]}
    return out


def print_acceptance(title: str, columns: dict[str, str], per_workload: dict[str, dict[str, dict[str, float]]],
                     ratio_of: str) -> None:
    print(f"\n{title}")
    head = "".join(f"{label:>12}" for label in columns.values())
    print(f"  {'workload':<9}{'head':<10}{head}{'vs full':>9}")
    for workload, rows in per_workload.items():
        for name, values in rows.items():
            cells = "".join(f"{values[key]:>12.3f}" for key in columns)
            print(f"  {workload:<9}{name:<10}{cells}{values[ratio_of] / rows[FULL][ratio_of]:>9.3f}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specav.bench.vocab_subset", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8192,16384,32768,65536", help="subset sizes N (the full head is added)")
    parser.add_argument("--parts", default="timing,acceptance,engine")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload (code, chat, prose)")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per prompt")
    parser.add_argument("--k", type=int, default=4, help="static K of the engine part")
    parser.add_argument("--repeats", type=int, default=15, help="timing rounds (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    target = load_checkpoint("default", args.dtype, role="target")
    drafter = load_checkpoint("default", args.dtype, role="drafter")
    heads = build_heads(drafter, [int(n) for n in args.sizes.split(",") if n])
    print(f"packaged pair in {args.dtype}, {args.threads} threads, torch {torch.__version__}; drafter heads: "
          f"{', '.join(heads.modules)}; sampling {SAMPLING}")
    equal = subset_logits_equal(heads, drafter.model.config.hidden_size, drafter.model.dtype)
    print(f"subset heads' logits equal the full head's on their subsets (1 and 5 rows): {equal}")
    if "timing" in parts:
        print_timing(time_heads(drafter, target, heads, args.repeats), heads)
    prompts = {w: [encode_prompt(target.tokenizer, messages=p.chat()) for p in load_workload(w)[:args.prompts]]
               for w in WORKLOADS}
    if "acceptance" in parts:
        forced = {}
        for w, ps in prompts.items():
            forced[w] = forced_acceptance(target, drafter, heads, ps, sample_continuations(target, ps, args.tokens))
        print_acceptance(f"teacher-forced acceptance on the target's own samples ({args.prompts} prompts x "
                         f"{args.tokens} tokens per workload): alpha = mean sum_x min(p, q_N)",
                         {"alpha": "alpha", "coverage": "p in subset"}, forced, "alpha")
    if "engine" in parts:
        runs = {w: engine_runs(target, drafter, heads, ps, args.tokens, args.k) for w, ps in prompts.items()}
        print_acceptance(f"speculative decoding at batch 1, static K={args.k}, {args.prompts} prompts x {args.tokens} "
                         f"tokens per workload, heads in turns, same seeds; tokens/s after the prefill step; "
                         f"'vs full' compares tokens/s", {"rate": "accept rate", "first": "slot 1",
                                                          "length": "mean length", "tps": "tokens/s"}, runs, "tps")


if __name__ == "__main__":
    main()
