"""The native (C) DNAS / HNAS path (``doubly_normalized/cpu.py``, ``_native/dnas.c``) and its fallback.

The C passes are float32 only: values and gradients are checked against the float64 reference
(``tests/reference``) at float32 tolerances, and against the PyTorch fused path they replace.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

import attnopt.functional.doubly_normalized.cpu as native
import attnopt.functional.doubly_normalized.materialized as mat
from attnopt import _native
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.doubly_normalized import doubly_normalized_attention, hybrid_normalized_attention
from tests._marks import needs_native
from tests.reference.doubly_normalized import attention_ref, hybrid_ref


@pytest.fixture
def small(monkeypatch):
    """Every float32 call takes the fused kernel; native chunks of a few heads (splits across batches)."""
    monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", 0)
    monkeypatch.setattr(THRESHOLDS, "dnas_native_min_entries", 0)
    monkeypatch.setattr(THRESHOLDS, "dnas_cpu_chunk_entries", 100)


@pytest.fixture
def path(native_or_torch):
    """Both sides: the C kernel and the PyTorch fallback (tests/functional/conftest.py)."""
    return native_or_torch


def _inputs(shape, nq, nk, d=5, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, n, e, generator=g) for n, e in ((nq, d), (nk, d), (nk, dv))]


def _mask(kind, shape, nq, nk):
    g = torch.Generator().manual_seed(3)
    if kind == "key":  # key padding; the first batch entry sees no key at all
        m = torch.rand(shape[0], *[1] * (len(shape) - 1), 1, nk, generator=g) > 0.3
        m[0] = False
        return m
    if kind == "keybias":  # finite key biases cancel in E but not in the LNAS share; one key dropped
        m = torch.randn(shape[0], *[1] * (len(shape) - 1), 1, nk, generator=g)
        m[..., 2] = float("-inf")
        return m
    if kind == "padding":  # key and query padding, as the modules pass it: (B, 1, Nq, Nk)
        keys = torch.rand(shape[0], nk, generator=g) > 0.3
        queries = torch.rand(shape[0], nq, generator=g) > 0.3
        queries[:, 0] = True
        return (queries[:, :, None] & keys[:, None, :]).view(shape[0], *[1] * (len(shape) - 1), nq, nk)
    if kind == "full":  # an empty row and an unseen key
        m = torch.rand(*shape, nq, nk, generator=g) > 0.3
        m[..., 1, :] = False
        m[..., :, 0] = False
        return m
    return None


def _check(out, ref, leaves, ref_leaves):
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, go.float())
    want = torch.autograd.grad(ref, ref_leaves, go)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("kind", [None, "key", "keybias", "padding", "full"])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_matches_float64_reference(small, path, kind, causal):
    shape = (3, 2)
    nq, nk = (7, 7) if causal else (7, 9)
    q, k, v = _inputs(shape, nq, nk)
    mask = _mask(kind, shape, nq, nk)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    rmask = mask.double() if mask is not None and mask.is_floating_point() else mask
    out = doubly_normalized_attention(*leaves, attn_mask=mask,
                                      causal="plan", is_causal=causal, impl="materialized")
    _check(out, attention_ref(*ref_leaves, 1, mask=rmask, is_causal=causal), leaves, ref_leaves)
    for w in (torch.tensor(0.3), torch.tensor([0.0, 0.8]), torch.tensor(1.0)):
        wl, wr = w.clone().requires_grad_(), w.double().requires_grad_()
        out = hybrid_normalized_attention(*leaves, wl, attn_mask=mask,
                                          causal="plan", is_causal=causal, impl="materialized")
        ref = hybrid_ref(*ref_leaves, wr, 1, mask=rmask, is_causal=causal)
        _check(out, ref, [*leaves, wl], [*ref_leaves, wr])


@pytest.mark.parametrize("shape", [(3, 1), (1, 2), (3, 2)])
def test_admissible_rows_of_a_full_mask_read_without_broadcasting(shape):
    """The shortcut for a full mask alone (query padding) is the general rule's answer."""
    g = torch.Generator().manual_seed(1)
    full = torch.where(torch.rand(*shape, 5, 6, generator=g) > 0.6, 0.0, float("-inf"))
    full[..., 2, :] = float("-inf")
    fast = native._admissible_rows(full, None, False, 3, 2, 5, 6)
    general = torch.isfinite(full).expand(3, 2, 5, 6).reshape(6, 5, 6).any(-1)
    assert torch.equal(fast, general) and not bool(fast[:, 2].any())


@needs_native
def test_native_path_taken_and_agrees_with_the_pytorch_fused_path(monkeypatch):
    monkeypatch.setattr(_native, "_LIBS", {})
    monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)
    calls = []
    real = native.native_sinkhorn
    monkeypatch.setattr(native, "native_sinkhorn", lambda *a: calls.append(1) or real(*a))
    q, k, v = (x.view(2, 3, 40, -1).requires_grad_() for x in _inputs((6,), 40, 40, d=8, dv=8, seed=2))
    w = torch.tensor([0.2, 0.5, 0.9]).view(1, 3, 1, 1).requires_grad_()
    mask = torch.zeros(2, 1, 1, 40)
    mask[1, ..., 30:] = float("-inf")
    monkeypatch.setattr(THRESHOLDS, "dnas_native_min_entries", 0)
    monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", 0)
    results = []
    for env in ("1", "0"):
        monkeypatch.setenv("ATTNOPT_NATIVE", env)  # the router runs the C passes, then the PyTorch kernel
        out = hybrid_normalized_attention(q, k, v, w.view(3), attn_mask=mask, scale=0.3, impl="materialized")
        results.append([out, *torch.autograd.grad(out.square().sum(), (q, k, v, w))])
    assert calls == [1]  # ATTNOPT_NATIVE=0 ran the PyTorch materialized kernel (chunked)
    direct = mat.materialized_sinkhorn(q, k, v, w, mask, False, 0.3, 1)
    assert direct is not None
    torch.testing.assert_close(direct, results[1][0], rtol=1e-6, atol=1e-7)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@needs_native
def test_threads_split_heads_and_match_one_thread(monkeypatch):
    monkeypatch.setattr(THRESHOLDS, "dnas_cpu_chunk_entries", 1 << 12)
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 1)
    q, k, v = (x.requires_grad_() for x in _inputs((2, 5), 33, 33, d=8, dv=4, seed=7))
    lib = native.library(q, 1)
    assert lib is not None
    w = torch.tensor(0.6).view(1, 1, 1, 1).requires_grad_()
    results, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = native.native_sinkhorn(lib, q, k, v, w, None, True, 0.4)
            assert out is not None
            results.append([out, *torch.autograd.grad(out.sum(), (q, k, v, w))])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@needs_native
def test_polynomial_exp_accuracy():
    lib = _native.library("dnas")
    assert lib is not None
    x = torch.cat([-torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 87,
                   torch.tensor([0.0, -1e-30, -86.99, -87.0, -87.5, -150.0, float("-inf")])])
    y = x.clone()
    lib.dn_exp(ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(0), ctypes.c_int64(y.numel()), ctypes.c_int64(0))
    live = x > -87
    ref = torch.exp(x[live].double())
    assert ((y[live].double() - ref).abs() / ref).max() < 4 * 2.0**-24  # a few ulp
    assert torch.equal(y[~live], torch.zeros_like(y[~live]))  # below e^-87 and -inf: exactly 0


@pytest.mark.parametrize(("b", "h"), [(3, 2), (1, 4), (4, 1), (2, 5)])
def test_add_mask_over_any_head_range(b, h):
    """Every head range a chunk can be, against the mask broadcast head by head (whole batches
    go in one add, partial ones at either end by themselves)."""
    g = torch.Generator().manual_seed(0)
    for fshape in [(b, h), (b, 1), (1, h), (1, 1)]:
        full = torch.randn(*fshape, 3, 4, generator=g)
        want = full.expand(b, h, 3, 4).reshape(b * h, 3, 4)
        for h0 in range(b * h):
            for h1 in range(h0 + 1, b * h + 1):
                s = torch.zeros(h1 - h0, 3, 4)
                native._add_mask(s, full, h, h0, h1)
                assert torch.equal(s, want[h0:h1]), (fshape, h0, h1)
