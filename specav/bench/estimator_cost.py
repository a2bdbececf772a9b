"""Per-step cost of the online acceptance estimator: score + observe, refits amortised.

    python -m specav.bench.estimator_cost [--batch-size 16] [--num-slots 8] [--mode pooled] [--step-ms X]

Prints microseconds per engine step for score, observe (including the refit every
refit_interval steps, amortised) and their sum, and with --step-ms the sum as a
fraction of an engine step of X milliseconds. Inputs are synthetic features and
first-rejection counts; the estimator does not look at their values' meaning, so its
cost does not depend on them. This program owns only the measurement; it must not
load models.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from specav.acceptance.estimator import OnlineAcceptanceEstimator
from specav.config import EstimatorConfig


@dataclass(frozen=True, slots=True)
class StepInputs:
    features: torch.Tensor  # [B, K] float32
    num_admitted: torch.Tensor  # [B] int64
    num_accepted: torch.Tensor  # [B] int64


@dataclass(frozen=True, slots=True)
class CostReport:
    """Median microseconds per engine step over repeats."""

    score_us: float
    observe_us: float  # refits amortised
    refit_us: float  # one refit on its own

    @property
    def total_us(self) -> float:
        return self.score_us + self.observe_us


def make_inputs(batch: int, num_slots: int, count: int, generator: torch.Generator) -> list[StepInputs]:
    """Synthetic steps: features around logit(q_max) of real drafts, ragged admitted and accepted."""
    out = []
    for _ in range(count):
        f = torch.randn(batch, num_slots, generator=generator) * 2.5 + 2.0
        admitted = torch.randint(0, num_slots + 1, (batch,), generator=generator)
        accepted = (torch.rand(batch, generator=generator) * (admitted + 1)).long().clamp(max=admitted)
        out.append(StepInputs(f, admitted, accepted))
    return out


def time_steps(est: OnlineAcceptanceEstimator, inputs: list[StepInputs]) -> tuple[float, float]:
    """Seconds spent in score and in observe over all inputs."""
    score_s = observe_s = 0.0
    for s in inputs:
        t0 = time.perf_counter()
        est.score(s.features)
        t1 = time.perf_counter()
        est.observe(s.features, s.num_admitted, s.num_accepted)
        t2 = time.perf_counter()
        score_s += t1 - t0
        observe_s += t2 - t1
    return score_s, observe_s


def time_refit(est: OnlineAcceptanceEstimator, inputs: list[StepInputs], repeats: int) -> float:
    samples = []
    for s in inputs[:repeats]:
        est.observe(s.features, s.num_admitted, s.num_accepted)
        t0 = time.perf_counter()
        est.refit()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(batch: int, num_slots: int, config: EstimatorConfig, steps: int, repeats: int,
            seed: int = 0) -> CostReport:
    g = torch.Generator().manual_seed(seed)
    inputs = make_inputs(batch, num_slots, steps, g)
    est = OnlineAcceptanceEstimator(num_slots, config)
    time_steps(est, inputs[: min(steps, 200)])  # warm-up
    runs = [time_steps(est, inputs) for _ in range(repeats)]
    score = statistics.median(r[0] for r in runs) / steps
    observe = statistics.median(r[1] for r in runs) / steps
    refit = time_refit(OnlineAcceptanceEstimator(num_slots, config), inputs, min(steps, 200))
    return CostReport(score * 1e6, observe * 1e6, refit * 1e6)


def main(argv: list[str] | None = None) -> None:
    defaults = EstimatorConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=16, help="B requests per step (default 16)")
    p.add_argument("--num-slots", type=int, default=8, help="K draft slots (default 8)")
    p.add_argument("--refit-interval", type=int, default=defaults.refit_interval,
                   help=f"steps between refits (default {defaults.refit_interval}, EstimatorConfig)")
    p.add_argument("--mode", default=defaults.mode, choices=EstimatorConfig.MODES,
                   help=f"estimator mode (default {defaults.mode}, EstimatorConfig)")
    p.add_argument("--steps", type=int, default=2000, help="steps per repeat (default 2000)")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the median is shown (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--step-ms", type=float, default=None,
                   help="engine step time in ms; also print the estimator's share of it")
    args = p.parse_args(argv)
    if args.step_ms is not None and not args.step_ms > 0:
        p.error(f"--step-ms = {args.step_ms} must be > 0 (an engine step's time in ms)")
    if args.batch_size < 1 or args.num_slots < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--batch-size, --num-slots, --steps and --repeats must be integers >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EstimatorConfig(mode=args.mode, refit_interval=args.refit_interval)
    r = measure(args.batch_size, args.num_slots, config, args.steps, args.repeats)
    print(f"estimator cost per engine step  B={args.batch_size} K={args.num_slots} mode={config.mode} "
          f"refit_interval={config.refit_interval} torch_threads={torch.get_num_threads()}")
    print(f"  {'score':<28}{r.score_us:10.1f} us")
    print(f"  {'observe (refits amortised)':<28}{r.observe_us:10.1f} us")
    print(f"  {'score + observe':<28}{r.total_us:10.1f} us")
    print(f"  {'one refit':<28}{r.refit_us:10.1f} us")
    if args.step_ms is not None:
        share = r.total_us / (args.step_ms * 1e3)
        print(f"  {'share of a ' + format(args.step_ms, 'g') + ' ms step':<28}{share:10.2e} "
              f"({share * 100:.3f}%)")


if __name__ == "__main__":
    main()
