"""Benchmarks, run from the repository root as `python -m bench.<name>`; bench.harness holds what they share."""
