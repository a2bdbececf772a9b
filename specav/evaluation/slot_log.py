"""Labelled-draft logs: one row per labelled slot, stored as Parquet parts in a directory.

Layout of a log directory:

    meta.json              run metadata given by the caller (+ format version, hidden_dim)
    part-000000.parquet    complete parts, each written to a temporary name then
    part-000001.parquet    renamed with os.replace (atomic), so a killed run leaves
    ...                    only complete files; at most the unflushed buffer is lost

Columns (one row per labelled slot, N rows per batch):

    request_id  string    workload  string    step  int64   position  int16 (1-based)
    temperature float32   q_max, logit_q_max, entropy, top2_margin, q_sampled, q_max_truncated, confidence  float32
    label       int8 (1 accepted, 0 rejected)
    hidden      fixed_size_list<float16>[hidden_dim]  (only when the writer has hidden_dim)

This module owns the on-disk format and a synthetic generator of logs drawn from a known
logistic model (for tests and benchmarks). It must not know about models, the engine or
how features are computed; the engine fills SlotRecordBatch and this module stores it.
One writer per directory at a time.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specav.models.cache import atomic_write

FORMAT_VERSION = 1
META_FILE = "meta.json"
PART_PATTERN = re.compile(r"^part-(\d{6})\.parquet$")

_COLUMN_TYPES: dict[str, tuple[pa.DataType, np.dtype | None]] = {
    "request_id": (pa.string(), None),
    "workload": (pa.string(), None),
    "step": (pa.int64(), np.dtype(np.int64)),
    "position": (pa.int16(), np.dtype(np.int16)),
    "temperature": (pa.float32(), np.dtype(np.float32)),
    "q_max": (pa.float32(), np.dtype(np.float32)),
    "logit_q_max": (pa.float32(), np.dtype(np.float32)),
    "entropy": (pa.float32(), np.dtype(np.float32)),
    "top2_margin": (pa.float32(), np.dtype(np.float32)),
    "q_sampled": (pa.float32(), np.dtype(np.float32)),
    "q_max_truncated": (pa.float32(), np.dtype(np.float32)),
    "confidence": (pa.float32(), np.dtype(np.float32)),
    "label": (pa.int8(), np.dtype(np.int8)),
}
COLUMNS: tuple[str, ...] = tuple(_COLUMN_TYPES)
# zstd for the slot columns; hidden states (float16, near-incompressible) stored plain: 5x faster reads
_PARQUET_OPTIONS: dict[str, Any] = {
    "compression": {**{name: "zstd" for name in _COLUMN_TYPES}, "hidden": "none"},
    "use_dictionary": ["request_id", "workload", "position", "temperature", "label"],
}


def slot_log_schema(hidden_dim: int | None = None) -> pa.Schema:
    """The Arrow schema of a slot log, with the `hidden` column when hidden_dim is given."""
    schema_fields = [pa.field(name, t, nullable=False) for name, (t, _) in _COLUMN_TYPES.items()]
    if hidden_dim is not None:
        schema_fields.append(pa.field("hidden", pa.list_(pa.float16(), hidden_dim), nullable=False))
    return pa.schema(schema_fields)


@dataclass(slots=True)
class SlotRecordBatch:
    """Labelled slots of one or more steps, as equal-length numpy arrays (`# [N]`).

    `hidden` is the drafter's hidden state at each slot (`# [N, hidden_dim]` float16), or None.
    Arrays are converted to the stored dtypes on construction; a length mismatch raises.
    """

    request_id: np.ndarray  # [N] str
    workload: np.ndarray  # [N] str
    step: np.ndarray  # [N] int64, decode step of the request
    position: np.ndarray  # [N] int16, draft position i = 1..K
    temperature: np.ndarray  # [N] float32
    q_max: np.ndarray  # [N] float32, largest drafter probability (temperature only, untruncated)
    logit_q_max: np.ndarray  # [N] float32, the feature f = logit(q_max), clamped to [-40, 40]
    entropy: np.ndarray  # [N] float32, entropy (nats) of the same distribution
    top2_margin: np.ndarray  # [N] float32, q_max minus the second largest probability
    q_sampled: np.ndarray  # [N] float32, q_i(x_i): LOSSY, never used to trim
    q_max_truncated: np.ndarray  # [N] float32, largest probability of q_i after top-k / top-p
    confidence: np.ndarray  # [N] float32, the online estimator's confidence when the slot was scored
    label: np.ndarray  # [N] int8, 1 accepted / 0 rejected
    hidden: np.ndarray | None = field(default=None)  # [N, hidden_dim] float16

    def __post_init__(self) -> None:
        n = None
        for name, (_, dtype) in _COLUMN_TYPES.items():
            value = np.asarray(getattr(self, name))
            value = value.astype(str) if dtype is None else value.astype(dtype, copy=False)
            if value.ndim != 1:
                raise ValueError(f"SlotRecordBatch.{name} must be 1-D, got shape {value.shape}")
            n = value.shape[0] if n is None else n
            if value.shape[0] != n:
                raise ValueError(f"SlotRecordBatch.{name} has {value.shape[0]} rows, expected {n} "
                                 "(all columns must have one entry per labelled slot)")
            setattr(self, name, value)
        if n and (self.position.min() < 1):
            raise ValueError("SlotRecordBatch.position must be >= 1 (draft positions are 1-based)")
        if n and not np.all((self.label == 0) | (self.label == 1)):
            raise ValueError("SlotRecordBatch.label must be 0 or 1")
        if self.hidden is not None:
            self.hidden = np.asarray(self.hidden, dtype=np.float16)
            if self.hidden.ndim != 2 or self.hidden.shape[0] != n:
                raise ValueError(f"SlotRecordBatch.hidden must have shape [N={n}, hidden_dim], "
                                 f"got {self.hidden.shape}")

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def to_arrow(self, hidden_dim: int | None) -> pa.Table:
        """Arrow table in the slot-log schema; `hidden` is required iff hidden_dim is set."""
        if hidden_dim is None and self.hidden is not None:
            raise ValueError("batch has hidden states but the writer was created without hidden_dim")
        if hidden_dim is not None and (self.hidden is None or self.hidden.shape[1] != hidden_dim):
            got = None if self.hidden is None else self.hidden.shape
            raise ValueError(f"writer expects hidden of shape [N, {hidden_dim}], got {got}")
        columns = [pa.array(getattr(self, name), type=t) for name, (t, _) in _COLUMN_TYPES.items()]
        if hidden_dim is not None:
            flat = pa.array(np.ascontiguousarray(self.hidden).ravel(), type=pa.float16())
            columns.append(pa.FixedSizeListArray.from_arrays(flat, hidden_dim))
        return pa.Table.from_arrays(columns, schema=slot_log_schema(hidden_dim))


def concat_batches(batches: list[SlotRecordBatch]) -> SlotRecordBatch:
    """One batch holding the rows of `batches` in order."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    values: dict[str, Any] = {}
    for f in fields(SlotRecordBatch):
        parts = [getattr(b, f.name) for b in batches]
        values[f.name] = None if any(p is None for p in parts) else np.concatenate(parts)
    return SlotRecordBatch(**values)


def _existing_parts(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if PART_PATTERN.match(p.name))


class SlotLogWriter:
    """Buffers labelled slots and writes them as complete, atomically renamed Parquet parts.

    Usage:
        with SlotLogWriter(run_dir, hidden_dim=None, meta={"drafter": ...}) as log:
            log.append(batch)

    Every flush (when the buffer reaches `flush_rows`, and on close) writes one new
    `part-XXXXXX.parquet`. Parts already in the directory are kept and numbering continues
    after them, so a resumed run appends (with the same hidden_dim; meta.json is rewritten).
    """

    def __init__(self, directory: str | os.PathLike, flush_rows: int = 50_000,
                 hidden_dim: int | None = None, meta: Mapping[str, Any] | None = None) -> None:
        if not isinstance(flush_rows, int) or flush_rows < 1:
            raise ValueError(f"flush_rows = {flush_rows!r} is invalid: allowed an integer >= 1")
        if hidden_dim is not None and (not isinstance(hidden_dim, int) or hidden_dim < 1):
            raise ValueError(f"hidden_dim = {hidden_dim!r} is invalid: allowed None or an integer >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.flush_rows = flush_rows
        self.hidden_dim = hidden_dim
        self._buffer: list[SlotRecordBatch] = []
        self._buffered = 0
        self._closed = False
        parts = _existing_parts(self.directory)
        self._next_part = int(PART_PATTERN.match(parts[-1].name).group(1)) + 1 if parts else 0
        self.rows_written = 0
        self.write_meta(meta or {})

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        """(Re)write meta.json atomically: the caller's metadata plus format version and hidden_dim."""
        record = {"format_version": FORMAT_VERSION, "hidden_dim": self.hidden_dim, **dict(meta)}
        text = json.dumps(record, indent=2, sort_keys=True, default=str).encode()
        atomic_write(self.directory / META_FILE, lambda h: h.write(text))

    def append(self, batch: SlotRecordBatch) -> None:
        """Buffer `batch`; flush a part once `flush_rows` rows are buffered."""
        if self._closed:
            raise RuntimeError(f"SlotLogWriter for {self.directory} is closed; open a new writer")
        if (self.hidden_dim is None) != (batch.hidden is None):
            raise ValueError(f"writer has hidden_dim={self.hidden_dim} but batch.hidden is "
                             f"{'absent' if batch.hidden is None else 'present'}")
        if batch.hidden is not None and batch.hidden.shape[1] != self.hidden_dim:
            raise ValueError(f"batch.hidden has {batch.hidden.shape[1]} columns; the writer's hidden_dim "
                             f"is {self.hidden_dim}")
        if len(batch):
            self._buffer.append(batch)
            self._buffered += len(batch)
        if self._buffered >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one new complete part (no-op when the buffer is empty)."""
        if not self._buffered:
            return
        table = concat_batches(self._buffer).to_arrow(self.hidden_dim)
        path = self._claim_part_path()
        atomic_write(path, lambda h: pq.write_table(table, h, **_PARQUET_OPTIONS))
        self.rows_written += table.num_rows
        self._buffer, self._buffered = [], 0

    def _claim_part_path(self) -> Path:
        while (path := self.directory / f"part-{self._next_part:06d}.parquet").exists():
            self._next_part += 1
        self._next_part += 1
        return path

    def close(self) -> None:
        """Flush what is buffered; further appends raise."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> "SlotLogWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """The run metadata of a slot log ({} when the log has no meta.json)."""
    path = Path(directory) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def read_slot_log(directory: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """All complete parts of a slot log as one table (temporary files are ignored).

    Returns an empty table in the base schema when no part has been flushed yet.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"slot log directory {root} does not exist; pass the run's log directory")
    parts = _existing_parts(root)
    if not parts:
        schema = slot_log_schema(read_meta(root).get("hidden_dim"))
        table = schema.empty_table()
        return table.select(columns) if columns else table
    tables = [pq.read_table(p, columns=columns) for p in parts]
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as err:
        raise ValueError(f"parts of {root} have different schemas ({err}); "
                         "a log directory must hold one run's parts") from err


def hidden_matrix(table: pa.Table) -> np.ndarray:
    """The `hidden` column as a float16 matrix `# [N, hidden_dim]`."""
    column = table.column("hidden")
    dim = column.type.list_size
    chunks = [c.flatten().to_numpy(zero_copy_only=False) for c in column.chunks]
    flat = np.concatenate(chunks) if chunks else np.empty(0, np.float16)
    return flat.reshape(-1, dim)


# ---- synthetic logs from a known logistic model -------------------------------------------------

@dataclass(frozen=True, slots=True)
class SyntheticTruth:
    """The logistic model a synthetic log is drawn from: P(accept) = sigmoid(omega f + beta_i + shift_w)."""

    omega: float = 0.6
    beta: tuple[float, ...] = (0.3, 0.15, 0.0, -0.1, -0.2, -0.3, -0.4, -0.5)  # per position 1..K
    workloads: tuple[str, ...] = ("code", "chat", "math", "prose", "unpredictable")
    workload_shift: tuple[float, ...] = (0.3, 0.0, 0.45, -0.2, -0.6)  # added to every intercept
    feature_mean: tuple[float, ...] = (3.0, 2.0, 2.6, 1.5, 0.8)  # mean of f per workload

    @property
    def num_slots(self) -> int:
        return len(self.beta)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _draw_features(rng: np.random.Generator, f_mean: np.ndarray) -> dict[str, np.ndarray]:
    """Drafter-like features for `# [M, K]` slots: q_max, logit, entropy, top-2 margin."""
    f = np.clip(f_mean + rng.normal(0.0, 2.2, f_mean.shape), -40, 40)
    q = _sigmoid(f)
    alternatives = np.exp(rng.normal(1.5, 0.8, f.shape))  # effective count of other tokens
    rest = 1.0 - q
    with np.errstate(divide="ignore", invalid="ignore"):
        h_rest = np.where(rest > 0, -rest * np.log(rest / alternatives), 0.0)
        entropy = np.where(q < 1, -q * np.log(q), 0.0) + h_rest
    second = np.minimum(q, rest * rng.beta(2.0, 2.0, f.shape))
    return {"logit_q_max": f, "q_max": q, "entropy": np.maximum(entropy, 0.0),
            "top2_margin": q - second}


def _labelled_mask(accept: np.ndarray, drafted: np.ndarray) -> np.ndarray:
    """Label rule: slots 1..a+1 of each step are labelled (a = accepted prefix), within drafted."""
    k = accept.shape[1]
    prefix = np.cumprod(accept, axis=1)  # [M, K] 1 while all previous accepted
    prior = np.concatenate([np.ones((accept.shape[0], 1), bool), prefix[:, :-1].astype(bool)], axis=1)
    return prior & (np.arange(1, k + 1)[None, :] <= drafted[:, None])


def synthetic_slot_batch(rows: int, truth: SyntheticTruth = SyntheticTruth(), seed: int = 0,
                         hidden_dim: int | None = None, steps_per_request: int = 64,
                         request_prefix: str = "req") -> SlotRecordBatch:
    """About `rows` labelled slots (exactly `rows`, cut at the end) drawn from `truth`.

    Steps are grouped into requests of `steps_per_request` decode steps; each request has
    one workload and temperature. Labels follow the label rule (slots up to and including
    the first rejection). `confidence` mimics a prequential online estimator shared by all
    requests: it starts at omega = 1, beta = 0 (raw q_max) and approaches (omega, beta_i),
    without the workload shifts, over the first few percent of slots.
    q_sampled leaks the label (it is the draft token's own probability): lossy by design.
    `hidden` (if requested) is noise plus a direction that carries the true log-odds.
    """
    rng = np.random.default_rng(seed)
    batches: list[SlotRecordBatch] = []
    have = 0
    while have < rows:  # about 3 labelled slots per step; top up in the rare short draw
        steps = int((rows - have) / 2.5) + steps_per_request
        prefix = f"{request_prefix}{len(batches)}"
        batches.append(_draw_steps(rng, truth, steps, steps_per_request, prefix, hidden_dim))
        have += len(batches[-1])
    batch = batches[0] if len(batches) == 1 else concat_batches(batches)
    return slice_batch(batch, 0, rows)


def _draw_steps(rng: np.random.Generator, truth: SyntheticTruth, steps: int, steps_per_request: int,
                prefix: str, hidden_dim: int | None) -> SlotRecordBatch:
    k = truth.num_slots
    num_requests = -(-steps // steps_per_request)
    req_workload = rng.integers(0, len(truth.workloads), num_requests)  # [R]
    req_temperature = rng.choice(np.array([0.0, 0.7, 1.0], np.float32), num_requests)
    request = np.repeat(np.arange(num_requests), steps_per_request)[:steps]  # [M]
    step = np.tile(np.arange(steps_per_request), num_requests)[:steps]
    w = req_workload[request]
    feats = _draw_features(rng, np.broadcast_to(np.asarray(truth.feature_mean)[w][:, None], (steps, k)))
    beta = np.asarray(truth.beta)[None, :]
    true_logit = truth.omega * feats["logit_q_max"] + beta + np.asarray(truth.workload_shift)[w][:, None]
    accept = rng.uniform(size=(steps, k)) < _sigmoid(true_logit)  # [M, K]
    drafted = rng.integers(max(1, k // 2), k + 1, steps)  # ragged K per step
    mask = _labelled_mask(accept, drafted)
    rows_m, cols = np.nonzero(mask)
    label = accept[rows_m, cols].astype(np.int8)
    # online estimator: one set of parameters for all requests, from (1, 0) towards the truth
    progress = 1.0 - np.exp(-np.arange(rows_m.size) / (0.02 * rows_m.size + 1.0))
    omega_t = 1.0 + (truth.omega - 1.0) * progress
    beta_t = beta[0, cols] * progress
    f = feats["logit_q_max"][rows_m, cols]
    q_max = feats["q_max"][rows_m, cols]
    q_sampled = q_max * _sigmoid(rng.normal(np.where(label == 1, 1.2, 0.0), 1.0))
    hidden = None
    if hidden_dim is not None:
        direction = rng.normal(size=hidden_dim) / np.sqrt(hidden_dim)
        signal = true_logit[rows_m, cols] + rng.normal(0, 0.8, rows_m.size)
        noise = rng.standard_normal((rows_m.size, hidden_dim), dtype=np.float32)
        noise += (3.0 * signal[:, None]).astype(np.float32) * direction[None, :].astype(np.float32)
        hidden = noise.astype(np.float16)
    names = np.array([f"{prefix}-{i:07d}" for i in range(num_requests)])
    return SlotRecordBatch(
        request_id=names[request[rows_m]], workload=np.asarray(truth.workloads)[w[rows_m]],
        step=step[rows_m], position=cols + 1, temperature=req_temperature[request[rows_m]],
        q_max=q_max, logit_q_max=f, entropy=feats["entropy"][rows_m, cols],
        top2_margin=feats["top2_margin"][rows_m, cols], q_sampled=q_sampled,
        q_max_truncated=np.maximum(q_max, rng.uniform(0.0, 1.0, rows_m.size) < 0.5),
        confidence=_sigmoid(omega_t * f + beta_t), label=label, hidden=hidden)


def write_synthetic_slot_log(directory: str | os.PathLike, rows: int,
                             truth: SyntheticTruth = SyntheticTruth(), seed: int = 0,
                             hidden_dim: int | None = None, flush_rows: int = 50_000) -> Path:
    """Write a synthetic slot log of `rows` labelled slots through SlotLogWriter; returns the directory."""
    batch = synthetic_slot_batch(rows, truth, seed, hidden_dim)
    meta = {"source": "synthetic", "seed": seed, "omega": truth.omega, "beta": list(truth.beta),
            "workloads": list(truth.workloads), "workload_shift": list(truth.workload_shift)}
    with SlotLogWriter(directory, flush_rows=flush_rows, hidden_dim=hidden_dim, meta=meta) as log:
        for start in range(0, rows, flush_rows):
            log.append(slice_batch(batch, start, start + flush_rows))
    return Path(directory)


def slice_batch(batch: SlotRecordBatch, start: int, stop: int) -> SlotRecordBatch:
    """Rows start..stop-1 of `batch` (views, no copy)."""
    values = {f.name: (None if getattr(batch, f.name) is None else getattr(batch, f.name)[start:stop])
              for f in fields(SlotRecordBatch)}
    return SlotRecordBatch(**values)
