"""A step record in plain numbers, for whoever reports on steps without touching tensors (metrics).

Owns: counting one StepRecord's slots (drafted, admitted, accepted; reached and accepted per
position, as EngineStats counts them) and its labelled slots for calibration (labels as
estimator.md defines them: slots 1..a accepted, slot a + 1 rejected if a < k; only from requests
whose outcomes teach the estimator, `engine.representative`), and reading the estimator's
parameters as plain floats.

Must not know: HTTP, models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specav.engine.engine import representative
from specav.types import StepRecord


@dataclass(frozen=True, slots=True)
class StepSummary:
    batch_size: int
    drafted: int
    admitted: int
    accepted: int
    seconds: float  # measured, plan to observe (StepRecord.times.total)
    reached: list[int]  # [K] slot i verified with slots 1..i-1 accepted
    accepted_at: list[int]  # [K] of those, accepted
    labelled: int  # labelled slots of representative requests
    labelled_confidence: float  # the sum of their confidences
    labelled_accepted: int  # how many of them were accepted


@dataclass(frozen=True, slots=True)
class EstimatorParameters:
    slope: float
    intercepts: list[float]  # [K]
    observed_steps: int


def summarize(record: StepRecord, num_slots: int) -> StepSummary:
    admitted, accepted = record.num_admitted, record.num_accepted  # [B] each
    pos = torch.arange(1, num_slots + 1)  # [K]
    reached = (pos[None, :] <= admitted[:, None]) & (pos[None, :] <= accepted[:, None] + 1)  # [B, K]
    accepted_at = pos[None, :] <= accepted[:, None]  # [B, K]
    n, conf, ok = _labelled(record)
    return StepSummary(len(record.requests), int(record.drafts.num_drafted.sum()), int(admitted.sum()),
                       int(accepted.sum()), record.times.total, reached.sum(0).tolist(),
                       accepted_at.sum(0).tolist(), n, conf, ok)


def _labelled(record: StepRecord) -> tuple[int, float, int]:
    confidences = record.confidences  # [B, K]
    if confidences.numel() == 0:
        return 0, 0.0, 0
    rows = torch.tensor([representative(r) for r in record.requests], dtype=torch.bool)  # [B]
    pos = torch.arange(confidences.shape[1])  # [K], 0-based
    admitted, accepted = record.num_admitted, record.num_accepted
    labelled = (pos[None, :] < torch.minimum(accepted + 1, admitted)[:, None]) & rows[:, None]  # [B, K]
    labelled &= torch.isfinite(confidences)
    label = pos[None, :] < accepted[:, None]  # [B, K]
    return int(labelled.sum()), float(confidences[labelled].sum()), int((label & labelled).sum())


def estimator_parameters(scorer) -> EstimatorParameters | None:
    """The online estimator's slope and intercepts (None for a scorer without them)."""
    if scorer is None or not hasattr(scorer, "slope") or not hasattr(scorer, "intercepts"):
        return None
    return EstimatorParameters(float(scorer.slope), [float(b) for b in scorer.intercepts.tolist()],
                               int(getattr(scorer, "total_steps", 0)))
