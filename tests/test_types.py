"""The ragged layout every stage reads (types.Ragged), including a step with no rows at all."""

import pytest
import torch

from specav.types import Ragged


@pytest.mark.parametrize("counts", [[], [0], [0, 0, 0], [2, 0, 3], [0, 1], [4]])
def test_ragged_layout_of_any_counts(counts):
    r = Ragged.of(counts)
    rows = [(b, i) for b, k in enumerate(counts) for i in range(k)]
    assert r.counts.tolist() == counts and len(r) == len(counts) and r.total == len(rows)
    assert r.starts.tolist() == [sum(counts[:b]) for b in range(len(counts))]
    assert list(zip(r.request.tolist(), r.position.tolist())) == rows
    assert r.request.dtype == r.position.dtype == r.starts.dtype == torch.int64
    lengths = torch.tensor([min(k, 1) for k in counts], dtype=torch.int64)
    expected = [sum(counts[:b]) for b, k in enumerate(counts) if k]
    assert r.prefix_rows(lengths).tolist() == expected
    assert r.prefix_rows(torch.zeros(len(counts), dtype=torch.int64)).tolist() == []
