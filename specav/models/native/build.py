"""Building one native variant into the cache, once per machine, safely across processes.

Owns: where a variant's library lives (`<cache root>/native/<variant>-<key>/`, the key a hash
of the sources, headers, flags and torch version, so an edit rebuilds; the cache root is
`$SPECAV_CACHE`, default ~/.cache/specav, as for every cached artefact), compiling it with
torch's C++ extension tools (g++ and ninja; about 40 s a variant), and the lock that lets one
process build while the others wait.

The lock is an flock on `build.lock` in the build directory: the kernel releases it when its
owner dies, however it dies (SIGKILL included), so a killed build never holds the next run. The
owner writes its pid and host into the file, for the message of whoever waits. torch's own build
lock (`lock`, a plain file it deletes when done) outlives a killed build and would make the next
build wait for good; whoever holds `build.lock` removes it first.

Progress goes to stderr: one line when a build starts, one when it ends with its duration.
A build found finished prints nothing. Errors are `NativeBuildError`, whose message says what
failed (an unwritable or full cache, no compiler, a compile error) and what to do.

Must not know: which variant a machine should run, or what the ops do.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specav.models.native.variants import Variant

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("kquant.cpp", "quantize.cpp", "layers.cpp", "decoder.cpp", "topk.cpp", "rejection.cpp"))
HEADERS = tuple(HERE / name for name in ("common.h", "ops.h", "kquant_avx2.h", "kquant_avx512.h"))
# -fopenmp: the kernels split their work with OpenMP (torch's intra-op threads); the library
# then needs libgomp.so.1, which torch has already loaded.
COMMON_FLAGS = ("-O3", "-std=c++17", "-fopenmp")
LOCK_TIMEOUT_S = 900.0  # a build takes about 40 s; a live owner past this is taken as hung


class NativeBuildError(RuntimeError):
    """A native variant could not be built; the message says why and what to do."""


def native_root() -> Path:
    from specav.models.packaged import cache_root

    return cache_root() / "native"


def build_directory(variant: Variant, root: Path | None = None, sources: Sequence[Path] = SOURCES,
                    headers: Sequence[Path] = HEADERS) -> Path:
    """The variant's build folder, keyed by everything that changes the library."""
    digest = hashlib.sha256()
    for path in (*sources, *headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join((*COMMON_FLAGS, *variant.cflags, variant.namespace, torch.__version__)).encode())
    return (root or native_root()) / f"{variant.name}-{digest.hexdigest()[:16]}"


def library_path(directory: Path, variant: Variant) -> Path:
    return directory / f"{variant.namespace}.so"


def build(variant: Variant, root: Path | None = None, sources: Sequence[Path] = SOURCES,
          headers: Sequence[Path] = HEADERS) -> Path:
    """The variant's built library, building it first if needed (loads it into this process
    when it builds: call it in the probe's child, not in a process that must not fault)."""
    directory = build_directory(variant, root, sources, headers)
    library = library_path(directory, variant)
    if library.exists():
        return library
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NativeBuildError(cannot_write(directory, err)) from None
    with _build_lock(directory):
        if library.exists():  # built by the process we waited for
            return library
        (directory / "lock").unlink(missing_ok=True)  # torch's lock: stale, since we hold build.lock
        print(f"specav: building the native kernels ({variant.name}) in {directory}; about 40 s, once",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        _compile(variant, directory, sources, headers)
        print(f"specav: built the native kernels ({variant.name}) in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)
    return library


def _compile(variant: Variant, directory: Path, sources: Sequence[Path], headers: Sequence[Path]) -> None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and shutil.which("ninja", path=str(Path(sys.executable).parent)) is None:
        raise NativeBuildError("building the native kernels needs ninja (pip install ninja)")
    flags = [*COMMON_FLAGS, *variant.cflags, f"-DSPECAV_NS={variant.namespace}"]
    try:
        with _ninja_on_path():
            cpp_extension.load(name=variant.namespace, sources=[str(s) for s in sources], extra_cflags=flags,
                               extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                               verbose=False)
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise NativeBuildError(cannot_write(directory, err)) from None
        raise NativeBuildError(f"building the native kernels failed: {err}") from None
    except (RuntimeError, ImportError) as err:  # no compiler, a compile error, a full disk mid-build
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        detail = next((line for line in lines if "No space left" in line or "Read-only" in line), None)
        if detail:
            raise NativeBuildError(cannot_write(directory, detail)) from None
        raise NativeBuildError(f"building the native kernels failed ({lines[-1] if lines else err!r}); "
                               f"is g++ installed?") from None


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The ninja wheel's binary sits beside this interpreter, which need not be on PATH: put it
    there for the build only (importing specav must leave os.environ alone)."""
    saved = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{saved or ''}"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


def cannot_write(directory: Path, err: OSError | str) -> str:
    """The message for a cache the build cannot write (read-only, full, not a directory)."""
    why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return (f"the native kernels cannot be built in {directory} ({why}); make the cache writable, free "
            f"space, or point SPECAV_CACHE at a writable directory")


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Exclusive across processes; released by the kernel when the owner dies."""
    path = directory / "build.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise NativeBuildError(cannot_write(directory, err)) from None
    try:
        _acquire(fd, path, LOCK_TIMEOUT_S)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode())
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _acquire(fd: int, path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not told:
            owner = path.read_text(errors="replace").split()
            who = f"pid {owner[0]} on {owner[1]}" if len(owner) >= 2 else "another process"
            print(f"specav: waiting for {who}, which is building the native kernels in {path.parent}",
                  file=sys.stderr, flush=True)
            told = True
        if time.monotonic() > deadline:
            raise NativeBuildError(f"gave up waiting {timeout_s:.0f} s for the native build in {path.parent} "
                                   f"(its owner holds {path}); delete that directory to build afresh")
        time.sleep(0.2)
