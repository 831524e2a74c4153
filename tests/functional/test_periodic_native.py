"""The C passes of the fused Expsin node (``_periodic_native``, ``_native/periodic.c``): which path
runs, float32 C against the PyTorch node, thread splits, the C sine/cosine, and the refusals
(double backward, tensors without storage)."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from attnopt import _native
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import kernel_attention
from attnopt.functional.kernel import periodic_cpu as native
from attnopt.kernels import Periodic
from tests._marks import needs_native

pytestmark = needs_native


def _qkv(b, h, nq, nk, d=8, dv=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, e, generator=g, dtype=dtype).requires_grad_()
            for n, e in ((nq, d), (nk, d), (nk, dv))]


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the native node."""
    seen: list[int] = []
    real = native._NativePeriodic.apply

    def spy(*args):
        seen.append(1)
        return real(*args)

    monkeypatch.setattr(native._NativePeriodic, "apply", spy)
    monkeypatch.setattr(_native, "_LIBS", {})
    return seen


def _run(q, k, v, mask, causal, p, period=2 * math.pi, lengthscale=None):
    out = kernel_attention(q, k, v, kernel=Periodic(period, lengthscale), magnitude_p=p, attn_mask=mask,
                           is_causal=causal)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


@pytest.mark.parametrize("mask_kind,causal,p,chunk", [
    ("none", False, 2.0, "saved"), ("none", True, 2.0, "recomputed"), ("rows", False, 2.0, "recomputed"),
    ("dead", True, 2.0, "saved-chunks"), ("keys", False, 1.5, "recomputed"), ("none", False, None, "saved"),
])
def test_float32_c_passes_match_the_pytorch_node(monkeypatch, calls, mask_kind, causal, p, chunk):
    """Values and q, k, v gradients of the C path against the PyTorch node at float32 rounding
    (polynomial exp / sin / cos), across masks, the L^p magnitude's bias, and both layouts."""
    if chunk != "saved":  # one head per chunk; weights saved, or recomputed in the backward
        monkeypatch.setattr(THRESHOLDS, "periodic_save_bytes", 1 << 30 if chunk == "saved-chunks" else 0)
        monkeypatch.setattr(THRESHOLDS, "periodic_chunk_bytes", 1)
    q, k, v = _qkv(2, 3, 24, 40, d=16, seed=1)
    g = torch.Generator().manual_seed(2)
    mask = None
    if mask_kind == "rows":
        mask = torch.rand(2, 1, 24, 40, generator=g) > 0.3
        mask[..., 0] = True
    elif mask_kind == "dead":
        mask = torch.rand(2, 3, 24, 40, generator=g) > 0.3
        mask[0, 1, 5] = False  # a query with no admissible key
    elif mask_kind == "keys":
        mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
        mask[1, ..., 30:] = False
    got = _run(q, k, v, mask, causal, p)
    assert len(calls) == 1
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    want = _run(q, k, v, mask, causal, p)
    assert len(calls) == 1  # the fallback did not take the C path
    for a, b in zip(got, want):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * scale)
    if mask_kind == "dead":
        assert torch.equal(got[0][0, 1, 5], torch.zeros(5))


def test_threads_split_heads_and_give_the_one_thread_result(monkeypatch, calls):
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 0)
    q, k, v = _qkv(3, 2, 10, 12, seed=3, dtype=torch.float64)
    one = _run(q, k, v, None, True, 2.0)
    torch.set_num_threads(2)
    try:
        two = _run(q, k, v, None, True, 2.0)
    finally:
        torch.set_num_threads(1)
    assert len(calls) == 2
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_c_sine_and_cosine_against_torch_float64():
    lib = native.library(torch.zeros(1))
    assert lib is not None
    x = torch.cat([torch.linspace(0, 10, 20001), torch.linspace(10, 1e4, 20001),
                   torch.tensor([1e-15, 1e7, 3e38])])
    sn, cs = torch.empty_like(x), torch.empty_like(x)
    ptr = ctypes.c_void_p
    lib.px_sincos_f32(ptr(x.data_ptr()), ptr(sn.data_ptr()), ptr(cs.data_ptr()), ctypes.c_int64(x.numel()))
    xd = x[:-2].double()  # below the clamp (4e6): the reduction holds
    ulp = torch.finfo(torch.float32).eps
    assert (sn[:-2].double() - xd.sin()).abs().max() < 4 * ulp
    assert (cs[:-2].double() - xd.cos()).abs().max() < 4 * ulp
    assert sn[-3] == 1e-15 and cs[-3] == 1.0
    assert torch.isfinite(sn).all() and torch.isfinite(cs).all() and (sn.abs() <= 1.0001).all()


def test_torch_func_takes_the_plain_ops_and_half_precision_no_c(calls):
    """torch.func's wrapped tensors have no storage for C, nor does the autograd node support
    them: the general log-domain path runs (the same function)."""
    q, k, v = (t.detach() for t in _qkv(1, 2, 5, 6, seed=4))

    def f(a):
        return kernel_attention(a, k, v, kernel=Periodic(3.0)).sum()

    g_func = torch.func.grad(f)(q)
    assert calls == []
    q.requires_grad_()
    (g_plain,) = torch.autograd.grad(f(q), q)
    assert calls == [1]
    torch.testing.assert_close(g_func, g_plain, rtol=1e-5, atol=1e-6)
    assert native.library(q.half()) is None


def test_double_backward_is_refused(calls):
    q, k, v = _qkv(1, 1, 3, 4, seed=5, dtype=torch.float64)
    out = kernel_attention(q, k, v, kernel=Periodic(2.0))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    assert calls == [1]


def test_c_float64_sine_cosine_and_exponential_to_an_ulp_or_two():
    lib = native.library(torch.zeros(1, dtype=torch.float64))
    assert lib is not None
    ptr = ctypes.c_void_p
    x = torch.cat([torch.linspace(0, 10, 20001, dtype=torch.float64),
                   torch.linspace(10, 1e6, 20001, dtype=torch.float64),
                   torch.tensor([1e-300, 1e20], dtype=torch.float64)])
    sn, cs = torch.empty_like(x), torch.empty_like(x)
    lib.px_sincos_f64(ptr(x.data_ptr()), ptr(sn.data_ptr()), ptr(cs.data_ptr()), ctypes.c_int64(x.numel()))
    ulp = torch.finfo(torch.float64).eps
    assert (sn[:-1] - x[:-1].sin()).abs().max() <= 2 * ulp
    assert (cs[:-1] - x[:-1].cos()).abs().max() <= 2 * ulp
    assert sn[-2] == 1e-300 and cs[-2] == 1.0 and sn[-1].abs() <= 1 and cs[-1].abs() <= 1
    y = torch.linspace(0, 720, 20001, dtype=torch.float64)
    e = torch.empty_like(y)
    lib.px_expneg_f64(ptr(y.data_ptr()), ptr(e.data_ptr()), ctypes.c_int64(y.numel()))
    live = y < 708
    assert ((e[live] - (-y[live]).exp()) / (-y[live]).exp()).abs().max() <= 2 * ulp
    assert (e[~live] == 0).all()  # flushed below the smallest normal number
