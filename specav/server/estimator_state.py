"""The estimator's state across server restarts (`specav serve --estimator-state PATH`).

Owns: writing the online estimator's `state_dict()` with what it was learned for (the model pair
and K) atomically (a temporary file in the same directory, fsynced, then renamed over the old
one: a crash mid-write leaves the previous state whole), and reading it back on start, refusing
a state that belongs to another pair or K with a message that says what to do. The state itself
is opaque here: a dict of tensors and plain values, whatever the estimator puts in it.

Must not know: HTTP, what the estimator's state holds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from specav.models.cache import atomic_write

FORMAT = 1


class EstimatorStateError(ValueError):
    """A saved estimator state cannot be used here; the message names the file and the remedy."""


def identity(target: str, drafter: str, num_slots: int) -> dict[str, Any]:
    """What a state is valid for: the model pair (paths resolved; "default" is the packaged pair) and K."""
    def resolved(path: str) -> str:
        return path if path == "default" else str(Path(path).expanduser().resolve())

    return {"target": resolved(target), "drafter": resolved(drafter), "num_speculative_tokens": int(num_slots)}


def save(path: str | Path, scorer, ident: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> Path:
    """Write the scorer's state atomically; returns the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "identity": dict(ident), "saved_at": time.time(), "extra": dict(extra or {}),
               "state": scorer.state_dict()}
    atomic_write(path, lambda f: torch.save(payload, f))
    _fsync_directory(path.parent)
    return path


def load(path: str | Path, scorer, ident: Mapping[str, Any]) -> bool:
    """Restore the scorer from `path`; False when there is no file yet (a first start)."""
    path = Path(path).expanduser()
    if not path.exists():
        return False
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EstimatorStateError(f"--estimator-state {str(path)!r} is not a specav estimator state ({e}); "
                                  "pass another path, or delete the file to start afresh") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "state" not in payload:
        raise EstimatorStateError(f"--estimator-state {str(path)!r} is not a specav estimator state (format "
                                  f"{FORMAT}); pass another path, or delete the file to start afresh")
    saved = payload.get("identity", {})
    if saved != dict(ident):
        raise EstimatorStateError(
            f"--estimator-state {str(path)!r} was learned for {_describe(saved)}, but this server runs "
            f"{_describe(ident)}: an estimator's state belongs to one model pair and K. Pass another path "
            "for this pair, or delete the file to start afresh")
    try:
        scorer.load_state_dict(payload["state"])
    except (KeyError, ValueError, TypeError) as e:
        raise EstimatorStateError(f"--estimator-state {str(path)!r} does not fit this estimator ({e}); "
                                  "pass another path, or delete the file to start afresh") from None
    return True


def _describe(ident: Mapping[str, Any]) -> str:
    return (f"target {ident.get('target')!r}, drafter {ident.get('drafter')!r}, "
            f"K = {ident.get('num_speculative_tokens')}")


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
