"""A vocabulary-subset output head for the drafter: only the N most frequent tokens get logits.

Owns: `VocabSubsetHead`, which computes only N rows of an output head and returns
full-vocabulary logits with -inf outside the subset (so sampling, features and rejection
sampling downstream are unchanged: q = 0 outside the subset), building its N-row head from a
dense `nn.Linear` or from a quantized `QuantizedLinear` (from the selected rows of the GGUF
tensor, with the same kernels as the full head), and `apply_vocab_subset`, which swaps it
into a loaded drafter.

Why it is lossless: rejection sampling only needs the q that the draft tokens were sampled
from, and the drafter samples from this q. What it costs is acceptance where the target
wants a token outside the subset; what it saves is the output head's matmul, which for a
152k-token vocabulary is a large part of a small drafter's forward (docs/quantized.md
measures both).

The subset's logits equal the full head's on the subset: every kernel computes each output
row from that row's weights alone (dense rows are copied; quantized rows keep the file's
blocks), which tests/test_vocab_subset.py checks.

Must not know: the engine, sampling, or how the ranking is made (vocab_ranking.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specav.models.loader import Checkpoint
from specav.models.packed import PackedCausalLM
from specav.models.quant import QuantizedLinear
from specav.models.quant_choice import KernelPlan
from specav.models.quant_formats import GGUFWeight
from specav.models.quant_gguf import read_header
from specav.models.vocab_ranking import VocabRanking, VocabRankingError, load_ranking


class VocabSubsetHead(nn.Module):
    """logits # [T, V]: the rows of `token_ids` from `rows` (an N-row head), -inf everywhere else."""

    def __init__(self, rows: nn.Module, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.rows = rows  # [T, hidden] -> [T, N]
        self.register_buffer("token_ids", token_ids.to(torch.int64))  # [N], ascending
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x # [T, hidden] -> # [T, V] in the N-row head's dtype."""
        sub = self.rows(x)  # [T, N]
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), -math.inf)  # [T, V]
        return out.index_copy_(-1, self.token_ids, sub)

    def extra_repr(self) -> str:
        return f"subset={self.token_ids.numel()} of {self.vocab_size} tokens"


def _dense_rows(head: nn.Linear, token_ids: torch.Tensor, gguf_path: Path | None) -> nn.Module:
    rows = nn.Linear(head.in_features, len(token_ids), bias=head.bias is not None, device=head.weight.device,
                     dtype=head.weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(head.weight[token_ids])
        if head.bias is not None:
            rows.bias.copy_(head.bias[token_ids])
    return rows.requires_grad_(False)


class _SameAsHead:
    """A kernel policy that converts every weight as the full head's policy did and gives it the full
    head's plan (same kernels, same rounding: a Q8_0 head requantised to Q4_K stays so row by row)."""

    def __init__(self, head: QuantizedLinear) -> None:
        self._head = head

    def convert(self, weight: GGUFWeight) -> GGUFWeight:
        return weight if self._head.policy is None else self._head.policy.convert(weight)

    def plan(self, weight: GGUFWeight, head: bool = False) -> KernelPlan:
        return self._head.plan


def _quantized_rows(head: QuantizedLinear, token_ids: torch.Tensor, gguf_path: Path | None) -> nn.Module:
    if gguf_path is None:
        raise VocabRankingError("draft_vocab_size: the drafter's quantized head has no GGUF file to take its "
                                "rows from; load the drafter from a .gguf file or the packaged pair")
    header = read_header(gguf_path)
    name = "output.weight" if "output.weight" in header.tensors else "token_embd.weight"  # as quant.py loads it
    full = header.weight(name)
    if full.shape != (head.out_features, head.in_features):
        raise VocabRankingError(f"{gguf_path}: {name} is {full.shape}, but the drafter's head is "
                                f"{(head.out_features, head.in_features)}; is this the drafter's own file?")
    sub = GGUFWeight(name, full.qtype, (len(token_ids), full.shape[1]), full.blocks[token_ids.numpy()])
    del full
    bias = None if head.bias is None else head.bias[token_ids].clone()
    return QuantizedLinear.from_gguf(sub, bias, _SameAsHead(head), head=True)


_ROW_BUILDERS: dict[type, Callable[[nn.Module, torch.Tensor, Path | None], nn.Module]] = {
    nn.Linear: _dense_rows, QuantizedLinear: _quantized_rows}


def subset_head(head: nn.Module, token_ids: torch.Tensor, vocab_size: int,
                gguf_path: Path | None = None) -> VocabSubsetHead:
    """A VocabSubsetHead computing `head`'s rows `token_ids` # [N] (gguf_path: where a quantized head's
    blocks are read from)."""
    builder = _ROW_BUILDERS.get(type(head))
    if builder is None:
        raise VocabRankingError(f"draft_vocab_size: the drafter's output head is a {type(head).__name__}; a "
                                f"subset head is built from {[t.__name__ for t in _ROW_BUILDERS]}")
    ids = torch.unique(token_ids.to(torch.int64))  # sorted, distinct
    if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
        raise VocabRankingError(f"subset token ids must lie in [0, {vocab_size}) and not be empty")
    return VocabSubsetHead(builder(head, ids, gguf_path), ids, vocab_size)


def set_head(model: PackedCausalLM, head: nn.Module) -> None:
    """Make `head` the model's output head (the packed forward and the HF module both see it)."""
    model.hf_model.lm_head = head
    model.lm_head = head


def apply_vocab_subset(checkpoint: Checkpoint, size: int, ranking: VocabRanking | None = None) -> VocabSubsetHead:
    """Give the checkpoint's model a head over its `size` most frequent tokens (the shipped ranking for its
    tokenizer unless one is given); the full head is dropped. Returns the new head."""
    model = checkpoint.model
    ranking = ranking or load_ranking(checkpoint.tokenizer)
    head = subset_head(model.lm_head, ranking.top(size, model.vocab_size), model.vocab_size, checkpoint.gguf_path)
    set_head(model, head)
    return head
