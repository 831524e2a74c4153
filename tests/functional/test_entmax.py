"""Tests of the regularized family's maps: sparsemax and α-entmax (float64 oracles, entmax package)."""
from __future__ import annotations

import warnings

import entmax as entmax_pkg
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnopt.functional import entmax, sparsemax
from tests.reference.regularized import entmax_bisect_ref, sparsemax_sort, sparsemax_support_size

ALPHAS = [1.05, 1.3, 1.5, 2.0, 2.5, 4.0]
SHAPES = [(3, 1), (4, 7), (2, 3, 17), (2, 2, 5, 64)]


def _map(alpha: float):
    if alpha == 2.0:
        return lambda x, dim=-1: sparsemax(x, dim=dim)
    return lambda x, dim=-1: entmax(x, alpha, dim=dim)


def _scores(shape, scale=2.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(alpha, shape):
    x = _scores(shape, seed=len(shape))
    ref = sparsemax_sort(x) if alpha == 2.0 else entmax_bisect_ref(x, alpha)
    torch.testing.assert_close(_map(alpha)(x), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dim", [0, 1, -2, -1])
@pytest.mark.parametrize("alpha", [1.3, 1.5, 2.0])
def test_dim_argument(dim, alpha):
    x = _scores((5, 6, 7), seed=3)
    got = _map(alpha)(x, dim=dim)
    ref = _map(alpha)(x.movedim(dim, -1)).movedim(-1, dim)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(got.sum(dim), torch.ones_like(got.sum(dim)), atol=1e-10, rtol=0)


def test_matches_entmax_package_float64():
    x = _scores((16, 40), scale=3.0, seed=1)
    torch.testing.assert_close(sparsemax(x), entmax_pkg.sparsemax(x), atol=1e-12, rtol=0)
    torch.testing.assert_close(entmax(x, 1.5), entmax_pkg.entmax15(x), atol=1e-12, rtol=0)
    for a in (1.3, 1.7, 3.0):
        ref = entmax_pkg.entmax_bisect(x, a, n_iter=100)
        torch.testing.assert_close(entmax(x, a), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("alpha", [1.3, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("dim", [-1, 0])
def test_gradcheck(alpha, dim):
    x = _scores((4, 6), scale=1.5, seed=7).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: _map(alpha)(t, dim=dim), (x,), atol=1e-6)


def test_gradcheck_alpha_tensor():
    x = _scores((3, 2, 6), scale=1.5, seed=8).requires_grad_(True)
    alpha = torch.tensor([[[1.3]], [[1.7]], [[2.4]]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, a: entmax(t, a), (x, alpha), atol=1e-6)


def test_alpha_gradient_matches_entmax_package():
    x = _scores((5, 9), seed=9)
    a1 = torch.full((5, 1), 1.6, dtype=torch.float64, requires_grad=True)
    a2 = a1.detach().clone().requires_grad_(True)
    w = torch.randn(5, 9, dtype=torch.float64)
    (entmax(x, a1) * w).sum().backward()
    (entmax_pkg.entmax_bisect(x, a2, n_iter=100) * w).sum().backward()
    torch.testing.assert_close(a1.grad, a2.grad, atol=1e-8, rtol=0)


def test_tensor_alpha_equals_float_alpha():
    x = _scores((3, 4, 10), seed=10)
    a = torch.tensor(1.5, dtype=torch.float64)
    torch.testing.assert_close(entmax(x, a), entmax(x, 1.5), atol=1e-12, rtol=0)


finite_rows = st.lists(st.floats(-20, 20, allow_nan=False, width=64), min_size=1, max_size=12)


@given(row=finite_rows, alpha=st.sampled_from(ALPHAS), shift=st.floats(-50, 50))
def test_simplex_and_shift_invariance(row, alpha, shift):
    x = torch.tensor(row, dtype=torch.float64)
    p = _map(alpha)(x)
    assert (p >= 0).all()
    assert abs(float(p.sum()) - 1) < 1e-9
    torch.testing.assert_close(_map(alpha)(x + shift), p, atol=1e-8, rtol=0)


@given(row=finite_rows, keep=st.lists(st.booleans(), min_size=12, max_size=12), alpha=st.sampled_from(ALPHAS))
def test_masking_equals_truncation(row, keep, alpha):
    x = torch.tensor(row, dtype=torch.float64)
    keep_t = torch.tensor(keep[: len(row)])
    if not keep_t.any():
        keep_t[0] = True
    masked = x.masked_fill(~keep_t, float("-inf"))
    p = _map(alpha)(masked)
    assert (p[~keep_t] == 0).all()
    torch.testing.assert_close(p[keep_t], _map(alpha)(x[keep_t]), atol=1e-10, rtol=0)


@given(row=st.lists(st.floats(-5, 5, allow_nan=False, width=64), min_size=1, max_size=15))
def test_sparsemax_support_size_formula(row):
    x = torch.tensor(row, dtype=torch.float64)
    p = sparsemax(x)
    k = int(sparsemax_support_size(x))
    # ties at the threshold may give exact zeros inside the formula's support
    assert int((p > 1e-12).sum()) <= k
    assert int((p > 0).sum()) >= int((p > 1e-9).sum())
    zs, _ = torch.sort(x, descending=True)
    tau = (zs[:k].sum() - 1) / k
    torch.testing.assert_close(p, (x - tau).clamp_min(0), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.01, 1.3, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("scale", [1.0, 100.0, 1000.0])
def test_half_precision_no_nan(dtype, alpha, scale):
    x = _scores((8, 64), scale=scale, seed=11).to(dtype)
    x[0, :5] = float("-inf")
    x[1] = float("-inf")
    p = _map(alpha)(x)
    assert p.dtype == dtype
    assert not torch.isnan(p).any()
    assert (p[1] == 0).all()
    ref = _map(alpha)(x.to(torch.float64))
    err = (p.double() - ref).abs().max().item()
    naive_half_err = (ref.to(dtype).double() - ref).abs().max().item()  # rounding of the output
    assert err <= 8 * naive_half_err + 1e-3
    sums = p.double().sum(-1)
    assert torch.allclose(sums[torch.arange(8) != 1], torch.ones(7, dtype=torch.float64), atol=2e-2)


@pytest.mark.parametrize("alpha", [1.3, 1.5, 2.0])
def test_half_precision_backward_no_nan(alpha):
    x = _scores((4, 32), scale=300.0, seed=12).to(torch.bfloat16).requires_grad_(True)
    (_map(alpha)(x) * torch.arange(32.0)).sum().backward()
    assert x.grad is not None and not torch.isnan(x.grad).any()


@pytest.mark.parametrize("alpha", [1.3, 1.5, 2.0, 3.0])
def test_all_masked_slice_is_zero_with_zero_grad(alpha):
    x = _scores((3, 5), seed=13)
    x[1] = float("-inf")
    x.requires_grad_(True)
    p = _map(alpha)(x)
    assert (p[1] == 0).all()
    torch.testing.assert_close(p[0].sum(), torch.tensor(1.0, dtype=torch.float64))
    (p * torch.randn(3, 5, dtype=torch.float64)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()


def test_exact_zero_outside_support_and_no_nan_with_neg_inf():
    x = torch.tensor([[0.0, -1e-3, -5.0, float("-inf")]], dtype=torch.float32)
    for a in ALPHAS:
        p = _map(a)(x)
        assert p[0, 3] == 0 and not torch.isnan(p).any()


def test_nonconvergence_warns():
    x = _scores((4, 50), seed=14)
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        entmax(x, 1.3, max_iter=1)


def test_default_runs_do_not_warn():
    x = _scores((64, 300), scale=5.0, seed=15).float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for a in ALPHAS:
            _map(a)(x)


def test_bad_inputs():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="alpha"):
        entmax(x, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        entmax(x, float("nan"))
    with pytest.raises(ValueError, match="alpha"):
        entmax(x, torch.tensor([[-0.5], [2.0], [2.0]]))
    with pytest.raises(ValueError, match="size 1 along dim"):
        entmax(x, torch.full((3, 4), 1.5))
    with pytest.raises(TypeError, match="alpha"):
        entmax(x, "1.5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN"):
        sparsemax(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match=r"\+inf"):
        entmax(torch.tensor([0.0, float("inf")]), 1.5)
    with pytest.raises(ValueError, match="dim"):
        sparsemax(x, dim=2)
    with pytest.raises(TypeError, match="scores"):
        sparsemax(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="tol"):
        entmax(x, 1.3, tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        entmax(x, 1.3, max_iter=0)


@pytest.mark.parametrize("alpha", [1.3, 1.5, 2.0])
def test_large_inputs_use_cache_blocks_and_match_package(alpha):
    x = _scores((3, 200, 1000), scale=3.0, seed=16)  # above the row-block threshold
    if alpha == 2.0:
        ref = entmax_pkg.sparsemax(x)
    elif alpha == 1.5:
        ref = entmax_pkg.entmax15(x)
    else:
        ref = entmax_pkg.entmax_bisect(x, alpha, n_iter=100)
    got = _map(alpha)(x)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    xt = x.transpose(1, 2).contiguous()  # dim != last: the unblocked path
    torch.testing.assert_close(_map(alpha)(xt, dim=1).transpose(1, 2), got, atol=1e-12, rtol=0)


# torch.func: jacrev vmaps the backward over a batched gradient (the in-place forms cannot run
# there), vmap over scores is one more batch dimension of the row-wise map
_TORCH_FUNC_MAPS = {
    "sparsemax": sparsemax,
    "entmax-1.5": lambda t: entmax(t, alpha=1.5),
    "entmax-1.3": lambda t: entmax(t, alpha=1.3),
    "entmax-tensor-alpha": lambda t: entmax(t, alpha=torch.tensor([1.3], dtype=t.dtype)),
}


@pytest.mark.parametrize("name", list(_TORCH_FUNC_MAPS))
def test_torch_func_jacrev_matches_autograd_jacobian(name):
    fn = _TORCH_FUNC_MAPS[name]
    x = torch.tensor([0.5, 0.3, -1.0, 0.45, 0.1, 0.2], dtype=torch.float64)
    got = torch.func.jacrev(fn)(x)
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(fn, x))
    if name == "sparsemax":  # the closed form: diag(s) − s sᵀ/|s| on the support s
        s = (fn(x) > 0).double()
        torch.testing.assert_close(got, torch.diag(s) - torch.outer(s, s) / s.sum())


@pytest.mark.parametrize("name", list(_TORCH_FUNC_MAPS))
@pytest.mark.parametrize("in_dim", [0, 1])
def test_torch_func_vmap_is_a_batch_dimension(name, in_dim):
    fn = _TORCH_FUNC_MAPS[name]
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = torch.func.vmap(lambda t: fn(t.T), in_dims=in_dim)(x)
    expect = torch.stack([fn(x.select(in_dim, i).T) for i in range(x.shape[in_dim])])
    torch.testing.assert_close(got, expect)
