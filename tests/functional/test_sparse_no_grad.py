"""The no-grad forward of fused sparsemax / 1.5-entmax attention (``regularized/materialized.py``).

Inference (``torch.no_grad()`` or inputs that do not require grad) runs the C map of
``_sparse_native`` in place on the scores at every size and saves nothing; without the C kernel
(``ATTNOPT_NATIVE=0``) the autograd Function runs as before. Both are checked against the
float64 sort-based reference, with masks (a fully masked row), causal, locality and broadcasting.
"""
from __future__ import annotations

import pytest
import torch

import attnopt.functional.regularized.materialized as sf
from attnopt.functional.regularized import cpu as _sparse_native
from attnopt.functional.regularized import locality_bias, regularized_attention
from attnopt.functional.regularized.regularizers import SquaredL2, Tsallis
from tests.reference.regularized import attention_reference, entmax15_sort, sparsemax_sort

REGS = {2.0: (SquaredL2(), sparsemax_sort), 1.5: (Tsallis(1.5), entmax15_sort)}


@pytest.fixture
def calls(monkeypatch):
    seen: list[int] = []
    real = sf._no_grad_forward

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sf, "_no_grad_forward", spy)
    return seen


def _qkv(dtype, seed=0, nq=6, nk=7):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, nq, 4, generator=g, dtype=dtype) * 2
    k = torch.randn(2, 3, nk, 4, generator=g, dtype=dtype) * 2
    v = torch.randn(3, nk, 5, generator=g, dtype=dtype)  # broadcast over the batch
    return q, k, v


@pytest.mark.parametrize("alpha", [2.0, 1.5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_float64_reference_with_masks_causal_and_locality(native_or_torch, calls, alpha, dtype):
    reg, ref_map = REGS[alpha]
    q, k, v = _qkv(dtype)
    mask = torch.rand(2, 1, 6, 7, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    mask[0, :, 3] = False  # a fully masked row: zeros
    beta = torch.tensor([0.0, 0.3, 1.0], dtype=dtype)
    tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    cases = [dict(), dict(attn_mask=mask), dict(is_causal=True),
             dict(locality=beta, attn_mask=mask, is_causal=True), dict(locality=0.5)]
    for kw in cases:
        with torch.no_grad():
            out = regularized_attention(q, k, v, regularizer=reg, impl="materialized", **kw)
        bias = None
        if "locality" in kw:
            bias = locality_bias(6, 7, kw["locality"], dtype=torch.float64, device="cpu")
        ref = attention_reference(q, k, v, lambda s: ref_map(s, -1), mask=kw.get("attn_mask"), bias=bias,
                                  causal=kw.get("is_causal", False))
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, **tol)
        if "attn_mask" in kw:
            assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    assert len(calls) == (len(cases) if native_or_torch == "native" else 0)
    # grad mode with inputs that do not require grad takes the same path; requiring grad does not
    plain = regularized_attention(q, k, v, regularizer=reg, impl="materialized")
    assert len(calls) == (len(cases) + 1 if native_or_torch == "native" else 0)
    trained = regularized_attention(q.clone().requires_grad_(), k, v, regularizer=reg, impl="materialized")
    assert trained.requires_grad and len(calls) == (len(cases) + 1 if native_or_torch == "native" else 0)
    torch.testing.assert_close(plain, trained.detach(), **tol)


@pytest.mark.parametrize("alpha", [2.0, 1.5])
def test_rows_the_c_search_does_not_settle_are_recomputed(calls, monkeypatch, alpha):
    """A row the C search reports (status 1) gets the whole map again on the PyTorch search."""
    if not _sparse_native.library_available():
        pytest.skip("no C compiler on this machine")
    reg, ref_map = REGS[alpha]
    q, k, v = _qkv(torch.float64, seed=2)
    real = _sparse_native.forward
    first = [True]

    def unsettled(x, a, max_iter, **kw):  # the first call reports two rows unsettled
        p, theta, redo = real(x, a, max_iter, **kw)
        if first[0]:
            first[0] = False
            p.fill_(float("nan"))  # whatever the kernel left there must not be used
            redo = torch.arange(2)
        return p, theta, redo

    monkeypatch.setattr(_sparse_native, "forward", unsettled)
    with torch.no_grad():
        out = regularized_attention(q, k, v, regularizer=reg, impl="materialized")
    assert calls == [1]
    ref = attention_reference(q, k, v, lambda s: ref_map(s, -1))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)


def test_half_precision_and_non_finite_inputs_rejected(calls):
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(torch.float32, seed=3))
    ref = attention_reference(q.double(), k.double(), v.double(), lambda s: entmax15_sort(s, -1))
    with torch.no_grad():
        out = regularized_attention(q, k, v, regularizer=Tsallis(1.5))
        q[0, 0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="q contains NaN"):
            regularized_attention(q, k, v, regularizer=Tsallis(1.5))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)
