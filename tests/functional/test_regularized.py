"""Tests of regularized maps and regularized (one-sided EOT) attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnopt.functional import (
    Regularizer,
    Shannon,
    SquaredL2,
    Tsallis,
    entmax,
    locality_bias,
    regularized_attention,
    regularized_attention_weights,
    regularized_weights,
    softmax_weights,
    sparsemax,
)
from attnopt.nn.preference import ALiBiPreference
from tests.reference.regularized import attention_reference, entmax_bisect_ref, sparsemax_sort

REGS = [Shannon(), Shannon(0.5), SquaredL2(), Tsallis(1.5), Tsallis(1.3), Tsallis(3.0)]


def _ref_map(reg):
    if isinstance(reg, Shannon):
        return lambda s: torch.softmax(s / reg.temperature, -1).nan_to_num(0.0)
    if isinstance(reg, SquaredL2):
        return sparsemax_sort
    return lambda s: entmax_bisect_ref(s, float(reg.alpha))


def _qkv(b=2, h=3, nq=5, nk=7, d=4, dv=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in
                 ((b, h, nq, d), (b, h, nk, d), (b, h, nk, dv)))


class Shifted:
    """A user regularizer: Shannon with temperature 2 written from scratch (conjugate grad only)."""

    def conjugate_grad(self, scores, dim):
        return torch.softmax(scores / 2.0, dim)


def test_softmax_weights_is_softmax_over_temperature():
    s = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(softmax_weights(s, temperature=0.3), torch.softmax(s / 0.3, -1))
    s[1] = float("-inf")
    assert (softmax_weights(s)[1] == 0).all()


@pytest.mark.parametrize("reg", REGS, ids=repr)
def test_regularized_weights_match_reference(reg):
    s = torch.randn(4, 9, dtype=torch.float64) * 2
    torch.testing.assert_close(regularized_weights(s, reg), _ref_map(reg)(s), atol=1e-10, rtol=0)


def test_regularized_weights_dispatch_and_user_regularizer():
    s = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(regularized_weights(s, SquaredL2(), dim=1), sparsemax(s, dim=1))
    torch.testing.assert_close(regularized_weights(s, Tsallis(1.7)), entmax(s, 1.7))
    torch.testing.assert_close(regularized_weights(s, Shifted()), softmax_weights(s, temperature=2.0))
    assert isinstance(Shifted(), Regularizer)


@pytest.mark.parametrize("reg", REGS, ids=repr)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_materialized_reference(reg, causal):
    q, k, v = _qkv(nq=6, nk=6)
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[2] = False  # a fully masked query row
    out = regularized_attention(q, k, v, regularizer=reg, attn_mask=mask, is_causal=causal, block_size=4)
    ref = attention_reference(q, k, v, _ref_map(reg), mask=mask, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=0)
    assert (out[..., 2, :] == 0).all()


@pytest.mark.parametrize("reg", REGS, ids=repr)
def test_locality_matches_reference_and_alibi(reg):
    q, k, v = _qkv(nq=5, nk=8)
    alibi = ALiBiPreference(3, slopes=torch.tensor([0.1, 0.5, 1.0]))
    bias = alibi(5, 8)
    out = regularized_attention(q, k, v, regularizer=reg, locality=alibi.slopes, block_size=2)
    ref = attention_reference(q, k, v, _ref_map(reg), bias=bias)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=0)


def test_locality_bias_equals_alibi_preference_exactly():
    for dtype in (torch.float32, torch.float64):
        with torch.no_grad():
            alibi = ALiBiPreference(4)
        for nq, nk in ((5, 5), (3, 9)):
            got = locality_bias(nq, nk, alibi.slopes, dtype=dtype, device="cpu")
            assert torch.equal(got, alibi(nq, nk)[0].to(dtype))
    scalar = locality_bias(3, 4, 0.25, dtype=torch.float64, device="cpu")
    assert torch.equal(scalar, -(0.25 * (torch.arange(3)[:, None] - torch.arange(4)[None, :]).abs().double()))


def test_shannon_locality_is_sdpa_with_alibi_mask():
    q, k, v = _qkv(dtype=torch.float32, nq=7, nk=7)
    alibi = ALiBiPreference(3)
    out = regularized_attention(q, k, v, locality=alibi.slopes)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi(7, 7))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_shannon_without_bias_is_sdpa_with_temperature():
    q, k, v = _qkv(dtype=torch.float32)
    torch.testing.assert_close(regularized_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    out = regularized_attention(q, k, v, regularizer=Shannon(2.0), scale=0.7)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.35)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5), Tsallis(1.3), Tsallis(2.5)], ids=repr)
def test_blocked_gradients_match_materialized(reg):
    q, k, v = _qkv(nq=5, nk=6, seed=3)
    beta = torch.tensor([0.2, 0.0, 0.7], dtype=torch.float64)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[:, 0] = False
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, beta)]
    w = torch.randn(2, 3, 5, 3, dtype=torch.float64)
    out = regularized_attention(
        *leaves[:3], regularizer=reg, attn_mask=mask, locality=leaves[3], block_size=2
    )
    g1 = torch.autograd.grad((out * w).sum(), leaves)
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v, beta)]
    wts = regularized_attention_weights(*leaves2[:2], regularizer=reg, attn_mask=mask, locality=leaves2[3])
    g2 = torch.autograd.grad(((wts @ leaves2[2]) * w).sum(), leaves2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_blocked_gradcheck():
    q, k, v = _qkv(b=1, h=2, nq=3, nk=4, d=2, dv=2, seed=4)
    beta = torch.tensor(0.3, dtype=torch.float64)
    inputs = tuple(t.requires_grad_(True) for t in (q, k, v, beta))

    def f(q, k, v, beta):
        return regularized_attention(q, k, v, regularizer=Tsallis(1.5), locality=beta, block_size=2)

    assert torch.autograd.gradcheck(f, inputs, atol=1e-6)


def test_tensor_alpha_regularizer_gets_gradient():
    q, k, v = _qkv(seed=5)
    alpha = torch.tensor([1.2, 1.5, 2.0], dtype=torch.float64).view(3, 1, 1).requires_grad_(True)
    out = regularized_attention(q, k, v, regularizer=Tsallis(alpha))
    out.sum().backward()
    assert alpha.grad is not None and torch.isfinite(alpha.grad).all() and alpha.grad.abs().sum() > 0


@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5), Tsallis(1.3), Shannon()], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_attention(reg, dtype):
    q, k, v = _qkv(dtype=torch.float32, nq=8, nk=8, seed=6)
    q = q * 30
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False
    out = regularized_attention(q.to(dtype), k.to(dtype), v.to(dtype), regularizer=reg, attn_mask=mask)
    assert out.dtype == dtype and not torch.isnan(out).any()
    ref = regularized_attention(q.double(), k.double(), v.double(), regularizer=reg, attn_mask=mask)
    assert (out.double() - ref).abs().max() < 0.15
    assert (out[..., 3, :] == 0).all()


def test_weights_function_shapes_and_rows():
    q, k, _ = _qkv(nq=4, nk=9)
    w = regularized_attention_weights(q, k, regularizer=SquaredL2(), locality=0.5)
    assert w.shape == (2, 3, 4, 9)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 4, dtype=torch.float64))
    assert (w == 0).any()


def test_bad_inputs():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="conjugate_grad"):
        regularized_attention(q, k, v, regularizer=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="locality"):
        regularized_attention(q, k, v, locality=float("nan"))
    with pytest.raises(ValueError, match="H = 3"):
        regularized_attention(q, k, v, regularizer=SquaredL2(), locality=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale"):
        regularized_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="block_size"):
        regularized_attention(q, k, v, regularizer=SquaredL2(), block_size=0)
    with pytest.raises(ValueError, match="temperature"):
        Shannon(0.0)
    with pytest.raises(ValueError, match="alpha"):
        Tsallis(0.0)
    with pytest.raises(ValueError, match="alpha"):
        Tsallis(torch.tensor([0.5, -1.0]))
    with pytest.raises(TypeError, match="alpha"):
        Tsallis("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN"):
        regularized_weights(torch.tensor([0.0, float("nan")]), Shannon())
    with pytest.raises(ValueError, match="attn_mask"):
        regularized_attention(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool))


@settings(max_examples=15)
@given(seed=st.integers(0, 10_000), reg_index=st.integers(0, len(REGS) - 1))
def test_key_permutation_equivariance(seed, reg_index):
    q, k, v = _qkv(b=1, h=2, nq=3, nk=6, seed=seed)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(seed))
    reg = REGS[reg_index]
    out = regularized_attention(q, k, v, regularizer=reg)
    out_perm = regularized_attention(q, k[..., perm, :], v[..., perm, :], regularizer=reg)
    torch.testing.assert_close(out_perm, out, atol=1e-10, rtol=0)
    w = regularized_attention_weights(q, k, regularizer=reg)
    w_perm = regularized_attention_weights(q, k[..., perm, :], regularizer=reg)
    torch.testing.assert_close(w_perm, w[..., perm])


@pytest.mark.parametrize("alpha", [0.25, 0.5, 0.75])
def test_tsallis_below_one_solves_its_problem(alpha):
    """KKT of max <s,p> - Ω(p) on the simplex with a dense p: ∇Ω(p) - s is one constant per row."""
    s = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reg = Tsallis(alpha)
    p = regularized_weights(s, reg)
    assert (p > 0).all() and torch.allclose(p.sum(-1), torch.ones(4, dtype=torch.float64))
    grad_omega = (alpha * p ** (alpha - 1) - 1) / (alpha * (alpha - 1))
    gap = grad_omega - s
    torch.testing.assert_close(gap, gap[:, :1].expand_as(gap), rtol=0, atol=1e-9)
    # and it beats any other point of the simplex on the objective
    other = torch.softmax(torch.randn(64, 4, 9, dtype=torch.float64), -1)
    best = (s * p).sum(-1) - reg.value(p)
    assert ((s * other).sum(-1) - reg.value(other) <= best + 1e-12).all()


def test_tsallis_value_at_and_around_one():
    p = torch.softmax(torch.randn(3, 6, dtype=torch.float64), -1)
    torch.testing.assert_close(Tsallis(1.0).value(p), (p * p.log()).sum(-1))
    torch.testing.assert_close(Tsallis(1.0 + 1e-7).value(p), (p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(Tsallis(0.5).value(p), ((p.sqrt() - p) / (0.5 * -0.5)).sum(-1))
    a = torch.tensor([[0.5], [1.0], [1.5]], dtype=torch.float64, requires_grad=True)
    mixed = Tsallis(a).value(p)
    want = torch.stack([Tsallis(x).value(p[i]) for i, x in enumerate((0.5, 1.0, 1.5))])
    torch.testing.assert_close(mixed, want)
    mixed.sum().backward()
    assert torch.isfinite(a.grad).all()


def test_attention_with_tsallis_at_and_below_one():
    q, k, v = _qkv()
    torch.testing.assert_close(regularized_attention(q, k, v, regularizer=Tsallis(1.0)),
                               F.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-15)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    for causal in (False, True):
        sc = scores.masked_fill(torch.ones(5, 7).triu(1).bool(), float("-inf")) if causal else scores
        want = entmax(sc, 0.5) @ v
        got = regularized_attention(q, k, v, regularizer=Tsallis(0.5), is_causal=causal)
        torch.testing.assert_close(got, want)
    q, k, v = (t.detach()[:1, :1].requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda *t: regularized_attention(*t, regularizer=Tsallis(0.5)), (q, k, v))
