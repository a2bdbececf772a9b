"""Benchmark-only dependencies (pyproject's `bench` extra): imported where a benchmark needs them,
with a message that says what to install when one is missing. The package and its tests need none."""

from __future__ import annotations

import importlib
from types import ModuleType

BENCH_EXTRA = {"psutil": "psutil>=5.9", "llama_cpp": "llama-cpp-python==0.3.36"}


def require(module: str, who: str) -> ModuleType:
    """Import `module` for benchmark `who`, or exit with the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"{who} needs {module}, a benchmark-only dependency: install it with "
                         f".venv/bin/pip install '{BENCH_EXTRA[module]}' (or .venv/bin/pip install -e '.[bench]', "
                         f"which also builds llama-cpp-python)") from None
