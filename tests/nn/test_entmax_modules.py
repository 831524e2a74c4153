"""The ``entmax`` package's API under attnopt: switch by changing the import.

``from entmax import sparsemax, entmax15, entmax_bisect, Sparsemax, Entmax15, EntmaxBisect`` and
``from attnopt... import`` the same names must give the same maps for the same positional calls.
"""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt.nn import Entmax15, EntmaxBisect, Sparsemax

entmax_pkg = pytest.importorskip("entmax")


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_functions_take_dim_positionally_as_the_entmax_package(dim):
    x = _x()
    torch.testing.assert_close(attnopt.sparsemax(x, dim), entmax_pkg.sparsemax(x, dim))
    torch.testing.assert_close(attnopt.entmax15(x, dim), entmax_pkg.entmax15(x, dim))
    torch.testing.assert_close(attnopt.entmax(x, 1.5, dim), entmax_pkg.entmax15(x, dim))
    for alpha in (1.25, 1.5, 2.0, 3.0):
        ref = entmax_pkg.entmax_bisect(x, alpha, dim)
        torch.testing.assert_close(attnopt.entmax_bisect(x, alpha, dim), ref, atol=1e-6, rtol=1e-5)
    assert (attnopt.sparsemax(x, dim) == 0).any()  # sparse along the chosen dim, summing to one
    torch.testing.assert_close(attnopt.sparsemax(x, dim).sum(dim), torch.ones_like(x.sum(dim)))


@pytest.mark.parametrize("dim", [0, -1, 1])
def test_modules_match_the_entmax_package_in_value_and_gradient(dim):
    pairs = [
        (Sparsemax(dim), entmax_pkg.Sparsemax(dim)),
        (Entmax15(dim), entmax_pkg.Entmax15(dim)),
        (EntmaxBisect(1.7, dim), entmax_pkg.EntmaxBisect(1.7, dim)),
    ]
    for ours, theirs in pairs:
        x = _x(1).requires_grad_()
        a, b = ours(x), theirs(x)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        g = torch.randn_like(a)
        (ga,) = torch.autograd.grad(a, x, g)
        (gb,) = torch.autograd.grad(b, x, g)
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)
    assert repr(Sparsemax(1)) == "Sparsemax(dim=1)" and "alpha=1.7" in repr(EntmaxBisect(1.7))


def test_learned_alpha_and_bad_input():
    alpha = torch.nn.Parameter(torch.full((3, 1, 1), 1.5, dtype=torch.float64))
    p = EntmaxBisect(alpha, -1)(_x())
    p.square().sum().backward()
    assert alpha.grad is not None and alpha.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="dim"):
        Sparsemax(3)(_x())
    with pytest.raises(ValueError, match="alpha"):
        EntmaxBisect(-1.0)(_x())
