"""End-to-end: `specav serve`'s app on the packaged default pair, with the official openai client."""

from __future__ import annotations

import openai
import pytest
import torch

from specav.config import EngineConfig, ServerConfig
from specav.engine.engine import Engine
from tests.server_harness import RunningServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with RunningServer(Engine.from_config(EngineConfig()), ServerConfig(port=0), model="default") as s:
        yield s
    torch.set_num_threads(threads)


def test_chat_and_streamed_completion_on_the_default_pair(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Write a Python function that returns the square of x."}]
    chat = c.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="default", messages=messages, max_tokens=16, temperature=0, stream=True))
    finish, tokens = chat.choices[0].finish_reason, chat.usage.completion_tokens
    assert (finish == "length" and tokens == 16) or (finish == "stop" and tokens <= 16)  # the answer may end sooner
    assert streamed == chat.choices[0].message.content
    assert "def" in chat.choices[0].message.content or "square" in chat.choices[0].message.content.lower()
    done = c.completions.create(model="default", prompt="def add(a, b):\n    return", max_tokens=8, temperature=0,
                                stop=["\n"])
    assert done.choices[0].finish_reason == "stop" and "a + b" in done.choices[0].text
