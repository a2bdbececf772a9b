"""How well a request's recent slots predict its next slot 1, on a real labelled-draft log.

    python -m specav.bench.predictor LOG [LOG ...]

The adaptive planner decides before a request's first slot whether it drafts at all, from the
features of the request's recent drafted slots (verification/adaptive.py, `FeatureSamples`:
weights decayed by HISTORY_DECAY per step). This replays every request of the logs (written by
`specav eval collect`, e.g. `specav eval collect --out runs/pc --workloads prose,chat --prompts 6
--max-tokens 128 --speculative-config '{"model": "default", "num_speculative_tokens": 4}'`) step
by step and, before each step whose slot 1 is labelled and after at least one step drafted,
predicts that slot's acceptance from the request's recent features in two ways, under the
offline shared-slope fit of all the logs (so that only the predictor differs, not the
calibration):

    mean feature      sigmoid(omega * weighted mean feature + beta_1)  (the planner before)
    mean confidence   weighted mean of sigmoid(omega * f + beta_1)      (the planner now)

Printed per workload: slots predicted, mean prediction against the observed acceptance, and
log-loss. Reads logs only; loads no model.
"""

from __future__ import annotations

import argparse

import numpy as np

from specav.evaluation.report import fit_position_logistic, load_slots
from specav.verification.adaptive import HISTORY_DECAY, HISTORY_SLOTS, FeatureSamples


def predictions(data, slope: float, intercept: float) -> dict[str, list[float]]:
    """Per labelled slot 1 with history: the two predictions and the label (see the module docstring)."""
    out: dict[str, list[float]] = {"workload": [], "mean feature": [], "mean confidence": [], "label": []}
    for r in range(data.request_names.size):
        mine = data.request == r
        steps, positions, features, labels = (data.step[mine], data.position[mine], data.logit_q_max[mine],
                                              data.label[mine])
        history = FeatureSamples()
        for step in np.unique(steps):
            now = steps == step
            first = now & (positions == 1)
            if history.features and first.any():
                f, w = np.array(history.features), np.array(history.weights)
                out["mean feature"].append(_sigmoid(slope * (w @ f) / w.sum() + intercept))
                out["mean confidence"].append(float(w @ _sigmoid(slope * f + intercept)) / w.sum())
                out["label"].append(float(labels[first][0]))
                out["workload"].append(data.workload_names[data.workload[mine][0]])
            history.add(features[now].tolist(), HISTORY_DECAY, HISTORY_SLOTS)
    return out


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args()
    data = load_slots(args.logs)
    fit = fit_position_logistic(data.logit_q_max, data.position, data.label)
    slope, intercept = float(fit.slope[0]), float(fit.intercept[0])
    rows = predictions(data, slope, intercept)
    print(f"{data.size} labelled slots; offline fit: slope {slope:.3f}, slot-1 intercept {intercept:.3f}")
    print(f"{'workload':<10} {'slots':>6} {'observed':>9} {'predictor':<16} {'mean pred':>9} {'log-loss':>9}")
    label, workloads = np.array(rows["label"]), np.array(rows["workload"])
    for workload in sorted(set(rows["workload"])):
        mine = workloads == workload
        for name in ("mean feature", "mean confidence"):
            p = np.clip(np.array(rows[name])[mine], 1e-12, 1 - 1e-12)
            y = label[mine]
            loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
            print(f"{workload:<10} {int(mine.sum()):>6} {y.mean():>9.3f} {name:<16} {p.mean():>9.3f} {loss:>9.4f}")


if __name__ == "__main__":
    main()
