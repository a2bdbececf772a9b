"""Tests for specav.verification.rejection.

Two layers of evidence:
  * exact enumeration: the accept / recover / bonus rule (the module's docstring, with its
    `residual_probs`) is evaluated analytically over every draft outcome and branch, with an
    admission policy in the loop, and the distribution of the first emitted tokens is compared
    with the target's own, to 1e-6. Lossy policies must deviate: the harness shows its power;
  * sampling: `rejection_sample` on a ragged batch, over many seeds, matches those exact
    distributions (chi-square, fixed seeds) and equals `rejection_sample_reference` draw for draw;
    a deliberately broken sampler fails the same test.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specav.models import native
from specav.token_probs import TokenProbs
from specav.types import DraftBatch, Ragged
from specav.verification import rejection
from specav.verification.rejection import rejection_sample, rejection_sample_reference, residual_probs
from specav.verification.sampling import processed_probs, sample


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: on a shared 2-core machine intra-op threads only add wake-up latency."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ================================================================ exact enumeration harness

Context = tuple[int, ...]
Table = Callable[[Context], np.ndarray]  # context -> [V] processed distribution (float64)
Policy = Callable[[Sequence[np.ndarray], Context], int]  # (q_1..q_K, x_1..x_K) -> admitted k
Dist = dict[Context, float]


@dataclass(frozen=True)
class Toy:
    """A toy target / drafter pair given by explicit conditional tables."""

    p: Table
    q: Table


@dataclass(frozen=True)
class Params:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def make_table(seed: int, V: int, params: Params, autoregressive: bool = True,
               zero_frac: float = 0.0, scale: float = 1.5) -> Table:
    """Random logits per context (or per position only), through processed_probs.

    zero_frac masks that fraction of tokens to -inf (always keeping one), so p and q built
    with different seeds have zeros where the other has mass.
    """

    @functools.lru_cache(maxsize=None)
    def table(context: Context) -> np.ndarray:
        key = context if autoregressive else (len(context),)
        rng = np.random.default_rng([seed, len(key), *key])
        logits = rng.normal(0.0, scale, V)
        masked = rng.random(V) < zero_frac
        masked[rng.integers(V)] = False
        logits[masked] = -np.inf
        row = torch.tensor(logits, dtype=torch.float32)[None]
        probs = processed_probs(row, torch.tensor([params.temperature]), torch.tensor([params.top_k]),
                                torch.tensor([params.top_p]))
        row = probs[0].double().numpy()
        return row / row.sum()  # float64, so exact sums hold to ~1e-15 instead of float32 rounding

    return table


def draft_outcomes(toy: Toy, context: Context, K: int) -> list[tuple[Context, float]]:
    """Every draft x_1..x_K with positive probability, and that probability under q."""
    drafts: list[tuple[Context, float]] = [((), 1.0)]
    for _ in range(K):
        drafts = [(xs + (x,), w * qx) for xs, w in drafts
                  for x, qx in enumerate(toy.q(context + xs)) if qx > 0]
    return drafts


def verify_outcomes(toy: Toy, context: Context, admitted: Context) -> list[tuple[Context, float]]:
    """Every emitted sequence of rejection sampling on the admitted drafts, with its probability."""
    out, reach = [], 1.0
    for i, x in enumerate(admitted):
        ctx = context + admitted[:i]
        p, q = toy.p(ctx), toy.q(ctx)
        accept = min(1.0, p[x] / q[x])  # P(u * q < p), u ~ U[0, 1)
        recovered = residual_probs(torch.from_numpy(p)[None], torch.from_numpy(q)[None])[0].numpy()
        out += [(admitted[:i] + (y,), reach * (1 - accept) * r) for y, r in enumerate(recovered) if r > 0]
        reach *= accept
    bonus = toy.p(context + admitted)
    return out + [(admitted + (y,), reach * r) for y, r in enumerate(bonus) if r > 0]


def step_distribution(toy: Toy, context: Context, K: int, policy: Policy) -> Dist:
    """Exact distribution of the tokens one speculative step emits from `context`."""
    out: Dist = defaultdict(float)
    for drafts, w in draft_outcomes(toy, context, K):
        q_rows = [toy.q(context + drafts[:i]) for i in range(K)]
        k = policy(q_rows, drafts)
        for emitted, v in verify_outcomes(toy, context, drafts[:k]):
            out[emitted] += w * v
    return out


def first_tokens(toy: Toy, K: int, policy: Policy, n: int, context: Context = ()) -> Dist:
    """Exact distribution of the first n tokens emitted by repeated speculative steps."""
    out: Dist = defaultdict(float)
    for emitted, w in step_distribution(toy, context, K, policy).items():
        if len(emitted) >= n:
            out[emitted[:n]] += w
            continue
        for rest, v in first_tokens(toy, K, policy, n - len(emitted), context + emitted).items():
            out[emitted + rest] += w * v
    return out


def target_tokens(toy: Toy, n: int, context: Context = ()) -> Dist:
    """Exact distribution of the first n tokens sampled from the target alone."""
    seqs: list[tuple[Context, float]] = [((), 1.0)]
    for _ in range(n):
        seqs = [(s + (y,), w * py) for s, w in seqs for y, py in enumerate(toy.p(context + s)) if py > 0]
    return dict(seqs)


def deviation(a: Dist, b: Dist) -> float:
    return max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


# ---------------------------------------------------------------- policies


def admit_all(K: int) -> Policy:
    return lambda q_rows, drafts: K


def admit_while_q_max(threshold: float) -> Policy:
    """Lossless: slot i is admitted from q_1..q_i alone; stop at the first slot that fails."""

    def policy(q_rows: Sequence[np.ndarray], drafts: Context) -> int:
        k = 0
        while k < len(q_rows) and q_rows[k].max() >= threshold:
            k += 1
        return k

    return policy


def admit_while_previous_draft_even(q_rows: Sequence[np.ndarray], drafts: Context) -> int:
    """Lossless: slot i may depend on x_1..x_{i-1}."""
    k = 1
    while k < len(q_rows) and drafts[k - 1] % 2 == 0:
        k += 1
    return k


def admit_while_q_sampled(threshold: float) -> Policy:
    """LOSSY: trims on q_i(x_i), a number computed from the draft token itself."""

    def policy(q_rows: Sequence[np.ndarray], drafts: Context) -> int:
        k = 0
        while k < len(q_rows) and q_rows[k][drafts[k]] >= threshold:
            k += 1
        return k

    return policy


def admit_while_next_q_max(threshold: float) -> Policy:
    """LOSSY: admits slot i by looking at q_{i+1}, which depends on x_i."""

    def policy(q_rows: Sequence[np.ndarray], drafts: Context) -> int:
        k = 0
        while k + 1 < len(q_rows) and q_rows[k + 1].max() >= threshold:
            k += 1
        return k

    return policy


# ================================================================ exact enumeration tests

VARIANTS = {
    "random": (Params(), 0.0),
    "temperature 0.6": (Params(temperature=0.6), 0.0),
    "temperature 1.7": (Params(temperature=1.7), 0.0),
    "top-k 3": (Params(top_k=3), 0.0),
    "top-p 0.7": (Params(top_p=0.7), 0.0),
    "top-k 4, top-p 0.85, temperature 0.8": (Params(0.8, 4, 0.85), 0.0),
    "zeros in p and q": (Params(), 0.4),
    "greedy": (Params(temperature=0.0), 0.0),
}


def toy_pair(variant: str, V: int, autoregressive: bool, seed: int = 0) -> Toy:
    params, zero_frac = VARIANTS[variant]
    return Toy(p=make_table(seed, V, params, autoregressive, zero_frac),
               q=make_table(seed + 1000, V, params, autoregressive, zero_frac, scale=1.0))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("K", [1, 3])
def test_first_emitted_token_is_p1(variant, K):
    toy = toy_pair(variant, V=6, autoregressive=False)
    step = step_distribution(toy, (), K, admit_all(K))
    assert sum(step.values()) == pytest.approx(1.0, abs=1e-9)
    first: Dist = defaultdict(float)
    for emitted, w in step.items():
        first[emitted[:1]] += w
    assert deviation(first, target_tokens(toy, 1)) < 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("autoregressive", [False, True], ids=["positional", "autoregressive"])
def test_first_two_emitted_tokens_follow_the_target_joint(variant, autoregressive):
    toy = toy_pair(variant, V=5, autoregressive=autoregressive)
    assert deviation(first_tokens(toy, 3, admit_all(3), n=2), target_tokens(toy, 2)) < 1e-6


def test_first_three_tokens_with_two_slots():
    toy = toy_pair("top-k 4, top-p 0.85, temperature 0.8", V=4, autoregressive=True, seed=5)
    assert deviation(first_tokens(toy, 2, admit_all(2), n=3), target_tokens(toy, 3)) < 1e-6


def test_zero_variant_has_zeros_on_both_sides():
    """Guard for the "zeros in p and q" variant: q drafts tokens p excludes, and p has mass q lacks."""
    toy = toy_pair("zeros in p and q", V=5, autoregressive=True)
    contexts = [()] + [(x,) for x in range(5)]
    assert any(((toy.p(c) == 0) & (toy.q(c) > 0)).any() for c in contexts)
    assert any(((toy.p(c) > 0) & (toy.q(c) == 0)).any() for c in contexts)


def test_drafter_equal_to_target_accepts_everything():
    table = make_table(3, 5, Params(), autoregressive=True)
    toy = Toy(p=table, q=table)
    step = step_distribution(toy, (), 2, admit_all(2))
    assert sum(w for emitted, w in step.items() if len(emitted) == 3) == pytest.approx(1.0, abs=1e-6)
    assert deviation(first_tokens(toy, 2, admit_all(2), n=2), target_tokens(toy, 2)) < 1e-6


LOSSLESS_POLICIES = {
    "admit none": lambda q_rows, drafts: 0,
    "admit 1": lambda q_rows, drafts: 1,
    "q_max >= 0.3": admit_while_q_max(0.3),
    "q_max >= 0.35": admit_while_q_max(0.35),
    "previous draft even": admit_while_previous_draft_even,
}


@pytest.mark.parametrize("policy", LOSSLESS_POLICIES)
@pytest.mark.parametrize("variant", ["random", "top-p 0.7", "zeros in p and q"])
def test_policies_on_q_and_earlier_drafts_are_lossless(policy, variant):
    toy = toy_pair(variant, V=5, autoregressive=True, seed=11)
    dist = first_tokens(toy, 3, LOSSLESS_POLICIES[policy], n=2)
    assert deviation(dist, target_tokens(toy, 2)) < 1e-6


def test_q_max_policy_admits_a_mix_of_depths():
    """Guard for the test above: the threshold policy really trims at different depths."""
    toy = toy_pair("random", V=5, autoregressive=True, seed=11)
    depths = {admit_while_q_max(0.35)([toy.q(xs[:i]) for i in range(3)], xs)
              for xs, _ in draft_outcomes(toy, (), 3)}
    assert depths == {1, 2, 3}


@pytest.mark.parametrize("policy", [admit_while_q_sampled(0.3), admit_while_next_q_max(0.35)],
                         ids=["q_sampled >= 0.3", "q_max of the next slot >= 0.35"])
def test_policies_reading_the_draft_token_are_lossy(policy):
    toy = toy_pair("random", V=5, autoregressive=True, seed=11)
    dist = first_tokens(toy, 3, policy, n=2)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-9)
    assert deviation(dist, target_tokens(toy, 2)) > 1e-3


# ================================================================ sampling tests

V_SAMPLED = 5
NUM_ADMITTED = [2, 0, 3]


@dataclass(frozen=True)
class Batch:
    """Fixed per-request p and q rows (positional toy: they do not depend on earlier tokens)."""

    q: list[torch.Tensor]  # per request # [k_b, V]
    p: list[torch.Tensor]  # per request # [k_b + 1, V]

    def toy(self, b: int) -> Toy:
        p, q = self.p[b].double().numpy(), self.q[b].double().numpy()
        return Toy(p=lambda ctx: p[len(ctx)], q=lambda ctx: q[len(ctx)])


def make_batch(num_admitted: Sequence[int], seed: int = 0, params: Params = Params()) -> Batch:
    g = torch.Generator().manual_seed(seed)
    qs, ps = [], []
    for k in num_admitted:
        for rows, scale, out in ((k, 1.0, qs), (k + 1, 2.0, ps)):
            logits = torch.randn(rows, V_SAMPLED, generator=g) * scale
            out.append(processed_probs(logits, torch.full((rows,), params.temperature),
                                       torch.full((rows,), params.top_k), torch.full((rows,), params.top_p)))
    return Batch(q=qs, p=ps)


def draft_and_verify(batch: Batch, seed: int, sampler=rejection_sample):
    """Draw drafts x_i ~ q_i with a drafting generator, then verify with one generator per request."""
    q, p = torch.cat(batch.q), torch.cat(batch.p)
    drafts = sample(q, [torch.Generator().manual_seed(10**6 + seed)] * q.shape[0])
    generators = [torch.Generator().manual_seed(seed * 7919 + b) for b in range(len(batch.q))]
    admitted = Ragged.of([x.shape[0] for x in batch.q])
    return drafts, sampler(drafts, q, p, admitted, generators)


def chi2_pvalue(samples: list[Context], expected: Dist) -> float:
    """Chi-square p-value of observed outcomes against exact probabilities (cells < 5 pooled)."""
    n, counts = len(samples), Counter(samples)
    big = [key for key, w in expected.items() if w * n >= 5]
    observed = [counts[key] for key in big]
    exp = [expected[key] * n for key in big]
    observed.append(n - sum(observed))
    exp.append(n - sum(exp))
    if exp[-1] < 1e-9:
        observed, exp = observed[:-1], exp[:-1]
    return float(chisquare(observed, np.array(exp) * (sum(observed) / sum(exp))).pvalue)


def sampled_outputs(batch: Batch, trials: int, sampler=rejection_sample) -> list[list[Context]]:
    outputs: list[list[Context]] = [[] for _ in batch.q]
    for seed in range(trials):
        _, result = draft_and_verify(batch, seed, sampler)
        for b, tokens in enumerate(result.output_tokens):
            outputs[b].append(tuple(tokens))
    return outputs


TRIALS = 3000


def as_candidates(probs: torch.Tensor) -> TokenProbs:
    """Dense rows # [N, V] as a TokenProbs of their positive entries (padded with V, as the engine's)."""
    n, vocab = probs.shape
    width = max(1, int((probs > 0).sum(-1).max())) if n else 1
    values, ids = probs.topk(width, dim=-1)
    return TokenProbs.candidates(torch.where(values > 0, ids, vocab), values, vocab)


def candidates_sampler(draft_form: str, target_form: str):
    """rejection_sample with q and / or p handed over as candidates instead of dense rows."""
    def sampler(drafts, q, p, admitted, generators):
        q = as_candidates(q) if draft_form == "candidates" else q
        p = as_candidates(p) if target_form == "candidates" else p
        return rejection_sample(drafts, q, p, admitted, generators)
    return sampler


FORMS = pytest.mark.parametrize("sampler", [rejection_sample, candidates_sampler("candidates", "candidates"),
                                            candidates_sampler("candidates", "dense"),
                                            candidates_sampler("dense", "candidates")],
                                ids=["dense", "candidates", "q-candidates", "p-candidates"])


@FORMS
def test_fast_sampler_matches_exact_distributions(sampler):
    batch = make_batch(NUM_ADMITTED)
    outputs = sampled_outputs(batch, TRIALS, sampler)
    for b, k in enumerate(NUM_ADMITTED):
        toy = batch.toy(b)
        first = [out[:1] for out in outputs[b]]
        assert chi2_pvalue(first, target_tokens(toy, 1)) > 1e-3, f"request {b}: first token is not p_1"
        step = step_distribution(toy, (), k, admit_all(k))
        assert chi2_pvalue(outputs[b], step) > 1e-3, f"request {b}: emitted sequences"


@FORMS
def test_a_broken_sampler_fails_the_same_test(monkeypatch, sampler):
    """Negative control: recovered tokens drawn from p_i instead of the residual (a guard that
    takes every residual for empty: both the torch path and the native call read it)."""
    monkeypatch.setattr(rejection, "RESIDUAL_EPS", 2.0)
    batch = make_batch(NUM_ADMITTED)
    outputs = sampled_outputs(batch, TRIALS, sampler)
    for b, k in enumerate(NUM_ADMITTED):
        if k > 0:
            first = [out[:1] for out in outputs[b]]
            assert chi2_pvalue(first, target_tokens(batch.toy(b), 1)) < 1e-6


@pytest.mark.parametrize("params", [Params(), Params(0.7, 3, 0.9), Params(temperature=0.0)],
                         ids=["plain", "truncated", "greedy"])
@FORMS
def test_fast_equals_reference_draw_for_draw(params, sampler):
    batch = make_batch([2, 0, 3, 1, 0, 4], seed=1, params=params)
    for seed in range(150):
        drafts, fast = draft_and_verify(batch, seed, sampler)
        _, slow = draft_and_verify(batch, seed, rejection_sample_reference)
        assert fast.output_tokens == slow.output_tokens
        assert torch.equal(fast.num_accepted, slow.num_accepted)
        assert fast.num_accepted.dtype == torch.int64
        for tokens, n in zip(fast.output_tokens, fast.num_accepted.tolist()):
            assert len(tokens) == n + 1


def test_candidate_rows_take_one_native_call_with_the_same_draws(monkeypatch):
    """q and p as candidates: native/rejection.cpp where built, draw for draw what the torch path
    gives (with requests sharing a generator, and a guard that catches a residual of mass ~0)."""
    if not native.available():
        pytest.skip(native.unavailable_reason())
    batch = make_batch([2, 0, 3, 1, 4], seed=5, params=Params(0.7, 3, 0.9))
    q, p, counts = torch.cat(batch.q), torch.cat(batch.p), [2, 0, 3, 1, 4]
    p[3] = q[2]  # slot 3 of request 2 (its first slot): p = q, the residual's mass is 0
    calls = []
    original = native.ops().rejection_candidates
    monkeypatch.setattr(rejection, "_native_ops", lambda: SimpleNamespace(
        rejection_candidates=lambda *a: calls.append(1) or original(*a)))
    for seed in range(200):
        drafts = sample(q, [torch.Generator().manual_seed(seed)] * q.shape[0])
        shared = seed % 2 == 0  # every request on one generator, or each on its own

        def generators():
            own = [torch.Generator().manual_seed(seed + b) for b in range(len(counts))]
            return [own[0]] * len(counts) if shared else own

        fast = rejection_sample(drafts, as_candidates(q), as_candidates(p), Ragged.of(counts), generators())
        with monkeypatch.context() as torch_path:
            torch_path.setattr(rejection, "_native_ops", lambda: None)
            slow = rejection_sample(drafts, as_candidates(q), as_candidates(p), Ragged.of(counts), generators())
        assert fast.output_tokens == slow.output_tokens and torch.equal(fast.num_accepted, slow.num_accepted)
    assert len(calls) == 200


def test_a_step_without_drafts_takes_the_native_call_with_p_as_candidates(monkeypatch):
    """Target-only steps (the empty draft's q has no rows, as candidates) emit each request's token
    from p in one native call, the token sample() draws from p with the same generator."""
    if not native.available():
        pytest.skip(native.unavailable_reason())
    calls = []
    monkeypatch.setattr(rejection, "_native_ops", lambda: calls.append(1) or native.ops())
    p = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    q = DraftBatch.empty(3, 50).probs
    for seed in range(20):
        result = rejection_sample(torch.zeros(0, dtype=torch.int64), q, as_candidates(p), Ragged.of([0, 0, 0]),
                                  [torch.Generator().manual_seed(seed + b) for b in range(3)])
        expected = [sample(p[b:b + 1], [torch.Generator().manual_seed(seed + b)]).item() for b in range(3)]
        assert result.output_tokens == [[t] for t in expected] and result.num_accepted.tolist() == [0, 0, 0]
    assert len(calls) == 20


def test_fast_equals_reference_when_requests_share_a_generator():
    batch = make_batch([2, 0, 3], seed=2)
    q, p, admitted = torch.cat(batch.q), torch.cat(batch.p), Ragged.of([2, 0, 3])
    for seed in range(100):
        drafts = sample(q, [torch.Generator().manual_seed(seed)] * q.shape[0])
        results = [fn(drafts, q, p, admitted, [torch.Generator().manual_seed(seed)] * 3)
                   for fn in (rejection_sample, rejection_sample_reference)]
        assert results[0].output_tokens == results[1].output_tokens


def test_a_request_does_not_depend_on_the_rest_of_the_batch():
    mine, others = make_batch([2], seed=3), make_batch([3, 0, 1], seed=4)
    for seed in range(60):
        x = sample(mine.q[0], [torch.Generator().manual_seed(seed)] * 2)
        alone = rejection_sample(x, mine.q[0], mine.p[0], Ragged.of([2]), [torch.Generator().manual_seed(seed)])
        y = sample(torch.cat(others.q), [torch.Generator().manual_seed(seed + 1)] * 4)
        for position in range(4):  # mine inserted before request `position` of the others
            d = [0, 3, 3, 4][position]  # its first draft row
            drafts = torch.cat([y[:d], x, y[d:]])
            q = torch.cat(others.q[:position] + [mine.q[0]] + others.q[position:])
            p = torch.cat(others.p[:position] + [mine.p[0]] + others.p[position:])
            counts = [3, 0, 1][:position] + [2] + [3, 0, 1][position:]
            generators = [torch.Generator().manual_seed(1000 + seed * 10 + i) for i in range(4)]
            generators[position] = torch.Generator().manual_seed(seed)
            result = rejection_sample(drafts, q, p, Ragged.of(counts), generators)
            assert result.output_tokens[position] == alone.output_tokens[0]


SAMPLERS = pytest.mark.parametrize("sampler", [rejection_sample, rejection_sample_reference],
                                   ids=["fast", "reference"])


def greedy_probs(logits: torch.Tensor) -> torch.Tensor:
    """processed_probs with temperature 0: one-hot rows (# [N, V])."""
    n = logits.shape[0]
    return processed_probs(logits, torch.zeros(n), torch.zeros(n, dtype=torch.int64), torch.ones(n))


@SAMPLERS
def test_greedy_accepts_exactly_the_target_argmax(sampler):
    g = torch.Generator().manual_seed(5)
    num_admitted = [3, 0, 2, 4]
    B, S, V = len(num_admitted), sum(num_admitted), 6
    starts = np.cumsum([0] + num_admitted[:-1]).tolist()  # first draft row of each request
    slot_rows = [d + b + i for b, (d, k) in enumerate(zip(starts, num_admitted)) for i in range(k)]
    for trial in range(40):
        target_logits = torch.randn(S + B, V, generator=g)
        argmax = target_logits.argmax(-1)  # [S + B]
        # each draft is the target's argmax with probability 2/3, else another token
        wrong = torch.rand(S, generator=g) > 2 / 3
        drafts = torch.where(wrong, (argmax[slot_rows] + torch.randint(1, V, (S,), generator=g)) % V,
                             argmax[slot_rows])
        drafter_logits = torch.randn(S, V, generator=g) + 20 * torch.nn.functional.one_hot(drafts, V)
        q, p = greedy_probs(drafter_logits), greedy_probs(target_logits)
        assert torch.equal(sample(q, [g] * S), drafts)
        result = sampler(drafts, q, p, Ragged.of(num_admitted),
                         [torch.Generator().manual_seed(trial * 10 + b) for b in range(B)])
        for b, (d, k) in enumerate(zip(starts, num_admitted)):
            t = d + b  # first target row of request b
            n = next((i for i in range(k) if drafts[d + i] != argmax[t + i]), k)
            assert int(result.num_accepted[b]) == n
            assert result.output_tokens[b] == argmax[t:t + n + 1].tolist()  # accepted, then recovered or bonus


@SAMPLERS
def test_strict_acceptance_never_keeps_a_token_the_target_excludes(sampler):
    # q(x) = 0 and p(x) = 0 for a draft token outside both supports: rejected, and the empty
    # residual falls back to p, so the recovered token is still from p's support
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    for seed in range(50):
        result = sampler(torch.tensor([3]), q, p, Ragged.of([1]), [torch.Generator().manual_seed(seed)])
        assert result.num_accepted.tolist() == [0] and result.output_tokens[0][0] in (1, 2)


@SAMPLERS
def test_draft_equal_to_target_is_always_accepted(sampler):
    p = torch.softmax(torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), -1)
    drafts = torch.tensor([0, 4, 2])
    for seed in range(50):
        result = sampler(drafts, p[:3], p, Ragged.of([3]), [torch.Generator().manual_seed(seed)])
        assert result.num_accepted.tolist() == [3]


def test_residual_probs_hand_case():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.4, 0.1, 0.3], [0.25, 0.25, 0.25, 0.25]])
    out = residual_probs(p, q)
    torch.testing.assert_close(out[0], torch.tensor([0.75, 0.0, 0.25, 0.0]))
    torch.testing.assert_close(out[1], p[1])  # no residual mass: falls back to p


@SAMPLERS
def test_all_requests_without_drafts_emit_one_bonus_token(sampler):
    p = torch.eye(4)[[3, 1]]
    result = sampler(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), p, Ragged.of([0, 0]),
                              [torch.Generator(), torch.Generator()])
    assert result.num_accepted.tolist() == [0, 0] and result.output_tokens == [[3], [1]]


@SAMPLERS
def test_layout_errors_name_the_problem(sampler):
    q, p, g = torch.full((3, 4), 0.25), torch.full((5, 4), 0.25), torch.Generator()
    x = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="S = 2"):
        sampler(x, q, p, Ragged.of([1, 1]), [g, g])
    with pytest.raises(ValueError, match="bonus row"):
        sampler(x, q, p[:4], Ragged.of([2, 1]), [g, g])
    with pytest.raises(ValueError, match="one per request"):
        sampler(x, q, p, Ragged.of([2, 1]), [g])
