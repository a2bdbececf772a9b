"""Server metrics (Prometheus): what speculation does, how well the estimator is calibrated, how fast requests go.

Owns: one CollectorRegistry per server (no process-wide state), filled from two sources:

    steps      a step listener on the engine (`engine.step_listeners`), called on the engine thread
               with each StepRecord: slots drafted / admitted / trimmed / accepted, acceptance per
               position and mean acceptance length, step time and batch size, and the online
               calibration figure: mean confidence against observed acceptance over the last
               `window` labelled slots (labels as estimator.md defines them, from the requests that
               teach the estimator: none with per-request logit transforms);
    requests   the HTTP handlers: time to first token, inter-token latency (per token after the
               first output: the gap between two outputs divided by the tokens the later one
               brought), request latency, finish reasons, prompt and generated tokens.

The estimator's slope and intercepts are read from `engine.scorer` when it is the online
estimator (anything with `slope` and `intercepts`), after every step. Gauges are cumulative
since the server started unless their help says otherwise. Step records reach this module as
plain numbers (engine/step_summary.py): the server never touches tensors.

Must not know: HTTP, the OpenAI formats, tensors.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specav.engine.step_summary import StepSummary, estimator_parameters, summarize
from specav.types import StepRecord

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    def __init__(self, num_slots: int, scorer=None, window: int = 2000) -> None:
        self.registry = r = CollectorRegistry()
        self.num_slots = num_slots
        self.scorer = scorer
        self.window = window
        self._calibration: deque[tuple[float, int, int]] = deque()  # per step: (sum confidence, accepted, slots)
        self._reached = [0] * num_slots  # per position, summed over steps
        self._accepted_at = [0] * num_slots
        self._request_steps = 0
        self._accepted = 0

        self.steps = Counter("specav_steps", "Engine steps", registry=r)
        self.drafted = Counter("specav_slots_drafted", "Slots drafted", registry=r)
        self.admitted = Counter("specav_slots_admitted", "Drafted slots admitted for verification", registry=r)
        self.trimmed = Counter("specav_slots_trimmed", "Drafted slots the planner did not verify", registry=r)
        self.accepted = Counter("specav_slots_accepted", "Admitted slots the rejection sampler kept", registry=r)
        self.acceptance = Gauge("specav_acceptance_rate", "Acceptance rate of slot i among slots verified with "
                                "slots 1..i-1 accepted", ["position"], registry=r)
        self.acceptance_length = Gauge("specav_mean_acceptance_length",
                                       "Tokens per request per step (accepted draft tokens + 1)", registry=r)
        self.slope = Gauge("specav_estimator_slope", "The online estimator's shared slope omega", registry=r)
        self.intercept = Gauge("specav_estimator_intercept", "The online estimator's intercept beta_i",
                               ["position"], registry=r)
        self.estimator_steps = Gauge("specav_estimator_observed_steps",
                                     "Steps the estimator has observed (its total_steps)", registry=r)
        self.mean_confidence = Gauge("specav_calibration_mean_confidence",
                                     "Mean confidence of the last labelled slots (window)", registry=r)
        self.observed_acceptance = Gauge("specav_calibration_observed_acceptance",
                                         "Observed acceptance of the same labelled slots (window)", registry=r)
        self.calibration_slots = Gauge("specav_calibration_window_slots", "Labelled slots in the calibration "
                                       "window", registry=r)
        self.step_seconds = Histogram("specav_step_seconds", "Engine step time, plan to observe",
                                      buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("specav_batch_size", "Requests per engine step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.queue_depth = Gauge("specav_queue_depth", "Requests waiting for a place in the batch", registry=r)
        self.running = Gauge("specav_running_requests", "Requests in the running batch", registry=r)
        self.latency = Histogram("specav_request_latency_seconds", "Arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specav_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specav_inter_token_latency_seconds", "Seconds per token after the first",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("specav_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("specav_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specav_generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.refused = Counter("specav_refused_requests", "Requests answered with an error status",
                               ["status"], registry=r)
        self._read_estimator()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the engine thread ------------------------------------------------------------------

    def on_step(self, record: StepRecord) -> None:
        """A step listener: call with each StepRecord (on the engine thread)."""
        step = summarize(record, self.num_slots)
        self.steps.inc()
        self.drafted.inc(step.drafted)
        self.admitted.inc(step.admitted)
        self.trimmed.inc(step.drafted - step.admitted)
        self.accepted.inc(step.accepted)
        self.step_seconds.observe(step.seconds)
        self.batch_size.observe(step.batch_size)
        self._request_steps += step.batch_size
        self._accepted += step.accepted
        self.acceptance_length.set((self._accepted + self._request_steps) / self._request_steps)
        for i, (reached, accepted) in enumerate(zip(step.reached, step.accepted_at)):
            self._reached[i] += reached
            self._accepted_at[i] += accepted
            if self._reached[i]:
                self.acceptance.labels(position=str(i + 1)).set(self._accepted_at[i] / self._reached[i])
        if step.labelled:
            self._calibrate(step)
        self._read_estimator()

    def on_queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def _calibrate(self, step: StepSummary) -> None:
        """Keep the last `window` labelled slots (whole steps) and publish their two means."""
        self._calibration.append((step.labelled_confidence, step.labelled_accepted, step.labelled))
        total = sum(n for _, _, n in self._calibration)
        while total - self._calibration[0][2] >= self.window:
            total -= self._calibration.popleft()[2]
        self.mean_confidence.set(sum(c for c, _, _ in self._calibration) / total)
        self.observed_acceptance.set(sum(y for _, y, _ in self._calibration) / total)
        self.calibration_slots.set(total)

    def _read_estimator(self) -> None:
        params = estimator_parameters(self.scorer)
        if params is None:
            return
        self.slope.set(params.slope)
        for i, beta in enumerate(params.intercepts, start=1):
            self.intercept.labels(position=str(i)).set(beta)
        self.estimator_steps.set(params.observed_steps)

    # ---- the handlers -------------------------------------------------------------------------

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_tokens(self, gap: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(gap / tokens)

    def on_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.latency.observe(seconds)
