"""The small_n bench suite runs on tiny sizes and reports the path ``auto`` chose (timings never asserted)."""
import math

from attnopt.bench import BenchContext, small_n
from attnopt.functional import dispatch


def test_suite_runs_and_notes_the_dispatch(monkeypatch):
    monkeypatch.setattr(small_n, "_cases", lambda ctx: [(1, 16)])  # noqa: ARG005
    rows = list(small_n.suite(BenchContext(quick=False, memory=False, repeat=1)))
    cases = {r.case for r in rows}
    assert len(cases) == 2  # fwd, fwd+bwd
    for case in cases:
        group = [r for r in rows if r.case == case]
        assert sum(r.baseline for r in group) == 1
        assert all(math.isfinite(r.seconds) and r.seconds > 0 for r in group)
        names = {r.impl for r in group}
        for name, key in small_n.DISPATCHED.items():
            auto = next(r for r in group if r.impl == name)
            assert auto.note.startswith("auto -> materialized")  # 8·16² entries: below every crossover
            assert f"{name} [streaming]" in names
            assert str(dispatch.CROSSOVERS[key]["float32"]) in auto.note
