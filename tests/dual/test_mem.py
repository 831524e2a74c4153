"""Exact MEM / Fenchel-dual solver: vs scipy (dual and primal), paths, batching, closed forms."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnopt.dual import (
    approx_lambda,
    gaussian_mem,
    mem_dual_objective,
    mem_primal_objective,
    solve_mem,
)
from attnopt.dual._mem_batch import canonicalize
from attnopt.functional._thresholds import THRESHOLDS
from tests.reference.mem import dual_oracle, primal_objective, primal_oracle

F64 = torch.float64


def _instance(n, d, seed, *, zero=False, batch=()):
    g = torch.Generator().manual_seed(seed)
    T = torch.randn(*batch, n, d, generator=g, dtype=F64)
    z = torch.randn(*batch, d, generator=g, dtype=F64)
    u = torch.rand(*batch, n, generator=g, dtype=F64) + 0.05
    if zero and n > 1:
        u[..., 0] = 0.0
    return T, z, u


CASES = [(1, 3), (3, 2), (5, 8), (8, 3), (12, 5)]


@pytest.mark.parametrize("n,d", CASES)
@pytest.mark.parametrize("alpha", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("zero", [False, True])
def test_matches_scipy_dual(n, d, alpha, zero):
    T, z, u = _instance(n, d, seed=n * 31 + d, zero=zero)
    sol = solve_mem(T, z, preference=u, alpha=alpha, tol=1e-11)
    assert sol.converged and float(sol.grad_norm) <= 1e-11
    ref = dual_oracle(T.numpy(), z.numpy(), u.numpy(), alpha)
    np.testing.assert_allclose(sol.lam.numpy(), ref, atol=1e-7, rtol=1e-7)
    assert torch.all(sol.weights[u == 0] == 0)
    torch.testing.assert_close(sol.weights.sum(), torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(sol.h, sol.weights @ T)


@pytest.mark.parametrize("n,d", [(3, 2), (5, 8), (8, 3)])
@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_theorem1_primal_equals_dual(n, d, alpha):
    """Theorem 1: the recovered p̃ solves the primal (3) and the optimal values coincide."""
    T, z, u = _instance(n, d, seed=7 + n, zero=True)
    sol = solve_mem(T, z, preference=u, alpha=alpha, tol=1e-12)
    p_star = primal_oracle(T.numpy(), z.numpy(), u.numpy(), alpha)
    np.testing.assert_allclose(sol.weights.numpy(), p_star, atol=1e-6)
    primal = float(mem_primal_objective(sol.weights, T, z, preference=u, alpha=alpha))
    dual = float(mem_dual_objective(sol.lam, T, z, preference=u, alpha=alpha))
    assert primal == pytest.approx(dual, abs=1e-10)
    assert primal == pytest.approx(primal_objective(p_star, T.numpy(), z.numpy(), u.numpy(), alpha), abs=1e-9)


@pytest.mark.parametrize("n,d", [(4, 9), (9, 4)])
@pytest.mark.parametrize("force_cg", [False, True])
def test_lowrank_equals_dense(n, d, force_cg, monkeypatch):
    if force_cg:  # route every low-rank solve through conjugate gradients
        monkeypatch.setattr(THRESHOLDS, "mem_direct_max_entries", 0)
    T, z, u = _instance(n, d, seed=3, batch=(2, 3))
    a = solve_mem(T, z, preference=u, alpha=1.5, method="lowrank", tol=1e-11)
    b = solve_mem(T, z, preference=u, alpha=1.5, method="dense", tol=1e-11)
    assert a.converged and b.converged
    torch.testing.assert_close(a.lam, b.lam, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(a.weights, b.weights, atol=1e-10, rtol=1e-9)
    l2a = approx_lambda(T, z, preference=u, alpha=1.5, order=2)
    assert l2a.shape == a.lam.shape


def test_batched_equals_looped_and_templates_not_copied():
    g = torch.Generator().manual_seed(11)
    B, H, Nq, n, d = 2, 3, 4, 5, 7
    T = torch.randn(B, H, 1, n, d, generator=g, dtype=F64)  # shared by the Nq queries
    z = torch.randn(B, H, Nq, d, generator=g, dtype=F64)
    prefs = (torch.rand(B, H, Nq, n, generator=g, dtype=F64), torch.rand(B, H, 1, n, generator=g, dtype=F64))
    cb = canonicalize(T, z, None, (B, H, Nq))  # one template set per head, shared by the queries
    assert cb.T.shape == (B * H, n, d) and cb.z.shape == (B * H, Nq, d)
    torch.testing.assert_close(cb.restore(cb.z), z)
    for pref in prefs:
        sol = solve_mem(T, z, preference=pref, alpha=0.8, tol=1e-11)
        assert sol.lam.shape == (B, H, Nq, d) and sol.weights.shape == (B, H, Nq, n)
        assert sol.grad_norm.shape == (B, H, Nq)
        for b in range(B):
            for h in range(H):
                for i in range(Nq):
                    one = solve_mem(T[b, h, 0], z[b, h, i], preference=pref[b, h, min(i, pref.shape[2] - 1)],
                                    alpha=0.8, tol=1e-11)
                    torch.testing.assert_close(sol.lam[b, h, i], one.lam, atol=1e-9, rtol=1e-9)
                    torch.testing.assert_close(sol.weights[b, h, i], one.weights, atol=1e-10, rtol=1e-9)


def test_broadcast_templates_first_and_batched_templates():
    T, z, u = _instance(4, 6, seed=5, batch=(3,))
    sol = solve_mem(T, z, preference=u, alpha=1.0)  # one template set per problem (Q = 1)
    for i in range(3):
        torch.testing.assert_close(sol.lam[i], solve_mem(T[i], z[i], preference=u[i]).lam)
    zz = torch.randn(5, 6, dtype=F64)
    sol2 = solve_mem(T[0], zz, alpha=1.0)  # (n, d) templates shared by 5 evidences
    assert sol2.lam.shape == (5, 6)
    torch.testing.assert_close(sol2.lam[2], solve_mem(T[0], zz[2]).lam)


@pytest.mark.parametrize("n,d", [(5, 8), (8, 3)])
def test_float32_and_half(n, d):
    T, z, u = _instance(n, d, seed=2, batch=(4,))
    ref = solve_mem(T, z, preference=u, alpha=1.0, tol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # default tol is floored at float32 resolution: no warning
        s32 = solve_mem(T.float(), z.float(), preference=u.float(), alpha=1.0)
    assert s32.converged and s32.lam.dtype == torch.float32
    torch.testing.assert_close(s32.lam.double(), ref.lam, atol=1e-4, rtol=1e-4)
    s16 = solve_mem(T.half(), z.half(), preference=u.half(), alpha=1.0)
    assert s16.lam.dtype == torch.float16 and torch.isfinite(s16.lam).all()
    torch.testing.assert_close(s16.weights.double(), ref.weights, atol=5e-3, rtol=5e-2)


def test_gaussian_closed_form_vs_discretized_solver():
    """Sec. 5: u = N(μ, I) approximated by a fine grid; the solver reproduces the closed form."""
    mu = torch.tensor([0.3, -0.2], dtype=F64)
    z = torch.tensor([0.8, 0.5], dtype=F64)
    ax = torch.arange(-7.0, 7.0 + 1e-9, 0.2, dtype=F64)
    grid = torch.cartesian_prod(ax, ax) + mu
    u = torch.exp(-0.5 * ((grid - mu) ** 2).sum(-1))
    for alpha in (0.5, 2.0):
        sol = solve_mem(grid, z, preference=u, alpha=alpha, tol=1e-10)
        closed = gaussian_mem(mu, mu + z, alpha)
        torch.testing.assert_close(sol.lam, closed.lam, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sol.h, closed.h, atol=1e-6, rtol=1e-6)
    g = gaussian_mem(mu, mu + z, 1.0)
    torch.testing.assert_close(g.h, mu + z / 2)


def test_approximation_orders_as_alpha_shrinks():
    """Eq. (14) has error O(α²), eq. (13) O(α³): halving α divides them by ≈4 and ≈8."""
    T, z, u = _instance(6, 4, seed=0)
    alphas = [0.04, 0.02, 0.01]
    e1, e2 = [], []
    for a in alphas:
        lam = solve_mem(T, z, preference=u, alpha=a, tol=1e-14).lam
        e1.append(float((approx_lambda(T, z, preference=u, alpha=a, order=1) - lam).norm()))
        e2.append(float((approx_lambda(T, z, preference=u, alpha=a, order=2) - lam).norm()))
    slope1 = math.log(e1[0] / e1[-1]) / math.log(alphas[0] / alphas[-1])
    slope2 = math.log(e2[0] / e2[-1]) / math.log(alphas[0] / alphas[-1])
    assert 1.8 < slope1 < 2.2
    assert 2.7 < slope2 < 3.3
    assert all(b < a for a, b in zip(e1, e2))


def test_zero_preference_equals_truncation():
    T, z, u = _instance(6, 4, seed=9)
    u[[1, 4]] = 0.0
    keep = torch.tensor([0, 2, 3, 5])
    full = solve_mem(T, z, preference=u, alpha=1.3, tol=1e-12)
    trunc = solve_mem(T[keep], z, preference=u[keep], alpha=1.3, tol=1e-12)
    torch.testing.assert_close(full.lam, trunc.lam)
    torch.testing.assert_close(full.weights[keep], trunc.weights)


@given(
    n=st.integers(1, 6), d=st.integers(1, 6), seed=st.integers(0, 10_000),
    scale=st.floats(0.1, 10.0), alpha=st.floats(0.05, 5.0),
)
def test_properties(n, d, seed, scale, alpha):
    T, z, u = _instance(n, d, seed)
    sol = solve_mem(T, z, preference=u, alpha=alpha, tol=1e-10)
    assert sol.converged
    assert torch.all(sol.weights >= 0)
    torch.testing.assert_close(sol.weights.sum(), torch.tensor(1.0, dtype=F64))
    # invariance to scaling u; equivariance to permuting templates
    torch.testing.assert_close(solve_mem(T, z, preference=u * scale, alpha=alpha, tol=1e-10).lam, sol.lam)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    sp = solve_mem(T[perm], z, preference=u[perm], alpha=alpha, tol=1e-10)
    torch.testing.assert_close(sp.lam, sol.lam)
    torch.testing.assert_close(sp.weights, sol.weights[perm])
    # optimality condition g(λ*) = 0  <=>  ĥ = μ + z − λ*/α
    ub = u / u.sum()
    torch.testing.assert_close(sol.h, ub @ T + z - sol.lam / alpha, atol=1e-8, rtol=1e-8)


def test_non_convergence_warns():
    T, z, u = _instance(5, 8, seed=1)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        sol = solve_mem(T, z * 20, preference=u, alpha=5.0, tol=1e-14, max_iter=1)
    assert not sol.converged and sol.iterations == 1
    assert float(sol.grad_norm) > 1e-14


def test_bad_inputs():
    T, z, u = _instance(3, 2, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        solve_mem(T, z, alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        solve_mem(T, z, alpha=-1.0)
    with pytest.raises(ValueError, match="preference"):
        solve_mem(T, z, preference=-u)
    with pytest.raises(ValueError, match="preference"):
        solve_mem(T, z, preference=torch.zeros_like(u))
    with pytest.raises(ValueError, match="preference"):
        solve_mem(T, z, preference=u[:2])
    with pytest.raises(ValueError, match="z"):
        solve_mem(T, z[:1])
    with pytest.raises(ValueError, match="broadcast"):
        solve_mem(T.expand(2, 3, 2), z.expand(3, 2))
    with pytest.raises(ValueError, match="tol"):
        solve_mem(T, z, tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        solve_mem(T, z, max_iter=0)
    with pytest.raises(ValueError, match="method"):
        solve_mem(T, z, method="cholesky")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="order"):
        approx_lambda(T, z, order=3)
    with pytest.raises(TypeError, match="templates"):
        solve_mem(T.long(), z)
    with pytest.raises(ValueError, match="templates"):
        solve_mem(T.clone().fill_(float("nan")), z)
    with pytest.raises(ValueError, match="alpha"):
        gaussian_mem(z, z, 0.0)
