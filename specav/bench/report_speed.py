"""Benchmark: how long the evaluation report takes on a large synthetic slot log.

    python -m specav.bench.report_speed --rows 1000000

Writes a synthetic log (slot_log.write_synthetic_slot_log) into a temporary directory,
runs evaluation.report.build_report on it, and prints the wall time of each stage.
Goal: the report of 1,000,000 labelled slots in under 60 s on a 2-core machine.
This program owns no logic of its own; it must not import models or the engine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from specav.evaluation.metrics import DEFAULT_BINS
from specav.evaluation.report import build_report
from specav.evaluation.slot_log import write_synthetic_slot_log

GOAL_SECONDS = 60.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specav.bench.report_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="labelled slots in the synthetic log")
    parser.add_argument("--hidden-dim", type=int, default=64,
                        help="hidden-state width logged per slot (0: no hidden column, no head fit)")
    parser.add_argument("--bins", type=int, default=DEFAULT_BINS, help="ECE / reliability bins")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="write log and report here instead of a temp dir")
    args = parser.parse_args(argv)
    if args.rows < 1000:
        parser.error(f"--rows {args.rows} is too small: allowed >= 1000")
    if args.hidden_dim < 0:
        parser.error(f"--hidden-dim {args.hidden_dim} is invalid: allowed 0 (none) or a positive width")
    return args


def run(rows: int, hidden_dim: int | None, bins: int, seed: int, root: Path) -> tuple[float, float]:
    """(seconds to write the synthetic log, seconds to build the report) in directory `root`."""
    start = time.perf_counter()
    write_synthetic_slot_log(root / "log", rows, seed=seed, hidden_dim=hidden_dim)
    written = time.perf_counter()
    build_report(root / "log", root / "report", bins=bins, seed=seed)
    return written - start, time.perf_counter() - written


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    hidden = args.hidden_dim or None
    with tempfile.TemporaryDirectory(prefix="specav-report-speed-") as tmp:
        root = args.keep or Path(tmp)
        write_s, report_s = run(args.rows, hidden, args.bins, args.seed, root)
    print(f"synthetic slot log: {args.rows:,} labelled slots, hidden_dim={hidden}, bins={args.bins}")
    print(f"{'stage':<28}{'seconds':>10}{'slots/s':>14}")
    for stage, seconds in (("write synthetic log", write_s), ("build_report", report_s)):
        print(f"{stage:<28}{seconds:>10.2f}{args.rows / seconds:>14,.0f}")
    verdict = "OK" if report_s < GOAL_SECONDS else "OVER GOAL"
    print(f"report wall time: {report_s:.2f} s for {args.rows:,} rows "
          f"(goal < {GOAL_SECONDS:.0f} s, {report_s / GOAL_SECONDS:.2f} of goal): {verdict}")
    if args.keep:
        print(f"log and report kept in {args.keep}")


if __name__ == "__main__":
    main()
