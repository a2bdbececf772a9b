"""The ragged layout every stage reads (types.Ragged), including a step with no rows at all."""

import pytest
import torch

from specav.types import DraftBatch, Plan, Ragged


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


@pytest.mark.parametrize("batch", [0, 1, 3])
def test_a_step_that_drafts_nothing_plans_nothing(batch):
    """The empty draft (target-only steps, and adaptive steps where nobody drafts) and its plan: no
    rows anywhere, each named feature [B, 0], and a plan that still refuses an admitted slot."""
    drafts = DraftBatch.empty(batch, vocab_size=7, features=("logit_q_max",))
    assert drafts.num_drafted.tolist() == [0] * batch and drafts.token_ids.shape == (batch, 0)
    assert len(drafts.probs) == 0 and drafts.features["logit_q_max"].shape == (batch, 0)
    assert drafts.probs.ids is not None and drafts.probs.vocab == 7  # no rows, as candidates (see below)
    plan = Plan.of(drafts, torch.zeros(batch, dtype=torch.int64))
    assert plan.num_admitted.tolist() == [0] * batch and plan.token_lists() == [[]] * batch
    assert plan.draft_rows.numel() == plan.tokens.numel() == 0
    assert plan.draft_rows.dtype == plan.tokens.dtype == torch.int64
    if batch:
        with pytest.raises(ValueError, match="num_admitted"):
            Plan.of(drafts, torch.ones(batch, dtype=torch.int64))
