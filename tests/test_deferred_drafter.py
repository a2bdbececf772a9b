"""A drafter loaded when a plan first drafts (drafting/deferred.py): it loads once, only when a
slot is drafted, drafts then what a drafter loaded from the start would, and its load is priced by
the planner but counted in no step's stage times."""

from __future__ import annotations

import time

import torch

from specav.config import EngineConfig, SamplingParams, SpeculativeConfig
from specav.drafting import DeferredDrafter, DraftModelDrafter
from specav.engine.engine import Engine
from specav.request import Request
from specav.types import AcceptResult
from tests.tiny_models import adaptive_engine, cheap_drafting_profile, make_engine, tiny_pair

PARAMS = SamplingParams(temperature=0.8, top_k=20, max_tokens=40, seed=7)


def _decode_target_only(drafter, request: Request, tokens: list[int]) -> None:
    """Steps that drafted nothing: each emits one token, as the engine commits it."""
    for token in tokens:
        drafts = drafter.propose([request], [0])
        drafter.commit([request], drafts, AcceptResult(torch.zeros(1, dtype=torch.int64), [[token]]))
        request.append([token], ())


def test_it_loads_once_at_the_first_drafted_slot_and_drafts_what_an_eager_drafter_would():
    _, model = tiny_pair()
    loads, told = [], []

    def load():
        loads.append(1)
        return DraftModelDrafter(model)

    deferred = DeferredDrafter(load, "draft_model", model.vocab_size, expected_seconds=3.0, on_load=told.append)
    eager = DraftModelDrafter(model)
    mine, theirs = (Request([5, 6, 7, 8], PARAMS, request_id="r") for _ in range(2))
    skipped = [11, 12, 13]
    _decode_target_only(deferred, mine, skipped)
    _decode_target_only(eager, theirs, skipped)
    assert not loads and not deferred.loaded and deferred.setup_seconds == 3.0
    assert deferred.pending_tokens([mine]) == eager.pending_tokens([theirs]) == [7]  # prompt and outputs
    assert deferred.propose([mine], [0]).setup_seconds == 0.0 and not loads  # nothing drafted: nothing loaded

    drafts, reference = deferred.propose([mine], [3]), eager.propose([theirs], [3])
    assert loads == [1] and deferred.loaded and deferred.setup_seconds == 0.0
    assert drafts.setup_seconds == deferred.load_seconds > 0 and told == [deferred.load_seconds]
    assert torch.equal(drafts.token_ids, reference.token_ids)
    assert torch.equal(drafts.probs.to_dense(), reference.probs.to_dense())
    assert drafts.forwards == reference.forwards and drafts.forwards[0][0] == 7  # the catch-up fed all of it
    again = deferred.propose([mine], [0])
    assert again.setup_seconds == 0.0 and loads == [1]


def test_a_drafter_whose_load_no_draft_repays_is_never_loaded():
    target, model = tiny_pair(noise=0.08)
    loads = []
    deferred = DeferredDrafter(lambda: loads.append(1) or DraftModelDrafter(model), "draft_model",
                               model.vocab_size, expected_seconds=1e6)
    engine = adaptive_engine(target, deferred, cheap_drafting_profile())
    assert engine.planner.cost.draft_setup == 1e6
    greedy = SamplingParams(temperature=0, max_tokens=30)
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    outputs = [r.output_ids for r in engine.generate(prompts, greedy)]
    assert outputs == [r.output_ids for r in make_engine(target).generate(prompts, greedy)]
    assert not loads and engine.stats.drafted == 0 and engine.stats.drafter_load_step is None


def test_the_load_is_paid_at_the_first_draft_and_counted_in_no_stage():
    target, model = tiny_pair(noise=0.08)
    pause = 0.3

    def slow_load():
        time.sleep(pause)
        return DraftModelDrafter(model)

    deferred = DeferredDrafter(slow_load, "draft_model", model.vocab_size, expected_seconds=0.0)
    engine = adaptive_engine(target, deferred, cheap_drafting_profile())
    records = []
    engine.step_listeners.append(records.append)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    prompts = [[3, 4, 5], [9, 8, 7, 6]]
    start = time.perf_counter()
    outputs = [r.output_ids for r in engine.generate(prompts, greedy)]
    wall = time.perf_counter() - start
    assert outputs == [r.output_ids for r in make_engine(target).generate(prompts, greedy)]
    loading = [r for r in records if r.drafts.setup_seconds > 0]
    assert len(loading) == 1 and engine.stats.drafted > 0
    assert loading[0].times.draft < pause and loading[0].times.total < pause  # the load is in neither
    assert engine.stats.drafter_load_seconds >= pause and engine.stats.seconds <= wall - pause  # nor in the steps' time
    assert engine.planner.cost.draft_setup == 0.0
    assert f"drafter loaded at step {engine.stats.drafter_load_step + 1}" in engine.stats.summary()


def test_a_one_shot_run_loads_only_what_its_drafts_may_repay(tmp_path, monkeypatch, capsys):
    """Engine.from_config(defer_drafter=True), what `specav generate` builds: with no cost profile
    cached it decodes target-only and says how to measure one; once a profile is cached (an engine
    that loads at start measures it and records the drafter's load), the drafter is deferred and
    its load priced at the recorded time."""
    from specav.config import ModelConfig
    from specav.engine.profile import PROFILE_FILE
    from specav.models import packaged
    from tests.tiny_models import save_tiny_checkpoint

    monkeypatch.setattr(packaged, "cache_root", lambda: tmp_path / "cache")
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    drafter = save_tiny_checkpoint(tmp_path / "drafter", seed=1)
    spec = SpeculativeConfig(model=drafter, num_speculative_tokens=3, enable_adaptive_verification=True)
    config = EngineConfig(target=ModelConfig(path=target, dtype="fp32"), speculative=spec, max_batch_size=2)

    first = Engine.from_config(config, defer_drafter=True)
    assert first.num_slots == 0 and first.config.speculative is None  # target-only
    assert "no cost profile" in capsys.readouterr().err and not (tmp_path / "cache" / PROFILE_FILE).exists()

    import specav.engine.engine as engine_module

    loads, load_checkpoint = [], engine_module.load_checkpoint

    def load(path, dtype, role):  # a machine's first drafter load writes caches later loads read: 2 s more
        if role == "drafter":
            loads.append(path)
            if len(loads) == 1:
                time.sleep(2.0)
        return load_checkpoint(path, dtype, role=role)

    monkeypatch.setattr(engine_module, "load_checkpoint", load)
    eager = Engine.from_config(config)  # loads and profiles at start, keeps the load's time
    assert isinstance(eager.drafter, DraftModelDrafter) and eager.planner.cost.draft_setup == 0.0
    recorded = eager.planner.cost.profile.draft_load
    assert len(loads) == 2 and 0 < recorded < 2.0  # no load recorded yet: the second one is timed
    recorded = Engine.from_config(config).planner.cost.profile.draft_load  # then one load, recorded
    assert len(loads) == 3 and recorded > 0  # and what `later` is priced at

    later = Engine.from_config(config, defer_drafter=True)
    assert isinstance(later.drafter, DeferredDrafter) and not later.drafter.loaded
    assert later.planner.cost.draft_setup == later.drafter.setup_seconds == recorded
    assert later.max_positions == eager.max_positions
    greedy = SamplingParams(temperature=0, max_tokens=6)
    assert [r.output_ids for r in later.generate([[3, 4, 5]], greedy)] == \
        [r.output_ids for r in first.generate([[3, 4, 5]], greedy)]
