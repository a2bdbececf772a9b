"""GGUF weight formats: read quantized tensors as blocks and convert them to torch's integer layouts.

Owns: one GGUF tensor as its raw blocks (`GGUFWeight`), the float reference
(`dequantize`, which is the `gguf` package's own dequantiser), and the two conversions the
kernels need:

- `int4_groups`: Q4_K (and Q4_0, Q4_1) -> 4-bit codes with one (scale, zero) per 32
  columns, the layout of torch's int4 CPU kernel, where w = (code - 8) * scale + zero. Q4_K stores
  w = d * sc_j * q - dmin * m_j per 32-element sub-block j, so code = q, scale = d * sc_j and
  zero = 8 * d * sc_j - dmin * m_j. The codes are exact; scale and zero are exact in float32
  (d and dmin are float16, sc_j and m_j 6-bit integers) and the kernel rounds them to
  bfloat16 (relative error <= 2^-9, a few hundredths of one quantisation step).
- `int8_rows`: any type -> int8 codes with one symmetric scale per output row,
  scale = max|w| / 127. This is a requantisation of the dequantised weights, so it is
  approximate: each weight moves by at most half an int8 step of its row (max|w| / 254).
  Q5_0, Q6_K and Q8_0 have 32 to 256 levels per 16- or 32-element block; no torch CPU
  kernel takes per-block scales with more than 4 bits, so int8 per row is the closest
  layout that is fast here.

- `requantize_q4_k`: any type -> Q4_K blocks (approximate), for the drafter's Q5_0 / Q8_0
  tensors, so that the native kernel runs every drafter layer (drafter precision never touches
  losslessness: the rejection sampler uses whatever q the drafter produced).

Shapes use torch's order: a weight is # [N, K] (N output features, K input features); the
GGUF header lists the same tensor as [K, N].

Must not know: modules, kernels' speed, or which model the tensor belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
GROUP = 32  # Q4_K sub-block = torch int4 kernel group
_ROW_CHUNK = 4096  # rows dequantised at a time when requantising (bounds the float32 transient)


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """One GGUF tensor in its stored form: blocks # [N, bytes_per_row] (quant_gguf.py reads them)."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, int]  # (N, K) in torch order
    blocks: np.ndarray  # [N, bytes_per_row] uint8

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)


_DEQUANT_BLOCKS = 1 << 14  # blocks per call of a type's block dequantiser (bounds its transients: ~16 MB each)


def dequantize(weight: GGUFWeight, rows: slice | np.ndarray = slice(None)) -> torch.Tensor:
    """The float reference: rows of the weight as # [n, K] float32 (the gguf package's dequantiser).
    Blocks padded past K (requantize_q4_k) dequantise to their first K columns."""
    data = np.ascontiguousarray(weight.blocks[rows])
    out = np.asarray(_dequantize_rows(data, weight.qtype), dtype=np.float32).reshape(data.shape[0], -1)
    if out.shape[1] != weight.shape[1]:
        out = out[:, :weight.shape[1]]
    if np.may_share_memory(out, weight.blocks) or not out.flags.c_contiguous:  # F32 tensors are views of the file
        out = np.ascontiguousarray(out).copy()
    return torch.from_numpy(out)


def _dequantize_rows(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """gguf.quants.dequantize of rows # [n, bytes per row], its own block dequantiser called on many
    rows at once: the package's array path takes 16 rows a call, and its Python between calls was
    a third of the packaged pair's load on the AMD EPYC (36 of 100 s under cProfile). The same
    arithmetic on the same blocks: the package's output bit for bit (tests/test_quant.py)."""
    trait = getattr(gguf.quants, qtype.name, None)  # the package's class of the type (Q4_K, Q6_K, ...)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if not (isinstance(trait, type) and hasattr(trait, "dequantize_rows")) or data.ndim != 2 \
            or data.shape[1] % type_size:
        return gguf.quants.dequantize(data, qtype)  # plain floats and odd shapes: the package's own path
    trait.init_grid()  # what the package's array path does first (the i-quants' lookup grids)
    n = data.shape[0]
    out = np.empty((n, data.shape[1] // type_size * block_size), dtype=np.float32)
    step = max(1, _DEQUANT_BLOCKS // max(1, data.shape[1] // type_size))
    for start in range(0, n, step):
        out[start:start + step] = trait.dequantize_rows(data[start:start + step])
    return out


def int4_groups(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit types -> (codes # [N, K] uint8 in 0..15, scales # [N, K/32] float32, zeros # [N, K/32] float32).

    w = (codes - 8) * scale + zero reproduces the type's dequantisation exactly in float32.
    """
    decode = _INT4_DECODERS.get(weight.qtype)
    if decode is None:
        raise ValueError(f"{weight.name} is {weight.qtype.name}; 4-bit groups exist for "
                         f"{sorted(t.name for t in _INT4_DECODERS)}")
    n, k = weight.shape
    codes, scale, zero = decode(np.ascontiguousarray(weight.blocks))
    groups = k // GROUP
    return (torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(scale.reshape(n, groups)),
            torch.from_numpy(zero.reshape(n, groups)))


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes # [nb, c, run] -> codes # [nb, c, 2 * run]: `run` low nibbles, then their high nibbles."""
    shifted = qs[..., None, :] >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)  # [nb, c, 2, run]
    return (shifted & np.uint8(0x0F)).reshape(*qs.shape[:-1], 2 * run)


def _q4_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = data.reshape(-1, 18)  # d f16, 16 bytes of nibbles; w = d * (q - 8)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)[:, 0]
    return _nibbles(blocks[:, None, 2:], 16), d, np.zeros_like(d)


def _q4_1(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = data.reshape(-1, 20)  # d f16, m f16, 16 bytes of nibbles; w = d * q + m
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)[:, 0]
    m = blocks[:, 2:4].view(np.float16).astype(np.float32)[:, 0]
    return _nibbles(blocks[:, None, 4:], 16), d, 8 * d + m


def _q4_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # 256-element super-block: d f16, dmin f16, 12 bytes of 6-bit (sc_j, m_j), 128 bytes of nibbles;
    # sub-block j (32 elements) is w = d * sc_j * q - dmin * m_j; each 32 bytes hold two sub-blocks.
    blocks = data.reshape(-1, 144)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [nb, 1]
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)  # [nb, 1]
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [nb, 8] each
    scale = d * sc.astype(np.float32)
    return _nibbles(blocks[:, 16:].reshape(-1, 4, 32), 32), scale, 8 * scale - dmin * m.astype(np.float32)


_INT4_DECODERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k}


def requantize_q4_k(weight: GGUFWeight, quantize: Callable[[torch.Tensor], torch.Tensor]) -> GGUFWeight:
    """Any type -> Q4_K blocks of its dequantised values (approximate: a second rounding, to 4.5 bits
    per weight). K is padded with zero weights to whole 256-element blocks (Q4_K's super-block; the
    drafter's K = 896 becomes 4 blocks, the last half zeros); the shape stays (N, K), so the padding
    is invisible to the kernels' callers.

    quantize: rows # [n, K] float32 -> their Q4_K blocks # [n, ceil(K / 256) * 144] uint8, zero-padded
    (the native quantiser, llama.cpp's reference algorithm: native/quantize.cpp).
    """
    n, k = weight.shape
    blocks = np.empty((n, -(-k // 256) * 144), dtype=np.uint8)
    for start in range(0, n, _ROW_CHUNK):
        rows = slice(start, min(n, start + _ROW_CHUNK))
        blocks[rows] = quantize(dequantize(weight, rows)).numpy()  # [n_chunk, K] -> its blocks
    return GGUFWeight(weight.name, T.Q4_K, (n, k), blocks)


def int8_rows(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Any type -> (codes # [N, K] int8 in -127..127, scale # [N] float32): w ~ codes * scale."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.float32)
    for start in range(0, n, _ROW_CHUNK):
        rows = slice(start, min(n, start + _ROW_CHUNK))
        w = dequantize(weight, rows)  # [n_chunk, K]
        s = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        codes[rows] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[rows] = s
    return codes, scales
