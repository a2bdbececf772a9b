"""What a checkpoint says about itself, read without loading its weights.

Owns: a checkpoint's context length, its vocabulary size (rows of the output head, what
speculative decoding compares between target and drafter) and the sampling values its authors
recommend, read from a Hugging Face directory's config.json and generation_config.json, from a
GGUF file's header (`general.sampling.*`, via the fast reader), or, for the packaged pair, from
the upstream generation config recorded in packaged.py (those GGUF files carry none). Headers
only, well under a second, so a front end can check its inputs before loading any model.

Recommended sampling follows vLLM's default (`--generation-config auto`): a value the caller
gives wins; a sampling field the caller leaves out takes the checkpoint's recommendation; the
rest keep SamplingParams' defaults. Applied: temperature, top_k, top_p. A recommended
repetition_penalty is read and reported, not applied: SamplingParams has no penalties yet.

Must not know: the engine, drafting, how sampling is done.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from specav.config import ConfigError, SamplingParams
from specav.models import packaged
from specav.models.loader import CheckpointError
from specav.models.quant_gguf import GGUFHeader, QuantizedGGUFError
from specav.models.quant_gguf import read_header as _read_header

APPLIED_FIELDS = ("temperature", "top_k", "top_p")  # recommended values that SamplingParams takes
_HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
            "repetition_penalty": "repetition_penalty"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The sampling values a checkpoint recommends (by SamplingParams field name) and where they came from."""

    values: Mapping[str, float] = field(default_factory=dict)
    source: str = "none"

    @property
    def applied(self) -> dict[str, float]:
        """The recommended values SamplingParams takes (the rest, e.g. repetition_penalty, are reported only)."""
        return {k: v for k, v in self.values.items() if k in APPLIED_FIELDS}

    def sampling_params(self, **given) -> SamplingParams:
        """SamplingParams from the caller's values (None = not given), the recommendation for sampling
        fields not given, and SamplingParams' own defaults for the rest."""
        given = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(**{**self.applied, **given})


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    source: str  # the path (or "default") it describes
    context_length: int | None  # positions the model was built for (None: the checkpoint does not say)
    vocab_size: int | None  # rows of the output head
    generation: GenerationDefaults


def generation_defaults(path: str, role: str = "target") -> GenerationDefaults:
    """The sampling values checkpoint `path` ("default" = the packaged model for `role`) recommends."""
    if path == "default":
        model = packaged.PACKAGED[role]
        return _clean(dict(model.generation), f"the packaged {role}'s generation config ({model.name})")
    p = Path(path).expanduser()
    if p.is_dir():
        return _from_hf_dir(p)
    return _from_gguf(read_header(p))


def inspect_checkpoint(path: str, role: str = "target") -> CheckpointInfo:
    """Context length, vocabulary size and recommended sampling of `path`, from headers only.

    The packaged pair is assembled first if it is not in the cache yet (packaged.assembled_gguf)."""
    if path == "default":
        try:
            gguf_path = packaged.assembled_gguf(packaged.PACKAGED[role])
        except packaged.PackagedModelError as e:
            raise CheckpointError(str(e)) from None
        return CheckpointInfo(path, *_gguf_shape(read_header(gguf_path)), generation_defaults(path, role))
    p = Path(path).expanduser()
    if p.is_dir():
        config = _read_json(p / "config.json")
        text = config.get("text_config", config)  # multimodal configs nest the language model's
        return CheckpointInfo(path, _int_or_none(text.get("max_position_embeddings")),
                              _int_or_none(text.get("vocab_size")), _from_hf_dir(p))
    header = read_header(p)
    return CheckpointInfo(path, *_gguf_shape(header), _from_gguf(header))


def _from_hf_dir(directory: Path) -> GenerationDefaults:
    config_path = directory / "generation_config.json"
    config = _read_json(config_path)
    values = {name: config[key] for key, name in _HF_KEYS.items() if key in config}
    return _clean(values, str(config_path))


def _from_gguf(header: GGUFHeader) -> GenerationDefaults:
    values = {name: header.metadata[key] for key, name in _GGUF_KEYS.items() if key in header.metadata}
    return _clean(values, f"{header.path} (general.sampling.*)")


def _gguf_shape(header: GGUFHeader) -> tuple[int | None, int | None]:
    arch = header.metadata.get("general.architecture")
    embedding = header.tensors.get("token_embd.weight")
    return (_int_or_none(header.metadata.get(f"{arch}.context_length")),
            int(embedding.dims[1]) if embedding is not None and len(embedding.dims) > 1 else None)


def _clean(values: dict, source: str) -> GenerationDefaults:
    """Keep the values a request could use: each must pass SamplingParams' own check alone."""
    kept = {}
    for name, value in values.items():
        if name == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        if name in APPLIED_FIELDS:
            try:
                SamplingParams(**{name: value})
            except (ConfigError, TypeError):
                continue
        elif not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            continue
        kept[name] = value
    return GenerationDefaults(kept, source if kept else "none")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} cannot be read ({type(e).__name__}: {e})") from None
    return data if isinstance(data, dict) else {}


def read_header(path: Path) -> GGUFHeader:
    try:
        return _read_header(path)
    except QuantizedGGUFError as e:
        raise CheckpointError(str(e)) from None


def _int_or_none(value) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
