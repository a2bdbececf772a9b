"""Evaluation: labelled-draft logs, the rulers (AUC / log-loss / ECE), workloads and reports.

    metrics.py     AUC, log-loss, ECE, calibration gap, reliability tables (numpy float64)
    workloads.py   the five shipped prompt sets (code, chat, math, prose, unpredictable)
    slot_log.py    Parquet slot logs (crash-safe writer, reader) and a synthetic generator
    report.py      build_report: every scorer measured on a log -> report.md + PNG plots
    replay.py      the online estimator replayed over a log in log order (both modes)

Evaluation never imports models or the engine: the engine fills SlotRecordBatch and this
package reads what was written. torch comes in only through the estimator that replay.py
runs (and collect.py, which drives an engine).
"""

from specav.evaluation.metrics import (
    ReliabilityTable,
    ScorerMetrics,
    auc,
    calibration_gap,
    ece,
    log_loss,
    measure,
    reliability_table,
)
from specav.evaluation.report import Report, build_report
from specav.evaluation.slot_log import SlotLogWriter, SlotRecordBatch, read_slot_log
from specav.evaluation.workloads import WORKLOADS, Prompt, load_all, load_workload

__all__ = [
    "WORKLOADS", "Prompt", "ReliabilityTable", "Report", "ScorerMetrics", "SlotLogWriter", "SlotRecordBatch",
    "auc", "build_report", "calibration_gap", "ece", "load_all", "load_workload", "log_loss", "measure",
    "read_slot_log", "reliability_table",
]
