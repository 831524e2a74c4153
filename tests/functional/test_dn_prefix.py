"""The autoregressive ``causal="prefix"`` DNAS / Sinkhorn-K / HNAS (functional/doubly_normalized/prefix.py).

Float64 loop oracle (:mod:`tests.reference.dn_prefix`), gradcheck, bitwise independence of every
row from the later positions, the defaults (``is_causal=True`` runs the prefix variant, the fast
paths never do), and the masked plan (``causal="plan"``) still leaking as documented.
"""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt.functional import dispatch
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.doubly_normalized import (
    doubly_normalized_attention,
    doubly_normalized_weights,
    hybrid_normalized_attention,
    hybrid_normalized_weights,
    prefix,
)
from tests.reference.dn_prefix import prefix_attention_ref, prefix_hybrid_ref, prefix_weights_ref
from tests.reference.doubly_normalized import attention_ref, scores_ref


def _qkv(nq, nk, *, b=2, h=3, d=4, dv=5, seed=0, dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, nk, dv, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _mask(kind, b, nq, nk, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "key":  # key padding (B, 1, 1, Nk), a padded key in the middle
        m = torch.ones(b, 1, 1, nk, dtype=torch.bool)
        m[0, ..., 1] = False
        return m
    m = torch.rand(b, 1, nq, nk, generator=g) > 0.3  # full: empty rows and columns allowed
    m[0, :, 2, :] = False
    return m


# (Nq, Nk, is_causal, mask kind): causal square and rectangular (SDPA's top-left mask), and the
# prefix normalization without a causal mask (a decoder's cross-attention over a source)
CASES = [(6, 6, True, None), (5, 7, True, "key"), (7, 5, True, "full"), (6, 6, True, "full"),
         (5, 4, False, None), (4, 6, False, "full")]


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize(("nq", "nk", "causal", "kind"), CASES)
def test_matches_float64_loop_oracle_forward_and_gradients(iterations, nq, nk, causal, kind):
    q, k, v = _qkv(nq, nk)
    mask = _mask(kind, 2, nq, nk)
    out = doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask, is_causal=causal,
                                      causal="prefix")
    ref = prefix_attention_ref(q, k, v, iterations, mask=mask, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    w = doubly_normalized_weights(q, k, iterations=iterations, attn_mask=mask, is_causal=causal,
                                  causal="prefix")
    s = scores_ref(q, k, mask=mask, is_causal=causal)
    torch.testing.assert_close(w, prefix_weights_ref(s, iterations), rtol=1e-10, atol=1e-12)
    rows = w.sum(-1)
    assert torch.all(((rows - 1).abs() < 1e-12) | (rows == 0))


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize(("nq", "nk", "causal", "kind"), CASES[:4])
def test_hybrid_matches_oracle_scalar_and_per_head_weight(iterations, nq, nk, causal, kind):
    q, k, v = _qkv(nq, nk, seed=3)
    mask = _mask(kind, 2, nq, nk)
    for w in (torch.tensor(0.3, dtype=torch.float64), torch.tensor([0.0, 0.6, 1.0], dtype=torch.float64)):
        w.requires_grad_()
        out = hybrid_normalized_attention(q, k, v, w, iterations=iterations, attn_mask=mask, is_causal=causal,
                                          causal="prefix")
        ref = prefix_hybrid_ref(q, k, v, w, iterations, mask=mask, is_causal=causal)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, w), go), torch.autograd.grad(ref, (q, k, v, w), go)
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        pw = hybrid_normalized_weights(q, k, w, iterations=iterations, attn_mask=mask, is_causal=causal)
        torch.testing.assert_close(pw @ v, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("iterations", [1, 2])
def test_gradcheck_with_empty_rows_and_columns(iterations):
    """fast_mode gradcheck (random projections of the Jacobian); the oracle tests compare full gradients."""
    q, k, v = _qkv(5, 5, b=1, h=2, d=3, dv=2, seed=4)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    mask[..., 1, :] = False  # a query with no admissible key
    mask[..., :, 3] = False  # a key nobody sees
    assert torch.autograd.gradcheck(
        lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask,
                                                    is_causal=True), (q, k, v), fast_mode=True)
    w = torch.tensor([0.25, 0.75], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, w: hybrid_normalized_attention(q, k, v, w, iterations=iterations, is_causal=True),
        (q, k, v, w), fast_mode=True)


def _change_future(t, pos, seed):
    g = torch.Generator().manual_seed(seed)
    out = t.detach().clone()
    out[..., pos:, :] = torch.randn(out[..., pos:, :].shape, generator=g, dtype=t.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_row_reads_a_later_position_bitwise(dtype):
    """Changing queries, keys and values after position t leaves every row <= t bit for bit."""
    n = 9
    q, k, v = _qkv(n, n, dtype=dtype, grad=False, seed=5)
    w = torch.tensor([0.2, 0.5, 0.9], dtype=dtype)
    fns = {
        "dnas": lambda q, k, v: doubly_normalized_attention(q, k, v, is_causal=True),
        "sinkhorn3": lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=3, is_causal=True),
        "hnas": lambda q, k, v: hybrid_normalized_attention(q, k, v, w, is_causal=True),
        "oracle": lambda q, k, v: prefix_attention_ref(q, k, v, 2),
    }
    for t in (3, 6, 8):
        q2, k2, v2 = (_change_future(x, t, seed=t) for x in (q, k, v))
        for name, fn in fns.items():
            a, b = fn(q, k, v), fn(q2, k2, v2)
            assert torch.equal(a[..., :t, :], b[..., :t, :]), (name, t)
            assert not torch.equal(a[..., t:, :], b[..., t:, :]), (name, t)
            # the masked plan leaks: the earlier rows move
            if name == "dnas":
                pa = doubly_normalized_attention(q, k, v, is_causal=True, causal="plan")
                pb = doubly_normalized_attention(q2, k2, v2, is_causal=True, causal="plan")
                assert (pa[..., :t, :] - pb[..., :t, :]).abs().max() > 1e-4


def test_defaults_route_is_causal_to_the_prefix_variant_and_never_to_the_fast_paths():
    q, k, v = _qkv(7, 7, grad=False, seed=6)
    ref = prefix_attention_ref(q, k, v, 1)
    plan = attention_ref(q, k, v, 1, is_causal=True)
    for impl in ("auto", "materialized"):
        out = doubly_normalized_attention(q, k, v, is_causal=True, impl=impl)
        assert dispatch.last_dispatch["doubly_normalized"] == "prefix"
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    out3 = doubly_normalized_attention(q, k, v, iterations=3, is_causal=True)
    assert dispatch.last_dispatch["sinkhorn"] == "prefix"
    torch.testing.assert_close(out3, prefix_attention_ref(q, k, v, 3), rtol=1e-10, atol=1e-12)
    hybrid_normalized_attention(q, k, v, torch.tensor(0.5, dtype=torch.float64), is_causal=True)
    assert dispatch.last_dispatch["hybrid_normalized"] == "prefix"
    torch.testing.assert_close(doubly_normalized_attention(q, k, v, is_causal=True, causal="plan"), plan,
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(doubly_normalized_weights(q, k, is_causal=True) @ v, ref,
                               rtol=1e-10, atol=1e-12)
    # without is_causal nothing changes: the ordinary (non-causal) plan
    torch.testing.assert_close(doubly_normalized_attention(q, k, v), attention_ref(q, k, v, 1),
                               rtol=1e-10, atol=1e-12)
    assert not torch.allclose(ref, plan)


def test_bad_options_raise_naming_the_leak_and_the_options():
    q, k, v = _qkv(4, 4, grad=False)
    with pytest.raises(ValueError, match="causal must be None, 'prefix'"):
        doubly_normalized_attention(q, k, v, is_causal=True, causal="strict")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="causal must be"):
        hybrid_normalized_attention(q, k, v, torch.tensor(0.5, dtype=torch.float64), causal=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="impl='streaming' has no autoregressive.*causal='plan'"):
        doubly_normalized_attention(q, k, v, is_causal=True, impl="streaming")
    # streaming stays available for the masked plan and for K = 0 (nothing over queries)
    doubly_normalized_attention(q, k, v, is_causal=True, causal="plan", impl="streaming")
    doubly_normalized_attention(q, k, v, iterations=0, is_causal=True, impl="streaming")


def test_iterations_zero_is_the_causal_softmax():
    q, k, v = _qkv(5, 5, grad=False)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(doubly_normalized_attention(q, k, v, iterations=0, is_causal=True), sdpa)
    torch.testing.assert_close(
        prefix.prefix_attention(q, k, v, iterations=0, attn_mask=None, scale=0.5, is_causal=True),
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))


def test_sinkhorn_rows_at_k1_equal_the_cumulative_formula_and_chunks_do_not_matter(monkeypatch):
    q, k, _ = _qkv(8, 8, grad=False, seed=7)
    s = scores_ref(q, k, is_causal=True)
    cumulative = prefix.prefix_weights(q, k, iterations=1, attn_mask=None, scale=0.5, is_causal=True)
    torch.testing.assert_close(prefix._sinkhorn_rows(scores_ref(q, k, 0.5, is_causal=True), 1, 0), cumulative,
                               rtol=1e-12, atol=1e-14)
    full = prefix._sinkhorn_rows(s, 3, 0)
    monkeypatch.setattr(THRESHOLDS, "dn_prefix_chunk_elements", 1)  # one row per chunk
    torch.testing.assert_close(prefix._sinkhorn_rows(s, 3, 0), full, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("iterations", [1, 3])
def test_first_row_gives_the_later_rows_of_the_full_call(iterations):
    q, k, v = _qkv(7, 7, grad=False, seed=8)
    full = prefix.prefix_attention(q, k, v, iterations=iterations, attn_mask=None, scale=0.4, is_causal=True)
    for p in (0, 3, 6, 7):
        part = prefix.prefix_attention(q, k, v, iterations=iterations, attn_mask=None, scale=0.4,
                                       is_causal=True, first_row=p)
        assert part.shape[-2] == 7 - p
        torch.testing.assert_close(part, full[..., p:, :], rtol=1e-12, atol=1e-14)


def test_wide_score_range_float32_matches_float64():
    """Columns whose scores span far more than float32's exp range: no underflow to -inf or NaN."""
    q, k, v = _qkv(9, 9, dtype=torch.float32, grad=False, seed=9)
    q = q * 40  # scores of several hundred: a prefix sum must not be shifted by a later maximum
    out = doubly_normalized_attention(q, k, v, is_causal=True)
    out3 = doubly_normalized_attention(q, k, v, iterations=3, is_causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(out3).all()
    torch.testing.assert_close(out.double(), prefix_attention_ref(q.double(), k.double(), v.double(), 1),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out3.double(), prefix_attention_ref(q.double(), k.double(), v.double(), 3),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_finite_and_close_to_float64(dtype):
    q, k, v = (x.to(dtype).requires_grad_() for x in _qkv(8, 8, grad=False, seed=10))
    for iterations in (1, 2):
        out = doubly_normalized_attention(q, k, v, iterations=iterations, is_causal=True)
        assert out.dtype == dtype and torch.isfinite(out).all()
        ref = prefix_attention_ref(q.detach().double(), k.detach().double(), v.detach().double(), iterations)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-2 if dtype == torch.bfloat16 else 5e-3)
        out.float().sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_public_namespace_exposes_the_option():
    q, k, v = _qkv(3, 3, grad=False)
    torch.testing.assert_close(attnopt.doubly_normalized_attention(q, k, v, causal="prefix"),
                               prefix_attention_ref(q, k, v, 1, is_causal=False))


def test_checkpointed_chunks_give_the_oracle_gradients(monkeypatch):
    """Several chunks, each recomputed in the backward: same values and gradients as the oracle."""
    monkeypatch.setattr(THRESHOLDS, "dn_prefix_chunk_elements", 2 * 3 * 6 * 6 * 2)  # two rows per chunk
    q, k, v = _qkv(6, 6, seed=11)
    out = doubly_normalized_attention(q, k, v, iterations=3, is_causal=True)
    ref = prefix_attention_ref(q, k, v, 3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("iterations", [1, 3])
def test_vmap_and_func_grad_equal_the_batched_autograd_call(iterations):
    from torch.func import grad, vmap

    q, k, v = _qkv(5, 5, grad=False, seed=12)

    def fn(q, k, v):
        return doubly_normalized_attention(q, k, v, iterations=iterations, is_causal=True)

    torch.testing.assert_close(vmap(fn)(q, k, v), fn(q, k, v), rtol=1e-12, atol=1e-14)
    g = grad(lambda q: fn(q, k, v).pow(2).sum())(q)
    q2 = q.clone().requires_grad_()
    fn(q2, k, v).pow(2).sum().backward()
    torch.testing.assert_close(g, q2.grad, rtol=1e-12, atol=1e-14)
