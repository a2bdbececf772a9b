"""GGUF header: metadata scalars and the tensor table, read without parsing the vocabulary.

Owns: walking a GGUF (v2 / v3, little-endian) header for what the quantized path needs
(architecture and hyperparameters, special token ids, and where each tensor's blocks lie),
and reading one tensor's blocks from the file into memory it owns.

Why not `gguf.GGUFReader`: it turns every metadata array into numpy views, which for a
151,936-token vocabulary plus its merges takes 10-20 s and holds ~0.4 GB; here arrays are
skipped (their length is kept), which takes well under a second. Tensor blocks are read
with plain file reads, so the file's pages never count in this process's memory.

Must not know: torch, kernels, models.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from specav.models.quant_formats import GGUFWeight

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class QuantizedGGUFError(ValueError):
    """A GGUF file lacks what the quantized path needs or is damaged; the message names the file."""


@dataclass(frozen=True, slots=True)
class ArrayField:
    """A metadata array, skipped: only its length is kept."""

    length: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: gguf.GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (input) dimension
    offset: int  # absolute byte offset of the blocks in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, object]  # scalars and strings; arrays as ArrayField
    tensors: dict[str, TensorInfo]

    def field(self, key: str, default=Ellipsis):
        if key not in self.metadata:
            if default is Ellipsis:
                raise QuantizedGGUFError(f"GGUF file {str(self.path)!r} has no metadata {key!r}")
            return default
        return self.metadata[key]

    def weight(self, name: str) -> GGUFWeight:
        """Tensor `name` as a GGUFWeight whose blocks # [N, bytes_per_row] are an owned copy."""
        info = self.tensors.get(name)
        if info is None:
            raise QuantizedGGUFError(f"GGUF file {str(self.path)!r} has no tensor {name!r}: it is not a "
                                     f"complete Llama/Qwen2 model")
        k = info.dims[0]
        n = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        blocks = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return GGUFWeight(name, info.qtype, (n, k), blocks.reshape(n, -1))


def read_header(path: Path) -> GGUFHeader:
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(path, data)
    except (struct.error, ValueError, KeyError, UnicodeDecodeError, OSError) as e:
        if isinstance(e, QuantizedGGUFError):
            raise
        raise QuantizedGGUFError(f"GGUF file {str(path)!r} is corrupt or truncated ({type(e).__name__}: {e}); "
                                 f"re-download or re-assemble it") from None


def _parse(path: Path, data: mmap.mmap) -> GGUFHeader:
    if data[:4] != _MAGIC:
        raise QuantizedGGUFError(f"{str(path)!r} does not start with the GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise QuantizedGGUFError(f"GGUF file {str(path)!r} is version {version}; versions 2 and 3 are read "
                                 f"(a big-endian file reads as a huge version number)")
    cursor = _Cursor(data, 24)
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
        infos.append((name, gguf.GGMLQuantizationType(cursor.scalar("<I")), dims, cursor.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, qtype, dims, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
        tensors[name] = TensorInfo(name, qtype, dims, start + offset, nbytes)
    end = max((t.offset + t.nbytes for t in tensors.values()), default=start)
    if end > len(data):
        raise QuantizedGGUFError(f"GGUF file {str(path)!r} is truncated: its tensors need {end} bytes but the "
                                 f"file has {len(data)}; re-download or re-assemble it")
    return GGUFHeader(path, metadata, tensors)


class _Cursor:
    def __init__(self, data: mmap.mmap, offset: int) -> None:
        self.data, self.offset = data, offset

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.offset += n
        return bytes(self.data[self.offset - n:self.offset]).decode("utf-8")

    def skip_string(self) -> None:
        self.offset += 8 + struct.unpack_from("<Q", self.data, self.offset)[0]

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, length = self.scalar("<I"), self.scalar("<Q")
        if item in _SCALARS:
            self.offset += length * struct.calcsize(_SCALARS[item])
        elif item == _STRING:
            for _ in range(length):
                self.skip_string()
        else:  # arrays of arrays: walk them
            for _ in range(length):
                self.value(item)
        return ArrayField(length)
