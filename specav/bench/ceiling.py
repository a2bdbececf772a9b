"""What drafting could gain at concurrency 1 under rules that stop on the drafter's own confidence,
at most, on a real labelled-draft log, priced by this machine's cost profile.

    python -m specav.bench.ceiling LOG [LOG ...] [--draft-scale 1.0] [--draft-vocab-size 65536]

The log is written by `specav eval collect` with static K = 8 (every step's block verified from
slot 1; e.g. `specav eval collect --out runs/k8 --workloads code,chat,prose --prompts 8
--max-tokens 128 --max-batch-size 8 --seed 1 --speculative-config '{"model": "default",
"num_speculative_tokens": 8}'`): per request and step, the accepted prefix a and the drafter's
feature logit(q_max) of each slot up to the first rejection. Each logged step is a situation;
a rule drafts d slots of it and verifies v <= d, emitting min(a, v) + 1 tokens, and costs what
the cost profile (`specav profile`, the entry of this machine and the packaged pair in `auto`,
the drafter's head as --draft-vocab-size says)
predicts for its drafter forwards (the first feeding what the drafter has not seen: one token after
a step that drafted, everything since it last drafted otherwise; the prompt taken as seen) and
its verification of v + 1 tokens. A rule's speed is its tokens over its seconds across all
situations, each request's in order, relative to target-only (one token a step, the plain
decoding step's price). Printed per workload:

    static K        d = v = K for K = 1..8
    oracle          d = v = a: what bench adaptive's oracle drafts
    stop rules      the best, over a grid chosen in hindsight, of: draft a step only where the
                    request's previous step accepted at least m (m = 0: every step); draft slot
                    j + 1 while slot j's feature is at least theta, or while the survival of slots
                    1..j is (the product of their confidences under the logs' own per-position
                    logistic fit, the estimator's form, fitted on the outcomes); verify every
                    drafted slot, or all but the last where it fails the threshold; or never draft

The stop rules' figure is an upper bound for their family, not a rule anyone can run: the grid's
best is picked knowing the outcome, every step knows the previous step's a (a rule that did not
draft it would not), and where the log ends a block at its first rejection (the features past it
are not logged) a rule still drafting is taken to stop at the next slot, the cheapest it could.
`--draft-scale x` prices the drafter's forwards at x times the profile's (what a drafter that much
cheaper would allow). Reads logs and the cached profile only; loads no model.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, replace

import numpy as np

from specav.config import PACKAGED_SPECULATIVE
from specav.engine.profile import PROFILE_FILE, cached_profile, models_key, profile_key
from specav.evaluation.report import fit_position_logistic, load_slots
from specav.models import packaged
from specav.types import attended
from specav.verification.cost_model import CostCurve, CostModel, CostProfile

K = 8
CONTEXT = 200  # key positions a step attends to besides its own rows (a prompt and part of an answer)


@dataclass(frozen=True, slots=True)
class Situation:
    """One logged step of one request: its accepted prefix and the features of its slots up to the
    first rejection (a + 1 of them, or K where all K were accepted)."""

    accepted: int
    features: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Rule:
    """What a rule drafts and verifies in a situation (see the module docstring)."""

    name: str
    min_previous: int = 0  # draft only where the previous step accepted at least this many
    theta: float | None = None  # continue past slot j while its feature >= theta (None: draft `static` slots)
    static: int = K
    trim_last: bool = False
    fit: tuple[np.ndarray, np.ndarray] | None = None  # (slope, intercept) per position: theta bounds survival

    def slots(self, s: Situation, previous: int) -> tuple[int, int]:
        """(drafted, verified) in situation s after a step that accepted `previous`."""
        if previous < self.min_previous:
            return 0, 0
        if self.theta is None:
            return self.static, self.static
        values = s.features
        if self.fit is not None:
            slope, intercept = self.fit
            j = np.arange(len(values))
            values = tuple(np.cumprod(1.0 / (1.0 + np.exp(-(slope[j] * np.array(values) + intercept[j])))))
        drafted = K
        for j, v in enumerate(values, start=1):
            if v < self.theta or j == K:
                drafted = j
                break
        else:  # every logged slot passes: the next slot, unlogged, is taken to stop the rule
            drafted = min(K, len(values) + 1)
        last = values[drafted - 1] if drafted <= len(values) else -np.inf
        return drafted, drafted - 1 if self.trim_last and last < self.theta else drafted


def oracle_slots(s: Situation, previous: int = K) -> tuple[int, int]:
    """The oracle's (drafted, verified): exactly the accepted prefix (a rule's signature; previous unused)."""
    return s.accepted, s.accepted


def speed(requests: list[list[Situation]], choose, cost: CostModel) -> float:
    """Tokens per second of a rule over every request's situations in order; choose(situation,
    previous accepted) -> (drafted, verified)."""
    tokens = seconds = 0.0
    for situations in requests:
        previous, unseen = K, 0  # the prompt taken as seen (its catch-up left out for every rule alike)
        for s in situations:
            drafted, verified = choose(s, previous)
            emitted = min(s.accepted, verified) + 1
            if drafted:
                fed = 1 + unseen
                forwards = [(fed, attended(fed, CONTEXT))] + [(1, CONTEXT + j) for j in range(1, drafted)]
                step = cost.predict(forwards, verified + 1, attended(verified + 1, CONTEXT))
                unseen = 0
            else:
                step = cost.predict([], 1, attended(1, CONTEXT))
                unseen += emitted
            tokens += emitted
            seconds += step.total
            previous = s.accepted
    return tokens / seconds


def situations_by_workload(logs: list[str]) -> tuple[dict[str, list[list[Situation]]], tuple[np.ndarray, np.ndarray]]:
    """The logs' steps grouped per workload into each request's situations, in step order, and the
    logs' shared-slope per-position logistic fit of their labels on the feature (slope, intercept
    per position)."""
    data = load_slots(logs)
    fitted = fit_position_logistic(data.logit_q_max, data.position, data.label)
    fit = tuple(np.pad(np.asarray(a, np.float64)[:K], (0, max(0, K - len(a))), mode="edge")
                for a in (fitted.slope, fitted.intercept))
    blocks: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
    for i in range(data.label.size):
        blocks.setdefault((int(data.request[i]), int(data.step[i])), []).append(
            (int(data.position[i]), float(data.logit_q_max[i]), float(data.label[i])))
    workload_of = {int(r): data.workload_names[int(w)] for r, w in zip(data.request, data.workload)}
    out: dict[str, dict[int, list[tuple[int, Situation]]]] = {}
    for (request, step), slots in blocks.items():
        slots.sort()
        labels = [label for _, _, label in slots]
        accepted = next((j for j, label in enumerate(labels) if label < 0.5), len(labels))
        s = Situation(accepted, tuple(f for _, f, _ in slots[:accepted + 1]))
        out.setdefault(workload_of[request], {}).setdefault(request, []).append((step, s))
    return ({w: [[s for _, s in sorted(steps)] for steps in per.values()] for w, per in out.items()}, fit)


def stop_rules(requests: list[list[Situation]], fit: tuple[np.ndarray, np.ndarray] | None = None) -> list[Rule]:
    """The grid: feature thresholds at the features' deciles (and, with a fit, survival thresholds
    0.1 .. 0.9), previous-step gates 0-4, trimming or not, and the rule that never drafts
    (target-only is one of the family)."""
    features = np.array([f for situations in requests for s in situations for f in s.features])
    thetas = sorted(set(np.quantile(features, np.linspace(0.0, 0.9, 10)).round(3).tolist())) if features.size else []
    rules = [Rule("never", min_previous=K + 1)] + [
        Rule(f"m={m} feature>={theta:.3f}{' trim' if trim else ''}", m, theta, trim_last=trim)
        for m, theta, trim in itertools.product(range(5), thetas, (False, True))]
    if fit is not None:
        rules += [Rule(f"m={m} survival>={tau:.1f}{' trim' if trim else ''}", m, tau, trim_last=trim, fit=fit)
                  for m, tau, trim in itertools.product(range(5), np.linspace(0.1, 0.9, 9).round(1), (False, True))]
    return rules


def table(by_workload: dict[str, list[list[Situation]]], profile: CostProfile,
          fit: tuple[np.ndarray, np.ndarray] | None = None) -> list[str]:
    cost = CostModel(profile)
    target_only = Rule("target-only", min_previous=K + 1)
    lines = [f"{'workload':<8} {'static K (best)':>22} {'stop rules (best, bound)':>26} {'oracle':>8} "
             f"{'bound / oracle':>15}  best stop rule"]
    for workload, requests in sorted(by_workload.items()):
        base = speed(requests, target_only.slots, cost)
        static = {k: speed(requests, Rule(f"K={k}", static=k).slots, cost) / base for k in range(1, K + 1)}
        best_k = max(static, key=static.get)
        rules = {r.name: speed(requests, r.slots, cost) / base for r in stop_rules(requests, fit)}
        best_rule = max(rules, key=rules.get)
        oracle = speed(requests, oracle_slots, cost) / base
        lines.append(f"{workload:<8} {f'{static[best_k]:.3f}x (K={best_k})':>22} {rules[best_rule]:>25.3f}x "
                     f"{oracle:>7.3f}x {rules[best_rule] / oracle:>15.3f}  {best_rule}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--draft-scale", type=float, default=1.0,
                        help="price the drafter's forwards at this multiple of the profile's")
    parser.add_argument("--draft-vocab-size", type=int, default=PACKAGED_SPECULATIVE.draft_vocab_size or 0,
                        help="whose profile prices the drafter: the one with this vocabulary-subset head (the "
                             "packaged default's), 0: the full head's")
    args = parser.parse_args()
    key = profile_key(models_key("default", "default", "auto", args.draft_vocab_size or None))
    profile = cached_profile(key, packaged.cache_root() / PROFILE_FILE, True, K + 1, 1)
    if profile is None:
        parser.error(f"no cost profile cached for {key!r}: run `specav profile` first")
    if args.draft_scale != 1.0:
        d = profile.draft
        profile = replace(profile, draft=CostCurve(d.tokens, tuple(t * args.draft_scale for t in d.seconds),
                                                   d.per_context * args.draft_scale))
    print(f"cost profile: {key}" + (f", the drafter's forwards x {args.draft_scale}" if args.draft_scale != 1.0 else ""))
    one = profile.draft(1) / profile.verify(1)
    print(f"one drafter slot / one target token: {one:.2f}")
    print("tokens/s relative to target-only at concurrency 1, each logged step a situation (see --help)")
    by_workload, fit = situations_by_workload(args.logs)
    for line in table(by_workload, profile, fit):
        print(line)


if __name__ == "__main__":
    main()
