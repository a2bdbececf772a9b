"""How close the online estimator gets to the offline maximum-likelihood fit, and how fast it
follows a change, on synthetic traffic drawn from a known model.

    python -m specav.bench.estimator_fit [--steps 12000] [--seeds 8] [--half-lives 500,1000,...]
                                         [--change-z inf,6] [--shift -0.5] [--trust on,off]

Traffic (issue 12): 8 requests per step, K = 6, every drafted slot verified (the static
planner), labels up to the first rejection; confidence_i = sigmoid(0.53 f + beta_i) with
beta = 0.45 down to -0.40 and f = logit(q_max) drawn from a mixture of confident and unsure
slots. Each configuration is replayed online over the same seeded traffic
(evaluation/replay.py, which equals a step-by-step run):

1. stationary, 12,000 steps: the largest |online - offline MLE| over the K + 1 parameters
   at the end (the MLE is an exact Newton fit on all the labels), and the log-loss gap on
   all labels of the final parameters and of the prequential confidences;
2. changing: every intercept moves by -0.5 at step 6,000; the mean |intercept - new truth|
   at several steps after it (the issue's goal is read at 9,000);
3. cold start: prequential log-loss over the first 300 steps minus that of the true model.

Optional tables: --cold-start-sweep 0,8,16,... (the same cold-start gap for each
cold_start_labels, at 1 request per step over 300 and 1,000 steps and at 8 per step over
300), and --false-alarm-runs N (changes detected on N stationary 12,000-step runs, per
change_z in --false-alarm-z, against the chi^2 rate the test is built for).

Every pooled row uses the default EstimatorConfig but for its half-life and change_z
(cold_start_labels and the initial values can be set too; --trust on,off adds the rows
without the trust region); the seed's windowed
configuration is the first row. Figures are the mean and the worst over seeds.
This program owns only the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from specav.config import EstimatorConfig
from specav.evaluation.replay import replay_online
from specav.evaluation.report import fit_position_logistic

SLOPE = 0.53
INTERCEPTS = tuple(np.round(np.linspace(0.45, -0.40, 6), 4))
BATCH = 8


@dataclass(frozen=True, slots=True)
class Traffic:
    """Labelled slots in step order, `# [N]` each."""

    step: np.ndarray
    request: np.ndarray
    position: np.ndarray  # 1-based
    feature: np.ndarray
    label: np.ndarray

    def before(self, step: int) -> "Traffic":
        keep = self.step < step
        return Traffic(*(getattr(self, f.name)[keep] for f in dataclasses.fields(self)))


def draw_traffic(steps: int, seed: int, shift_at: int | None = None, shift: float = -0.5,
                 batch: int = BATCH, slope: float = SLOPE,
                 intercepts: tuple[float, ...] = INTERCEPTS) -> Traffic:
    """Seeded traffic from the known model; intercepts move by `shift` from step `shift_at` on."""
    rng = np.random.default_rng(seed)
    k = len(intercepts)
    confident = rng.random((steps, batch, k)) < 0.6
    f = np.where(confident, rng.normal(4.0, 1.5, confident.shape), rng.normal(-0.5, 1.5, confident.shape))
    f = np.clip(f, math.log(0.05 / 0.95), math.log(0.999 / 0.001))
    beta = np.broadcast_to(np.asarray(intercepts), (steps, k)).copy()
    if shift_at is not None:
        beta[shift_at:] += shift
    accept = rng.random(f.shape) < 1.0 / (1.0 + np.exp(-(slope * f + beta[:, None, :])))
    reached = np.concatenate([np.ones((steps, batch, 1), bool), np.cumprod(accept, axis=2)[..., :-1] > 0], axis=2)
    s, b, i = np.nonzero(reached)  # step-major, then request, then position: log order
    return Traffic(s, b, i + 1, f[s, b, i], accept[s, b, i].astype(np.int8))


def mean_log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@dataclass(frozen=True, slots=True)
class FitResult:
    max_param_gap: float  # max |online - MLE| over slope and intercepts
    worst_param: str
    final_gap: float  # log-loss of the final parameters minus the MLE's, all labels
    prequential_gap: float  # log-loss of the prequential confidences minus the MLE's


def stationary(config: EstimatorConfig, traffic: Traffic) -> FitResult:
    mle = fit_position_logistic(traffic.feature, traffic.position, traffic.label)
    r = replay_online(traffic.step, traffic.request, traffic.position, traffic.feature, traffic.label, config)
    est = r.estimator
    online = np.r_[est.slope, est.intercepts.numpy()]
    offline = np.r_[mle.slope[0], mle.intercept]
    gaps = np.abs(online - offline)
    names = ["omega"] + [f"beta{i}" for i in range(1, offline.size)]
    idx = traffic.position - 1
    base = mean_log_loss(mle.predict(traffic.feature, traffic.position), traffic.label)
    final = mean_log_loss(_sigmoid(online[0] * traffic.feature + online[1:][idx]), traffic.label)
    return FitResult(float(gaps.max()), names[int(gaps.argmax())], final - base,
                     mean_log_loss(r.confidence, traffic.label) - base)


def tracking_error(config: EstimatorConfig, traffic: Traffic, at: int, truth: np.ndarray) -> float:
    """Mean |intercept - truth| after the first `at` steps."""
    t = traffic.before(at)
    est = replay_online(t.step, t.request, t.position, t.feature, t.label, config).estimator
    return float(np.abs(est.intercepts.numpy() - truth).mean())


def false_alarms(runs: int, zs: list[float], steps: int) -> None:
    """Changes detected on stationary traffic, per change_z, with the chi^2 rate expected."""
    from scipy.stats import chi2

    k = len(INTERCEPTS)
    found = {z: 0 for z in zs}
    refits = 0
    for seed in range(runs):
        t = draw_traffic(steps, 500 + seed)
        for z in zs:
            est = replay_online(t.step, t.request, t.position, t.feature, t.label,
                                EstimatorConfig(change_z=z)).estimator
            found[z] += est.num_changes
        refits += est.num_refits
    print(f"\nfalse alarms: {runs} stationary runs of {steps:,} steps, {refits:,} refits per change_z")
    print(f"{'change_z':>10}{'changes':>10}{'per refit':>12}{'chi^2 (K dof) per refit':>26}")
    for z in zs:
        expected = chi2.sf(k + z * math.sqrt(2 * k), k)
        print(f"{z:>10g}{found[z]:>10}{found[z] / refits:>12.2e}{expected:>26.2e}")


def cold_start_sweep(values: list[int], seeds: int, init: tuple[float, float]) -> None:
    print(f"\ncold-start refits from slope {init[0]:g}, intercepts {init[1]:g}: prequential log-loss minus "
          "the true model's (mean / worst over seeds)")
    cases = ((1, 300), (1, 1000), (BATCH, 300))
    print(f"{'cold_start_labels':>18}" + "".join(f"{f'B={b}, {n} steps':>22}" for b, n in cases))
    for first in values:
        cells = []
        for batch, steps in cases:
            config = EstimatorConfig(cold_start_labels=first, init_slope=init[0], init_intercept=init[1])
            gaps = [cold_start_gap(config, draw_traffic(steps, seed, batch=batch), steps) for seed in range(seeds)]
            cells.append(f"{np.mean(gaps):.4f} / {max(gaps):.4f}")
        print(f"{first:>18}" + "".join(f"{c:>22}" for c in cells))


def cold_start_gap(config: EstimatorConfig, traffic: Traffic, steps: int) -> float:
    """Prequential log-loss over the first `steps` steps minus that of the truth's own confidences."""
    t = traffic.before(steps)
    r = replay_online(t.step, t.request, t.position, t.feature, t.label, config)
    truth = _sigmoid(SLOPE * t.feature + np.asarray(INTERCEPTS)[t.position - 1])
    return mean_log_loss(r.confidence, t.label) - mean_log_loss(truth, t.label)


def configs(half_lives: list[float], cold_start_labels: int, init: tuple[float, float],
            change_z: list[float], trust: tuple[bool, ...] = (True,)) -> dict[str, EstimatorConfig]:
    out = {"windowed (seed)": EstimatorConfig.seed_windowed()}
    off = {"trust_radius": math.inf, "slope_factor": math.inf}
    for region in trust:
        for z in change_z:
            for h in half_lives:
                name = f"pooled, h {h:g}" + ("" if math.isinf(z) else f", z {z:g}") + ("" if region else ", no TR")
                out[name] = EstimatorConfig(half_life=h, cold_start_labels=cold_start_labels, change_z=z,
                                            init_slope=init[0], init_intercept=init[1], **({} if region else off))
    return out


def main(argv: list[str] | None = None) -> None:
    default = EstimatorConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12_000, help="steps of stationary traffic (default 12000)")
    p.add_argument("--seeds", type=int, default=8, help="seeds; mean and worst are shown (default 8)")
    p.add_argument("--half-lives", default="500,1000,2000,4000,8000",
                   help="pooled half-lives in steps to compare (comma-separated; inf: never forget)")
    p.add_argument("--cold-start-labels", type=int, default=default.cold_start_labels)
    p.add_argument("--init-slope", type=float, default=default.init_slope)
    p.add_argument("--init-intercept", type=float, default=default.init_intercept)
    p.add_argument("--change-z", default=f"inf,{default.change_z:g}",
                   help="change_z values to compare (comma-separated; inf: no change test)")
    p.add_argument("--trust", default="on", help="trust region settings to compare (on,off; off: the pooled "
                   "rows without trust_radius and slope_factor, named 'no TR')")
    p.add_argument("--shift-at", type=int, default=6_000)
    p.add_argument("--shift", type=float, default=-0.5, help="the change added to every intercept")
    p.add_argument("--cold-start-sweep", default="", help="cold_start_labels values for the optional table")
    p.add_argument("--false-alarm-runs", type=int, default=0, help="stationary runs for the false-alarm table")
    p.add_argument("--false-alarm-z", default="4,5,6,8", help="change_z values for the false-alarm table")
    p.add_argument("--read-at", default="6500,7000,8000,9000", help="steps at which tracking error is read")
    args = p.parse_args(argv)
    half_lives = [float(h) for h in args.half_lives.split(",")]
    if not set(args.trust.split(",")) <= {"on", "off"}:
        p.error(f"--trust {args.trust!r}: a comma-separated list of on and off")
    trust = tuple(t == "on" for t in args.trust.split(","))
    read_at = [int(s) for s in args.read_at.split(",")]
    table = configs(half_lives, args.cold_start_labels, (args.init_slope, args.init_intercept),
                    [float(z) for z in args.change_z.split(",")], trust)
    seeds = range(args.seeds)
    calm = [draw_traffic(args.steps, seed) for seed in seeds]
    moved = [draw_traffic(max(read_at), 1000 + seed, shift_at=args.shift_at, shift=args.shift) for seed in seeds]
    counts = np.bincount(calm[0].position)[1:] / args.steps * 100
    print(f"traffic: {BATCH} requests/step, K = {len(INTERCEPTS)}, slope {SLOPE}, intercepts "
          f"{', '.join(f'{b:+.2f}' for b in INTERCEPTS)}; labels per 100 steps by position: "
          + " ".join(f"{c:.0f}" for c in counts))
    print(f"\n1. stationary, {args.steps:,} steps, {args.seeds} seeds: online vs offline MLE (mean / worst)")
    print(f"{'config':<26}{'max |param gap|':>18}{'worst at':>10}{'final log-loss gap':>22}"
          f"{'prequential gap':>19}")
    for name, config in table.items():
        rs = [stationary(config, t) for t in calm]
        worst = max(rs, key=lambda r: r.max_param_gap)
        print(f"{name:<26}{np.mean([r.max_param_gap for r in rs]):>9.3f} / {worst.max_param_gap:.3f}"
              f"{worst.worst_param:>10}{np.mean([r.final_gap for r in rs]):>12.5f} / {max(r.final_gap for r in rs):.5f}"
              f"{np.mean([r.prequential_gap for r in rs]):>10.5f} / {max(r.prequential_gap for r in rs):.5f}")
    new_truth = np.asarray(INTERCEPTS) + args.shift
    print(f"\n2. changing: every intercept {args.shift:+g} at step {args.shift_at:,}; mean |intercept - new truth| "
          f"(mean / worst over seeds) at step")
    print(f"{'config':<26}" + "".join(f"{s:>16,}" for s in read_at))
    for name, config in table.items():
        cells = []
        for s in read_at:
            errs = [tracking_error(config, t, s, new_truth) for t in moved]
            cells.append(f"{np.mean(errs):>9.3f} / {max(errs):.3f}")
        print(f"{name:<26}" + "".join(f"{c:>16}" for c in cells))
    print("\n3. cold start: prequential log-loss minus the true model's, first 300 steps (mean / worst)")
    for name, config in table.items():
        gaps = [cold_start_gap(config, t, 300) for t in calm]
        print(f"{name:<26}{np.mean(gaps):>9.4f} / {max(gaps):.4f}")
    if args.cold_start_sweep:
        cold_start_sweep([int(v) for v in args.cold_start_sweep.split(",")], args.seeds,
                         (args.init_slope, args.init_intercept))
    if args.false_alarm_runs:
        false_alarms(args.false_alarm_runs, [float(z) for z in args.false_alarm_z.split(",")], args.steps)


if __name__ == "__main__":
    main()
