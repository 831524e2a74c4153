"""The materialized DNAS / Sinkhorn-K / HNAS kernel (``doubly_normalized/materialized.py``) chunk by
chunk over batch × heads, and its underflow fallback (one piece and chunked)."""
from __future__ import annotations

import pytest
import torch

import attnopt.functional.doubly_normalized.materialized as mat
from attnopt.functional import dispatch
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.doubly_normalized import (
    doubly_normalized_attention,
    hybrid_normalized_attention,
    reference,
)
from tests.reference.doubly_normalized import attention_ref, hybrid_ref


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of one or two (batch, head) slices: every split of ``_chunks`` is exercised."""
    monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", 60)


def _qkv(shape, nq, nk, d=3, dv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, n, e, generator=g, dtype=torch.float64).requires_grad_()
            for n, e in ((nq, d), (nk, d), (nk, dv))]


def _mask(kind, shape, nq, nk):
    g = torch.Generator().manual_seed(3)
    if kind is None:
        return None
    if kind == "key":  # key padding; the first batch entry sees no key at all
        m = torch.rand(*shape[:1], *[1] * (len(shape) - 1), 1, nk, generator=g) > 0.3
        m[0] = False
        return m
    m = torch.rand(*shape, nq, nk, generator=g) > 0.3  # full, with an empty row and an unseen key
    m[..., 1, :] = False
    m[..., :, 0] = False
    return m


def _check(out, ref, leaves):
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(("shape", "kind", "iterations"), [
    ((3, 4), None, 1), ((3, 4), "key", 3), ((5,), "full", 1), ((2, 2, 3), "full", 2), ((2, 2, 3), "key", 1),
])
def test_chunked_matches_float64_reference(tiny_chunks, shape, kind, iterations):
    for causal in (False, True):
        nq, nk = (5, 5) if causal else (5, 6)
        q, k, v = _qkv(shape, nq, nk)
        mask = _mask(kind, shape, nq, nk)
        out = doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask,
                                          causal="plan", is_causal=causal,
                                          impl="materialized")
        _check(out, attention_ref(q, k, v, iterations, mask=mask, is_causal=causal), (q, k, v))
        for w in (torch.tensor(0.3, dtype=torch.float64),
                  torch.linspace(0.0, 1.0, shape[-1], dtype=torch.float64)):
            w.requires_grad_()
            out = hybrid_normalized_attention(q, k, v, w, iterations=iterations, attn_mask=mask,
                                              causal="plan", is_causal=causal, impl="materialized")
            _check(out, hybrid_ref(q, k, v, w, iterations, mask=mask, is_causal=causal), (q, k, v, w))


def test_chunks_cover_every_slice_once():
    for b, h, per in ((7, 3, 10), (2, 9, 25), (1, 1, 10**9), (4, 4, 1)):
        for limit in (1, 30, 64, 1000):
            saved = THRESHOLDS.dnas_materialized_chunk_entries
            THRESHOLDS.dnas_materialized_chunk_entries = limit
            try:
                parts = mat._chunks(b, h, per)
            finally:
                THRESHOLDS.dnas_materialized_chunk_entries = saved
            seen = torch.zeros(b, h, dtype=torch.long)
            for bs, hs in parts:
                seen[bs, hs] += 1
            assert torch.equal(seen, torch.ones(b, h, dtype=torch.long)), (b, h, per, limit)


@pytest.mark.parametrize("chunk", [1 << 20, 60])
@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_gradcheck_hybrid_and_sinkhorn_with_mask(monkeypatch, chunk, iterations):
    """float64 gradcheck of the kernel in one piece and chunked: HNAS (the weight's gradient too)
    with a full mask, Sinkhorn-K under the causal plan."""
    monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", chunk)
    q, k, v = _qkv((2, 2), 4, 5, seed=5)
    w = torch.tensor([0.25, 0.7], dtype=torch.float64, requires_grad=True)
    mask = _mask("full", (2, 2), 4, 5)
    assert torch.autograd.gradcheck(
        lambda q, k, v, w: hybrid_normalized_attention(q, k, v, w, iterations=iterations, attn_mask=mask,
                                                       impl="materialized"), (q, k, v, w), fast_mode=True)
    q, k, v = _qkv((2, 2), 5, 5, seed=6)
    assert torch.autograd.gradcheck(
        lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=iterations, is_causal=True,
                                                    causal="plan", impl="materialized"), (q, k, v),
        fast_mode=True)


@pytest.mark.parametrize("chunk", [1 << 20, 40])
def test_kernel_path_taken_and_inference_matches_training(monkeypatch, chunk):
    """One piece or one chunk per head (36 scores each): the autograd Function and the no-grad
    forward both answer (no fallback), equal to the reference and to each other."""
    monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", chunk)
    q, k, v = _qkv((2, 3), 6, 6)
    with torch.no_grad():
        inf = doubly_normalized_attention(q, k, v, iterations=2, impl="auto")
    assert dispatch.last_dispatch["sinkhorn"] == "materialized"
    # inference runs the no-grad forward (transposed, nothing saved): the same up to rounding
    train = doubly_normalized_attention(q, k, v, iterations=2)
    torch.testing.assert_close(inf, train, rtol=1e-12, atol=1e-13)
    qkv4 = [x.contiguous() for x in (q, k, v)]
    out = mat.materialized_sinkhorn(*qkv4, None, None, False, 0.5, 1)
    assert out is not None  # the kernel itself, not its log-domain fallback
    torch.testing.assert_close(out, attention_ref(q, k, v, 1, scale=0.5))
    with torch.no_grad():
        for iterations in (1, 3):
            out = mat.no_grad_forward(*qkv4, None, False, 0.5, iterations)
            assert out is not None
            torch.testing.assert_close(out, attention_ref(q, k, v, iterations, scale=0.5))


@pytest.mark.parametrize("chunk", [1 << 20, 40])
@pytest.mark.parametrize("iterations", [1, 3])
def test_underflow_detected_and_falls_back(monkeypatch, chunk, iterations):
    """float32: a row ~200 below the rest in every column underflows σ (DNAS and HNAS), in one
    piece and in the chunk that holds it; a fully masked row is not an underflow."""
    monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", chunk)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g) for _ in range(3))
    bias = torch.zeros(1, 1, 6, 6)
    bias[..., 2, :] = -200.0
    w = torch.tensor(0.4)
    assert mat.materialized_sinkhorn(q, k, v, None, bias, False, 0.5, iterations) is None
    assert mat.materialized_sinkhorn(q, k, v, w.view(1, 1, 1, 1), bias, False, 0.5, iterations) is None
    out = hybrid_normalized_attention(q, k, v, w, iterations=iterations, attn_mask=bias, impl="materialized")
    ref = hybrid_ref(q.double(), k.double(), v.double(), w.double(), iterations, mask=bias.double())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    # an admissible row is never mistaken for an empty one: a fully masked row is not an underflow
    empty = torch.zeros(1, 1, 6, 6)
    empty[..., 2, :] = float("-inf")
    assert mat.materialized_sinkhorn(q, k, v, w.view(1, 1, 1, 1), empty, False, 0.5, iterations) is not None


@pytest.mark.parametrize("chunk", ["one piece", "chunked"])
@pytest.mark.parametrize("iterations", [1, 3])
def test_underflow_fallback_gives_the_reference_values_and_gradients(monkeypatch, chunk, iterations):
    """A dominated row (float32, ~200 below the rest in every column) under autograd: the
    materialized kernel (in one piece or chunked) reports the underflow and the router's
    log-domain reference answers,
    values and gradients (q, k, v, w) equal to the float64 reference."""
    if chunk == "chunked":  # one head per chunk
        monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", 0)
    monkeypatch.setattr(THRESHOLDS, "dnas_native_min_entries", 1 << 40)  # the PyTorch kernels only
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g) for _ in range(3))
    bias = torch.zeros(1, 1, 6, 6)
    bias[..., 2, :] = -200.0
    w = torch.tensor(0.4)
    fallbacks = []
    real = reference.attention
    monkeypatch.setattr(reference, "attention", lambda *a: fallbacks.append(1) or real(*a))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, w)]
    out = hybrid_normalized_attention(*leaves[:3], leaves[3], iterations=iterations, attn_mask=bias,
                                      impl="materialized")
    assert dispatch.last_dispatch["hybrid_normalized"] == "materialized" and fallbacks == [1]
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, w)]
    ref = hybrid_ref(*ref_leaves[:3], ref_leaves[3], iterations, mask=bias.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, leaves, go)
    ref_grads = torch.autograd.grad(ref, ref_leaves, go.double())
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4)
