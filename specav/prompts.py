"""Prompts to token ids: a plain prompt, or chat messages through the tokenizer's chat template.

A neutral module: the CLI, the Python API, the server and the benchmarks all encode prompts
the same way, so the helper lives below all of them. Must not know models or the engine.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def encode_prompt(tokenizer, prompt: str | None = None, messages: Sequence[Mapping] | None = None,
                  chat: bool = True) -> list[int]:
    """Token ids for a plain prompt or chat messages (the chat template applies to both by default)."""
    if messages is None:
        if prompt is None:
            raise ValueError("give a prompt or chat messages")
        if not chat:
            return list(tokenizer.encode(prompt))
        messages = [{"role": "user", "content": prompt}]
    if not has_chat_template(tokenizer):
        raise ValueError("this tokenizer has no chat template: pass --raw to send the prompt as plain text")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))
