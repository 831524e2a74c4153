r"""The whole-call Fourier-feature path's C entries (``ffw_*`` of ``_native/fourier_features.c``): the
checks of what they read and write, the points' layout, the forward and backward bodies (of the eager
:class:`~.fourier._WholeFourier` and of the ops ``attnopt::ffw_fwd`` / ``ffw_bwd`` in
:mod:`.fourier_cpu`: one implementation), and the rules of when it applies. A helper of the leaves,
not chosen by itself: the router picks the path.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import fail, require, require_dense, require_size, require_view
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel._fourier_c import _F64P, _I64, _LP_MODES, _VP, _base

_FWD_SIG = ([_VP] * 6 + [_I64] * 3 + [_VP] + [_I64] * 8 + [ctypes.c_int] + [_F64P] * 5 + [ctypes.c_int]
            + [_VP] * 3)
_BWD_SIG = ([_VP] * 6 + [_I64] * 3 + [_VP] + [_I64] * 3 + [_VP] + [_I64] * 8 + [ctypes.c_int] + [_F64P] * 2
            + [_VP] * 6 + [_I64] * 2 + [ctypes.c_int])
#: ``(fwd, bwd, save_size, work_size)`` per (build, float32?), argument types declared once
_WHOLE: dict[tuple[int, bool], tuple[Any, Any, Any, Any]] = {}


def _whole_fns(lib: ctypes.CDLL, f32: bool) -> tuple[Any, Any, Any, Any]:
    key = (id(lib), f32)
    hit = _WHOLE.get(key)
    if hit is not None:
        return hit
    suffix = "f32" if f32 else "f64"
    fwd, bwd = getattr(lib, "ffw_fwd_" + suffix), getattr(lib, "ffw_bwd_" + suffix)
    fwd.argtypes, fwd.restype = _FWD_SIG, None
    bwd.argtypes, bwd.restype = _BWD_SIG, None
    sizes = lib.ffw_save_size, lib.ffw_work_size
    for fn in sizes:
        fn.argtypes, fn.restype = [_I64] * 6, _I64
    _WHOLE[key] = (fwd, bwd, *sizes)
    return _WHOLE[key]


def _points_layout(points: Tensor, lead: tuple[int, ...]) -> tuple[Tensor, int, int, int]:
    """``(w, wsb, wsh, hi)``: head ``g``'s points at ``w + (g // hi)·wsb + (g % hi)·wsh`` (elements),
    rows of each head contiguous. Shared points: one ``(S·R, d)`` matrix, strides 0."""
    sr, d = points.shape[-2:]
    if all(s == 1 for s in points.shape[:-2]):
        return points.reshape(sr, d).contiguous(), 0, 0, 1
    if points.shape[:-2] == lead and len(lead) >= 2 and points.is_contiguous():  # per example and head
        return points, lead[-1] * sr * d, sr * d, lead[-1]
    if points.stride(-1) != 1 or points.stride(-2) != d:
        points = points.contiguous()
    inner = lead[-1]
    try:
        w4 = points.expand(*lead, sr, d).view(-1, inner, sr, d)  # no copy of broadcast points
        return w4, w4.stride(0), w4.stride(1), inner
    except RuntimeError:
        w3 = points.expand(*lead, sr, d).reshape(-1, sr, d)
        return w3, sr * d, 0, 1


#: ``(fwd, bwd, save_size, work_size, gemm address, MKL thread setter address)``
_WholeConfig = tuple[Any, Any, Any, Any, int, int]


#: ``torch.finfo(dtype).max / 8`` (the key weights' cap) per dtype
_CAP = {torch.float32: torch.finfo(torch.float32).max / 8, torch.float64: torch.finfo(torch.float64).max / 8}
_SIZES: dict[tuple[int, tuple[int, ...]], int] = {}


def _size(fn: Any, sizes: tuple[int, ...]) -> int:
    """``fn(*sizes)`` (``ffw_save_size`` / ``ffw_work_size`` of a library :data:`_WHOLE` keeps
    alive, a C call) once per sizes."""
    key = (id(fn), sizes)
    hit = _SIZES.get(key)
    if hit is None:
        hit = _SIZES[key] = int(fn(*sizes))
    return hit


_CHECKED_SIZES: dict[tuple[int, int, tuple[int, ...]], tuple[int, int]] = {}


def _kernel_sizes(fns: tuple[Any, Any], sizes: tuple[int, ...]) -> tuple[int, int]:
    """``(save_size(*sizes), work_size(*sizes))`` for :func:`check_whole`, from a cache of its own (not
    :func:`_size`'s: a size the caller got wrong is not the size the check compares with)."""
    key = (id(fns[0]), id(fns[1]), sizes)
    hit = _CHECKED_SIZES.get(key)
    if hit is None:
        if len(_CHECKED_SIZES) > 1024:
            _CHECKED_SIZES.clear()
        hit = _CHECKED_SIZES[key] = int(fns[0](*sizes)), int(fns[1](*sizes))
    return hit


def _heads_split(g: int, work: int) -> int:
    """Threads for ``g`` heads of ``work`` scores each (one below ``_native.min_parallel()`` entries)."""
    return min(torch.get_num_threads(), g) if g * work >= _native.min_parallel() else 1


def _each(threads: int, g: int, call: Callable[[int, int, int], None]) -> None:
    """``call(t, g0, g1)`` for thread ``t``'s heads ``[g0, g1)``, the threads in parallel."""
    if threads <= 1:
        call(0, 0, g)
        return
    bounds = [g * i // threads for i in range(threads + 1)]
    pool = _native._pool(threads)
    futures = [pool.submit(call, t, bounds[t], bounds[t + 1]) for t in range(1, threads)]
    call(0, bounds[0], bounds[1])
    for fut in futures:
        fut.result()


def check_whole(
    kernel: str, size_fns: tuple[Any, Any], sizes: tuple[int, ...], g: int, q: Tensor, k: Tensor, v: Tensor,
    w: Dense, wsb: int, wsh: int, hi: int, save: Dense, out: Tensor, work: Dense, threads: int, *,
    step: int | None = None,
    mask: Tensor | None = None, dout: Tensor | None = None, dstrides: tuple[int, ...] = (),
    grads: tuple[Tensor | None, ...] = (), dw: list[Tensor] | Dense | None = None, dsb: int = 0, dsh: int = 0,
    shared: bool = False,
) -> None:
    """What ``ffw_fwd`` / ``ffw_bwd`` (``_native/fourier_features.c``) read and write for heads ``[0, g)``,
    ``sizes = (Nq, Nk, d, Dv, R, S)``: ``q (g, Nq, d)``, ``k (g, Nk, d)``, ``v (g, Nk, Dv)``, ``out (g, Nq,
    Dv)`` dense; head ``j``'s points ``S·R × d`` dense at ``w + (j // hi)·wsb + (j % hi)·wsh``, inside ``w``'s
    storage for every head; ``mask (g, Nk)`` dense; ``ffw_save_size`` entries of ``save`` per head and
    ``ffw_work_size`` of ``work`` per thread (``size_fns``: those two C functions; rows of ``step``
    entries: a 2-D ``work``'s row length by
    default); the backward's ``dout`` element ``(j, i, c)`` at ``j·ds₀ + i·ds₁ + c·ds₂``, the gradients
    dense like their inputs, ``dw``: one ``(S·R, d)`` buffer per thread (``shared``) or head ``j``'s at
    ``(j // hi)·dsb + (j % hi)·dsh``. The save and work sizes are the C functions' own
    (:func:`_size`). A dense buffer is a tensor or ``(scratch, offset)`` (:func:`require_dense`)."""
    nq, nk, d, dv, r, nsets = sizes
    dtype, sr = q.dtype, r * nsets
    # (the checks of :func:`require` on q, k, v, out in one expression; the loop names a failure)
    if not (k.dtype is dtype and v.dtype is dtype and out.dtype is dtype and q.is_cpu and k.is_cpu
            and v.is_cpu and out.is_cpu and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            and out.is_contiguous() and q.numel() == g * nq * d and k.numel() == g * nk * d
            and v.numel() == g * nk * dv and out.numel() == g * nq * dv):
        for name, t, rows, cols in (("q", q, nq, d), ("k", k, nk, d), ("v", v, nk, dv), ("out", out, nq, dv)):
            require(kernel, name, t, dtype=dtype, numel=g * rows * cols)
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if grad is not None and not (grad.dtype is dtype and grad.is_cpu and grad.is_contiguous()
                                     and grad.numel() == like.numel()):
            require(kernel, name, grad, dtype=dtype, numel=like.numel())
    if mask is not None:
        require(kernel, "mask", mask, dtype=dtype, numel=g * nk)
    heads = ((g - 1) // hi + 1, min(hi, g), sr * d)
    wt, w_at, w_end = (w[0], w[1], w[2] if len(w) > 2 else None) if isinstance(w, tuple) else (w, 0, None)
    if not isinstance(w, tuple) and (w.stride(-1) != 1 or (w.shape[-2] > 1 and w.stride(-2) != d)
                                     or w.shape[-2:] != (sr, d)):
        raise fail(kernel, "w", f"shape "
                   f"{tuple(w.shape)}, strides {w.stride()}: expected dense ({sr}, {d}) rows")
    require_view(kernel, "w", wt, dtype=dtype, sizes=heads, strides=(wsb, wsh, 1), offset=w_at, limit=w_end)
    per_save, per_work = _kernel_sizes(size_fns, sizes)
    if isinstance(save, tuple) or not (save.dtype is dtype and save.is_cpu and save.is_contiguous()
                                       and save.numel() == g * per_save):
        require_dense(kernel, "save", save, dtype=dtype, numel=g * per_save)
    if isinstance(work, tuple):
        row = per_work if step is None else step
        require_size(kernel, "work step", row, at_least=per_work)
        require_dense(kernel, "work", work, dtype=dtype, numel=(threads - 1) * row + per_work)
    elif not (work.dtype is dtype and work.is_cpu and work.is_contiguous()
              and work.numel() >= threads * per_work
              and work.shape[0] >= threads and work.shape[1] >= per_work):
        require(kernel, "work", work, dtype=dtype, min_numel=threads * per_work)
        require_size(kernel, "work rows", work.shape[0], at_least=threads)
        require_size(kernel, "work row", work.shape[1], at_least=per_work)
    if dout is not None:
        require_view(kernel, "dout", dout, dtype=dtype, sizes=(g, nq, dv), strides=dstrides)
    if isinstance(dw, list):
        for t in dw:
            if shared:
                require(kernel, "dw", t, dtype=dtype, numel=sr * d)
            else:
                require_view(kernel, "dw", t, dtype=dtype, sizes=heads, strides=(dsb, dsh, 1))
    elif isinstance(dw, tuple):
        require_view(kernel, "dw", dw[0], dtype=dtype, sizes=heads, strides=(dsb, dsh, 1), offset=dw[1],
                     limit=dw[2] if len(dw) > 2 else None)


#: a dense buffer handed to C: a tensor, or ``(scratch, offset)`` (a region of a plan's scratch)
Dense = Tensor | tuple[Tensor, int] | tuple[Tensor, int, int]


#: ``(w, wsb, wsh, hi)`` of :func:`_points_layout`
_Layout = tuple[Tensor, int, int, int]


def _forward_body(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float, coef: float, nsets: int,
    p: float | None, scale: float, need_k: bool, cfg: _WholeConfig, zeroed: bool,
) -> tuple[Tensor, Tensor, _Layout]:
    """:func:`whole_forward` on contiguous ``q, k, v``, with the points' layout it computed (the
    eager Function keeps it for the backward: one layout per call, not two). Called untraced."""
    fwd, _, save_size, work_size, gemm, set_threads = cfg
    lead = q.shape[:-2] or (1,)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    sr = points.shape[-2]
    r = sr // nsets
    g = math.prod(lead)
    layout = w, wsb, wsh, hi = _points_layout(points, lead)
    mk = None if mask is None else mask.expand(*lead, nk).contiguous()
    sizes = (nq, nk, d, dv, r, nsets)
    save = (q.new_zeros if zeroed else q.new_empty)(g, _size(save_size, sizes))
    out = q.new_empty(*lead, nq, dv)
    threads = _heads_split(g, nq * nk)
    work = q.new_empty(threads, _size(work_size, sizes))
    mode = -1 if p is None else _LP_MODES.get(p, 0)
    cap = _CAP[q.dtype]
    grad = int(p is not None and need_k)
    c4 = coef**4
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), w.data_ptr(), wsb, wsh, hi, _base(mk))
    tail = (nq, nk, d, dv, r, nsets, mode, 1.0 if p is None else p, scale, cap, c4, eps, grad,
            save.data_ptr(), out.data_ptr())
    pw, step = work.data_ptr(), work.shape[1] * work.element_size()
    check_whole("ffw_fwd", (save_size, work_size), sizes, g, q, k, v, w, wsb, wsh, hi, save, out, work,
                threads, mask=mk)

    if threads == 1:
        fwd(gemm, set_threads, *args, 0, g, *tail, pw)
    else:

        def heads(t: int, g0: int, g1: int) -> None:
            fwd(gemm, set_threads, *args, g0, g1, *tail, pw + t * step)

        _each(threads, g, heads)
    return out, save, layout


@_native.untraced
def whole_forward(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float, coef: float, nsets: int,
    p: float | None, scale: float, need_k: bool, cfg: _WholeConfig | None = None, zeroed: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(out (*lead, Nq, dv), saved)``: the forward C call(s) (``ffw_fwd``) of :class:`_WholeFourier`;
    ``need_k``: keep what the magnitude's key gradient needs. ``cfg``: the C functions and BLAS
    addresses (:func:`_whole_call`; looked up when None). ``zeroed``: the saved buffer starts at zeros
    (the op's output: entries a configuration does not use are then defined). The body of
    ``attnopt::ffw_fwd``; :class:`_WholeFourier` calls :func:`_forward_body` itself."""
    cfg = _whole_config(q.dtype) if cfg is None else cfg
    out, save, _ = _forward_body(q.contiguous(), k.contiguous(), v.contiguous(), points, mask, eps, coef,
                                 nsets, p, scale, need_k, cfg, zeroed)
    return out, save


def _backward_body(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor, eps: float,
    coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool, need_v: bool, need_w: bool,
    cfg: _WholeConfig, layout: _Layout | None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """:func:`whole_backward` on contiguous ``q, k, v`` with the forward's points ``layout`` (None:
    computed here), a gradient not asked for None. Called untraced."""
    _, bwd, save_size, work_size, gemm, set_threads = cfg
    lead = q.shape[:-2] or (1,)
    w, wsb, wsh, hi = _points_layout(points, lead) if layout is None else layout
    r = points.shape[-2] // nsets
    c4 = coef**4
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    sr = w.shape[-2]
    g = math.prod(lead)
    if dout.dtype != out.dtype:
        dout = dout.to(out.dtype)
    # as (g, nq, dv) with its strides (an expanded scalar stays a view with strides 0)
    d3 = dout.reshape(g, nq, dv) if not dout.is_contiguous() else dout
    dstrides = (nq * dv, dv, 1) if d3 is dout else (d3.stride(0), d3.stride(1), d3.stride(2))
    dq = torch.empty_like(q) if need_q else None
    dk = torch.empty_like(k) if need_k else None
    dvv = torch.empty_like(v) if need_v else None
    threads = _heads_split(g, nq * nk)
    work = q.new_empty(threads, _size(work_size, (nq, nk, d, dv, r, nsets)))
    shared = wsb == 0 and wsh == 0
    dwb: list[Tensor] = []
    dsb = dsh = 0
    if need_w:
        if shared:
            dwb = [q.new_zeros(sr, d) for _ in range(threads)]
        else:
            dwb = [q.new_empty(g, sr, d)]
            dsb, dsh = (hi * sr * d, sr * d) if hi > 1 or wsb != sr * d else (sr * d, 0)
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), w.data_ptr(), wsb, wsh, hi, d3.data_ptr(),
            *dstrides, out.data_ptr())
    tail = (nq, nk, d, dv, r, nsets, int(magnitude), c4, eps, save.data_ptr())
    outs = (_base(dq), _base(dk), _base(dvv))
    pw, step = work.data_ptr(), work.shape[1] * work.element_size()
    check_whole("ffw_bwd", (save_size, work_size), (nq, nk, d, dv, r, nsets), g, q, k, v, w, wsb, wsh, hi,
                save,
                out, work,
                threads, dout=d3, dstrides=dstrides, grads=(dq, dk, dvv), dw=dwb, dsb=dsb, dsh=dsh,
                shared=shared)

    if threads == 1:
        pdw = None if not dwb else dwb[0].data_ptr()
        bwd(gemm, set_threads, *args, 0, g, *tail, pw, *outs, pdw, dsb, dsh, int(shared))
    else:

        def heads(t: int, g0: int, g1: int) -> None:
            pdw = None if not dwb else dwb[t if shared else 0].data_ptr()
            bwd(gemm, set_threads, *args, g0, g1, *tail, pw + t * step, *outs, pdw, dsb, dsh, int(shared))

        _each(threads, g, heads)
    dw = None
    if need_w:
        if shared:
            dw = dwb[0]
            for extra in dwb[1:]:
                dw += extra
            dw = dw.view(points.shape)
        else:
            dw = dwb[0].view(*lead, sr, d)
            if dw.shape != points.shape:
                dw = dw.sum_to_size(points.shape)
    return dq, dk, dvv, dw


@_native.untraced
def whole_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor, eps: float,
    coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool, need_v: bool, need_w: bool,
    cfg: _WholeConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d points)`` of :func:`whole_forward` (``ffw_bwd``; a gradient not asked for is
    empty). The body of ``attnopt::ffw_bwd``; :class:`_WholeFourier` calls :func:`_backward_body`."""
    cfg = _whole_config(q.dtype) if cfg is None else cfg
    dq, dk, dv, dw = _backward_body(dout, q.contiguous(), k.contiguous(), v.contiguous(), points, save, out,
                                    eps, coef, nsets, magnitude, need_q, need_k, need_v, need_w, cfg, None)
    return (q.new_empty(0) if dq is None else dq, k.new_empty(0) if dk is None else dk,
            v.new_empty(0) if dv is None else dv, q.new_empty(0) if dw is None else dw)


def whole_ready() -> bool:
    """Whether the whole call's C library and BLAS are there, readable while ``torch.compile`` /
    ``torch.export`` trace (:func:`attnopt._native.ready`: answered at trace time, a constant of the
    graph), so a compiled graph holds ``attnopt::ffw_*`` where an eager call could have run it."""
    return _native.ready("fourier_features", "blas")


def _whole_config(dtype: torch.dtype) -> _WholeConfig:
    """The C functions and BLAS addresses of the whole call for ``dtype`` (the op bodies' lookup)."""
    found = _native.blas()
    lib = _native.library("fourier_features")
    assert found is not None and lib is not None
    f32 = dtype == torch.float32
    return (*_whole_fns(lib, f32), found.sgemm if f32 else found.dgemm, found.set_threads)


def _whole_call(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, key_mask: Tensor | None
) -> _WholeConfig | None:
    """The whole-call configuration where :class:`_WholeFourier` applies, else None: CPU
    float32/64 tensors of one dtype with storage, no dispatch mode active (a FLOP counter sees the
    node's products), q, k, v of one batch shape, ``0 < B·H·Nq·Nk <=
    kernel_wholecall_below``, ``Nq·Nk <= kernel_wholecall_max_head_scores``, the C kernels and
    :func:`attnopt._native.blas` there."""
    dtype = q.dtype
    if dtype not in (torch.float32, torch.float64) or q.device.type != "cpu":
        return None
    nq, nk = q.shape[-2], k.shape[-2]
    size = math.prod(q.shape[:-2]) * nq * nk
    t = THRESHOLDS
    if not 0 < size <= t.kernel_wholecall_below or nq * nk > t.kernel_wholecall_max_head_scores:
        return None
    if q.shape[-1] == 0 or v.shape[-1] == 0 or points.shape[-2] == 0:
        return None
    # (explicit tests, no generators: this runs on every call at N = 64, where a call is ~0.4 ms)
    if k.dtype != dtype or v.dtype != dtype or points.dtype != dtype:
        return None
    if not (k.is_cpu and v.is_cpu and points.is_cpu):
        return None
    if key_mask is not None and (key_mask.dtype != dtype or not key_mask.is_cpu):
        return None
    if not (_native.has_storage(q, k, v) and _native.has_storage(points, key_mask)):
        return None
    # under a dispatch mode (FlopCounterMode, the claims' PeakMemory) the node's aten ops are seen;
    # the products inside the C call would not be
    if torch._C._len_torch_dispatch_stack():
        return None
    found = _native.blas()
    lib = _native.library("fourier_features") if found is not None else None
    if lib is None or found is None:
        return None
    f32 = dtype == torch.float32
    return (*_whole_fns(lib, f32), found.sgemm if f32 else found.dgemm, found.set_threads)


def whole_applies(q: Tensor, k: Tensor, v: Tensor, points: Tensor) -> bool:
    """The size and shape rules of :func:`_whole_call` alone (no storage, library or dispatch-mode
    test): what a traced router asks before it puts ``attnopt::ffw_fwd`` in the graph, so that the
    compiled and the eager call take the same path."""
    nq, nk = q.shape[-2], k.shape[-2]
    size = math.prod(q.shape[:-2]) * nq * nk
    t = THRESHOLDS
    return (0 < size <= t.kernel_wholecall_below and nq * nk <= t.kernel_wholecall_max_head_scores
            and q.shape[-1] > 0 and v.shape[-1] > 0 and points.shape[-2] > 0
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and len(points.shape) - 2 <= len(q.shape) - 2
            and k.dtype == q.dtype and v.dtype == q.dtype and q.dtype in (torch.float32, torch.float64))
