"""The input_checks bench suite runs on tiny sizes (timings are never asserted)."""
from attnopt.bench import BenchContext, all_suites
from attnopt.bench.input_checks import suite


def test_suite_rows_and_registration():
    rows = list(suite(BenchContext(quick=True, memory=False, repeat=1)))
    assert {m.case for m in rows} == {"N=16 fwd float32", "N=256 fwd float32"}
    assert sum(m.baseline for m in rows) == 2 and all(m.seconds > 0 for m in rows)
    assert "input_checks" in all_suites()
