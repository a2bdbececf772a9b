"""Loading checkpoints: the packaged default pair, local HF directories, local GGUF files.

Owns: resolving a model path ("default" or a local path), validating it (exists, supported
architecture, intact GGUF), loading weights and tokenizer with transformers offline, and
checking that a target and a drafter share one vocabulary. Every failure is a
`CheckpointError` that names the path and says what to do.

The packaged pair is assembled from its chunk packages (packaged.py) and converted once
to a bf16 safetensors directory in the cache, so later loads skip GGUF dequantisation.
Every dtype of the packaged pair loads from that directory: fp32 computes in float32 on
the same bf16-rounded weights (a local GGUF file in fp32 keeps its full dequantised values).

Quantized dtypes ("q4", "auto"; quant.py) run a GGUF file's quantized weights natively, so
they need a GGUF file: the packaged models and local .gguf files. "auto" on a Hugging Face
directory has nothing quantized to choose from and loads bf16.

Must not know: drafting, sampling, the engine.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from specav.models import packaged
from specav.models.packed import SUPPORTED_MODEL_TYPES, PackedCausalLM
from specav.models.quant import QUANTIZED_DTYPES, QuantizedGGUFError, load_quantized

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KERNEL_PROFILE = "kernel-profile.json"  # in packaged.cache_root(): kernel times measured for "auto"


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
    if dtype not in TORCH_DTYPES and dtype not in QUANTIZED_DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of "
                              f"{sorted(TORCH_DTYPES) + list(QUANTIZED_DTYPES)}")
    if path == "default":
        return _load_packaged(packaged.PACKAGED[role], dtype, role)
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{role} checkpoint {str(p)!r} does not exist: pass a local Hugging Face "
                              f"model directory, a .gguf file, or 'default' for the packaged {role}")
    if p.is_dir():
        if dtype in QUANTIZED_DTYPES and dtype != "auto":
            raise CheckpointError(f"dtype {dtype!r} runs a GGUF file's quantized weights, but {str(p)!r} is a "
                                  f"Hugging Face directory: pass its .gguf file, or use one of "
                                  f"{sorted(TORCH_DTYPES)} or 'auto'")
        return _load_hf_dir(p, "bf16" if dtype == "auto" else dtype)
    if p.suffix.lower() == ".gguf" or _starts_with_gguf_magic(p):
        return _load_gguf(p, dtype, role)
    raise CheckpointError(f"{role} checkpoint {str(p)!r} is neither a directory nor a GGUF file: pass a "
                          f"Hugging Face model directory (config.json + *.safetensors) or a .gguf file")


def check_same_vocabulary(target: Checkpoint, drafter: Checkpoint) -> None:
    """Speculative decoding compares p and q token by token: both must index one vocabulary."""
    tv, dv = target.model.vocab_size, drafter.model.vocab_size
    if tv != dv:
        raise CheckpointError(f"target {target.source!r} has vocabulary size {tv} but drafter "
                              f"{drafter.source!r} has {dv}: choose a drafter with the target's tokenizer")
    if target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        raise CheckpointError(f"target {target.source!r} and drafter {drafter.source!r} have different "
                              f"tokenizers (same size, different tokens): choose a drafter from the "
                              f"target's model family")


def _load_packaged(model: packaged.PackagedModel, dtype: str, role: str = "target") -> Checkpoint:
    try:
        gguf_path = packaged.assembled_gguf(model)
    except packaged.PackagedModelError as e:
        raise CheckpointError(str(e)) from None
    converted = gguf_path.parent / "hf-bf16"
    if dtype in QUANTIZED_DTYPES:  # the tokenizer loads faster from the converted directory
        tokenizer_dir = converted if (converted / "tokenizer.json").exists() else None
        return _load_gguf_quantized(gguf_path, dtype, tokenizer_dir, role)
    if not (converted / "config.json").exists():
        _convert_to_hf(gguf_path, converted)
    checkpoint = _load_hf_dir(converted, dtype)
    checkpoint.gguf_path = gguf_path
    return checkpoint


def _convert_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file once into a bf16 safetensors directory (atomic: temp dir, then rename)."""
    print(f"specav: converting {gguf_path.name} to bf16 safetensors in {out_dir} (once; later loads reuse it)",
          flush=True)
    checkpoint = _load_gguf(gguf_path, "bf16")
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    checkpoint.model.hf_model.save_pretrained(tmp)
    checkpoint.tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def _load_hf_dir(path: Path, dtype: str) -> Checkpoint:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").exists():
        raise CheckpointError(f"{str(path)!r} has no config.json: it is not a Hugging Face model directory")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    _check_architecture(config.model_type, path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise CheckpointError(f"{str(path)!r} has no weights (*.safetensors): copy the checkpoint's "
                              f"weight files into it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} has no usable tokenizer ({e}): add tokenizer.json / "
                              f"tokenizer_config.json from the same model") from None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype], local_files_only=True)
    return Checkpoint(PackedCausalLM(hf), tokenizer, str(path), None)


def _load_gguf(path: Path, dtype: str, role: str = "target") -> Checkpoint:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    architecture = _check_gguf(path)
    _check_architecture(architecture, path)
    if dtype in QUANTIZED_DTYPES:
        return _load_gguf_quantized(path, dtype, role=role)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=TORCH_DTYPES[dtype],
            quantization_config=GgufConfig(dequantize=True))
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise CheckpointError(f"GGUF file {str(path)!r} could not be loaded ({type(e).__name__}: {e}); "
                              f"check that it is a complete Llama/Qwen2 GGUF file") from None
    hf = hf.to(TORCH_DTYPES[dtype])
    return Checkpoint(PackedCausalLM(hf), tokenizer, str(path), path)


def _load_gguf_quantized(path: Path, dtype: str, tokenizer_dir: Path | None = None, role: str = "target") -> Checkpoint:
    from transformers import AutoTokenizer

    try:
        tokenizer = (AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True) if tokenizer_dir
                     else AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
        model = load_quantized(path, dtype, packaged.cache_root() / KERNEL_PROFILE, role)
    except (QuantizedGGUFError, ValueError, KeyError, IndexError, OSError) as e:
        raise CheckpointError(f"GGUF file {str(path)!r} could not be loaded as {dtype!r} "
                              f"({type(e).__name__}: {e}); check that it is a complete Llama/Qwen2 GGUF "
                              f"file, or load it as bf16") from None
    return Checkpoint(model, tokenizer, str(path), path)


def _check_gguf(path: Path) -> str:
    """Parse the header and check every tensor lies inside the file; return the architecture."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        architecture = str(reader.fields["general.architecture"].contents())
        data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    except Exception as e:  # the gguf reader raises many types on a damaged file
        raise CheckpointError(f"GGUF file {str(path)!r} is corrupt or truncated ({type(e).__name__}: {e}); "
                              f"re-download or re-assemble it") from None
    size = path.stat().st_size
    if data_end > size:
        raise CheckpointError(f"GGUF file {str(path)!r} is truncated: its tensors need {data_end} bytes but "
                              f"the file has {size}; re-download or re-assemble it")
    return architecture


def _check_architecture(architecture: str, path: Path) -> None:
    if architecture not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{str(path)!r} is a {architecture!r} model; specav's packed forward supports "
                              f"{list(SUPPORTED_MODEL_TYPES)} (the Llama and Qwen2 families)")


def _starts_with_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == packaged.GGUF_MAGIC
