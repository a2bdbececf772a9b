"""The drafter's vocabulary-subset head: its logits, its ranking, its wiring, and losslessness.

- The head: on the subset its logits equal the full head's (dense heads in float32 and bf16;
  quantized heads in q4 and auto, at 1 row and at several rows, where auto changes kernels);
  -inf elsewhere, so q = 0 there.
- The ranking: a hand case, determinism, filling beyond the listed tokens, and refusing a
  ranking made for another vocabulary; the shipped file is reproduced from its sources (e2e).
- Losslessness: the whole engine with a subset drafter head keeps the target's joint
  distribution of two tokens (chi-square against the exact joint, as tests/test_lossless.py),
  on a subset that leaves out tokens the target does emit. Negative control: a drafter that
  samples from the subset q but hands the rejection sampler the full head's q is caught.
"""

from __future__ import annotations

import dataclasses
import gzip
import math

import pytest
import torch

from specav.config import ConfigError, EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine
from specav.verification.sampling_rows import SamplingRows
from specav.models import load_checkpoint
from specav.models.packed import PackedCausalLM
from specav.models.quant import QuantizedLinear
from specav.models.vocab_ranking import (VocabRanking, VocabRankingError, build_ranking, interleave,
                                         load_ranking, vocab_fingerprint)
from specav.models.vocab_subset import VocabSubsetHead, set_head, subset_head
from tests.test_lossless import PROMPT, V, empirical_joint, exact_joint, p_value
from tests.test_quant import VOCAB as GGUF_VOCAB, fake_measure, write_tiny_gguf
from tests.tiny_models import save_tiny_checkpoint, tiny_hf_model, tiny_pair, tiny_tokenizer

SUBSET = torch.tensor([0, 2, 3, 5, 6])  # of V = 8: leaves out 1, 4, 7


def hidden_rows(n: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))  # [T, hidden]


def assert_subset_logits(head: torch.nn.Module, sub: VocabSubsetHead, x: torch.Tensor, ids: torch.Tensor,
                         exact: bool) -> None:
    full, part = head(x).float(), sub(x).float()  # [T, V] each
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(part[:, outside]).all()
    if exact:
        assert torch.equal(part[:, ids], full[:, ids])
    else:  # a dense matmul over fewer rows may block its reduction differently: float rounding only
        torch.testing.assert_close(part[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_head_equals_full_head_on_the_subset(dtype):
    model = tiny_hf_model(vocab=96, dtype=dtype)
    ids = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:30]
    sub = subset_head(model.lm_head, ids, 96)
    assert sub.token_ids.tolist() == sorted(ids.tolist())
    for rows in (1, 5):
        x = hidden_rows(rows, 64).to(dtype)
        assert_subset_logits(model.lm_head, sub, x, ids, exact=dtype == torch.bfloat16)


@pytest.mark.parametrize("mode", ["q4", "auto"])
def test_quantized_head_equals_full_head_on_the_subset(tmp_path, monkeypatch, mode):
    import specav.models.quant_choice as choice

    monkeypatch.setattr(choice, "measure", fake_measure)  # auto: kquant at 1 row, int8dyn from 4 rows
    monkeypatch.setenv("SPECAV_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", tokenizer=True)
    checkpoint = load_checkpoint(str(path), dtype=mode)
    head = checkpoint.model.lm_head
    assert isinstance(head, QuantizedLinear)
    ids = torch.randperm(GGUF_VOCAB, generator=torch.Generator().manual_seed(2))[:GGUF_VOCAB // 3]
    sub = subset_head(head, ids, GGUF_VOCAB, path)
    assert isinstance(sub.rows, QuantizedLinear) and sub.rows.out_features == len(ids)
    assert sub.rows.plan == head.plan
    for rows in (1, 5, 16):  # auto runs a different kernel at 1 row than at 5 and 16
        assert_subset_logits(head, sub, hidden_rows(rows, head.in_features), ids, exact=True)


def test_quantized_head_needs_its_gguf_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", tokenizer=True)
    head = load_checkpoint(str(path), dtype="q4").model.lm_head
    with pytest.raises(VocabRankingError, match="no GGUF file"):
        subset_head(head, torch.arange(10), GGUF_VOCAB, None)


def test_head_rejects_ids_outside_the_vocabulary():
    model = tiny_hf_model(vocab=96)
    with pytest.raises(VocabRankingError, match=r"\[0, 96\)"):
        subset_head(model.lm_head, torch.tensor([0, 96]), 96)


def test_packed_forward_uses_the_subset_head():
    target, _ = tiny_pair(vocab=V)
    full = target.forward([PROMPT], [target.new_cache()], [1]).logits  # [1, V]
    set_head(target, subset_head(target.lm_head, SUBSET, V))
    logits = target.forward([PROMPT], [target.new_cache()], [1]).logits
    kept = torch.zeros(V, dtype=torch.bool)
    kept[SUBSET] = True
    torch.testing.assert_close(logits[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(logits[:, ~kept]).all()
    assert target.hf_model.lm_head is target.lm_head


# ---------------------------------------------------------------- the ranking


def test_ranking_hand_case_and_determinism():
    tokenizer = tiny_tokenizer(8)  # <pad> 0, <eos> 1 (special), w0..w5 = 2..7
    sources = {"code": ["w0 w0 w1", "w0 w1 w4"], "prose": ["w2 w2 w0"]}
    ranking = build_ranking(tokenizer, sources)
    # by text: specials, then w0 (3/6 + 1/3) / 2, w2 (0 + 2/3) / 2, w1 (2/6) / 2, w4 (1/6) / 2
    by_text = [0, 1, 2, 4, 3, 6]
    assert interleave(by_text, list(range(8))) == [0, 1, 2, 4, 3, 6, 5]  # 5 comes with 6's id-order pair
    assert list(ranking.ranked_ids) == [0, 1, 2, 4, 3, 6, 5]
    assert interleave([7, 6], list(range(8))) == [7, 0, 6, 1]  # stops once the text ranking is placed
    assert ranking.sources == {"code": {"documents": 2, "tokens": 6}, "prose": {"documents": 1, "tokens": 3}}
    again = build_ranking(tokenizer, sources)
    assert again.to_json() == ranking.to_json()
    assert VocabRanking.from_json(ranking.to_json()) == ranking


def test_top_fills_beyond_the_listed_tokens_in_id_order():
    ranking = VocabRanking("f", (5, 3, 9), {}, "3.11")
    assert ranking.top(2, 10).tolist() == [3, 5]
    assert ranking.top(5, 10).tolist() == [0, 1, 3, 5, 9]  # 5, 3, 9, then 0, 1
    assert ranking.top(3, 6).tolist() == [0, 3, 5]  # 9 is outside a 6-token vocabulary
    for bad in (0, 11, 2.5):
        with pytest.raises(VocabRankingError, match="draft_vocab_size.*allowed an integer in \\[1, 10\\]"):
            ranking.top(bad, 10)


def test_ranking_for_another_vocabulary_is_refused(tmp_path):
    ranking = build_ranking(tiny_tokenizer(8), {"a": ["w0"]})
    path = tmp_path / "r.json.gz"
    path.write_bytes(gzip.compress(ranking.to_json().encode()))
    assert load_ranking(tiny_tokenizer(8), path) == ranking
    with pytest.raises(VocabRankingError, match="another vocabulary.*null"):
        load_ranking(tiny_tokenizer(8, prefix="x"), path)
    with pytest.raises(VocabRankingError, match="another vocabulary"):
        load_ranking(tiny_tokenizer(8))  # the shipped file belongs to the packaged Qwen2.5 tokenizer
    assert vocab_fingerprint(tiny_tokenizer(8)) != vocab_fingerprint(tiny_tokenizer(9))


# ---------------------------------------------------------------- config and wiring


def test_config_field():
    assert SpeculativeConfig().draft_vocab_size is None
    assert SpeculativeConfig.from_json('{"draft_vocab_size": 32768}').draft_vocab_size == 32768
    assert SpeculativeConfig.from_json('{"draft_vocab_size": null}').draft_vocab_size is None
    for bad in (0, -1, True, 2.0, "32k", "auto"):
        with pytest.raises(ConfigError, match="draft_vocab_size"):
            SpeculativeConfig(draft_vocab_size=bad)


def test_from_config_applies_the_subset_to_the_drafter(tmp_path, monkeypatch):
    import specav.models.vocab_subset as vocab_subset

    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    drafter = save_tiny_checkpoint(tmp_path / "drafter", seed=1)

    def engine(size):
        return Engine.from_config(EngineConfig(target=ModelConfig(target, dtype="fp32"),
                                               speculative=SpeculativeConfig(model=drafter, draft_vocab_size=size)))

    assert isinstance(engine(None).drafter.model.lm_head, torch.nn.Linear)  # the default: the full head
    with pytest.raises(VocabRankingError, match="draft_vocab_size.*another vocabulary"):
        engine(40)  # the shipped ranking is not for the tiny tokenizer
    words = " ".join(f"w{i}" for i in range(50))
    monkeypatch.setattr(vocab_subset, "load_ranking", lambda tokenizer: build_ranking(tokenizer, {"text": [words]}))
    subset = engine(40)
    head = subset.drafter.model.lm_head
    assert isinstance(head, VocabSubsetHead) and head.token_ids.numel() == 40
    out = subset.generate([[3, 4, 5]], SamplingParams(temperature=1.0, max_tokens=6, seed=0))[0]
    assert len(out.output_ids) == 6
    with pytest.raises(VocabRankingError, match=r"draft_vocab_size = 97 .*\[1, 96\]"):
        engine(97)


# ---------------------------------------------------------------- losslessness


class FullQReported:
    """LOSSY on purpose: samples drafts from the subset head's q, hands rejection sampling the full head's q."""

    name = "full-q-reported"
    setup_seconds = 0.0

    def __init__(self, model: PackedCausalLM, full_head: torch.nn.Module) -> None:
        self.inner = DraftModelDrafter(model, keep_hidden=True)
        self.full_head = full_head

    def propose(self, requests, num_slots, stop_rule=None):
        drafts = self.inner.propose(requests, num_slots, stop_rule)
        if drafts.hidden is None:  # nothing drafted this step
            return drafts
        rows = SamplingRows.of(requests, drafts.num_drafted.tolist())
        return dataclasses.replace(drafts, probs=rows.distributions(self.full_head(drafts.hidden).float()))

    def pending_tokens(self, requests):
        return self.inner.pending_tokens(requests)

    def commit(self, requests, drafts, result):
        self.inner.commit(requests, drafts, result)

    def release(self, request):
        self.inner.release(request)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=V, noise=0.2, seed=3)


def subset_drafter() -> PackedCausalLM:
    """The pair's drafter (rebuilt: tiny_pair is deterministic) with its head cut to SUBSET."""
    _, drafter = tiny_pair(vocab=V, noise=0.2, seed=3)
    set_head(drafter, subset_head(drafter.lm_head, SUBSET, V))
    return drafter


def engine_with(target, drafter) -> Engine:
    config = EngineConfig(speculative=SpeculativeConfig(num_speculative_tokens=3), max_batch_size=64)
    return Engine(target, tiny_tokenizer(V), drafter, config)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["plain", "temperature-topk-topp"])
def test_engine_with_subset_head_matches_target_distribution(pair, params):
    target, _ = pair
    engine = engine_with(target, DraftModelDrafter(subset_drafter()))
    joint = exact_joint(target, params)
    outside = [t for t in range(V) if t not in SUBSET.tolist()]
    assert joint[outside].sum() > 0.05  # the target emits tokens the drafter can never propose
    counts = empirical_joint(engine, params)
    assert counts[outside].sum() > 0  # ... and the engine emits them (as recovered or bonus tokens)
    assert engine.stats.accepted < engine.stats.admitted
    assert p_value(counts, joint) > 1e-3


def test_negative_control_reporting_another_q_is_caught(pair):
    target, drafter = pair
    engine = engine_with(target, FullQReported(subset_drafter(), drafter.lm_head))  # same weights, full head
    params = SamplingParams(temperature=1.0)
    assert p_value(empirical_joint(engine, params), exact_joint(target, params)) < 1e-6


def test_subset_q_is_zero_outside_the_subset(pair):
    engine = engine_with(pair[0], DraftModelDrafter(subset_drafter()))
    seen = []
    engine.step_listeners.append(lambda record: seen.append(record.drafts.probs))
    engine.generate([PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    probs = torch.cat([p.to_dense() for p in seen])  # [S_d, V]
    outside = torch.ones(V, dtype=torch.bool)
    outside[SUBSET] = False
    assert probs.shape[0] > 0 and (probs[:, outside] == 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[0]))
    assert not math.isnan(float(probs.sum()))


@pytest.mark.e2e
def test_shipped_ranking_is_reproduced_from_its_sources():
    import platform

    from transformers import AutoTokenizer

    from specav.models import packaged
    from specav.models.vocab_ranking import source_texts

    path = packaged.assembled_gguf(packaged.DRAFTER)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    shipped = load_ranking(tokenizer)  # the packaged drafter's vocabulary: the fingerprint matches
    if shipped.python != platform.python_version():
        pytest.skip(f"the shipped ranking was made on Python {shipped.python}; its stdlib text may differ here")
    assert build_ranking(tokenizer, source_texts()) == shipped
