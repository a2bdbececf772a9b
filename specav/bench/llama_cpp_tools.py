"""Running llama.cpp's own tools (built by llama_cpp.py) and reading their figures.

Owns: the command lines of `llama-bench` (target-only forwards: one token, and 5- and
16-token batches, on a context of given depth), `llama-completion` (target-only greedy
decoding of a prompt) and `llama-speculative-simple` (greedy speculative decoding with a
drafter, static K), and parsing what they print into named results. Prompts are passed as
text (the chat template already applied: special tokens are parsed, escapes are not), so
each result says how many prompt tokens the tool saw, for the caller to check against its own.

`llama-speculative-simple` (`--spec-type draft-simple`: a draft model) verifies greedily (a draft token is kept when the target's own
sampler picks it), so it is compared at temperature 0 only; `--spec-draft-p-min 0` and
`--spec-draft-n-min 0` make it draft exactly K tokens per step (static K), as specav's
static K does.

Must not know: specav's models or the engine.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specav.bench.llama_cpp import LlamaCppBuildError, LlamaCppTools


@dataclass(frozen=True, slots=True)
class BenchRates:
    """llama-bench's figures for one model: ms per forward of 1 token (decode) and of n-token batches."""

    depth: int  # tokens already in the context
    decode_ms: float  # one generated token (median over repetitions)
    batch_ms: dict[int, float]  # n -> one n-token batch forward (prompt processing), median

    @property
    def decode_tps(self) -> float:
        return 1e3 / self.decode_ms


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """One greedy decoding run of a tool."""

    tokens: int  # tokens generated
    seconds: float  # time after the prompt (llama-completion: its eval time; speculative: its decode time)
    prompt_tokens: int  # how many tokens the tool made of the prompt text
    drafted: int = 0  # speculative only
    accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


# ---- parsers (pure) ---------------------------------------------------------------------------

def parse_bench_json(text: str) -> BenchRates:
    """llama-bench `-o json` output (one model, one thread count) -> BenchRates."""
    records = json.loads(text)
    depths = {r["n_depth"] for r in records}
    if len(depths) != 1:
        raise ValueError(f"llama-bench output has several depths {sorted(depths)}; run one at a time")
    decode, batch = None, {}
    for r in records:
        median_ms = statistics.median(r["samples_ns"]) / 1e6
        if r["n_gen"] > 0 and r["n_prompt"] == 0:
            decode = median_ms / r["n_gen"]
        elif r["n_prompt"] > 0 and r["n_gen"] == 0:
            batch[r["n_prompt"]] = median_ms
    if decode is None:
        raise ValueError("llama-bench output has no token-generation test (-n > 0)")
    return BenchRates(depths.pop(), decode, batch)


_EVAL = re.compile(r"perf\w*_print:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_PROMPT = re.compile(r"perf\w*_print:\s+prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def parse_completion_log(log: str) -> DecodeRun:
    """llama-completion's performance lines -> DecodeRun (its eval time covers the tokens after the first)."""
    evaluated, prompt = _EVAL.search(log), _PROMPT.search(log)
    if evaluated is None or prompt is None:
        raise ValueError("llama-completion printed no 'eval time' / 'prompt eval time' lines")
    return DecodeRun(int(evaluated.group(2)), float(evaluated.group(1)) / 1e3, int(prompt.group(1)))


def parse_speculative_log(log: str) -> DecodeRun:
    """llama-speculative-simple's summary -> DecodeRun with drafted and accepted counts."""
    found = {}
    for key, pattern in (("encoded", r"encoded\s+(\d+) tokens in"),
                         ("decoded", r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
                         ("drafted", r"n_drafted\s*=\s*(\d+)"), ("accepted", r"n_accept\s*=\s*(\d+)")):
        match = re.search(pattern, log)
        if match is None:
            raise ValueError(f"llama-speculative-simple printed no {key!r} line")
        found[key] = match.groups()
    return DecodeRun(int(found["decoded"][0]), float(found["decoded"][1]), int(found["encoded"][0]),
                     int(found["drafted"][0]), int(found["accepted"][0]))


# ---- command lines ----------------------------------------------------------------------------

def bench_command(tools: LlamaCppTools, model: Path, threads: int, batches: Sequence[int], gen: int, depth: int,
                  repeats: int) -> list[str]:
    return [str(tools.tool("llama-bench")), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, batches)),
            "-n", str(gen), "-d", str(depth), "-r", str(repeats), "-o", "json"]


def completion_command(tools: LlamaCppTools, model: Path, prompt_file: Path, tokens: int,
                       threads: int) -> list[str]:
    return [str(tools.tool("llama-completion")), "-m", str(model), "-f", str(prompt_file), "-n", str(tokens),
            "-t", str(threads), "-tb", str(threads), "-c", "2048", "--temp", "0", "--ignore-eos", "-no-cnv",
            "--no-escape", "--no-warmup", "--no-display-prompt"]


def speculative_command(tools: LlamaCppTools, target: Path, drafter: Path, prompt_file: Path, tokens: int, k: int,
                        threads: int) -> list[str]:
    return [str(tools.tool("llama-speculative-simple")), "-m", str(target), "-md", str(drafter),
            "-f", str(prompt_file), "-n", str(tokens), "-t", str(threads), "-tb", str(threads),
            "-td", str(threads), "-tbd", str(threads), "-c", "2048", "--temp", "0", "--ignore-eos",
            "--no-escape", "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]


# ---- running ----------------------------------------------------------------------------------

def run_bench(tools: LlamaCppTools, model: Path, threads: int, batches: Sequence[int] = (5, 16), gen: int = 32,
              depth: int = 128, repeats: int = 3) -> BenchRates:
    return parse_bench_json(_run(bench_command(tools, model, threads, batches, gen, depth, repeats)).stdout)


def run_completion(tools: LlamaCppTools, model: Path, prompt_text: str, tokens: int, threads: int) -> DecodeRun:
    with _prompt_file(prompt_text) as path:
        return parse_completion_log(_run(completion_command(tools, model, path, tokens, threads)).stderr)


def run_speculative(tools: LlamaCppTools, target: Path, drafter: Path, prompt_text: str, tokens: int, k: int,
                    threads: int) -> DecodeRun:
    with _prompt_file(prompt_text) as path:
        return parse_speculative_log(_run(speculative_command(tools, target, drafter, path, tokens, k,
                                                              threads)).stderr)


class _prompt_file:
    """The prompt text in a temporary file for -f, which drops one trailing newline: one is added."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __enter__(self) -> Path:
        self._tmp = tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8")
        self._tmp.write(self.text + "\n")
        self._tmp.flush()
        return Path(self._tmp.name)

    def __exit__(self, *exc) -> None:
        self._tmp.close()


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LlamaCppBuildError(f"{Path(cmd[0]).name} failed (exit {done.returncode}): {done.stderr[-800:]}")
    return done
