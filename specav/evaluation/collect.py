"""Collecting labelled drafts from a running engine.

Owns: turning each engine step's record (drafts, features, confidences, admitted and
accepted counts) into labelled slot rows for the slot log, and `collect`, which runs a
model pair over the shipped workloads and writes the log.

Labels follow estimator.md: for a request that admitted k slots and accepted a, slots
1..a are labelled 1, slot a+1 is labelled 0 if a < k, and later slots get no label.
Collection runs the static planner, which verifies every drafted slot, so labels are never
censored by trimming (the "analysis mode").

Must not know: how the engine's stages work inside; it reads step records only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specav.evaluation.slot_log import SlotLogWriter, SlotRecordBatch
from specav.evaluation.workloads import Prompt, load_workload


def labelled_slots(num_admitted: torch.Tensor, num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every labelled slot, request-major: its (request, position) indices # [N, 2] and label # [N]."""
    pairs, labels = [], []
    for b, (k, a) in enumerate(zip(num_admitted.tolist(), num_accepted.tolist())):
        for i in range(min(a + 1, k)):
            pairs.append((b, i))
            labels.append(1 if i < a else 0)
    index = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    return index, torch.tensor(labels, dtype=torch.int8)


class SlotLogger:
    """An engine step listener writing every labelled slot to a SlotLogWriter."""

    def __init__(self, writer: SlotLogWriter, workload_of: Callable[[str], str]) -> None:
        self.writer = writer
        self.workload_of = workload_of
        self.rows = 0

    def __call__(self, record) -> None:  # record: specav.engine.engine.StepRecord
        index, labels = labelled_slots(record.num_admitted, record.num_accepted)
        if not len(labels):
            return
        b, i = index[:, 0], index[:, 1]
        f = record.drafts.features
        requests = record.requests
        hidden = None
        if self.writer.hidden_dim is not None and record.drafts.hidden is not None:
            hidden = record.drafts.hidden[record.drafts.offsets[b] + i].float().numpy()
        self.writer.append(SlotRecordBatch(
            request_id=np.array([requests[x].request_id for x in b.tolist()]),
            workload=np.array([self.workload_of(requests[x].request_id) for x in b.tolist()]),
            step=np.full(len(labels), record.step),
            position=(i + 1).numpy(),
            temperature=np.array([requests[x].params.temperature for x in b.tolist()]),
            q_max=f["q_max"][b, i].numpy(), logit_q_max=f["logit_q_max"][b, i].numpy(),
            entropy=f["entropy"][b, i].numpy(), top2_margin=f["top2_margin"][b, i].numpy(),
            q_sampled=f["q_sampled"][b, i].numpy(), q_max_truncated=f["q_max_truncated"][b, i].numpy(),
            confidence=record.confidences[b, i].float().numpy(),
            label=labels.numpy(), hidden=hidden))
        self.rows += len(labels)


@dataclass(frozen=True, slots=True)
class CollectResult:
    directory: Path
    requests: int
    labelled_slots: int
    seconds: float


def collect(engine, out_dir: str | Path, workloads: list[str], prompts_per_workload: int, encode,
            params_for: Callable[[int], object], keep_hidden: bool = False, flush_rows: int = 20_000,
            meta: dict | None = None, progress: bool = True) -> CollectResult:
    """Run every prompt of the workloads through `engine` and log its labelled slots.

    encode: Prompt -> token ids; params_for: request number -> SamplingParams.
    """
    from tqdm import tqdm

    prompts: list[Prompt] = [p for w in workloads for p in load_workload(w)[:prompts_per_workload]]
    hidden_dim = engine.drafter.model.config.hidden_size if keep_hidden else None
    if keep_hidden:
        engine.drafter.keep_hidden = True
    workload_of: dict[str, str] = {}
    start = time.perf_counter()
    with SlotLogWriter(out_dir, flush_rows=flush_rows, hidden_dim=hidden_dim, meta=meta) as writer:
        logger = SlotLogger(writer, workload_of.__getitem__)
        engine.step_listeners.append(logger)
        for n, prompt in enumerate(prompts):
            request = engine.add_request(encode(prompt), params_for(n), request_id=f"{prompt.id}")
            workload_of[request.request_id] = prompt.workload
        bar = tqdm(total=len(prompts), desc="collect", unit="req", disable=not progress)
        while engine.has_work():
            done = sum(r.finished for r in engine.step())
            bar.update(done)
            bar.set_postfix(slots=logger.rows)
        bar.close()
        engine.step_listeners.remove(logger)
    return CollectResult(Path(out_dir), len(prompts), logger.rows, time.perf_counter() - start)
