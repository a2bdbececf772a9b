"""Benchmark: the quantized weight path against bf16 / fp32 and llama.cpp, target-only, in one run.

    python -m specav.bench.quantized [--dtypes bf16,fp32,q4,auto] [--tokens 48] [--prompts 1] [--threads N]
                                     [--spec-ks 2,4]

All dtypes of the packaged target are loaded side by side and measured in turns (a round is one
forward of every row count, or one decoding run, of each dtype), so load from other processes
on a shared machine falls on all of them alike; llama.cpp takes its turn in the decoding
rounds. Printed:

- per dtype: load time; the packed forward's time for 1, 4, 5, 8 and 16 new tokens on a
  128-token context (logits for every new token; median of --repeats); greedy
  target-only decoding through the engine (no drafter, EOS ignored): prefill seconds and
  decode tokens/s (one over the median time per token); the speed-up over bf16;
- for each dtype against bf16's greedy output: the identical prefix of the free-running
  output, the argmax agreement when fed bf16's tokens (teacher forcing) and the mean
  KL(bf16 || dtype) there; then the same teacher-forced figures with the dtype's input
  embeddings multiplied by 1 + 1e-6 noise, --perturbations times (their range): the noise floor of
  the figures above. A change far below the kernels' own error (another order of float operations,
  another kernel plan) moves them within that range, because rounding an activation to int8
  turns a last-bit difference into a whole step now and then, and 28 layers carry it on;
- for auto, the kernel times it measured and the kernel each layer shape runs per row count;
- the memory of the packaged pair (target + drafter) in q4 and auto, each in a fresh process;
- llama.cpp target-only greedy decoding of the same GGUF file and prompts, when
  llama-cpp-python is installed (the optional `bench` extra, never a test dependency);
- speculative decoding with static K (--spec-ks) in auto with the packaged drafter, per
  workload, against auto target-only and llama.cpp target-only, run in turns on the same
  prompts (greedy; where auto switches kernels by row count, verifying K + 1 rows can round
  differently from decoding one, so outputs may part after some tokens);
- llama.cpp's own tools on the same GGUF files and threads (unless --no-llama-cpp-tools), built
  once into the cache by specav/bench/llama_cpp.py from the source vendored in the `bench`
  extra's llama-cpp-python sdist (many minutes the first time): `llama-bench` forwards of the
  target and the drafter (1 token, 5- and 16-token batches, on the same 128-token context)
  beside auto's, `llama-completion` target-only greedy decoding and `llama-speculative-simple`
  static-K greedy speculative decoding with the packaged drafter on the same prompts.

Goals (issue 6): auto at least 3x bf16 and 0.8x llama.cpp target-only tokens/s; both
models in q4 under 3 GiB. This program owns no model logic; it loads like the engine.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specav.bench.optional import require
from specav.cli import encode_prompt
from specav.config import EngineConfig, SamplingParams, SpeculativeConfig
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine, eos_token_ids
from specav.evaluation.workloads import load_workload
from specav.models import Checkpoint, load_checkpoint, packaged
from specav.models.loader import KERNEL_PROFILE
from specav.models.quant import quantized_nbytes
from specav.models.quant_choice import ROW_BUCKETS, MeasuredChoice, plan_from_times
from specav.models.threads import ThreadChoice

ROWS = (1, 4, 5, 8, 16)
CONTEXT = 128
WORKLOADS = ("code", "prose")
MEMORY_GOAL_GIB = 3.0
LLAMA_CPP = "llama.cpp"


@dataclass(slots=True)
class Decoded:
    tokens: list[int]
    prefill_s: float
    step_s: list[float]  # seconds per step after the first (one token each without a drafter)
    first_tokens: int = 1  # tokens the first (prefill) step emitted


@dataclass(slots=True)
class Result:
    """One dtype (or llama.cpp): timings and outputs gathered over the rounds."""

    name: str
    load_s: float = 0.0
    forward_s: dict[int, list[float]] = field(default_factory=lambda: {n: [] for n in ROWS})
    decoded: list[Decoded] = field(default_factory=list)  # one per prompt

    @property
    def prefill_s(self) -> float:
        return statistics.mean(d.prefill_s for d in self.decoded)

    @property
    def decode_tps(self) -> float:
        return 1.0 / statistics.median(s for d in self.decoded for s in d.step_s)

    def forward_ms(self, rows: int) -> float:
        return 1e3 * statistics.median(self.forward_s[rows])


def decode(checkpoint: Checkpoint, prompt: list[int], tokens: int, drafter: Checkpoint | None = None,
           k: int = 0) -> Decoded:
    """Greedy decoding through the engine, timing every step: target-only, or speculative with
    static K = k when a drafter is given."""
    spec = SpeculativeConfig(num_speculative_tokens=k) if drafter is not None else None
    engine = Engine(checkpoint.model, checkpoint.tokenizer, DraftModelDrafter(drafter.model) if spec else None,
                    EngineConfig(speculative=spec), eos_token_ids(checkpoint))
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    times, emitted = [], []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        emitted.append(len(request.output_ids))
    return Decoded(list(request.output_ids), times[0], times[1:], emitted[0])


def llama_cpp_decode(llm, prompt: list[int], tokens: int) -> Decoded:
    """llama.cpp greedy decoding of the same prompt tokens (llama-cpp-python's generator)."""
    llm.reset()
    out, stamps = [], [time.perf_counter()]
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        stamps.append(time.perf_counter())
        if len(out) == tokens:
            break
    steps = [b - a for a, b in itertools.pairwise(stamps[1:])]
    return Decoded(out, stamps[1] - stamps[0], steps)


def time_forward(model, cache, new: list[int]) -> float:
    """Seconds of one packed forward of `new` on top of `cache` (rolled back after)."""
    start = time.perf_counter()
    model.forward([new], [cache], [len(new)])
    seconds = time.perf_counter() - start
    cache.rollback(len(new))
    return seconds


PERTURBATION = 1e-6  # relative noise on the input embeddings (agreement's noise floor)


def forced_logits(checkpoint: Checkpoint, prompt: list[int], tokens: list[int],
                  perturbation_seed: int | None = None) -> torch.Tensor:
    """Logits # [N, V] predicting each of `tokens` when fed prompt + tokens (teacher forcing); with
    a seed, the input embeddings multiplied by 1 + PERTURBATION * standard normal noise."""
    model = checkpoint.model
    handle = None
    if perturbation_seed is not None:
        gen = torch.Generator().manual_seed(perturbation_seed)
        handle = model.hf_model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: out * (1 + PERTURBATION * torch.randn(out.shape, generator=gen)))
    try:
        return model.forward([prompt + tokens[:-1]], [model.new_cache()], [len(tokens)]).logits
    finally:
        if handle is not None:
            handle.remove()


def forced_agreement(reference: list[int], ref_logits: torch.Tensor, our_logits: torch.Tensor) -> tuple[int, float]:
    """Teacher-forced argmax agreement with `reference` and the mean KL(reference logits || ours)."""
    forced = int((our_logits.argmax(-1) == torch.tensor(reference)).sum())
    kl = torch.nn.functional.kl_div(our_logits.log_softmax(-1), ref_logits.log_softmax(-1),
                                    log_target=True, reduction="batchmean").item()
    return forced, kl


def agreement(reference: list[int], ours: list[int], ref_logits: torch.Tensor, our_logits: torch.Tensor,
              perturbed: Sequence[torch.Tensor] = ()) -> str:
    n = len(reference)
    prefix = next((i for i, (a, b) in enumerate(zip(reference, ours)) if a != b), n)
    forced, kl = forced_agreement(reference, ref_logits, our_logits)
    line = f"identical prefix {prefix:>3}/{n}, teacher-forced argmax {forced:>3}/{n}, KL {kl:.4f}"
    if perturbed:
        figures = [forced_agreement(reference, ref_logits, p) for p in perturbed]
        argmaxes, kls = [f for f, _ in figures], [k for _, k in figures]
        line += (f"; perturbed x {len(perturbed)}: argmax {min(argmaxes)}-{max(argmaxes)}/{n}, "
                 f"KL {min(kls):.4f}-{max(kls):.4f} (mean {statistics.mean(kls):.4f})")
    return line


def load_all(dtypes: list[str], threads: int, with_llama_cpp: bool) -> tuple[dict, dict[str, Result], str]:
    models, results = {}, {}
    for dtype in dtypes:
        start = time.perf_counter()
        models[dtype] = load_checkpoint("default", dtype, role="target")
        results[dtype] = Result(dtype, time.perf_counter() - start)
    note = "not requested (--no-llama-cpp)"
    if with_llama_cpp:
        try:
            from llama_cpp import Llama
        except ImportError:
            note = "llama-cpp-python is not installed (pip install llama-cpp-python): skipped"
        else:
            start = time.perf_counter()
            models[LLAMA_CPP] = Llama(str(packaged.assembled_gguf(packaged.TARGET)), n_ctx=2048,
                                      n_threads=threads, n_threads_batch=threads, verbose=False)
            results[LLAMA_CPP] = Result(LLAMA_CPP, time.perf_counter() - start)
            note = ""
    return models, results, note


def measure_forwards(models: dict, results: dict[str, Result], repeats: int) -> None:
    ours = {name: m.model for name, m in models.items() if isinstance(m, Checkpoint)}
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(ours.values())).vocab_size
    context = torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist()
    caches = {name: model.new_cache(CONTEXT + max(ROWS)) for name, model in ours.items()}
    for name, model in ours.items():
        model.forward([context], [caches[name]], [0])
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())  # models on the native kernels choose
    news = {n: torch.randint(0, vocab, (n,), generator=gen).tolist() for n in ROWS}  # their count by trying each
    for _ in range(repeats + warmup):  # rounds of every (row count, dtype): the VM's drift falls on all alike
        for n, new in news.items():
            for name, model in ours.items():
                results[name].forward_s[n].append(time_forward(model, caches[name], new))
    for name in ours:
        for n in ROWS:
            del results[name].forward_s[n][:warmup]


def measure_decoding(models: dict, results: dict[str, Result], prompts: list[list[int]], tokens: int) -> None:
    for prompt in prompts:
        for name, model in models.items():
            run = decode(model, prompt, tokens) if isinstance(model, Checkpoint) else \
                llama_cpp_decode(model, prompt, tokens)
            results[name].decoded.append(run)


def measure_speculative(models: dict, prompts: list[list[int]], tokens: int, ks: list[int],
                        threads: int) -> dict[str, list[Decoded]]:
    """Static-K speculative decoding in auto (packaged drafter), in turns with auto target-only and
    llama.cpp target-only on the same prompts: method -> one Decoded per prompt."""
    drafter = load_checkpoint("default", "auto", role="drafter")
    runs: dict[str, list[Decoded]] = {}
    for prompt in prompts:
        methods = {"auto target-only": lambda p: decode(models["auto"], p, tokens)}
        methods |= {f"auto static K={k}": lambda p, k=k: decode(models["auto"], p, tokens, drafter, k) for k in ks}
        if LLAMA_CPP in models:
            methods[f"{LLAMA_CPP} target-only"] = lambda p: llama_cpp_decode(models[LLAMA_CPP], p, tokens)
        for name, run in methods.items():
            runs.setdefault(name, []).append(run(prompt))
    return runs


def agreements(models: dict, results: dict[str, Result], prompts: list[list[int]],
               perturbations: int = 0) -> dict[str, list[str]]:
    """Each dtype against bf16's greedy output (free-running and teacher-forced; teacher-forced
    again under `perturbations` seeds of input noise)."""
    if "bf16" not in models:
        return {}
    reference = [d.tokens for d in results["bf16"].decoded]
    ref_logits = [forced_logits(models["bf16"], p, r) for p, r in zip(prompts, reference)]
    lines = {}
    for name, model in models.items():
        if name != "bf16" and isinstance(model, Checkpoint):
            lines[name] = [agreement(r, d.tokens, rl, forced_logits(model, p, r),
                                     [forced_logits(model, p, r, seed) for seed in range(perturbations)])
                           for p, r, rl, d in zip(prompts, reference, ref_logits, results[name].decoded)]
    return lines


def memory_child(dtype: str) -> None:
    """Runs in a fresh process: load the pair, run each once, print one JSON line."""
    psutil = require("psutil", "specav bench quantized")
    rss0 = psutil.Process().memory_info().rss
    target = load_checkpoint("default", dtype, role="target")
    drafter = load_checkpoint("default", dtype, role="drafter")
    for m in (target.model, drafter.model):
        m.forward([[1, 2, 3]], [m.new_cache()], [1])
    gc.collect()
    print(json.dumps({"rss_gib": psutil.Process().memory_info().rss / 2**30, "peak_gib": _high_water_gib(),
                      "start_gib": rss0 / 2**30, "target_weights_gib": quantized_nbytes(target.model) / 2**30,
                      "drafter_weights_gib": quantized_nbytes(drafter.model) / 2**30}))


def _high_water_gib() -> float:
    """Peak RSS of this process image (VmHWM). Not ru_maxrss: after fork + exec, Linux keeps the
    parent's RSS at fork time in the child's ru_maxrss."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def measure_memory(dtype: str, threads: int) -> dict | str:
    cmd = [sys.executable, "-m", "specav.bench.quantized", "--memory-of", dtype, "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if done.returncode == 0 and lines else f"failed: {done.stderr[-300:]}"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specav.bench.quantized", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16,fp32,q4,auto", help="comma-separated, bf16 among them "
                        "for the agreement table (fp32 holds 6 GiB more)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per workload (code, prose)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of forward timings (median)")
    parser.add_argument("--perturbations", type=int, default=4, help="teacher-forced agreement again under this "
                        "many seeds of 1e-6 relative noise on the input embeddings (the figures' noise floor)")
    parser.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: torch's)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    parser.add_argument("--no-llama-cpp-tools", action="store_true", help="skip llama.cpp's own tools "
                        "(llama-bench, llama-completion, llama-speculative-simple; built once, many minutes)")
    parser.add_argument("--spec-ks", default="2,4", help="static K values for speculative decoding in auto "
                        "('' to skip)")
    parser.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # the memory child
    args = parser.parse_args(argv)
    if args.tokens < 3:
        parser.error(f"--tokens {args.tokens} is too small: allowed >= 3")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.memory_of:
        return memory_child(args.memory_of)
    tools, tools_note = llama_cpp_tools(threads, not args.no_llama_cpp_tools)  # builds before any timing
    models, results, llama_note = load_all(args.dtypes.split(","), threads, not args.no_llama_cpp)
    tokenizer = next(m for m in models.values() if isinstance(m, Checkpoint)).tokenizer
    prompts = _prompts(tokenizer, args.prompts)
    ks = [int(k) for k in args.spec_ks.split(",") if k]
    peer = ToolFigures(tools, tools_note)
    measure_forwards(models, results, args.repeats)
    peer.bench = measure_llama_bench(tools, threads, args.repeats)
    measure_decoding(models, results, prompts, args.tokens)
    peer.completion = measure_llama_completion(tools, tokenizer, prompts, args.tokens, threads)
    print(f"packaged target, {threads} threads, torch {torch.__version__}, {len(prompts)} prompts "
          f"({', '.join(WORKLOADS)}) x {args.tokens} greedy tokens; forwards on a {CONTEXT}-token context")
    _print_table(results)
    for name, lines in agreements(models, results, prompts, args.perturbations).items():
        for i, line in enumerate(lines):
            print(f"  {name} vs bf16, prompt {i} ({WORKLOADS[i // args.prompts]}): {line}")
    _print_llama_cpp(results, llama_note, args.tokens)
    runs = {}
    if "auto" in models:
        _print_kernel_choice()
        if ks:
            runs = measure_speculative(models, prompts, args.tokens, ks, threads)
            _print_speculative(runs, args.prompts)
    peer.speculative = measure_llama_speculative(tools, tokenizer, prompts, args.tokens, ks, threads)
    print_llama_cpp_tools(peer, results, runs, prompts, args.prompts)
    del models
    gc.collect()
    _print_memory(threads)


def _prompts(tokenizer, per_workload: int) -> list[list[int]]:
    return [encode_prompt(tokenizer, messages=p.chat())
            for w in WORKLOADS for p in load_workload(w)[:per_workload]]


def _print_table(results: dict[str, Result]) -> None:
    head = "".join(f"{f'{n} rows ms':>12}" for n in ROWS)
    print(f"{'':<10}{'load s':>8}{head}{'prefill s':>11}{'decode tok/s':>14}{'vs bf16':>9}")
    base = results["bf16"].decode_tps if "bf16" in results else None
    for r in results.values():
        cells = "".join(f"{r.forward_ms(n):>12.1f}" if r.forward_s[n] else f"{'-':>12}" for n in ROWS)
        ratio = f"{r.decode_tps / base:>9.2f}" if base else ""
        print(f"{r.name:<10}{r.load_s:>8.1f}{cells}{r.prefill_s:>11.2f}{r.decode_tps:>14.2f}{ratio}")
    if "bf16" in results:
        for r in results.values():
            if r.name not in ("bf16", LLAMA_CPP):
                cells = "  ".join(f"{n} rows {results['bf16'].forward_ms(n) / r.forward_ms(n):.2f}x" for n in ROWS)
                print(f"  {r.name} forward speed-up over bf16: {cells}")


def _print_llama_cpp(results: dict[str, Result], note: str, tokens: int) -> None:
    if note:
        print(f"\nllama.cpp: {note}")
        return
    peer = results[LLAMA_CPP]
    print(f"\nagainst llama.cpp target-only on the same file ({peer.decode_tps:.2f} tok/s):")
    for r in results.values():
        if r.name != LLAMA_CPP:
            same = [next((j for j, (a, b) in enumerate(zip(o.tokens, p.tokens)) if a != b), tokens)
                    for o, p in zip(peer.decoded, r.decoded)]
            print(f"  {r.name}: {r.decode_tps / peer.decode_tps:.2f}x its tokens/s; identical greedy prefix "
                  f"with it per prompt {same} of {tokens}")


def _print_speculative(runs: dict[str, list[Decoded]], per_workload: int) -> None:
    print("\nspeculative decoding in auto (greedy, packaged drafter in auto), tokens/s after the prefill "
          "step, per workload:")
    peer = f"{LLAMA_CPP} target-only"
    print(f"  {'workload':<9}{'method':<24}{'tokens/s':>9}{'vs auto target-only':>21}"
          + (f"{'vs llama.cpp':>14}" if peer in runs else "") + f"{'tokens/step':>13}")
    for w, workload in enumerate(WORKLOADS):
        rates = {name: _pooled(done[w * per_workload:(w + 1) * per_workload]) for name, done in runs.items()}
        for name, (tps, per_step) in rates.items():
            vs_peer = f"{tps / rates[peer][0]:>14.2f}" if peer in rates else ""
            print(f"  {workload:<9}{name:<24}{tps:>9.2f}{tps / rates['auto target-only'][0]:>21.2f}"
                  f"{vs_peer}{per_step:>13.2f}")


def _pooled(done: list[Decoded]) -> tuple[float, float]:
    """(tokens/s after the prefill step, tokens per step) over several runs of one method."""
    tokens = sum(len(d.tokens) - d.first_tokens for d in done)
    return tokens / sum(sum(d.step_s) for d in done), tokens / sum(len(d.step_s) for d in done)


def _print_kernel_choice() -> None:
    profile = MeasuredChoice(packaged.cache_root() / KERNEL_PROFILE).profile()
    print(f"\nauto: measured ms per call (one thread, cache-cold, best of 7) at {ROW_BUCKETS} rows, "
          f"and the kernels chosen")
    for key in sorted(profile):
        times = profile[key]
        cells = "  ".join(f"{k} {'/'.join(f'{t:.2f}' for t in v)}" for k, v in sorted(times.items()))
        print(f"  {key:<20} {cells}  ->  {'/'.join(plan_from_times(times).kernels)}")


def _print_memory(threads: int) -> None:
    print("\nmemory of the packaged pair (target + drafter), each dtype in a fresh process")
    for dtype in ("q4", "auto"):
        m = measure_memory(dtype, threads)
        if isinstance(m, str):
            print(f"  {dtype}: {m}")
            continue
        verdict = "OK" if m["peak_gib"] < MEMORY_GOAL_GIB else "OVER GOAL"
        print(f"  {dtype}: RSS {m['rss_gib']:.2f} GiB after loading both (process start {m['start_gib']:.2f}), "
              f"peak {m['peak_gib']:.2f} GiB ({verdict}: goal < {MEMORY_GOAL_GIB} GiB); weights: target "
              f"{m['target_weights_gib']:.2f} GiB, drafter {m['drafter_weights_gib']:.2f} GiB")


# ==== llama.cpp's own tools (issue 15, item 6): begin ===========================================
# Owned by the llama.cpp peer (specav/bench/llama_cpp.py builds the tools, llama_cpp_tools.py runs
# them); the rest of this file calls only the functions below.

from specav.bench.llama_cpp import LlamaCppBuildError, LlamaCppTools, ensure_tools  # noqa: E402
from specav.bench.llama_cpp_tools import (BenchRates, DecodeRun, run_bench, run_completion,  # noqa: E402
                                          run_speculative)

TOOL_BATCHES = (5, 16)  # llama-bench -p: verifying K + 1 = 5 rows, and 16
TOOL_ROLES = {"target": packaged.TARGET, "drafter": packaged.DRAFTER}


@dataclass(slots=True)
class ToolFigures:
    """What llama.cpp's own tools measured in this run (empty where they were skipped)."""

    tools: LlamaCppTools | None
    note: str  # why they were skipped, or ""
    bench: dict[str, BenchRates] = field(default_factory=dict)  # "target" / "drafter" -> llama-bench
    completion: list[DecodeRun] = field(default_factory=list)  # llama-completion, per prompt (decoding rounds)
    speculative: dict[int, list[DecodeRun]] = field(default_factory=dict)  # K -> per prompt; 0 = llama-completion


def llama_cpp_tools(threads: int, enabled: bool) -> tuple[LlamaCppTools | None, str]:
    """The probed build for this machine (building it once, with progress on stderr), or why not."""
    if not enabled:
        return None, "not requested (--no-llama-cpp-tools)"
    try:
        return ensure_tools([packaged.assembled_gguf(m) for m in TOOL_ROLES.values()], threads), ""
    except LlamaCppBuildError as e:
        return None, f"unavailable ({e})"


def measure_llama_bench(tools: LlamaCppTools | None, threads: int, repeats: int) -> dict[str, BenchRates]:
    if tools is None:
        return {}
    return {role: run_bench(tools, packaged.assembled_gguf(m), threads, TOOL_BATCHES, gen=32, depth=CONTEXT,
                            repeats=repeats) for role, m in TOOL_ROLES.items()}


def _prompt_text(tokenizer, prompt: list[int]) -> str:
    return tokenizer.decode(prompt, skip_special_tokens=False)


def measure_llama_completion(tools: LlamaCppTools | None, tokenizer, prompts: list[list[int]], tokens: int,
                             threads: int) -> list[DecodeRun]:
    if tools is None:
        return []
    target = packaged.assembled_gguf(packaged.TARGET)
    return [run_completion(tools, target, _prompt_text(tokenizer, p), tokens, threads) for p in prompts]


def measure_llama_speculative(tools: LlamaCppTools | None, tokenizer, prompts: list[list[int]], tokens: int,
                              ks: list[int], threads: int) -> dict[int, list[DecodeRun]]:
    """Per prompt, in turns: llama-completion (K = 0) and llama-speculative-simple at each K."""
    if tools is None or not ks:
        return {}
    target, drafter = (packaged.assembled_gguf(m) for m in TOOL_ROLES.values())
    runs: dict[int, list[DecodeRun]] = {k: [] for k in [0, *ks]}
    for prompt in prompts:
        text = _prompt_text(tokenizer, prompt)
        runs[0].append(run_completion(tools, target, text, tokens, threads))
        for k in ks:
            runs[k].append(run_speculative(tools, target, drafter, text, tokens, k, threads))
    return runs


def print_llama_cpp_tools(peer: ToolFigures, results: dict[str, Result], spec_runs: dict[str, list[Decoded]],
                          prompts: list[list[int]], per_workload: int) -> None:
    if peer.tools is None:
        print(f"\nllama.cpp's own tools: {peer.note}")
        return
    print(f"\nllama.cpp's own tools on the same files and threads: {peer.tools.describe()}")
    _check_prompt_tokens(peer, prompts)
    _print_tool_forwards(peer.bench, results)
    _print_tool_decoding(peer.completion, results, per_workload)
    _print_tool_speculative(peer.speculative, spec_runs, per_workload)


def _check_prompt_tokens(peer: ToolFigures, prompts: list[list[int]]) -> None:
    seen = [r.prompt_tokens for r in peer.completion] + [r.prompt_tokens for rs in peer.speculative.values()
                                                         for r in rs]
    expected = [len(p) for p in prompts] * (len(seen) // max(len(prompts), 1))
    if seen != expected:
        print(f"  NOTE: the tools tokenised the prompts to {seen} tokens, specav to {expected}")


def _print_tool_forwards(bench: dict[str, BenchRates], results: dict[str, Result]) -> None:
    rows = (1, *TOOL_BATCHES)
    print(f"  llama-bench forwards on a {CONTEXT}-token context, ms (median): "
          + "  ".join(f"{n} rows" for n in rows))
    for role, rates in bench.items():
        cells = [rates.decode_ms, *(rates.batch_ms[n] for n in TOOL_BATCHES)]
        print(f"    llama.cpp {role:<8}" + "".join(f"{c:>10.1f}" for c in cells)
              + f"   ({rates.decode_tps:.2f} tok/s at 1 token)")
    auto = results.get("auto")
    if auto is not None and "target" in bench:
        ours = [auto.forward_ms(n) if auto.forward_s.get(n) else float("nan") for n in rows]
        ref = [bench["target"].decode_ms, *(bench["target"].batch_ms[n] for n in TOOL_BATCHES)]
        print(f"    specav auto target" + "".join(f"{c:>10.1f}" for c in ours))
        print(f"    auto / llama.cpp  " + "".join(f"{a / b:>10.2f}" for a, b in zip(ours, ref)))
        print(f"    verify cost (n rows / 1 row): auto " + " ".join(f"{n}: {o / ours[0]:.2f}x" for n, o in
                                                               zip(rows[1:], ours[1:]))
              + "; llama.cpp " + " ".join(f"{n}: {r / ref[0]:.2f}x" for n, r in zip(rows[1:], ref[1:])))
    if {"target", "drafter"} <= set(bench):
        print(f"    llama.cpp drafter / target at 1 token: {bench['drafter'].decode_ms / bench['target'].decode_ms:.2f}x")


def _print_tool_decoding(completion: list[DecodeRun], results: dict[str, Result], per_workload: int) -> None:
    if not completion:
        return
    print("  target-only greedy decoding, tokens/s after the prefill, per workload (llama-completion in the "
          "decoding rounds above; llama.cpp = llama-cpp-python):")
    names = list(results)
    print(f"    {'workload':<9}{'llama-completion':>18}" + "".join(f"{n:>11}" for n in names)
          + "".join(f"{n + ' / it':>16}" for n in names))
    for w, workload in enumerate(WORKLOADS):
        chunk = slice(w * per_workload, (w + 1) * per_workload)
        ref = _tool_rate(completion[chunk])
        ours = [1.0 / statistics.median(s for d in results[n].decoded[chunk] for s in d.step_s) for n in names]
        print(f"    {workload:<9}{ref:>18.2f}" + "".join(f"{o:>11.2f}" for o in ours)
              + "".join(f"{o / ref:>16.2f}" for o in ours))


def _print_tool_speculative(spec: dict[int, list[DecodeRun]], spec_runs: dict[str, list[Decoded]],
                            per_workload: int) -> None:
    if not spec:
        return
    print("  greedy speculative decoding with the packaged drafter, static K, tokens/s after the prefill, per "
          "workload: llama-speculative-simple (llama-completion in the same turns) beside specav auto (the "
          "speculative table above)")
    print(f"    {'workload':<9}{'K':>3}{'llama.cpp':>11}{'vs its K=0':>12}{'accept':>8}{'specav':>9}"
          f"{'specav / llama.cpp same K':>27}{'specav / llama.cpp K=0':>24}")
    for w, workload in enumerate(WORKLOADS):
        chunk = slice(w * per_workload, (w + 1) * per_workload)
        base = _tool_rate(spec[0][chunk])
        for k, runs in spec.items():
            rate = _tool_rate(runs[chunk])
            drafted = sum(r.drafted for r in runs[chunk])
            accept = f"{sum(r.accepted for r in runs[chunk]) / drafted:>8.2f}" if k and drafted else f"{'':>8}"
            ours = spec_runs.get(f"auto static K={k}" if k else "auto target-only")
            mine = _pooled(ours[chunk])[0] if ours else float("nan")
            print(f"    {workload:<9}{k:>3}{rate:>11.2f}{rate / base:>12.2f}{accept}{mine:>9.2f}"
                  f"{mine / rate:>27.2f}{mine / base:>24.2f}")


def _tool_rate(runs: list[DecodeRun]) -> float:
    """Tokens per second over several runs of one tool (after each run's prefill)."""
    return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)

# ==== llama.cpp's own tools (issue 15, item 6): end =============================================


if __name__ == "__main__":
    main()
