"""OT-based attention (fenchel-dual-attention eq. 22) against the float64 triple sum."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnopt import ot_attention, ot_weights
from attnopt.functional.ot import log_matmul_exp
from tests.reference.ot import cost_matrix, ot_weights_reference

F64 = torch.float64


def _inputs(b=2, h=2, nq=3, n=4, m=6, d=3, dtype=F64, seed=0, bank=True):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    t = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    a = torch.randn(b, h, m, d, generator=g, dtype=dtype) if bank else None
    u = torch.rand(b, h, n, generator=g, dtype=dtype) + 0.1
    return z, t, a, u


def _norm(u):
    return u / u.sum(-1, keepdim=True)


def _explicit_cost(a, t):
    return cost_matrix(a, t, "sqeuclidean") + 0.25


COSTS = ["neg_dot", "sqeuclidean", "tensor", "callable"]


def _cost_arg(kind, a, t):
    if kind == "tensor":
        return _explicit_cost(a, t)
    if kind == "callable":
        return _explicit_cost
    return kind


def _ref_cost(kind, a, t):
    return _explicit_cost(a, t) if kind in ("tensor", "callable") else cost_matrix(a, t, kind)


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("alpha,gamma", [(1.0, 1.0), (0.3, 0.05), (2.0, 8.0), (1.0, 1e-3)])
@pytest.mark.parametrize("shape", [(2, 2, 3, 4, 6, 3), (1, 3, 5, 2, 2, 4), (2, 1, 1, 3, 7, 2)])
def test_weights_and_output_match_triple_sum(cost, alpha, gamma, shape):
    b, h, nq, n, m, d = shape
    z, t, a, u = _inputs(b, h, nq, n, m, d)
    u[..., 0] = 0.0  # a zero-preference template
    v = torch.randn(b, h, m, 5, dtype=F64)
    w = ot_weights(z, t, bank=a, preference=u, cost=_cost_arg(cost, a, t), alpha=alpha, gamma=gamma)
    ref = ot_weights_reference(z, t, a, _norm(u), _ref_cost(cost, a, t), alpha, gamma)
    torch.testing.assert_close(w, ref, rtol=1e-9, atol=1e-11)
    out = ot_attention(
        z, t, bank=a, bank_values=v, preference=u, cost=_cost_arg(cost, a, t), alpha=alpha, gamma=gamma
    )
    torch.testing.assert_close(out, ref @ v, rtol=1e-9, atol=1e-11)


def test_default_bank_and_values_are_the_templates():
    z, t, _, u = _inputs(bank=False)
    out = ot_attention(z, t, preference=u, alpha=0.5, gamma=2.0)
    ref = ot_weights_reference(z, t, t, _norm(u), cost_matrix(t, t, "neg_dot"), 0.5, 2.0)
    torch.testing.assert_close(out, ref @ t)
    default_u = ot_attention(z, t, alpha=0.5, gamma=2.0)
    ones = torch.ones(4, dtype=F64)
    torch.testing.assert_close(default_u, ot_attention(z, t, preference=ones, alpha=0.5, gamma=2.0))


def test_gradients_match_reference():
    z, t, a, u = _inputs(nq=2, n=3, m=4)
    v = torch.randn(2, 2, 4, 2, dtype=F64)
    leaves = [x.clone().requires_grad_() for x in (z, t, a, v, u)]
    out = ot_attention(leaves[0], leaves[1], bank=leaves[2], bank_values=leaves[3], preference=leaves[4],
                       cost="sqeuclidean", alpha=0.7, gamma=0.4)
    gout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, gout)
    rleaves = [x.clone().requires_grad_() for x in (z, t, a, v, u)]
    rz, rt, ra, rv, ru = rleaves
    ref = ot_weights_reference(rz, rt, ra, _norm(ru), cost_matrix(ra, rt, "sqeuclidean"), 0.7, 0.4) @ rv
    rgrads = torch.autograd.grad(ref, rleaves, gout)
    for g_, r_ in zip(grads, rgrads):
        torch.testing.assert_close(g_, r_, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("cost", ["neg_dot", "sqeuclidean"])
def test_gradcheck(cost):
    z, t, a, u = _inputs(b=1, h=1, nq=2, n=3, m=4, d=2)
    v = torch.randn(1, 1, 4, 2, dtype=F64)
    args = tuple(x.clone().requires_grad_() for x in (z, t, a, v, u))

    def fn(z_, t_, a_, v_, u_):
        return ot_attention(z_, t_, bank=a_, bank_values=v_, preference=u_, cost=cost, alpha=0.8, gamma=0.6)

    assert torch.autograd.gradcheck(fn, args)


def test_neg_dot_is_mixture_of_softmax_attentions():
    z, t, a, u = _inputs()
    alpha, gamma = 0.6, 1.7
    out = ot_attention(z, t, bank=a, preference=u, alpha=alpha, gamma=gamma)
    un = _norm(u)
    mix = torch.zeros_like(out)
    for i in range(t.shape[-2]):
        q = (alpha * z + t[..., i : i + 1, :]) / gamma
        mix = mix + un[..., i, None, None] * F.scaled_dot_product_attention(q, a, a, scale=1.0)
    torch.testing.assert_close(out, mix)


def test_neg_dot_constant_cancels():
    z, t, a, u = _inputs()
    shifted = -(a @ t.transpose(-2, -1)) + 50.0  # M = -a^T b + C, non-negative
    torch.testing.assert_close(
        ot_weights(z, t, bank=a, preference=u, cost=shifted, alpha=0.5, gamma=3.0),
        ot_weights(z, t, bank=a, preference=u, alpha=0.5, gamma=3.0),
    )


def test_all_zero_preference_gives_zeros_and_finite_grads():
    z, t, a, u = _inputs()
    u[0, 1] = 0.0
    zz = z.clone().requires_grad_()
    out = ot_attention(zz, t, bank=a, preference=u)
    assert torch.all(out[0, 1] == 0) and out[0, 0].abs().sum() > 0
    out.sum().backward()
    assert torch.isfinite(zz.grad).all()


def test_zero_preference_equals_dropping_the_template():
    z, t, a, u = _inputs()
    u[..., 2] = 0.0
    keep = [0, 1, 3]
    torch.testing.assert_close(
        ot_weights(z, t, bank=a, preference=u, alpha=0.5, gamma=0.5),
        ot_weights(z, t[..., keep, :], bank=a, preference=u[..., keep], alpha=0.5, gamma=0.5),
    )


def test_bank_mask_equals_truncating_the_bank():
    z, t, a, u = _inputs(m=6)
    mask = torch.tensor([True, False, True, True, False, True])
    w = ot_weights(z, t, bank=a, preference=u, bank_mask=mask, cost="sqeuclidean", gamma=0.7)
    w_trunc = ot_weights(z, t, bank=a[..., mask, :], preference=u, cost="sqeuclidean", gamma=0.7)
    assert torch.all(w[..., ~mask] == 0)
    torch.testing.assert_close(w[..., mask], w_trunc)


def test_group_example_shares_weight_within_group():
    # Sec. 9: M = 0 inside a group, +inf across; equal z-scores inside a group => p*(t) = u_i / |G|.
    d = 3
    centers = torch.eye(d, dtype=F64)
    bank = centers.repeat_interleave(3, 0).view(1, 1, 9, d)  # 3 groups of 3 identical members
    groups = torch.arange(9) // 3
    templates = bank[..., [0, 4], :]  # one member of group 0 and of group 1
    m_cost = torch.where(groups[:, None] == groups[[0, 4]][None, :], 0.0, float("inf")).to(F64)
    u = torch.tensor([0.3, 0.7], dtype=F64)
    w = ot_weights(torch.randn(1, 1, 2, d, dtype=F64), templates, bank=bank, preference=u, cost=m_cost)
    expected = torch.tensor([0.1] * 3 + [0.7 / 3] * 3 + [0.0] * 3, dtype=F64)
    torch.testing.assert_close(w[0, 0], expected.expand(2, 9))


@given(
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 5), st.floats(0.05, 3.0), st.floats(0.05, 5.0),
    st.integers(0, 10_000),
)
def test_rows_are_distributions_and_bank_permutation_equivariant(nq, n, m, alpha, gamma, seed):
    z, t, a, u = _inputs(b=1, h=2, nq=nq, n=n, m=m, d=3, seed=seed)
    w = ot_weights(z, t, bank=a, preference=u, alpha=alpha, gamma=gamma, cost="sqeuclidean")
    assert torch.all(w >= 0)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(seed))
    wp = ot_weights(z, t, bank=a[..., perm, :], preference=u, alpha=alpha, gamma=gamma, cost="sqeuclidean")
    torch.testing.assert_close(wp, w[..., perm])
    tperm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    wt = ot_weights(z, t[..., tperm, :], bank=a, preference=u[..., tperm], alpha=alpha, gamma=gamma,
                    cost="sqeuclidean")
    torch.testing.assert_close(wt, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gamma", [8.0, 1.0, 1e-3])
def test_low_precision_finite_and_close(dtype, gamma):
    z, t, a, u = _inputs(nq=4, n=5, m=7, d=8, dtype=F64)
    ref = ot_weights_reference(z, t, a, _norm(u), cost_matrix(a, t, "neg_dot"), 1.0, gamma) @ a
    out = ot_attention(z.to(dtype), t.to(dtype), bank=a.to(dtype), preference=u.to(dtype), gamma=gamma)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # error vs the float64 golden within a multiple of what rounding the inputs alone costs
    rounded = ot_weights_reference(
        z.to(dtype).double(), t.to(dtype).double(), a.to(dtype).double(), _norm(u.to(dtype).double()),
        cost_matrix(a.to(dtype).double(), t.to(dtype).double(), "neg_dot"), 1.0, gamma,
    ) @ a.to(dtype).double()
    input_err = (rounded - ref).abs().max().item()
    eps = torch.finfo(dtype).eps
    assert (out.double() - ref).abs().max().item() <= 4 * input_err + 50 * eps * (1 + 1 / gamma)


def test_log_matmul_exp_extreme_and_masked():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 5, generator=g) * 400
    y = torch.randn(2, 5, 6, generator=g) * 400
    x[0, 1] = float("-inf")  # a row with no finite term
    y[1, :, 2] = float("-inf")
    ref = torch.logsumexp(x.double()[..., :, :, None] + y.double()[..., None, :, :], dim=-2)
    x.requires_grad_()
    out = log_matmul_exp(x, y)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    torch.testing.assert_close(out.double()[finite], ref[finite], rtol=1e-6, atol=1e-3)
    out[torch.isfinite(out)].sum().backward()
    assert torch.isfinite(x.grad).all()


def _bad(**over):
    z, t, a, u = _inputs()
    kw = dict(bank=a, preference=u, cost="neg_dot", alpha=1.0, gamma=1.0)
    kw.update(over)
    return z, t, kw


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(alpha=0.0), ValueError, "alpha"),
        (dict(gamma=-1.0), ValueError, "gamma"),
        (dict(gamma=float("nan")), ValueError, "gamma"),
        (dict(alpha=torch.tensor(1.0)), TypeError, "alpha"),
        (dict(cost="cosine"), ValueError, "cost"),
        (dict(cost=3), TypeError, "cost"),
        (dict(cost=torch.ones(6, 5)), ValueError, "cost"),
        (dict(cost=-torch.ones(6, 4)), ValueError, "non-negative"),
        (dict(cost=torch.full((6, 4), float("nan"))), ValueError, "NaN"),
        (dict(cost=torch.full((6, 4), float("inf"))), ValueError, "finite cost"),
        (dict(cost=torch.ones(6, 4, dtype=torch.int64)), TypeError, "floating"),
        (dict(cost=lambda a, t: 1.0), TypeError, "callable"),
        (dict(preference=-torch.ones(4, dtype=F64)), ValueError, "non-negative"),
        (dict(preference=torch.ones(5, dtype=F64)), ValueError, "preference"),
        (dict(preference=torch.full((4,), float("inf"), dtype=F64)), ValueError, "finite"),
        (dict(bank=torch.randn(2, 2, 6, 4, dtype=F64)), ValueError, "feature size"),
        (dict(bank=torch.randn(2, 2, 6, 3)), TypeError, "dtype"),
        (dict(bank=torch.randn(3, 2, 6, 3, dtype=F64)), ValueError, "broadcast"),
        (dict(bank_mask=torch.ones(6)), TypeError, "bank_mask"),
        (dict(bank_mask=torch.ones(5, dtype=torch.bool)), ValueError, "bank_mask"),
    ],
)
def test_bad_inputs(over, exc, match):
    z, t, kw = _bad(**over)
    with pytest.raises(exc, match=match):
        ot_attention(z, t, **kw)


def test_bad_square_cost_and_values():
    z, t, _, u = _inputs()
    asym = torch.rand(4, 4, dtype=F64)
    with pytest.raises(ValueError, match="symmetric"):
        ot_weights(z, t, cost=asym + 0.0)
    sym = asym + asym.T
    assert torch.isfinite(ot_weights(z, t, cost=sym)).all()
    with pytest.raises(ValueError, match="rows"):
        ot_attention(z, t, bank_values=torch.randn(2, 2, 5, 3, dtype=F64))
    with pytest.raises(TypeError, match="dtype"):
        ot_attention(z, t, bank_values=torch.randn(2, 2, 4, 3))
    with pytest.raises(TypeError, match="z"):
        ot_attention([1.0], t)
    # empty sets follow the shared empty-size policy (issue 17): no template / no bank member -> zeros
    assert torch.equal(ot_attention(z, t[..., :0, :]), torch.zeros(2, 2, z.shape[-2], 3, dtype=F64))
    assert ot_weights(z, t, bank=t[..., :0, :]).shape == (2, 2, z.shape[-2], 0)
