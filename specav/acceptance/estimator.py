"""The online acceptance estimator: confidence_i = sigmoid(omega * f + beta_i).

This module owns the K + 1 parameters (one slope omega shared by all positions, one
intercept beta_i per draft position i = 1..K), the O(K) sufficient statistics that
labelled slots add to, and the damped Newton (IRLS) refit that consumes them
(estimator.md). It must not know about models, drafters, the planner, the engine or
the server: it sees features `# [B, K]` and the counts of admitted and accepted slots.

Two modes (`EstimatorConfig.mode`, a registry below):
- pooled (the default): the arrowhead statistics are kept across refits. At each refit
  the pooled statistics are decayed by 0.5 ** (steps since the last refit / half_life),
  the interval's statistics are added, one damped Newton step d is taken on the sum, and
  the carried gradient is corrected to first order, g <- g - H d, so the old evidence
  stays consistent with the moved parameters. Memory and refit stay O(K). With a finite
  `change_z`, a refit whose new labels contradict the pooled fit (a calibration test, see
  `_changed`) drops the pooled statistics first, so a sudden change is followed within an
  interval or two while stationary traffic keeps a long memory.
  In both modes the Newton step is kept within a trust region (`trust_radius` and
  `slope_factor`, see `trusted`) before it is damped.
- windowed (the seed's, and vLLM's): one damped Newton step from the interval's
  statistics alone, which are then zeroed.

Refit schedule: every `refit_interval` decode steps; with `cold_start_labels` > 0 sooner
while labels are few: the first refit once that many labels are pending, each later one
once the pending labels equal the labels already fitted (the interval doubles in labels),
until `refit_interval` steps come first.

Defaults come from `EstimatorConfig` (docs/estimator.md gives the measurements behind them).

Precision and placement: parameters, statistics and confidences are float64 on the
estimator's `device` (default CPU; a keyword this module adds to the specified
constructor); inputs of any float dtype and device are converted.

Details estimator.md leaves open, decided here:
- Steps are counted per `observe` call, including calls with no labelled slot (B = 0
  or nothing admitted), so "every N decode steps" holds on an idle server too; a replay
  may let one call stand for several steps (`observe(..., steps=n)`, which refits at most
  once, after adding its slots).
- The ridge lambda is added to the Newton system only (A + lambda, c_i + lambda),
  not to the likelihood, so the fixed point is the unpenalised maximum likelihood fit.
- Damping uses the label counts the step is taken from: the interval's (windowed) or the
  decayed pooled counts (pooled). With n0 = 0, a position without labels gets factor 0.
- A refit with no pending labels takes no step (pooled statistics still decay). A skipped
  step (not finite, or the damped step would make omega negative) discards all statistics,
  pooled ones included, so one bad interval cannot poison the next.
- `merge` adds the other estimator's pending statistics (what it observed since its last
  refit); pooled statistics are history that synced replicas share, so they are not added.
- `state_dict` holds parameters, statistics and counters, not the config: the config
  belongs to the engine's configuration and is passed to the constructor. A state of the
  seed's format (no pooled statistics) loads with empty pooled statistics.
- `observe` ignores slots whose feature is not finite (NaN padding, +/-inf): they get
  no label. `score` clamps +/-inf to +/-clamp and returns NaN for NaN.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specav.config import EstimatorConfig

_DTYPE = torch.float64
# Rows of a statistics tensor # [6, K]: sums over labelled slots at position i of
_STATS = ("a", "b", "c", "g0", "g1", "n")  # w f^2, w f, w, r f, r, count  (w = p(1-p), r = y - p)
_MIN_TEST_WEIGHT = 10.0  # sum of p(1-p) per position, each side, before the change test uses it
STATE_FORMAT = 2  # state_dict layout: 1 = the seed's (no pooled statistics), 2 = this one


def survival(confidences: torch.Tensor) -> torch.Tensor:
    """P(slots 1..i all accepted): cumulative product along K.  # [B, K] -> [B, K]

    NaN (padding) propagates to every deeper slot, which is padding too.
    """
    return torch.cumprod(confidences, dim=-1)


@dataclass(frozen=True, slots=True)
class NewtonStep:
    """An undamped Newton step in (omega, beta_1..beta_K)."""

    slope: float
    intercepts: torch.Tensor  # [K] float64


def newton_step(statistics: torch.Tensor, ridge: float) -> NewtonStep:
    """Solve (H + ridge I) d = g for the arrowhead Hessian by Schur complement, in O(K).

    statistics: # [6, K] rows a, b, c, g0, g1, n (see `_STATS`).
    H = [[sum a, b^T], [b, diag(c)]], g = [sum g0, g1].
    """
    a, b, c, g0, g1, _ = statistics
    c_ridge = c + ridge
    schur = a.sum() + ridge - (b * b / c_ridge).sum()
    d_slope = (g0.sum() - (b * g1 / c_ridge).sum()) / schur
    d_intercepts = (g1 - b * d_slope) / c_ridge
    return NewtonStep(slope=float(d_slope), intercepts=d_intercepts)


def logit_change(statistics: torch.Tensor, d_slope: float, d_intercepts: torch.Tensor) -> float:
    """How far a step d moves the logits of the slots the statistics hold: the root mean square
    of d_omega * f + d_beta_i over them, weighted by p(1 - p), = sqrt(d^T H d / sum c). O(K)."""
    a, b, c, _, _, _ = statistics
    moved = (a * d_slope ** 2 + 2 * b * d_slope * d_intercepts + c * d_intercepts ** 2).sum()
    weight = float(c.sum())
    return math.sqrt(max(float(moved), 0.0) / weight) if weight > 0 else 0.0


def trusted(step: NewtonStep, statistics: torch.Tensor, slope: float, radius: float,
            slope_factor: float) -> NewtonStep:
    """The step scaled down (a trust region) so that it moves the slots' logits by at most
    `radius` (`logit_change`) and omega, now `slope`, by at most a factor `slope_factor` either way.

    The Newton step minimises a quadratic model of the log-likelihood built from p(1 - p) at the
    parameters the slots were scored with. Where most slots are sure (p near 1: code, whose drafts
    the target accepts 95% of the time), their curvature is nearly 0, and a few rejections ask for
    a step whose end the model cannot see: on the real pair's code traffic, omega from 1.3 to 0.1-
    0.3 (the maximum-likelihood fit of the same labels: 0.7-1.1), or below 0 (skipped, dropping the
    statistics), after which every slot was priced alike for the rest of the run (docs/estimator.md,
    "Near-separable traffic"). The weighted logit change cannot see those sure slots either (their
    weight is p(1 - p)); the factor on omega, the scale of the feature, does, and keeps it positive.
    Within both bounds the step is unchanged; inf turns a bound off."""
    scale = 1.0
    moved = logit_change(statistics, step.slope, step.intercepts) if math.isfinite(radius) else 0.0
    if math.isfinite(moved) and moved > radius:
        scale = radius / moved
    if math.isfinite(slope_factor) and slope > 0 and step.slope != 0:
        bound = slope * (slope_factor if step.slope > 0 else 1.0 / slope_factor)
        scale = min(scale, (bound - slope) / step.slope)
    if scale >= 1.0:
        return step
    return NewtonStep(step.slope * scale, step.intercepts * scale)


def corrected(statistics: torch.Tensor, d_slope: float, d_intercepts: torch.Tensor) -> torch.Tensor:
    """The statistics after the parameters moved by d: gradient g <- g - H d, H kept.  # [6, K]

    Per position i: g0_i -= a_i d_omega + b_i d_beta_i and g1_i -= b_i d_omega + c_i d_beta_i,
    whose sums are exactly g - H d for the arrowhead H (so merged sums stay exact).
    """
    a, b, c, g0, g1, n = statistics
    return torch.stack((a, b, c, g0 - a * d_slope - b * d_intercepts,
                        g1 - b * d_slope - c * d_intercepts, n))


class RefitOutcome(enum.StrEnum):
    APPLIED = "applied"
    NO_LABELS = "no_labels"  # nothing labelled since the last refit
    NON_FINITE = "non_finite"  # the Newton step is NaN or inf
    NEGATIVE_SLOPE = "negative_slope"  # the damped step would make omega < 0


@dataclass(frozen=True, slots=True)
class RefitResult:
    """What one refit did.

    num_labels*: the labels observed since the last refit; pooled_labels: the (decayed)
    label count the step was taken from (= num_labels in windowed mode).
    newton_*: the undamped step the statistics asked for; delta_*: what was added to the
    parameters (the step within the trust region, damped; or zeros when skipped).
    """

    outcome: RefitOutcome
    num_labels: int
    num_labels_per_slot: torch.Tensor  # [K] int64
    newton_slope: float
    newton_intercepts: torch.Tensor  # [K] float64
    delta_slope: float
    delta_intercepts: torch.Tensor  # [K] float64
    pooled_labels: float = 0.0

    @property
    def applied(self) -> bool:
        return self.outcome is RefitOutcome.APPLIED


@dataclass(frozen=True, slots=True)
class NextRefit:
    """When the next refit comes: after `steps` more decode steps, or as soon as `labels` more
    labelled slots are pending (inf: not before the steps), whichever is first."""

    steps: int
    labels: float


def _damping(count: torch.Tensor, n0: float) -> torch.Tensor:
    """n / (n + n0), and 0 where both are 0."""
    total = count + n0
    return torch.where(total > 0, count / total.clamp(min=1e-300), 0.0)


# ---- modes: what the statistics a step was taken from become afterwards -------------------------

def _keep_corrected(statistics: torch.Tensor, d_slope: float, d_intercepts: torch.Tensor) -> torch.Tensor:
    return corrected(statistics, d_slope, d_intercepts)


def _drop(statistics: torch.Tensor, d_slope: float, d_intercepts: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(statistics)


CARRY: dict[str, Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]] = {
    "pooled": _keep_corrected,
    "windowed": _drop,
}


class OnlineAcceptanceEstimator:
    """Confidence per slot from logit(q_max), calibrated online by damped IRLS.

    Usage per engine step: `score(features)` before planning, `observe(features,
    num_admitted, num_accepted)` after verification with the same features. Admitted
    slots are the first num_admitted[b] of each request (the planner admits by
    survival, which never increases along a request).
    """

    name = "online_estimator"
    feature = "logit_q_max"  # the slot feature it reads (lossless: computed from q_i alone)

    def __init__(self, num_slots: int, config: EstimatorConfig = EstimatorConfig(),
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots = {num_slots!r} is invalid: pass the number of draft "
                             "slots K (speculative num_speculative_tokens), an integer >= 1")
        self.config = config
        self.device = torch.device(device)
        self._num_slots = num_slots
        self._carry = CARRY[config.mode]
        self._slope = torch.tensor(float(config.init_slope), dtype=_DTYPE, device=self.device)
        self._intercepts = torch.full((num_slots,), float(config.init_intercept), dtype=_DTYPE,
                                      device=self.device)
        self._stats = torch.zeros(len(_STATS), num_slots, dtype=_DTYPE, device=self.device)
        self._pooled = torch.zeros_like(self._stats)
        self.labels_fitted = 0.0  # labels consumed by refits so far (not decayed): the cold-start clock
        self.steps_since_refit = 0
        self.total_steps = 0
        self.num_refits = 0
        self.num_skipped = 0
        self.num_changes = 0
        self.last_refit: RefitResult | None = None
        self.version = 0  # changes with the parameters (the Scorer protocol's `version`)

    # ---- parameters -------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slope(self) -> float:
        """omega, the shared slope."""
        return float(self._slope)

    @property
    def intercepts(self) -> torch.Tensor:
        """beta_1..beta_K.  # [K] float64 (a copy)"""
        return self._intercepts.clone()

    @property
    def statistics(self) -> dict[str, torch.Tensor]:
        """Pending sufficient statistics (since the last refit) by name, each # [K] (copies)."""
        return {k: v.clone() for k, v in zip(_STATS, self._stats)}

    @property
    def pooled_statistics(self) -> dict[str, torch.Tensor]:
        """Statistics carried from earlier refits (pooled mode; zeros when windowed), # [K] each."""
        return {k: v.clone() for k, v in zip(_STATS, self._pooled)}

    # ---- score ------------------------------------------------------------------

    def _features(self, features: torch.Tensor) -> torch.Tensor:
        """Validated features as float64 on the estimator's device, not yet clamped.  # [B, K]"""
        if not isinstance(features, torch.Tensor) or features.ndim != 2 \
                or features.shape[1] != self._num_slots:
            shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features)
            raise ValueError(f"features must be a [B, K] tensor with K = {self._num_slots} "
                             f"(NaN for undrafted slots), got {shape}")
        if not features.dtype.is_floating_point:
            raise ValueError(f"features must be a float tensor (logit(q_max)), got {features.dtype}")
        return features.to(device=self.device, dtype=_DTYPE)

    def _confidences(self, f: torch.Tensor) -> torch.Tensor:
        """sigmoid(omega * f + beta_i) for clamped features.  # [B, K] -> [B, K]"""
        return torch.sigmoid(torch.addcmul(self._intercepts, f, self._slope))

    def score(self, features: torch.Tensor) -> torch.Tensor:
        """Confidence per slot.  features # [B, K] logit(q_max) -> # [B, K] float64.

        +/-inf features are clamped to +/-feature_clamp; NaN (undrafted slot) gives NaN.
        """
        clamp = self.config.feature_clamp
        return self._confidences(self._features(features).clamp(-clamp, clamp))

    def survival(self, confidences: torch.Tensor) -> torch.Tensor:
        """Cumulative product of confidences along K.  # [B, K] -> [B, K]"""
        return survival(confidences)

    # ---- observe ----------------------------------------------------------------

    def _counts(self, counts: Any, what: str, batch: int) -> torch.Tensor:
        t = torch.as_tensor(counts, device=self.device)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
            raise ValueError(f"{what} must be integer counts per request, got dtype {t.dtype}; "
                             "pass an int64 tensor of shape [B]")
        if t.shape != (batch,):
            raise ValueError(f"{what} must have shape [B] = [{batch}] (one count per request "
                             f"of features [B, K]), got {tuple(t.shape)}")
        return t

    def _check_counts(self, num_admitted: list[int], num_accepted: list[int]) -> None:
        """0 <= num_accepted <= num_admitted <= K per request, else an error naming the requests."""
        k = self._num_slots
        rows = [b for b, (a, n) in enumerate(zip(num_admitted, num_accepted)) if n < 0 or n > a or a > k]
        if not rows:
            return
        admitted, accepted = [num_admitted[b] for b in rows], [num_accepted[b] for b in rows]
        if any(a > k for a in admitted):
            raise ValueError(f"num_admitted must lie in [0, K = {k}]; requests {rows} have {admitted}")
        raise ValueError(f"num_accepted must lie in [0, num_admitted] per request; requests "
                         f"{rows} violate it (num_accepted {accepted}, num_admitted {admitted})")

    def observe(self, features: torch.Tensor, num_admitted: torch.Tensor,
                num_accepted: torch.Tensor, *, steps: int = 1) -> None:
        """Add one step's labelled slots to the statistics; refit when the schedule says so.

        features: # [B, K], the same features that were scored; num_admitted: # [B] int,
        slots verified per request (a prefix); num_accepted: # [B] int, accepted among them.
        steps: decode steps this call stands for (a replay batches the steps of one interval,
        scored with the same parameters, into one call; see `next_refit`).
        """
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps = {steps!r} is invalid: allowed an integer >= 0 (decode steps "
                             "this call stands for; 1 for one engine step)")
        f = self._features(features)
        # The counts and features as Python numbers: each torch op costs tens of us on the caches a
        # forward left cold, and a step has a few labelled slots per request.
        admitted = self._counts(num_admitted, "num_admitted", f.shape[0]).tolist()
        accepted = self._counts(num_accepted, "num_accepted", f.shape[0]).tolist()
        labels = any(admitted) or any(accepted)  # else a step that verified no slot (most where drafts do not pay)
        if labels:
            self._check_counts(admitted, accepted)
            self._accumulate(f.tolist(), admitted, accepted)
        self.steps_since_refit += steps
        self.total_steps += steps
        # Pending labels grow only with labels, and a refit is taken as soon as they are due, so a
        # step without labels (most steps where drafts do not pay) can be due only by its count.
        if self.steps_since_refit >= self.config.refit_interval or (labels and self.next_refit().labels <= 0):
            self.refit()

    def _accumulate(self, f: list[list[float]], num_admitted: list[int], num_accepted: list[int]) -> None:
        """stats += sums over the labelled slots of their terms, at the current parameters.

        f: # [B, K]. Labels: slots 1..a accepted (1), slot a + 1 rejected (0) if admitted, the rest
        none; a slot whose feature is not finite gets none. A loop over the labelled slots only (a
        prefix of each request's, a few per request): cheaper than any array op on the few dozen
        values a step has, whose calls cost tens of us each on the caches a forward left cold.
        """
        clamp = self.config.feature_clamp
        slope, intercepts = float(self._slope), self._intercepts.tolist()
        sums = [[0.0] * self._num_slots for _ in _STATS]  # rows a, b, c, g0, g1, n
        a, b, c, g0, g1, n = sums
        for row, admitted, accepted in zip(f, num_admitted, num_accepted):
            for i in range(min(accepted + 1, admitted)):
                x = row[i]
                if not math.isfinite(x):
                    continue
                x = min(max(x, -clamp), clamp)
                z = intercepts[i] + slope * x
                p = 1.0 / (1.0 + math.exp(-z)) if z > -700.0 else 0.0
                w, r = p - p * p, (1.0 if i < accepted else 0.0) - p
                a[i] += w * x * x
                b[i] += w * x
                c[i] += w
                g0[i] += r * x
                g1[i] += r
                n[i] += 1.0
        self._stats += torch.tensor(sums, dtype=_DTYPE, device=self.device)

    # ---- schedule and refit -----------------------------------------------------------

    def next_refit(self) -> NextRefit:
        """Steps and pending labels still to come before the next refit (see the module doc)."""
        steps = self.config.refit_interval - self.steps_since_refit
        first = self.config.cold_start_labels
        if first == 0:
            return NextRefit(steps, math.inf)
        pending = float(self._stats[5].sum())
        return NextRefit(steps, max(float(first), self.labels_fitted) - pending)

    def _decay(self) -> float:
        """Forgetting factor for the pooled statistics over the steps since the last refit."""
        return 0.5 ** (self.steps_since_refit / self.config.half_life)

    def refit(self) -> RefitResult:
        """Take one damped Newton step from the statistics; pool or zero them by mode."""
        pending = self._stats[5]
        n_pending = float(pending.sum())
        pooled = self._pooled * self._decay()
        if self._changed(pooled):
            pooled = torch.zeros_like(pooled)
            self.num_changes += 1
        stats = pooled + self._stats
        counts = stats[5]
        n = float(counts.sum())
        step = newton_step(stats, self.config.ridge)
        region = trusted(step, stats, self.slope, self.config.trust_radius, self.config.slope_factor)
        outcome, d_slope, d_intercepts = self._damped(region, counts, n, n_pending)
        if outcome is RefitOutcome.APPLIED:
            self._slope += d_slope
            self._intercepts += d_intercepts
            self.version += 1
            self._pooled = self._carry(stats, d_slope, d_intercepts)
        elif outcome is RefitOutcome.NO_LABELS:
            self._pooled = self._carry(stats, 0.0, torch.zeros_like(self._intercepts))
        else:
            self.num_skipped += 1
            self._pooled = torch.zeros_like(self._pooled)
        if outcome is not RefitOutcome.APPLIED:
            d_slope, d_intercepts = 0.0, torch.zeros_like(self._intercepts)
        result = RefitResult(outcome, int(round(n_pending)), pending.round().long(), step.slope,
                             step.intercepts, d_slope, d_intercepts, n)
        self.labels_fitted += n_pending
        self._stats.zero_()
        self.steps_since_refit = 0
        self.num_refits += 1
        self.last_refit = result
        return result

    def _changed(self, pooled: torch.Tensor) -> bool:
        """Do the pending labels contradict the pooled fit? (pooled mode; see the module doc)

        Per position i, a two-sample test of calibration: the interval's mean residual
        g1_i / c_i against the pool's G1_i / C_i (zero once a full step has been taken), both
        at the current parameters, z_i = (g1_i / c_i - G1_i / C_i) / sqrt(1 / c_i + 1 / C_i).
        sum z_i^2 ~ chi^2 with one degree of freedom per position whose weight (sum of p(1-p))
        is at least _MIN_TEST_WEIGHT on both sides, so the normal approximation holds (no test
        in the first refits of a cold start); a change is declared above dof + change_z *
        sqrt(2 dof). O(K).
        """
        z = self.config.change_z
        if not math.isfinite(z):
            return False
        c, g1, big_c, big_g1 = self._stats[2], self._stats[4], pooled[2], pooled[4]
        used = (c >= _MIN_TEST_WEIGHT) & (big_c >= _MIN_TEST_WEIGHT)
        dof = int(used.sum())
        if dof == 0:
            return False
        c, g1, big_c, big_g1 = c[used], g1[used], big_c[used], big_g1[used]
        stat = ((g1 - c * big_g1 / big_c) ** 2 / (c * (1 + c / big_c))).sum()
        return bool(stat > dof + z * math.sqrt(2 * dof))

    def _damped(self, step: NewtonStep, counts: torch.Tensor, n: float, n_pending: float
                ) -> tuple[RefitOutcome, float, torch.Tensor]:
        n0 = self.config.damping_n0
        d_slope = step.slope * (n / (n + n0) if n + n0 > 0 else 0.0)
        d_intercepts = step.intercepts * _damping(counts, n0)
        if n_pending == 0:
            return RefitOutcome.NO_LABELS, d_slope, d_intercepts
        if not (math.isfinite(d_slope) and bool(torch.isfinite(d_intercepts).all())):
            return RefitOutcome.NON_FINITE, d_slope, d_intercepts
        if self.slope + d_slope < 0:
            return RefitOutcome.NEGATIVE_SLOPE, d_slope, d_intercepts
        return RefitOutcome.APPLIED, d_slope, d_intercepts

    # ---- merge and state --------------------------------------------------------

    def merge(self, other: "OnlineAcceptanceEstimator") -> None:
        """Add another estimator's pending statistics to this one's (replicas, shards).

        Both must have the same K and exactly the same parameters: the statistics are a
        Taylor expansion at the parameters that produced them, and sums taken at different
        points describe no single Newton step. Only statistics pending since the last refit
        are added: pooled statistics are the history replicas share after a sync (load one
        state_dict into all after each refit). Replicas should not refit on their own
        (refit_interval large, cold_start_labels 0); the one that merges calls `refit()`.
        Step counters are not added.
        """
        if other.num_slots != self._num_slots:
            raise ValueError(f"cannot merge an estimator with K = {other.num_slots} into one with "
                             f"K = {self._num_slots}: statistics are per draft position")
        same = torch.equal(other._slope.to(self.device), self._slope) and \
            torch.equal(other._intercepts.to(self.device), self._intercepts)
        if not same:
            raise ValueError(
                "cannot merge statistics collected at different parameters (slope "
                f"{other.slope} vs {self.slope}, intercepts {other.intercepts.tolist()} vs "
                f"{self.intercepts.tolist()}): each sum is evaluated at the parameters that "
                "produced its confidences. Keep replicas in sync (load one state_dict into all "
                "after each refit) and merge before refitting.")
        self._stats += other._stats.to(self.device)

    def state_dict(self) -> dict[str, Any]:
        """Parameters, statistics and counters as plain values and tensors (copies)."""
        return {
            "format": STATE_FORMAT,
            "num_slots": self._num_slots,
            "slope": self._slope.clone(),
            "intercepts": self._intercepts.clone(),
            "statistics": self._stats.clone(),
            "pooled_statistics": self._pooled.clone(),
            "labels_fitted": self.labels_fitted,
            "steps_since_refit": self.steps_since_refit,
            "total_steps": self.total_steps,
            "num_refits": self.num_refits,
            "num_skipped": self.num_skipped,
            "num_changes": self.num_changes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (same K required); the seed's format loads too.

        A seed-format state has no pooled statistics (they start empty) and no cold-start
        clock: if it has refitted at all, its estimator counts as warm (no cold-start refits).
        """
        state = _upgraded(state)
        if state["num_slots"] != self._num_slots:
            raise ValueError(f"state has num_slots = {state['num_slots']!r} but this estimator "
                             f"has K = {self._num_slots}; build it with the state's num_slots")
        shape = (len(_STATS), self._num_slots)
        expected = {"slope": (), "intercepts": (self._num_slots,), "statistics": shape,
                    "pooled_statistics": shape}
        tensors = {}
        for key, want in expected.items():
            value = torch.as_tensor(state[key])
            if tuple(value.shape) != want:
                raise ValueError(f"state[{key!r}] has shape {tuple(value.shape)}, expected {want}")
            tensors[key] = value.to(self.device, _DTYPE).clone()
        self._slope, self._intercepts = tensors["slope"], tensors["intercepts"]
        self.version += 1
        self._stats, self._pooled = tensors["statistics"], tensors["pooled_statistics"]
        self.labels_fitted = float(state["labels_fitted"])
        for key in ("steps_since_refit", "total_steps", "num_refits", "num_skipped", "num_changes"):
            setattr(self, key, int(state[key]))


_SEED_KEYS = ("num_slots", "slope", "intercepts", "statistics", "steps_since_refit", "total_steps",
              "num_refits", "num_skipped")


def _upgraded(state: dict[str, Any]) -> dict[str, Any]:
    """A state in the current format: seed-format (format 1) states gain empty pooled statistics."""
    if not isinstance(state, dict):
        raise ValueError(f"state must be the dict that state_dict() returned, got {type(state).__name__}")
    version = state.get("format", 1)
    if version not in (1, STATE_FORMAT):
        raise ValueError(f"state has format {version!r}; this estimator reads formats 1 (the seed's) "
                         f"and {STATE_FORMAT}: save it again with a matching specav version")
    added = ("pooled_statistics", "labels_fitted", "num_changes")
    keys = _SEED_KEYS + (added if version == STATE_FORMAT else ())
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"state (format {version}) lacks {missing}; pass what state_dict() returned")
    if version == STATE_FORMAT:
        return state
    statistics = torch.as_tensor(state["statistics"])
    warm = int(state["num_refits"]) > 0
    return {**state, "pooled_statistics": torch.zeros_like(statistics, dtype=_DTYPE),
            "labels_fitted": math.inf if warm else 0.0, "num_changes": 0, "format": STATE_FORMAT}
