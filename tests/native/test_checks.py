"""What the C kernels receive is checked in Python before the call (issue 29, item 3).

Two kinds of tests per C entry family: the family's check helper called directly with a crafted
wrong argument (a short buffer, a wrong dtype, a non-contiguous tensor, a view whose reads leave
its storage) must raise :class:`NativeArgumentError` naming the kernel and the argument; and one
end-to-end call through the public path with a size made wrong by monkeypatching the wrapper
must raise it too (so the check sits on the path, before the C call, and compares what is
really handed to C). The right arguments pass the same helpers (the native test files run them
on every call).
"""
from __future__ import annotations

import os
import types
from typing import Any

import pytest
import torch

import attnopt
import attnopt.nn as ann
from attnopt._native.checks import NativeArgumentError, require, require_dense, require_size, require_view
from attnopt.functional._thresholds import THRESHOLDS
from tests._marks import needs_native

F32, F64 = torch.float32, torch.float64


def _raises(match: str) -> Any:
    return pytest.raises(NativeArgumentError, match=match)


# --- the shared helpers --------------------------------------------------------------------------


def test_require_accepts_the_right_tensor_and_names_kernel_and_argument():
    t = torch.zeros(3, 4)
    require("k", "x", t, dtype=F32, numel=12, min_numel=5)
    with _raises(r"C kernel 'kern', argument 'arg': dtype torch.float64"):
        require("kern", "arg", t.double(), dtype=F32)
    with _raises("'arg': not contiguous"):
        require("kern", "arg", t.t(), dtype=F32)
    require("kern", "arg", t.t(), dtype=F32, contiguous=False)
    with _raises("12 entries, the kernel uses 13"):
        require("kern", "arg", t, dtype=F32, numel=13)
    with _raises("12 entries, the kernel uses 20"):
        require("kern", "arg", t, dtype=F32, min_numel=20)
    assert issubclass(NativeArgumentError, RuntimeError)


def test_require_view_bounds_both_ends_of_the_storage():
    base = torch.zeros(10, 8)
    view = base[2:5, 1:3]  # storage offset 17, 80 elements in all
    require_view("k", "w", view, dtype=F32, sizes=(3, 2), strides=(8, 1))
    require_view("k", "w", view, dtype=F32, sizes=(1,), strides=(1,), offset=80 - 17 - 1)  # the last one
    with _raises("'w': reads elements"):
        require_view("k", "w", view, dtype=F32, sizes=(1,), strides=(1,), offset=80 - 17)
    with _raises("'w': reads elements"):
        require_view("k", "w", view, dtype=F32, sizes=(9, 2), strides=(8, 1))
    # a negative stride reads backwards from the offset: Toeplitz rows
    require_view("k", "w", view, dtype=F32, sizes=(18,), strides=(-1,))
    with _raises("reads elements -18"):
        require_view("k", "w", view, dtype=F32, sizes=(19,), strides=(-1,))
    require_view("k", "w", view, dtype=F32, sizes=(0, 5), strides=(10**9, 1))  # nothing is read
    with _raises("dtype"):
        require_view("k", "w", view, dtype=F64, sizes=(1,), strides=(1,))


def test_require_dense_region_and_require_size():
    scratch = torch.zeros(100)
    require_dense("k", "ws", (scratch, 90), dtype=F32, numel=10)
    with _raises("'ws': entries 91..101 of a region 91..100 of a scratch of 100"):
        require_dense("k", "ws", (scratch, 91), dtype=F32, numel=10)
    require_dense("k", "ws", (scratch, 10, 20), dtype=F32, numel=10)
    with _raises("'ws': entries 10..21 of a region 10..20"):  # runs into the next region
        require_dense("k", "ws", (scratch, 10, 20), dtype=F32, numel=11)
    with _raises("reads elements"):
        require_view("k", "ws", scratch, dtype=F32, sizes=(2, 5), strides=(6, 1), offset=10, limit=20)
    with _raises("'ws': 100 entries, the kernel uses 99"):
        require_dense("k", "ws", scratch, dtype=F32, numel=99)
    require_size("k", "n", 3, at_least=1, at_most=3)
    with _raises("'n': 4"):
        require_size("k", "n", 4, at_most=3)


# --- each family's helper, called directly with a wrong argument -----------------------------------


def test_normal_fill_check():
    from attnopt.functional.kernel.gaussian_noise import _check_normal_fill

    seed, out = torch.tensor(3), torch.empty(5)
    _check_normal_fill(seed, out, F32)
    with _raises("'normal_fill_at', argument 'seed'"):
        _check_normal_fill(seed.float(), out, F32)
    with _raises("argument 'out': dtype"):
        _check_normal_fill(seed, out, F64)


def test_finite_check():
    from attnopt._validation import _check_finite

    x = torch.zeros(4, 6)[:, ::2]
    _check_finite(x, (1, 1, 4, 3), (0, 0, 6, 2))
    with _raises("'nonfinite_strided', argument 'x'"):
        _check_finite(x, (1, 1, 4, 4), (0, 0, 6, 2))  # one column too many: past the storage
    with _raises("'nonfinite_dense', argument 'x': not contiguous"):
        _check_finite(x, None, None)


def test_t5_toeplitz_check():
    from attnopt.nn.preference import _check_t5_toeplitz

    table, out = torch.zeros(32, 4), torch.empty(1, 4, 3, 5)
    buckets = torch.zeros(3 + 5 - 1, dtype=torch.int64)
    _check_t5_toeplitz(table, buckets, out, 3, 5)
    with _raises("'bsf_toeplitz', argument 'buckets'"):
        _check_t5_toeplitz(table, buckets[:-1], out, 3, 5)
    with _raises("argument 'buckets': dtype torch.int32"):
        _check_t5_toeplitz(table, buckets.int(), out, 3, 5)
    with _raises("argument 'out'"):
        _check_t5_toeplitz(table, buckets, out[..., :4], 3, 5)


def test_sparse_map_check():
    from attnopt.functional.regularized.cpu import _check_sparse_map

    x, p, theta = torch.zeros(6, 5), torch.zeros(6, 5), torch.zeros(6, 1)
    status, counter = torch.zeros(6, dtype=torch.int8), torch.zeros(1, dtype=torch.int64)
    _check_sparse_map(x, p, theta, status, counter, 6, 5)
    with _raises("'sparse_maps', argument 'c'"):
        _check_sparse_map(x, p, theta[:5], status, counter, 6, 5)
    with _raises("argument 'status'"):
        _check_sparse_map(x, p, theta, status.long(), counter, 6, 5)
    with _raises("argument 'b': not contiguous"):
        _check_sparse_map(x, torch.zeros(5, 6).t(), p, None, counter, 6, 5)


def test_dnas_check():
    from attnopt.functional.doubly_normalized.cpu import _check_dn

    g, nq, nk = 4, 3, 5
    s = torch.zeros(2, nq, nk)
    vec = {n: torch.zeros(g * (nk if n in ("m", "beta", "u") else nq)) for n in
           ("m", "beta", "u", "alpha", "binv", "rs", "rho")}
    w = torch.zeros(g)
    _check_dn(s, None, 0, 2, g, nq, nk, None, w, vec["m"], vec["beta"], vec["u"], vec["alpha"], vec["binv"],
              vec["rs"], vec["rho"], None)
    with _raises("'dn_fwd', argument 'm'"):
        _check_dn(s, None, 0, 2, g, nq, nk, None, w, vec["m"][1:], vec["beta"], vec["u"], vec["alpha"],
                  vec["binv"], vec["rs"], vec["rho"], None)
    with _raises("'dn_fwd', argument 's'"):
        _check_dn(s, None, 1, 4, g, nq, nk, None, w, vec["m"], vec["beta"], vec["u"], vec["alpha"],
                  vec["binv"], vec["rs"], vec["rho"], None)  # 3 heads, a 2-head chunk
    with _raises("HNAS"):
        _check_dn(s, None, 0, 2, g, nq, nk, None, w, vec["m"], vec["beta"], None, vec["alpha"], vec["binv"],
                  vec["rs"], vec["rho"], None)
    with _raises("'dn_bwd', argument 'dp'"):
        _check_dn(s, s.double(), 0, 2, g, nq, nk, None, None, vec["m"], vec["beta"], None, vec["alpha"], None,
                  None, None, None)


def test_sinkhorn_k_check():
    from attnopt.functional.doubly_normalized.cpu import _check_sk

    g, nq, nk, kk = 4, 3, 5, 3
    s = torch.zeros(2, nq, nk)
    m, rs = torch.zeros(g * nk), torch.zeros(g * nq)
    beta, alpha = torch.zeros(g * kk * nk), torch.zeros(g * kk * nq)
    _check_sk(s, None, 0, 2, g, nq, nk, kk, None, m, beta, alpha, rs)
    with _raises("'sk_fwd', argument 'beta'"):  # one step's beta per head, not K
        _check_sk(s, None, 0, 2, g, nq, nk, kk, None, m, beta[: g * nk], alpha, rs)
    with _raises("'sk_fwd', argument 'rs'"):
        _check_sk(s, None, 0, 2, g, nq, nk, kk, None, m, beta, alpha, None)
    with _raises("'sk_bwd', argument 'dp'"):
        _check_sk(s, s[:1], 0, 2, g, nq, nk, kk, None, m, beta, alpha, None)


def test_biased_softmax_checks():
    from attnopt.functional.generalized import cpu as gn

    b, h, nq, nk = 2, 3, 4, 5
    g = b * h
    bias = torch.zeros(1, h, nq, nk)
    s, mx, rinv = torch.zeros(g, nq, nk), torch.zeros(g, nq), torch.zeros(g, nq)
    layout = gn._layout(bias, False, nq)
    gn._check_bs("bs_fwd", s, None, g * nq * nk, bias, False, g, h, nq, nk, mx, rinv, None, layout)
    with _raises("'bs_fwd', argument 's': not contiguous"):
        gn._check_bs("bs_fwd", s.transpose(1, 2), None, g * nq * nk, bias, False, g, h, nq, nk, mx, rinv,
                     None,
                     layout)
    with _raises("'bs_fwd', argument 'bias': reads elements"):  # a batch stride on a batch-1 bias
        gn._check_bs("bs_fwd", s, None, g * nq * nk, bias, False, g, h, nq, nk, mx, rinv, None,
                     (layout[0], (h * nq * nk, nq * nk, nk)))
    with _raises("'bs_bwd', argument 'delta'"):
        gn._check_bs("bs_bwd", s, s, g * nq * nk, bias, False, g, h, nq, nk, mx, rinv, rinv[1:], layout)
    offsets = torch.zeros(h, nq + nk - 1)
    gn._check_bias("k", "bias", offsets, True, g, h, nq, nk, F32)
    with _raises("Toeplitz bias of shape"):
        gn._check_bias("k", "bias", offsets[:, 1:], True, g, h, nq, nk, F32)
    # the fused whole call: q, k, v by their strides, the per-thread work rows
    q, k, v = torch.zeros(b, h, nq, 8), torch.zeros(b, h, nk, 8), torch.zeros(b, h, nk, 6)
    heads = (gn._head_strides(q), gn._head_strides(k), gn._head_strides(v))
    e, out = torch.zeros(g, nq, nk), torch.zeros(b, h, nq, 6)
    work = torch.zeros(1, 2 * nq * nk + nq * 7 + nq + nk - 1)
    gn._check_bsf("bsf_bwd", q, k, v, heads, None, e, out, rinv, out, work)
    with _raises("'bsf_bwd', argument 'work'"):
        gn._check_bsf("bsf_bwd", q, k, v, heads, None, e, out, rinv, out, work[:, 1:])
    bad = (heads[0], (heads[1][0], heads[1][1], heads[1][2], 16), heads[2])  # a row stride past the rows
    with _raises("'bsf_bwd', argument 'k': reads elements"):
        gn._check_bsf("bsf_bwd", q, k, v, bad, None, e, out, rinv, out, work)
    with _raises("argument 'table'"):
        gn._check_bsf_gather(torch.zeros(32, h + 1), torch.zeros(nq + nk - 1, dtype=torch.int64), None, h,
                             nq + nk - 1)


def test_periodic_checks():
    from attnopt.functional.kernel import periodic_cpu as pn

    bh, nq, nk, d = 4, 3, 5, 2
    q, k = torch.zeros(bh, nq, d), torch.zeros(bh, nk, d)
    s, aux, state = torch.zeros(bh, nq, nk), torch.zeros(bh, 2, nk), torch.zeros(2, bh, nq)
    mask = torch.zeros(2, 1, nk).expand(2, nq, nk)  # (G, Nq, Nk), rows broadcast, G = 2: rep = 2
    pn._check_px("px_fwd", s, None, None, q, k, None, mask, 2, aux, state, 0, bh)
    with _raises("'px_fwd', argument 'mask': reads elements"):
        pn._check_px("px_fwd", s, None, None, q, k, None, mask, 1, aux, state, 0, bh)  # rep 1: rows 0..3
    with _raises("'px_fwd', argument 'mask': shape"):
        pn._check_px("px_fwd", s, None, None, q, k, None, mask.transpose(1, 2), 2, aux, state, 0, bh)
    with _raises("'px_fwd', argument 'aux'"):
        pn._check_px("px_fwd", s, None, None, q, k, None, None, 1, aux[1:], state, 0, bh)
    with _raises("'px_bwd', argument 'colsums'"):
        pn._check_px("px_bwd", s, None, s, q, k, None, None, 1, aux, state, 0, bh, torch.zeros(bh, nq, 3),
                     torch.zeros(bh, nq, 3), torch.zeros(bh, nq), torch.zeros(bh, nk))
    with _raises("'px_fin', argument 'dk'"):
        pn._check_px_fin(None, q, torch.zeros(bh, nq), k[1:], k, torch.zeros(2, bh, nk))


def _sample_args(n_sets: int = 2, b: int = 2, heads: int = 3, half: int = 4, d: int = 5, hid: int = 6,
                 cop: bool = True) -> dict[str, Any]:
    from attnopt.functional.kernel._spectral_c import _set_stride, _shapes

    m = b * heads
    params = [torch.zeros(s) for s in _shapes(n_sets, d, hid)]
    noise = torch.zeros(n_sets, 1, heads, half, d).expand(n_sets, b, heads, half, d)
    ws = torch.zeros(n_sets * _set_stride(m, half, d, hid, cop) + (2 * heads * heads if cop else 0))
    return dict(dims=(n_sets, b, heads, half, d, hid), h=torch.zeros(m, d), noise=noise,
                strides=noise.stride()[:3], raw=torch.zeros(heads, heads) if cop else None, params=params,
                scales=(1.0,) * n_sets, ws=ws, pts=torch.zeros(m, n_sets, 2, half, d), kl=torch.zeros(b))


def test_spectral_sampler_check():
    from attnopt.functional.kernel._spectral_c import check_sample

    a = _sample_args()

    def call(**change: Any) -> None:
        x = {**a, **change}
        check_sample("ss_fwd", x["dims"], x["h"], 0, None, x["noise"], x["strides"], x["raw"], x["params"],
                     x["scales"], x["ws"], pts=x["pts"], kl=x["kl"])

    call()
    with _raises("'ss_fwd', argument 'ws'"):
        call(ws=a["ws"][1:])
    with _raises("'ss_fwd', argument 'noise': reads elements"):
        call(strides=(a["strides"][0], a["strides"][2] * 3, a["strides"][2]))  # a batch stride: 1 stored
    with _raises("'ss_fwd', argument 'parameter 3'"):
        call(params=[*a["params"][:3], a["params"][3][1:], *a["params"][4:]])
    with _raises("'ss_fwd', argument 'pts'"):
        call(pts=a["pts"].double())
    with _raises("16 parameters and 1 scales"):
        call(scales=(1.0,))


def test_whole_fourier_check():
    from attnopt.functional.kernel import _fourier_whole as kf
    from attnopt.functional.kernel._fourier_whole import check_whole

    fns = kf._whole_fns(attnopt._native.library("fourier_features"),
                        True) if attnopt._native.enabled() else None
    if fns is None:
        pytest.skip("no native kernels")
    sizes_fns = (fns[2], fns[3])
    g, nq, nk, d, dv, r, nsets = 6, 4, 5, 3, 2, 4, 2
    sizes = (nq, nk, d, dv, r, nsets)
    sr = r * nsets
    per_save, per_work = int(fns[2](*sizes)), int(fns[3](*sizes))
    q, k, v, out = torch.zeros(g, nq, d), torch.zeros(g, nk, d), torch.zeros(g, nk, dv), torch.zeros(g, nq,
                                                                                                     dv)
    w = torch.zeros(2, 3, sr, d)  # per (batch, head): hi = 3
    save, work = torch.zeros(g, per_save), torch.zeros(1, per_work)
    check_whole("ffw_fwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d, sr * d, 3, save, out, work, 1)
    with _raises("'ffw_fwd', argument 'w': reads elements"):  # head 5's points past w's storage
        check_whole("ffw_fwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d + 1, sr * d, 3, save, out, work, 1)
    with _raises("'ffw_fwd', argument 'w': shape"):
        check_whole("ffw_fwd", sizes_fns, sizes, g, q, k, v, w[..., :-1, :], 3 * sr * d, sr * d, 3, save, out,
                    work, 1)
    with _raises("'ffw_fwd', argument 'save'"):
        check_whole("ffw_fwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d, sr * d, 3, save[:, 1:], out,
                    work, 1)
    with _raises("'ffw_fwd', argument 'work"):
        check_whole("ffw_fwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d, sr * d, 3, save, out, work, 2)
    with _raises("'ffw_fwd', argument 'q'"):
        check_whole("ffw_fwd", sizes_fns, sizes, g, q.transpose(1, 2), k, v, w, 3 * sr * d, sr * d, 3, save,
                    out, work, 1)
    dout = torch.zeros(()).expand(g, nq, dv)  # the gradient of a sum: strides 0
    check_whole("ffw_bwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d, sr * d, 3, save, out, work, 1,
                dout=dout, dstrides=(0, 0, 0))
    with _raises("'ffw_bwd', argument 'dout'"):
        check_whole("ffw_bwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d, sr * d, 3, save, out, work, 1,
                    dout=dout, dstrides=(nq * dv, dv, 1))
    # a scratch region (the sampled path's plan): the work rows of the last thread past the scratch
    scratch = torch.zeros(per_work * 2 + 10)
    check_whole("ffw_fwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d, sr * d, 3, save, out, (scratch, 10),
                2,
                step=per_work)
    with _raises("'ffw_fwd', argument 'work'"):
        check_whole("ffw_fwd", sizes_fns, sizes, g, q, k, v, w, 3 * sr * d, sr * d, 3, save, out, (scratch,
                                                                                                   11),
                    2, step=per_work)


def test_per_pass_fourier_check():
    from attnopt.functional.kernel._fourier_c import _check_rows

    _check_rows("ff_finish", 4, (("num", torch.zeros(4, 3), 3), ("out", torch.zeros(4, 2), 2), ("inv", None,
                                                                                                1)))
    with _raises("'ff_finish', argument 'out'"):
        _check_rows("ff_finish", 4, (("num", torch.zeros(4, 3), 3), ("out", torch.zeros(3, 2), 2)))
    with _raises("'ff_finish', argument 'out': dtype"):
        _check_rows("ff_finish", 4, (("num", torch.zeros(4, 3), 3), ("out", torch.zeros(4, 2, dtype=F64), 2)))


# --- end to end: a size made wrong in the wrapper is caught before C ---------------------------------


@pytest.fixture
def small_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernels on, one thread, the size thresholds at 0 (small shapes reach C)."""
    monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)
    monkeypatch.setattr(THRESHOLDS, "dnas_native_min_entries", 0)
    monkeypatch.setattr(THRESHOLDS, "sparse_native_min_entries", 0)
    monkeypatch.setattr(THRESHOLDS, "generalized_native_min_head_scores", 0)
    monkeypatch.setattr(THRESHOLDS, "generalized_native_forward_min_head_scores", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _shim(module: Any, **overrides: Any) -> Any:
    """``module``'s ``torch`` with some functions replaced (the wrapper's own calls only)."""
    names = {n: getattr(module, n) for n in dir(module) if not n.startswith("__")}
    return types.SimpleNamespace(**{**names, **overrides})


@needs_native
def test_e2e_normal_fill_wrong_seed_dtype(small_native):
    from attnopt.functional.kernel.gaussian_noise import noise_from_seed

    with _raises("'normal_fill_at', argument 'seed'"):
        noise_from_seed(torch.tensor(7.0), (3, 4))


@needs_native
def test_e2e_sparse_map_counter(small_native, monkeypatch):
    from attnopt.functional.regularized import cpu as _sparse_native

    monkeypatch.setattr(_sparse_native, "torch", _shim(
        torch, zeros=lambda *a, **k: torch.zeros(*a, **{**k, "dtype": torch.int32})))
    with _raises("'sparse_maps', argument 'counter'"):
        _sparse_native.forward(torch.randn(5, 7), 2.0, 50)


@needs_native
def test_e2e_t5_buckets(small_native, monkeypatch):
    mod = ann.T5RelativePreference(2)
    real = mod._buckets
    monkeypatch.setattr(mod, "_buckets", lambda nq, nk, device: (real(nq, nk, device)[0][:-1], None))
    with _raises("'bsf_toeplitz', argument 'buckets'"):
        mod(4, 6)


@needs_native
def test_e2e_dnas_weight(small_native, monkeypatch):
    from attnopt.functional.doubly_normalized import cpu as _dnas_native

    real = _dnas_native._flat
    monkeypatch.setattr(_dnas_native, "_flat", lambda x, b, h, tail: None if x is None else real(x, b, h,
                                                                                                 tail)[1:])
    q, k, v = (torch.randn(2, 2, 5, 4, requires_grad=True) for _ in range(3))
    with _raises("'dn_fwd', argument 'w'"):
        attnopt.hybrid_normalized_attention(q, k, v, torch.tensor(0.3), iterations=1, impl="materialized")


@needs_native
def test_e2e_biased_softmax_row_stride(small_native, monkeypatch):
    from attnopt.functional.generalized import cpu as _generalized_native

    real = _generalized_native._strides
    monkeypatch.setattr(_generalized_native, "_strides", lambda t: (*real(t)[:2], 2 * real(t)[2] + 1))
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 6, 6, requires_grad=True)
    with _raises("'bs_fwd', argument 'bias': reads elements"):
        attnopt.generalized_attention(q, k, v, log_preference=bias, impl="materialized")


@needs_native
def test_e2e_fused_biased_softmax_strides(small_native, monkeypatch):
    from attnopt.functional.generalized import cpu as _generalized_native

    if attnopt._native.blas() is None:
        pytest.skip("no BLAS found in torch's library")
    real = _generalized_native._head_strides
    monkeypatch.setattr(_generalized_native, "_head_strides", lambda t: (*real(t)[:3], real(t)[3] * 2))
    mod = ann.make_attention("t5", 8, 2)
    with _raises("'bsf_fwd', argument 'q': reads elements"):
        mod(torch.randn(2, 6, 8))


@needs_native
def test_e2e_periodic_mask_rows(small_native, monkeypatch):
    from attnopt.functional.kernel import periodic_cpu

    real = periodic_cpu.native_periodic_attention
    monkeypatch.setattr(periodic_cpu, "native_periodic_attention",
                        lambda lib, q, k, v, e, m, rep, *rest: real(lib, q, k, v, e, m, 1, *rest))
    q, k, v = (torch.randn(2, 3, 5, 4, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5)  # per example and query (a key-only mask joins the key bias)
    mask[0, :, 1, -1] = float("-inf")
    with _raises("'px_fwd', argument 'mask'"):
        attnopt.kernel_attention(q, k, v, kernel=attnopt.kernels.Periodic(period=2.0), attn_mask=mask)


@needs_native
def test_e2e_whole_fourier_save_size(small_native, monkeypatch):
    from attnopt.functional.kernel import _fourier_whole as _kernel_fused

    if attnopt._native.blas() is None:
        pytest.skip("no BLAS found in torch's library")
    real = _kernel_fused._size
    monkeypatch.setattr(_kernel_fused, "_size", lambda fn, sizes: real(fn, sizes) - 1)
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    points = torch.randn(2, 8, 4)
    with _raises("'ffw_fwd', argument 'save'"):
        attnopt.kernel_attention(q, k, v, kernel=attnopt.kernels.RandomFourier(points), magnitude_p=1.5)


@needs_native
def test_e2e_per_pass_fourier_buffer(small_native, monkeypatch):
    from attnopt.functional.kernel import _fourier_pass as _kernel_fused

    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", 0)
    monkeypatch.setattr(_kernel_fused, "torch", _shim(
        torch, empty_like=lambda t, **k: torch.empty(t.numel() - 1, dtype=t.dtype)))
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    points = torch.randn(2, 8, 4)
    with _raises("C kernel 'ff_"):
        attnopt.kernel_attention(q, k, v, kernel=attnopt.kernels.RandomFourier(points), magnitude_p=1.5)


@needs_native
def test_e2e_spectral_sampler_noise(small_native, monkeypatch):
    from attnopt.functional.kernel import spectral_cpu as _spectral_native

    monkeypatch.setattr(THRESHOLDS, "kernel_wholecall_below", 0)  # the sampler node, then the attention

    calls = []
    real = _spectral_native._noise_layout

    def short(noise, *args):
        calls.append(1)
        ne = real(noise, *args)
        return ne[..., :-1, :].clone()  # a fresh buffer one noise row short

    monkeypatch.setattr(_spectral_native, "_noise_layout", short)
    torch.manual_seed(0)
    mod = ann.make_attention("ika-ns", 8, 2).train()
    try:
        mod(torch.randn(2, 6, 8))
    except NativeArgumentError as err:
        assert "'ss_fwd', argument 'noise'" in str(err)
    else:
        pytest.fail("the sampler's noise was not checked" if calls else "the C sampler was not reached")


@needs_native
def test_e2e_sampled_fourier_workspace(small_native, monkeypatch):
    from attnopt.functional.kernel import sampled_fourier as _sampled_fourier

    if attnopt._native.blas() is None:
        pytest.skip("no BLAS found in torch's library")
    monkeypatch.setattr(_sampled_fourier, "_PLANS", {})
    monkeypatch.setattr(_sampled_fourier, "_BY_CALL", {})
    real = _sampled_fourier._set_stride
    monkeypatch.setattr(_sampled_fourier, "_set_stride",
                        lambda *a: real(*a) - 40)  # past the 16-entry alignment
    torch.manual_seed(0)
    mod = ann.make_attention("ikan", 8, 2).train()
    with _raises("'ss_fwd', argument 'ws'"):
        mod(torch.randn(2, 6, 8))


# --- item 2: no cached addresses ----------------------------------------------------------------------


def test_alibi_cache_is_not_keyed_by_an_address():
    mod = ann.ALiBiPreference(4)
    first = mod(3, 5)
    assert mod(3, 5) is first  # cached
    mod.slopes.data = mod.slopes * 2  # a new storage, maybe at the freed one's address: rebuilt
    second = mod(3, 5)
    assert second is not first
    torch.testing.assert_close(second, 2 * first)
    old = mod.slopes.data
    mod.slopes.data = old.clone()  # same values, another storage: rebuilt (not read from a stale stamp)
    assert mod(3, 5) is not second
    third = mod(3, 5)
    mod.slopes.mul_(0.5)  # in place: the version counter
    torch.testing.assert_close(mod(3, 5), 0.5 * third)
    for entry in mod.__dict__["_bias_cache"].values():
        assert not any(isinstance(x, int) and x > 1 << 20 for x in entry[1])  # offset, strides, version


def test_alibi_under_vmap_of_functional_call():
    mod = ann.ALiBiPreference(4)
    slopes = torch.rand(3, 4)
    out = torch.func.vmap(lambda s: torch.func.functional_call(mod, {"slopes": s}, (3, 5)))(slopes)
    for i in range(3):
        torch.testing.assert_close(out[i], torch.func.functional_call(mod, {"slopes": slopes[i]}, (3, 5)))


def test_sampled_fourier_plans_hold_no_tensor_address():
    """A plan holds sizes, offsets, C functions and constants: no tensor, nor a tensor's address."""
    from attnopt.functional.kernel import sampled_fourier as _sampled_fourier

    if os.environ.get("ATTNOPT_NATIVE") == "0" or attnopt._native.blas() is None:
        pytest.skip("no native kernels")
    torch.manual_seed(0)
    mod = ann.make_attention("ikan", 8, 2).train()
    x = torch.randn(2, 6, 8)
    mod(x)[0].sum().backward() if isinstance(mod(x), tuple) else mod(x).sum().backward()
    addresses = {p.data_ptr() for p in mod.parameters()} | {x.data_ptr()}
    assert _sampled_fourier._PLANS
    for plan in _sampled_fourier._PLANS.values():
        for field in plan:
            assert not isinstance(field, torch.Tensor)
            values = field if isinstance(field, tuple) else (field,)
            assert not any(isinstance(v, int) and v in addresses for v in values)
