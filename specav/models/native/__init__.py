"""Native CPU kernels, compiled on first use: AVX2 matmul on GGUF k-quant blocks (kquant.cpp)
and the small float32 operations of a decoder layer (layers.cpp).

Owns: building both sources with torch's C++ extension tools (g++ and ninja) into one
library in `~/.cache/specav/native/<build key>/` the first time a process needs it (about
40 s; later processes load the built library in milliseconds), and saying why when it cannot.

The ops land in `torch.ops.specav_kquant` (`q4k_matmul`, `q6k_matmul`,
`quantize_activations`) and `torch.ops.specav_layers` (`rms_norm`, `add_rms_norm_`,
`silu_mul`, `rope_`, `attention`). `available()` is False, with `unavailable_reason()`
saying why, on CPUs without AVX2/FMA/F16C or where the build fails; the quantized path then
uses torch's own kernels (quant_kernels.py) and the packed forward torch's own ops, so
nothing but speed depends on this module.

Must not know: GGUF files, modules, which kernel is fastest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kquant.cpp", "layers.cpp"))
HEADERS = (Path(__file__).with_name("avx2.h"),)  # included by the sources: part of the build key
# -fopenmp: at::parallel_for is inlined from ATen's headers and is OpenMP; without the flag it
# runs on one thread. The library then needs libgomp.so.1, which torch has already loaded.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-fopenmp"]
_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
_STALE_LOCK_S = 600  # a build takes about 30 s
_lock = threading.Lock()
_state: dict[str, str | bool] = {}


def available() -> bool:
    """True once the kernels are built and loaded (building them now if needed)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["reason"] = _load()
    return bool(_state["ok"])


def unavailable_reason() -> str:
    return "" if available() else str(_state["reason"])


def build_directory() -> Path:
    """Where the library is built: $SPECAV_NATIVE_DIR, else ~/.cache/specav/native, in a folder
    keyed by the source, flags and torch version (so an edit rebuilds). Not under $SPECAV_CACHE:
    tests point that at temporary folders, and the build should happen once per machine."""
    root = Path(os.environ.get("SPECAV_NATIVE_DIR", Path.home() / ".cache" / "specav" / "native"))
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(_FLAGS).encode()
                         + torch.__version__.encode())
    return root / key.hexdigest()[:16]


def _load() -> tuple[bool, str]:
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return False, f"this CPU lacks {', '.join(missing)}"
    if hasattr(torch.ops.specav_kquant, "q4k_matmul") and hasattr(torch.ops.specav_layers, "attention"):
        return True, ""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel's binary sits beside this interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # torch's build lock: a build killed midway leaves it behind, and later builds would wait on it forever.
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    try:
        cpp_extension.load(name="specav_native", sources=[str(s) for s in SOURCES], extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                           verbose=False)
    except (RuntimeError, OSError, ImportError, FileNotFoundError) as err:  # no compiler / ninja, build error
        log.warning("native kernels unavailable (%s); using torch's kernels", err)
        return False, f"building the native kernels failed: {str(err).strip().splitlines()[-1] if str(err) else err!r}"
    return True, ""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()  # not Linux: AVX2 implies FMA/F16C in practice
    return set(_REQUIRED_CPU_FLAGS) if capability in ("AVX2", "AVX512") else set()


if os.environ.get("SPECAV_NO_NATIVE"):  # for comparisons: run torch's kernels only
    _state.update(ok=False, reason="SPECAV_NO_NATIVE is set")
