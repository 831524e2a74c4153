"""True preference (eq. 37–38) vs loops and POT; OT-MEM Newton solver (eq. 35–36) vs scipy."""
from __future__ import annotations

import warnings

import numpy as np
import ot as pot
import pytest
import torch
from scipy.optimize import minimize

from attnopt import ot_attention, ot_weights
from attnopt.dual import OTMEMSolution, solve_ot_mem, true_preference
from tests.reference.ot import cost_matrix, dual_objective_reference, true_preference_reference

F64 = torch.float64


def _points(m=6, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g, dtype=F64)
    u = torch.rand(m, generator=g, dtype=F64)
    return x, u / u.sum()


def _w_gamma(p, u, m_cost, gamma):
    """Entropic OT value W_γ(p, u; M) = <M, X> − γ H(X) from POT's log-domain Sinkhorn plan."""
    plan, log = pot.sinkhorn(p, u, m_cost, gamma, method="sinkhorn_log", log=True, stopThr=1e-13,
                             numItermax=200_000)
    return float((m_cost * plan).sum() + gamma * (plan * np.log(plan)).sum()), gamma * log["log_u"]


@pytest.mark.parametrize("cost", ["sqeuclidean", "neg_dot"])
@pytest.mark.parametrize("gamma", [0.3, 1.0, 4.0])
def test_true_preference_matches_loops(cost, gamma):
    x, u = _points()
    u_t, mu_t = true_preference(x, u, cost=cost, gamma=gamma)
    m_cost = cost_matrix(x, x, cost)
    ref = true_preference_reference(x, u, m_cost, gamma)
    torch.testing.assert_close(u_t, ref)
    torch.testing.assert_close(mu_t, ref @ x)
    assert abs(float(u_t.sum()) - 1.0) < 1e-12


@pytest.mark.parametrize("gamma", [0.2, 1.0])
def test_true_preference_minimizes_entropic_ot_pot(gamma):
    x, u = _points(m=7, seed=1)
    m_cost = cost_matrix(x, x, "sqeuclidean").numpy()
    u_t = true_preference(x, u, cost="sqeuclidean", gamma=gamma)[0].numpy()
    w_star, potential = _w_gamma(u_t, u.numpy(), m_cost, gamma)
    # first-order optimality on the simplex: the dual potential of the free marginal is constant
    assert np.ptp(potential) < 1e-7
    rng = np.random.default_rng(0)
    for scale in (0.05, 0.5):
        for _ in range(4):
            p = u_t * np.exp(scale * rng.normal(size=u_t.shape))
            assert _w_gamma(p / p.sum(), u.numpy(), m_cost, gamma)[0] > w_star
    assert _w_gamma(u.numpy(), u.numpy(), m_cost, gamma)[0] > w_star  # u itself is not the minimizer


def test_true_preference_tends_to_u_and_is_ot_weights_at_zero_evidence():
    x, u = _points(m=5, seed=2)
    gammas = (1.0, 0.1, 0.001)
    errs = [float((true_preference(x, u, cost="sqeuclidean", gamma=g)[0] - u).abs().sum()) for g in gammas]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-8
    bank = torch.cat([x, torch.randn(3, 2, dtype=F64)])
    u_t, _ = true_preference(x, u, bank=bank, cost="sqeuclidean", gamma=0.5)
    w = ot_weights(torch.zeros(1, 2, dtype=F64), x, bank=bank, preference=u, cost="sqeuclidean", gamma=0.5)
    torch.testing.assert_close(u_t, w[0])


def _problem(b=2, nq=3, n=4, m=6, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, 1, nq, d, generator=g, dtype=F64)
    t = torch.randn(b, 1, n, d, generator=g, dtype=F64)
    a = torch.cat([t, torch.randn(b, 1, m - n, d, generator=g, dtype=F64)], dim=-2)
    u = torch.rand(b, 1, n, generator=g, dtype=F64)
    return z, t, a, u / u.sum(-1, keepdim=True)


@pytest.mark.parametrize("cost", ["sqeuclidean", "neg_dot"])
@pytest.mark.parametrize("alpha,gamma", [(0.5, 1.0), (3.0, 0.3)])
def test_solver_matches_scipy_on_the_dual(cost, alpha, gamma):
    z, t, a, u = _problem()
    sol = solve_ot_mem(z, t, bank=a, preference=u, cost=cost, alpha=alpha, gamma=gamma)
    assert isinstance(sol, OTMEMSolution) and sol.converged and sol.iterations <= 20
    m_cost = cost_matrix(a, t, cost)
    for bi in range(z.shape[0]):
        for k in range(z.shape[2]):
            args = (z[bi, 0, k], sol.mu_tilde[bi, 0], a[bi, 0], u[bi, 0], m_cost[bi, 0], alpha, gamma)

            def neg(lam, args=args):
                return -float(dual_objective_reference(torch.from_numpy(lam), *args))

            res = minimize(neg, np.zeros(z.shape[-1]), method="BFGS", options={"gtol": 1e-10})
            np.testing.assert_allclose(sol.lam[bi, 0, k].numpy(), res.x, atol=1e-5)
            assert abs(-res.fun - float(sol.objective[bi, 0, k])) < 1e-9
    # recovery (35) and stationarity: ĥ = Σ p*(a) a = μ̃ + z − λ*/α
    torch.testing.assert_close(sol.weights.sum(-1), torch.ones(2, 1, 3, dtype=F64))
    stationary = sol.mu_tilde.unsqueeze(-2) + z - sol.lam / alpha
    torch.testing.assert_close(sol.output, stationary, atol=1e-8, rtol=0)


def test_solver_agrees_with_eq22_when_alpha_and_ratio_small():
    z, t, a, u = _problem(seed=3)
    errs = []
    for alpha in (0.1, 0.01, 0.001):
        sol = solve_ot_mem(z, t, bank=a, preference=u, cost="sqeuclidean", alpha=alpha, gamma=1.0)
        approx = ot_attention(z, t, bank=a, preference=u, cost="sqeuclidean", alpha=alpha, gamma=1.0)
        errs.append(float((approx - sol.output).norm() / (sol.output - sol.mu_tilde.unsqueeze(-2)).norm()))
    assert errs[0] > errs[1] > errs[2] and errs[2] < 5e-3


def test_solver_batched_equals_single_and_zero_preference():
    z, t, a, u = _problem(b=2, nq=2)
    u[1, 0, 0] = 0.0
    sol = solve_ot_mem(z, t, bank=a, preference=u, cost="sqeuclidean", gamma=0.7)
    one = solve_ot_mem(z[1:, :, 1:], t[1:], bank=a[1:], preference=u[1:], cost="sqeuclidean", gamma=0.7)
    torch.testing.assert_close(sol.lam[1:, :, 1:], one.lam)
    dropped = solve_ot_mem(
        z[1:], t[1:, :, 1:], bank=a[1:], preference=u[1:, :, 1:], cost="sqeuclidean", gamma=0.7
    )
    torch.testing.assert_close(sol.lam[1:], dropped.lam)
    zero = solve_ot_mem(z, t, bank=a, preference=torch.zeros(4, dtype=F64), gamma=0.7)
    assert zero.converged and torch.all(zero.weights == 0) and torch.all(zero.output == 0)
    torch.testing.assert_close(zero.lam, z)


def test_solver_warns_when_not_converged_and_half_input():
    z, t, a, u = _problem()
    with pytest.warns(RuntimeWarning, match="did not converge"):
        sol = solve_ot_mem(z, t, bank=a, preference=u, alpha=50.0, gamma=0.01, max_iter=1, tol=1e-14)
    assert not sol.converged and sol.iterations == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        half = solve_ot_mem(z.half(), t.half(), bank=a.half(), preference=u.half(), gamma=2.0, tol=1e-6)
    assert half.lam.dtype == torch.float16 and torch.isfinite(half.output).all()


@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(tol=0.0), ValueError),
        (dict(max_iter=0), ValueError),
        (dict(max_iter=2.5), ValueError),
        (dict(alpha=-1.0), ValueError),
        (dict(cost="l1"), ValueError),
        (dict(preference=torch.ones(3, dtype=F64)), ValueError),
    ],
)
def test_solver_bad_inputs(kw, exc):
    z, t, a, _ = _problem()
    with pytest.raises(exc):
        solve_ot_mem(z, t, bank=a, **kw)


def test_true_preference_bad_inputs():
    x, u = _points()
    with pytest.raises(ValueError, match="symmetric"):
        true_preference(x, u, cost=torch.rand(6, 6, dtype=F64))
    with pytest.raises(ValueError, match="gamma"):
        true_preference(x, u, gamma=0.0)
    with pytest.raises(TypeError, match="templates"):
        true_preference(x.numpy(), u)


def test_analytic_gradient_and_hessian_match_autograd():
    from attnopt.dual.ot import _derivatives

    z, t, a, u = _problem(b=1, nq=1)
    alpha, gamma = 0.8, 0.6
    m_cost = cost_matrix(a, t, "sqeuclidean")
    _, mu_t = true_preference(t, u, bank=a, cost="sqeuclidean", gamma=gamma)
    lam = torch.randn(1, 1, 1, 3, dtype=F64, generator=torch.Generator().manual_seed(5))
    b = mu_t.unsqueeze(-2) + z
    obj, grad, neg_hess, _ = _derivatives(lam, b, a, -m_cost / gamma, u, alpha, gamma)
    args = (z[0, 0, 0], mu_t[0, 0], a[0, 0], u[0, 0], m_cost[0, 0], alpha, gamma)
    x = lam[0, 0, 0].clone()
    torch.testing.assert_close(obj[0, 0, 0], dual_objective_reference(x, *args))
    auto_grad = torch.autograd.functional.jacobian(lambda v: dual_objective_reference(v, *args), x)
    auto_hess = torch.autograd.functional.hessian(lambda v: dual_objective_reference(v, *args), x)
    torch.testing.assert_close(grad[0, 0, 0], auto_grad)
    torch.testing.assert_close(-neg_hess[0, 0, 0], auto_hess)
