"""Configuration: frozen, validated dataclasses for every part of the engine.

Each config checks itself on construction and raises `ConfigError` naming the field,
the bad value and what is allowed. CLI flags and the server's JSON are parsed into
these; nothing else in the package holds defaults of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range.

    field: what is at fault, "<config>.<field>" (e.g. "SamplingParams.top_p") or "<config>" for
    unknown keys, so a front end can name its own flag or JSON key for it.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _check(ok: bool, where: str, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{where}.{name} = {value!r} is invalid: allowed {allowed}", f"{where}.{name}")


def _from_mapping(cls, data: Mapping[str, Any], where: str):
    """Build a config dataclass from a mapping, rejecting unknown keys by name."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}", where)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed keys are {sorted(names)}", where)
    return cls(**data)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling, with vLLM's names. temperature 0 means greedy; top_k 0 and top_p 1 mean
    no truncation.

    presence_penalty, frequency_penalty: OpenAI's penalties on the tokens generated so far (not
        the prompt): logit[v] -= frequency_penalty * count[v] + presence_penalty * (count[v] > 0).
    logit_bias: {token id: bias} added to the logits (OpenAI's range, [-100, 100]).
    logprobs: None, or how many most likely tokens to report beside each generated token's own
        log-probability (0: only its own), from the target's raw logits (vLLM's default mode).
    Penalties and logit_bias apply to the drafter's and the target's logits alike (lossless);
    requests that carry them are left out of the online estimator's statistics.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a {token id: bias} mapping is accepted and sorted
    logprobs: int | None = None

    def __post_init__(self) -> None:
        w = "SamplingParams"
        _check(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0, w,
               "temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        _check(_is_int(self.top_k) and self.top_k >= 0, w, "top_k", self.top_k, "an integer >= 0 (0 = off)")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, w, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, w, "max_tokens",
               self.max_tokens, "an integer >= 1")
        _check(self.seed is None or _is_int(self.seed), w, "seed", self.seed, "an integer or null")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check(isinstance(stop, (tuple, list)), w, "stop", self.stop, "a string or a list of strings")
        object.__setattr__(self, "stop", tuple(stop))
        _check(all(isinstance(s, str) and s for s in self.stop), w, "stop", self.stop,
               "non-empty strings")
        _check(isinstance(self.ignore_eos, bool), w, "ignore_eos", self.ignore_eos, "true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, w, name, value, "a number in [-2, 2]")
        object.__setattr__(self, "logit_bias", self._normalised_bias(w))
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), w,
               "logprobs", self.logprobs, f"null or an integer in [0, {MAX_LOGPROBS}]")

    def _normalised_bias(self, w: str) -> tuple[tuple[int, float], ...]:
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, Mapping) else bias
        _check(isinstance(items, (tuple, list, type({}.items()))), w, "logit_bias", bias,
               "a mapping of token ids to numbers")
        out = {}
        for pair in items:
            ok = isinstance(pair, (tuple, list)) and len(pair) == 2
            token, value = pair if ok else (None, None)
            if isinstance(token, str) and token.strip().lstrip("-").isdigit():
                token = int(token)  # JSON object keys are strings
            _check(ok and _is_int(token) and token >= 0, w, "logit_bias", bias,
                   "token ids that are integers >= 0")
            _check(_is_number(value) and -100 <= value <= 100, w, f"logit_bias[{token}]", value,
                   "a number in [-100, 100]")
            out[int(token)] = float(value)
        return tuple(sorted(out.items()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def has_transforms(self) -> bool:
        """Whether this request changes the model's logits itself (penalties, logit_bias): its
        acceptance outcomes are not representative of other traffic."""
        return self.has_penalties or bool(self.logit_bias)


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


DRAFT_METHODS = ("draft_model",)
DRAFT_SAMPLE_METHODS = ("probabilistic",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM-style speculative config, e.g. the JSON of `--speculative-config`.

    model: drafter checkpoint (local HF directory, GGUF file, or "default" for the packaged drafter).
    draft_vocab_size: the drafter's output head computes only this many of the most frequent
    tokens (ranked once, offline: specav/models/vocab_ranking.py), q = 0 for the rest; null (the
    dataclass default, for any drafter) = the full vocabulary. The packaged default
    (PACKAGED_SPECULATIVE) runs 65536 on the packaged drafter: its forward 0.86x the full head's,
    its acceptance 98-100%, faster on code, chat and prose (docs/quantized.md). Lossless either
    way: rejection sampling uses the q the drafts were sampled from.
    """

    model: str = "default"
    method: str = "draft_model"
    num_speculative_tokens: int = 4
    draft_sample_method: str = "probabilistic"
    enable_adaptive_verification: bool = False
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        w = "speculative_config"
        _check(isinstance(self.model, str) and bool(self.model), w, "model", self.model,
               "a local checkpoint path or 'default'")
        _check(self.method in DRAFT_METHODS, w, "method", self.method, f"one of {DRAFT_METHODS}")
        _check(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 32,
               w, "num_speculative_tokens", self.num_speculative_tokens, "an integer in [1, 32]")
        _check(self.draft_sample_method in DRAFT_SAMPLE_METHODS, w, "draft_sample_method",
               self.draft_sample_method, f"one of {DRAFT_SAMPLE_METHODS}")
        _check(isinstance(self.enable_adaptive_verification, bool), w,
               "enable_adaptive_verification", self.enable_adaptive_verification, "true or false")
        _check(self.draft_vocab_size is None or (isinstance(self.draft_vocab_size, int) and
                                                 not isinstance(self.draft_vocab_size, bool) and
                                                 self.draft_vocab_size >= 1),
               w, "draft_vocab_size", self.draft_vocab_size, "an integer >= 1 or null (the full head)")

    @property
    def planner(self) -> str:
        """The planner registry's key (verification.planner.PLANNERS) this config selects."""
        return "adaptive" if self.enable_adaptive_verification else "static"

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> "SpeculativeConfig":
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON ({e}): {text!r}",
                                  "speculative_config") from None
        return _from_mapping(cls, text, "speculative_config")


# What `specav generate | serve` and `specav.LLM` run when no speculative config is given: the
# packaged drafter with adaptive verification, drafting up to 8 slots where drafts pay (measured
# against static K and target-only in docs/adaptive.md), its head over the 65536 most frequent
# tokens (docs/quantized.md, "The drafter's vocabulary-subset head"). A config given explicitly
# takes the dataclass defaults for the fields it leaves out (static K = 4 unless it turns AV on,
# the full head), as vLLM's.
PACKAGED_SPECULATIVE = SpeculativeConfig(num_speculative_tokens=8, enable_adaptive_verification=True,
                                         draft_vocab_size=65536)


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    """Online acceptance estimator (estimator.md; docs/estimator.md says how defaults were measured).

    mode: "pooled" (default) keeps the arrowhead statistics across refits, decayed with a
    half-life of `half_life` decode steps, the carried gradient corrected after each step
    (g <- g - H d); "windowed" is the seed's: one Newton step per interval from that
    interval's statistics alone, then they are zeroed (`half_life` unused).
    refit_interval: decode steps between refits once warm. cold_start_labels: the first
    refit comes as soon as this many labels are pending, later ones as soon as the pending
    labels equal those already fitted (the interval doubles in labels) until refit_interval
    steps come first; 0 refits every refit_interval steps from the start.
    change_z (pooled): when the labels of an interval contradict the pooled fit, beyond
    chi^2 dof + change_z * sqrt(2 dof) for the per-position calibration statistic, the pooled
    statistics are dropped before the step (a detected change); inf turns the test off.
    trust_radius: a Newton step is scaled down, before damping, so that it moves the logits of
    the slots its statistics hold by at most this much in p(1 - p)-weighted root mean square
    (the region where the quadratic model of the log-likelihood holds); inf turns it off.
    slope_factor: ... and so that omega changes by at most this factor either way (the weighted
    logit change cannot see sure slots, whose weight is ~0); inf turns it off.
    damping_n0: omega moves by n / (n + n0) of its Newton step, beta_i by n_i / (n_i + n0).
    ridge: added to the Newton system's diagonal only. feature_clamp: f clamped to +/- this.
    init_slope, init_intercept: the parameters before any label (a loaded state replaces
    them); 1 and 0 make the unfitted estimator equal raw q_max, which works for any pair (the
    packaged pair's own fit, 0.68 and -0.06, measured no better than 0.001 in AUC or log-loss).
    `EstimatorConfig.seed_windowed()` is the seed's configuration, which reproduces its
    published behaviour.
    """

    MODES: ClassVar[tuple[str, ...]] = ("pooled", "windowed")

    mode: str = "pooled"
    refit_interval: int = 100
    half_life: float = 4000.0
    cold_start_labels: int = 16
    change_z: float = 6.0
    trust_radius: float = 1.0
    slope_factor: float = 2.0
    damping_n0: float = 50.0
    ridge: float = 1e-3
    feature_clamp: float = 40.0
    init_slope: float = 1.0
    init_intercept: float = 0.0

    def __post_init__(self) -> None:
        w = "estimator"
        _check(self.mode in self.MODES, w, "mode", self.mode, f"one of {self.MODES}")
        _check(isinstance(self.refit_interval, int) and self.refit_interval >= 1, w,
               "refit_interval", self.refit_interval, "an integer >= 1")
        def positive(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0

        _check(positive(self.half_life), w, "half_life", self.half_life,
               "a number of decode steps > 0 (inf: never forget)")
        _check(isinstance(self.cold_start_labels, int) and not isinstance(self.cold_start_labels, bool)
               and self.cold_start_labels >= 0, w, "cold_start_labels", self.cold_start_labels,
               "an integer >= 0 (0: off)")
        _check(positive(self.change_z), w, "change_z", self.change_z, "a number > 0 (inf: off)")
        _check(positive(self.trust_radius), w, "trust_radius", self.trust_radius, "a number > 0 (inf: off)")
        _check(isinstance(self.slope_factor, (int, float)) and not isinstance(self.slope_factor, bool)
               and self.slope_factor > 1, w, "slope_factor", self.slope_factor, "a number > 1 (inf: off)")
        _check(self.damping_n0 >= 0, w, "damping_n0", self.damping_n0, "a number >= 0")
        _check(self.ridge > 0, w, "ridge", self.ridge, "a number > 0")
        _check(self.feature_clamp > 0, w, "feature_clamp", self.feature_clamp, "a number > 0")
        _check(math.isfinite(self.init_slope) and self.init_slope >= 0, w, "init_slope",
               self.init_slope, "a finite number >= 0")
        _check(math.isfinite(self.init_intercept), w, "init_intercept", self.init_intercept,
               "a finite number")

    @classmethod
    def seed_windowed(cls, **overrides: Any) -> "EstimatorConfig":
        """The seed's estimator: windowed, no cold-start schedule, no trust region, starting at raw q_max."""
        values = {"mode": "windowed", "cold_start_labels": 0, "trust_radius": math.inf,
                  "slope_factor": math.inf, "init_slope": 1.0,
                  "init_intercept": 0.0, **overrides}
        return cls(**values)


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """Adaptive verification: how the planner drafts, trims and explores (verification/adaptive.py).

    exploration: the share of compute spent exploring, on average. Each step every request, with
        a probability drawn from the planner's own generator (never from the drafts), drafts its
        whole block and has all of it verified, so deep positions keep getting labels while
        trimming is aggressive. The probability is set per step from the cost model so that
        exploring costs this share of the step's time whatever the concurrency (one exploring
        request makes the whole batch wait for K drafter forwards). Default 0.01 (1%).
    probe_interval: steps a request that decided not to draft waits before it drafts one slot
        again to see whether drafting pays now; each probe that does not pay doubles the wait, up
        to max_probe_interval. Defaults 8 and 64 (a probe costs a drafter forward over the skipped
        tokens plus a slot; at 64 steps a request that turned predictable waits at most ~2 s on
        this project's CPUs).
    probe_share: the share of compute learning may spend: probes and the cold start's block. A
        probe makes the drafter catch up on every token the request skipped, so they are paid
        from a budget that grows by this share of each step's measured time; a due probe (or the
        cold start) waits while the budget is in debt, and out of debt pays its whole price, so
        learning spends this share and one price more (a probe the traffic says pays is no
        learning: verification/adaptive.py runs it outside the budget). Default 0.005 (0.5%):
        where nothing drafts, what AV costs beside target-only decoding must stay under 2% in
        all, and at 0.01 probes took about 1.2% of it on chat at concurrency 1 (a probe's
        catch-up of a refused request's prompt is ~70 drafter tokens); at 0.02, all of it.
    min_speedup: the least speed-up over target-only decoding that drafting must be predicted to
        bring before AV drafts (the floor of the price of compute, as a multiple of the target-only
        rate). Above 1 because predictions err: on the packaged pair, drafting steps' times were
        predicted within 2-5% and their accepted tokens within 1-8%, and drafts predicted to just
        break even ran 10% slower than target-only (chat at concurrency 1). Default 1.05.
    control_share: the share of steps in which the whole batch decodes target-only (drawn from the
        planner's generator, never from the drafts), so the cost model keeps measuring the
        target-only step that prices every rule even while every request drafts. Default 0.02 (2%
        of steps; where drafting pays 1.3x it costs about 0.5% of the rate).
    rate_halflife: steps, half-life of each request's measured speed-up over target-only
        decoding; their mean over a step's requests prices a second of compute (the planner's
        lambda). Default 16.
    cost_halflife: steps, half-life of the level of the cost model's online correction (each
        model's measured / profiled time: a thermal change or a noisy neighbour is followed within
        a few half-lives). Default 8.
    cost_shape_halflife: observations of a profiled token count, half-life of the shape of the
        online correction (what the level leaves unexplained at that count: a start-up profile's
        wrong shape, learnt more slowly than the drift). Default 32.
    cold_start_after: tokens a request emits (target-only) before it may draft the cold start's
        block, the one block whose features stand for all traffic until more is drafted. The first
        tokens of an answer are its least predictable: on the packaged pair the cold start's block,
        drafted at an answer's first token, had 0 or 1 of 8 slots accepted on code, where static
        K = 4 keeps about 85% of its slots, and the features of that one block refused every
        request's entry (docs/adaptive.md). Default 16; 0 drafts it at once.
    check_halflife: decisions, half-life of the first-slot check. Before a request drafts, its
        slot 1 is predicted from its past blocks, and the rule drafts where that prediction is
        high, so the slot it then drafts is on average less sure than predicted (regression to the
        mean under selection: on prose at concurrency 1 the rule drafted 132 slots of which 57%
        were accepted, at a loss). The planner keeps the ratio of what the drafted slot 1 turned out
        to be (its confidence from its own feature, calibrated by the estimator) to what was
        predicted, over its recent draft-rule decisions, and scales its predictions of blocks by it.
        Default 64; 0 turns the check off (the ratio stays 1).
    seed: seed of the exploration generator.
    """

    exploration: float = 0.01
    probe_interval: int = 8
    max_probe_interval: int = 64
    probe_share: float = 0.005
    min_speedup: float = 1.05
    control_share: float = 0.02
    rate_halflife: float = 16.0
    cost_halflife: float = 8.0
    cost_shape_halflife: float = 32.0
    cold_start_after: int = 16
    check_halflife: float = 64.0
    seed: int = 0

    def __post_init__(self) -> None:
        w = "adaptive"
        _check(isinstance(self.exploration, (int, float)) and math.isfinite(self.exploration)
               and self.exploration >= 0, w, "exploration", self.exploration,
               "a share of compute >= 0 (0.01 = 1%)")
        _check(isinstance(self.probe_share, (int, float)) and math.isfinite(self.probe_share)
               and self.probe_share >= 0, w, "probe_share", self.probe_share, "a share of compute >= 0 (0.01 = 1%)")
        _check(isinstance(self.min_speedup, (int, float)) and math.isfinite(self.min_speedup)
               and self.min_speedup >= 1, w, "min_speedup", self.min_speedup, "a speed-up >= 1 (1.05 = 5%)")
        _check(isinstance(self.control_share, (int, float)) and math.isfinite(self.control_share)
               and 0 <= self.control_share <= 1, w, "control_share", self.control_share,
               "a share of steps in [0, 1] (0.02 = 2%)")
        _check(isinstance(self.probe_interval, int) and self.probe_interval >= 1, w, "probe_interval",
               self.probe_interval, "an integer >= 1")
        _check(isinstance(self.cold_start_after, int) and self.cold_start_after >= 0, w, "cold_start_after",
               self.cold_start_after, "a number of tokens >= 0")
        _check(isinstance(self.max_probe_interval, int) and self.max_probe_interval >= self.probe_interval, w,
               "max_probe_interval", self.max_probe_interval, f"an integer >= probe_interval ({self.probe_interval})")
        for name in ("rate_halflife", "cost_halflife", "cost_shape_halflife"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, w, name, value,
                   "a number of steps > 0")
        _check(isinstance(self.check_halflife, (int, float)) and not math.isnan(self.check_halflife)
               and self.check_halflife >= 0, w, "check_halflife", self.check_halflife,
               "a number of decisions >= 0 (0: no check)")
        _check(isinstance(self.seed, int), w, "seed", self.seed, "an integer")


DTYPES = ("bf16", "fp32", "q4", "auto")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which checkpoint to load and at what precision.

    path: local HF directory (safetensors), a local .gguf file, or "default" for the packaged target.
    dtype: "auto" (the default: on a GGUF file, including the packaged pair, the fastest
    kernel per layer and row count, measured once per machine, which may quantise activations
    to int8; on a dense HF directory, bf16), "bf16" (the exact reference, matching
    transformers), "fp32" (float32 on the same weights), or "q4" (a GGUF file's quantized
    weights on torch's kernels: 4-bit types keep their exact codes, the others are requantised
    to int8 per row; float32 activations).
    Speculative decoding is lossless with respect to whichever target precision runs.
    """

    path: str = "default"
    dtype: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.path, str) and bool(self.path), "model", "path", self.path,
               "a local checkpoint path or 'default'")
        _check(self.dtype in DTYPES, "model", "dtype", self.dtype, f"one of {DTYPES}")
        _check(self.threads is None or (isinstance(self.threads, int) and self.threads >= 1),
               "model", "threads", self.threads, "an integer >= 1 or null")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The whole engine: target, speculation, estimator, adaptive verification, and batch limits."""

    target: ModelConfig = field(default_factory=ModelConfig)
    speculative: SpeculativeConfig | None = field(default_factory=SpeculativeConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    max_batch_size: int = 16

    def __post_init__(self) -> None:
        _check(isinstance(self.max_batch_size, int) and self.max_batch_size >= 1, "engine",
               "max_batch_size", self.max_batch_size, "an integer >= 1")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """`specav serve`: where it listens, what it calls the model, who may use it, how much it queues.

    served_model_name: names clients pass as `model` (empty: the model argument itself).
    api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`.
    max_queued_requests: requests that may wait for a place in the running batch (max_num_seqs);
        beyond them a request is answered 429. Default 64.
    estimator_state: a file the online estimator's state is restored from on start (when it
        exists) and saved to on shutdown (SIGTERM, SIGINT).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: tuple[str, ...] = ()
    api_key: str | None = None
    max_queued_requests: int = 64
    estimator_state: str | None = None

    def __post_init__(self) -> None:
        w = "server"
        _check(isinstance(self.host, str) and bool(self.host), w, "host", self.host, "a host name or address")
        _check(_is_int(self.port) and 0 <= self.port <= 65535, w, "port", self.port,
               "an integer in [0, 65535] (0: any free port)")
        names = (self.served_model_name,) if isinstance(self.served_model_name, str) else self.served_model_name
        object.__setattr__(self, "served_model_name", tuple(names or ()))
        _check(all(isinstance(n, str) and n for n in self.served_model_name), w, "served_model_name",
               self.served_model_name, "non-empty names")
        _check(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)), w, "api_key",
               self.api_key, "a non-empty string or null")
        _check(_is_int(self.max_queued_requests) and self.max_queued_requests >= 0, w, "max_queued_requests",
               self.max_queued_requests, "an integer >= 0")
        _check(self.estimator_state is None or (isinstance(self.estimator_state, str) and bool(self.estimator_state)),
               w, "estimator_state", self.estimator_state, "a file path or null")
