"""Collecting labelled drafts from the engine into slot logs, and surviving a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from specav.config import SamplingParams
from specav.evaluation.collect import collect, labelled_slots
from specav.evaluation.report import build_report
from specav.evaluation.slot_log import read_slot_log
from tests.tiny_models import make_engine, tiny_pair

ROOT = Path(__file__).resolve().parents[1]


def test_labels_stop_after_the_first_rejection():
    index, labels = labelled_slots(torch.tensor([3, 2, 0, 4]), torch.tensor([1, 2, 0, 0]))
    assert index.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [3, 0]]
    assert labels.tolist() == [1, 0, 1, 1, 0]


def encode_words(prompt):
    return [2 + (sum(map(ord, w)) % 90) for w in prompt.text.split()][:20]


def test_collect_logs_every_labelled_slot(tmp_path):
    target, drafter = tiny_pair(noise=0.1)
    engine = make_engine(target, drafter, k=4, max_batch_size=4)
    result = collect(engine, tmp_path / "log", ["math", "prose"], 3, encode_words,
                     lambda n: SamplingParams(temperature=0.9, max_tokens=12, seed=n), keep_hidden=True,
                     progress=False)
    table = read_slot_log(tmp_path / "log").to_pydict()
    assert result.requests == 6 and result.labelled_slots == len(table["label"]) > 0
    assert sum(table["label"]) == engine.stats.accepted
    assert set(table["workload"]) == {"math", "prose"}
    assert max(table["position"]) <= 4 and min(table["position"]) == 1
    assert len(table["hidden"][0]) == 64
    build_report(tmp_path / "log", tmp_path / "report")
    assert (tmp_path / "report" / "report.md").exists()


def test_a_killed_collect_leaves_a_log_that_report_reads(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        torch.set_num_threads(1)
        from specav.config import SamplingParams
        from specav.evaluation.collect import collect
        from tests.tiny_models import make_engine, tiny_pair
        from tests.test_collect import encode_words
        target, drafter = tiny_pair(noise=0.1)
        engine = make_engine(target, drafter, k=4, max_batch_size=4)
        collect(engine, {str(tmp_path / 'log')!r}, ["math", "prose", "chat"], 40, encode_words,
                lambda n: SamplingParams(temperature=0.9, max_tokens=400, seed=n), flush_rows=50,
                progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((tmp_path / "log").glob("part-*.parquet"))) < 3:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(list((tmp_path / "log").glob("part-*.parquet"))) >= 3
    rows = read_slot_log(tmp_path / "log").num_rows
    assert rows >= 150
    report = build_report(tmp_path / "log", tmp_path / "report")
    assert report.num_slots == rows
