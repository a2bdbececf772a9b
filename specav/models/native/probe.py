"""Which native variant this machine runs: feature bits, OS permission, then a self-test in a child.

Owns: the safe probe. A CPU (or a VM) can report features it faults on, and a library built
for them may fault as soon as it is loaded, so a variant is used only after a child process has
built it (build.py), loaded it and run its self-test (selftest.py): a fault (SIGILL) or a wrong
result kills or fails the child, which costs a fallback to the next variant, never a crash of the
caller. The outcome is kept beside the build (`probe.json` in the variant's build directory),
keyed by a fingerprint of the machine (CPU model and flags, kernel release), so later processes
skip the child. A failed build is not kept (installing a compiler fixes it); a failed self-test
is (the same machine would fail it again).

Must not know: what the kernels compute (selftest.py checks that), or the models using them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from specav.models.native.build import HEADERS, SOURCES, build_directory, cannot_write, library_path
from specav.models.native.variants import Variant

CHILD_TIMEOUT_S = 1200.0  # building (about 40 s, or waiting for another builder) plus the self-test
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1023, 18  # Linux: request the AMX tile state
_FILE = "probe.json"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    reason: str  # why not, when not ok
    library: Path | None = None
    keep: bool = True  # False: do not cache (a build failure, which a later run may not repeat)


# The child: `python -m specav.models.native.selftest <variant> <root>`; tests substitute another command.
ChildCommand = Callable[[Variant, Path | None], Sequence[str]]


def default_child(variant: Variant, root: Path | None) -> list[str]:
    return [sys.executable, "-m", "specav.models.native.selftest", variant.name, str(root or "")]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def os_permits(feature: str | None) -> bool:
    """Whether the OS grants `feature` to this process (requesting it where it must be requested)."""
    if feature is None:
        return True
    if feature == "amx-tile":  # Linux 5.16+: AMX tile data must be requested once per process
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            return libc.syscall(158, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0  # 158: arch_prctl
        except (OSError, AttributeError):
            return False
    return False


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("unknown cpu" where it does not)."""
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo_lines() if line.startswith("model name")),
                "unknown cpu")


def fingerprint(flags: set[str]) -> str:
    return hashlib.sha256(f"{cpu_model()}|{' '.join(sorted(flags))}|{platform.release()}".encode()).hexdigest()[:16]


def probe(variant: Variant, flags: set[str], root: Path | None = None, child: ChildCommand = default_child,
          sources: Sequence[Path] = SOURCES, headers: Sequence[Path] = HEADERS) -> ProbeResult:
    """Whether `variant` runs here; builds and self-tests it in a child the first time."""
    missing = variant.missing(flags)
    if missing:
        return ProbeResult(False, f"this CPU lacks {', '.join(missing)}")
    if not os_permits(variant.os_feature):
        return ProbeResult(False, f"the OS does not grant {variant.os_feature}")
    directory = build_directory(variant, root, sources, headers)
    key = fingerprint(flags)
    cached = read_cache(directory, _FILE).get(key)
    if cached is not None and (not cached["ok"] or library_path(directory, variant).exists()):
        return ProbeResult(cached["ok"], cached["reason"], library_path(directory, variant) if cached["ok"] else None)
    if not library_path(directory, variant).exists():
        try:  # an unwritable cache fails here, before a child is started for nothing
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return ProbeResult(False, cannot_write(directory, err), keep=False)
    result = _run_child(variant, root, child, directory)
    if result.keep:
        write_cache(directory, _FILE, key, {"ok": result.ok, "reason": result.reason})
    return result


def _run_child(variant: Variant, root: Path | None, child: ChildCommand, directory: Path) -> ProbeResult:
    try:
        done = subprocess.run(list(child(variant, root)), stdout=subprocess.PIPE, stderr=None, text=True,
                              timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"its build and self-test took over {CHILD_TIMEOUT_S:.0f} s", keep=False)
    except OSError as err:
        return ProbeResult(False, f"its self-test could not start ({err})", keep=False)
    report = _last_json(done.stdout)
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else done.returncode
        return ProbeResult(False, f"its self-test was killed by {name} (an instruction this machine faults on)")
    if done.returncode == 0 and report.get("ok"):
        return ProbeResult(True, "", library_path(directory, variant))
    if report.get("stage") == "build":
        return ProbeResult(False, report.get("reason", "its build failed"), keep=False)
    return ProbeResult(False, report.get("reason", f"its self-test failed (exit status {done.returncode})"))


def _last_json(text: str) -> dict:
    for line in reversed((text or "").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {}


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def read_cache(directory: Path, name: str) -> dict:
    """The JSON object kept in `directory`/`name` (machine fingerprint -> outcome), {} if none."""
    try:
        return json.loads((directory / name).read_text())
    except (OSError, ValueError):
        return {}


def write_cache(directory: Path, name: str, key: str, value: dict) -> None:
    """Keep `value` under `key` in `directory`/`name`. Best effort: an unwritable cache only means
    the next process probes (or measures) again."""
    try:
        data = read_cache(directory, name)
        data[key] = value
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, directory / name)
    except OSError:
        pass
