"""Benchmarks: programs that print tables and ratios measured in one run."""
