"""Bench harness: timing, subprocess memory probe, ratios against the baseline, suite registry."""
import pytest

from attnopt.bench import BenchContext, Measurement, all_suites, peak_memory_mb, time_call
from attnopt.bench._runner import ratio_rows, run_bench


def big_allocation(mb: int):
    """Memory-probe factory used by the test: allocates ``mb`` MB when run."""
    import torch

    def run():
        x = torch.ones(mb * 2**20 // 4)
        x.add_(1)

    return run


def test_time_call_counts_calls():
    calls = []
    t = time_call(lambda: calls.append(1), repeat=3, warmup=2)
    assert len(calls) == 5 and t >= 0


def test_peak_memory_sees_an_allocation():
    large = peak_memory_mb("tests.bench.test_harness:big_allocation", {"mb": 200})
    assert 150 < large < 400


def test_peak_memory_reports_a_failing_factory():
    with pytest.raises(RuntimeError, match="memory probe"):
        peak_memory_mb("tests.bench.test_harness:does_not_exist", {})


def test_ratio_rows():
    rows = ratio_rows([
        Measurement("s", "c", "peer", 2.0, 10.0, baseline=True),
        Measurement("s", "c", "ours", 1.0, 5.0),
    ])
    assert rows[0][4] == 1.0 and rows[1][4] == 0.5 and rows[1][6] == 0.5


def test_generalized_suite_runs_quick(tmp_path, monkeypatch):
    from attnopt.bench import generalized

    monkeypatch.setattr(generalized, "_cases", lambda ctx: [32])
    assert "generalized" in all_suites()
    out = tmp_path / "bench.md"
    ms = run_bench(BenchContext(quick=True, memory=False, repeat=1), only="generalized", out=out,
                   echo=lambda s: None)
    assert {m.impl for m in ms} >= {"sdpa", "generalized_attention"}
    assert all(m.seconds > 0 for m in ms)
    assert "generalized_attention" in out.read_text()
    with pytest.raises(ValueError, match="unknown bench suite"):
        all_suites("nope")
