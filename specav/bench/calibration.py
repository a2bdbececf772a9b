"""The online estimator on a real labelled-draft log, beside offline fits of the same model.

    python -m specav.bench.calibration LOG [LOG ...] [--config JSON ...] [--folds 0]

Reads logs written by `specav eval collect` (e.g. the packaged pair: `specav eval collect
--out runs/cold --prompts 6 --max-tokens 128 --temperature 0.7 --top-k 20 --top-p 0.8
--speculative-config '{"model": "default", "num_speculative_tokens": 6}'`) and replays
the estimator over them in log order (evaluation/replay.py), once per configuration: the
default, the seed's windowed one, and each `--config` (JSON overrides of the default, e.g.
'{"half_life": 4000}'). Prints, per configuration, prequential AUC / log-loss / ECE (15
bins) over every slot (what a freshly started server would have scored) and over the
report's held-out requests (`specav eval report`'s 70/30 split by request), with the
number of refits; beside them raw q_max, the logged confidences, and the offline
shared-slope fit: cross-validated by request (each request scored by a fit on all the
others; --folds N: N folds by request instead) for the all-slots column, fitted on the
training requests for the held-out column. Reads logs only; loads no model.

    --stream STEPS [--switch]

A log holds a few hundred engine steps, too few to tell half-lives in the thousands
apart, so this also builds a long stream from the log's real request traces: a batch of
16 requests, each replaced when its trace ends by one drawn at random (with replacement,
seeded) from the log, replayed step by step. With --switch the first half draws only
code and math requests and the second half the others (a change of content). Printed:
prequential metrics over the stream and over the 300 steps after its midpoint, and the
changes the estimator detected.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from specav.config import EstimatorConfig
from specav.evaluation.metrics import DEFAULT_BINS, ScorerMetrics, measure
from specav.evaluation.replay import replay_online
from specav.evaluation.report import SlotData, fit_position_logistic, held_out_requests, load_slots


def cross_validated(data: SlotData, folds: int, seed: int = 0) -> np.ndarray:
    """Shared-slope fit confidences `# [N]`, each request scored by a fit on the other folds.

    folds 0: one fold per request (leave one request out).
    """
    r = data.request_names.size
    fold_of_request = np.arange(r) if folds == 0 else np.random.default_rng(seed).permutation(r) % folds
    fold = fold_of_request[data.request]
    out = np.empty(data.size)
    for f in np.unique(fold):
        test = fold == f
        fit = fit_position_logistic(data.logit_q_max[~test], data.position[~test], data.label[~test])
        out[test] = fit.predict(data.logit_q_max[test], data.position[test])
    return out


def held_out_fit(data: SlotData, held: np.ndarray) -> np.ndarray:
    """Shared-slope fit on the training requests, confidences on every slot `# [N]`."""
    fit = fit_position_logistic(data.logit_q_max[~held], data.position[~held], data.label[~held])
    return fit.predict(data.logit_q_max, data.position)


def request_traces(data: SlotData) -> list[list[np.ndarray]]:
    """Per request, its slot indices grouped by step, in order (the log is in step order)."""
    order = np.lexsort((data.step, data.log, data.request))
    r, key = data.request[order], data.step[order] + (data.step.max() + 1) * data.log[order]
    cut = np.flatnonzero((np.diff(r) != 0) | (np.diff(key) != 0)) + 1
    groups = np.split(order, cut)
    traces: dict[int, list[np.ndarray]] = {}
    for g in groups:
        traces.setdefault(int(data.request[g[0]]), []).append(g)
    return list(traces.values())


def stream(data: SlotData, steps: int, switch: bool, batch: int = 16, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot indices into data, step, request instance), each `# [M]`, of a resampled stream."""
    rng = np.random.default_rng(seed)
    traces = request_traces(data)
    easy = np.array([data.workload_names[data.workload[t[0][0]]] in ("code", "math") for t in traces])
    pools = (np.flatnonzero(easy), np.flatnonzero(~easy)) if switch else (np.arange(len(traces)),) * 2
    active: list[list] = []  # [instance, trace, next step group]
    rows, at, who = [], [], []
    started = 0
    for t in range(steps):
        pool = pools[int(t >= steps // 2)]
        while len(active) < batch:
            active.append([started, traces[rng.choice(pool)], 0])
            started += 1
        for a in active:
            g = a[1][a[2]]
            rows.append(g)
            at.append(np.full(g.size, t))
            who.append(np.full(g.size, a[0]))
            a[2] += 1
        active = [a for a in active if a[2] < len(a[1])]
    return np.concatenate(rows), np.concatenate(at), np.concatenate(who)


def stream_table(data: SlotData, steps: int, switch: bool, configs: dict[str, EstimatorConfig]) -> None:
    rows, at, who = stream(data, steps, switch)
    y = data.label[rows]
    after = (at >= steps // 2) & (at < steps // 2 + 300)
    kind = "code/math, then the other workloads" if switch else "all workloads mixed"
    print(f"\nstream of {steps:,} steps from the log's request traces ({kind}), {rows.size:,} slots")
    print(f"{'':<58}{'whole stream':^25}{'300 steps after the midpoint':^27}")
    print(f"{'scorer':<58}{'AUC':>8}{'log-loss':>9}{'ECE':>8}{'AUC':>10}{'log-loss':>9}{'ECE':>8}")
    for name, config in configs.items():
        r = replay_online(at, who, data.position[rows], data.logit_q_max[rows], y, config)
        print(_row(f"online replay, {name}", measure(r.confidence, y, DEFAULT_BINS),
                   measure(r.confidence[after], y[after], DEFAULT_BINS),
                   f"{r.estimator.num_refits} refits, {r.estimator.num_changes} changes"))
    fit = fit_position_logistic(data.logit_q_max[rows], data.position[rows], y)
    p = fit.predict(data.logit_q_max[rows], data.position[rows])
    print(_row("offline shared slope, fitted on the whole stream (in-sample)", measure(p, y, DEFAULT_BINS),
               measure(p[after], y[after], DEFAULT_BINS)))


def ece_noise_floor(probs: np.ndarray, draws: int = 200, seed: int = 0) -> float:
    """Mean ECE of `probs` against labels drawn from `probs` themselves: the ECE a perfectly
    calibrated scorer shows on this many slots, from sampling noise alone."""
    rng = np.random.default_rng(seed)
    return float(np.mean([measure(probs, rng.random(probs.size) < probs, DEFAULT_BINS).ece
                          for _ in range(draws)]))


def configurations(overrides: list[str]) -> dict[str, EstimatorConfig]:
    out = {"default (pooled)": EstimatorConfig(), "seed (windowed)": EstimatorConfig.seed_windowed()}
    for text in overrides:
        out[text] = dataclasses.replace(EstimatorConfig(), **json.loads(text))
    return out


def _row(name: str, everything: ScorerMetrics, held: ScorerMetrics, note: str = "") -> str:
    return (f"{name:<58}{everything.auc:>8.4f}{everything.log_loss:>9.4f}{everything.ece:>8.4f}"
            f"{held.auc:>10.4f}{held.log_loss:>9.4f}{held.ece:>8.4f}  {note}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", nargs="+", help="slot log directories (several: pooled, in the order given)")
    p.add_argument("--config", action="append", default=[],
                   help="JSON overrides of the default EstimatorConfig (repeatable)")
    p.add_argument("--folds", type=int, default=0, help="folds by request for the offline fit (0: one per request)")
    p.add_argument("--seed", type=int, default=0, help="seed of the report's held-out split")
    p.add_argument("--stream", type=int, default=0, help="also replay a resampled stream of this many steps")
    p.add_argument("--switch", action="store_true", help="the stream switches content at its midpoint")
    args = p.parse_args(argv)
    data = load_slots(args.log)
    held = held_out_requests(data.request_names, args.seed)[data.request]
    y = data.label

    def both(conf: np.ndarray) -> tuple[ScorerMetrics, ScorerMetrics]:
        return measure(conf, y, DEFAULT_BINS), measure(conf[held], y[held], DEFAULT_BINS)

    print(f"{data.size:,} labelled slots, {data.request_names.size} requests "
          f"({int(np.unique(data.request[held]).size)} held out, {int(held.sum()):,} slots), "
          f"positions 1..{int(data.position.max())}, acceptance {y.mean():.4f}")
    print(f"{'':<58}{'all slots (prequential)':^25}{'held-out requests':^27}")
    print(f"{'scorer':<58}{'AUC':>8}{'log-loss':>9}{'ECE':>8}{'AUC':>10}{'log-loss':>9}{'ECE':>8}")
    configs = configurations(args.config)
    print(_row("raw q_max", *both(data.q_max)))
    print(_row("logged confidence (the estimator the log ran with)", *both(data.confidence)))
    for name, config in configs.items():
        r = replay_online(data.step, data.request, data.position, data.logit_q_max, y, config, log=data.log)
        est = r.estimator
        print(_row(f"online replay, {name}", *both(r.confidence),
                   f"{est.num_refits} refits ({est.num_changes} changes), {r.num_steps} steps; final omega {est.slope:.3f}, beta "
                   + " ".join(f"{b:+.2f}" for b in est.intercepts.tolist())))
    folds = "one fold per request" if args.folds == 0 else f"{args.folds} folds by request"
    cv = measure(cross_validated(data, args.folds), y, DEFAULT_BINS)
    train_fit = held_out_fit(data, held)
    print(_row(f"offline shared slope: CV ({folds}) / train->held-out", cv,
               measure(train_fit[held], y[held], DEFAULT_BINS)))
    print(f"ECE from sampling noise alone (labels drawn from the offline fit's own confidences, mean of "
          f"200 draws): {ece_noise_floor(cross_validated(data, args.folds)):.4f} on all slots, "
          f"{ece_noise_floor(train_fit[held]):.4f} on the held-out slots")
    fit = fit_position_logistic(data.logit_q_max, data.position, y)
    print(f"\noffline shared-slope fit on all slots: omega {fit.slope[0]:.4f}, beta "
          + " ".join(f"{b:+.4f}" for b in fit.intercept)
          + f"; slot-weighted mean beta {fit.intercept @ fit.count / fit.count.sum():+.4f}")
    if args.stream:
        stream_table(data, args.stream, args.switch, configs)


if __name__ == "__main__":
    main()
