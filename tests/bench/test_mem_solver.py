"""The mem_solver bench suite runs on its quick sizes and reports sane rows (no timing asserts)."""
from attnopt.bench import BenchContext, mem_solver
from attnopt.bench.mem_solver import gradient_ascent, make_layer, suite
from attnopt.dual import solve_mem


def test_suite_quick_rows(monkeypatch):
    monkeypatch.setattr(mem_solver, "_sizes", lambda ctx: (2, 4, 6, 9))  # tiny layer
    rows = list(suite(BenchContext(quick=True, memory=False, repeat=1)))
    assert [m.impl for m in rows] == ["gradient ascent", "solve_mem (Newton)", "scipy L-BFGS-B per query"]
    assert sum(m.baseline for m in rows) == 1 and rows[0].baseline
    assert len({m.case for m in rows}) == 1
    assert rows[1].extra["converged"] is True
    assert all(m.seconds > 0 for m in rows)


def test_gradient_ascent_baseline_converges_on_a_small_layer():
    T, z = make_layer(2, 3, 5, 7)
    it, gnorm, hist = gradient_ascent(T, z, 1.0, 1e-9, 5000)
    assert float(gnorm.max()) <= 1e-9 and hist[-1] < hist[0] and it > 1
    assert solve_mem(T, z, tol=1e-9).converged
