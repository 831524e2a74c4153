"""Causal ``mode="linear"`` implicit-kernel attention as a Triton chunked scan against float64.

Under ``attnopt.backend("triton")`` ``kernel_attention(..., mode="linear", is_causal=True)`` with a
random Fourier kernel runs ``triton/_fourier_scan.py``; the reference is the quadratic causal
weights (the same function). Chunks of 16 rows, N not a multiple; without CUDA in Triton's
interpreter (each case takes a few seconds there: the scan walks ``2R`` state slices per chunk,
so the sizes are tiny and most cases are ``slow``: ``pytest -m slow tests/functional/triton``).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnopt
from attnopt.functional import dispatch
from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.kernels import NonStationaryFourier, RandomFourier
from tests.functional.triton._helpers import DEVICE, assert_close, blocks, grads, rand

B, H, N, D, DV, R = 2, 1, 27, 8, 6, 3


def _case(sets: int, p, padding: str, dtype=torch.float64):
    w = (rand(H, sets * R, D, seed=30 + sets, grad=False) * 0.7).to(dtype).requires_grad_()
    kernel = RandomFourier(w) if sets == 1 else NonStationaryFourier.stacked(w)
    mask = None
    if padding == "keys":  # batch 1 keeps its first 11 keys, key 0 of batch 0 is padding
        mask = torch.ones(B, 1, 1, N, dtype=torch.bool)
        mask[1, ..., 11:] = False
        mask[0, ..., 0] = False
    elif padding == "keys_and_queries":  # the models' key ∪ query padding: padded queries' rows all False
        keep = torch.ones(B, N, dtype=torch.bool)
        keep[1, 20:] = False
        mask = (keep[:, None, :, None] & keep[:, None, None, :])
    mask = None if mask is None else mask.to(DEVICE)
    return kernel, w, dict(kernel=kernel, magnitude_p=p, attn_mask=mask, is_causal=True)


def _check(sets, p, padding, key_scale=1.0):
    q, v = rand(B, H, N, D, seed=1), rand(B, H, N, DV, seed=3)
    k = (rand(B, H, N, D, seed=2, grad=False) * key_scale).requires_grad_()
    _, w, kw = _case(sets, p, padding)
    with blocks(), attnopt.backend("triton"):
        out = kernel_attention(q, k, v, mode="linear", **kw)
    assert dispatch.last_dispatch["kernel"] == "triton"
    ref = kernel_weights(q, k, **kw) @ v
    assert_close(out, ref, 1e-11, what="out")
    if padding == "keys":  # row 0 of batch 0 sees only the padded key 0: zeros, as the reference
        assert out[0, :, 0].abs().max() == 0
    # p < 1: nearly one-hot rows, whose exact dk is ~0 and is returned as rounding times the
    # magnitude's large derivative (kernel_attention's docstring): 2e-9 where the reference has 0
    tol = 1e-9 if p is None or p >= 1 else 1e-7
    for i, (got, want) in enumerate(zip(grads(out, (q, k, v, w)), grads(ref, (q, k, v, w)))):
        assert_close(got, want, tol, rtol=1e-9, what="dq dk dv dW".split()[i])


def test_causal_scan_matches_float64_reference():
    """MIKAN's layout (stacked non-stationary points), L^1.5 magnitude in the kernel, key padding;
    keys scaled so that the log-weights span tens of units (the running-max shifts carried across
    chunks matter)."""
    _check(2, 1.5, "keys", key_scale=4.0)


@pytest.mark.slow
@pytest.mark.parametrize(("sets", "p", "padding"), [
    (1, 2.0, "none"), (1, 1.0, "keys_and_queries"), (2, None, "none"), (1, 0.5, "keys"),
])
def test_causal_scan_variants(sets, p, padding):
    """IKA (L2), IKAN p = 1 with query padding, no magnitude, p = 0.5 (magnitude as a PyTorch bias)."""
    _check(sets, p, padding)


@pytest.mark.slow
def test_causal_scan_float16_against_float64():
    q, k, v = (rand(B, H, N, dd, seed=s, grad=False).half().requires_grad_()
               for dd, s in ((D, 1), (D, 2), (DV, 3)))
    _, w, kw = _case(1, 1.0, "keys")
    with blocks(), attnopt.backend("triton"):
        out = kernel_attention(q, k, v, mode="linear", **kw)
    assert out.dtype == torch.float16
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = kernel_weights(q64, k64, **kw) @ v64
    assert_close(out.float(), ref, 5e-3, what="out")
    for i, (got, want) in enumerate(zip(grads(out, (q, k, v, w)), grads(ref, (q64, k64, v64, w)))):
        rel = (got.double() - want).norm() / want.norm()
        assert torch.isfinite(got).all() and rel < 1e-2, f"{'dq dk dv dW'.split()[i]}: {rel:.2e}"


def test_non_causal_linear_mode_keeps_the_portable_path():
    """Without is_causal the linear mode is a single state (no scan): the portable O(N) path runs."""
    q, k = rand(1, 1, 9, D, seed=1, grad=False), rand(1, 1, 9, D, seed=2, grad=False)
    v = rand(1, 1, 9, DV, seed=3, grad=False)
    kernel, _, _ = _case(1, 1.0, "none")
    with attnopt.backend("triton"):
        out = kernel_attention(q, k, v, kernel=kernel, magnitude_p=1.0, mode="linear")
    assert dispatch.last_dispatch.get("kernel") != "triton"
    assert_close(out, kernel_weights(q, k, kernel=kernel, magnitude_p=1.0) @ v, 1e-10, what="out")


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 40), d=st.integers(1, 12), dv=st.integers(1, 12), r=st.integers(1, 6),
       sets=st.sampled_from([1, 2]), p=st.sampled_from([None, 1.0, 1.5, 2.0]), seed=st.integers(0, 2**16))
def test_causal_scan_any_shape(n, d, dv, r, sets, p, seed):
    """Any sizes (one row, chunk remainders, odd d / dv / R): values and gradients against float64;
    a few seconds an example in the interpreter (``pytest -m slow``)."""
    q, k, v = rand(1, 1, n, d, seed=seed), rand(1, 1, n, d, seed=seed + 1), rand(1, 1, n, dv, seed=seed + 2)
    w = rand(1, sets * r, d, seed=seed + 3)
    kernel = RandomFourier(w) if sets == 1 else NonStationaryFourier.stacked(w)
    kw = dict(kernel=kernel, magnitude_p=p, is_causal=True)
    with blocks(), attnopt.backend("triton"):
        out = kernel_attention(q, k, v, mode="linear", **kw)
    ref = kernel_weights(q, k, **kw) @ v
    assert_close(out, ref, 1e-10, what="out")
    for i, (got, want) in enumerate(zip(grads(out, (q, k, v, w)), grads(ref, (q, k, v, w)))):
        assert_close(got, want, 1e-8, rtol=1e-8, what="dq dk dv dW".split()[i])


@pytest.mark.slow
def test_causal_scan_gradcheck():
    """torch.autograd.gradcheck of the scan op itself (float64, 20 rows = one full and one partial
    chunk, in-kernel L^1.5 magnitude, a differentiable key log-weight with one excluded key); fast
    mode (random projections: the full Jacobian took ~6 min in the interpreter)."""
    from attnopt.functional.triton._fourier_scan import ika_causal_scan

    q, k, v = rand(1, 1, 20, 3, seed=7), rand(1, 1, 20, 3, seed=8), rand(1, 1, 20, 2, seed=9)
    w = rand(1, 1, 4, 3, seed=10)
    cb = 0.3 * torch.randn(1, 1, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    cb[..., 5] = float("-inf")
    cb = cb.to(DEVICE).requires_grad_()

    def fn(q, k, v, w, cb):
        return ika_causal_scan(q, k, v, w, cb, magnitude_p=1.5, scale=0.4, eps=1e-3, coef=0.5, sets=2)
    with blocks():
        assert torch.autograd.gradcheck(fn, (q, k, v, w, cb), atol=1e-7, fast_mode=True)
