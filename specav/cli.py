"""`specav generate | bench | eval`: the command line.

Flags are derived from the config dataclasses: their defaults come from config.py, so the
CLI never disagrees with the library.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

from specav.config import ConfigError, EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def wrap(fn):
        COMMANDS[name] = fn
        return fn
    return wrap


def _default(cls, name: str):
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_default(ModelConfig, "path"),
                   help="target: local HF directory, .gguf file, or 'default' (packaged Qwen2.5-Coder-1.5B)")
    p.add_argument("--dtype", default=_default(ModelConfig, "dtype"), help="bf16 (default) or fp32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--speculative-config", default=json.dumps(dataclasses.asdict(SpeculativeConfig())),
                   help="vLLM-style JSON: model, method, num_speculative_tokens, draft_sample_method, "
                        "enable_adaptive_verification ('model': 'default' = packaged Qwen2.5-Coder-0.5B)")
    p.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    p.add_argument("--max-batch-size", type=int, default=_default(EngineConfig, "max_batch_size"))


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    for name, kind in [("temperature", float), ("top_k", int), ("top_p", float), ("max_tokens", int),
                       ("seed", int)]:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=_default(SamplingParams, name))
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    spec = None if args.no_speculation else SpeculativeConfig.from_json(args.speculative_config)
    return EngineConfig(target=ModelConfig(args.model, args.dtype, args.threads), speculative=spec,
                        max_batch_size=args.max_batch_size)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))


def encode_prompt(tokenizer, prompt: str | None = None, messages: list[dict] | None = None,
                  chat: bool = True) -> list[int]:
    """Token ids for a plain prompt or chat messages (the chat template applies to both by default)."""
    if messages is None:
        if prompt is None:
            raise ValueError("give a prompt or chat messages")
        if not chat:
            return tokenizer.encode(prompt)
        messages = [{"role": "user", "content": prompt}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template: pass --raw to send the prompt as plain text")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@command("generate")
def cmd_generate(args: argparse.Namespace) -> int:
    from specav.engine.engine import Engine

    messages = None
    if args.messages:
        text = Path(args.messages).read_text() if Path(args.messages).exists() else args.messages
        messages = json.loads(text)
    elif args.prompt is None:
        args.prompt = sys.stdin.read()
    engine = Engine.from_config(engine_config(args))
    prompt_ids = encode_prompt(engine.tokenizer, args.prompt, messages, chat=not args.raw)
    request = engine.add_request(prompt_ids, sampling_params(args))
    shown = 0
    while engine.has_work():
        engine.step()
        sys.stdout.write(request.text[shown:])
        sys.stdout.flush()
        shown = len(request.text)
    print()
    print(f"[specav] {engine.stats.summary()}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specav", description="Speculative decoding with adaptive verification")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("--prompt", help="the prompt (default: read stdin)")
    gen.add_argument("--messages", help="chat messages as JSON (a string or a file path)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    add_engine_flags(gen)
    add_sampling_flags(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ValueError, NotImplementedError) as e:
        print(f"specav {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
