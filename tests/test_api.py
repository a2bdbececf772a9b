"""The Python API: `specav.LLM` and `specav.SamplingParams`, as vLLM users know them."""

from __future__ import annotations

import pytest

import specav
from specav import LLM, SamplingParams
from specav.config import ConfigError, EngineConfig, SpeculativeConfig
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine
from specav.models.packed import PackedCausalLM
from tests.tiny_chat import IM_END, byte_tokenizer, script_ids, scripted_model
from tests.tiny_models import make_engine, save_tiny_checkpoint, tiny_pair

SCRIPT = "\n¡Hé東€-STOP+tail"  # the scripted model's answer after the chat template's last token ("\n")


def test_exports():
    assert specav.SamplingParams is SamplingParams and specav.LLM is LLM


def test_generate_many_prompts_in_order_with_their_own_params():
    target, drafter = tiny_pair(noise=0.08)
    llm = LLM.from_engine(make_engine(target, drafter, k=3, max_batch_size=2))  # 5 prompts, 2 at a time
    prompts = ["w3 w4", "w10", {"prompt_token_ids": [7, 8, 9]}, "w50 w51 w52", {"prompt": "w2"}]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (4, 9, 6, 12, 3)]
    outs = llm.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, outs):
        alone = make_engine(target).generate([out.prompt_token_ids], sp)[0]  # target-only, alone
        assert out.outputs[0].token_ids == alone.output_ids and len(alone.output_ids) == sp.max_tokens
        assert out.outputs[0].text == alone.text and out.outputs[0].finish_reason == "length"
        assert out.finished and out.metrics.steps >= 1 and out.metrics.admitted >= out.metrics.accepted
    assert outs[0].prompt == "w3 w4" and outs[2].prompt is None and outs[2].prompt_token_ids == [7, 8, 9]
    assert len({o.request_id for o in outs}) == 5
    assert sum(o.metrics.accepted for o in outs) == llm.engine.stats.accepted


def test_chat_applies_the_template_and_honours_stop_strings():
    script = script_ids(SCRIPT)
    model = PackedCausalLM(scripted_model(script))
    engine = Engine(model, byte_tokenizer(), DraftModelDrafter(model),
                    EngineConfig(speculative=SpeculativeConfig(num_speculative_tokens=2)), eos_ids=[IM_END])
    llm = LLM.from_engine(engine)
    conversation = [{"role": "user", "content": "Say it"}]
    plain, stopped = llm.chat([conversation, conversation],
                              [SamplingParams(temperature=0), SamplingParams(temperature=0, stop=["STOP"])])
    assert plain.outputs[0].text == SCRIPT[1:] and plain.outputs[0].finish_reason == "stop"
    assert plain.outputs[0].token_ids == script[1:] + [IM_END] and plain.outputs[0].stop_reason is None
    assert stopped.outputs[0].text == "¡Hé東€-" and stopped.outputs[0].stop_reason == "STOP"
    assert byte_tokenizer().decode(stopped.outputs[0].token_ids) == "¡Hé東€-STOP"
    assert plain.metrics.accepted == plain.metrics.admitted > 0  # its own drafter
    single = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=3))
    assert len(single) == 1 and single[0].outputs[0].text == "¡H"


def test_llm_loads_checkpoints_by_path_with_a_vllm_style_speculative_config(tmp_path):
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    drafter = save_tiny_checkpoint(tmp_path / "drafter", seed=1)
    llm = LLM(model=target, speculative_config={"model": drafter, "num_speculative_tokens": 3}, dtype="fp32",
              max_num_seqs=4)
    assert llm.engine.num_slots == 3 and llm.engine.config.max_batch_size == 4
    prompt = {"prompt_token_ids": [3, 4, 5]}  # (transformers reloads the word-level tokenizer as Qwen2's BPE)
    out = llm.generate([prompt] * 3, SamplingParams(temperature=0.8, max_tokens=6, seed=5))
    assert [o.outputs[0].token_ids for o in out[1:]] == [out[0].outputs[0].token_ids] * 2  # one seed, one output
    target_only = LLM(model=target, speculative_config=None, dtype="fp32")
    assert target_only.engine.num_slots == 0
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == \
        target_only.generate(prompt, greedy)[0].outputs[0].token_ids


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="unknown key"):
        LLM(speculative_config={"num_tokens": 3})
    target, _ = tiny_pair()
    llm = LLM.from_engine(make_engine(target))
    with pytest.raises(ValueError, match="3 sampling params for 2 prompts"):
        llm.generate(["w1", "w2"], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="prompt must be a string"):
        llm.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        llm.generate("w1", SamplingParams(max_tokens=600))
