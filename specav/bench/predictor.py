"""How well what the planner remembers predicts a request's next block, on a real labelled-draft log.

    python -m specav.bench.predictor LOG [LOG ...]

Before a request's first slot of a step nothing of the step is drafted, so the adaptive planner
predicts the block it would draft (the survival s_n of its slots n = 1..K, whose sum is the
expected accepted tokens) from what earlier steps drafted: the request's own drafted slots, with
the traffic's (the population's) as a prior; for a new request, the population's alone
(verification/adaptive.py). This replays the logs (written by `specav eval collect` with a static
K, so that every step's block is verified from slot 1: e.g. `specav eval collect --out runs/k8
--workloads code,chat,prose --prompts 8 --max-tokens 128 --max-batch-size 8 --seed 1
--speculative-config '{"model": "default", "num_speculative_tokens": 8}'`) step by step in
engine order and, before each request's step, predicts its block in two ways, under the offline
shared-slope fit of all the logs (so that only the predictor differs, not the calibration):

    slot samples    every drafted slot's feature, at whatever position it was drafted, is a
                    sample of the next slot's feature, standing for every slot of the block
                    (the planner before)
    block samples   every drafted block (its slots' features, each scored at its own position)
                    is a sample of the next block; a block counts up to its end and not past it
                    (the planner now: `BlockSamples`, `block_survival`)

The truth is the step's accepted prefix a (the log labels slots up to the first rejection):
the block's slot n survives if a >= n. Printed per workload, for new requests (population only)
and for requests with their own history: blocks predicted, the observed mean of a, the mean
predicted sum of s_n, and the log-loss of s_n against [a >= n], averaged over n = 1..K. The log
has each block's features up to its first rejection, where the planner has every drafted slot's:
here a block ends at its first rejection, in the planner where its drafting stopped. Reads logs
only; loads no model.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from specav.evaluation.report import fit_position_logistic, load_slots
from specav.verification.adaptive import (_PRIOR_BLOCKS, HISTORY_BLOCKS, HISTORY_DECAY, BlockSamples, Population,
                                          block_features, block_survival)

_SLOT_PRIOR = 2.0  # the planner before: the population's features counted as two of the request's slots
_SLOT_HISTORY, _SLOT_POPULATION = 32, 256  # ... and it kept this many slot features


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _survivals(features: np.ndarray, weights: np.ndarray, slope: np.ndarray, intercept: np.ndarray) -> np.ndarray:
    """Weighted mean survival curve # [K] of samples # [M, K] (features at each position)."""
    curves = np.cumprod(_sigmoid(slope * features + intercept), axis=1)
    return weights @ curves / weights.sum()


def _slot_prediction(own: BlockSamples, population: Population, k: int, slope, intercept) -> np.ndarray:
    def flat(samples: BlockSamples, keep: int) -> tuple[list[float], list[float]]:
        pairs = [(f, w) for block, w in zip(samples.blocks, samples.weights) for f in block][-keep:]
        return [f for f, _ in pairs], [w for _, w in pairs]
    f, w = flat(own, _SLOT_HISTORY)
    pf, pw = flat(population.prior(), _SLOT_POPULATION)
    if pw:
        f, w = f + pf, w + [x * _SLOT_PRIOR / sum(pw) for x in pw]
    return _survivals(np.repeat(np.array(f)[:, None], k, axis=1), np.array(w), slope, intercept)


def _block_prediction(own: BlockSamples, population: Population, k: int, slope, intercept) -> np.ndarray:
    blocks, weights = own.with_prior(population.prior(), _PRIOR_BLOCKS)
    features, drafted = block_features(blocks, k)
    confidences = torch.from_numpy(_sigmoid(slope * features.numpy() + intercept))
    return block_survival(confidences, torch.tensor(weights, dtype=torch.float64), drafted).numpy()


PREDICTORS = {"slot samples": _slot_prediction, "block samples": _block_prediction}


def predictions(data, slope: np.ndarray, intercept: np.ndarray) -> list[dict]:
    """One row per (request, step) after the population has a block: each predictor's survival
    curve # [K], the accepted prefix, the workload, and whether the request had its own history."""
    k = slope.size
    order = np.lexsort((data.position, data.request, data.step))
    step, request, position = data.step[order], data.request[order], data.position[order]
    feature, label, workload = data.logit_q_max[order], data.label[order], data.workload[order]
    own: dict[int, BlockSamples] = {}
    population = Population()
    rows = []
    for s in np.unique(step):
        now = step == s
        blocks = {}
        for r in np.unique(request[now]):
            mine = now & (request == r)
            history = own.setdefault(int(r), BlockSamples())
            if population.requests:
                rows.append({"workload": data.workload_names[workload[mine][0]],
                             "new": not history.blocks, "accepted": int(label[mine].sum()),
                             **{name: predict(history, population, k, slope, intercept)
                                for name, predict in PREDICTORS.items()}})
            blocks[int(r)] = feature[mine][np.argsort(position[mine])].tolist()
        for r, block in blocks.items():
            own[r].add([block], HISTORY_DECAY, HISTORY_BLOCKS)  # (the planner's own weights decay per step drafted)
            population.add(str(r), block)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args()
    data = load_slots(args.logs)
    fit = fit_position_logistic(data.logit_q_max, data.position, data.label)
    slope, intercept = np.asarray(fit.slope, np.float64), np.asarray(fit.intercept, np.float64)
    k = slope.size
    rows = predictions(data, slope, intercept)
    print(f"{data.size} labelled slots, K = {k}; offline fit: slope {slope[0]:.3f}, "
          f"intercepts {' '.join(f'{b:.2f}' for b in intercept)}")
    print(f"{'workload':<8} {'requests':<9} {'blocks':>6} {'accepted':>9} {'predictor':<14} {'predicted':>9} "
          f"{'log-loss':>9}")
    for workload in sorted({row["workload"] for row in rows}):
        for new in (True, False):
            mine = [row for row in rows if row["workload"] == workload and row["new"] == new]
            if not mine:
                continue
            accepted = np.array([row["accepted"] for row in mine])
            truth = accepted[:, None] >= np.arange(1, k + 1)  # [N, K]: slot n survives
            for name in PREDICTORS:
                p = np.clip(np.array([row[name] for row in mine]), 1e-12, 1 - 1e-12)  # [N, K]
                loss = -np.mean(truth * np.log(p) + (~truth) * np.log(1 - p))
                print(f"{workload:<8} {'new' if new else 'own':<9} {len(mine):>6} {accepted.mean():>9.2f} "
                      f"{name:<14} {p.sum(1).mean():>9.2f} {loss:>9.4f}")


if __name__ == "__main__":
    main()
