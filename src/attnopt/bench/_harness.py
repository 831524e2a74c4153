"""Timing and peak-memory measurement for ``attnopt bench``.

Every row of a suite times our implementation and its peers in the same process on the
same inputs; the ratio to the row group's baseline is what we report. Peak memory is
measured in a fresh subprocess (peak RSS on CPU via ``/proc/self/status`` VmHWM after a
reset, ``torch.cuda.max_memory_allocated`` on a GPU), minus the memory held before the call.
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BenchContext",
    "Measurement",
    "bench_suite",
    "all_suites",
    "time_call",
    "peak_memory_mb",
    "forward_backward",
]


@dataclass(frozen=True)
class BenchContext:
    """Settings for a benchmark run.

    Attributes:
        quick: smaller sizes / fewer repeats (seconds, not minutes).
        device: ``"cpu"`` or ``"cuda"``.
        memory: also measure peak memory in fresh subprocesses (slower).
        repeat: timed repetitions per measurement (the median is reported).
        threads: the most CPU threads any row may use (``attnopt bench --threads``); ``None``:
            no limit (suites that compare thread counts run each of theirs).
    """

    quick: bool = False
    device: str = "cpu"
    memory: bool = True
    repeat: int = 5
    threads: int | None = None

    def thread_counts(self, wanted: Iterable[int]) -> list[int]:
        """The thread counts of ``wanted`` within :attr:`threads` (just ``[threads]`` if none is)."""
        wanted = list(wanted)
        if self.threads is None:
            return wanted
        return [t for t in wanted if t <= self.threads] or [self.threads]


@dataclass
class Measurement:
    """One timed implementation on one case.

    ``group`` identifies the comparison (suite + case); the measurement with
    ``baseline=True`` in a group is the denominator of the ratios printed for that group.
    """

    suite: str
    case: str
    impl: str
    seconds: float
    peak_mb: float | None = None
    baseline: bool = False
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


SuiteFn = Callable[[BenchContext], Iterable[Measurement]]
_SUITES: dict[str, SuiteFn] = {}


def bench_suite(name: str) -> Callable[[SuiteFn], SuiteFn]:
    """Register a benchmark suite under ``name`` (modules in ``attnopt.bench`` are discovered)."""

    def register(fn: SuiteFn) -> SuiteFn:
        _SUITES[name] = fn
        return fn

    return register


def all_suites(only: str | None = None) -> dict[str, SuiteFn]:
    """Registered suites, optionally restricted to the comma-separated names in ``only``."""
    import pkgutil

    import attnopt.bench as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"attnopt.bench.{info.name}")
    if only is None:
        return dict(_SUITES)
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in _SUITES]
    if unknown:
        raise ValueError(f"unknown bench suite(s) {unknown}; available: {sorted(_SUITES)}")
    return {w: _SUITES[w] for w in wanted}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1, device: str = "cpu") -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    """A closure running ``fn(*inputs).sum().backward()`` (inputs must require grad)."""

    def run() -> None:
        for x in inputs:
            x.grad = None
        fn(*inputs).sum().backward()

    return run


def peak_memory_mb(
    factory: str, kwargs: dict[str, Any], *, device: str = "cpu", timeout: float = 600
) -> float:
    """Peak extra memory (MB) of one call, measured in a fresh Python process.

    Args:
        factory: ``"module:function"``; ``function(**kwargs)`` builds the inputs and returns
            a zero-argument callable; it is run once to warm up, then measured on a second
            run (a closure that calls backward should reset its inputs' ``.grad`` first).
        kwargs: JSON-serializable arguments of the factory.
        device: ``"cpu"`` (peak RSS) or ``"cuda"`` (``max_memory_allocated``).
    Raises:
        RuntimeError: the subprocess failed (its stderr is included).
    """
    cmd = [sys.executable, "-m", "attnopt.bench._memprobe", factory, json.dumps(kwargs), device]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    # A fixed mmap threshold turns off glibc's adaptive one, so blocks >= 128 KiB are always
    # mmapped and returned on free: the warm-up call cannot leave a retained heap that the
    # measured call then reuses unseen.
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe {factory} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])
