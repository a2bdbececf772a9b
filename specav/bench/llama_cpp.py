"""llama.cpp's own tools, built once from the source the `bench` extra ships, with flags that run here.

    python -m specav.bench.llama_cpp [--probe-model PATH] [--threads N]   # build (once) and print the tools

Owns: building `llama-bench`, `llama-completion` and `llama-speculative-simple` from the
llama.cpp source vendored in llama-cpp-python's sdist (the version the `bench` extra pins,
or the one installed), choosing compiler flags this machine can run, and caching the
binaries under `<SPECAV_CACHE>/llama.cpp/<version>-<variant>-<hash>/bin/`.

Flag choice. A CPU (or a VM) can advertise instructions it faults on: llama.cpp built with
`-march=native` (AMX included) on an Intel Xeon that reports AMX died with SIGILL on
5-token batches, while an AVX-512 VNNI build without AMX ran (issue 15). So the variants
are tried in order, `native` first, then explicit instruction sets (`-DGGML_NATIVE=OFF`,
never AMX) that the CPU reports: AVX-512 with VNNI, then AVX2. Each build is probed by
running `llama-bench` on the given model(s) at one token and at a 5- and 16-token batch;
a probe killed by a signal (SIGILL above all) marks the variant faulted in its cache
directory, so it is never used or rebuilt, and the next variant is built. Only the three
targets are compiled (static libraries, so the binaries stand alone); on 2 cores one
variant takes many minutes, printed as progress lines on stderr.

Pure parts (tested without compiling): `cpu_flags`, `candidate_variants`, `cache_key`,
`is_fault`. Running the tools and reading their output is llama_cpp_tools.py's.

Must not know: specav's models, the engine, or how the tools' figures are compared.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

PINNED_VERSION = "0.3.36"  # pyproject.toml's `bench` extra: llama-cpp-python==0.3.36
TARGETS = ("llama-bench", "llama-completion", "llama-speculative-simple")
_COMMON_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CCACHE=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_OPENSSL=OFF")
_NO_AMX = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
_AVX2 = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
         "-DGGML_BMI2=ON")
_FAULT_SIGNALS = frozenset({signal.SIGILL, signal.SIGSEGV, signal.SIGBUS})  # not SIGABRT: an assert is no fault
COMMIT_FILE = "SPECAV_LLAMA_CPP_COMMIT"  # in the unpacked source: the vendored commit
_PROBE_BATCHES = "5,16"  # the batch sizes that faulted in the AMX build, and verification's largest


class LlamaCppBuildError(RuntimeError):
    """llama.cpp could not be fetched, built or run; the message says which step and what to do."""


@dataclass(frozen=True, slots=True)
class BuildVariant:
    """One set of compiler flags for llama.cpp's CPU backend."""

    name: str
    cmake_flags: tuple[str, ...]
    requires: frozenset[str]  # /proc/cpuinfo flags the CPU must report


VARIANTS: tuple[BuildVariant, ...] = (
    BuildVariant("native", ("-DGGML_NATIVE=ON",), frozenset()),
    BuildVariant("avx512-vnni", _AVX2 + ("-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON") + _NO_AMX,
                 frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512bw", "avx512dq",
                            "avx512vl", "avx512_vnni"})),
    BuildVariant("avx2", _AVX2 + ("-DGGML_AVX512=OFF",) + _NO_AMX, frozenset({"avx2", "fma", "f16c", "bmi2"})),
)


@dataclass(frozen=True, slots=True)
class LlamaCppTools:
    """A probed build of llama.cpp's tools in the cache."""

    root: Path  # the cache directory of this build
    version: str  # llama-cpp-python version whose vendored llama.cpp it is
    variant: str
    cmake_flags: tuple[str, ...]
    commit: str  # the vendored llama.cpp commit ("unknown" if the sdist does not say)

    def tool(self, name: str) -> Path:
        if name not in TARGETS:
            raise ValueError(f"{name!r} is not one of the built tools {TARGETS}")
        return self.root / "bin" / name

    def describe(self) -> str:
        return (f"llama.cpp {self.commit[:10]} (vendored in llama-cpp-python {self.version}), "
                f"build '{self.variant}': {' '.join(f for f in self.cmake_flags if 'GGML_' in f)}")


# ---- pure parts ------------------------------------------------------------------------------

def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of the first processor in /proc/cpuinfo's text."""
    match = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


def candidate_variants(flags: frozenset[str], variants: Sequence[BuildVariant] = VARIANTS) -> list[BuildVariant]:
    """The variants to try, in order: those whose required flags the CPU reports."""
    return [v for v in variants if v.requires <= flags]


def cache_key(version: str, variant: BuildVariant, compiler: str) -> str:
    """Directory name of one build: version, variant, and a hash of everything that shapes the binaries."""
    identity = json.dumps([version, variant.cmake_flags, _COMMON_FLAGS, TARGETS, compiler])
    return f"{version}-{variant.name}-{hashlib.sha256(identity.encode()).hexdigest()[:10]}"


def is_fault(returncode: int) -> bool:
    """Whether a child process died of a fault (killed by SIGILL, SIGSEGV, ...), directly or via a shell."""
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    return number in {int(s) for s in _FAULT_SIGNALS}


# ---- building --------------------------------------------------------------------------------

def installed_version() -> str:
    """llama-cpp-python's installed version, else the `bench` extra's pin."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return PINNED_VERSION


def ensure_tools(probe_models: Sequence[Path], threads: int, cache: Path | None = None,
                 version: str | None = None, log: Callable[[str], None] | None = None) -> LlamaCppTools:
    """The first variant (in `candidate_variants` order) that builds and runs the probe on this machine.

    Builds (once per variant, cached) and probes as needed; a faulted variant is recorded and
    skipped from then on. Raises LlamaCppBuildError when no variant runs.
    """
    from specav.models.packaged import cache_root

    log = log or _stderr
    version = version or installed_version()
    base = (cache or cache_root()) / "llama.cpp"
    compiler = _compiler_id()
    flags = cpu_flags(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    faults = []
    for variant in candidate_variants(flags):
        root = base / cache_key(version, variant, compiler)
        record = _build_once(root, base, version, variant, compiler, log)
        if record.get("probe") is None:
            record["probe"] = _probe(root, probe_models, threads, variant, log)
            _write_record(root, record)
        if record["probe"] == "ok":
            return LlamaCppTools(root, version, variant.name, variant.cmake_flags, record.get("commit", "unknown"))
        faults.append(f"{variant.name}: {record['probe']}")
        log(f"llama.cpp build '{variant.name}' faults on this machine ({record['probe']}); trying the next")
    raise LlamaCppBuildError(f"no llama.cpp build runs on this machine ({'; '.join(faults) or 'no variant fits'}"
                             f"; CPU flags include AVX2: {'avx2' in flags})")


def _build_once(root: Path, base: Path, version: str, variant: BuildVariant, compiler: str,
                log: Callable[[str], None]) -> dict:
    """The build record of `root`, building it first if absent (under a per-build file lock)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = _read_record(root)
        if record is not None and (record.get("probe") not in (None, "ok") or
                                   all((root / "bin" / t).exists() for t in TARGETS)):
            return record
        source = _source(base, version, log)
        build = root / "build"
        shutil.rmtree(build, ignore_errors=True)
        flags = (*_COMMON_FLAGS, *variant.cmake_flags)
        log(f"llama.cpp: building {', '.join(TARGETS)} ('{variant.name}': {' '.join(variant.cmake_flags)}) "
            f"into {root}; this takes many minutes on few cores")
        _run_logged(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *flags], "configure", log)
        _run_logged(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(os.cpu_count() or 1)],
                    "build", log)
        (root / "bin").mkdir(exist_ok=True)
        for target in TARGETS:
            shutil.copy2(build / "bin" / target, root / "bin" / target)
        shutil.rmtree(build, ignore_errors=True)
        record = {"version": version, "variant": variant.name, "cmake_flags": list(flags), "compiler": compiler,
                  "commit": _vendored_commit(source), "probe": None}
        _write_record(root, record)
        log(f"llama.cpp: build '{variant.name}' done")
        return record


def _probe(root: Path, models: Sequence[Path], threads: int, variant: BuildVariant,
           log: Callable[[str], None]) -> str:
    """'ok', or what killed llama-bench on one token and on 5- and 16-token batches of each model."""
    for model in models:
        cmd = [str(root / "bin" / "llama-bench"), "-m", str(model), "-p", _PROBE_BATCHES, "-n", "2", "-r", "1",
               "-t", str(threads), "-o", "json"]
        log(f"llama.cpp: probing build '{variant.name}' on {model}")
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if is_fault(done.returncode):
            code = -done.returncode if done.returncode < 0 else done.returncode - 128
            return f"fault ({signal.Signals(code).name})"
        if done.returncode != 0:
            raise LlamaCppBuildError(f"llama-bench failed on {model} (exit {done.returncode}) without a fault: "
                                     f"{done.stderr[-800:]}")
    return "ok"


def _source(base: Path, version: str, log: Callable[[str], None]) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, fetched with pip and unpacked once."""
    source = base / f"src-{version}"
    if (source / "CMakeLists.txt").exists():
        return source
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        log(f"llama.cpp: fetching the llama-cpp-python {version} sdist with pip (its vendor/llama.cpp is the source)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not sdists:
            raise LlamaCppBuildError(f"pip could not download the llama-cpp-python {version} sdist: "
                                     f"{done.stderr[-800:]}")
        vendored = unpack_vendored(sdists[0], Path(tmp) / "unpacked")
        shutil.rmtree(source, ignore_errors=True)
        os.replace(vendored, source)
    return source


def unpack_vendored(sdist: Path, dest: Path) -> Path:
    """Unpack vendor/llama.cpp of a llama-cpp-python sdist under `dest`; its submodule commit (kept in the
    sdist's .git/modules) is written to COMMIT_FILE. Returns the source directory."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                   not m.name.endswith("/vendor/llama.cpp/.git")]  # a gitfile pointing outside the tree
        heads = [m for m in tar.getmembers() if m.name.endswith(".git/modules/vendor/llama.cpp/HEAD")]
        tar.extractall(dest, members=members, filter="data")
        commit = tar.extractfile(heads[0]).read().decode().strip() if heads else "unknown"
    vendored = next(dest.glob("*/vendor/llama.cpp"), None)
    if vendored is None or not (vendored / "CMakeLists.txt").exists():
        raise LlamaCppBuildError(f"{sdist.name} has no vendor/llama.cpp with a CMakeLists.txt")
    (vendored / COMMIT_FILE).write_text(commit if re.fullmatch(r"[0-9a-f]{40}", commit) else "unknown")
    return vendored


def _run_logged(cmd: list[str], step: str, log: Callable[[str], None]) -> None:
    """Run a build step; forward ninja's progress every 5% and the tail of the output on failure."""
    tail: list[str] = []
    shown = -1
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-40:]
            progress = re.match(r"\[(\d+)/(\d+)\]", line)
            if progress:
                percent = 100 * int(progress.group(1)) // int(progress.group(2))
                if percent // 5 > shown:
                    shown = percent // 5
                    log(f"llama.cpp {step}: {progress.group(0)} {percent}%")
    if proc.returncode != 0:
        raise LlamaCppBuildError(f"llama.cpp {step} failed ({' '.join(cmd[:4])} ...):\n" + "\n".join(tail))


def _compiler_id() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    except (OSError, subprocess.CalledProcessError):
        raise LlamaCppBuildError(f"no C++ compiler ({compiler!r}): install g++ (and cmake, ninja) to build "
                                 f"llama.cpp's tools") from None


def _vendored_commit(source: Path) -> str:
    path = source / COMMIT_FILE
    return path.read_text().strip() if path.exists() else "unknown"


def _read_record(root: Path) -> dict | None:
    path = root / "build.json"
    return json.loads(path.read_text()) if path.exists() else None


def _write_record(root: Path, record: dict) -> None:
    tmp = root / "build.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, root / "build.json")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    from specav.models import packaged

    parser = argparse.ArgumentParser(prog="python -m specav.bench.llama_cpp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe-model", action="append", default=None,
                        help="GGUF file(s) the probe runs (default: the packaged target and drafter)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    models = [Path(m) for m in args.probe_model] if args.probe_model else [
        packaged.assembled_gguf(packaged.TARGET), packaged.assembled_gguf(packaged.DRAFTER)]
    tools = ensure_tools(models, args.threads)
    print(tools.describe())
    for target in TARGETS:
        print(f"  {tools.tool(target)}")


if __name__ == "__main__":
    main()
