"""Benchmark: what an engine step spends outside the two models' forwards.

    python -m specav.bench.step_overhead [--batches 1,8] [--k 4] [--tokens 48] [--threads 2] [--vocab-passes both]
                                         [--calls] [--draft-vocab-size 65536]

Runs the packaged pair (auto) with static K on chat prompts, temperature 0.7, top-k 20,
top-p 0.8 (EOS ignored), the drafter's head as the packaged default has it (`--draft-vocab-size`,
config.PACKAGED_SPECULATIVE; 0: the full head), timing every call of the target's and the
drafter's packed forward (the models' thread policies having made their trial forwards first, so
the forwards run as in a long run).
Printed per batch size, in milliseconds per step: the whole step, the two models' forwards, and
what is left: the drafter's per-slot work (processed distributions, sampling, features), the
verifier's distributions, and the rest (scoring, planning, rejection sampling, commit).
The last two rows look inside the forwards: what they spend outside their kernels (the layer
ops' native calls and the quantized linears, the output head's included): the Python around the
kernels (embedding lookup, positions, rotary tables, each layer's call and its arguments).
`--vocab-passes both` measures each batch twice in turns, with the native passes over vocabulary
rows (specav/topk.py: the top-k of sampling, the features' top two and softmax tail) and with
torch's ops in their place, so the two columns come from one run. `--calls` also times the
per-slot calls inside the step (ms per call, with the caches as each forward leaves them: cold).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch

from specav import topk
from specav.bench.adaptive import warm_thread_policy
from specav.config import PACKAGED_SPECULATIVE, EngineConfig, SamplingParams, SpeculativeConfig
from specav.drafting import DraftModelDrafter
from specav.engine.engine import Engine, eos_token_ids
from specav.evaluation.workloads import load_workload
from specav.models import load_checkpoint
from specav.models.native.probe import cpu_model
from specav.models.quant import FusedLinear, QuantizedLinear
from specav.models.vocab_subset import apply_vocab_subset
from specav.prompts import encode_prompt
from specav.verification import sampling
from specav.verification.sampling_rows import SamplingRows


class _ForwardTimer:
    """Adds the wall time of a model's forward calls to `seconds`, and of the kernels they ran
    (`kernels`, a _KernelClock) to `in_kernels`."""

    def __init__(self, model, kernels: "_KernelClock") -> None:
        self.seconds = self.in_kernels = 0.0
        original = model.forward

        def forward(*args, **kwargs):
            start, start_kernels = time.perf_counter(), kernels.seconds
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.in_kernels += kernels.seconds - start_kernels

        model.forward = forward


class _KernelClock:
    """Wall time spent in kernels: the native layer calls of the models' layer ops (their op
    namespace) and the quantized linears' forwards (the output head's included), the outermost
    call only. A forward's time outside them is its Python: embedding lookup, positions, rotary
    tables, each layer's call and its arguments."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def timed(self, call):
        def run(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start
        return run

    @contextlib.contextmanager
    def watching(self, models):
        with contextlib.ExitStack() as stack:
            for cls in (QuantizedLinear, FusedLinear):
                stack.enter_context(mock.patch.object(cls, "forward", self.timed(cls.forward)))
            for model in models:
                if hasattr(model.ops, "native"):  # NativeLayerOps: its ops are looked up on this namespace
                    stack.enter_context(mock.patch.object(model.ops, "native", _TimedNamespace(model.ops.native, self)))
            yield self


class _TimedNamespace:
    """An op namespace whose ops run under a _KernelClock."""

    def __init__(self, namespace, clock: _KernelClock) -> None:
        self._namespace, self._clock = namespace, clock

    def __getattr__(self, name: str):
        return self._clock.timed(getattr(self._namespace, name))


# The per-slot calls `--calls` times: label, owner, attribute (where the step looks them up).
_CALLS = (
    ("SamplingRows.of (both models)", SamplingRows, "of"),
    ("drafter: draw (q_i, tails, tokens)", SamplingRows, "draw"),
    ("  draw_top_k (one native call)", sampling, "draw_top_k"),
    ("  distributions_and_tails", SamplingRows, "distributions_and_tails"),
    ("  scan_rows (both models)", sampling, "scan_rows"),
    ("  candidate_probs (both models)", sampling, "candidate_probs"),
    ("verifier: top_k_distributions", sampling, "top_k_distributions"),
    ("drafter: features (per slot)", DraftModelDrafter, "_slot_features"),
)


@contextlib.contextmanager
def _timed_calls(seconds: dict[str, float], counts: dict[str, int]):
    """Adds the wall time and the number of calls of each of _CALLS to seconds / counts."""
    def timed(label, original):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start
                counts[label] = counts.get(label, 0) + 1
        return call

    with contextlib.ExitStack() as stack:
        for label, owner, name in _CALLS:
            original = getattr(owner, name)  # a classmethod comes bound: keep it bound
            new = staticmethod(timed(label, original)) if isinstance(owner.__dict__.get(name), classmethod) \
                else timed(label, original)
            stack.enter_context(mock.patch.object(owner, name, new))
        yield


def measure(target, drafter, batch: int, k: int, tokens: int, calls: dict[str, float] | None = None
            ) -> dict[str, float]:
    """ms per decoding step of each part; with `calls`, also ms per call of each of _CALLS into it."""
    spec = SpeculativeConfig(num_speculative_tokens=k)
    engine = Engine(target.model, target.tokenizer, DraftModelDrafter(drafter.model),
                    EngineConfig(speculative=spec, max_batch_size=batch), eos_token_ids(target))
    clock = _KernelClock()
    target_timer, drafter_timer = _ForwardTimer(target.model, clock), _ForwardTimer(drafter.model, clock)
    prompts = [encode_prompt(target.tokenizer, messages=p.chat()) for p in load_workload("chat")[:batch]]
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, max_tokens=tokens, seed=i, ignore_eos=True)
              for i in range(batch)]
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    engine.step()  # the prefill step is left out
    target_timer.seconds = drafter_timer.seconds = target_timer.in_kernels = drafter_timer.in_kernels = 0.0
    stages = {"step": 0.0, "draft": 0.0, "verify": 0.0}
    steps = 0
    engine.step_listeners.append(lambda r: (stages.__setitem__("draft", stages["draft"] + r.times.draft),
                                            stages.__setitem__("verify", stages["verify"] + r.times.verify)))
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    with _timed_calls(seconds, counts) if calls is not None else contextlib.nullcontext(), \
            clock.watching([target.model, drafter.model]):
        while engine.has_work():
            start = time.perf_counter()
            engine.step()
            stages["step"] += time.perf_counter() - start
            steps += 1
    if calls is not None:
        calls.update({label: 1e3 * seconds[label] / counts[label] for label in seconds})
    del target.model.forward, drafter.model.forward  # back to the class's method
    ms = {name: 1e3 * s / steps for name, s in stages.items()}
    ms["target forward"] = 1e3 * target_timer.seconds / steps
    ms["drafter forwards"] = 1e3 * drafter_timer.seconds / steps
    ms["drafter outside its forwards"] = ms["draft"] - ms["drafter forwards"]
    ms["verifier outside the forward"] = ms["verify"] - ms["target forward"]
    ms["rest of the step"] = ms["step"] - ms["draft"] - ms["verify"]
    ms["outside the forwards"] = ms["step"] - ms["target forward"] - ms["drafter forwards"]
    ms["target forward outside kernels"] = ms["target forward"] - 1e3 * target_timer.in_kernels / steps
    ms["drafter forwards outside kernels"] = ms["drafter forwards"] - 1e3 * drafter_timer.in_kernels / steps
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", action="store_true",
                        help="also print ms per call of the per-slot calls, timed inside the step")
    parser.add_argument("--vocab-passes", choices=("native", "torch", "both"), default="native",
                        help="the native passes over vocabulary rows (specav/topk.py) or torch's ops in their "
                             "place (both: measured in turns)")
    parser.add_argument("--draft-vocab-size", type=int, default=PACKAGED_SPECULATIVE.draft_vocab_size or 0,
                        help="the drafter's vocabulary-subset head (0: the full head); default: the packaged default's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_checkpoint("default", "auto", role="target")
    drafter = load_checkpoint("default", "auto", role="drafter")
    if args.draft_vocab_size:
        apply_vocab_subset(drafter, args.draft_vocab_size)
    for model in (target.model, drafter.model):  # the thread policies' trial forwards, before any step is timed
        warm_thread_policy(model, max(int(b) for b in args.batches.split(",")) * (args.k + 1))
    kinds = {"native": ["native"], "torch": ["torch"], "both": ["native", "torch"]}[args.vocab_passes]
    columns = [(b, kind) for b in (int(b) for b in args.batches.split(",")) for kind in kinds]
    rows, calls = {}, {}
    for b, kind in columns:
        calls[b, kind] = {} if args.calls else None
        with _vocab_passes(kind):
            rows[b, kind] = measure(target, drafter, b, args.k, args.tokens, calls[b, kind])
    head = f"a {args.draft_vocab_size:,}-token head" if args.draft_vocab_size else "the full head"
    print(f"ms per decoding step, static K={args.k}, {args.tokens} tokens per request, {torch.get_num_threads()} "
          f"threads, temperature 0.7 / top-k 20 / top-p 0.8, the drafter with {head}, {cpu_model()}")
    print(f"{'':<32}" + "".join(f"{f'batch {b} {kind}':>16}" for b, kind in columns))
    for name in ("step", "target forward", "drafter forwards", "drafter outside its forwards",
                 "verifier outside the forward", "rest of the step", "outside the forwards",
                 "target forward outside kernels", "drafter forwards outside kernels"):
        print(f"{name:<32}" + "".join(f"{rows[c][name]:>16.2f}" for c in columns))
    if args.calls:
        print("ms per call, timed inside the step")
        for label, _, _ in _CALLS:
            print(f"{label:<32}" + "".join(f"{calls[c].get(label, float('nan')):>16.3f}" for c in columns))


def _vocab_passes(kind: str):
    """native: specav.topk as it is; torch: torch's ops in place of its native passes."""
    return mock.patch.object(topk, "_native_ops", lambda: None) if kind == "torch" else contextlib.nullcontext()


if __name__ == "__main__":
    main()
