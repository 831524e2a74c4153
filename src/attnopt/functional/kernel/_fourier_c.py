r"""C plumbing of the Fourier-feature kernels (``_native/fourier_features.c``, ``lp_magnitude.c``), shared
by the per-pass node and the whole call of :mod:`.fourier`, the ops of :mod:`.fourier_cpu` and the
sampled node of :mod:`.sampled_fourier` (a helper, not an implementation: the L^p key magnitude's
C pass and its PyTorch twin, the per-pass entries' argument types, row checks and thread split).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import require

_LP_MODES = {1.0: 1, 1.5: 2, 2.0: 3}
_F64P = ctypes.c_double
_I64 = ctypes.c_int64


@_native.untraced
def _magnitude_native(
    k: Tensor, p: float, scale: float, grad: bool, cap: float
) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """:func:`_magnitude` by ``_native/lp_magnitude.c`` (one pass per row instead of ~11 ops), or
    None where it does not apply (no native library, not a contiguous float32/float64 CPU tensor)."""
    if k.device.type != "cpu" or k.dtype not in (torch.float32, torch.float64) or not k.is_contiguous():
        return None
    lib = _native.library("lp_magnitude")
    if lib is None:
        return None
    d = k.shape[-1]
    rows = k.numel() // d if d else 0
    a = k.new_empty(k.shape[:-1])
    u = torch.empty_like(k) if grad else None
    c = k.new_empty(k.shape[:-1]) if grad else None
    fn = lib.lp_magnitude_f32 if k.dtype == torch.float32 else lib.lp_magnitude_f64
    _check_rows("lp_magnitude", rows, (("k", k, d), ("a", a, 1), ("u", u, d), ("c", c, 1)))
    size = k.element_size()
    mode = ctypes.c_int(_LP_MODES.get(p, 0))

    def at(t: Tensor | None, offset: int) -> ctypes.c_void_p | None:
        return None if t is None else ctypes.c_void_p(t.data_ptr() + offset * size)

    def call(r0: int, r1: int) -> None:  # rows [r0, r1)
        fn(at(k, r0 * d), ctypes.c_int64(r1 - r0), ctypes.c_int64(d), mode, _F64P(p), _F64P(scale),
           _F64P(cap), at(a, r0), at(u, r0 * d), at(c, r0))

    _native.parallel_rows(call, rows, d)
    return a, u, c


def _magnitude(k: Tensor, p: float, scale: float, grad: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``a = s·(Σ|k|^p)^{2/p}/2`` (clamped below the dtype's max/8) and, with ``grad``, its gradient
    factors: ``∂a_j/∂k_j = c_j·u_j`` with ``u = |k|^{p−1}·sign(k)`` and ``c = s·T^{2/p−1}``
    (``T = Σ|k|^p``; 0 where the clamp is active).

    :func:`attnopt.functional.kernel.log_magnitude`'s ``1 <= p <= 2`` branch, without autograd;
    by the native kernel where it applies (N = 64, d = 64, p = 1.5: ~10 µs instead of ~55).
    """
    cap = torch.finfo(k.dtype).max / 8
    native = _magnitude_native(k, p, scale, grad, cap) if k.numel() else None
    if native is not None:
        return native
    if p == 2.0:
        total = (k * k).sum(-1)
        a = total.mul(0.5 * scale).clamp_(max=cap)
        if not grad:
            return a, None, None
        return a, k, (a < cap).to(k.dtype).mul_(scale)  # (a where of Python scalars would be float32)
    ax = k.abs()
    if p == 1.0:  # |k|^{p−1} = 1
        pw = None
        total = ax.sum(-1)
    else:
        pw = ax.sqrt() if p == 1.5 else ax.pow(p - 1.0)
        total = (ax * pw).sum(-1)
    tp = total.pow(2.0 / p - 1.0)  # T^{2/p−1}: a = s·T·T^{2/p−1}/2 (one pow on the rows, not two)
    a = torch.mul(total, tp).mul_(0.5 * scale).clamp_(max=cap)
    if not grad:
        return a, None, None
    u = k.sign() if pw is None else torch.copysign(pw, k, out=pw)  # |k|^{p−1}·sign(k) (sign(0) = 0: pw = 0)
    c = torch.where(a < cap, tp.mul_(scale), 0.0)
    return a, u, c


_VP = ctypes.c_void_p
_FEATURES = (_VP, _I64, _I64, _I64, _VP, _VP, _VP)
_KEY_WEIGHTS = (_VP, _VP, _VP, _I64, _I64, _I64, _I64, ctypes.c_int, _F64P, _F64P, _F64P, _VP, _VP, _VP, _VP)
_KEY_GRADS = (_VP, _VP, _VP, _VP, _VP, _I64, _I64, _I64, _VP, _VP, _VP)
_DP = (_VP, _VP, _VP, _I64, _I64, _I64, _VP)
_SIGS: dict[str, tuple[Any, ...]] = {
    "ff_features": _FEATURES,
    "ff_key_weights": _KEY_WEIGHTS,
    "ff_prepare": _FEATURES + _KEY_WEIGHTS,
    "ff_finish": (_VP, _I64, _I64, _VP, _VP),
    "ff_gn": (_VP, _I64, _I64, _VP, _VP, _I64, _I64, _VP),
    "ff_key_grads": _KEY_GRADS,
    "ff_dp": _DP,
    "ff_tail": _KEY_GRADS + _DP,
}
#: the C functions of a build per (build, float32?), argument types set once: Python ints and
#: None are passed without building ctypes objects (a call's overhead ~2 µs instead of ~8)
_FNS: dict[tuple[int, bool], dict[str, Any]] = {}
_Fns = dict[str, Any] | None
#: ``(C function, args(r0, r1) for rows [r0, r1), rows, entries a row)``: one C pass, ready to run
_Plan = tuple[Any, Callable[[int, int], tuple[Any, ...]], int, int]
_Three = tuple[Tensor, Tensor, Tensor]
#: ``(vm, m, u, c)`` of the key weights
_KeyWeights = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]


def _fns(x: Tensor) -> _Fns:
    """The native functions for ``x``'s dtype (float32/float64 CPU tensors with storage), or None
    where they do not apply (then the PyTorch ops run). Looked up once per forward / backward."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or not _native.has_storage(x):
        return None
    ff = _native.library("fourier_features")
    if ff is None:
        return None
    f32 = x.dtype == torch.float32
    key = (id(ff), f32)
    fns = _FNS.get(key)
    if fns is None:
        fns = {}
        for name, sig in _SIGS.items():
            fn = getattr(ff, name + ("_f32" if f32 else "_f64"))
            fn.argtypes, fn.restype = sig, None
            fns[name] = fn
        _FNS[key] = fns
    return fns


def _dense(fns: _Fns, *ts: Tensor | None) -> _Fns:
    """``fns`` if every tensor of ``ts`` (``None`` skipped) is contiguous, else None."""
    if fns is None or not all(t is None or t.is_contiguous() for t in ts):
        return None
    return fns


def _check_rows(kernel: str, rows: int, args: tuple[tuple[str, Tensor | None, int], ...]) -> None:
    """What a per-pass kernel (``ff_*``, ``lp_magnitude``) reads and writes: for each ``(name, tensor,
    per_row)`` (``None`` skipped: NULL) ``rows × per_row`` dense entries of one dtype, the first tensor's.
    A thread's ``[r0, r1)`` is an address offset by ``r0 × per_row`` entries and ``r1 − r0`` rows, so
    the whole-range check covers every split."""
    dtype = args[0][1].dtype if args[0][1] is not None else None
    for name, t, per_row in args:
        if t is not None:
            require(kernel, name, t, dtype=t.dtype if dtype is None else dtype, numel=rows * per_row)


def _run(plan: _Plan) -> None:
    fn, args, rows, row_len = plan
    _native.parallel_rows(lambda r0, r1: fn(*args(r0, r1)), rows, row_len)


def _run2(fn: Any, a: _Plan, b: _Plan) -> None:
    """Two passes by one C call ``fn`` (their arguments one after the other): one call's overhead
    at small sizes; with threads, each thread takes the same fraction of both passes' rows."""
    na, nb = a[2], b[2]
    v = max(na, nb, 1)

    def call(v0: int, v1: int) -> None:
        fn(*a[1](v0 * na // v, v1 * na // v), *b[1](v0 * nb // v, v1 * nb // v))

    _native.parallel_rows(call, v, (na * a[3] + nb * b[3]) // v)


def _base(t: Tensor | None) -> int | None:
    """``t``'s address (None for None). The closures that offset it hold ``t`` itself too (a
    default argument): a buffer only referenced by address would be freed before the C call."""
    return None if t is None else t.data_ptr()


def _off(base: int | None, offset: int) -> int | None:
    return None if base is None else base + offset
