"""Regression: DNAS/Sinkhorn/HNAS on any strided layout and on empty sizes (issue 17).

The fused CPU kernel reads the last dim as unit-stride and dies (SIGFPE) on empty sizes;
the ops must make inputs fit and answer empty shapes before the kernel.
"""
from __future__ import annotations

import pytest
import torch

from attnopt.functional import (
    doubly_normalized_attention,
    doubly_normalized_weights,
    hybrid_normalized_attention,
)
from attnopt.functional.doubly_normalized import flash_cpu as fc


def _strided(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as ``x`` in another memory layout."""
    if kind == "last_dim_transposed":  # e.g. keys kept as a (B, H, d, N) cache
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "every_other_channel":
        y = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
        y[..., ::2] = x
        return y[..., ::2]
    if kind == "permuted":
        return x.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    if kind == "seq_heads_swapped":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    raise ValueError(kind)


KINDS = ["last_dim_transposed", "every_other_channel", "permuted", "seq_heads_swapped"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize(
    "iterations,causal,key_mask", [(1, False, False), (2, False, True), (1, True, False)]
)
def test_strided_inputs_match_contiguous(kind, which, iterations, causal, key_mask):
    g = torch.Generator().manual_seed(0)
    nq = nk = 5
    q = torch.randn(2, 3, nq, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, nk, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, nk, 4, generator=g, dtype=torch.float64)  # d == dv: no padding copy hides it
    mask = (torch.rand(2, 1, 1, nk, generator=g) > 0.3) | (torch.arange(nk) == 0) if key_mask else None
    base = {"q": q, "k": k, "v": v}
    ins = dict(base)
    ins[which] = _strided(base[which], kind)
    assert torch.equal(ins[which], base[which])
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in ins.items()}
    ref_leaves = {n: t.detach().clone().requires_grad_(True) for n, t in base.items()}
    kw = {"iterations": iterations, "attn_mask": mask, "is_causal": causal, "causal": "plan"}
    out = doubly_normalized_attention(leaves["q"], leaves["k"], leaves["v"], **kw)
    ref = doubly_normalized_attention(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], **kw)
    w = doubly_normalized_weights(base["q"], base["k"], **kw)
    torch.testing.assert_close(ref, w @ base["v"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    gout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * gout).sum().backward()
    (ref * gout).sum().backward()
    for n in "qkv":
        torch.testing.assert_close(leaves[n].grad, ref_leaves[n].grad, rtol=1e-9, atol=1e-11)


def test_issue_example_transposed_key_cache():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    v = torch.randn(1, 2, 5, 2, dtype=torch.float64)
    k = torch.randn(1, 2, 3, 5, dtype=torch.float64).transpose(-1, -2)
    ref = doubly_normalized_weights(q, k.contiguous()) @ v
    torch.testing.assert_close(doubly_normalized_attention(q, k, v), ref, rtol=1e-12, atol=1e-12)
    w = torch.tensor(0.4, dtype=torch.float64)
    hyb = hybrid_normalized_attention(q, k, v, w, iterations=2)
    hyb_ref = hybrid_normalized_attention(q, k.contiguous(), v, w, iterations=2)
    torch.testing.assert_close(hyb, hyb_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("iterations", [0, 1, 2])
@pytest.mark.parametrize("b,h,nq,nk", [(1, 2, 0, 3), (1, 2, 3, 0), (0, 2, 3, 3), (1, 0, 3, 3), (1, 1, 0, 0)])
def test_empty_sizes_give_empty_or_zero_output_with_finite_gradients(iterations, b, h, nq, nk):
    q = torch.randn(b, h, nq, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, h, nk, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, h, nk, 2, dtype=torch.float64, requires_grad=True)
    out = doubly_normalized_attention(q, k, v, iterations=iterations)
    assert out.shape == (b, h, nq, 2)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and torch.equal(x.grad, torch.zeros_like(x))
    assert doubly_normalized_weights(q, k, iterations=iterations).shape == (b, h, nq, nk)


def test_kernel_wrapper_refuses_empty_sizes_instead_of_crashing():
    x = torch.randn(1, 1, 0, 4)
    with pytest.raises(ValueError, match="empty"):
        fc._flash(x, torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), None, False, 0.5)
