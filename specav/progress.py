"""Progress of the long one-off phases of a first run (assembling a GGUF, converting it), on stderr.

Owns: a phase's start line and end line (with its duration), and a byte bar (tqdm) that shows
only where stderr is a terminal, so logs get the two lines and no carriage-return noise. A run
that finds everything cached enters no phase, so it prints none of this.

Must not know: what the phases do.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

from tqdm import tqdm


@contextmanager
def phase(what: str) -> Iterator[None]:
    """`specav: <what> ...` now, `specav: <what>: done in 12.3 s` when the block ends without error."""
    print(f"specav: {what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"specav: {what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def byte_bar(total: int, desc: str) -> tqdm:
    """A bar counting `total` bytes on stderr (shown on a terminal only); call `.update(n)`, then `.close()`."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not _is_terminal(sys.stderr), leave=False, dynamic_ncols=True)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
