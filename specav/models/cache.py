"""The cache root: where everything specav builds once is kept, and what to say when it cannot be.

Owns: the root directory ($SPECAV_CACHE, else ~/.cache/specav); checking, before a long write
starts, that a directory under it can be written and has room for what is about to go there;
turning a failed write (read-only file system, no permission, disk full) into a `CacheError`
that names the directory and the remedy; atomic writes; temporary names that carry their writer's
process id, and removing the temporaries of writers that died (a SIGKILL runs no cleanup of its own).

Must not know: what the artefacts are or how they are built.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

_REASONS = {
    errno.EROFS: "is on a read-only file system",
    errno.EACCES: "is not writable (permission denied)",
    errno.EPERM: "is not writable (operation not permitted)",
    errno.ENOSPC: "is full (no space left on the device)",
    errno.EDQUOT: "is over its disk quota",
    errno.ENOTDIR: "is not a directory (a file is in its way)",
    errno.EEXIST: "is not a directory (a file is in its way)",
}


class CacheError(RuntimeError):
    """A cache directory cannot take what specav needs to keep there; the message says what to do."""


def cache_root() -> Path:
    """Where assembled and converted models, kernel profiles and builds live: $SPECAV_CACHE, else
    ~/.cache/specav."""
    return Path(os.environ.get("SPECAV_CACHE") or Path.home() / ".cache" / "specav").expanduser()


def prepare_dir(directory: Path, need_bytes: int, what: str) -> None:
    """Create `directory` and check it takes a file and has `need_bytes` free, before `what` is written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=f".probe.{os.getpid()}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise write_error(e, directory, what) from None
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise CacheError(f"cannot write {what}: it needs {format_size(need_bytes)} in {directory}, which has "
                         f"{format_size(free)} free; free some space, or set SPECAV_CACHE to a directory with room")


def is_writable(directory: Path) -> bool:
    """Whether a file can be created in `directory` (created if missing); a probe, not a permission guess."""
    try:
        prepare_dir(directory, 0, "a probe")
    except CacheError:
        return False
    return True


def write_error(e: OSError, directory: Path, what: str) -> CacheError:
    """The one-line error for a write into the cache that failed with `e`."""
    reason = _REASONS.get(e.errno, f"cannot be written ({e.strerror or e})")
    return CacheError(f"cannot write {what}: the cache directory {directory} {reason}; set SPECAV_CACHE to a "
                      f"writable directory with room (the cache root now is {cache_root()})")


def temp_path(final: Path) -> Path:
    """Where a writer of `final` writes before its atomic rename: `.<name>.<pid>.tmp` beside it."""
    return final.with_name(f".{final.name}.{os.getpid()}.tmp")


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` whole or not at all: write(file) into temp_path(path), flushed and fsynced, then
    renamed onto `path`; the temporary is removed whatever fails (the error propagates)."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temps(final: Path) -> list[Path]:
    """Remove the temporaries of `final` (files or directories) whose writer process is gone."""
    removed = []
    prefix = f".{final.name}."
    for path in final.parent.glob(f"{prefix}*.tmp"):
        pid = path.name[len(prefix):-len(".tmp")]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a temporary named for this process is a leftover of an earlier one with our pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def format_size(n: int) -> str:
    """Bytes for a message: "1.04 GiB", "12.00 MiB", "161 bytes"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"
