"""Replay what an AV engine's estimator observed on the real pair through estimator configs.

    python -m specav.bench.estimator_trace TRACE [--config '{"trust_radius": "inf"}' ...]

TRACE is the JSON-lines file of `python -m specav.bench.adaptive --trace` (plain or .gz): per
step and request the drafted slots' features, and the admitted and accepted counts, which are
what the estimator observed that step (every request of the bench teaches it). Each stream (a
cell's round for one AV method: its engine started with a fresh estimator) is replayed step by
step, one `observe` per engine step, through the default EstimatorConfig and each `--config`
(fields over the default; "inf" for infinity), and compared with the maximum-likelihood fit of
the same labels (`fit_position_logistic`, an exact Newton fit): the final parameters' log-loss
over the stream's labels less the MLE's, and the prequential log-loss (each slot scored before
its label was learned). The labels a replay sees are the ones the recorded run produced: its
drafts and trims followed the recorded estimator, not the replayed one.

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
import torch

from specav.acceptance.estimator import OnlineAcceptanceEstimator
from specav.config import EstimatorConfig
from specav.evaluation.report import fit_position_logistic

StreamKey = tuple[str, int, int, str]  # workload, concurrency, round, method


@dataclass(frozen=True, slots=True)
class Observation:
    """One engine step as the estimator saw it."""

    features: torch.Tensor  # [B, K] float64, NaN past each request's drafted slots
    num_admitted: torch.Tensor  # [B]
    num_accepted: torch.Tensor  # [B]


def read_streams(path: str, num_slots: int = 0) -> dict[StreamKey, list[Observation]]:
    """The trace's observation streams, in file order; K = num_slots, or the deepest draft seen."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    k = num_slots or max((len(line["features"]) for line in lines), default=1)
    steps: dict[StreamKey, dict[int, list[dict]]] = {}
    for line in lines:
        key = (line["workload"], line["concurrency"], line["round"], line.get("method", "AV"))
        steps.setdefault(key, {}).setdefault(line["step"], []).append(line)
    streams = {}
    for key, by_step in steps.items():
        streams[key] = []
        for rows in by_step.values():
            features = torch.full((len(rows), k), math.nan, dtype=torch.float64)
            for b, row in enumerate(rows):
                features[b, :len(row["features"])] = torch.tensor(row["features"], dtype=torch.float64)
            streams[key].append(Observation(features, torch.tensor([r["admitted"] for r in rows]),
                                            torch.tensor([r["accepted"] for r in rows])))
    return streams


@dataclass(frozen=True, slots=True)
class Replay:
    slope: float  # the final omega
    final_gap: float  # log-loss of the final parameters over the stream's labels, less the MLE's
    prequential: float  # mean log-loss of each label under the confidence it had before it was learned
    skipped: int  # refits skipped (a negative or non-finite step)


def labelled(stream: list[Observation]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stream's labelled slots: features, 1-based positions and labels # [N] (accepted slots
    and each request's first rejected one, as the estimator labels them)."""
    f, pos, y = [], [], []
    for o in stream:
        for b in range(len(o.num_admitted)):
            admitted, accepted = int(o.num_admitted[b]), int(o.num_accepted[b])
            for i in range(min(admitted, accepted + 1)):
                if math.isfinite(float(o.features[b, i])):
                    f.append(float(o.features[b, i]))
                    pos.append(i + 1)
                    y.append(1.0 if i < accepted else 0.0)
    return np.array(f), np.array(pos, dtype=np.int64), np.array(y)


def replay(stream: list[Observation], config: EstimatorConfig, mle_log_loss: float) -> Replay:
    est = OnlineAcceptanceEstimator(stream[0].features.shape[1], config)
    losses = []
    for o in stream:
        confidences = est.score(o.features)
        for b in range(len(o.num_admitted)):
            admitted, accepted = int(o.num_admitted[b]), int(o.num_accepted[b])
            for i in range(min(admitted, accepted + 1)):
                p = min(max(float(confidences[b, i]), 1e-12), 1 - 1e-12)
                if math.isfinite(p):
                    losses.append(-math.log(p if i < accepted else 1.0 - p))
        est.observe(o.features, o.num_admitted, o.num_accepted)
    f, pos, y = labelled(stream)
    logits = est.slope * f + est.intercepts.numpy()[pos - 1]
    final = float(np.mean(np.logaddexp(0.0, logits) - y * logits))
    return Replay(est.slope, final - mle_log_loss, float(np.mean(losses)), est.num_skipped)


def mle(stream: list[Observation]) -> tuple[float, float, int, float]:
    """The maximum-likelihood fit of the stream's labels: (slope, its log-loss, labels, acceptance)."""
    f, pos, y = labelled(stream)
    fit = fit_position_logistic(f, pos, y)
    logits = fit.logit(f, pos)
    return float(fit.slope[0]), float(np.mean(np.logaddexp(0.0, logits) - y * logits)), len(y), float(y.mean())


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
        if not len(labelled(stream)[2]):
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
