"""Exact MEM attention: implicit-differentiation gradients, masks, relation to eq. (16)."""
from __future__ import annotations

import pytest
import torch

from attnopt import generalized_attention, generalized_weights, mem_attention, mem_weights, solve_mem
from attnopt.dual import mem_estimate
from attnopt.functional._thresholds import THRESHOLDS

F64 = torch.float64


def _qkv(B=1, H=2, nq=3, nk=5, d=4, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, nq, d, generator=g, dtype=F64)
    k = torch.randn(B, H, nk, d, generator=g, dtype=F64)
    v = torch.randn(B, H, nk, dv, generator=g, dtype=F64)
    return q, k, v


@pytest.mark.parametrize("n,d", [(4, 6), (6, 3)])
@pytest.mark.parametrize("alpha", [0.4, 2.0])
def test_gradcheck_mem_estimate(n, d, alpha):
    g = torch.Generator().manual_seed(n + d)
    T = torch.randn(n, d, generator=g, dtype=F64, requires_grad=True)
    z = torch.randn(d, generator=g, dtype=F64, requires_grad=True)
    u = (torch.rand(n, generator=g, dtype=F64) + 0.1).requires_grad_()
    assert torch.autograd.gradcheck(lambda T, z, u: mem_estimate(T, z, preference=u, alpha=alpha, tol=1e-12),
                                    (T, z, u), fast_mode=alpha > 1)


def test_gradcheck_cg_backward(monkeypatch):
    monkeypatch.setattr(THRESHOLDS, "mem_direct_max_entries", 0)  # Woodbury solves through CG
    g = torch.Generator().manual_seed(1)
    T = torch.randn(1, 2, 1, 3, 5, generator=g, dtype=F64, requires_grad=True)
    z = torch.randn(1, 2, 2, 5, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda T, z: mem_estimate(T, z, alpha=0.9, tol=1e-12), (T, z))


def test_gradcheck_attention_with_preference_and_mask():
    q, k, v = _qkv(H=1, nq=3, nk=4, d=3, dv=2)
    pref = torch.rand(1, 1, 1, 4, dtype=F64) + 0.1
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 2] = False
    inputs = tuple(x.clone().requires_grad_() for x in (q, k, v, pref))
    assert torch.autograd.gradcheck(
        lambda q, k, v, p: mem_attention(q, k, v, preference=p, attn_mask=mask, scale=1.3, tol=1e-12), inputs
    )


def test_implicit_gradient_matches_finite_difference_of_solver():
    """d ĥ / d z from the backward equals a central difference of two exact solves."""
    g = torch.Generator().manual_seed(4)
    T = torch.randn(5, 3, generator=g, dtype=F64)
    z = torch.randn(3, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(3, generator=g, dtype=F64)
    (mem_estimate(T, z, alpha=1.7, tol=1e-13) @ w).backward()
    eps, fd = 1e-6, torch.zeros(3, dtype=F64)
    for j in range(3):
        e = torch.zeros(3, dtype=F64)
        e[j] = eps
        hp = solve_mem(T, z.detach() + e, alpha=1.7, tol=1e-13).h
        hm = solve_mem(T, z.detach() - e, alpha=1.7, tol=1e-13).h
        fd[j] = ((hp - hm) @ w) / (2 * eps)
    torch.testing.assert_close(z.grad, fd, atol=1e-7, rtol=1e-6)


def test_weights_match_solver_and_v_equals_k_gives_h():
    q, k, _ = _qkv(nq=4, nk=6, d=5)
    w = mem_weights(q, k, scale=0.7)
    sol = solve_mem(k.unsqueeze(-3), q, alpha=0.7)
    torch.testing.assert_close(w, sol.weights)
    torch.testing.assert_close(mem_attention(q, k, k, scale=0.7), sol.h)


def test_small_alpha_approaches_generalized_attention():
    """First-order approximation (14)–(16): the gap to eq. (16) shrinks like α²."""
    q, k, v = _qkv(nq=4, nk=7, d=3)
    pref = torch.rand(1, 2, 4, 7, dtype=F64) + 0.1
    gaps = []
    for a in (0.1, 0.05):
        exact = mem_attention(q, k, v, preference=pref, scale=a)
        approx = generalized_attention(q, k, v, preference=pref, scale=a)
        gaps.append(float((exact - approx).abs().max()))
    assert gaps[1] < gaps[0] / 3.0
    assert gaps[0] > 0


def test_fully_masked_rows_are_zero_with_finite_grads():
    q, k, v = _qkv()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = mem_attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 1] == 0)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert torch.all(q.grad[:, :, 1] == 0)
    w = mem_weights(q, k, is_causal=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 3, dtype=F64))
    assert torch.all(w[..., 0, 1:] == 0)


def test_half_precision_no_nan():
    q, k, v = _qkv()
    out = mem_attention(q.half(), k.half(), v.half())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), mem_attention(q, k, v), atol=1e-2, rtol=1e-2)


def test_bad_inputs():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale"):
        mem_attention(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="preference"):
        mem_weights(q, k, preference=-torch.ones(5, dtype=F64))
    with pytest.raises(ValueError, match="tol"):
        mem_weights(q, k, tol=-1.0)
    with pytest.raises(ValueError, match="max_iter"):
        mem_attention(q, k, v, max_iter=0)
    with pytest.raises(ValueError):
        mem_attention(q, k[..., :3], v)


def test_uniform_preference_equals_no_preference():
    q, k, _ = _qkv()
    uniform = torch.full((5,), 3.0, dtype=F64)
    torch.testing.assert_close(mem_weights(q, k, preference=uniform), mem_weights(q, k))
    # exact weights differ from the first-order (eq. 16) weights at α = 1
    assert float((mem_weights(q, k, scale=1.0) - generalized_weights(q, k, scale=1.0)).abs().max()) > 1e-3


def test_non_convergence_warns_in_attention():
    q, k, v = _qkv()
    with pytest.warns(RuntimeWarning, match="did not converge"):
        mem_attention(q * 30, k, v, scale=5.0, tol=1e-14, max_iter=1)
