"""Quantized matmul kernels: one packed weight per kernel, all with the same call.

Owns: packing a `GGUFWeight` for one of torch's CPU kernels, and running
`y = x @ W^T + b` with it: x # [T, K] float32 -> y # [T, N] float32. Each kernel states which
GGUF types it holds exactly and what it approximates:

| kernel  | weights                     | activations          | exact for                 | error* |
|---------|-----------------------------|----------------------|---------------------------|--------|
| int4    | 4-bit, (scale, zero) per 32 | rounded to bf16      | Q4_0, Q4_1, Q4_K codes    | ~0.3%  |
| int8    | int8, one scale per row     | rounded to bf16      | none (requantised)        | 0.5-3% |
| int8dyn | int8, one scale per row     | int8 per row (7 bit) | none (both requantised)   | 2-4%   |
| kquant  | the file's Q4_K/Q6_K blocks | int8 per 256 columns | Q4_K, Q6_K codes + scales | ~0.7%  |
| kquant_x8 | Q4_K, 8 features a vector | int8 per 256 columns | Q4_K codes + scales       | ~0.7%  |

*relative error of y against x @ dequantize(W)^T, measured on random and on the packaged
files' tensors (tests/test_quant.py); bf16 F.linear on the same weights: ~0.25%.

int4 is `torch.ops.aten._weight_int4pack_mm_for_cpu` (bf16 scales and zeros), int8 is
`_weight_int8pack_mm`, int8dyn is fbgemm's int8 GEMM
(`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`). For int8dyn each input row
is scaled to max |x| = 1 before it is quantised with one fixed scale, so the activation
quantisation is per row. Activations use 7 bits (0..128 around zero point 64) because
fbgemm's AVX2 path adds pairs of u8 x s8 products in int16, which saturates with 8-bit
activations. kquant is specav's own kernel (native/kquant.cpp, compiled on first use for the instruction
set this machine runs safely, AVX-512 VNNI or AVX2; absent where it cannot be built): it reads
the file's 4.5 or 6.6 bits per weight as stored, where the others read 8 or more, which is what
decoding one row on a CPU is bound by, and decodes each weight block once for up to 8 rows, which
is what verifying several rows is bound by. Several kquant weights of one
input run in one call (`kquant_matmuls`: q/k/v, gate/up). kquant_x8 runs the same Q4_K codes and
scales repacked at load with 8 output features interleaved in each vector (4.6 bits per weight):
a row then needs no horizontal sums and each sub-block's scales are applied once for 8 features,
so several rows cost about what an int8 GEMM costs, where kquant's per-(feature, row) dot products
cost about twice that (docs/quantized.md). All five are batch-invariant: a row's output is bit for
bit the same whatever other rows share the call (tested).

Must not know: models, modules, which kernel is fastest (quant_choice.py measures that).
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import gguf
import numpy as np
import torch

from specav.models import native
from specav.models.quant_formats import GROUP, GGUFWeight, int4_groups, int8_rows

T = gguf.GGMLQuantizationType
_DYN_SCALE, _DYN_ZERO_POINT = 2 / 127, 64  # x in [-1, 1] -> 0..128 (7 bits: no int16 saturation)


class PackedWeight:
    """A weight packed for one kernel. Subclasses set `kernel` and implement `matmul`."""

    kernel: ClassVar[str]
    exact_types: ClassVar[frozenset[T]] = frozenset()
    fuses: ClassVar[bool] = False  # whether `matmuls` does several weights of one input in one call

    def __init__(self, shape: tuple[int, int], nbytes: int) -> None:
        self.shape = shape  # (N, K)
        self.nbytes = nbytes

    @classmethod
    def supports(cls, qtype: T) -> bool:
        return True

    @classmethod
    def fits(cls, qtype: T, shape: tuple[int, int]) -> bool:
        """Whether `pack` takes a weight of this type and (N, K) shape."""
        return cls.supports(qtype)

    @classmethod
    def pack(cls, weight: GGUFWeight) -> PackedWeight:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x # [T, K] float32, bias # [N] float32 or None -> x W^T + bias # [T, N] float32."""
        y = self._matmul(x)
        return y if bias is None else y.add_(bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x # [T, K] float32 -> x W^T # [T, N] float32."""
        raise NotImplementedError

    @classmethod
    def family(cls) -> type[PackedWeight]:
        """The kernels whose weights `matmuls` takes together (this one's own, unless it says more)."""
        return cls

    @classmethod
    def matmuls(cls, x: torch.Tensor, weights: list[PackedWeight], biases: list[torch.Tensor | None]
                ) -> list[torch.Tensor]:
        """x # [T, K] float32 against several weights of this family that share the input (q/k/v,
        gate/up) -> one # [T, N_i] float32 each: one `matmul` each, unless the kernel `fuses`."""
        return [w.matmul(x, b) for w, b in zip(weights, biases)]


class Int4Weight(PackedWeight):
    kernel = "int4"
    exact_types = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, shape: tuple[int, int]) -> None:
        super().__init__(shape, packed.nbytes + scales_zeros.nbytes)
        self.packed = packed  # [N, K/2] uint8, torch's CPU int4 layout
        self.scales_zeros = scales_zeros  # [K/32, N, 2] bf16

    @classmethod
    def supports(cls, qtype: T) -> bool:
        return qtype in cls.exact_types

    @classmethod
    def pack(cls, weight: GGUFWeight) -> Int4Weight:
        codes, scales, zeros = int4_groups(weight)  # [N, K] uint8, [N, K/32] x 2
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(packed, scales_zeros, weight.shape)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros).float()


class Int8Weight(PackedWeight):
    kernel = "int8"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__(tuple(codes.shape), codes.nbytes + scales.nbytes)
        self.codes = codes  # [N, K] int8
        self.scales = scales  # [N] bf16

    @classmethod
    def pack(cls, weight: GGUFWeight) -> Int8Weight:
        codes, scales = int8_rows(weight)
        return cls(codes, scales.to(torch.bfloat16))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales).float()


class Int8DynamicWeight(PackedWeight):
    kernel = "int8dyn"
    fuses = True

    def __init__(self, packed: torch.ScriptObject, shape: tuple[int, int]) -> None:
        super().__init__(shape, shape[0] * shape[1] + 8 * shape[0])
        self.packed = packed  # fbgemm's packed int8 matrix (per-row scales inside)

    @classmethod
    def pack(cls, weight: GGUFWeight) -> Int8DynamicWeight:
        codes, scales = int8_rows(weight)
        with warnings.catch_warnings():  # quantized tensors are deprecated after torch 2.13 (pinned here)
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qweight = torch._make_per_channel_quantized_tensor(
                codes, scales.double(), torch.zeros(codes.shape[0], dtype=torch.long), 0)
        del codes  # the quantized tensor holds its own copy; keep the packing peak at two copies
        return cls(torch.ops.quantized.linear_prepack(qweight, None), weight.shape)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul_rows(*int8dyn_rows(x))

    @classmethod
    def matmuls(cls, x, weights, biases):
        return int8dyn_matmuls(x, weights, biases)  # one scaling of x's rows for all of them

    def matmul_rows(self, scaled: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """x W^T from int8dyn_rows(x) # [T, K], [T, 1] (computed once for several weights of x)."""
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            scaled, _DYN_SCALE, _DYN_ZERO_POINT, self.packed)
        return y.mul_(amax)


def int8dyn_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x # [T, K] -> (each row scaled to max |x| = 1, the rows' max |x| # [T, 1]): what int8dyn
    quantises. Row by row, so a row's numbers do not depend on the others (batch invariance)."""
    x = x.float()
    # abs().amax(): linalg.vector_norm's inf norm is one op but several times slower on a few rows
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)  # [T, 1]
    return x / amax, amax


def int8dyn_matmuls(x: torch.Tensor, weights: list[Int8DynamicWeight], biases: list[torch.Tensor | None]
                    ) -> list[torch.Tensor]:
    """x # [T, K] against several int8dyn weights of one input (gate/up), its rows scaled once (the
    torch ops around the kernel cost tens of microseconds each on cold caches) -> one # [T, N_i] each;
    the same numbers as one call per weight."""
    scaled, amax = int8dyn_rows(x)
    outputs = [w.matmul_rows(scaled, amax) for w in weights]
    return [y if b is None else y.add_(b) for y, b in zip(outputs, biases)]


def ends_in_first_half(k: int) -> bool:
    """Whether a width K ends in the first half of its last 256-element block (K mod 256 in 1..128):
    a Q4_K weight padded to whole blocks (requantize_q4_k) then holds zero weights in that block's
    second half, which the native kernels can leave out."""
    return 0 < k % 256 <= 128


class KQuantWeight(PackedWeight):
    """The native kernel on Q4_K / Q6_K blocks as the file stores them. A Q4_K weight requantised
    with K padded past half a block (requantize_q4_k: the drafter's K = 896 is 3.5 blocks) keeps
    only the first 80 bytes of each row's last block: its second half holds zero weights that the
    kernel would read for nothing (11% of the weight's bytes at K = 896; native/kquant.cpp)."""

    kernel = "kquant"
    exact_types = frozenset({T.Q4_K, T.Q6_K})
    fuses = True
    Q4_K_BYTES, HALF_BYTES = 144, 64  # a Q4_K block of 256 weights; the second half of its nibbles

    def __init__(self, qtype: T, blocks: torch.Tensor, shape: tuple[int, int], ops) -> None:
        super().__init__(shape, blocks.nbytes)
        self.qtype = qtype
        self.blocks = blocks  # [N, bytes per row] uint8: the file's blocks (see pack)
        self.ops = ops  # the native variant's op namespace (native.ops(), unless a test names one)

    @classmethod
    def supports(cls, qtype: T) -> bool:
        return qtype in cls.exact_types and native.available()

    @classmethod
    def pack(cls, weight: GGUFWeight, ops=None) -> KQuantWeight:
        if weight.qtype not in cls.exact_types or not native.available() and ops is None:
            raise ValueError(f"kquant cannot run {weight.name} ({weight.qtype.name}): "
                             f"{native.unavailable_reason() or 'only Q4_K and Q6_K'}")
        blocks = weight.blocks
        if weight.qtype == T.Q4_K and ends_in_first_half(weight.shape[1]) and blocks.shape[1] % cls.Q4_K_BYTES == 0:
            blocks = np.ascontiguousarray(blocks[:, :-cls.HALF_BYTES])  # the half block's zero half, left unread
        return cls(weight.qtype, torch.from_numpy(blocks), weight.shape, ops if ops is not None else native.ops())

    @property
    def ends_in_half_block(self) -> bool:
        """Whether each row ends in a Q4_K block's first half (pack left its zero half out)."""
        return self.qtype == T.Q4_K and self.blocks.shape[1] % self.Q4_K_BYTES == self.Q4_K_BYTES - self.HALF_BYTES

    def whole_blocks(self) -> torch.Tensor:
        """`blocks` with a last half block's zero half restored (what the kernel reads for nothing
        where pack keeps it: bench native times both)."""
        if not self.ends_in_half_block:
            return self.blocks
        return torch.cat([self.blocks, self.blocks.new_zeros(self.blocks.shape[0], self.HALF_BYTES)], 1)

    @property
    def native_type(self) -> int:
        """The type code kq_matmul (and the whole-layer call) takes for `blocks`: the GGUF type's."""
        return int(self.qtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.kq_matmul(x.float().contiguous(), [self.blocks], [self.native_type], [bias])[0]  # bias added inside

    @classmethod
    def family(cls) -> type[PackedWeight]:
        return KQuantWeight  # kquant and kquant_x8 weights of one input run in one kq_matmul

    @classmethod
    def matmuls(cls, x, weights, biases):
        return kquant_matmuls(x, weights, biases)  # one activation quantisation, one pass of the threads


def kquant_matmuls(x: torch.Tensor, weights: list[KQuantWeight], biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """x # [T, K] against several kquant weights of one input in one native call (one activation
    quantisation, one pass of the threads): q/k/v, or gate/up -> one # [T, N_i] per weight."""
    return weights[0].ops.kq_matmul(x.float().contiguous(), [w.blocks for w in weights],
                                    [w.native_type for w in weights], biases)


class KQuantX8Weight(KQuantWeight):
    """The native kernel on Q4_K repacked at load with 8 output features interleaved (native/kquant.cpp,
    kq_matmul's type 112, `x8_tile`): the file's codes and scales, 4.6 bits per weight, laid out so
    that a row needs no horizontal sums and each sub-block's scales apply to 8 features at once:
    several rows cost about as much as an int8 GEMM's, one row about as much as kquant's or less
    (docs/quantized.md). Q4_K with N a multiple of 8; K a multiple of 256, or padded to one
    (requantize_q4_k: the drafter's K = 896), where a last half block keeps only its first half
    of codes (as kquant's). A kquant weight to every caller (`blocks`, `native_type`): fused calls
    and the whole-layer call take either layout."""

    kernel = "kquant_x8"
    exact_types = frozenset({T.Q4_K})
    NATIVE_TYPE = 112  # kquant.cpp's kQ4KX8
    GROUP_BYTES, HALF_GROUP_BYTES = 1184, 672  # 8 features' block; its half (codes of sub-blocks 0-3)
    SCALE_BYTES = 160  # a group's block ends in its scales: sc 64, m 64, d 16, dmin 16

    @classmethod
    def fits(cls, qtype: T, shape: tuple[int, int]) -> bool:
        return cls.supports(qtype) and cls._lays_out(qtype, shape)

    @classmethod
    def _lays_out(cls, qtype: T, shape: tuple[int, int]) -> bool:
        """Q4_K blocks always span 256 columns: a K that is no multiple of 256 comes padded."""
        return qtype in cls.exact_types and shape[0] % 8 == 0

    @classmethod
    def pack(cls, weight: GGUFWeight, ops=None) -> KQuantX8Weight:
        padded = weight.blocks.shape[1] == -(-weight.shape[1] // 256) * cls.Q4_K_BYTES
        if not cls._lays_out(weight.qtype, weight.shape) or not padded or not native.available() and ops is None:
            raise ValueError(f"kquant_x8 cannot run {weight.name} ({weight.qtype.name}, {weight.shape}): "
                             f"{native.unavailable_reason() or 'only Q4_K with N % 8 == 0'}")
        return cls(weight.qtype, torch.from_numpy(interleave_q4_k(weight)), weight.shape,
                   ops if ops is not None else native.ops())

    @property
    def ends_in_half_block(self) -> bool:
        return self.blocks.shape[1] % self.GROUP_BYTES == self.HALF_GROUP_BYTES

    def whole_blocks(self) -> torch.Tensor:
        if not self.ends_in_half_block:
            return self.blocks
        codes = self.blocks.shape[1] - self.SCALE_BYTES  # the last block's scales follow its codes
        zeros = self.blocks.new_zeros(self.blocks.shape[0], self.GROUP_BYTES - self.HALF_GROUP_BYTES)
        return torch.cat([self.blocks[:, :codes], zeros, self.blocks[:, codes:]], 1)

    @property
    def native_type(self) -> int:
        return self.NATIVE_TYPE


def interleave_q4_k(weight: GGUFWeight) -> np.ndarray:
    """Q4_K blocks # [N, nb * 144] -> kq_matmul's interleaved layout (type 112) # [N / 8, nb * 1184]
    uint8 (native/kquant.cpp, x8_tile): per group of 8 features and block, codes 1024 bytes (vector
    v, feature n: byte i = code 8v + i | code 8v + 4 + i << 4), sc [j][n], m [p][n][2] (m_2p,
    m_2p+1), d [n] and dmin [n] as the file's float16. Where K ends in the first half of the last
    block (K mod 256 in 1..128: zero weights after it), that block keeps only its first 512 bytes
    of codes: # [N / 8, nb * 1184 - 512]."""
    n, k = weight.shape
    g, nb = n // 8, -(-k // 256)
    blocks = np.ascontiguousarray(weight.blocks).reshape(n, nb, 144)
    codes = (blocks[..., 16:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    codes = codes.reshape(g, 8, nb, 32, 2, 4)  # [group, feature, block, v, low/high half of 8 codes, i]
    nibbles = (codes[..., 0, :] | (codes[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)  # [g, nb, v, feature, i]
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # [n * nb, 8] each
    sc = sc.reshape(g, 8, nb, 8).transpose(0, 2, 3, 1)  # [g, nb, j, feature]
    m = m.reshape(g, 8, nb, 4, 2).transpose(0, 2, 3, 1, 4)  # [g, nb, p, feature, 2]
    d = blocks[..., 0:4].reshape(g, 8, nb, 2, 2).transpose(0, 2, 3, 1, 4)  # [g, nb, d / dmin, feature, 2 bytes]
    nibbles = nibbles.reshape(g, nb, 1024)
    scales = np.concatenate([sc.astype(np.uint8).reshape(g, nb, 64), m.astype(np.uint8).reshape(g, nb, 64),
                             d.reshape(g, nb, 32)], axis=2)  # [g, nb, 160]
    if not ends_in_first_half(k):
        return np.ascontiguousarray(np.concatenate([nibbles, scales], axis=2).reshape(g, nb * 1184))
    whole = np.concatenate([nibbles[:, :-1], scales[:, :-1]], axis=2).reshape(g, (nb - 1) * 1184)
    return np.ascontiguousarray(np.concatenate([whole, nibbles[:, -1, :512], scales[:, -1]], axis=1))


KERNELS: dict[str, type[PackedWeight]] = {
    k.kernel: k for k in (Int4Weight, Int8Weight, Int8DynamicWeight, KQuantWeight, KQuantX8Weight)}
