"""Functional ops under ``torch.func``: generalized attention with a (learned) bias, exact MEM
attention and the linear kernel. vmap equals the batched call, grad the autograd gradient
(float64, tight), jacrev the autograd Jacobian; a bad value in one vmapped example is the usual
ValueError (no ``.item()`` of a vmapped tensor)."""
from __future__ import annotations

import pytest
import torch
from torch import func

from attnopt.dual import mem_attention
from attnopt.functional import dispatch, generalized_attention, kernel_attention
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.kernels import Linear

# PyTorch warns where it batches an op by a loop (no batching rule): correct, only slower
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
TOL = {"rtol": 1e-9, "atol": 1e-11}


def _qkv(b=3, h=2, nq=4, nk=5, d=6, dv=3):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, h, nq, d, dtype=torch.float64, generator=g),
            torch.randn(b, h, nk, d, dtype=torch.float64, generator=g),
            torch.randn(b, h, nk, dv, dtype=torch.float64, generator=g),
            torch.randn(b, h, nq, nk, dtype=torch.float64, generator=g))


def _check(fn, args, argnums):
    """vmap over every argument = the call; grad (argnums) = autograd; vmap(grad) = per-example autograd."""
    torch.testing.assert_close(func.vmap(fn)(*args), fn(*args), **TOL)
    loss = lambda *a: fn(*a).square().sum()  # noqa: E731
    got = func.grad(loss, argnums=argnums)(*args)
    leaves = [a.clone().requires_grad_() for a in args]
    loss(*leaves).backward()
    for i, g in zip(argnums, got, strict=True):
        torch.testing.assert_close(g, leaves[i].grad, **TOL)
    per = func.vmap(func.grad(lambda *a: loss(*(x[None] for x in a)), argnums=argnums))(*args)
    for e in range(args[0].shape[0]):
        leaves = [a[e : e + 1].clone().requires_grad_() for a in args]
        loss(*leaves).backward()
        for i, g in zip(argnums, per, strict=True):
            torch.testing.assert_close(g[e], leaves[i].grad[0], **TOL)
    tiny = [a[:1, :1] for a in args]
    jac = func.jacrev(fn, argnums=argnums)(*tiny)
    ref = torch.autograd.functional.jacobian(lambda *a: fn(*a), tuple(tiny))
    for i, j in zip(argnums, jac, strict=True):
        torch.testing.assert_close(j, ref[i], **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_generalized_attention_with_a_bias(causal):
    """A bias that needs a gradient: SDPA refuses it under grad / jacrev, the fused nodes have no
    vmap rule, the C paths no storage: the plain ops run (recorded as "plain")."""
    q, k, v, lu = _qkv(nq=4, nk=4)
    fn = lambda q, k, v, lu: generalized_attention(q, k, v, log_preference=lu, is_causal=causal)  # noqa: E731
    _check(fn, (q, k, v, lu), (0, 1, 2, 3))
    func.vmap(fn)(q, k, v, lu)
    assert dispatch.last_dispatch["generalized_kernel"] == "plain"
    bad = lu.clone()
    bad[2, 1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="log_preference must not contain NaN"):
        func.vmap(fn)(q, k, v, bad)


def test_mem_attention_vmap_rule_and_implicit_backward():
    """The vmapped dim joins MEM's problem batch (dense d x d and low-rank Woodbury solves)."""
    q, k, v, lu = _qkv(nk=5, d=3)  # n >= d: the dense Newton path
    fn = lambda q, k, v, lu: mem_attention(q, k, v, log_preference=lu, tol=1e-12)  # noqa: E731
    _check(fn, (q, k, v, lu), (0, 1, 2, 3))
    q, k, v, _ = _qkv(nk=3, d=6)  # n < d: low rank
    only_k = lambda k: mem_attention(q[0], k, v[0], tol=1e-12)  # noqa: E731
    torch.testing.assert_close(func.vmap(only_k)(k), torch.stack([only_k(x) for x in k]), **TOL)


def test_mem_conjugate_gradient_backward_under_vmap_of_grad(monkeypatch):
    """Large low-rank systems take CG in the backward: under vmap it runs every (masked) iteration
    (no early exit by bool()), to the same gradient."""
    q, k, v, _ = _qkv(b=2, nq=3, nk=3, d=6)
    loss = lambda q, k: mem_attention(q, k, v[:1], tol=1e-12).square().sum()  # noqa: E731
    want = []
    for e in range(2):
        a, b = q[e : e + 1].clone().requires_grad_(), k[e : e + 1].clone().requires_grad_()
        loss(a, b).backward()
        want.append((a.grad[0], b.grad[0]))
    monkeypatch.setattr(THRESHOLDS, "mem_direct_max_entries", 0)
    got = func.vmap(func.grad(lambda a, b: loss(a[None], b[None]), argnums=(0, 1)))(q, k)
    for e in range(2):
        torch.testing.assert_close(got[0][e], want[e][0], rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(got[1][e], want[e][1], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("mode", ["quadratic", "linear"])
def test_linear_kernel_with_a_key_mask(mode):
    """The exp-free path's Cauchy-Schwarz bound and the linear mode's key-mask check read the values
    under the wrappers (float() / bool() of a vmapped tensor raised)."""
    q, k, v, _ = _qkv()
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 3:] = False

    def fn(q, k, v, m):
        return kernel_attention(q, k, v, kernel=Linear(), magnitude_p=2.0, attn_mask=m, mode=mode)

    torch.testing.assert_close(func.vmap(fn)(q, k, v, mask), fn(q, k, v, mask), **TOL)
    _check(lambda q, k, v: fn(q, k, v, mask[1, 0]), (q, k, v), (0, 1, 2))  # (1, Nk): keys 3, 4 masked
    if mode == "linear":  # a query-dependent mask in one example is still refused
        bad = mask.expand(3, 1, 4, 5).clone()
        bad[2, 0, 1, 0] = False
        with pytest.raises(ValueError, match="mode='linear' needs a key mask"):
            func.vmap(fn)(q, k, v, bad)
    float_mask = torch.zeros(3, 1, 1, 5, dtype=torch.float64)
    float_mask[0, 0, 0, 2] = float("nan")
    with pytest.raises(ValueError, match="attn_mask must not contain NaN"):
        func.vmap(fn)(q, k, v, float_mask)
