"""The command line on tiny local checkpoints, and its errors."""

from __future__ import annotations

import json

import pytest

from specav.cli import main
from tests.tiny_models import save_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return save_tiny_checkpoint(root / "target", "llama", seed=1), save_tiny_checkpoint(root / "draft", "llama", seed=2)


def test_generate_streams_text_and_prints_stats(checkpoints, capsys):
    target, drafter = checkpoints
    spec = json.dumps({"model": drafter, "method": "draft_model", "num_speculative_tokens": 3,
                       "draft_sample_method": "probabilistic", "enable_adaptive_verification": False})
    rc = main(["generate", "--model", target, "--dtype", "fp32", "--speculative-config", spec, "--raw",
               "--prompt", "w1 w2 w3", "--max-tokens", "12", "--temperature", "0.8", "--seed", "7"])
    out = capsys.readouterr()
    assert rc == 0
    assert len(out.out.split()) >= 1
    assert "tokens/s" in out.err and "acceptance per position [" in out.err


def test_unknown_speculative_key_is_named(checkpoints, capsys):
    target, drafter = checkpoints
    rc = main(["generate", "--model", target, "--speculative-config", json.dumps({"model": drafter, "k": 3}),
               "--raw", "--prompt", "w1"])
    assert rc == 2
    assert "unknown key(s) ['k']" in capsys.readouterr().err


def test_bad_value_names_key_value_and_allowed(checkpoints, capsys):
    target, drafter = checkpoints
    rc = main(["generate", "--model", target, "--speculative-config",
               json.dumps({"model": drafter, "num_speculative_tokens": 0}), "--raw", "--prompt", "w1"])
    err = capsys.readouterr().err
    assert rc == 2 and "num_speculative_tokens = 0" in err and "[1, 32]" in err


def test_missing_model_path_is_reported(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "absent"), "--no-speculation", "--raw", "--prompt", "w1"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_tokenizer_without_chat_template_suggests_raw(checkpoints, capsys):
    target, _ = checkpoints
    rc = main(["generate", "--model", target, "--no-speculation", "--prompt", "w1"])
    assert rc == 2 and "--raw" in capsys.readouterr().err
