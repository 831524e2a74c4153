"""The training_dnas bench suite runs on tiny sizes (timings are never asserted)."""
import math

import pytest

from attnopt.bench import BenchContext


def test_suite_runs_on_tiny_sizes(monkeypatch):
    pytest.importorskip("attnopt.models")
    from attnopt.bench.training_dnas import suite

    monkeypatch.setenv("ATTNOPT_BENCH_TRAIN_DN_SIZES", "16")
    rows = list(suite(BenchContext(quick=True, memory=False, repeat=1)))
    assert [r.impl for r in rows] == ["lnas", "dnas", "hnas"]
    assert [r.baseline for r in rows] == [True, False, False]
    assert all(math.isfinite(r.seconds) and r.seconds > 0 and r.extra["cpu_s"] >= 0 for r in rows)
