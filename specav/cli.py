"""`specav generate | serve | profile | bench | eval`: the command line.

Flags are derived from the config dataclasses: their defaults come from config.py, so the
CLI never disagrees with the library. Sampling flags left out take the target checkpoint's
recommended values (models/checkpoint_info.py), as vLLM does.

Bad input. Every command runs through `run_command`: a bad value (ConfigError, CheckpointError,
CacheError, UsageError, any ValueError) ends the command with exit status 2 and one line on stderr
that names the flag or field and what is allowed; argparse's own errors are one line too. What
can be checked without loading a model is checked before any model loads (`preflight`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specav.config import DTYPES, PACKAGED_SPECULATIVE, EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specav.prompts import encode_prompt
from specav.server.cli import add_serve_parser, cmd_serve

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}
SAMPLING_FLAGS = ("temperature", "top_k", "top_p")  # default: the target's generation config
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class UsageError(ValueError):
    """A bad command-line input; the message names the flag and says what is allowed."""


def command(name: str):
    def wrap(fn):
        COMMANDS[name] = fn
        return fn
    return wrap


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block): exit status 2, the flag and the fault."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def is_user_error(e: BaseException) -> bool:
    """Whether `e` means "bad input" (exit 2, one line) rather than a bug (a traceback): ValueError
    (ConfigError, CheckpointError and UsageError are ValueErrors), NotImplementedError, CacheError."""
    if isinstance(e, (ValueError, NotImplementedError)):
        return True
    cache = sys.modules.get("specav.models.cache")  # loaded by whatever raised a CacheError; importing
    return cache is not None and isinstance(e, cache.CacheError)  # it here would pull in torch


def run_command(name: str, fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one command; bad input becomes one line on stderr and exit status 2, Ctrl-C exit status 130."""
    try:
        return fn(args)
    except KeyboardInterrupt:
        print(f"specav {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"specav {name}: error: {describe_error(e)}", file=sys.stderr)
        return 2


def describe_error(e: BaseException) -> str:
    """The error's message on one line, prefixed with the flag a ConfigError's field comes from."""
    text = re.sub(r"\s*\n\s*", " ", str(e)).strip() or type(e).__name__
    flag = flag_for_field(getattr(e, "field", None))
    return f"{flag}: {text}" if flag else text


def flag_for_field(field: str | None) -> str | None:
    """The flag that sets a config field ("SamplingParams.top_p" -> "--top-p"), if one does."""
    if not field:
        return None
    config, _, name = field.partition(".")
    if config == "speculative_config":
        return "--speculative-config"
    if config == "model":
        return "--model" if name == "path" else f"--{name}"
    if config in ("SamplingParams", "engine") and name:
        return f"--{name.replace('_', '-')}"
    return None


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
    p.add_argument("--speculative-config", default=json.dumps(dataclasses.asdict(PACKAGED_SPECULATIVE)),
                   help="vLLM-style JSON: model, method, num_speculative_tokens, draft_sample_method, "
                        "enable_adaptive_verification ('model': 'default' = packaged Qwen2.5-Coder-0.5B)")
    p.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    p.add_argument("--max-batch-size", type=int, default=_default(EngineConfig, "max_batch_size"),
                   help="requests decoded together at most (default: %(default)s)")


# The packaged pair's recommended values (packaged.TARGET.generation; a test keeps them equal), here so
# that --help does not import the model layer and torch.
PACKAGED_SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    for name, kind, meaning in [("temperature", float, "0 = greedy"), ("top_k", int, "0 = off"),
                                ("top_p", float, "in (0, 1], 1 = off")]:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       help=f"{meaning} (default: the target's generation config, else "
                            f"{_default(SamplingParams, name)}; the packaged pair's is {PACKAGED_SAMPLING[name]})")
    p.add_argument("--max-tokens", type=int, default=_default(SamplingParams, "max_tokens"),
                   help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--seed", type=int, default=_default(SamplingParams, "seed"),
                   help="per-request seed (default: a random one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    spec = None if args.no_speculation else SpeculativeConfig.from_json(args.speculative_config)
    return EngineConfig(target=ModelConfig(args.model, args.dtype, args.threads), speculative=spec,
                        max_batch_size=args.max_batch_size)


def sampling_params(args: argparse.Namespace, generation=None) -> SamplingParams:
    """The flags' SamplingParams; sampling flags left out take `generation`'s recommendation
    (a models.GenerationDefaults, as its `sampling_params` does), else SamplingParams' defaults."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    recommended = generation.applied if generation is not None else {}
    return SamplingParams(**{**recommended, **given}, max_tokens=args.max_tokens, seed=args.seed,
                          stop=tuple(args.stop))


def parse_messages(value: str, where: str = "--messages") -> list[dict]:
    """Chat messages from JSON text, or from a file holding it: a list of {"role", "content"} objects.

    Text that starts with '[' or '{' is JSON, never a path (a long JSON string is not a file name)."""
    text = value
    if not value.lstrip().startswith(("[", "{")):
        try:
            text = Path(value).expanduser().read_text()
        except (OSError, ValueError) as e:
            reason = getattr(e, "strerror", None) or e
            raise UsageError(f"{where}: {_clip(repr(value))} is neither JSON (a list of {{\"role\", \"content\"}} "
                             f"objects) nor a readable file ({reason})") from None
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); expected "
                         f"a list of {{\"role\", \"content\"}} objects") from None
    check_messages(messages, where)
    return messages


def check_messages(messages, where: str = "messages") -> None:
    """A non-empty list of objects, each with a role from MESSAGE_ROLES and a string content."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where} must be a non-empty JSON list of {{\"role\", \"content\"}} objects, "
                         f"got {_clip(json.dumps(messages))}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UsageError(f"{where}[{i}] must be an object with \"role\" and \"content\", got "
                             f"{_clip(json.dumps(message))}")
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            raise UsageError(f"{where}[{i}].role = {_clip(json.dumps(role))} is invalid: allowed one of "
                             f"{list(MESSAGE_ROLES)}")
        if not isinstance(content, str):
            raise UsageError(f"{where}[{i}].content must be a string, got {_clip(json.dumps(content))}")


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True, slots=True)
class Preflight:
    """What `generate` knows before loading models: the prompt, configs, and what the checkpoints say."""

    prompt: str | None
    messages: list[dict] | None
    config: EngineConfig
    params: SamplingParams  # the user's values over the target's recommendation
    contexts: dict[str, int]  # role -> positions the checkpoint was built for (those that say)


def read_prompt(args: argparse.Namespace) -> tuple[str | None, list[dict] | None]:
    """--prompt, --messages, or stdin when it is a pipe or a file (never waits on a terminal)."""
    if args.messages is not None:
        if args.prompt is not None:
            raise UsageError("give --prompt or --messages, not both")
        if args.raw:
            raise UsageError("--raw applies to --prompt; --messages always goes through the chat template")
        return None, parse_messages(args.messages)
    if args.prompt is not None:
        if not args.prompt:
            raise UsageError("--prompt is empty: give the text to continue or answer")
        return args.prompt, None
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: give --prompt TEXT or --messages JSON, or pipe the prompt on stdin "
                         "(stdin is a terminal)")
    text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt read from stdin is empty: give --prompt TEXT or pipe a prompt")
    return text, None


def preflight(args: argparse.Namespace) -> Preflight:
    """Every check that needs no model loaded: flags, prompt, checkpoint paths, vocabularies, contexts.

    Reads checkpoint headers only (the packaged pair is assembled first if it is not cached yet)."""
    prompt, messages = read_prompt(args)
    config = engine_config(args)
    sampling_params(args)  # out-of-range values fail here, whatever the checkpoint recommends
    from specav.models.checkpoint_info import inspect_checkpoint  # the model layer imports torch
    from specav.models.loader import CheckpointError, check_checkpoint, vocabulary_mismatch

    paths = {"target": (config.target.path, "--model")}
    if config.speculative is not None:
        paths["drafter"] = (config.speculative.model, "--speculative-config's model")
    infos = {}
    for role, (path, flag) in paths.items():
        try:
            check_checkpoint(path, config.target.dtype, role)
            infos[role] = inspect_checkpoint(path, role)
        except CheckpointError as e:
            raise UsageError(f"{flag}: {e}") from None
    drafter = infos.get("drafter")
    target = infos["target"]
    if drafter and None not in (target.vocab_size, drafter.vocab_size) and target.vocab_size != drafter.vocab_size:
        raise UsageError(vocabulary_mismatch(target.source, target.vocab_size, drafter.source, drafter.vocab_size))
    contexts = {role: info.context_length for role, info in infos.items() if info.context_length}
    for role, context in contexts.items():
        if args.max_tokens >= context:
            raise UsageError(f"--max-tokens = {args.max_tokens} is invalid: allowed at most {context - 1} (the "
                             f"{role} has {context} positions, and the prompt takes at least one)")
    return Preflight(prompt, messages, config, sampling_params(args, target.generation), contexts)


def check_context(num_prompt_tokens: int, max_tokens: int, contexts: dict[str, int]) -> None:
    """The prompt and max_tokens fit the context of the target and the drafter."""
    for role, context in contexts.items():
        if num_prompt_tokens + max_tokens > context:
            allowed = context - num_prompt_tokens
            raise UsageError(
                f"--max-tokens = {max_tokens} is too many for this prompt ({num_prompt_tokens} tokens): the "
                f"{role} has {context} positions, so allowed at most {allowed}" if allowed >= 1 else
                f"the prompt ({num_prompt_tokens} tokens) does not fit the {role}'s {context} positions: "
                f"shorten it")


@command("generate")
def cmd_generate(args: argparse.Namespace) -> int:
    checked = preflight(args)
    from specav.engine.engine import Engine  # after the checks: a bad flag is refused without importing torch

    # One request (so a profile measured for any batch covers it), and one run: it spends on the
    # drafter only what its drafts may repay (Engine.from_config)
    engine = Engine.from_config(dataclasses.replace(checked.config, max_batch_size=1), defer_drafter=True)
    prompt_ids = encode_prompt(engine.tokenizer, checked.prompt, checked.messages, chat=not args.raw)
    check_context(len(prompt_ids), checked.params.max_tokens, checked.contexts)
    request = engine.add_request(prompt_ids, checked.params)
    shown = 0
    while engine.has_work():
        engine.step()
        sys.stdout.write(request.text[shown:])
        sys.stdout.flush()
        shown = len(request.text)
    print()
    print(f"[specav] {engine.stats.summary()}", file=sys.stderr)
    return 0


@command("profile")
def cmd_profile(args: argparse.Namespace) -> int:
    """Print the draft / verify cost profile adaptive verification plans with (measured once, cached)."""
    from specav.engine.engine import Engine
    from specav.engine.profile import format_profile

    config = engine_config(args)
    if config.speculative is None:
        raise ValueError("profile measures drafting and verification: drop --no-speculation")
    spec = dataclasses.replace(config.speculative, enable_adaptive_verification=True)
    engine = Engine.from_config(dataclasses.replace(config, speculative=spec), refresh_profile=args.refresh)
    print(format_profile(engine.planner.cost.profile))
    return 0


@command("eval")
def cmd_eval(args: argparse.Namespace) -> int:
    return EVAL_COMMANDS[args.eval_command](args)


EVAL_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _eval_collect(args: argparse.Namespace) -> int:
    from specav.engine.engine import Engine
    from specav.evaluation.collect import collect
    from specav.evaluation.workloads import WORKLOADS
    from specav.models.checkpoint_info import generation_defaults

    workloads = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    config = engine_config(args)
    if config.speculative is None:
        raise ValueError("eval collect needs a drafter: drop --no-speculation")
    engine = Engine.from_config(config)
    base = sampling_params(args, generation_defaults(args.model, "target"))

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
    "adaptive": "specav.bench.adaptive",
    "serve": "specav.bench.serve",
    "step_overhead": "specav.bench.step_overhead",
    "native": "specav.bench.native",
    "vocab_subset": "specav.bench.vocab_subset",
    "estimator_fit": "specav.bench.estimator_fit",
    "estimator_trace": "specav.bench.estimator_trace",
    "llama_cpp": "specav.bench.llama_cpp",
    "ab": "specav.bench.ab",
    "predictor": "specav.bench.predictor",
    "ceiling": "specav.bench.ceiling",
}


@command("bench")
def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.benchmark])
    sys.argv = [f"specav bench {args.benchmark}", *args.rest]
    module.main()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="specav", description="Speculative decoding with adaptive verification")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal",
                         description="Generate text for one prompt, streamed to stdout; a stats line goes to "
                                     "stderr. Sampling flags left out take the target checkpoint's recommended "
                                     "values (its generation_config.json, a GGUF file's general.sampling.* "
                                     "keys; for the packaged pair, Qwen2.5-Coder-Instruct's recommendation), "
                                     "else SamplingParams' defaults.")
    gen.add_argument("--prompt", help="the prompt (default: read stdin when it is a pipe or a file)")
    gen.add_argument("--messages", help="chat messages: JSON text (a list of {\"role\", \"content\"} objects) "
                                        "or the path of a file holding it")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    add_engine_flags(gen)
    add_sampling_flags(gen)

    prof = sub.add_parser("profile", help="measure (once per machine, cached) and print the draft and verify "
                                          "stage costs adaptive verification plans with")
    prof.add_argument("--refresh", action="store_true", help="measure again instead of reading the cache")
    add_engine_flags(prof)

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


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("specav")
    except PackageNotFoundError:
        return "(not installed)"


COMMANDS["serve"] = cmd_serve


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.command, COMMANDS[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
