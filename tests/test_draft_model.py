"""The draft-model drafter's slot loop: what a stop rule sees of each slot is what the step's feature
table says of it, and a request the rule stops drafts no further."""

from __future__ import annotations

import math

import torch

from specav.config import SamplingParams
from specav.drafting import DraftModelDrafter
from specav.drafting.draft_model import FEATURE_NAMES
from specav.request import Request
from tests.tiny_models import tiny_pair


class _Recorder:
    """A stop rule that keeps request 0 drafting, stops the others after slot 1, and records what
    it read of each slot (logit(q_max), and entropy from slot 2 on: another feature than the rules')."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int], dict[str, list[float]]]] = []

    def keep_drafting(self, slot, rows, features):
        names = ["logit_q_max"] + (["entropy"] if slot >= 1 else [])
        self.seen.append((slot, list(rows), {n: features[n].tolist() for n in names}))
        return torch.tensor([r == 0 for r in rows])


def test_the_stop_rule_reads_each_slot_as_the_feature_table_has_it():
    _, drafter_model = tiny_pair()
    drafter = DraftModelDrafter(drafter_model)
    requests = [Request([3, 4, 5, 6 + i], SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=i))
                for i in range(3)]
    rule = _Recorder()
    drafts = drafter.propose(requests, [4, 4, 4], rule)
    assert drafts.num_drafted.tolist() == [4, 1, 1]  # the rule stopped requests 1 and 2 after slot 1
    assert [(slot, rows) for slot, rows, _ in rule.seen] == [(0, [0, 1, 2]), (1, [0]), (2, [0])]
    for slot, rows, read in rule.seen:
        for name, values in read.items():
            table = [drafts.features[name][r, slot].item() for r in rows]
            assert values == table, (name, slot)
    assert set(drafts.features) == set(FEATURE_NAMES)
    assert all(math.isnan(drafts.features[n][1, 1].item()) for n in FEATURE_NAMES)  # not drafted
