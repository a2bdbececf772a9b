"""Short run on the packaged pair: does the online estimator improve on raw q_max?

    python -m specav.bench.calibration [--dtype fp32] [--prompts 8] [--max-tokens 96] [--k 4]
                                       [--refit-interval 10]

Runs a batch of prompts from several workloads through the engine with static K (every
drafted slot verified, so labels are not censored), the estimator learning online. Prints
the fitted slope and intercepts, and the calibration of raw q_max (the unfitted estimator)
against the estimator's prequential confidences (each slot scored before its label was
learned) over the second half of the run: mean confidence vs observed acceptance, ECE and
log-loss.
"""

from __future__ import annotations

import argparse

import numpy as np

from specav.cli import encode_prompt
from specav.config import EngineConfig, EstimatorConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specav.engine.engine import Engine
from specav.evaluation.collect import labelled_slots
from specav.evaluation.metrics import auc, ece, log_loss
from specav.evaluation.workloads import load_workload

WORKLOADS = ("code", "chat", "math", "prose", "unpredictable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--prompts", type=int, default=10, help="prompts in all, spread over the workloads")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--refit-interval", type=int, default=10)
    args = parser.parse_args()

    config = EngineConfig(target=ModelConfig(dtype=args.dtype),
                          speculative=SpeculativeConfig(num_speculative_tokens=args.k),
                          estimator=EstimatorConfig(refit_interval=args.refit_interval),
                          max_batch_size=args.prompts)
    engine = Engine.from_config(config)
    rows: list[tuple[int, float, float, int]] = []  # (step, q_max, confidence, label)

    def listen(record) -> None:
        index, labels = labelled_slots(record.num_admitted, record.num_accepted)
        b, i = index[:, 0], index[:, 1]
        q = record.drafts.features["q_max"][b, i].tolist()
        c = record.confidences[b, i].tolist()
        rows.extend((record.step, qq, cc, int(y)) for qq, cc, y in zip(q, c, labels.tolist()))

    engine.step_listeners.append(listen)
    per = -(-args.prompts // len(WORKLOADS))
    prompts = [p for w in WORKLOADS for p in load_workload(w)[:per]][: args.prompts]
    for n, p in enumerate(prompts):
        engine.add_request(encode_prompt(engine.tokenizer, messages=p.chat()),
                           SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=n))
    while engine.has_work():
        engine.step()

    data = np.array(rows)
    later = data[data[:, 0] >= np.median(data[:, 0])]
    est = engine.scorer
    print(f"{len(data)} labelled slots from {len(prompts)} prompts, {engine.stats.steps} steps, "
          f"{est.num_refits} refits (every {args.refit_interval} steps)")
    print(f"fitted slope {est.slope:.3f}; intercepts " + " ".join(f"{b:+.3f}" for b in est.intercepts.tolist()))
    print(f"\nsecond half of the run ({len(later)} slots, 15 equal-width bins):")
    print(f"{'scorer':<34} {'mean conf':>9} {'accepted':>9} {'gap':>7} {'ECE':>7} {'log-loss':>9} {'AUC':>6}")
    y = later[:, 3]
    for name, conf in [("raw q_max (unfitted)", later[:, 1]), ("online estimator (prequential)", later[:, 2])]:
        print(f"{name:<34} {conf.mean():>9.3f} {y.mean():>9.3f} {conf.mean() - y.mean():>+7.3f} "
              f"{ece(conf, y, bins=15):>7.4f} {log_loss(conf, y):>9.4f} {auc(conf, y):>6.3f}")
    print(f"\n{engine.stats.summary()}")


if __name__ == "__main__":
    main()
