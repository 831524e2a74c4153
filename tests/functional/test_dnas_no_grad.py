"""The no-grad forward of materialized DNAS / Sinkhorn-K / HNAS (``materialized.no_grad_forward``,
and the C pass ``cpu.no_grad_small``, in ``functional/doubly_normalized/``).

Inference (``torch.no_grad()`` or inputs that do not require grad) skips the autograd Function:
nothing saved, normalizations in place on the transposed scores. Checked against the float64
reference, against the training path, and for the cases it must hand back (masks, causal with
``Nk > Nq``, a dominated row).
"""
from __future__ import annotations

import pytest
import torch

import attnopt.functional.doubly_normalized.materialized as dm
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.doubly_normalized import cpu as _dnas_native
from attnopt.functional.doubly_normalized import doubly_normalized_attention, hybrid_normalized_attention
from tests.reference.doubly_normalized import attention_ref, hybrid_ref


@pytest.fixture
def calls(monkeypatch):
    """Count the no-grad forward's calls and the results it returned (``None`` = handed back)."""
    seen: list[bool] = []
    real = dm.no_grad_forward

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(dm, "no_grad_forward", spy)
    return seen


def _qkv(shape, nq, nk, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, n, e, generator=g, dtype=dtype) for s, n, e in
            ((shape, nq, 5), (shape, nk, 5), (shape[-1:], nk, 3))]  # v broadcast over the batch


@pytest.fixture(params=["in place", "vectors", "chunked vectors"])
def steps(request, monkeypatch):
    """Sinkhorn-K's later steps rewriting ``E`` in place, as scaling vectors, and the latter chunk
    by chunk over batch × heads (one head per chunk)."""
    vectors = 1 << 40 if request.param == "in place" else 0
    monkeypatch.setattr(THRESHOLDS, "dnas_no_grad_vector_entries", vectors)
    if request.param == "chunked vectors":
        monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", 0)
    return request.param


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize(("nq", "nk", "causal"), [(6, 7, False), (7, 5, True), (6, 6, True)])
def test_matches_float64_reference_and_the_training_path(calls, steps, iterations, nq, nk, causal):
    q, k, v = _qkv((2, 3), nq, nk)
    with torch.no_grad():
        out = doubly_normalized_attention(q, k, v, iterations=iterations, causal="plan", is_causal=causal,
                                          impl="materialized")
        hyb = {}
        for w in (torch.tensor(0.3, dtype=torch.float64), torch.tensor([0.0, 0.6, 1.0], dtype=torch.float64)):
            hyb[w.dim()] = hybrid_normalized_attention(q, k, v, w, iterations=iterations,
                                                       causal="plan", is_causal=causal,
                                                       impl="materialized")
            ref = hybrid_ref(q, k, v, w, iterations, is_causal=causal)
            torch.testing.assert_close(hyb[w.dim()], ref, rtol=1e-10, atol=1e-12)
    assert calls == [True, True, True]
    ref = attention_ref(q, k, v, iterations, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # grad mode with inputs that do not require grad takes it too; requiring grad does not
    assert torch.equal(doubly_normalized_attention(q, k, v, iterations=iterations,
                                                   causal="plan", is_causal=causal,
                                                   impl="materialized"), out)
    assert len(calls) == 4
    qg = q.clone().requires_grad_()
    trained = doubly_normalized_attention(qg, k, v, iterations=iterations, causal="plan", is_causal=causal,
                                          impl="materialized")
    assert len(calls) == 4 and trained.requires_grad
    torch.testing.assert_close(trained.detach(), out, rtol=1e-12, atol=1e-13)


def test_float32_auto_at_small_n_and_half_precision(calls):
    q, k, v = (x.float() for x in _qkv((2, 4), 16, 16, seed=1))
    with torch.no_grad():
        out = doubly_normalized_attention(q, k, v)  # auto: materialized at this size
        sk = doubly_normalized_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), iterations=3)
    # float32 K = 1 takes the one C pass where the native library is built (not counted here)
    assert calls == ([True] if _dnas_native.library(q, 1) is not None else [True, True])
    torch.testing.assert_close(out.double(), attention_ref(q.double(), k.double(), v.double()),
                               rtol=2e-5, atol=2e-6)
    assert sk.dtype == torch.bfloat16
    torch.testing.assert_close(sk.double(), attention_ref(q.double(), k.double(), v.double(), 3),
                               rtol=2e-2, atol=2e-2)


def test_masks_and_causal_with_more_keys_take_the_function(calls):
    """Dead rows / keys need the zero-weight rule of :class:`_MaterializedSinkhorn`: not taken."""
    q, k, v = _qkv((2, 3), 5, 6)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 2:] = False
    with torch.no_grad():
        out = doubly_normalized_attention(q, k, v, attn_mask=mask, impl="materialized")
        causal = doubly_normalized_attention(q, k, v, iterations=2,
                                             causal="plan", is_causal=True, impl="materialized")
    assert calls == []
    torch.testing.assert_close(out, attention_ref(q, k, v, 1, mask=mask), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(causal, attention_ref(q, k, v, 2, is_causal=True), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("iterations", [1, 3])
def test_a_dominated_row_is_handed_back_to_the_log_domain(calls, iterations, monkeypatch):
    """float32, no mask: query 2 scores ~330 below every other query on every key, so its first row
    sum underflows; the no-grad path returns None and the log-domain fallback gives the answer."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, 6, 3, generator=g)
    k[..., 0] += 10.0
    q = torch.randn(1, 2, 6, 3, generator=g)
    q[..., 0] = 3.0
    q[..., 2, :] = torch.tensor([-30.0, 0.0, 0.0])
    v = torch.randn(1, 2, 6, 4, generator=g)
    w = torch.tensor(0.4)
    real = _dnas_native.no_grad_small

    def c_spy(*args):  # K = 1 float32 with the native library: the C pass hands back instead
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_dnas_native, "no_grad_small", c_spy)
    with torch.no_grad():
        out = hybrid_normalized_attention(q, k, v, w, iterations=iterations, scale=1.0, impl="materialized")
    assert calls == [False]
    ref = hybrid_ref(q.double(), k.double(), v.double(), w.double(), iterations, scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_c_pass_and_its_fallback(native_or_torch, calls, monkeypatch, causal):
    """K = 1 float32: one C call over all heads (native) or the PyTorch ops; DNAS and HNAS with a
    scalar and a per-head weight, against the float64 reference."""
    c_calls = []
    real = _dnas_native.no_grad_small
    monkeypatch.setattr(_dnas_native, "no_grad_small", lambda *a: c_calls.append(1) or real(*a))
    q, k, v = (x.float() for x in _qkv((2, 3), 9, 8 if causal else 10, seed=6))
    k = k.expand(2, 3, -1, -1)  # a broadcast (stride-0) batch dim
    d64 = [x.double() for x in (q, k, v)]
    with torch.no_grad():
        out = doubly_normalized_attention(q, k, v, causal="plan", is_causal=causal)
        torch.testing.assert_close(out.double(), attention_ref(*d64, is_causal=causal), rtol=2e-5, atol=2e-6)
        for w in (torch.tensor(0.3), torch.tensor([0.0, 0.6, 1.0])):
            hyb = hybrid_normalized_attention(q, k, v, w, causal="plan", is_causal=causal)
            ref = hybrid_ref(*d64, w.double(), is_causal=causal)
            torch.testing.assert_close(hyb.double(), ref, rtol=2e-5, atol=2e-6)
    # the router runs the one C pass (native) or the PyTorch no-grad forward, never both
    assert calls == ([] if native_or_torch == "native" else [True, True, True])
    assert len(c_calls) == (3 if native_or_torch == "native" else 0)
