"""`specav generate | serve | bench | eval`: the command line.

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

from specav.config import DTYPES, ConfigError, EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specav.prompts import encode_prompt  # noqa: F401  (re-exported: bench modules import it from here)
from specav.server.cli import add_serve_parser, cmd_serve

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
    p.add_argument("--dtype", default=_default(ModelConfig, "dtype"), choices=DTYPES,
                   help="auto (default: fastest kernels on GGUF weights; bf16 on HF directories), bf16 (the "
                        "reference), fp32, or q4 (GGUF weights on torch's kernels)")
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


@command("eval")
def cmd_eval(args: argparse.Namespace) -> int:
    return EVAL_COMMANDS[args.eval_command](args)


EVAL_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _eval_collect(args: argparse.Namespace) -> int:
    from specav.engine.engine import Engine
    from specav.evaluation.collect import collect
    from specav.evaluation.workloads import WORKLOADS

    workloads = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    config = engine_config(args)
    if config.speculative is None:
        raise ValueError("eval collect needs a drafter: drop --no-speculation")
    engine = Engine.from_config(config)
    base = sampling_params(args)

    def params_for(n: int) -> SamplingParams:
        seed = None if base.seed is None else base.seed + n
        return dataclasses.replace(base, seed=seed)

    meta = {"target": args.model, "speculative_config": dataclasses.asdict(config.speculative),
            "dtype": args.dtype, "sampling": dataclasses.asdict(base), "workloads": workloads,
            "prompts_per_workload": args.prompts}
    result = collect(engine, args.out, workloads, args.prompts,
                     lambda prompt: encode_prompt(engine.tokenizer, messages=prompt.chat()), params_for,
                     keep_hidden=args.hidden, meta=meta)
    print(f"wrote {result.labelled_slots} labelled slots from {result.requests} requests to {result.directory} "
          f"in {result.seconds:.0f} s")
    return 0


def _eval_report(args: argparse.Namespace) -> int:
    from specav.evaluation.report import build_report

    if len(args.log) > 1 and args.out is None:
        print("specav eval report: with several logs, say where the report goes (--out DIR)", file=sys.stderr)
        return 2
    report = build_report(args.log, args.out or args.log[0], bins=args.bins)
    print(f"report: {report.markdown_path} ({report.num_slots} labelled slots, {report.num_requests} requests)")
    return 0


EVAL_COMMANDS.update(collect=_eval_collect, report=_eval_report)

BENCHMARKS = {
    "forward": "specav.bench.forward",
    "speculative": "specav.bench.speculative",
    "estimator": "specav.bench.estimator_cost",
    "calibration": "specav.bench.calibration",
    "report": "specav.bench.report_speed",
    "quantized": "specav.bench.quantized",
    "serve": "specav.bench.serve",
}


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.benchmark])
    sys.argv = [f"specav bench {args.benchmark}", *args.rest]
    module.main()
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

    ev = sub.add_parser("eval", help="labelled-draft logs and reports on acceptance features")
    evsub = ev.add_subparsers(dest="eval_command", required=True)
    col = evsub.add_parser("collect", help="run the pair over the shipped workloads and log labelled slots")
    col.add_argument("--out", required=True, help="log directory (Parquet parts + meta.json)")
    col.add_argument("--workloads", default=None, help="comma-separated (default: all)")
    col.add_argument("--prompts", type=int, default=40, help="prompts per workload")
    col.add_argument("--hidden", action="store_true", help="also log the drafter's hidden state per slot")
    add_engine_flags(col)
    add_sampling_flags(col)
    rep = evsub.add_parser("report", help="AUC / log-loss / ECE tables and plots from a log")
    rep.add_argument("log", nargs="+", help="log directory written by `specav eval collect` (several: pooled)")
    rep.add_argument("--out", default=None, help="report directory (default: the log directory; "
                                                 "required with several logs)")
    rep.add_argument("--bins", type=int, default=15, help="ECE bins (equal width on [0, 1])")

    add_serve_parser(sub, add_engine_flags)

    bench = sub.add_parser("bench", help="benchmark programs (print tables measured in one run)")
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags (see --help)")
    return parser


COMMANDS["serve"] = cmd_serve


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ValueError, NotImplementedError) as e:
        print(f"specav {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
