"""Generalized attention (fenchel-dual-attention eq. 16–18) against the float64 oracle."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import attnopt
from tests.reference.generalized import generalized_attention_ref, generalized_weights_ref

SHAPES = [(1, 1, 4, 4, 3, 5), (2, 3, 5, 7, 4, 2), (1, 2, 9, 3, 8, 8)]  # B, H, Nq, Nk, d, dv


def make(b, h, nq, nk, d, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, nk, dv, generator=g, dtype=dtype)
    return q, k, v, g


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pref_kind", ["none", "full", "key_only", "with_zeros", "all_zero_row"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
def test_matches_reference(shape, pref_kind, mask_kind):
    b, h, nq, nk, d, dv = shape
    q, k, v, g = make(*shape)
    pref = None
    if pref_kind == "full":
        pref = torch.rand(b, h, nq, nk, generator=g, dtype=torch.float64)
    elif pref_kind == "key_only":
        pref = torch.rand(b, h, 1, nk, generator=g, dtype=torch.float64)
    elif pref_kind == "with_zeros":
        pref = torch.rand(b, h, nq, nk, generator=g, dtype=torch.float64)
        pref[pref < 0.3] = 0.0
    elif pref_kind == "all_zero_row":
        pref = torch.rand(b, h, nq, nk, generator=g, dtype=torch.float64)
        pref[..., 0, :] = 0.0
    mask, causal = None, mask_kind == "causal"
    if mask_kind == "bool":
        mask = torch.rand(nq, nk, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(b, 1, nq, nk, generator=g, dtype=torch.float64)
    out = attnopt.generalized_attention(q, k, v, preference=pref, attn_mask=mask, is_causal=causal)
    w = attnopt.generalized_weights(q, k, preference=pref, attn_mask=mask, is_causal=causal)
    ref_w = generalized_weights_ref(q, k, preference=pref, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(w, ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, ref_w @ v, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(out).all()


def test_log_preference_equals_preference():
    q, k, v, g = make(2, 2, 5, 6, 4, 3)
    u = torch.rand(2, 2, 5, 6, generator=g, dtype=torch.float64)
    u[0, 0, 0, :3] = 0
    a = attnopt.generalized_attention(q, k, v, preference=u)
    b = attnopt.generalized_attention(q, k, v, log_preference=u.log())
    torch.testing.assert_close(a, b)


def test_uniform_preference_is_dot_product_attention():
    q, k, v, _ = make(2, 3, 5, 6, 4, 3)
    u = torch.full((1, 1, 1, 6), 0.37, dtype=torch.float64)
    torch.testing.assert_close(
        attnopt.generalized_attention(q, k, v, preference=u), F.scaled_dot_product_attention(q, k, v)
    )


def test_custom_scale():
    q, k, v, g = make(1, 2, 4, 5, 3, 2)
    u = torch.rand(1, 2, 1, 5, generator=g, dtype=torch.float64)
    out = attnopt.generalized_attention(q, k, v, preference=u, scale=2.5)
    torch.testing.assert_close(out, generalized_attention_ref(q, k, v, preference=u, scale=2.5))


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, k, v, g = make(1, 2, 4, 5, 3, 2)
    for t in (q, k, v):
        t.requires_grad_(True)
    u = torch.rand(1, 2, 4, 5, generator=g, dtype=torch.float64)
    u[0, 1, 2] = 0.0
    u.requires_grad_(True)
    out = attnopt.generalized_attention(q, k, v, preference=u)
    assert out[0, 1, 2].abs().max() == 0
    out.square().sum().backward()
    for t in (q, k, v, u):
        assert torch.isfinite(t.grad).all()
    w = attnopt.generalized_weights(q, k, preference=u)
    assert w[0, 1, 2].abs().max() == 0


def test_key_only_preference_not_materialized(monkeypatch):
    """The (B, H, 1, Nk) preference reaches the kernel as is (CPU flash kernel or SDPA)."""
    from attnopt.functional.generalized import streaming as fused

    q, k, v, g = make(2, 3, 6, 7, 4, 4)
    u = torch.rand(2, 3, 1, 7, generator=g, dtype=torch.float64)
    seen = []
    real_sdpa, real_flash = F.scaled_dot_product_attention, fused._fwd

    def spy(*args, **kwargs):
        seen.append(tuple(kwargs["attn_mask"].shape))
        return real_sdpa(*args, **kwargs)

    def spy_flash(*args, **kwargs):
        seen.append(tuple(kwargs["attn_mask"].shape))
        return real_flash(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(fused, "_fwd", spy_flash)
    attnopt.generalized_attention(q, k, v, preference=u)
    assert seen == [(2, 3, 1, 7)]


def test_gradcheck_all_inputs():
    q, k, v, g = make(1, 2, 3, 4, 3, 2)
    u = torch.rand(1, 2, 3, 4, generator=g, dtype=torch.float64) + 0.1
    lu = torch.randn(1, 2, 1, 4, generator=g, dtype=torch.float64)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, u)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, u: attnopt.generalized_attention(q, k, v, preference=u), inputs
    )
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, lu)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, lu: attnopt.generalized_attention(q, k, v, log_preference=lu, is_causal=True), inputs
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v, lu: attnopt.generalized_weights(q, k, log_preference=lu), inputs
    )


def test_gradient_of_zero_preference_entries_is_finite():
    q, k, v, g = make(1, 1, 3, 4, 3, 2)
    u = torch.rand(1, 1, 3, 4, generator=g, dtype=torch.float64)
    u[..., 1] = 0.0
    u.requires_grad_(True)
    attnopt.generalized_attention(q, k, v, preference=u).sum().backward()
    assert torch.isfinite(u.grad).all()
    assert (u.grad[..., 1] == 0).all()


@given(
    nq=st.integers(1, 6), nk=st.integers(1, 6), d=st.integers(1, 5), seed=st.integers(0, 10_000),
    c=st.floats(0.01, 100.0),
)
def test_properties(nq, nk, d, seed, c):
    q, k, v, g = make(1, 2, nq, nk, d, 3, seed=seed)
    u = torch.rand(1, 2, nq, nk, generator=g, dtype=torch.float64) + 1e-3
    w = attnopt.generalized_weights(q, k, preference=u)
    # rows are distributions
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, nq, dtype=torch.float64))
    # invariance to scaling u (per row)
    row_scale = torch.rand(1, 2, nq, 1, generator=g, dtype=torch.float64) * c + 1e-3
    torch.testing.assert_close(attnopt.generalized_weights(q, k, preference=u * row_scale), w)
    # permutation equivariance over keys and over queries
    pk, pq = torch.randperm(nk, generator=g), torch.randperm(nq, generator=g)
    out = attnopt.generalized_attention(q, k, v, preference=u)
    out_k = attnopt.generalized_attention(q, k[..., pk, :], v[..., pk, :], preference=u[..., pk])
    torch.testing.assert_close(out_k, out)
    out_q = attnopt.generalized_attention(q[..., pq, :], k, v, preference=u[..., pq, :])
    torch.testing.assert_close(out_q, out[..., pq, :])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_no_nan_and_accurate(dtype):
    q, k, v, g = make(1, 2, 16, 16, 8, 8, dtype=torch.float64)
    u = torch.rand(1, 2, 1, 16, generator=g, dtype=torch.float64)
    u[..., :3] = 0
    ref = generalized_attention_ref(q * 4, k * 4, v, preference=u)
    qh, kh, vh, uh = (q * 4).to(dtype), (k * 4).to(dtype), v.to(dtype), u.to(dtype)
    out = attnopt.generalized_attention(qh, kh, vh, preference=uh)
    w = attnopt.generalized_weights((q * 4).to(dtype), (k * 4).to(dtype), preference=u.to(dtype))
    assert out.dtype == dtype and w.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    naive = torch.softmax(((q * 4).to(dtype) @ (k * 4).to(dtype).transpose(-2, -1)) / math.sqrt(8)
                          + u.to(dtype).log(), -1) @ v.to(dtype)
    naive_err = (naive.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 4 * naive_err + 1e-3


def test_bad_inputs_raise():
    q, k, v, _ = make(1, 2, 3, 4, 5, 2)
    with pytest.raises(ValueError, match="preference"):
        attnopt.generalized_attention(q, k, v, preference=-torch.ones(1, 2, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="preference"):
        attnopt.generalized_attention(q, k, v, preference=torch.full((4,), math.inf, dtype=torch.float64))
    with pytest.raises(ValueError, match="preference"):
        attnopt.generalized_attention(q, k, v, preference=torch.tensor([1.0, math.nan, 1.0, 1.0]).double())
    with pytest.raises(ValueError, match="attn_mask"):
        attnopt.generalized_attention(q, k, v, attn_mask=torch.tensor([0.0, math.inf, 0.0, 0.0]).double())
    with pytest.raises(ValueError, match="preference"):
        attnopt.generalized_attention(q, k, v, preference=torch.ones(1, 2, 3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="log_preference"):
        attnopt.generalized_attention(q, k, v, log_preference=torch.full((4,), math.nan, dtype=torch.float64))
    with pytest.raises(ValueError, match="either"):
        attnopt.generalized_attention(q, k, v, preference=torch.ones(4), log_preference=torch.zeros(4))
    with pytest.raises(ValueError, match="scale"):
        attnopt.generalized_attention(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="scale"):
        attnopt.generalized_weights(q, k, scale=-1.0)
    with pytest.raises(ValueError, match="head"):
        attnopt.generalized_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="v must have"):
        attnopt.generalized_attention(q, k, v[..., :3, :])
    with pytest.raises(ValueError, match="attn_mask"):
        attnopt.generalized_attention(q, k, v, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p"):
        attnopt.generalized_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(TypeError, match="preference"):
        attnopt.generalized_attention(q, k, v, preference=[1.0, 2.0])
    with pytest.raises(TypeError, match="q"):
        attnopt.generalized_attention("q", k, v)
