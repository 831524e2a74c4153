"""The dual_deviation bench suite runs on tiny sizes and its three rows agree (no timing asserts)."""
from attnopt.bench import BenchContext
from attnopt.bench import dual_deviation as bench


def test_suite_tiny_rows(monkeypatch):
    monkeypatch.setattr(bench, "_sizes", lambda ctx: (2, 5, 2, 12))
    rows = list(bench.suite(BenchContext(quick=True, memory=False, repeat=1)))
    names = ["solve_mem, full d", "dual_deviation (solve_mem)", "dual_deviation (shared)"]
    assert [m.impl for m in rows] == names
    assert sum(m.baseline for m in rows) == 1 and rows[0].baseline and len({m.case for m in rows}) == 1
    assert all(m.seconds > 0 for m in rows)
    assert all(m.extra["max_abs_diff"] < 1e-8 for m in rows)  # same deviations from every path
