"""The request lifecycle: caller ids, abort, stop strings and text, per-request transforms, faults, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specav.config import EngineConfig, EstimatorConfig, SamplingParams, SpeculativeConfig
from specav.detokenize import make_detokenizer
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine
from specav.request import Request
from specav.verification.cost_model import CostCurve, CostProfile
from specav.verification.sampling import NonFiniteLogitsError, processed_probs
from tests.tiny_chat import byte_tokenizer
from tests.tiny_models import VOCAB, make_engine, tiny_pair, tiny_tokenizer

# A made-up cost profile (verify 1 ms + 0.05 ms per token, draft 0.4 ms per forward): the adaptive
# planner runs without timing anything.
PROFILE = CostProfile(CostCurve.fit({1: 1e-3, 64: 4e-3}), CostCurve.fit({1: 4e-4, 32: 1e-3}))


def prompts(n, seed=0, lo=1, hi=12):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(2, VOCAB, (m,), generator=gen).tolist() for m in lengths]


def engine_for(target, drafter, planner="static", k=4, max_batch_size=8, estimator=EstimatorConfig()):
    spec = SpeculativeConfig(num_speculative_tokens=k, enable_adaptive_verification=planner == "adaptive")
    config = EngineConfig(speculative=spec, max_batch_size=max_batch_size, estimator=estimator)
    return Engine(target, tiny_tokenizer(target.vocab_size), DraftModelDrafter(drafter), config,
                  cost_profile=PROFILE)


def live_state(engine, request_id):
    """Which stages still hold state for a request."""
    stages = {"target": engine.verifier._states, "drafter": engine.drafter._states,
              "planner": getattr(engine.planner, "history", {})}
    return {name for name, states in stages.items() if request_id in states}


# ---- ids and abort ----------------------------------------------------------------------------

def test_a_second_live_request_with_the_same_id_is_refused():
    target, drafter = tiny_pair()
    engine = make_engine(target, drafter, k=3)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    first = engine.add_request([3, 4], greedy, request_id="code-0")
    with pytest.raises(ValueError, match="request code-0: a live request already has this id"):
        engine.add_request([5, 6], greedy, request_id="code-0")
    while engine.has_work():
        engine.step()
    assert first.finished and len(first.output_ids) == 5
    again = engine.add_request([3, 4], greedy, request_id="code-0")  # finished ids may be reused
    while engine.has_work():
        engine.step()
    assert again.output_ids == first.output_ids


@pytest.mark.parametrize("planner", ["static", "adaptive"])
def test_abort_frees_both_models_caches_at_the_next_step_boundary(planner):
    target, drafter = tiny_pair(noise=0.08)
    ps, greedy = prompts(4, seed=3), SamplingParams(temperature=0, max_tokens=30)
    alone = [r.output_ids for r in engine_for(target, drafter, planner).generate(ps, greedy)]

    engine = engine_for(target, drafter, planner, max_batch_size=3)  # the fourth request waits
    requests = [engine.add_request(p, greedy, request_id=f"r{i}") for i, p in enumerate(ps)]
    engine.step()
    engine.step()
    assert live_state(engine, "r1") >= {"target", "drafter"}
    engine.abort("r1")  # running
    engine.abort("r3")  # still waiting
    engine.abort("nobody")  # not live: ignored
    assert not requests[1].finished  # nothing happens until the step boundary
    outputs = {o.request_id: o for o in engine.step()}
    for rid in ("r1", "r3"):
        assert outputs[rid].finished and outputs[rid].finish_reason == "abort" and outputs[rid].new_token_ids == []
        assert live_state(engine, rid) == set()
    while engine.has_work():
        engine.step()
    assert requests[0].output_ids == alone[0] and requests[2].output_ids == alone[2]
    assert requests[3].output_ids == [] and requests[1].output_ids == alone[1][:len(requests[1].output_ids)]
    assert engine.num_live_requests == 0
    assert not engine.verifier._states and not engine.drafter._states and not getattr(engine.planner, "history", {})


# ---- text: stop strings and incremental decoding ------------------------------------------------

def test_stop_strings_are_held_back_and_end_the_output_at_the_token_that_completes_them():
    tok = byte_tokenizer()
    prompt = tok.encode("> ")
    request = Request(prompt, SamplingParams(max_tokens=100, stop=("STOP", "€!")),
                      detokenizer=make_detokenizer(tok, prompt))
    tokens = tok.encode("Grüße € ST S STOP and more")
    shown = []
    for i in range(0, len(tokens), 3):  # three tokens per step, as a speculative step emits them
        request.append(tokens[i:i + 3], frozenset())
        shown.append(request.text)
        if request.finished:
            break
    assert request.text == "Grüße € ST S " and request.finish_reason == "stop" and request.stop_reason == "STOP"
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))  # what was shown is never taken back
    assert not any(s.endswith(("S", "ST", "STO", "€")) for s in shown[:-1])  # a stop string's start is held
    assert tok.decode(request.output_ids) == "Grüße € ST S STOP"  # the token completing it is the last kept
    assert not any("\ufffd" in s for s in shown)


def test_max_tokens_flushes_held_back_text():
    tok = byte_tokenizer()
    tokens = tok.encode("ab S")
    request = Request([1], SamplingParams(max_tokens=4, stop=("STOP",)), detokenizer=make_detokenizer(tok, [1]))
    request.append(tokens[:3], frozenset())
    assert request.text == "ab "  # "S" might start "STOP"
    request.append(tokens[3:], frozenset())
    assert request.finish_reason == "length" and request.text == "ab S"


def test_engine_text_is_the_incremental_decode_of_the_output():
    target, drafter = tiny_pair()
    engine = make_engine(target, drafter, k=4)
    out = engine.generate(prompts(3, seed=5), SamplingParams(temperature=0.9, max_tokens=40, seed=2))
    for r in out:
        assert r.text == engine.tokenizer.decode(r.prompt_ids[-6:] + r.output_ids, skip_special_tokens=True)[
            len(engine.tokenizer.decode(r.prompt_ids[-6:], skip_special_tokens=True)):]


# ---- per-request transforms ---------------------------------------------------------------------

TRANSFORMS = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=-0.5),
              dict(logit_bias={5: 3.0, 9: -100.0}), dict(frequency_penalty=0.7, logit_bias={12: 1.5})]


def test_penalties_and_logit_bias_keep_greedy_speculation_exact():
    """p_i must be the target's distribution after the request's output plus x_1..x_{i-1}: a verifier
    row that counted the wrong tokens would part from target-only decoding."""
    target, drafter = tiny_pair(noise=0.08)
    ps = prompts(len(TRANSFORMS), seed=4)
    params = [SamplingParams(temperature=0, max_tokens=24, **t) for t in TRANSFORMS]
    reference = [r.output_ids for r in make_engine(target).generate(ps, params)]
    plain = [r.output_ids for r in make_engine(target).generate(ps, SamplingParams(temperature=0, max_tokens=24))]
    assert all(r != p for r, p in zip(reference, plain))  # every transform changes the output
    assert 9 not in reference[2]
    for k, batch in [(1, 2), (3, 4), (6, 3)]:
        engine = make_engine(target, drafter, k=k, max_batch_size=batch)
        assert [r.output_ids for r in engine.generate(ps, params)] == reference, f"K={k}"
        assert engine.stats.accepted > 0


def test_the_drafter_sees_the_same_transforms_as_the_target():
    """With the target as its own drafter, q_i == p_i only if both apply the same penalties to the same
    tokens (drafts so far included): then every admitted slot is accepted."""
    target, _ = tiny_pair()
    engine = make_engine(target, target, k=4, max_batch_size=4)
    params = [SamplingParams(temperature=0.9, max_tokens=30, seed=s, **t) for s, t in enumerate(TRANSFORMS)]
    engine.generate(prompts(len(TRANSFORMS), seed=6), params)
    assert engine.stats.accepted == engine.stats.admitted > 0


def test_requests_with_logit_transforms_leave_the_estimator_statistics_untouched():
    target, drafter = tiny_pair(noise=0.08)
    estimator = EstimatorConfig(refit_interval=4)
    ps = prompts(3, seed=7)
    plain = [SamplingParams(temperature=0.8, max_tokens=20, seed=s) for s in range(3)]
    transformed = SamplingParams(temperature=0.8, max_tokens=30, seed=11, frequency_penalty=0.8,
                                 logit_bias={7: 2.0})

    def state(requests):
        engine = engine_for(target, drafter, estimator=estimator)
        engine.generate([p for p, _ in requests], [sp for _, sp in requests])
        return engine.scorer.state_dict()

    alone = state(list(zip(ps, plain)))
    with_transformed = state(list(zip(ps, plain)) + [([5, 6, 7], transformed)])
    control = state(list(zip(ps, plain)) + [([5, 6, 7], dataclasses.replace(transformed, frequency_penalty=0.0,
                                                                             logit_bias=()))])
    assert alone["num_refits"] > 0

    def same(a, b):  # to float32 rounding: a batch's composition may move the drafter's logits by an ulp
        return all(torch.allclose(torch.as_tensor(a[k]).double(), torch.as_tensor(b[k]).double(),
                                  rtol=1e-5, atol=1e-5) for k in a)

    assert same(alone, with_transformed)
    assert not same(alone, control)  # the same request without transforms does teach the estimator


# ---- faults: non-finite logits ------------------------------------------------------------------

class Poisoned:
    """A model whose logits are NaN (or +inf) for the requests whose caches are listed."""

    def __init__(self, model, value=math.nan):
        self.model, self.value, self.caches = model, value, set()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, token_ids, caches, num_logits):
        out = self.model.forward(token_ids, caches, num_logits)
        out.logits = out.logits.clone()
        start = 0
        for cache, n in zip(caches, num_logits):
            if id(cache) in self.caches:
                out.logits[start:start + n, 3] = self.value
            start += n
        return out


def test_sampling_refuses_rows_without_a_distribution():
    logits = torch.randn(4, 10)
    logits[1, 2] = math.nan
    logits[2, 5] = math.inf
    logits[3, :] = -math.inf
    args = (torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.zeros(4, dtype=torch.int64), torch.ones(4))
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[1, 2, 3\]") as e:
        processed_probs(logits, *args)
    assert e.value.rows == [1, 2, 3]
    masked = torch.randn(2, 10)
    masked[:, :3] = -math.inf  # -inf only masks tokens
    assert processed_probs(masked, *(a[:2] for a in args))[:, :3].sum() == 0


@pytest.mark.parametrize("where,value", [("target", math.nan), ("drafter", math.nan), ("target", math.inf)])
def test_non_finite_logits_fail_one_request_and_not_its_neighbours(where, value):
    target, drafter = tiny_pair(noise=0.08)
    ps, greedy = prompts(4, seed=8), SamplingParams(temperature=0, max_tokens=20)
    clean = [r.output_ids for r in make_engine(target, drafter, k=3).generate(ps, greedy)]
    poisoned_target = Poisoned(target, value) if where == "target" else target
    poisoned_drafter = Poisoned(drafter, value) if where == "drafter" else drafter
    engine = make_engine(poisoned_target, poisoned_drafter, k=3)
    requests = [engine.add_request(p, greedy, request_id=f"r{i}") for i, p in enumerate(ps)]
    engine.step()
    engine.step()
    before = list(requests[2].output_ids)
    states = engine.verifier._states if where == "target" else engine.drafter._states
    (poisoned_target if where == "target" else poisoned_drafter).caches.add(id(states["r2"].cache))
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["r2"].finished and outputs["r2"].finish_reason == "error" and outputs["r2"].new_token_ids == []
    assert "request r2" in requests[2].error and f"the {where}'s logits hold NaN or inf" in requests[2].error
    assert requests[2].output_ids == before  # nothing from the bad rows
    assert live_state(engine, "r2") == set()
    while engine.has_work():
        engine.step()
    assert [requests[i].output_ids for i in (0, 1, 3)] == [clean[i] for i in (0, 1, 3)]


# ---- logprobs and per-request stats ---------------------------------------------------------------

def test_logprobs_are_the_targets_log_softmax_at_each_generated_token():
    target, drafter = tiny_pair(noise=0.08)
    engine = make_engine(target, drafter, k=4)
    ps = prompts(3, seed=9)
    params = [SamplingParams(temperature=0.9, max_tokens=12, seed=1, logprobs=3),
              SamplingParams(temperature=0, max_tokens=12, logprobs=0), SamplingParams(temperature=0, max_tokens=5)]
    out = engine.generate(ps, params)
    assert out[2].logprobs is None
    for r in out[:2]:
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        with torch.no_grad():
            reference = torch.log_softmax(target.hf_model(ids).logits[0].float(), -1)  # [T, V]
        assert [lp.token_id for lp in r.logprobs] == r.output_ids
        for j, lp in enumerate(r.logprobs):
            row = reference[len(r.prompt_ids) - 1 + j]
            assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
            assert [t for t, _ in lp.top] == row.topk(r.params.logprobs).indices.tolist()


def test_per_request_stats_add_up_to_the_engines():
    target, drafter = tiny_pair(noise=0.08)
    engine = make_engine(target, drafter, k=4, max_batch_size=3)
    out = engine.generate(prompts(5, seed=10), SamplingParams(temperature=0.7, max_tokens=15, seed=3))
    for name in ("drafted", "admitted", "accepted"):
        assert sum(getattr(r.stats, name) for r in out) == getattr(engine.stats, name)
    assert sum(r.stats.steps for r in out) == engine.stats.request_steps
    assert all(r.stats.mean_acceptance_length >= 1 for r in out)
