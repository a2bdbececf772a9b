"""Loading checkpoints: the packaged default pair, local HF directories, local GGUF files.

Owns: resolving a model path ("default" or a local path), validating it (exists, supported
architecture, intact GGUF), loading weights and tokenizer with transformers offline, and
checking that a target and a drafter share one vocabulary. Every failure is a
`CheckpointError` that names the path and says what to do.

The packaged pair is assembled from its chunk packages (packaged.py) and converted once
to a bf16 safetensors directory in the cache, so later loads skip GGUF dequantisation.
Every dtype of the packaged pair loads from that directory: fp32 computes in float32 on
the same bf16-rounded weights (a local GGUF file in fp32 keeps its full dequantised values).
The conversion writes a temporary directory named for its process and renames it into place;
one left behind by a killed conversion is removed by the next one.

Every transformers call reads local files only (`local_files_only=True`): no model hub is
contacted, and importing specav sets no environment variables.

Quantized dtypes ("q4", "auto"; quant.py) run a GGUF file's quantized weights natively, so
they need a GGUF file: the packaged models and local .gguf files. "auto" on a Hugging Face
directory has nothing quantized to choose from and loads bf16.

Must not know: drafting, sampling, the engine.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specav.models import packaged
from specav.models.cache import cache_root, prepare_dir, remove_stale_temps, temp_path, write_error
from specav.models.packed import SUPPORTED_MODEL_TYPES, PackedCausalLM
from specav.models.quant import QUANTIZED_DTYPES, QuantizedGGUFError, load_quantized
from specav.models.quant_gguf import read_header
from specav.progress import phase

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KERNEL_PROFILE = "kernel-profile.json"  # in cache_root(): kernel times measured for "auto"


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the path and the remedy."""


@dataclass(slots=True)
class Checkpoint:
    model: PackedCausalLM
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    source: str  # the path it came from (for messages and logs)
    gguf_path: Path | None  # the GGUF file behind it, if any


def load_checkpoint(path: str, dtype: str = "bf16", role: str = "target") -> Checkpoint:
    """Load `path` ("default" = the packaged model for `role`, a HF directory, or a .gguf file)."""
    kind = check_checkpoint(path, dtype, role)
    if kind == "packaged":
        return _load_packaged(packaged.PACKAGED[role], dtype, role)
    p = Path(path).expanduser()
    if kind == "hf":
        return _load_hf_dir(p, "bf16" if dtype == "auto" else dtype)
    return _load_gguf(p, dtype, role)


def check_checkpoint(path: str, dtype: str = "bf16", role: str = "target") -> str:
    """What can be checked without loading weights; returns the kind: "packaged", "hf" or "gguf".

    The dtype is known, the path exists and is a Hugging Face directory (config.json of a supported
    architecture, weight files) or a GGUF file of a supported architecture (its header, read fast),
    and the dtype suits it. Raises CheckpointError naming the path and the remedy."""
    if dtype not in TORCH_DTYPES and dtype not in QUANTIZED_DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of "
                              f"{sorted(TORCH_DTYPES) + list(QUANTIZED_DTYPES)}")
    if path == "default":
        return "packaged"
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{role} checkpoint {str(p)!r} does not exist: pass a local Hugging Face "
                              f"model directory, a .gguf file, or 'default' for the packaged {role}")
    if p.is_dir():
        if dtype in QUANTIZED_DTYPES and dtype != "auto":
            raise CheckpointError(f"dtype {dtype!r} runs a GGUF file's quantized weights, but {str(p)!r} is a "
                                  f"Hugging Face directory: pass its .gguf file, or use one of "
                                  f"{sorted(TORCH_DTYPES)} or 'auto'")
        _check_hf_dir(p)
        return "hf"
    if p.suffix.lower() == ".gguf" or _starts_with_gguf_magic(p):
        _check_architecture(_check_gguf(p), p)
        return "gguf"
    raise CheckpointError(f"{role} checkpoint {str(p)!r} is neither a directory nor a GGUF file: pass a "
                          f"Hugging Face model directory (config.json + *.safetensors) or a .gguf file")


def check_same_vocabulary(target: Checkpoint, drafter: Checkpoint) -> None:
    """Speculative decoding compares p and q token by token: both must index one vocabulary."""
    tv, dv = target.model.vocab_size, drafter.model.vocab_size
    if tv != dv:
        raise CheckpointError(vocabulary_mismatch(target.source, tv, drafter.source, dv))
    if target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        raise CheckpointError(f"target {target.source!r} and drafter {drafter.source!r} have different "
                              f"tokenizers (same size, different tokens): choose a drafter from the "
                              f"target's model family, or decode without one (--no-speculation)")


def vocabulary_mismatch(target: str, target_size: int, drafter: str, drafter_size: int) -> str:
    return (f"target {target!r} has vocabulary size {target_size} but drafter {drafter!r} has {drafter_size}: "
            f"choose a drafter with the target's tokenizer, or decode without one (--no-speculation)")


def _load_packaged(model: packaged.PackagedModel, dtype: str, role: str = "target") -> Checkpoint:
    try:
        gguf_path = packaged.assembled_gguf(model)
    except packaged.PackagedModelError as e:
        raise CheckpointError(str(e)) from None
    converted = gguf_path.parent / "hf-bf16"
    if dtype in QUANTIZED_DTYPES:
        return _load_gguf_quantized(gguf_path, dtype, lambda: _packaged_tokenizer(gguf_path, converted), role)
    if not (converted / "config.json").exists():
        _convert_to_hf(gguf_path, converted)
    checkpoint = _load_hf_dir(converted, dtype)
    checkpoint.gguf_path = gguf_path
    return checkpoint


def _packaged_tokenizer(gguf_path: Path, converted: Path):
    """The packaged model's tokenizer, from a directory it was saved to once: loading it from there
    took 3 s on a busy 2-core machine, from the GGUF file's vocabulary arrays 12-37 s. Saved beside
    the GGUF the first time (where the cache cannot take it, it loads from the GGUF file every time)."""
    from transformers import AutoTokenizer

    saved = gguf_path.parent / "tokenizer"
    for directory in (converted, saved):
        if (directory / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    with phase(f"reading the tokenizer of {gguf_path} (once; later runs load the copy saved beside it)"):
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tmp = temp_path(saved)
    try:
        remove_stale_temps(saved)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, saved)
    except OSError:
        pass  # a read-only or full cache: nothing kept, nothing lost
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _convert_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file once into a bf16 safetensors directory (atomic: temp dir, then rename)."""
    what = f"the bf16 conversion of {gguf_path.name}"
    prepare_dir(out_dir.parent, _bf16_bytes(gguf_path), what)
    remove_stale_temps(out_dir)
    tmp = temp_path(out_dir)
    try:
        with phase(f"converting {gguf_path} to bf16 safetensors in {out_dir} (once; later loads reuse it)"):
            checkpoint = _load_gguf(gguf_path, "bf16")
            checkpoint.model.hf_model.save_pretrained(tmp)
            checkpoint.tokenizer.save_pretrained(tmp)
            shutil.rmtree(out_dir, ignore_errors=True)
            os.replace(tmp, out_dir)
    except OSError as e:
        raise write_error(e, out_dir.parent, what) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bf16_bytes(gguf_path: Path) -> int:
    """Bytes of the bf16 safetensors of a GGUF file: 2 per weight, plus room for the tokenizer."""
    import numpy as np

    header = read_header(gguf_path)
    return sum(2 * int(np.prod(t.dims, dtype=np.int64)) for t in header.tensors.values()) + (64 << 20)


def _load_hf_dir(path: Path, dtype: str) -> Checkpoint:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_hf_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} has no usable tokenizer ({e}): add tokenizer.json / "
                              f"tokenizer_config.json from the same model") from None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype], local_files_only=True)
    return Checkpoint(PackedCausalLM(hf), tokenizer, str(path), None)


def _check_hf_dir(path: Path) -> None:
    """config.json of a supported architecture and weight files, without importing transformers."""
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} has no config.json: it is not a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path / 'config.json')!r} cannot be read ({type(e).__name__}: {e}); "
                              f"copy the checkpoint's config.json again") from None
    _check_architecture(str(config.get("model_type") if isinstance(config, dict) else None), path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CheckpointError(f"{str(path)!r} has no weights (*.safetensors): copy the checkpoint's "
                              f"weight files into it")


def _load_gguf(path: Path, dtype: str, role: str = "target") -> Checkpoint:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _check_architecture(_check_gguf(path), path)
    if dtype in QUANTIZED_DTYPES:
        return _load_gguf_quantized(path, dtype, role=role)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=TORCH_DTYPES[dtype],
            quantization_config=GgufConfig(dequantize=True), local_files_only=True)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise CheckpointError(f"GGUF file {str(path)!r} could not be loaded ({type(e).__name__}: {e}); "
                              f"check that it is a complete Llama/Qwen2 GGUF file") from None
    hf = hf.to(TORCH_DTYPES[dtype])
    return Checkpoint(PackedCausalLM(hf), tokenizer, str(path), path)


def _load_gguf_quantized(path: Path, dtype: str, load_tokenizer: Callable[[], object] | None = None,
                         role: str = "target") -> Checkpoint:
    from transformers import AutoTokenizer

    try:
        tokenizer = (load_tokenizer() if load_tokenizer else
                     AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True))
        model = load_quantized(path, dtype, cache_root() / KERNEL_PROFILE, role)
    except (QuantizedGGUFError, ValueError, KeyError, IndexError, OSError) as e:
        raise _unloadable(path, dtype, e) from None
    return Checkpoint(model, tokenizer, str(path), path)


def _unloadable(path: Path, dtype: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"GGUF file {str(path)!r} could not be loaded as {dtype!r} ({type(e).__name__}: {e}); "
                           f"check that it is a complete Llama/Qwen2 GGUF file, or load it as bf16")


def _check_gguf(path: Path) -> str:
    """Parse the header with the fast reader (every tensor must lie inside the file); return the
    architecture."""
    try:
        header = read_header(path)
        return str(header.field("general.architecture"))
    except QuantizedGGUFError as e:
        raise CheckpointError(str(e)) from None


def _check_architecture(architecture: str, path: Path) -> None:
    if architecture not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{str(path)!r} is a {architecture!r} model; specav's packed forward supports "
                              f"{list(SUPPORTED_MODEL_TYPES)} (the Llama and Qwen2 families)")


def _starts_with_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == packaged.GGUF_MAGIC
