"""Replay what an AV engine's estimator observed on the real pair through estimator configs.

    python -m specav.bench.estimator_trace TRACE [--config '{"trust_radius": "inf"}' ...]

TRACE is the JSON-lines file of `python -m specav.bench.adaptive --trace` (plain or .gz): per
step and request the drafted slots' features, and the admitted and accepted counts, which are
what the estimator observed that step (every request of the bench teaches it). Each stream (a
cell's round for one AV method: its engine started with a fresh estimator) is replayed as the
engine fed it (`evaluation/replay.py`), through the default EstimatorConfig and each `--config`
(fields over the default; "inf" for infinity), and compared with the maximum-likelihood fit of
the same labels (`fit_position_logistic`, an exact Newton fit): the final parameters' log-loss
over the stream's labels less the MLE's, and the prequential log-loss (each slot scored before
its label was learned). The labels a replay sees are the ones the recorded run produced: its
drafts and trims followed the recorded estimator, not the replayed one; the replay goes on to a
stream's last step, label-free after its last draft, as the engine did (a refit can fall there).

This program owns only the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
from dataclasses import dataclass

import numpy as np

from specav.config import EstimatorConfig
from specav.evaluation.metrics import log_loss
from specav.evaluation.replay import replay_online
from specav.evaluation.report import fit_position_logistic

StreamKey = tuple[str, int, int, str]  # workload, concurrency, round, method


@dataclass(frozen=True, slots=True)
class Slots:
    """A stream's labelled slots in step order, `# [N]` each (`replay_online`'s inputs): each
    request's accepted slots and its first rejected one, as the estimator labels them."""

    step: np.ndarray
    request: np.ndarray  # the trace line (a request's row in a step)
    position: np.ndarray  # 1-based
    feature: np.ndarray
    label: np.ndarray
    num_slots: int  # K
    trailing_steps: int = 0  # the stream's steps after its last labelled one


def read_streams(path: str, num_slots: int = 0) -> dict[StreamKey, Slots]:
    """The trace's streams, in file order; K = num_slots, or the deepest draft seen."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    k = num_slots or max((len(line["features"]) for line in lines), default=1)
    rows: dict[StreamKey, list[tuple]] = {}
    last_step: dict[StreamKey, int] = {}
    for row, line in enumerate(lines):  # a line is one request's draft row of one step
        key = (line["workload"], line["concurrency"], line["round"], line.get("method", "AV"))
        slots = rows.setdefault(key, [])
        last_step[key] = max(last_step.get(key, 0), line["step"])
        accepted = line["accepted"]
        for i, f in enumerate(line["features"][:min(line["admitted"], accepted + 1)]):
            slots.append((line["step"], row, i + 1, f, float(i < accepted)))
    streams = {}
    for key, slots in rows.items():
        step, request, position, feature, label = zip(*slots) if slots else ((),) * 5
        trailing = last_step[key] - max(step, default=last_step[key])
        streams[key] = Slots(np.array(step, np.int64), np.array(request, np.int64), np.array(position, np.int64),
                             np.array(feature, np.float64), np.array(label, np.float64), k, trailing)
    return streams


@dataclass(frozen=True, slots=True)
class Replay:
    slope: float  # the final omega
    final_gap: float  # log-loss of the final parameters over the stream's labels, less the MLE's
    prequential: float  # mean log-loss of each label under the confidence it had before it was learned
    skipped: int  # refits skipped (a negative or non-finite step)


def replay(slots: Slots, config: EstimatorConfig, mle_log_loss: float) -> Replay:
    r = replay_online(slots.step, slots.request, slots.position, slots.feature, slots.label, config,
                      num_slots=slots.num_slots, trailing_steps=slots.trailing_steps)
    est = r.estimator
    final = est.slope * slots.feature + est.intercepts.numpy()[slots.position - 1]
    return Replay(est.slope, log_loss(1 / (1 + np.exp(-final)), slots.label) - mle_log_loss,
                  log_loss(r.confidence, slots.label), est.num_skipped)


def mle(slots: Slots) -> tuple[float, float, int, float]:
    """The maximum-likelihood fit of the stream's labels: (slope, its log-loss, labels, acceptance)."""
    fit = fit_position_logistic(slots.feature, slots.position, slots.label)
    return (float(fit.slope[0]), log_loss(fit.predict(slots.feature, slots.position), slots.label),
            len(slots.label), float(slots.label.mean()))


def parse_config(text: str) -> EstimatorConfig:
    """'{"trust_radius": "inf"}' -> the default EstimatorConfig with those fields ("inf" = infinity)."""
    fields = {k: (math.inf if v == "inf" else v) for k, v in json.loads(text).items()}
    return dataclasses.replace(EstimatorConfig(), **fields)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a `bench adaptive --trace` file (.jsonl or .jsonl.gz)")
    p.add_argument("--config", action="append", default=[], metavar="JSON",
                   help="EstimatorConfig fields over the default (repeatable)")
    p.add_argument("--k", type=int, default=0, help="the estimator's K (default: the deepest draft in the trace)")
    args = p.parse_args(argv)
    configs = {"default": EstimatorConfig()} | {c: parse_config(c) for c in args.config}
    streams = read_streams(args.trace, args.k)
    print(f"{'stream':<28}{'labels':>7}{'accept':>8}{'MLE slope':>10}  " +
          "  ".join(f"{name[:34]:>34}" for name in configs))
    print(f"{'':<53}  " + "  ".join(f"{'slope  final gap  prequential  skip':>34}" for _ in configs))
    for key, stream in streams.items():
        name = f"{key[0]} C={key[1]} r{key[2]} {key[3]}"
        if not len(stream.label):
            print(f"{name[:28]:<28}{0:>7}  (nothing verified: no labels to fit)")
            continue
        slope, loss, n, acceptance = mle(stream)
        cells = []
        for config in configs.values():
            r = replay(stream, config, loss)
            cells.append(f"{r.slope:>5.2f}  {r.final_gap:>9.4f}  {r.prequential:>11.4f}  {r.skipped:>4}")
        print(f"{name[:28]:<28}{n:>7}{acceptance:>8.3f}{slope:>10.2f}  " + "  ".join(f"{c:>34}" for c in cells))


if __name__ == "__main__":
    main()
