"""Test-wide settings, and a summary line that counts the end-to-end tests apart.

Unit tests run tiny models whose ops take microseconds; with a multi-threaded pool, each op
can wait milliseconds for a descheduled worker when the machine is busy. One intra-op thread
keeps them fast and stable. End-to-end tests on the real pair raise it themselves.

Tests marked `e2e` load the packaged pair (pyproject.toml registers the marker). They run with
the rest (CI runs everything); the summary says how many there were and how long they took, so
a slow run can be told apart from a slow unit test. `-m "not e2e"` runs the unit tests alone.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specav.models import native
from specav.models.native.variants import VARIANTS

torch.set_num_threads(1)


@pytest.fixture(params=[v.name for v in VARIANTS])
def native_ops(request):
    """The op namespace of each native variant (torch.ops.specav_<variant>); the test id names the
    variant, and one this machine cannot run is skipped with the reason."""
    try:
        return native.variant_ops(request.param)
    except native.VariantUnavailable as err:
        pytest.skip(str(err))

_outcomes: dict[str, Counter] = {"e2e": Counter(), "unit": Counter()}
_seconds: Counter = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    kind = "e2e" if "e2e" in report.keywords else "unit"
    _seconds[kind] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes[kind][report.outcome] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    parts = []
    for kind, label in (("unit", "unit tests"), ("e2e", "end-to-end tests on the packaged pair (e2e)")):
        counts = _outcomes[kind]
        if counts:
            outcome = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
            parts.append(f"{label}: {outcome} in {_seconds[kind]:.0f} s")
    if parts:
        terminalreporter.write_line("specav: " + "; ".join(parts))
