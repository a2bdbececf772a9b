"""The start-up cost profile: how long the draft and verify stages take on this machine.

Owns: measuring the two stages through the stages themselves (the drafter's `propose` for one
slot of A requests, the verifier's `verify` of T tokens), each at a grid of sizes on a short
context and once on a longer one with many tokens (attention's seconds per attended position:
per token and per cached position, so one token over a long context would barely show it),
and caching the result per
machine (CPU model and flags, torch, native kernel build), models, dtype and threads in
`<cache>/cost-profile.json`. `specav profile` prints it. The cost model
(verification/cost_model.py) turns the profile into predictions and corrects it online.

Must not know: the planner's rules, the estimator, the server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from specav.config import SamplingParams
from specav.drafting.base import Drafter
from specav.engine.target import TargetVerifier
from specav.models.cache import atomic_write
from specav.models.threads import ThreadChoice
from specav.request import Request
from specav.types import AcceptResult, attended
from specav.verification.cost_model import CostCurve, CostProfile

PROFILE_FILE = "cost-profile.json"
VERIFY_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)  # past 64 the curve extends linearly
DRAFT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SHORT_CONTEXT, LONG_CONTEXT = 64, 576
CATCH_UP = 128  # tokens of one request in one drafter forward: a catch-up (a new prompt, skipped tokens)
PROFILE_VERSION = 6  # bumped when what is measured, or how, changes (2: thread policy warmed first; 3: catch-up;
#                     4: attention priced per attended position; 5: the thread policy's doubling groups;
#                     6: 7 repeats, curves fitted without flat steps)
ATTENTION_TOKENS = 16  # the verify that measures attention's per-position cost (or the largest measured)
REPEATS = 7  # per size: with 3, on the Zen 4 EPYC, verify(16) / verify(8) read 1.42-1.94 in four profiles minutes
#             apart and adjacent sizes pooled into flat steps (a slot priced free); with 7, 1.54-1.67
_PARAMS = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, max_tokens=1 << 20)  # the usual sampling


def models_key(target: str, drafter: str, dtype: str, draft_vocab_size: int | None = None) -> str:
    """The models part of a profile's key: the pair, its dtype, and the drafter's head where it
    computes a vocabulary subset (a cheaper drafter forward: its own profile)."""
    head = f" head {draft_vocab_size}" if draft_vocab_size is not None else ""
    return f"target {target} | drafter {drafter}{head} | {dtype}"


def profile_key(models: str, threads: int | None = None) -> str:
    """What a profile is valid for: machine, torch, kernel build, models and dtype, threads."""
    from specav.models.quant_choice import machine_key

    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    threads = threads or torch.get_num_threads()
    return (f"{machine_key()} | cpu flags {hashlib.sha256(flags.encode()).hexdigest()[:12]} | {models} | "
            f"{threads} threads | profile v{PROFILE_VERSION}")


def load_or_profile(verifier: TargetVerifier, drafter: Drafter | None, key: str, cache_path: Path | None,
                    max_verify_tokens: int, max_draft_rows: int, refresh: bool = False,
                    progress: bool = True) -> CostProfile:
    """The cached profile for `key` if it covers these sizes, or a fresh measurement (then cached:
    a profile measured for a larger engine serves a smaller one, not the other way round)."""
    cached = None if refresh else cached_profile(key, cache_path, drafter is not None, max_verify_tokens, max_draft_rows)
    if cached is not None:
        return cached
    profile = measure_profile(verifier, drafter, max_verify_tokens, max_draft_rows, key, progress)
    if cache_path is not None:
        _write(cache_path, key, profile)
    return profile


def cached_profile(key: str, cache_path: Path | None, drafting: bool, max_verify_tokens: int,
                   max_draft_rows: int) -> CostProfile | None:
    """The profile cached for `key`, if it covers these sizes (None otherwise)."""
    cached = _read(cache_path).get(key) if cache_path is not None else None
    if cached is None:
        return None
    profile = CostProfile.from_dict(cached)
    return profile if _covers(profile, drafting, max_verify_tokens, max_draft_rows) else None


def record_draft_load(cache_path: Path | None, key: str, seconds: float) -> None:
    """Keep what the drafter's load took in the profile cached for `key` (the expectation a
    deferred load is priced at next time: drafting/deferred.py); nothing if none is cached."""
    cached = _read(cache_path).get(key) if cache_path is not None else None
    if cached is not None:
        _write(cache_path, key, dataclasses.replace(CostProfile.from_dict(cached), draft_load=seconds))


def _covers(profile: CostProfile, drafting: bool, max_verify_tokens: int, max_draft_rows: int) -> bool:
    """Whether a profile measured the sizes an engine with these limits uses (past the grid's end
    every profile extends its last segment, so the grid's end is enough; larger grids hold every
    smaller grid's end)."""
    verify_end = max([t for t in VERIFY_TOKENS if t <= max(1, max_verify_tokens)])
    draft_end = max([a for a in DRAFT_ROWS if a <= max(1, max_draft_rows)])
    if verify_end not in profile.verify.tokens:
        return False
    return not drafting or (profile.draft is not None and draft_end in profile.draft.tokens
                            and CATCH_UP in profile.draft.tokens)


def measure_profile(verifier: TargetVerifier, drafter: Drafter | None, max_verify_tokens: int,
                    max_draft_rows: int, key: str = "", progress: bool = True) -> CostProfile:
    """Time the verify stage at VERIFY_TOKENS (up to max_verify_tokens) and the draft stage at
    DRAFT_ROWS (up to max_draft_rows), median of REPEATS each taken in rounds over the sizes (so a
    slow minute does not bend the curve's shape), on a SHORT_CONTEXT-token context;
    the draft stage also at a CATCH_UP-token forward of one request (what a catch-up costs, past
    the rows measured). Attention's seconds per attended position: the ATTENTION_TOKENS verify and
    the catch-up once more over LONG_CONTEXT; the curves keep the rest (each point less the
    attention it measured).

    The contexts are prefilled once and shared: every verify size runs on one request, every row
    count on the first rows of one pool of requests (each call adds a token to what they cache, and
    each point is taken less the attention it did). Prefilling a context per size was most of the
    measurement: 136 s for one request and 313 s for 16 on the AVX2 EPYC, 97 s and 179 s shared."""
    gen = torch.Generator().manual_seed(0)
    vocab = verifier.model.vocab_size
    verify_sizes = [t for t in VERIFY_TOKENS if t <= max(1, max_verify_tokens)]
    draft_sizes = [a for a in DRAFT_ROWS if a <= max(1, max_draft_rows)] if drafter is not None else []
    total = len(verify_sizes) + len(draft_sizes) + (3 if draft_sizes else 1)
    if progress:
        print(f"specav: profiling the draft and verify stages once for this machine ({total} shapes)",
              file=sys.stderr, flush=True)
    started = time.perf_counter()
    warmup = ThreadChoice.warmup_forwards(torch.get_num_threads())  # a model's thread policy tries each
    short = _dummy_requests(1, SHORT_CONTEXT, vocab, gen, "profile-short")[0]
    pool = _dummy_requests(max(draft_sizes, default=0), SHORT_CONTEXT, vocab, gen, "profile-row")
    try:
        _timed_verify(verifier, short, [])  # its context, for every verify below
        if pool:
            _prefill_drafter(drafter, pool)
        verifies = {t: _verify_timer(verifier, short, t, vocab, gen) for t in verify_sizes}
        drafts = {a: _draft_timer(drafter, pool[:a]) for a in draft_sizes}
        for t in _one_per_group(verify_sizes):  # count first, per row-count group
            _rounds({t: verifies[t]}, warmup)
        for a in _one_per_group(draft_sizes):
            _rounds({a: drafts[a]}, warmup)
        if draft_sizes:
            _time_catch_up(drafter, CATCH_UP, SHORT_CONTEXT, vocab, gen, warmup)
        verify = _rounds(verifies)
        t = max(s for s in verify_sizes if s <= ATTENTION_TOKENS)
        verify_curve = _fit(verify, _verify_attention(verifier, short, t, vocab, gen))
        draft_curve = None
        if drafter is not None:
            draft = _rounds(drafts)
            draft[CATCH_UP] = _time_catch_up(drafter, CATCH_UP, SHORT_CONTEXT, vocab, gen)  # past DRAFT_ROWS
            draft_curve = _fit(draft, _catch_up_attention(drafter, CATCH_UP, vocab, gen))
    finally:
        verifier.release(short)
        for r in pool:
            drafter.release(r)
    if progress:
        print(f"specav: profiled in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return CostProfile(verify_curve, draft_curve, key)


def _one_per_group(sizes: list[int]) -> list[int]:
    """The first of `sizes` in each of the thread policy's row-count groups (what warms each group)."""
    firsts: dict[int, int] = {}
    for n in sorted(sizes):
        firsts.setdefault(ThreadChoice.group_of(n), n)
    return list(firsts.values())


def _fit(points: dict[int, tuple[float, float]], per_position: float) -> CostCurve:
    """A curve from measured points, size -> (seconds, positions attended), each less its attention,
    plus attention's seconds per position."""
    per_position = max(0.0, per_position)
    rest = {size: max(0.0, s - per_position * positions) for size, (s, positions) in points.items()}
    return CostCurve.fit(rest, per_position)


def _per_position(pairs: list[tuple[tuple[float, int], tuple[float, int]]]) -> float:
    """Median over ((seconds, attended) short, (seconds, attended) long) pairs, timed back to back
    so the machine's drift cancels, of the seconds per attended position."""
    return statistics.median((long[0] - short[0]) / (long[1] - short[1]) for short, long in pairs)


def _verify_attention(verifier: TargetVerifier, short: Request, tokens: int, vocab: int, gen: torch.Generator,
                      repeats: int = 7) -> float:
    """The verify stage's seconds per attended position, from `tokens`-token verifies of the short
    request and of one over LONG_CONTEXT, timed back to back."""
    long = _dummy_requests(1, LONG_CONTEXT, vocab, gen, "profile-long")[0]
    try:
        _timed_verify(verifier, long, [])
        over_short, over_long = (_verify_timer(verifier, r, tokens, vocab, gen) for r in (short, long))
        return _per_position([(over_short(), over_long()) for _ in range(repeats)])
    finally:
        verifier.release(long)


def _catch_up_attention(drafter: Drafter, tokens: int, vocab: int, gen: torch.Generator, repeats: int = 7) -> float:
    """The draft stage's seconds per attended position, from `tokens`-token catch-ups over
    SHORT_CONTEXT and LONG_CONTEXT, timed back to back."""
    short = _dummy_requests(1, SHORT_CONTEXT, vocab, gen, "profile-short-draft")[0]
    long = _dummy_requests(1, LONG_CONTEXT, vocab, gen, "profile-long")[0]
    try:
        _prefill_drafter(drafter, [short, long])
        return _per_position([(_timed_catch_up(drafter, short, tokens, vocab, gen),
                               _timed_catch_up(drafter, long, tokens, vocab, gen)) for _ in range(repeats)])
    finally:
        drafter.release(short)
        drafter.release(long)


def _timed_verify(verifier: TargetVerifier, request: Request, slots: list[int]) -> float:
    """Seconds of one verify of a request's pending tokens + `slots`, then its commit (none accepted)."""
    start = time.perf_counter()
    verifier.verify([request], [slots])
    seconds = time.perf_counter() - start
    rejected = AcceptResult(torch.zeros(1, dtype=torch.int64), [[slots[0] if slots else 0]])
    verifier.commit([request], [len(slots)], rejected)
    return seconds


def _prefill_drafter(drafter: Drafter, requests: list[Request]) -> None:
    """Feed requests' prompts to the drafter (one drafted slot each, rejected), in one forward."""
    n = len(requests)
    drafter.commit(requests, drafter.propose(requests, [1] * n),
                   AcceptResult(torch.zeros(n, dtype=torch.int64), [[0]] * n))


def _timed_catch_up(drafter: Drafter, request: Request, tokens: int, vocab: int, gen: torch.Generator
                    ) -> tuple[float, int]:
    """Seconds of one drafting slot of a request after it skipped tokens - 1 steps (its drafter feeds
    `tokens` pending tokens), and the positions that forward attended to."""
    skipped = torch.randint(0, vocab, (tokens - 1,), generator=gen).tolist()
    idle = drafter.propose([request], [0])
    drafter.commit([request], idle, AcceptResult(torch.zeros(1, dtype=torch.int64), [skipped]))
    start = time.perf_counter()
    drafts = drafter.propose([request], [1])
    seconds = time.perf_counter() - start
    drafter.commit([request], drafts, AcceptResult(torch.zeros(1, dtype=torch.int64), [[0]]))
    return seconds, drafts.forwards[0][1]


def _dummy_requests(n: int, context: int, vocab: int, gen: torch.Generator, name: str = "profile") -> list[Request]:
    return [Request(torch.randint(0, vocab, (context,), generator=gen).tolist(), _PARAMS,
                    request_id=f"{name}-{i}") for i in range(n)]


def _rounds(timers: dict[int, Callable[[], tuple[float, float]]], repeats: int = REPEATS) -> dict[int, tuple[float, float]]:
    """Per size, the median seconds and positions attended of `repeats` calls of its timer, the sizes
    taking turns round by round: a slow minute falls on every size alike, not on the sizes measured
    in it (the curve's shape, not its level, is what the planner's rules weigh; the online scales
    follow the level)."""
    samples: dict[int, list[tuple[float, float]]] = {size: [] for size in timers}
    for _ in range(repeats):
        for size, timer in timers.items():
            samples[size].append(timer())
    return {size: (statistics.median(s for s, _ in got), statistics.median(a for _, a in got))
            for size, got in samples.items()}


def _verify_timer(verifier: TargetVerifier, request: Request, tokens: int, vocab: int, gen: torch.Generator
                  ) -> Callable[[], tuple[float, float]]:
    """One verify of the (prefilled) request's pending token + tokens - 1 slots: (seconds, positions attended)."""
    slots = torch.randint(0, vocab, (tokens - 1,), generator=gen).tolist()

    def timer() -> tuple[float, float]:
        positions = attended(tokens, verifier.shapes([request])[0].context)
        return _timed_verify(verifier, request, slots), positions

    return timer


def _draft_timer(drafter: Drafter, requests: list[Request]) -> Callable[[], tuple[float, float]]:
    """One drafting slot of the (prefilled) requests, one pending token each: (seconds, positions attended)."""
    rows = len(requests)

    def timer() -> tuple[float, float]:
        start = time.perf_counter()
        drafts = drafter.propose(requests, [1] * rows)
        seconds = time.perf_counter() - start
        last = drafts.token_ids[:, 0].tolist()
        drafter.commit(requests, drafts, AcceptResult(torch.zeros(rows, dtype=torch.int64), [[t] for t in last]))
        return seconds, drafts.forwards[0][1]

    return timer


def _time_catch_up(drafter: Drafter, tokens: int, context: int, vocab: int, gen: torch.Generator,
                   repeats: int = REPEATS) -> tuple[float, float]:
    """Median seconds of one drafting slot of one request with `tokens` pending tokens (it skipped
    tokens - 1 steps) over a cached context, and the positions it attended to (their median)."""
    times, positions = [], []
    for _ in range(repeats):
        request = _dummy_requests(1, context, vocab, gen, "profile-catch-up")[0]
        try:
            _prefill_drafter(drafter, [request])
            seconds, attended_positions = _timed_catch_up(drafter, request, tokens, vocab, gen)
            times.append(seconds)
            positions.append(attended_positions)
        finally:
            drafter.release(request)
    return statistics.median(times), statistics.median(positions)


def format_profile(profile: CostProfile) -> str:
    """The profile as a table (what `specav profile` prints)."""
    lines = [f"cost profile: {profile.key}", "verify stage (target forward + processed distributions):",
             "  tokens  " + " ".join(f"{t:>7d}" for t in profile.verify.tokens),
             "  ms      " + " ".join(f"{s * 1e3:7.2f}" for s in profile.verify.seconds),
             f"  + {profile.verify.per_context * 1e6:.3f} us per attended position (tokens x cached positions)"]
    if profile.draft is not None:
        lines += [f"draft stage, one slot (drafter forward + sampling + features; {CATCH_UP}: one request's catch-up):",
                  "  rows    " + " ".join(f"{t:>7d}" for t in profile.draft.tokens),
                  "  ms      " + " ".join(f"{s * 1e3:7.2f}" for s in profile.draft.seconds),
                  f"  + {profile.draft.per_context * 1e6:.3f} us per attended position",
                  f"  one drafter slot / one target token: {profile.draft(1) / profile.verify(1):.2f}"]
        if profile.draft_load is not None:
            lines.append(f"  drafter load (last measured): {profile.draft_load:.1f} s")
    v1 = profile.verify(1)
    lines.append("  verify cost relative to one token: " + ", ".join(
        f"{t} tokens {profile.verify(t) / v1:.2f}x" for t in (2, 5, 9, 16) if t <= profile.verify.tokens[-1]))
    return "\n".join(lines)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, key: str, profile: CostProfile) -> None:
    data = _read(path)
    data[key] = profile.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(data, indent=1, sort_keys=True)
        atomic_write(path, lambda f: f.write(text.encode()))
    except OSError as e:  # a read-only cache: the profile still serves this run
        print(f"specav: could not cache the cost profile in {path} ({e}); it will be measured again next time",
              file=sys.stderr)
