"""Benchmark: adaptive verification against target-only, static K and the oracle, on the packaged pair.

    python -m specav.bench.adaptive [--workloads code,chat,prose] [--concurrency 1,4,8] [--requests 8]
                                    [--max-tokens 128] [--rounds 1] [--ks 1,2,4,8] [--av-k 8] [--threads 2]
                                    [--av-variant probe_share=0.01 ...] [--plot docs/adaptive.png]
                                    [--trace av-trace.jsonl]

For each workload and concurrency C, the same `--requests` prompts (the workload's first ones,
chat template applied) run to `--max-tokens` tokens each (EOS ignored, so every method does the
same work) with C requests in flight (continuous batching, max_batch_size = C), temperature 0.7,
top-k 20, top-p 0.8, request i seeded with i, through:

    target-only    no drafter
    static K=k     every request drafts and verifies k slots per step
    AV             adaptive verification, K = --av-k at most (the engine's default config otherwise)
    AV a=x,b=y     AV with those AdaptiveConfig fields changed, or EstimatorConfig fields named
                   estimator.FIELD (one row per --av-variant, stepping in turn with the others; the
                   goals are AV's own)
    oracle         drafts and verifies exactly up to the first rejection: replayed from the
                   static K=8 run's steps (same accepted counts, so the same emitted tokens) through
                   the cost model, as that run's measured time x predicted(oracle) / predicted(K=8);
                   a request's first drafter forward feeds what its drafter has not seen (its
                   prompt, and every token since it last drafted), as any drafting method's must

Every row is measured in this one process, the methods stepping in turn per cell: each method runs
in its own engine over the same requests, and the engines take one step each, in an order drawn
afresh every step (`step_orders`), every step timed alone; a method's time is the sum of its steps.
Speeds on these machines drift 10-20% within minutes, in humps as well as slopes (prose at
concurrency 4, methods run one after another in the order target-only, AV, AV, target-only:
target-only's steps took a median 74 and 71 ms, AV's 83 and 83 ms with nothing drafted; the same
pair minutes later, 77 and 77 ms), so methods run one after the other compare the machine's moments,
not the methods; stepped in turn, every method meets the same moments within a second. Before the
cells, one warm-up request per method, and both models' thread policies (models/threads.py) make
their trial forwards at every row count the cells will run, prefills included (the models are shared
by all the methods, so trials left for the cells would slow whichever method first runs each size).
With `--rounds N` each cell runs N times and its figures are over all of them, each round its own
orders. Printed per cell:
tokens/s, the ratio to target-only, to the best static K and to the oracle, tokens per step,
slots drafted / verified per step, requests that skipped drafting, the seconds of the steps that
prefilled prompts, and the decoding speed against target-only's (target-only's wall time outside
prefill steps over the method's: every method prefills the same prompts with the same target, so
prefill's own noise, which can be a third of a cell's time, drops out); then AV's goals (issue 11)
met or missed, and the share of AV's step time spent in its planner, estimator and cost model;
with `--trace`, each AV request's decoding steps that drafted and that did not (`Trace`).
This program owns no engine logic.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch

from specav.cli import encode_prompt
from specav.config import (PACKAGED_SPECULATIVE, AdaptiveConfig, EngineConfig, EstimatorConfig, SamplingParams,
                           SpeculativeConfig)
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine, eos_token_ids
from specav.engine.profile import PROFILE_FILE, load_or_profile, models_key, profile_key
from specav.engine.stats import DraftCounts
from specav.evaluation.workloads import load_workload
from specav.models import check_same_vocabulary, load_checkpoint, packaged
from specav.models.native.probe import cpu_model
from specav.models.packed import PackedCausalLM
from specav.models.threads import ThreadChoice
from specav.models.vocab_subset import apply_vocab_subset
from specav.types import StepRecord, attended
from specav.verification.cost_model import CostModel, CostProfile

PARAMS = dict(temperature=0.7, top_k=20, top_p=0.8)


@dataclass(slots=True)
class _Step:
    """What the oracle replay needs of one static K=8 step."""

    pending: int
    attended: int  # key positions the K=8 verify attended to
    accepted: list[int]  # per request
    forwards: list[tuple[int, int]]
    admitted: int
    request_ids: list[str]
    draft_pending: list[int]  # per request, the tokens K=8's drafter fed before its first slot
    tokens: list[int]  # per request, its prompt and output tokens before the step


@dataclass(slots=True)
class Run:
    method: str
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: int = 0
    admitted: int = 0
    skipped: int = 0
    prefill_seconds: float = 0.0  # steps that prefilled a prompt (the same prompts for every method)
    planning_seconds: float = 0.0  # AV only: planner + estimator + cost model
    predicted_seconds: float = 0.0  # AV only: its cost model's step times, summed (against measured)
    measured_seconds: float = 0.0
    replay: list[_Step] = field(default_factory=list)
    by_reason: dict[str, DraftCounts] = field(default_factory=dict)  # AV: why requests drafted -> their slots

    def merge(self, other: "Run") -> "Run":
        """This run and another of the same method taken together (rounds of a cell)."""
        by_reason = {k: self.by_reason.get(k, DraftCounts()) + other.by_reason.get(k, DraftCounts())
                     for k in {**self.by_reason, **other.by_reason}}
        return Run(self.method, **{f.name: getattr(self, f.name) + getattr(other, f.name)
                                   for f in fields(Run) if f.name not in ("method", "by_reason")},
                   by_reason=by_reason)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def decode_seconds(self) -> float:
        """Wall time outside the steps that prefilled a prompt."""
        return self.seconds - self.prefill_seconds


class _Timed:
    """Wraps an object's methods, adding their wall time to a run's planning_seconds (AV's overhead)."""

    def __init__(self, run: Run, target, names: tuple[str, ...]) -> None:
        for name in names:
            original = getattr(target, name)

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    run.planning_seconds += time.perf_counter() - start

            setattr(target, name, timed)


def build_engine(target, drafter, k: int, adaptive: bool, concurrency: int, profile: CostProfile,
                 adaptive_config: AdaptiveConfig = AdaptiveConfig(),
                 estimator_config: EstimatorConfig = EstimatorConfig()) -> Engine:
    spec = SpeculativeConfig(num_speculative_tokens=k, enable_adaptive_verification=adaptive) if k else None
    config = EngineConfig(speculative=spec, max_batch_size=concurrency, adaptive=adaptive_config,
                          estimator=estimator_config)
    return Engine(target.model, target.tokenizer, DraftModelDrafter(drafter.model) if k else None, config,
                  eos_token_ids(target), cost_profile=profile if adaptive else None)


Method = tuple[str, int, bool, AdaptiveConfig, EstimatorConfig]  # name, K (0: no drafter), adaptive, AV's configs


class Trace:
    """`--trace`: AV's decisions, one JSON line per step and request (its cell and method, the
    request, its tokens so far, why it drafted, what it drafted, had admitted and accepted, its
    drafted slots' features as the scorer saw them, the step's seconds, and, after the step, what
    the adaptive planner holds of the request and the estimator's fit: `state`), and per cell each
    request's steps that drafted and that did not. The features, admitted and accepted counts of a
    step's lines are what the estimator observed that step (every request of the bench teaches it):
    `python -m specav.bench.estimator_trace` replays them through other estimator configs."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "w")
        self.cell: dict[str, object] = {}
        self.steps: dict[str, dict[str, collections.Counter]] = {}  # method -> request -> {"drafted": n, "not": n}

    def start(self, workload: str, concurrency: int, round_: int) -> None:
        self.cell = {"workload": workload, "concurrency": concurrency, "round": round_}

    def attach(self, engine: Engine, method: str = "AV") -> None:
        engine.step_listeners.append(lambda record: self.listen(record, engine, method))

    def listen(self, record: StepRecord, engine: Engine | None = None, method: str = "AV") -> None:
        drafted, admitted = record.drafts.num_drafted.tolist(), record.num_admitted.tolist()
        features = record.scores.features.tolist()  # [B][K]
        for b, request in enumerate(record.requests):
            reason = record.draft_reasons[b] if record.draft_reasons else ""
            line = {**self.cell, "method": method, "step": record.step, "request": request.request_id,
                    "output": len(request.output_ids), "reason": reason, "drafted": drafted[b],
                    "admitted": admitted[b], "accepted": int(record.num_accepted[b]),
                    "features": [round(f, 4) for f in features[b][:drafted[b]]],
                    "seconds": round(record.times.total, 5),
                    "predicted": round(record.plan.predicted.total, 5) if record.plan.predicted else None}
            if engine is not None:
                line.update(self.state(engine, request.request_id))
            self.file.write(json.dumps(line) + "\n")
            if not record.prefill_tokens or request.output_ids:
                counts = self.steps.setdefault(method, {}).setdefault(request.request_id, collections.Counter())
                counts["drafted" if drafted[b] else "not"] += 1

    @staticmethod
    def state(engine: Engine, request_id: str) -> dict[str, object]:
        """What decides the request's next steps: its wait, probe interval and whether a probe is
        due, its measured speed-up, the probe budget (ms), the traffic's requests, the cost model's
        one-token target-only step (ms, attention aside) and its stages' levels (plain, verify,
        draft), and the estimator's slope, intercepts and detected changes (where the engine has them)."""
        out: dict[str, object] = {}
        planner = engine.planner
        h = getattr(planner, "history", {}).get(request_id)
        if h is not None:
            out.update(wait=h.wait, interval=h.interval, probing=h.probing, speedup=round(h.speedup, 3))
        if hasattr(planner, "probe_budget"):
            out.update(budget_ms=round(1e3 * planner.probe_budget, 1), population=len(planner.population.requests))
        cost = getattr(planner, "cost", None)
        if cost is not None:  # the target-only step of one token the prices are held to, and the stages' levels
            out.update(plain_ms=round(1e3 * (cost.plain_seconds(1) + cost.overhead), 2),
                       scales=[round(cost.scale(stage), 3) for stage in ("plain", "verify", "draft")])
        scorer = engine.scorer
        if scorer is not None and hasattr(scorer, "slope"):
            out.update(slope=round(float(scorer.slope), 3),
                       intercepts=[round(float(v), 2) for v in scorer.intercepts.tolist()],
                       changes=scorer.num_changes)
        return out

    def summary(self) -> str:
        """Each request's decoding steps that drafted / did not, since the last summary (a line per method)."""
        lines = [f"{'':<12} {method} steps drafting / not, per request: "
                 + " ".join(f"{r}: {c['drafted']}/{c['not']}" for r, c in requests.items())
                 for method, requests in self.steps.items()]
        self.steps = {}
        self.file.flush()
        return "\n".join(lines)

    def close(self) -> None:
        self.file.close()


def step_orders(methods: int, seed: int) -> Iterator[list[int]]:
    """The order the methods' engines step in, turn after turn: a permutation drawn afresh every turn
    (from a generator seeded by the round), so every method meets the machine's moments and its
    neighbours alike. A step's time depends on the step before it: with the order listed and
    reversed every turn, AV always stepped next to static K = 8 (its heavy steps on one side) and
    target-only next to static K = 1, and AV decoding nothing but target-only's steps read
    0.95-0.98x target-only at concurrency 8 in every workload, 1.02x where the two ran alone
    (docs/adaptive.md, "Zen 3 EPYC, AVX2 only: commit 407804e, and the methods' step order"); at
    concurrency 8 every prompt is prefilled in the first step, where the order listed put AV's
    prefill sixth (13.4 s against target-only's 11.1 s on code, "Zen 4 EPYC, commit ee63101")."""
    generator = random.Random(seed)
    while True:
        order = list(range(methods))
        generator.shuffle(order)
        yield order


def run_cell(target, drafter, methods: list[Method], prompts: list[list[int]], max_tokens: int,
             concurrency: int, profile: CostProfile, seed: int = 0, trace: Trace | None = None) -> dict[str, Run]:
    """Every method on the same prompts, each in its own engine, the engines stepping in turn, in
    `step_orders` (seed: the round's): a method's time is the sum of its own steps, each timed alone,
    so the machine's drift falls on every method alike (see the module docstring)."""
    params = [SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True, **PARAMS) for i in range(len(prompts))]
    engines = []
    for name, k, adaptive, config, estimator in methods:
        engine, result, prefilled = _instrumented(target, drafter, name, k, adaptive, concurrency, profile, config,
                                                  estimator)
        if trace is not None and adaptive:
            trace.attach(engine, name)
        for prompt, sp in zip(prompts, params):
            engine.add_request(prompt, sp)
        engines.append((engine, result, prefilled))
    for order in step_orders(len(engines), seed):
        live = [engines[i] for i in order if engines[i][0].has_work()]
        if not live:
            break
        for engine, result, prefilled in live:
            prefilled[0] = False
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            result.seconds += seconds
            if prefilled[0]:
                result.prefill_seconds += seconds
    for engine, result, _ in engines:
        stats = engine.stats
        result.tokens, result.steps = stats.emitted_tokens, stats.steps
        result.drafted, result.admitted, result.skipped = stats.drafted, stats.admitted, stats.skipped
        result.by_reason = dict(stats.by_reason)
    return {result.method: result for _, result, _ in engines}


def _instrumented(target, drafter, method: str, k: int, adaptive: bool, concurrency: int, profile: CostProfile,
                  config: AdaptiveConfig, estimator: EstimatorConfig = EstimatorConfig()
                  ) -> tuple[Engine, Run, list[bool]]:
    """A method's engine with the listeners and timers its Run needs, the Run, and a flag its
    listener sets when a step prefilled a prompt."""
    engine = build_engine(target, drafter, k, adaptive, concurrency, profile, config, estimator)
    result = Run(method)
    prefilled = [False]

    def listen(record: StepRecord) -> None:
        prefilled[0] = bool(record.prefill_tokens)
        if adaptive and record.plan.predicted is not None and not record.prefill_tokens:  # decoding steps
            result.predicted_seconds += record.plan.predicted.total
            result.measured_seconds += record.times.total
        if method == "static K=8":
            result.replay.append(_replay_step(record))
    engine.step_listeners.append(listen)
    if adaptive:
        _Timed(result, engine.planner, ("draft_plan", "plan", "observe"))
        _Timed(result, engine.scorer, ("score", "observe"))
        original_draft_plan = engine.planner.draft_plan

        def draft_plan(*args):  # the stop rule runs inside the drafter: time it too
            plan = original_draft_plan(*args)
            if plan.stop_rule is not None:
                _Timed(result, plan.stop_rule, ("keep_drafting",))
            return plan

        engine.planner.draft_plan = draft_plan
    return engine, result, prefilled


def warm_thread_policy(model: PackedCausalLM, max_rows: int) -> None:
    """Run the model's thread policy through its trial forwards in every row-count group up to
    max_rows (one forward size per group: 1, 2, 4, ...), so that no measured cell pays for them."""
    if model.threads is None:
        return
    gen = torch.Generator().manual_seed(0)
    rows = 1
    while True:
        n = min(rows, max_rows)
        for _ in range(ThreadChoice.warmup_forwards(torch.get_num_threads())):
            tokens = torch.randint(0, model.vocab_size, (n,), generator=gen).tolist()
            model.forward([tokens], [model.new_cache(n)], [1])
        if rows >= max_rows:
            return
        rows *= 2


def _replay_step(record: StepRecord) -> _Step:
    admitted = int(record.num_admitted.sum())
    return _Step(record.verify_tokens - admitted, record.verify_attended, record.num_accepted.tolist(),
                 list(record.drafts.forwards), admitted, [r.request_id for r in record.requests],
                 list(record.draft_pending), [r.num_tokens for r in record.requests])


def oracle_forwards(step: _Step, unseen: dict[str, int]) -> list[tuple[int, int]]:
    """The oracle's drafter forwards in a K=8 step, as (tokens, attended): forward j drafts slot j
    of every request whose draft was accepted to slot j at least. A request's first forward feeds
    what its drafter has not seen: K=8's pending tokens (its prompt in its first step), and those
    of the steps the oracle did not draft it in, kept in `unseen` (request id -> tokens; updated)."""
    forwards: list[tuple[int, int]] = []
    for j in range(1, max(step.accepted, default=0) + 1):
        tokens = attending = 0
        for request_id, accepted, pending, length in zip(step.request_ids, step.accepted, step.draft_pending,
                                                         step.tokens):
            if accepted < j:
                continue
            fed = pending + unseen.get(request_id, 0) if j == 1 else 1
            tokens += fed
            attending += attended(fed, length - fed + j - 1)  # its drafter's cache holds the rest
        forwards.append((tokens, attending))
    for request_id, accepted, pending in zip(step.request_ids, step.accepted, step.draft_pending):
        unseen[request_id] = 0 if accepted else unseen.get(request_id, 0) + pending
    return forwards


def oracle(k8: Run, profile: CostProfile) -> Run:
    """Draft and verify exactly up to the first rejection, on the K=8 run's steps (see the module docstring)."""
    cost = CostModel(profile)
    predicted_k8 = predicted_oracle = 0.0
    drafted = 0
    unseen: dict[str, int] = {}
    for step in k8.replay:
        verified = step.pending + step.admitted
        predicted_k8 += cost.predict(step.forwards, verified, step.attended).total
        per_token = step.attended / max(verified, 1)  # attention's work per verified token
        forwards = oracle_forwards(step, unseen)
        drafted += sum(step.accepted)
        oracle_verified = step.pending + sum(step.accepted)
        predicted_oracle += cost.predict(forwards, oracle_verified, round(oracle_verified * per_token)).total
    seconds = k8.seconds * predicted_oracle / predicted_k8 if predicted_k8 else float("nan")
    return Run("oracle", k8.tokens, seconds, k8.steps, drafted, drafted,
               prefill_seconds=k8.prefill_seconds)  # the same prompts prefilled by the same target


def goals(cell: dict[str, Run], concurrency: int) -> list[str]:
    av, target_only = cell["AV"], cell["target-only"]
    static = {m: r for m, r in cell.items() if m.startswith("static")}
    if not static:  # --ks none: AV against target-only alone
        return [f"AV >= 0.98x target-only: {av.tps / target_only.tps:.2f}x -> "
                f"{'met' if av.tps / target_only.tps >= 0.98 else 'MISSED'}"]
    oracle_run = cell["oracle"]
    best_static = max(static.values(), key=lambda r: r.tps)
    best_plain = max([target_only, best_static], key=lambda r: r.tps)
    checks = []
    if concurrency == 1:
        checks.append(("AV >= 0.98x the best of target-only and static K", av.tps / best_plain.tps, 0.98))
    else:
        checks.append(("AV above the best static K", av.tps / best_static.tps, 1.0 + 1e-9))
    checks.append(("AV >= 0.9x the oracle", av.tps / oracle_run.tps, 0.9))
    checks.append(("AV >= 0.98x target-only", av.tps / target_only.tps, 0.98))
    return [f"{name}: {ratio:.2f}x -> {'met' if ratio >= need else 'MISSED'}" for name, ratio, need in checks]


def print_cell(workload: str, concurrency: int, cell: dict[str, Run]) -> None:
    base = cell["target-only"].tps
    best_static = max((r.tps for m, r in cell.items() if m.startswith("static")), default=float("nan"))
    oracle_tps = cell["oracle"].tps if "oracle" in cell else float("nan")
    for method, r in cell.items():
        per_step = r.tokens / r.steps if r.steps else float("nan")
        print(f"{workload:<6} {concurrency:>4}  {method:<12} {r.tps:>8.2f} {r.tps / base:>8.2f} {r.tps / best_static:>8.2f} "
              f"{r.tps / oracle_tps:>8.2f} {per_step:>8.2f} {r.drafted / max(r.steps, 1):>8.2f} "
              f"{r.admitted / max(r.steps, 1):>8.2f} {r.skipped:>7d} {r.prefill_seconds:>8.1f} "
              f"{cell['target-only'].decode_seconds / r.decode_seconds:>8.2f}", flush=True)
    av = cell["AV"]
    share = av.planning_seconds / av.seconds if av.seconds else float("nan")
    print(f"{'':<12} AV planner + estimator + cost model: {1e3 * av.planning_seconds / max(av.steps, 1):.2f} ms "
          f"per step, {100 * share:.2f}% of AV's time; its decoding steps predicted at "
          f"{av.predicted_seconds / max(av.measured_seconds, 1e-9):.2f}x their measured time; "
          + "; ".join(goals(cell, concurrency)), flush=True)
    for reason, counts in sorted(av.by_reason.items()):
        print(f"{'':<12} AV drafted for {reason}: {counts}", flush=True)


def plot(results: dict[tuple[str, int], dict[str, Run]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(results)
    methods = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(cells)), 4.5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        ratios = [results[c][method].tps / results[c]["target-only"].tps for c in cells]
        ax.bar([i + j * width for i in range(len(cells))], ratios, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    ax.set_xticklabels([f"{w}\nC={c}" for w, c in cells])
    ax.set_ylabel("tokens/s relative to target-only")
    ax.set_title("adaptive verification on the packaged pair (temperature 0.7, top-k 20, top-p 0.8)")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="code,chat,prose")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=8, help="requests per cell")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each cell runs (every method stepping in turn); a cell's figures are over "
                             "all rounds")
    parser.add_argument("--ks", default="1,2,4,8",
                        help="static K values (8 is needed for the oracle); none: target-only and AV alone "
                             "(a control of AV's cost where it does not draft, with --rounds)")
    parser.add_argument("--av-k", type=int, default=8, help="AV's num_speculative_tokens (the deepest it drafts)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-vocab-size", type=int, default=PACKAGED_SPECULATIVE.draft_vocab_size or 0,
                        help="the drafter's vocabulary-subset head for every method, as the packaged default "
                             "runs it (0: the full head)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--av-variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                        help="also run AV with these AdaptiveConfig fields changed, EstimatorConfig fields "
                             "named estimator.FIELD (repeatable)")
    parser.add_argument("--plot", default=None, help="write the bar chart here (PNG)")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="write AV's (and its variants') decisions here (JSON lines, one per step and request), and print each "
                             "request's steps that drafted and that did not per cell")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [] if args.ks == "none" else [int(k) for k in args.ks.split(",")]
    if ks and 8 not in ks:
        parser.error("--ks must include 8: the oracle replays the static K=8 run")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    target = load_checkpoint("default", args.dtype, role="target")
    drafter = load_checkpoint("default", args.dtype, role="drafter")
    check_same_vocabulary(target, drafter)
    head = args.draft_vocab_size or None
    if head is not None:
        apply_vocab_subset(drafter, head)
    probe = build_engine(target, drafter, args.av_k, False, max(concurrencies), None)
    key = profile_key(models_key("default", "default", args.dtype, head))
    profile = load_or_profile(probe.verifier, probe.drafter, key, packaged.cache_root() / PROFILE_FILE,
                              max(concurrencies) * (args.av_k + 1), max(concurrencies))
    variants = [(f"AV {v}", args.av_k, True, *_variant(parser, v)) for v in args.av_variant]
    default, estimator = AdaptiveConfig(), EstimatorConfig()
    methods = ([("target-only", 0, False, default, estimator)] + [(f"static K={k}", k, False, default, estimator)
                                                                  for k in ks]
               + [("AV", args.av_k, True, default, estimator)] + variants)
    cpu = cpu_model()
    print(f"packaged pair, {args.dtype}, drafter head {head or 'full'}, {torch.get_num_threads()} threads, {cpu}; "
          f"{args.requests} requests x "
          f"{args.max_tokens} tokens per cell (EOS ignored), temperature 0.7, top-k 20, top-p 0.8")
    # warm-up: first calls' allocations, kernel plans
    run_cell(target, drafter, methods, [encode_prompt(target.tokenizer, "Hi")], 8, 1, profile)
    workloads = {w: [encode_prompt(target.tokenizer, messages=p.chat()) for p in load_workload(w)[: args.requests]]
                 for w in args.workloads.split(",")}
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    for model in (target.model, drafter.model):  # a prefill of C prompts at once, at the most
        warm_thread_policy(model, max(concurrencies) * longest + max(concurrencies) * (args.av_k + 1))
    print(f"{'work':<6} {'conc':>4}  {'method':<12} {'tok/s':>8} {'vs T-o':>8} {'vs best':>8} {'vs orac':>8} "
          f"{'tok/step':>8} {'drft/st':>8} {'verf/st':>8} {'skipped':>7} {'prefill':>8} {'dec/T-o':>8}")
    results: dict[tuple[str, int], dict[str, Run]] = {}
    trace = Trace(args.trace) if args.trace else None
    for workload, prompts in workloads.items():
        for concurrency in concurrencies:
            cell: dict[str, Run] = {}
            for round_ in range(args.rounds):
                if trace is not None:
                    trace.start(workload, concurrency, round_)
                runs = run_cell(target, drafter, methods, prompts, args.max_tokens, concurrency, profile, round_, trace)
                for name, r in runs.items():
                    cell[name] = cell[name].merge(r) if name in cell else r
            cell |= {"oracle": oracle(cell["static K=8"], profile)} if ks else {}
            results[(workload, concurrency)] = cell
            print_cell(workload, concurrency, cell)
            if trace is not None:
                print(trace.summary(), flush=True)
    if trace is not None:
        trace.close()
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


def _variant(parser: argparse.ArgumentParser, variant: str) -> tuple[AdaptiveConfig, EstimatorConfig]:
    """--av-variant "probe_share=0.01,estimator.trust_radius=inf" -> the default AdaptiveConfig and
    EstimatorConfig with those fields changed (an estimator field is named estimator.FIELD)."""
    defaults = {"": AdaptiveConfig(), "estimator.": EstimatorConfig()}
    types = {prefix + f.name: type(getattr(config, f.name))
             for prefix, config in defaults.items() for f in fields(config)}
    changes: dict[str, dict[str, object]] = {prefix: {} for prefix in defaults}
    for item in variant.split(","):
        name, _, value = item.partition("=")
        if name not in types or not value:
            parser.error(f"--av-variant {variant!r}: {item!r} is not FIELD=VALUE with FIELD one of {sorted(types)}")
        prefix = "estimator." if name.startswith("estimator.") else ""
        changes[prefix][name.removeprefix(prefix)] = types[name](value)
    try:
        return tuple(dataclasses.replace(config, **changes[prefix]) for prefix, config in defaults.items())
    except ValueError as e:
        parser.error(f"--av-variant {variant!r}: {e}")


if __name__ == "__main__":
    main()
