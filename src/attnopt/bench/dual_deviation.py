"""Bench rows for the Sec. 8 dual-deviation solve (what ``attnopt analyze`` spends its time on).

One MiniLM-sized layer: ``B`` sentences of ``n`` tokens, ``H`` heads, model width ``d``;
eq. (19) gives templates ``t = x/√d'`` shared by a sentence's heads and queries and one
evidence ``z`` per head and query (``B·H·n`` dual problems). Float64, tolerance 1e-8,
padding-free, uniform ``u``.

* ``solve_mem, full d`` (baseline, the direct way): :func:`attnopt.dual.solve_mem` on
  ``(t, z, u)`` in ``R^d`` (its own low-rank Newton since ``n < d``).
* ``dual_deviation (solve_mem)``: :func:`attnopt.analysis.dual_deviation`: exact reduction
  to the ``≤ n``-dimensional span of the templates, then ``solve_mem``.
* ``dual_deviation (shared)``: the same reduction with the chord-Newton solver that shares
  the templates' outer products across heads and queries.
All three return the same deviations (checked: ``max_abs_diff`` in ``extra``).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from attnopt.analysis.dual_deviation import DualMapping, dual_deviation, eq19_mapping
from attnopt.bench._harness import BenchContext, Measurement, bench_suite, peak_memory_mb, time_call
from attnopt.dual import solve_mem

TOL = 1e-8


def _sizes(ctx: BenchContext) -> tuple[int, int, int, int]:
    """``(B, n, H, d)``."""
    return (4, 16, 4, 96) if ctx.quick else (16, 32, 12, 384)


def make_mapping(b: int, n: int, heads: int, d: int, seed: int = 0) -> DualMapping:
    """A random eq. (19) mapping with logits of standard deviation about 2."""
    g = torch.Generator().manual_seed(seed)
    hd = d // heads
    x = torch.randn(b, n, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, heads, n, hd, generator=g, dtype=torch.float64)
    wk = torch.randn(heads * hd, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    return eq19_mapping(x, q, wk, scaling=2.0 / math.sqrt(hd))


def _full(mp: DualMapping) -> torch.Tensor:
    sol = solve_mem(mp.templates[:, None, None], mp.z, preference=mp.log_preference.exp(), tol=TOL)
    return (sol.lam - mp.z).norm(dim=-1) / sol.lam.norm(dim=-1)


def factory(impl: str, b: int, n: int, heads: int, d: int) -> Any:
    """Memory-probe factory: build the layer, return the zero-argument call of ``impl``."""
    mp = make_mapping(b, n, heads, d)
    if impl == "full":
        return lambda: _full(mp)
    return lambda: dual_deviation(mp, tol=TOL, solver=impl)  # "solve_mem" or "shared"


@bench_suite("dual_deviation")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    b, n, heads, d = _sizes(ctx)
    mp = make_mapping(b, n, heads, d)
    case = f"B={b} n={n} H={heads} d={d} ({b * heads * n} problems)"
    ref = _full(mp)
    impls = (("solve_mem, full d", "full", True), ("dual_deviation (solve_mem)", "solve_mem", False),
             ("dual_deviation (shared)", "shared", False))
    for name, impl, base in impls:
        def fn(impl: str = impl) -> Any:
            return _full(mp) if impl == "full" else dual_deviation(mp, tol=TOL, solver=impl)

        diff = 0.0 if impl == "full" else float((fn().deviation - ref).abs().max())
        seconds = time_call(fn, repeat=max(1, ctx.repeat // 2 if not ctx.quick else 1), device="cpu")
        peak = None
        if ctx.memory:
            peak = peak_memory_mb("attnopt.bench.dual_deviation:factory",
                                  {"impl": impl, "b": b, "n": n, "heads": heads, "d": d})
        yield Measurement("dual_deviation", case, name, seconds, peak_mb=peak, baseline=base,
                          note="float64, tol 1e-8", extra={"max_abs_diff": diff})
