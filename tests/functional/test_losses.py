"""Fenchel–Young losses: vs cross_entropy (α = 1), vs the entmax package's losses, gradcheck."""
from __future__ import annotations

import entmax as entmax_pkg
import pytest
import torch
import torch.nn.functional as F

from attnopt import nn as ann
from attnopt.functional import entmax, entmax_loss, sparsemax_loss, tsallis_negentropy

ALPHAS = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]


def _data(n=6, c=7, seed=0, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) * scale
    y = torch.randint(0, c, (n,), generator=g)
    return x, y


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_alpha_one_is_cross_entropy_exactly(reduction):
    x, y = _data(seed=1)
    y[2] = -100
    ref = F.cross_entropy(x, y, reduction=reduction)
    got = entmax_loss(x, y, 1.0, reduction=reduction)
    assert torch.equal(got, ref)
    xs = torch.randn(3, 5, 4, dtype=torch.float64)  # (N, C, d1): classes on dim 1
    ys = torch.randint(0, 5, (3, 4))
    ref = F.cross_entropy(xs, ys, reduction=reduction)
    assert torch.equal(entmax_loss(xs, ys, 1.0, reduction=reduction), ref)


def test_alpha_one_distribution_target_is_kl():
    x, _ = _data(seed=2)
    y = torch.softmax(torch.randn(6, 7, dtype=torch.float64), -1)
    kl = F.kl_div(torch.log_softmax(x, -1), y, reduction="none").sum(-1)
    torch.testing.assert_close(entmax_loss(x, y, 1.0, reduction="none"), kl, atol=1e-14, rtol=0)
    torch.testing.assert_close(entmax_loss(x, y, 1.0, reduction="none"),
                               F.cross_entropy(x, y, reduction="none") + torch.special.xlogy(y, y).sum(-1))
    # the general (tensor α) path agrees with the α = 1 path
    a = torch.ones(6, dtype=torch.float64)
    torch.testing.assert_close(entmax_loss(x, y, a, reduction="none"), kl, atol=1e-12, rtol=0)


def test_matches_package_losses():
    x, y = _data(n=20, c=9, seed=3, scale=2.0)
    torch.testing.assert_close(sparsemax_loss(x, y, reduction="none"), entmax_pkg.sparsemax_loss(x, y),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(entmax_loss(x, y, 1.5, reduction="none"), entmax_pkg.entmax15_loss(x, y),
                               atol=1e-12, rtol=0)
    for a in (1.25, 1.75, 3.0):
        ref = entmax_pkg.entmax_bisect_loss(x, y, a, 200)
        torch.testing.assert_close(entmax_loss(x, y, a, reduction="none"), ref, atol=1e-10, rtol=0)
    mods = [(ann.SparsemaxLoss(reduction="sum", ignore_index=int(y[0])),
             entmax_pkg.SparsemaxLoss(reduction="sum", ignore_index=int(y[0]))),
            (ann.EntmaxLoss(1.5), entmax_pkg.Entmax15Loss(k=None))]
    for ours, theirs in mods:
        torch.testing.assert_close(ours(x, y), theirs(x, y), atol=1e-12, rtol=0)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_gradient_is_p_minus_y_and_gradcheck(alpha):
    x, y = _data(n=3, c=5, seed=4)
    xr = x.clone().requires_grad_(True)
    entmax_loss(xr, y, alpha, reduction="sum").backward()
    p = entmax(x, alpha)
    torch.testing.assert_close(xr.grad, p - F.one_hot(y, 5).double(), atol=1e-12, rtol=0)
    yd = torch.softmax(torch.randn(3, 5, dtype=torch.float64), -1)
    a = torch.full((3,), alpha, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, b: entmax_loss(t, y, b, reduction="none"),
                                    (x.clone().requires_grad_(True), a), atol=1e-6)
    assert torch.autograd.gradcheck(lambda t, b: entmax_loss(t, yd, b, reduction="mean"),
                                    (x.clone().requires_grad_(True), a), atol=1e-6)


def test_gradcheck_alpha_straddling_one():
    x, y = _data(n=5, c=6, seed=5)
    a = torch.tensor([0.5, 1 - 1e-7, 1.0, 1 + 1e-7, 2.5], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, b: entmax_loss(t, y, b, reduction="none"),
                                    (x.clone().requires_grad_(True), a), atol=1e-6)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 1.5, 2.0, 3.0])
def test_nonnegative_and_zero_at_target(alpha):
    x, y = _data(n=30, c=5, seed=6, scale=3.0)
    assert (entmax_loss(x, y, alpha, reduction="none") >= -1e-12).all()
    p = entmax(x, alpha)  # L(s; p(s)) = 0
    assert entmax_loss(x, p, alpha, reduction="none").abs().max() < 1e-10


def test_tsallis_negentropy_values():
    p = torch.softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    for a in (0.5, 1.5, 2.0, 3.0):
        ref = ((p**a - p) / (a * (a - 1))).sum(-1)
        torch.testing.assert_close(tsallis_negentropy(p, a), ref, atol=1e-14, rtol=0)
    shannon = torch.special.xlogy(p, p).sum(-1)
    torch.testing.assert_close(tsallis_negentropy(p, 1.0), shannon, atol=1e-15, rtol=0)
    torch.testing.assert_close(tsallis_negentropy(p, 1 + 1e-9), tsallis_negentropy(p, 1.0), atol=1e-8, rtol=0)


def test_ignore_index_and_reductions():
    x, y = _data(n=8, c=5, seed=7)
    y = y % 3
    y[[1, 4]] = 3
    full = sparsemax_loss(x, y, reduction="none")
    ign = sparsemax_loss(x, y, reduction="none", ignore_index=3)
    assert (ign[[1, 4]] == 0).all() and torch.equal(ign[[0, 2, 3, 5, 6, 7]], full[[0, 2, 3, 5, 6, 7]])
    torch.testing.assert_close(sparsemax_loss(x, y, ignore_index=3), ign.sum() / 6)
    assert sparsemax_loss(x, torch.full((8,), 3), ignore_index=3) == 0  # all ignored: 0, not NaN
    xr = x.clone().requires_grad_(True)
    sparsemax_loss(xr, y, ignore_index=3).backward()
    assert (xr.grad[[1, 4]] == 0).all()


def test_masked_class_and_half_precision():
    x, y = _data(n=4, c=6, seed=8)
    x[:, 5] = float("-inf")
    y[y == 5] = 0
    for a in (0.5, 1.0, 1.5, 2.0):
        xr = x.clone().requires_grad_(True)
        loss = entmax_loss(xr, y, a)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(xr.grad).all()
    xh = (x.clamp_min(-60) * 1000).to(torch.bfloat16).requires_grad_(True)
    for a in (1.5, 2.0, 0.5):
        lh = entmax_loss(xh, y, a)
        assert torch.isfinite(lh)


def test_learned_alpha_module_and_bad_inputs():
    x, y = _data(seed=9)
    m = ann.EntmaxLoss(1.3, learn_alpha=True)
    assert abs(float(m.current_alpha().detach()) - 1.3) < 1e-6
    m(x.float(), y).backward()
    assert m.rho.grad is not None and torch.isfinite(m.rho.grad)
    with pytest.raises(ValueError, match="alpha"):
        ann.EntmaxLoss(0.0)
    with pytest.raises(ValueError, match="reduction"):
        entmax_loss(x, y, reduction="elementwise_mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="class indices"):
        sparsemax_loss(x, torch.full((6,), 7))
    with pytest.raises(ValueError, match="shape"):
        sparsemax_loss(x, y[:3])
    with pytest.raises(ValueError, match="sum to 1"):
        sparsemax_loss(x, torch.rand(6, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN"):
        sparsemax_loss(torch.full((2, 3), float("nan")), torch.zeros(2, dtype=torch.long))
