"""The one error type of the benchmarks."""

from __future__ import annotations


class BenchError(ValueError):
    """Bad benchmark input, or a router/worker that cannot be benchmarked (unreachable...)."""
