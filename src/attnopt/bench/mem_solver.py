"""Bench rows for the exact MEM / Fenchel-dual solver (fenchel-dual-attention eq. 7).

One BERT-small layer's worth of dual problems: 12 heads × 128 queries × 128 templates ×
d = 384, float64, solved to ‖∇‖₂ ≤ 1e-6 (quick: 4 × 32 × 32 × 96). Templates are
``x/√d'`` with ``x ~ N(0, I)`` and ``d' = 32`` (the paper's reparameterization (19)), the
evidence is scaled so that the logits ``<t, z>`` have a standard deviation of about 2.

* ``gradient ascent`` (baseline; the paper's method): batched over all problems, fixed step
  ``1/L`` with ``L = 1/α + maxᵢ‖tᵢ − t̄‖²`` (a bound on the Hessian norm), started at ``αz``.
  Iterations are capped; if the cap is hit, the time to reach the tolerance is extrapolated
  from the measured linear rate (said in the note).
* ``solve_mem``: our batched damped Newton (one call for the whole layer).
* ``scipy L-BFGS-B per query``: ``scipy.optimize.minimize`` with the analytic gradient, one
  problem at a time; a subset of problems is timed and the total extrapolated (note).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np
import torch

from attnopt.bench._harness import BenchContext, Measurement, bench_suite, peak_memory_mb, time_call
from attnopt.dual.mem import solve_mem

TOL = 1e-6
ALPHA = 1.0


def make_layer(heads: int, nq: int, n: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``templates (1, H, 1, n, d)`` and ``z (1, H, Nq, d)`` in float64 (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    T = torch.randn(1, heads, 1, n, d, generator=g, dtype=torch.float64) / math.sqrt(32)
    z = torch.randn(1, heads, nq, d, generator=g, dtype=torch.float64)
    z = z * (2.0 / float(T.norm(dim=-1).mean()))
    return T, z


def _sizes(ctx: BenchContext) -> tuple[int, int, int, int]:
    return (4, 32, 32, 96) if ctx.quick else (12, 128, 128, 384)


def gradient_ascent(
    T: torch.Tensor, z: torch.Tensor, alpha: float, tol: float, max_iter: int
) -> tuple[int, torch.Tensor, list[float]]:
    """Plain batched gradient ascent on the dual; returns (iterations, grad norms, max-norm history).

    ``T (B, H, 1, n, d)`` is shared by the queries of ``z (B, H, Nq, d)``.
    """
    T = T.squeeze(-3)  # (B, H, n, d): matmuls broadcast over the Nq rows of z without copies
    Tt = T.transpose(-1, -2)
    b = T.mean(-2, keepdim=True) + z  # uniform preference: μ = mean template
    spread = (T - T.mean(-2, keepdim=True)).norm(dim=-1).amax(-1)[..., None, None]  # (B, H, 1, 1)
    step = 1.0 / (1.0 / alpha + spread.square())
    lam = alpha * z
    history: list[float] = []
    gnorm = torch.full(z.shape[:-1], math.inf, dtype=z.dtype)
    it = 0
    for it in range(max_iter + 1):
        p = torch.softmax(lam @ Tt, dim=-1)
        g = b - lam / alpha - p @ T
        gnorm = g.norm(dim=-1)
        history.append(float(gnorm.max()))
        if history[-1] <= tol or it == max_iter:
            break
        lam = lam + step * g
    return it, gnorm, history


def _scipy_one(T: np.ndarray, z: np.ndarray, alpha: float, tol: float) -> float:
    import scipy.optimize as so
    from scipy.special import logsumexp, softmax

    b = T.mean(0) + z

    def neg(lam: np.ndarray) -> tuple[float, np.ndarray]:
        s = T @ lam
        g = b - lam / alpha - softmax(s) @ T
        return -(lam @ b - lam @ lam / (2 * alpha) - logsumexp(s)), -g

    res = so.minimize(neg, alpha * z, jac=True, method="L-BFGS-B",
                      options={"gtol": tol / math.sqrt(T.shape[1]), "ftol": 0.0, "maxiter": 10_000})
    return float(np.linalg.norm(neg(res.x)[1]))


def memory_factory(heads: int, nq: int, n: int, d: int) -> object:
    """Inputs for the memory probe; returns the ``solve_mem`` closure."""
    T, z = make_layer(heads, nq, n, d)
    return lambda: solve_mem(T, z, alpha=ALPHA, tol=TOL)


@bench_suite("mem_solver")
def suite(ctx: BenchContext) -> Iterator[Measurement]:
    """solve_mem vs gradient ascent (baseline) vs scipy per query, one layer, float64, tol 1e-6."""
    heads, nq, n, d = _sizes(ctx)
    T, z = make_layer(heads, nq, n, d)
    case = f"H={heads} Nq={nq} n={n} d={d} f64 tol={TOL:g}"
    problems = heads * nq

    # gradient ascent (baseline)
    cap = 3000 if ctx.quick else 400
    t0 = time.perf_counter()
    it, gnorm, hist = gradient_ascent(T, z, ALPHA, TOL, cap)
    ga_secs = time.perf_counter() - t0
    reached = hist[-1] <= TOL
    note = f"{it} iterations, max grad {hist[-1]:.1e}"
    if not reached:
        k = max(1, len(hist) // 2)  # linear rate over the second half of the run
        rate = (hist[-1] / hist[k]) ** (1.0 / max(1, len(hist) - 1 - k))
        need = it + (math.log(TOL / hist[-1]) / math.log(rate) if 0 < rate < 1 else math.inf)
        note += f"; cap hit, extrapolated to {need:.0f} iterations at the measured rate {rate:.5f}/it"
        ga_secs = ga_secs * need / max(it, 1)
    yield Measurement("mem_solver", case, "gradient ascent", ga_secs, baseline=True, note=note,
                      extra={"iterations": it, "reached_tol": reached})

    # ours
    repeat = 2 if ctx.quick else max(2, ctx.repeat // 2)
    sol = solve_mem(T, z, alpha=ALPHA, tol=TOL)
    secs = time_call(lambda: solve_mem(T, z, alpha=ALPHA, tol=TOL), repeat=repeat)
    peak = None
    if ctx.memory:
        peak = peak_memory_mb("attnopt.bench.mem_solver:memory_factory",
                              {"heads": heads, "nq": nq, "n": n, "d": d})
    yield Measurement(
        "mem_solver", case, "solve_mem (Newton)", secs, peak,
        note=(f"{sol.iterations} Newton its, converged={sol.converged}, "
              f"max grad {float(sol.grad_norm.max()):.1e}"),
        extra={"iterations": sol.iterations, "converged": sol.converged},
    )

    # scipy per query, a subset timed and extrapolated
    try:
        import scipy  # noqa: F401
    except ImportError:
        return
    subset = 8 if ctx.quick else 24
    Tn = T[0, :, 0].numpy()
    zn = z[0].numpy()
    idx = [(i % heads, (i * 7) % nq) for i in range(subset)]
    t0 = time.perf_counter()
    worst = max(_scipy_one(Tn[h], zn[h, q], ALPHA, TOL) for h, q in idx)
    per = (time.perf_counter() - t0) / subset
    yield Measurement(
        "mem_solver", case, "scipy L-BFGS-B per query", per * problems,
        note=(f"{subset} of {problems} problems timed, extrapolated ×{problems // subset}; "
              f"max grad {worst:.1e}"),
    )
