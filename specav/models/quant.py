"""Quantized weight path: run a GGUF file's quantized weights natively, without dequantising them.

Owns: building a `PackedCausalLM` from a Llama / Qwen2 GGUF file in which every linear
layer (q, k, v, o, gate, up, down, lm_head) is a `QuantizedLinear` and the token
embedding is a `QuantizedEmbedding`; the precision modes behind `--dtype q4` and
`--dtype auto` (quant_choice.py says which kernel each mode picks).

- Weights: each linear layer holds only its packed quantized form (quant_kernels.py);
  the embedding holds the file's raw blocks and dequantises the rows it looks up (keeping
  the last 4096 tokens' rows: 25 MB for the packaged target, 15 MB for its drafter). No
  full-precision copy of a quantized tensor exists, ever: the model skeleton is built on
  the meta device, tensors are read from the file one at a time (quant_gguf.py), and
  requantising dequantises at most 4096 rows at once. The transient is about three
  copies of the tensor being packed, so the lm_head (the largest) is packed first.
  Measured, packaged pair (target + drafter) in one process: q4 2.32 GiB resident after
  loading, 2.38 GiB peak; auto 3.84 GiB, 3.94 GiB peak (kquant and int8dyn copies of the
  large layers; docs/quantized.md).
- Activations run in float32 (`ACTIVATION_DTYPE`): on CPUs without native bf16 (AVX2),
  float32 norms, attention and KV caches are faster than bf16, and each kernel converts
  its input to what it needs (bf16 for int4 / int8, int8 for int8dyn). KV caches follow
  (`PackedCausalLM.dtype` is float32).
- The packed forward and KV caches are unchanged: they call the modules by name. Each layer
  also gets `self_attn.qkv_proj` and `mlp.gate_up_proj` (`FusedLinear`): q/k/v and gate/up
  of one input in one native call where they all run kquant (packed.py and layer_ops.py use
  them when present), and `kquant` (`KQuantLayer`): at the row counts where all seven of its
  linears run kquant, the whole layer runs as one native call (layer_ops.py, native/decoder.cpp).
- Roles: a drafter in `auto` runs every layer on the native kernel, requantising its Q5_0 /
  Q8_0 weights to Q4_K at load (quant_choice.NativeDrafter); a target keeps the file's weights.

Exact vs approximate (see quant_formats.py and quant_kernels.py): Q4_K, Q4_0 and Q4_1
weights keep their exact codes (int4, scales and zeros rounded to bf16); other types are
requantised to int8 per output row; activations are rounded to bf16 (int4, int8) or
quantised to 7 bits per row (int8dyn). Norms, biases and the embedding are exact.

Must not know: tokenizers, sampling, the engine.
"""

from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specav.models import native
from specav.models.packed import PackedCausalLM
from specav.models.quant_choice import POLICIES, KernelPlan, MeasuredChoice, Policy, policy_for, shape_key
from specav.models.quant_formats import GGUFWeight, dequantize
from specav.models.quant_gguf import GGUFHeader, QuantizedGGUFError, read_header
from specav.models.quant_kernels import KERNELS, KQuantWeight, PackedWeight
from specav.models.threads import ThreadChoice

QUANTIZED_DTYPES = tuple(POLICIES)  # ("q4", "auto")
ACTIVATION_DTYPE = torch.float32

# GGUF tensor name (per block) -> transformers submodule of model.layers[i]
_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W only in packed quantized form; the kernel is chosen by row count."""

    def __init__(self, packed: dict[str, PackedWeight], plan: KernelPlan, bias: torch.Tensor | None,
                 policy: Policy | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = next(iter(packed.values())).shape
        self.packed = packed  # kernel name -> packed weight (one per kernel in the plan)
        self.plan = plan
        self.policy = policy  # what converted and planned it (a subset of its rows is built the same way)
        self._by_rows: dict[int, PackedWeight] = {}  # packed row count -> its packed weight (memo of plan)
        self.register_buffer("bias", bias)  # [N] float32 or None

    @classmethod
    def from_gguf(cls, weight: GGUFWeight, bias: torch.Tensor | None, policy: Policy,
                  head: bool = False) -> QuantizedLinear:
        weight = policy.convert(weight)
        plan = policy.plan(weight, head)
        return cls({k: KERNELS[k].pack(weight) for k in plan.distinct}, plan, bias, policy)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packed.values()) + (0 if self.bias is None else self.bias.nbytes)

    def packed_for(self, num_rows: int) -> PackedWeight:
        """The packed weight whose kernel runs `num_rows` rows."""
        weight = self._by_rows.get(num_rows)
        if weight is None:
            weight = self._by_rows[num_rows] = self.packed[self.plan.kernel_for(num_rows)]
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x # [..., in_features] -> # [..., out_features] in x's dtype."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [T, K]
        y = self.packed_for(rows.shape[0]).matmul(rows, self.bias)  # [T, N] float32
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        plan = ", ".join(f"{r}:{k}" for r, k in zip(self.plan.rows, self.plan.kernels))
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels by rows={{{plan}}}"


class FusedLinear(nn.Module):
    """Several QuantizedLinears of one input (q/k/v, gate/up) in their kernels' call for several
    weights where every one of them runs a kernel of one family at that row count (kquant and
    kquant_x8: one native call, one activation quantisation, one pass of the threads; int8dyn: the
    input's rows scaled once), else one call each. Holds no weights of its own: the members stay
    the model's submodules."""

    def __init__(self, members: list[QuantizedLinear]) -> None:
        super().__init__()
        self._members = tuple(members)  # not registered: they are already the parent's submodules

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x # [T, in_features] float32 -> one # [T, out_features_i] per member."""
        packed = [m.packed_for(x.shape[0]) for m in self._members]
        family = type(packed[0]).family()
        if family.fuses and all(type(p).family() is family for p in packed):  # the family's one call
            return family.matmuls(x, packed, [m.bias for m in self._members])
        return [m(x) for m in self._members]


class KQuantLayer:
    """A decoder layer as the native whole-layer call takes it (native/decoder.cpp): its seven
    linears (q, k, v, o, gate, up, down) at the row counts where every one of them runs kquant, and
    the arguments that stay the same from forward to forward (its norms, its index, the attention
    scale), gathered once per row count. Looked up layer by layer at every forward they cost about
    30 us a layer (Python on the caches each native call leaves cold): 0.5-0.9 ms of a one-row
    forward on the AMD EPYC. Holds no weights of its own: it reads the layer's modules at the first
    forward of each row count (after loading, which is the last to set their weights)."""

    def __init__(self, layer: nn.Module, index: int, next_norm: nn.Module) -> None:
        """next_norm: the norm after this layer (the next layer's input norm, or the final norm)."""
        attn, mlp = layer.self_attn, layer.mlp
        self._linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                         mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        self._layer, self._index, self._next_norm = layer, index, next_norm
        self._by_rows: dict[int, WholeLayerCall | None] = {}  # row count -> its call (memo, like packed_for's)

    def at(self, num_rows: int) -> WholeLayerCall | None:
        """The layer's call where q, k, v and o run kquant at num_rows rows (`mlp` True where gate,
        up and down do too: the whole layer, else its attention half), else None."""
        if num_rows not in self._by_rows:
            packed = [m.packed_for(num_rows) for m in self._linears]
            kquant = [isinstance(p, KQuantWeight) for p in packed]
            n = 7 if all(kquant) else 4 if all(kquant[:4]) else 0
            post, after = self._layer.post_attention_layernorm, self._next_norm
            self._by_rows[num_rows] = WholeLayerCall(
                [p.blocks for p in packed[:n]], [p.native_type for p in packed[:n]],
                [m.bias for m in self._linears[:n]], post.weight, post.variance_epsilon, after.weight,
                after.variance_epsilon, self._index, self._layer.self_attn.scaling, mlp=n == 7) if n else None
        return self._by_rows[num_rows]


@dataclass(frozen=True, slots=True)
class WholeLayerCall:
    """What the whole-layer call reads of a layer: its q, k, v, o, gate, up and down linears as kquant
    runs them (q, k, v and o only where `mlp` is False: the attention half's call), its two norms'
    weights and epsilons, its index and its attention scale."""

    blocks: list[torch.Tensor]  # each [N, bytes per row] uint8: KQuantWeight.blocks
    qtypes: list[int]  # GGUF type codes (Q4_K, Q6_K)
    biases: list[torch.Tensor | None]  # [N] float32 or None
    post_norm: torch.Tensor  # [hidden] the post-attention norm's weight
    post_eps: float
    next_norm: torch.Tensor  # [hidden] the norm after the layer (the next layer's input norm, or the final one)
    next_eps: float
    index: int  # the layer's index (its slot in each cache)
    scale: float  # attention's softmax scale
    mlp: bool = True  # the MLP's linears too (the whole layer in one call), else the attention half


class QuantizedEmbedding(nn.Module):
    """Token embedding kept as the file's blocks; looked-up rows are dequantised exactly, and the
    rows of the last `memo_rows` distinct tokens kept: the gguf package's dequantiser spends about
    0.4 ms on one row (numpy on a few blocks, the AMD EPYC), a fifth of what a decoding forward
    spends outside its native calls, where a kept row costs microseconds and text reuses its
    tokens. The kept rows are a [memo_rows, hidden] float32 table (25 MB for the packaged target),
    least recently used first out."""

    def __init__(self, weight: GGUFWeight, memo_rows: int = 4096) -> None:
        super().__init__()
        self.name, self.qtype = weight.name, weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.blocks = np.array(weight.blocks)  # [V, bytes_per_row], owned (not a view of the file)
        self.memo_rows = memo_rows
        self._table: torch.Tensor | None = None  # [memo_rows, hidden], made at the first lookup
        self._slot: OrderedDict[int, int] = OrderedDict()  # token -> its row of _table, oldest use first

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids # [...] -> # [..., hidden] float32."""
        flat = ids.reshape(-1).tolist()
        distinct = list(dict.fromkeys(flat))
        if len(distinct) > self.memo_rows:  # more than the memo holds: straight from the blocks
            return self._dequantize(flat).reshape(*ids.shape, self.embedding_dim)
        if self._table is None:
            self._table = torch.empty(self.memo_rows, self.embedding_dim, dtype=ACTIVATION_DTYPE)
        missing = []
        for token in distinct:  # this lookup's tokens are the most recent: evicted last
            if token in self._slot:
                self._slot.move_to_end(token)
            else:
                missing.append(token)
        if missing:
            rows = self._dequantize(missing)
            for token, row in zip(missing, rows):
                slot = len(self._slot) if len(self._slot) < self.memo_rows else self._slot.popitem(last=False)[1]
                self._table[slot] = row
                self._slot[token] = slot
        slots = torch.tensor([self._slot[t] for t in flat], dtype=torch.int64)
        return self._table.index_select(0, slots).reshape(*ids.shape, self.embedding_dim)

    def _dequantize(self, tokens: list[int]) -> torch.Tensor:
        rows = GGUFWeight(self.name, self.qtype, (len(tokens), self.embedding_dim), self.blocks[tokens])
        return dequantize(rows).to(ACTIVATION_DTYPE)


def load_quantized(path: Path, mode: str, profile_path: Path | None = None, role: str = "target") -> PackedCausalLM:
    """Build the packed model of GGUF file `path` with its weights quantized as `mode` says.

    profile_path: where `auto` keeps its measured kernel times (None: measure, keep nothing).
    role: "target" or "drafter" (a drafter in `auto` runs every layer natively: quant_choice.py).
    """
    from transformers import AutoModelForCausalLM

    if mode not in POLICIES:
        raise ValueError(f"quantized mode {mode!r} is unknown; use one of {QUANTIZED_DTYPES}")
    header = read_header(path)
    config = hf_config(header)
    policy = policy_for(mode, role, profile_path)
    if isinstance(policy, MeasuredChoice):
        policy.measure_missing(_linear_shapes(header))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=ACTIVATION_DTYPE)
    files = _Tensors(header, config)
    lm_head_name = "output.weight" if "output.weight" in header.tensors else "token_embd.weight"

    def head() -> QuantizedLinear:
        return QuantizedLinear.from_gguf(header.weight(lm_head_name), None, policy, head=True)

    def linear(i: int, gguf_name: str) -> QuantizedLinear:
        weight, bias = files.linear(f"blk.{i}.{gguf_name}")
        return QuantizedLinear.from_gguf(weight, bias, policy)

    # Packing is most of a load (dequantising, requantising, fbgemm's prepack: all outside the GIL),
    # so the weights are packed by as many threads as torch computes with, each one weight at a time
    # (the peak grows by one weight's transient per thread). The lm_head first: the largest matrix,
    # its transient (~3 copies of it) lands while little else is resident.
    jobs = [head] + [functools.partial(linear, i, gguf_name) for i in range(len(hf.model.layers)) for gguf_name in _LINEARS]
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        linears = pool.map(lambda build: build(), jobs)
        lm_head = next(linears)
        for i, layer in enumerate(hf.model.layers):
            for module in _LINEARS.values():
                layer.set_submodule(module, next(linears))
            for gguf_name, module in _NORMS.items():
                layer.get_submodule(module).weight = files.parameter(f"blk.{i}.{gguf_name}.weight")
            attn, mlp = layer.self_attn, layer.mlp  # one call for the projections of one input (packed.py)
            attn.qkv_proj = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up_proj = FusedLinear([mlp.gate_proj, mlp.up_proj])
            after = hf.model.layers[i + 1].input_layernorm if i + 1 < len(hf.model.layers) else hf.model.norm
            layer.kquant = KQuantLayer(layer, i, after)  # the whole layer in one native call where it can (layer_ops.py)
            _return_freed_memory()
    hf.model.norm.weight = files.parameter("output_norm.weight")
    hf.model.embed_tokens = QuantizedEmbedding(header.weight("token_embd.weight"))
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)  # its buffers were built on meta
    hf.lm_head = lm_head
    packed = PackedCausalLM(hf)
    if native.available():  # the thread count changes speed only, never the native kernels' numbers
        packed.threads = ThreadChoice()
    _check_materialised(hf, path)
    _return_freed_memory()
    return packed


def _linear_shapes(header: GGUFHeader) -> dict:
    """One linear weight per (type, shape) of the file: profile key -> (its type, a reader)."""
    lm_head = "output.weight" if "output.weight" in header.tensors else "token_embd.weight"
    shapes = {}
    for info in header.tensors.values():
        parts = info.name.split(".")
        if info.name == lm_head or (len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEARS and parts[3] == "weight"):
            key = shape_key(info.qtype, (info.dims[1], info.dims[0]))  # torch order: (N, K)
            shapes.setdefault(key, (info.qtype, functools.partial(header.weight, info.name)))
    return shapes


def hf_config(header: GGUFHeader):
    """The transformers config of a Llama / Qwen2 GGUF file, from its metadata."""
    from transformers import AutoConfig

    arch = header.field("general.architecture")

    def arch_field(key: str, default=Ellipsis):
        return header.field(f"{arch}.{key}", default)

    if "token_embd.weight" not in header.tensors:
        raise QuantizedGGUFError(f"GGUF file {str(header.path)!r} has no token_embd.weight tensor")
    heads = arch_field("attention.head_count")
    kwargs = {
        "vocab_size": int(header.tensors["token_embd.weight"].dims[1]),
        "hidden_size": arch_field("embedding_length"),
        "intermediate_size": arch_field("feed_forward_length"),
        "num_hidden_layers": arch_field("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": arch_field("attention.head_count_kv", heads),
        "max_position_embeddings": arch_field("context_length", 4096),
        "rms_norm_eps": arch_field("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": arch_field("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "bos_token_id": header.field("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": header.field("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": header.field("tokenizer.ggml.padding_token_id", None),
    }
    if arch == "llama" and arch_field("rope.dimension_count", None) is not None:
        kwargs["head_dim"] = arch_field("rope.dimension_count")
    return AutoConfig.for_model(arch, **kwargs)


class _Tensors:
    """Linear layers and vectors of one GGUF file in transformers' layout (Llama q/k row order)."""

    def __init__(self, header: GGUFHeader, config) -> None:
        self.header = header
        self.permute = {}  # llama.cpp interleaves the rotary halves of Llama's q and k rows
        if config.model_type == "llama":
            self.permute = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}

    def vector(self, name: str) -> torch.Tensor:
        return dequantize(self.header.weight(name)).reshape(-1)

    def parameter(self, name: str) -> nn.Parameter:
        return nn.Parameter(self.vector(name).to(ACTIVATION_DTYPE), requires_grad=False)

    def linear(self, base: str) -> tuple[GGUFWeight, torch.Tensor | None]:
        weight = self.header.weight(f"{base}.weight")
        bias = self.vector(f"{base}.bias") if f"{base}.bias" in self.header.tensors else None
        heads = self.permute.get(base.rsplit(".", 1)[-1])
        if heads is not None:
            order = _rotary_row_order(weight.shape[0], heads)
            weight = replace(weight, blocks=weight.blocks[order])
            bias = None if bias is None else bias[torch.from_numpy(order)]
        return weight, bias


def _rotary_row_order(rows: int, heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permutation (transformers' `_reverse_permute_weights`)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _check_materialised(hf: nn.Module, path: Path) -> None:
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise QuantizedGGUFError(f"GGUF file {str(path)!r}: no weights for {left[:5]}; the quantized "
                                 f"path maps only Llama/Qwen2 tensors")


def _return_freed_memory() -> None:
    """Packing frees many large temporaries; ask glibc to give their pages back to the system."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps them for reuse
        pass


def quantized_nbytes(model: PackedCausalLM) -> int:
    """Bytes held by the model's weights: packed linears, embedding blocks, norms."""
    total = 0
    for module in model.hf_model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            total += module.nbytes
        else:
            total += sum(p.nbytes for p in module.parameters(recurse=False))
    return total
