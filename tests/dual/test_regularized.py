"""Tests of attnopt.dual.solve_regularized (the generic interior-point solver)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from attnopt.dual import RegularizedSolution, solve_regularized
from attnopt.functional import Shannon, SquaredL2, Tsallis, entmax, softmax_weights, sparsemax


def _scores(shape=(3, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * 2


@pytest.mark.parametrize(
    "reg, closed",
    [
        (Shannon(0.7), lambda s: softmax_weights(s, temperature=0.7)),
        (SquaredL2(), sparsemax),
        (Tsallis(1.5), lambda s: entmax(s, 1.5)),
        (Tsallis(1.3), lambda s: entmax(s, 1.3)),
    ],
    ids=["shannon", "l2", "tsallis15", "tsallis13"],
)
def test_solver_matches_closed_forms(reg, closed):
    s = _scores()
    s[0, 4:] = float("-inf")
    sol = solve_regularized(s, reg)
    assert isinstance(sol, RegularizedSolution)
    assert sol.converged and sol.kkt_residual <= 1e-9
    torch.testing.assert_close(sol.weights, closed(s), atol=1e-6, rtol=0)
    assert (sol.weights[0, 4:] == 0).all()


def test_dim_and_all_masked_slice():
    s = _scores((5, 2, 3), seed=1)
    s[:, 1, 0] = float("-inf")
    sol = solve_regularized(s, SquaredL2(), dim=0)
    torch.testing.assert_close(sol.weights, sparsemax(s, dim=0), atol=1e-6, rtol=0)
    assert (sol.weights[:, 1, 0] == 0).all()


def test_user_callable_with_locality_is_alibi():
    s = _scores((4, 6), seed=2)
    dist = (torch.arange(4)[:, None] - torch.arange(6)[None, :]).abs().double()
    tau, beta = 0.8, 0.4

    def omega(p):  # Shannon + linear locality penalty (Prop. 4.4)
        return tau * torch.special.xlogy(p, p).sum(-1) + beta * (p * dist).sum(-1)

    sol = solve_regularized(s, omega)
    torch.testing.assert_close(sol.weights, torch.softmax((s - beta * dist) / tau, -1), atol=1e-6, rtol=0)


def test_non_separable_regularizer_against_scipy():
    n = 5
    g = torch.Generator().manual_seed(3)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    a = m @ m.T / n + 0.5 * torch.eye(n, dtype=torch.float64)
    s = torch.randn(n, generator=g, dtype=torch.float64)
    sol = solve_regularized(s, lambda p: 0.5 * torch.einsum("...i,ij,...j->...", p, a, p))
    an, sn = a.numpy(), s.numpy()
    res = minimize(
        lambda x: 0.5 * x @ an @ x - sn @ x, np.full(n, 1 / n), jac=lambda x: an @ x - sn, method="SLSQP",
        bounds=[(0, None)] * n, constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1}],
        options={"ftol": 1e-14, "maxiter": 500},
    )
    assert res.success
    np.testing.assert_allclose(sol.weights.numpy(), res.x, atol=1e-6)


def test_float32_input_returns_float32():
    s = _scores().float()
    sol = solve_regularized(s, Shannon())
    assert sol.weights.dtype == torch.float32
    torch.testing.assert_close(sol.weights, torch.softmax(s, -1), atol=1e-6, rtol=0)


def test_nonconvergence_warns():
    with pytest.warns(RuntimeWarning, match="did not converge"):
        sol = solve_regularized(_scores(), SquaredL2(), max_iter=2)
    assert not sol.converged


def test_bad_inputs():
    s = _scores()
    with pytest.raises(TypeError, match="regularizer"):
        solve_regularized(s, 3)
    with pytest.raises(ValueError, match="NaN"):
        solve_regularized(torch.tensor([0.0, float("nan")]), Shannon())
    with pytest.raises(ValueError, match="dim"):
        solve_regularized(s, Shannon(), dim=5)
    with pytest.raises(ValueError, match="tol"):
        solve_regularized(s, Shannon(), tol=0)
    with pytest.raises(ValueError, match="omega"):
        solve_regularized(s, lambda p: p)
