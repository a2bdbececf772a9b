"""Tests for specav.evaluation.slot_log: round trips, crash safety, the synthetic generator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from specav.evaluation.slot_log import (
    COLUMNS,
    SlotLogWriter,
    SlotRecordBatch,
    SyntheticTruth,
    hidden_matrix,
    read_meta,
    read_slot_log,
    slice_batch,
    synthetic_slot_batch,
    write_synthetic_slot_log,
)

REPO = Path(__file__).resolve().parents[1]


def _batch(n: int, seed: int = 0, hidden_dim: int | None = None) -> SlotRecordBatch:
    rng = np.random.default_rng(seed)
    q = rng.uniform(0.05, 0.99, n)
    return SlotRecordBatch(
        request_id=np.array([f"r{seed}-{i // 4}" for i in range(n)]),
        workload=np.where(rng.uniform(size=n) < 0.5, "chat", "math"),
        step=np.arange(n) // 4, position=np.arange(n) % 4 + 1, temperature=np.full(n, 0.7),
        q_max=q, logit_q_max=np.log(q / (1 - q)), entropy=rng.uniform(0, 3, n),
        top2_margin=q * rng.uniform(size=n), q_sampled=q * rng.uniform(size=n), q_max_truncated=np.maximum(q, 0.5),
        confidence=rng.uniform(size=n), label=rng.integers(0, 2, n),
        hidden=None if hidden_dim is None else rng.normal(size=(n, hidden_dim)))


def _assert_same(table: pa.Table, batch: SlotRecordBatch) -> None:
    for name in COLUMNS:
        got = table.column(name).to_numpy(zero_copy_only=False)
        np.testing.assert_array_equal(got, getattr(batch, name), err_msg=name)


def test_round_trip_and_meta(tmp_path: Path) -> None:
    batches = [_batch(30, seed=s) for s in range(4)]
    with SlotLogWriter(tmp_path, flush_rows=50, meta={"drafter": "tiny", "k": 4}) as log:
        for b in batches:
            log.append(b)
    table = read_slot_log(tmp_path)
    assert table.num_rows == 120
    assert table.schema.field("position").type == pa.int16()
    assert table.schema.field("label").type == pa.int8()
    assert table.schema.field("confidence").type == pa.float32()
    assert "hidden" not in table.column_names
    for i, b in enumerate(batches):
        _assert_same(table.slice(30 * i, 30), b)
    parts = sorted(p.name for p in tmp_path.glob("part-*.parquet"))
    assert parts == ["part-000000.parquet", "part-000001.parquet"]  # 60 rows each; close has nothing left
    meta = read_meta(tmp_path)
    assert meta["drafter"] == "tiny" and meta["k"] == 4 and meta["hidden_dim"] is None
    assert read_slot_log(tmp_path, columns=["label", "position"]).column_names == ["label", "position"]


def test_hidden_column_round_trip(tmp_path: Path) -> None:
    b = _batch(40, hidden_dim=12)
    with SlotLogWriter(tmp_path, hidden_dim=12) as log:
        log.append(b)
    table = read_slot_log(tmp_path)
    assert table.schema.field("hidden").type == pa.list_(pa.float16(), 12)
    h = hidden_matrix(table)
    assert h.dtype == np.float16 and h.shape == (40, 12)
    np.testing.assert_array_equal(h, b.hidden)
    _assert_same(table, b)


def test_resumed_writer_continues_numbering(tmp_path: Path) -> None:
    with SlotLogWriter(tmp_path) as log:
        log.append(_batch(10, seed=1))
    with SlotLogWriter(tmp_path) as log:
        log.append(_batch(10, seed=2))
    assert sorted(p.name for p in tmp_path.glob("part-*")) == ["part-000000.parquet", "part-000001.parquet"]
    assert read_slot_log(tmp_path).num_rows == 20


def test_validation_errors(tmp_path: Path) -> None:
    b = _batch(5)
    with pytest.raises(ValueError, match="label has 4 rows, expected 5"):
        SlotRecordBatch(**{**{n: getattr(b, n) for n in COLUMNS}, "label": np.ones(4)})
    with pytest.raises(ValueError, match="1-based"):
        SlotRecordBatch(**{**{n: getattr(b, n) for n in COLUMNS}, "position": np.zeros(5)})
    with SlotLogWriter(tmp_path / "a", hidden_dim=3) as log:
        with pytest.raises(ValueError, match="hidden"):
            log.append(b)
        with pytest.raises(ValueError, match="hidden_dim"):
            log.append(_batch(5, hidden_dim=4))
    with pytest.raises(ValueError, match="flush_rows"):
        SlotLogWriter(tmp_path / "b", flush_rows=0)
    log = SlotLogWriter(tmp_path / "c")
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.append(b)


def test_empty_and_missing_logs(tmp_path: Path) -> None:
    SlotLogWriter(tmp_path / "empty", hidden_dim=8).close()
    table = read_slot_log(tmp_path / "empty")
    assert table.num_rows == 0 and "hidden" in table.column_names
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_slot_log(tmp_path / "nope")


def test_simulated_crash_leaves_complete_parts(tmp_path: Path) -> None:
    log = SlotLogWriter(tmp_path, flush_rows=100)
    b = _batch(350)
    for start in range(0, 350, 50):
        log.append(slice_batch(b, start, start + 50))
    # a write interrupted before its rename, and unrelated junk
    (tmp_path / ".part-000003.parquet.x1y2.tmp").write_bytes(b"PAR1 half a file")
    (tmp_path / "notes.txt").write_text("hello")
    del log  # never closed: the last 50 buffered rows are lost, nothing else
    table = read_slot_log(tmp_path)
    assert table.num_rows == 300
    _assert_same(table, slice_batch(b, 0, 300))


_CHILD = textwrap.dedent("""
    import sys
    from specav.evaluation.slot_log import SlotLogWriter, slice_batch, synthetic_slot_batch
    batch = synthetic_slot_batch(2000, seed=1, hidden_dim=8)
    log = SlotLogWriter(sys.argv[1], flush_rows=100, hidden_dim=8, meta={"run": "killed"})
    i = 0
    while True:
        start = (i * 37) % 1900
        log.append(slice_batch(batch, start, start + 37))
        i += 1
        if i == 40:
            print("ready", flush=True)
""")


def test_sigkill_mid_run_leaves_readable_log(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"ready"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    table = read_slot_log(tmp_path)
    assert table.num_rows >= 1000 and table.num_rows % 111 == 0  # whole parts of 3 x 37 rows only
    assert hidden_matrix(table).shape == (table.num_rows, 8)
    assert json.loads((tmp_path / "meta.json").read_text())["run"] == "killed"


def test_synthetic_batch_follows_label_rule() -> None:
    truth = SyntheticTruth()
    b = synthetic_slot_batch(20_000, truth, seed=3, hidden_dim=4)
    assert len(b) == 20_000 and b.hidden.shape == (20_000, 4)
    assert set(np.unique(b.workload)) == set(truth.workloads)
    assert b.position.min() == 1 and b.position.max() == truth.num_slots
    same_step = b.position[1:] != 1  # rows i, i+1 belong to one (request, step)
    np.testing.assert_array_equal(b.position[1:][same_step], b.position[:-1][same_step] + 1)
    assert np.all(b.label[:-1][same_step] == 1)  # only the last labelled slot of a step may be 0
    assert np.all(b.q_sampled <= b.q_max) and np.all(b.top2_margin >= 0) and np.all(b.entropy >= 0)
    np.testing.assert_allclose(b.logit_q_max, np.log(b.q_max / (1 - b.q_max)), rtol=1e-3, atol=1e-3)
    assert 0.6 < b.label.mean() < 0.85


def test_write_synthetic_slot_log(tmp_path: Path) -> None:
    write_synthetic_slot_log(tmp_path, 2_500, seed=2, flush_rows=1_000)
    assert len(list(tmp_path.glob("part-*.parquet"))) == 3
    assert read_slot_log(tmp_path).num_rows == 2_500
    assert read_meta(tmp_path)["source"] == "synthetic"
