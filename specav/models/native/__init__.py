"""Native CPU kernels, built on first use for the instruction sets this machine runs safely:
matmuls on GGUF k-quant blocks (kquant.cpp), a Q4_K quantiser (quantize.cpp) and the small float32
operations of a decoder layer (layers.cpp).

Owns: choosing the variant this process runs (variants.py, best first: AVX-512 VNNI, then AVX2),
through the safe probe of probe.py (feature bits, OS permission, a self-test in a child process,
its outcome cached beside the build), and loading that variant's library with the kernel schedule
measured fastest on this machine (schedule.py, also cached beside the build). `ops()` is its op
namespace (`torch.ops.specav_<variant>`): `kq_matmul`, `quantize_activations`, `quantize_q4_k`,
`rms_norm`, `add_rms_norm_`, `silu_mul`, `rope_`, `attention`, `set_schedule`. `variant_ops(name)` loads one
named variant (for the tests, which run every variant the machine can, and for benchmarks).

`available()` is False, with `unavailable_reason()` saying why, where no variant passes (a CPU
without AVX2, no compiler, an unwritable cache); the quantized path then uses torch's own kernels
(quant_kernels.py) and the packed forward torch's ops, and a warning says so: nothing but speed
depends on this module.

Environment (read when first needed, never at import): SPECAV_NO_NATIVE=1 runs torch's kernels
only; SPECAV_NATIVE_VARIANT=<name> considers that variant alone (e.g. `avx2`, to compare);
SPECAV_NATIVE_SCHEDULE=<0..7> runs that kernel schedule (schedule.py).

Must not know: GGUF files, modules, which kernel is fastest.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from specav.models.native import probe as _probe
from specav.models.native import schedule as _schedule
from specav.models.native.build import build_directory
from specav.models.native.variants import BY_NAME, VARIANTS, Variant

log = logging.getLogger(__name__)
_lock = threading.Lock()
_chosen: dict[str, object] = {}  # the process's loaded library: "variant" (Variant | None), "reason"
_loaded: dict[str, object] = {}  # variant name -> its op namespace, or the reason it is unusable


class VariantUnavailable(RuntimeError):
    """A named variant cannot run here; the message says why."""


def available() -> bool:
    """True once a variant is chosen and loaded (probing and building now if needed)."""
    return _choose() is not None


def unavailable_reason() -> str:
    _choose()
    return "" if _chosen["variant"] is not None else str(_chosen["reason"])


def selected() -> Variant | None:
    """The variant this process runs, or None."""
    return _choose()


def ops():
    """The chosen variant's op namespace (`torch.ops.specav_<variant>`)."""
    variant = _choose()
    if variant is None:
        raise VariantUnavailable(f"no native kernels: {_chosen['reason']}")
    return getattr(torch.ops, variant.namespace)


def ops_or_none():
    """The chosen variant's op namespace, or None where no variant is built (SPECAV_NO_NATIVE, no
    compiler, a CPU without AVX2): for callers with a torch path giving the same results."""
    return ops() if available() else None


def build_key() -> str:
    """Names the chosen variant's build (the kernel profile keys its timings by it)."""
    variant = _choose()
    return build_directory(variant).name if variant is not None else "none"


def variant_ops(name: str, flags: set[str] | None = None):
    """Load variant `name` (probing it first) and return its op namespace; VariantUnavailable if it
    cannot run here. flags: the CPU flags to judge by (default this CPU's)."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(BY_NAME[name], _probe.cpu_flags() if flags is None else flags)
    loaded = _loaded[name]
    if isinstance(loaded, str):
        raise VariantUnavailable(f"native variant {name}: {loaded}")
    return loaded


def choose(flags: set[str], candidates: tuple[Variant, ...] = VARIANTS,
           probe=_probe.probe) -> tuple[Variant | None, dict[str, str]]:
    """The first candidate whose probe passes, and why each earlier one did not (pure: nothing loaded)."""
    reasons = {}
    for variant in candidates:
        result = probe(variant, flags)
        if result.ok:
            return variant, reasons
        reasons[variant.name] = result.reason
    return None, reasons


def _choose() -> Variant | None:
    with _lock:
        if "variant" not in _chosen:
            _chosen["variant"], _chosen["reason"] = _choose_now()
    return _chosen["variant"]  # type: ignore[return-value]


def _choose_now() -> tuple[Variant | None, str]:
    if os.environ.get("SPECAV_NO_NATIVE"):
        return None, "SPECAV_NO_NATIVE is set"
    forced = os.environ.get("SPECAV_NATIVE_VARIANT")
    if forced and forced not in BY_NAME:
        return None, f"SPECAV_NATIVE_VARIANT={forced!r} names no variant; known: {', '.join(BY_NAME)}"
    candidates = (BY_NAME[forced],) if forced else VARIANTS
    variant, reasons = choose(_probe.cpu_flags(), candidates)
    why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    if variant is None:
        log.warning("native kernels unavailable (%s); using torch's kernels, which are slower", why)
        return None, why or "no variant"
    loaded = _load(variant, _probe.cpu_flags())
    if isinstance(loaded, str):
        log.warning("native kernels unavailable (%s); using torch's kernels, which are slower", loaded)
        return None, loaded
    _loaded[variant.name] = loaded
    if reasons:
        log.info("native kernels: %s (%s)", variant.name, why)
    return variant, ""


def _load(variant: Variant, flags: set[str]):
    """The variant's op namespace once its probe passed and its library is loaded, else the reason."""
    if variant.name in _loaded:
        return _loaded[variant.name]
    result = _probe.probe(variant, flags)
    if not result.ok:
        return result.reason
    namespace = getattr(torch.ops, variant.namespace)
    if not hasattr(namespace, "kq_matmul"):
        try:
            torch.ops.load_library(str(result.library))
        except OSError as err:
            return f"its library could not be loaded ({err})"
    _schedule.apply(namespace, result.library.parent, flags)
    return namespace
