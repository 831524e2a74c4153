"""The training_dnas bench suite runs on tiny sizes (timings are never asserted)."""
import math

import pytest

from attnopt.bench import BenchContext


def test_suite_runs_on_tiny_sizes(monkeypatch):
    pytest.importorskip("attnopt.models")
    from attnopt.bench.training_dnas import suite

    import torch

    monkeypatch.setenv("ATTNOPT_BENCH_TRAIN_DN_SIZES", "16")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: no thread spin-up on a shared machine
    try:
        rows = list(suite(BenchContext(quick=True, memory=False, repeat=1)))
    finally:
        torch.set_num_threads(threads)
    assert [r.impl for r in rows] == ["lnas", "dnas", "hnas"]
    assert [r.baseline for r in rows] == [True, False, False]
    assert all(math.isfinite(r.seconds) and r.seconds > 0 and r.extra["cpu_s"] >= 0 for r in rows)
