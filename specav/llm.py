"""The Python API, in vLLM's shape: `specav.LLM(...)`, then `generate(prompts, sampling_params)` or
`chat(messages, sampling_params)`.

    from specav import LLM, SamplingParams
    llm = LLM(model="default", speculative_config={"num_speculative_tokens": 4}, dtype="auto")
    for out in llm.generate(["def fib(n):", "def is_prime(n):"], SamplingParams(temperature=0, max_tokens=64)):
        print(out.outputs[0].text, out.metrics.mean_acceptance_length)

Owns: turning prompts (text, token ids, chat messages) into engine requests, running them to
completion with continuous batching (every prompt is queued at once; the engine admits them as
slots free up), and returning one `RequestOutput` per prompt, in order. Names follow vLLM where
the meaning is the same (`RequestOutput.outputs[0].text`, `.token_ids`, `.finish_reason`,
`.stop_reason`, `prompt_token_ids`); `metrics` holds the request's speculation counts.

Must not know: HTTP, tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from specav.config import PACKAGED_SPECULATIVE, EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specav.prompts import encode_prompt
from specav.request import Request, RequestStats, TokenLogprob

PromptType = Union[str, Mapping[str, Any]]  # text, {"prompt": text} or {"prompt_token_ids": [...]}
Conversation = Sequence[Mapping[str, Any]]  # [{"role": ..., "content": ...}, ...]

DEFAULT_SPECULATIVE = PACKAGED_SPECULATIVE  # the packaged drafter with AV, as `specav generate` uses it


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: str | None  # the stop string that ended it, if one did
    logprobs: list[TokenLogprob] | None  # per token, when SamplingParams.logprobs was set


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestStats  # steps, slots drafted / admitted / accepted, mean acceptance length
    error: str | None = None  # why it finished with "error"


class LLM:
    """A target (and drafter) loaded once; many prompts per call, batched continuously."""

    def __init__(self, model: str = "default",
                 speculative_config: Mapping[str, Any] | SpeculativeConfig | None = DEFAULT_SPECULATIVE,
                 dtype: str = "auto", max_num_seqs: int = EngineConfig().max_batch_size,
                 threads: int | None = None) -> None:
        """model: "default" (the packaged target), a local Hugging Face directory or a .gguf file.
        speculative_config: vLLM-style dict or SpeculativeConfig (default: the packaged drafter with
        adaptive verification, K = 8 at most: config.PACKAGED_SPECULATIVE); None decodes with the
        target alone."""
        from specav.engine.engine import Engine

        if isinstance(speculative_config, Mapping):
            speculative_config = SpeculativeConfig.from_json(speculative_config)
        config = EngineConfig(target=ModelConfig(model, dtype, threads), speculative=speculative_config,
                              max_batch_size=max_num_seqs)
        self._init(Engine.from_config(config))

    @classmethod
    def from_engine(cls, engine) -> "LLM":
        """Wrap an engine built elsewhere (tests, custom drafters)."""
        llm = cls.__new__(cls)
        llm._init(engine)
        return llm

    def _init(self, engine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete every prompt (no chat template); one output per prompt, in order."""
        items = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        encoded = [self._encode(p) for p in items]
        return self._run(encoded, sampling_params)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer one conversation, or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not conversations:
            raise ValueError("chat: give at least one conversation (a list of {'role', 'content'} messages)")
        encoded = []
        for conversation in conversations:
            if not conversation:
                raise ValueError("chat: a conversation is empty; give at least one message")
            encoded.append((None, encode_prompt(self.engine.tokenizer, messages=conversation)))
        return self._run(encoded, sampling_params)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.engine.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            return self._encode(prompt["prompt"])
        raise ValueError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                         f"got {type(prompt).__name__}")

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(encoded)
        else:
            params = list(sampling_params)
            if len(params) != len(encoded):
                raise ValueError(f"got {len(params)} sampling params for {len(encoded)} prompts; "
                                 "give one, or one per prompt")
        requests = [self.engine.add_request(ids, sp, request_id=str(next(self._ids)))
                    for (_, ids), sp in zip(encoded, params)]
        while any(not r.finished for r in requests):
            self.engine.step()
        return [_output(r, text) for r, (text, _) in zip(requests, encoded)]


def _output(request: Request, prompt: str | None) -> RequestOutput:
    reason = str(request.finish_reason) if request.finish_reason is not None else None
    completion = CompletionOutput(0, request.text, list(request.output_ids), reason, request.stop_reason,
                                  request.logprobs)
    return RequestOutput(request.request_id, prompt, list(request.prompt_ids), [completion], request.finished,
                         request.stats, request.error)
