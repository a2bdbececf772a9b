"""Rows of token distributions, each carried as its candidates: what q_i and p_i travel as.

With top-k sampling (top_k = 20 in most traffic) a processed distribution has at most k tokens
with weight, yet a dense row holds the whole 152k-entry vocabulary, and every pass over it
(scatter, sample, gather, residual, stack) costs more than the k candidates' arithmetic. A
`TokenProbs` holds either kind of row:

  sparse  ids # [N, W] int64, each row's candidate tokens in ascending id order, padded with
          `vocab` (past every token); probs # [N, W] float32, zero at padding and at candidates
          a nucleus dropped. A token not among a row's ids has probability 0.
  dense   ids None; probs # [N, V], column j is token j (rows without top-k, or whose k-th logit
          ties with tokens beyond it).

Every row of one object is of the same kind: a batch mixing them is dense. Ascending ids make
`sample` walk the tokens in the order it walks a dense row, so both kinds draw the same token
from the same uniform.

It sits below sampling, rejection, drafting and acceptance (the types they share), next to
topk.py. Must not know: models, requests, sampling parameters, how the probabilities were made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True)
class TokenProbs:
    probs: torch.Tensor  # [N, W] float32 (W = vocab where dense)
    ids: torch.Tensor | None  # [N, W] int64 ascending per row, padding = vocab; None = dense
    vocab: int

    @classmethod
    def dense(cls, probs: torch.Tensor) -> TokenProbs:
        """Dense rows: probs # [N, V]."""
        return cls(probs, None, probs.shape[-1])

    @classmethod
    def candidates(cls, ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> TokenProbs:
        """Sparse rows from candidates in any order: ids # [N, W] (distinct within a row, or padding
        `vocab` with probability 0), probs # [N, W]. Sorts each row by token id."""
        ids, order = ids.sort(dim=-1)
        return cls(probs.gather(1, order), ids, vocab)

    @classmethod
    def of(cls, rows: torch.Tensor | TokenProbs) -> TokenProbs:
        """A TokenProbs as it is, or a dense tensor # [N, V] as dense rows."""
        return rows if isinstance(rows, TokenProbs) else cls.dense(rows)

    def __len__(self) -> int:
        return self.probs.shape[0]

    @property
    def is_dense(self) -> bool:
        return self.ids is None

    def to_dense(self) -> torch.Tensor:
        """The rows over the whole vocabulary # [N, V]."""
        if self.ids is None:
            return self.probs
        out = torch.zeros(len(self), self.vocab + 1, dtype=self.probs.dtype, device=self.probs.device)
        return out.scatter_add_(1, self.ids, self.probs)[:, :self.vocab]  # padding lands in the extra column

    def rows(self, index: torch.Tensor) -> TokenProbs:
        """The rows at index # [M] int64 (a copy)."""
        return TokenProbs(self.probs[index], None if self.ids is None else self.ids[index], self.vocab)

    def at(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Probability of tokens # [M] int64 (valid ids) in rows # [M] (default: row m for token m) -> # [M]."""
        if rows is None:
            probs, ids = self.probs, self.ids
        else:
            probs, ids = self.probs[rows], None if self.ids is None else self.ids[rows]
        if ids is None:
            return probs.gather(1, tokens[:, None]).squeeze(1)
        return (probs * (ids == tokens[:, None])).sum(-1)

    def lookup(self, ids: torch.Tensor | None) -> torch.Tensor:
        """Probabilities of each row at ids # [N, M] (padding `vocab` gives 0), or at every token where
        ids is None (-> # [N, V])."""
        if ids is None:
            return self.to_dense()
        if self.ids is None:
            return self.probs.gather(1, ids.clamp(max=self.vocab - 1)) * (ids < self.vocab)
        match = self.ids[:, None, :] == ids[:, :, None]  # [N, M, W]
        return (self.probs[:, None, :] * match).sum(-1)

    def max(self) -> torch.Tensor:
        """Each row's largest probability # [N]."""
        return self.probs.amax(dim=-1)

    def at_each(self, tokens: Sequence[int]) -> list[float]:
        """Probability of tokens[m] in row m, as Python floats: `at` for the few rows of a drafting
        slot, without the torch ops that cost tens of microseconds each on cold caches."""
        if self.ids is None:
            return self.probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)].tolist()
        return [sum((p for i, p in zip(ids, probs) if i == token), 0.0)
                for ids, probs, token in zip(self.ids.tolist(), self.probs.tolist(), tokens)]

    def max_each(self) -> list[float]:
        """`max` as Python floats (a sparse row's candidates are few)."""
        if self.ids is None:
            return self.probs.amax(dim=-1).tolist()
        return [max(row, default=0.0) for row in self.probs.tolist()]

    @staticmethod
    def cat(parts: Sequence[TokenProbs], vocab: int) -> TokenProbs:
        """Rows of all parts in order; dense if any part is, else padded to the widest part."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return TokenProbs(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.int64), vocab)
        if len(parts) == 1:
            return parts[0]
        if any(p.is_dense for p in parts):
            return TokenProbs.dense(torch.cat([p.to_dense() for p in parts]))
        width = max(p.probs.shape[1] for p in parts)
        return TokenProbs(torch.cat([_pad(p.probs, width, 0.0) for p in parts]),
                          torch.cat([_pad(p.ids, width, vocab) for p in parts]), vocab)


def _pad(x: torch.Tensor, width: int, value: float | int) -> torch.Tensor:
    """x # [N, w] padded on the right to # [N, width] with value."""
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
