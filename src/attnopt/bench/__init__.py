"""``attnopt bench``: our speed and memory side by side with the reference peers.

Suites live in this package, one module per mechanism, registered with
:func:`attnopt.bench.bench_suite`; they are discovered automatically.
"""
from attnopt.bench._harness import (
    BenchContext,
    Measurement,
    all_suites,
    bench_suite,
    forward_backward,
    peak_memory_mb,
    time_call,
)

__all__ = [
    "BenchContext",
    "Measurement",
    "all_suites",
    "bench_suite",
    "forward_backward",
    "peak_memory_mb",
    "time_call",
]
