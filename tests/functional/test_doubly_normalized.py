"""DNAS / Sinkhorn-K / HNAS: float64 reference, gradcheck, properties, POT oracle, half precision."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import attnopt
from attnopt.analysis import column_mass
from attnopt.functional import (
    dispatch,
    doubly_normalized_attention,
    doubly_normalized_weights,
    hybrid_normalized_attention,
    hybrid_normalized_weights,
)
from attnopt.functional.doubly_normalized import flash_cpu as fc
from tests.reference.doubly_normalized import attention_ref, hybrid_ref, scores_ref, sinkhorn_weights_ref

BACKENDS = ["flash_cpu", "chunked", "materialized"]
STREAMING = ["flash_cpu", "chunked"]


@contextlib.contextmanager
def backend(name: str):
    """Force a path: the fused materialized one, or streaming on the flash kernel or on the
    blocked pure-PyTorch passes (what non-CPU devices run, by hiding the kernel)."""
    orig = fc.flash_available
    saved = {m: dict(v) for m, v in dispatch.CROSSOVERS.items()}
    limit = 1 << 62 if name == "materialized" else -1
    for table in dispatch.CROSSOVERS.values():
        for key in table:
            table[key] = limit
    if name == "chunked":
        fc.flash_available = lambda x: False
    try:
        yield
    finally:
        fc.flash_available = orig
        for m, v in saved.items():
            dispatch.CROSSOVERS[m].update(v)


def _inputs(b, h, nq, nk, d, dv, seed=0, dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, h, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, h, nk, dv, generator=g, dtype=dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _mask(kind, b, h, nq, nk, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "key_bool":  # key padding; batch 0 has every key masked
        m = torch.rand(b, 1, 1, nk, generator=g) > 0.3
        m[0] = False
        m[-1, ..., 0] = True
        return m
    if kind == "key_float":
        m = torch.randn(b, 1, 1, nk, generator=g, dtype=torch.float64)
        m[..., -1] = float("-inf")
        return m
    m = torch.randn(b, h, nq, nk, generator=g, dtype=torch.float64)  # full, with an empty row and column
    m[torch.rand(b, h, nq, nk, generator=g) < 0.3] = float("-inf")
    m[0, 0, 1, :] = float("-inf")
    m[-1, -1, :, 0] = float("-inf")
    return m


CASES = [  # nq, nk, d, dv, mask, causal
    (5, 7, 4, 4, None, False),
    (6, 6, 3, 5, None, True),
    (4, 9, 3, 2, "key_bool", False),
    (5, 8, 3, 3, "key_float", True),
    (7, 4, 3, 3, None, True),
    (5, 6, 3, 3, "full", False),
    (5, 5, 3, 3, "full", True),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference_forward_and_gradients(name, case):
    nq, nk, d, dv, kind, causal = case
    q, k, v = _inputs(2, 3, nq, nk, d, dv)
    mask = _mask(kind, 2, 3, nq, nk)
    for iterations in (1, 2, 3):
        with backend(name):
            out = doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask, scale=0.7,
                                              causal="plan", is_causal=causal)
        ref = attention_ref(q, k, v, iterations, scale=0.7, mask=mask, is_causal=causal)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        go = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), go)
        want = torch.autograd.grad(ref, (q, k, v), go)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_iterations_zero_is_softmax_attention():
    q, k, v = _inputs(1, 2, 5, 6, 4, 4, grad=False)
    mask = _mask("key_float", 1, 2, 5, 6)
    out = doubly_normalized_attention(q, k, v, iterations=0, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    torch.testing.assert_close(out, attention_ref(q, k, v, 0, mask=mask))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("iterations", [1, 2])
def test_gradcheck(name, iterations):
    q, k, v = _inputs(1, 1, 3, 4, 3, 2, seed=3)
    mask = torch.tensor([True, False, True, True]).view(1, 1, 1, 4)
    with backend(name):
        assert torch.autograd.gradcheck(
            lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask),
            (q, k, v), fast_mode=True,
        )
        q4 = q.detach()[..., :3, :].clone().requires_grad_()
        k4, v4 = (x.detach()[..., :3, :].clone().requires_grad_() for x in (k, v))
        assert torch.autograd.gradcheck(
            lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=iterations,
                                                        causal="plan", is_causal=True),
            (q4, k4, v4), fast_mode=True,
        )


def test_gradcheck_full_mask_and_hybrid_weight():
    q, k, v = _inputs(1, 2, 3, 3, 2, 2, seed=4)
    w = torch.tensor([0.3, 0.8], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, True, True], [True, False, True]])
    assert torch.autograd.gradcheck(lambda q, k, v: doubly_normalized_attention(q, k, v, attn_mask=mask),
                                    (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v, w: hybrid_normalized_attention(q, k, v, w), (q, k, v, w),
                                    fast_mode=True)


def test_backward_saves_nothing_of_size_nq_nk():
    mask = torch.ones(1, 1, 1, 64, dtype=torch.bool)
    mask[..., :3] = False
    for name in STREAMING:
        for iterations, nk, kw in ((1, 64, {"attn_mask": mask}), (3, 64, {"attn_mask": mask}),
                                   (1, 48, {"is_causal": True, "causal": "plan"}),
                                   (2, 64, {"is_causal": True, "causal": "plan"})):
            q, k, v = _inputs(1, 1, 64, nk, 8, 8, grad=True)
            sizes: list[int] = []

            def pack(t):
                sizes.append(t.numel())  # noqa: B023
                return t

            with backend(name), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = doubly_normalized_attention(q, k, v, iterations=iterations, **kw)
            out.sum().backward()
            assert sizes and max(sizes) < 64 * nk, (name, iterations, kw, max(sizes))


@given(
    nq=st.integers(1, 7), nk=st.integers(1, 7), seed=st.integers(0, 10_000),
    spread=st.floats(0.1, 30.0), iterations=st.integers(1, 3),
)
def test_weights_rows_sum_to_one_and_lemma1(nq, nk, seed, spread, iterations):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, nq, 3, generator=g, dtype=torch.float64) * spread
    k = torch.randn(1, 1, nk, 3, generator=g, dtype=torch.float64) * spread
    w = doubly_normalized_weights(q, k, iterations=iterations)
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 1, nq, dtype=torch.float64))
    if iterations == 1:  # Lemma 1: each key keeps column mass >= 1/Nk
        assert column_mass(w).min() >= 1.0 / nk - 1e-12
    v = torch.randn(1, 1, nk, 2, generator=g, dtype=torch.float64)
    torch.testing.assert_close(doubly_normalized_attention(q, k, v, iterations=iterations), w @ v)


@given(nq=st.integers(2, 6), nk=st.integers(2, 6), seed=st.integers(0, 10_000))
def test_sinkhorn_column_sums_approach_nq_over_nk(nq, nk, seed):
    # Sinkhorn contracts at a rate set by the score range (Hilbert metric: tanh(range/2));
    # half-scale inputs keep that range where 60 iterations always reach 1e-6 (at full scale
    # a 2x2 draw with scores ~6 apart still had 2.7e-6 left after 60 iterations).
    g = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(1, 1, nq, 3, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(1, 1, nk, 3, generator=g, dtype=torch.float64)
    target = torch.full((1, 1, nk), nq / nk, dtype=torch.float64)
    err = [float((column_mass(doubly_normalized_weights(q, k, iterations=it)) - target).abs().max())
           for it in (1, 5, 60)]
    assert err[2] < 1e-6
    assert err[2] <= err[0] + 1e-12


def test_sinkhorn_k_equals_pot_sinkhorn_k_iterations():
    ot = pytest.importorskip("ot")
    q, k, _ = _inputs(1, 1, 6, 9, 4, 4, grad=False)
    s = scores_ref(q, k)[0, 0].numpy()
    for iterations in (1, 2, 5):
        plan = ot.sinkhorn(np.full(6, 1 / 6), np.full(9, 1 / 9), -s, reg=1.0, numItermax=iterations,
                           stopThr=0.0, warn=False)
        ours = doubly_normalized_weights(q, k, iterations=iterations)[0, 0].numpy()
        np.testing.assert_allclose(ours, 6 * plan, rtol=1e-10, atol=1e-13)


def test_hybrid_weight_zero_and_one_are_exact():
    q, k, v = _inputs(2, 3, 5, 6, 4, 4, grad=False)
    mask = _mask("key_bool", 2, 3, 5, 6)
    one, zero = torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    dn = doubly_normalized_attention(q, k, v, attn_mask=mask, impl="streaming")
    ln = doubly_normalized_attention(q, k, v, iterations=0, attn_mask=mask)
    assert torch.equal(hybrid_normalized_attention(q, k, v, one, attn_mask=mask, impl="streaming"), dn)
    assert torch.equal(hybrid_normalized_attention(q, k, v, zero, attn_mask=mask, impl="streaming"), ln)
    for w, ref in ((one, dn), (zero, ln)):  # the fused path: the same up to rounding
        fused = hybrid_normalized_attention(q, k, v, w, attn_mask=mask, impl="materialized")
        torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
    w = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(hybrid_normalized_attention(q, k, v, w, attn_mask=mask),
                               hybrid_ref(q, k, v, w, mask=mask))
    hw = hybrid_normalized_weights(q, k, w, attn_mask=mask)
    torch.testing.assert_close(hw @ v, hybrid_ref(q, k, v, w, mask=mask))


def test_fully_masked_rows_and_unseen_keys():
    q, k, v = _inputs(1, 1, 4, 6, 3, 3)
    out = doubly_normalized_attention(q, k, v,
                                      causal="plan", is_causal=True)  # keys 4, 5 are seen by no query
    w = doubly_normalized_weights(q, k, causal="plan", is_causal=True)
    assert torch.equal(w[..., 4:], torch.zeros_like(w[..., 4:]))
    torch.testing.assert_close(out, w @ v)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    out = doubly_normalized_attention(q, k, v, attn_mask=mask, iterations=2)
    assert torch.equal(out[..., 2, :], torch.zeros(1, 1, 3, dtype=torch.float64))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", BACKENDS)
def test_half_precision_no_nan_and_close_to_golden(dtype, name):
    q, k, v = _inputs(1, 2, 16, 16, 8, 8, seed=5, dtype=torch.float64, grad=False)
    q = q * 6  # large scores
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    mask[..., :4] = False
    gold = attention_ref(q, k, v, 1, mask=mask)
    qh, kh, vh = (x.to(dtype).requires_grad_() for x in (q, k, v))
    with backend(name):
        out = doubly_normalized_attention(qh, kh, vh, attn_mask=mask)
        out3 = doubly_normalized_attention(qh, kh, vh, attn_mask=mask, iterations=3,
                                           causal="plan", is_causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(out3).all()
    (out.float().sum() + out3.float().sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in (qh, kh, vh))
    naive = (sinkhorn_weights_ref(scores_ref(qh.detach(), kh.detach(), mask=mask).float(), 1).to(dtype)
             @ vh.detach())
    naive_err = (naive.double() - gold).abs().max()
    assert (out.double() - gold).abs().max() <= 4 * naive_err + 1e-3


def test_broadcast_batch_dims_and_3d_inputs():
    q, k, v = _inputs(2, 3, 5, 4, 3, 3, grad=False)
    out = doubly_normalized_attention(q, k[:1], v[:1], iterations=2)
    torch.testing.assert_close(out, attention_ref(q, k[:1], v[:1], 2))
    out3 = doubly_normalized_attention(q[0], k[0], v[0])
    torch.testing.assert_close(out3, attention_ref(q[0], k[0], v[0], 1))
    assert attnopt.doubly_normalized_attention is doubly_normalized_attention


def test_bad_inputs():
    q, k, v = _inputs(1, 2, 3, 4, 3, 3, grad=False)
    with pytest.raises(ValueError, match="iterations"):
        doubly_normalized_attention(q, k, v, iterations=-1)
    with pytest.raises(TypeError, match="iterations"):
        doubly_normalized_attention(q, k, v, iterations=1.5)
    with pytest.raises(ValueError, match="scale"):
        doubly_normalized_attention(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="attn_mask"):
        doubly_normalized_attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="head"):
        doubly_normalized_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="weight"):
        hybrid_normalized_attention(q, k, v, torch.tensor(1.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight"):
        hybrid_normalized_attention(q, k, v, torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="weight"):
        hybrid_normalized_weights(q, k, 0.5)
    with pytest.raises(TypeError):
        doubly_normalized_weights(q.long(), k)


def test_differentiable_float_mask_gets_its_gradient():
    q, k, v = _inputs(1, 2, 4, 5, 3, 3)
    mask = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    out = doubly_normalized_attention(q, k, v, attn_mask=mask, iterations=2)
    ref = attention_ref(q, k, v, 2, mask=mask)
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, mask, go)[0], torch.autograd.grad(ref, mask, go)[0])


def test_weights_gradient_finite_with_empty_columns_and_rows():
    q, k, _ = _inputs(1, 1, 3, 5, 2, 2)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = False
    for kw in ({"is_causal": True, "causal": "plan"}, {"attn_mask": mask}):
        w = doubly_normalized_weights(q, k, iterations=2, **kw)
        gq, gk = torch.autograd.grad((w * torch.arange(5.0, dtype=torch.float64)).sum(), (q, k))
        assert torch.isfinite(gq).all() and torch.isfinite(gk).all()
        ref = sinkhorn_weights_ref(scores_ref(q, k, mask=kw.get("attn_mask"), is_causal="is_causal" in kw), 2)
        torch.testing.assert_close(w, ref)
