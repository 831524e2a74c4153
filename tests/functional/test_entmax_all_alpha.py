"""α-entmax for every α > 0: α < 1 (dense), α = 1 (softmax) and tensor α straddling 1."""
from __future__ import annotations

import entmax as entmax_pkg
import pytest
import torch

from attnopt.functional import entmax

ALPHAS = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]


def _scores(shape, scale=1.5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_gradcheck_float_and_tensor_alpha(alpha):
    x = _scores((3, 5), seed=1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: entmax(t, alpha), (x,), atol=1e-6)
    a = torch.full((3, 1), alpha, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, b: entmax(t, b), (x, a), atol=1e-6)


def test_gradcheck_tensor_alpha_straddling_one():
    x = _scores((7, 2, 5), seed=2).requires_grad_(True)
    a = torch.tensor([0.3, 0.9, 1 - 1e-7, 1.0, 1 + 1e-7, 1.1, 2.6], dtype=torch.float64)
    a = a.view(7, 1, 1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t, b: entmax(t, b), (x, a), atol=1e-6)


def test_alpha_one_is_softmax_exactly():
    x = _scores((4, 3, 9), scale=4.0, seed=3)
    ref = torch.softmax(x, -1)
    assert (entmax(x, 1.0) - ref).abs().max() <= 1e-15
    mixed = torch.tensor([0.5, 1.0, 2.0, 1.0], dtype=torch.float64).view(4, 1, 1)
    p = entmax(x, mixed)
    assert (p[1] - ref[1]).abs().max() <= 1e-15 and (p[3] - ref[3]).abs().max() <= 1e-15
    torch.testing.assert_close(p[0], entmax(x[0], 0.5), atol=1e-12, rtol=0)
    torch.testing.assert_close(p[2], entmax(x[2], 2.0), atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", [0.1, 0.25, 0.5, 0.75, 0.95, 0.999])
def test_dense_alpha_below_one_matches_package_and_kkt(alpha):
    x = _scores((6, 40), scale=3.0, seed=4)
    p = entmax(x, alpha)
    torch.testing.assert_close(p, entmax_pkg.entmax_bisect(x, alpha, n_iter=200), atol=1e-10, rtol=0)
    assert (p > 0).all()  # α < 1: the Tsallis map is dense
    # stationarity of <s,p> - Σ(p^α - p)/(α(α-1)) on the simplex: s - p^{α-1}/(α-1) is constant
    r = x - p.pow(alpha - 1) / (alpha - 1)
    assert (r - r.mean(-1, keepdim=True)).abs().max() < 1e-8


def test_near_one_is_accurate_in_float32():
    """The q-exponential form keeps float32 accuracy as α → 1 (the power form loses 1/(α−1) digits)."""
    x = _scores((8, 300), scale=3.0, seed=5)
    for alpha in (1 - 1e-3, 1 + 1e-3, 1 + 1e-5):
        ref = entmax(x, alpha)
        got = entmax(x.float(), alpha).double()
        assert (got - ref).abs().max() < 1e-6
        torch.testing.assert_close(ref, torch.softmax(x, -1), atol=1e-2, rtol=0)  # the limit


def test_alpha_gradient_is_continuous_at_one_and_matches_finite_differences():
    x = _scores((5, 8), seed=6)
    w = _scores((5, 8), seed=7)

    def f(a: float) -> float:
        return float((entmax(x, torch.full((5, 1), a, dtype=torch.float64)) * w).sum())

    grads = []
    for a0 in (1 - 1e-6, 1.0, 1 + 1e-6):
        a = torch.full((5, 1), a0, dtype=torch.float64, requires_grad=True)
        (entmax(x, a) * w).sum().backward()
        grads.append(float(a.grad.sum()))
    h = 1e-4
    fd = (f(1 + h) - f(1 - h)) / (2 * h)
    assert abs(grads[1] - fd) < 1e-6
    assert abs(grads[0] - grads[1]) < 1e-5 and abs(grads[2] - grads[1]) < 1e-5


@pytest.mark.parametrize("alpha", [0.5, 1.25])
def test_alpha_gradient_matches_package(alpha):
    x = _scores((5, 9), seed=8)
    w = _scores((5, 9), seed=9)
    a1 = torch.full((5, 1), alpha, dtype=torch.float64, requires_grad=True)
    a2 = a1.detach().clone().requires_grad_(True)
    (entmax(x, a1) * w).sum().backward()
    (entmax_pkg.entmax_bisect(x, a2, n_iter=200) * w).sum().backward()
    torch.testing.assert_close(a1.grad, a2.grad, atol=1e-8, rtol=0)


@pytest.mark.parametrize("alpha", [0.25, 0.5, 1.0])
def test_masking_equals_truncation_dense_alphas(alpha):
    x = _scores((3, 10), seed=10)
    keep = torch.tensor([True, False, True, True, False, True, True, True, False, True])
    masked = x.masked_fill(~keep, float("-inf"))
    masked[2] = float("-inf")
    p = entmax(masked, alpha)
    assert (p[:, ~keep] == 0).all() and (p[2] == 0).all()
    torch.testing.assert_close(p[:2, keep], entmax(x[:2, keep], alpha), atol=1e-12, rtol=0)
    xr = masked.clone().requires_grad_(True)
    (entmax(xr, alpha) * _scores((3, 10), seed=11)).sum().backward()
    assert torch.isfinite(xr.grad).all() and (xr.grad[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 1.001, 1.25])
def test_half_precision_at_large_scale_is_finite(dtype, alpha):
    x = _scores((6, 64), scale=1000.0, seed=12).to(dtype)
    x[0, :7] = float("-inf")
    x[1] = float("-inf")
    xr = x.clone().requires_grad_(True)
    p = entmax(xr, alpha)
    assert p.dtype == dtype and torch.isfinite(p).all() and (p[1] == 0).all()
    ref = entmax(x.double(), alpha)
    assert (p.double() - ref).abs().max() <= 8 * (ref.to(dtype).double() - ref).abs().max() + 1e-3
    (p.float() * torch.arange(64.0)).sum().backward()
    assert torch.isfinite(xr.grad).all()
    a = torch.full((6, 1), alpha, dtype=dtype, requires_grad=True)
    (entmax(x, a).float() * torch.arange(64.0)).sum().backward()
    assert torch.isfinite(a.grad).all()
