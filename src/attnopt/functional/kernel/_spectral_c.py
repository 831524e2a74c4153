r"""C plumbing of the implicit spectral sampler (``_native/spectral_sample.c``), shared by the sampler's
node and ops (:mod:`.spectral_cpu`) and the sampled attention node (:mod:`.sampled_fourier`): when
the C sampler applies (:func:`library`, :func:`traced_applies`), its function lookup, the stock
parameter shapes, the noise layout, the workspace size and the checks of what ``ss_fwd`` /
``ss_bwd`` read and write. A helper, not an implementation.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from attnopt import _func, _native
from attnopt._native.checks import fail, require, require_dense, require_view
from attnopt.functional._thresholds import THRESHOLDS

_I64, _VP = ctypes.c_int64, ctypes.c_void_p
_PF64 = ctypes.POINTER(ctypes.c_double)


def library(
    h: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], keys: bool = False,
    half: int | None = None,
) -> ctypes.CDLL | None:
    """The compiled ``spectral_sample.c`` when the native path applies, else ``None``: CPU
    float32/64 tensors with storage (not ``torch.func`` / fake tensors), one dtype, contiguous
    parameters shaped as the stock networks' (``W₁ₐ (hid, d)``, ``b₁ₐ (hid)``, ``W₁ᵦ (2d, hid)``,
    ``b₁ᵦ (2d)``, ``W₂ₐ (hid, d)``, ``b₂ₐ (hid)``, ``W₂ᵦ (d, hid)``, ``b₂ᵦ (d)`` per set); with
    more than one torch thread, at most ``THRESHOLDS.spectral_threaded_max_points`` base points.
    ``keys``: ``h`` is the keys ``(..., H, N, d)`` whose mean over ``N`` is the summary
    (:func:`native_sample`);
    ``half``: the base points per set and head, where ``noise`` is a stand-in (else its ``shape[-2]``)."""
    if torch.compiler.is_compiling():  # fake tensors: no memory for the C kernel
        return None
    dt = h.dtype
    # inside a torch.func transform (its tensors are wrapped: no storage to read) the PyTorch node
    # runs; outside one no tensor is wrapped, and subclasses (fake tensors) fail the type test
    if (dt not in _DTYPES or not h.is_cpu or h.dim() < 2 or not params or len(params) % 8
            or type(h) not in _PLAIN or type(noise) not in _PLAIN or noise.dtype != dt or not noise.is_cpu
            or (raw is not None and (type(raw) not in _PLAIN or raw.dtype != dt or not raw.is_cpu))
            or _func.under_transform()):
        return None
    if _WRAPPED(h) or _WRAPPED(noise) or (raw is not None and _WRAPPED(raw)):  # dead torch.func wrappers
        return None
    half = noise.shape[-2] if half is None else half
    points = h.numel() // max(h.shape[-1], 1) * half * (len(params) // 8)
    if keys:
        points //= max(h.shape[-2], 1)
    if points > THRESHOLDS.spectral_threaded_max_points and torch.get_num_threads() > 1:
        return None  # the C kernel runs on one thread: large samples go to the multithreaded matmuls
    shapes = _shapes(len(params) // 8, h.shape[-1], params[0].shape[0])
    for p, shape in zip(params, shapes, strict=True):  # one pass: ~0.4 µs a parameter
        if (p.shape != shape or p.dtype is not dt or type(p) not in _PLAIN or not p.is_contiguous()
                or not p.is_cpu or _WRAPPED(p)):
            return None
    return _native.library("spectral_sample")


def ready() -> bool:
    """Whether ``spectral_sample.c`` is built, readable while ``torch.compile`` / ``torch.export`` trace
    (:func:`attnopt._native.ready`: answered at trace time, a constant of the graph)."""
    return _native.ready("spectral_sample")


def traced_applies(
    h: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], keys: bool = False,
) -> bool:
    """:func:`library`'s rules while ``torch.compile`` / ``torch.export`` traces, without what tracing
    cannot read (storage, the library, the thread count): CPU float32/64 tensors of one dtype, stock
    parameter shapes, at most ``THRESHOLDS.spectral_threaded_max_points`` base points (the eager rule
    with more than one thread), an eager call found the library (:func:`ready`)."""
    dt = h.dtype
    if not ready() or dt not in _DTYPES or h.dim() < 2 or not params or len(params) % 8:
        return False
    if noise.dtype != dt or (raw is not None and raw.dtype != dt):
        return False
    if any(x.device.type != "cpu" for x in (h, noise, raw, *params) if x is not None):
        return False
    points = h.numel() // max(h.shape[-1], 1) * noise.shape[-2] * (len(params) // 8)
    if keys:
        points //= max(h.shape[-2], 1)
    if points > THRESHOLDS.spectral_threaded_max_points:
        return False
    shapes = _shapes(len(params) // 8, h.shape[-1], params[0].shape[0])
    return all(p.shape == shape and p.dtype == dt for p, shape in zip(params, shapes, strict=True))


_DTYPES = (torch.float32, torch.float64)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_WRAPPED = torch._C._functorch.is_functorch_wrapped_tensor


_SHAPES: dict[tuple[int, int, int], tuple[torch.Size, ...]] = {}


def _shapes(n_sets: int, d: int, hid: int) -> tuple[torch.Size, ...]:
    key = (n_sets, d, hid)
    hit = _SHAPES.get(key)
    if hit is None:
        one = [(hid, d), (hid,), (2 * d, hid), (2 * d,), (hid, d), (hid,), (d, hid), (d,)]
        hit = _SHAPES[key] = tuple(torch.Size(s) for s in one * n_sets)
    return hit


def _functions(lib: ctypes.CDLL, dtype: torch.dtype) -> tuple[Any, Any]:
    """The forward and backward C functions for ``dtype``, argument types declared once per library object."""
    suffix = "f64" if dtype == torch.float64 else "f32"
    done: dict[str, tuple[Any, Any]] = lib.__dict__.setdefault("_attnopt_declared", {})
    hit = done.get(suffix)
    if hit is not None:
        return hit
    fwd, bwd = getattr(lib, f"ss_fwd_{suffix}"), getattr(lib, f"ss_bwd_{suffix}")
    fwd.restype = bwd.restype = ctypes.c_int
    dims = [_I64] * 6
    # noise, its strides, raw, the parameters' addresses (an int64 array: a ctypes array or an
    # address), scales
    rest = [_VP, _I64, _I64, _I64, _VP, _VP, _PF64]
    fwd.argtypes = [*dims, _VP, _I64, _VP, *rest, _VP, _VP, _VP, _VP]
    bwd.argtypes = [*dims, _VP, *rest, _VP, _VP, _VP, _I64, _I64, _VP, _I64, _VP, ctypes.c_int,
                    _VP, _VP, _VP]
    done[suffix] = (fwd, bwd)
    return fwd, bwd


def _noise_layout(noise: Tensor, n_sets: int, lead: tuple[int, ...], half: int, d: int) -> Tensor:
    """The noise as ``(S, B, H, half, d)`` with unit strides inside each ``(half, d)`` block
    (broadcast dims keep stride 0: the eval buffer is not copied per example)."""
    if len(lead) == 2 and noise.shape[1:3] == lead and noise.dim() == 5 and noise.is_contiguous():
        return noise  # a fresh draw per example: as it is
    ne = noise.expand(n_sets, *lead, half, d)
    if len(lead) == 1:
        ne = ne.unsqueeze(1)
    elif len(lead) > 2:
        ne = ne.reshape(n_sets, -1, lead[-1], half, d)
    if ne.stride(-1) != 1 or ne.stride(-2) != d:
        ne = ne.contiguous()
    return ne


#: a dense buffer handed to C: a tensor, or ``(scratch, offset)`` (a region of a plan's scratch)
Dense = Tensor | tuple[Tensor, int] | tuple[Tensor, int, int]


def check_sample(
    kernel: str, dims: tuple[int, ...], h: Dense, n: int, hbuf: Dense | None, noise: Dense,
    strides: tuple[int, ...], raw: Tensor | None, params: list[Tensor] | tuple[Tensor, ...],
    scales: tuple[float, ...] | int, ws: Dense, *, pts: Dense | None = None, kl: Dense | None = None,
    klm: Tensor | None = None, gpts: Dense | None = None, gkl: Tensor | None = None, gks: int = 0,
    dh: Tensor | None = None, nkeys: int = 0, dkeys: Tensor | None = None, dnoise: Tensor | None = None,
    draw: Tensor | None = None, grads: list[Tensor] | None = None, params_checked: bool = False,
) -> None:
    """What ``ss_fwd`` / ``ss_bwd`` of ``spectral_sample.c`` read and write, ``dims = (S, B, H, half,
    d, hid)``, ``M = B·H``, ``R = M·half``: ``h`` dense ``(M, d)``, or with ``n > 0`` keys ``(M, n, d)`` and
    ``hbuf (M, d)``; the noise element ``(s, b, m, i, k)`` at ``s·ns + b·nb + m·nh + i·d + k``; ``raw (H, H)``
    dense; 8 ``S`` dense parameters of the stock shapes; ``S`` scales; the workspace ``S·set_stride + 2H²``
    (copula); ``pts (M, S, 2, half, d)``, ``kl (B)``, ``klm ()``. The backward's ``gpts`` like ``pts``,
    ``gkl[b·gks]``, ``dh (M, d)``, ``dkeys (M, nkeys, d)``, ``dnoise (S, R, d)``, ``draw (H, H)`` and
    gradients shaped as the parameters. A dense buffer is a tensor or ``(scratch, offset)``
    (:func:`attnopt._native.checks.require_dense`). ``params_checked``: the caller made the parameter
    checks in this call, against the same shapes (the sampled node's plan lookup), so they are not
    made twice."""
    n_sets, b, heads, half, d, hid = dims
    m = b * heads
    dtype = (h[0] if isinstance(h, tuple) else h).dtype
    require_dense(kernel, "h", h, dtype=dtype, numel=m * (n if n > 0 else 1) * d)
    if n > 0:
        if hbuf is None:
            raise fail(kernel, "hbuf", "missing")
        require_dense(kernel, "hbuf", hbuf, dtype=dtype, numel=m * d)
    ns, nb, nh = strides
    nt, at, end = (noise[0], noise[1], noise[2] if len(noise) > 2 else None) if isinstance(noise,
                                                                                           tuple) else (
        noise, 0, None)
    require_view(kernel, "noise", nt, dtype=dtype, sizes=(n_sets, b, heads, half, d), strides=(ns, nb, nh,
                                                                                               d, 1),
                 offset=at, limit=end)
    cop = raw is not None
    if raw is not None:
        require(kernel, "raw", raw, dtype=dtype, numel=heads * heads)
    n_scales = scales if isinstance(scales, int) else len(scales)
    if len(params) != 8 * n_sets or n_scales != n_sets:
        raise fail(kernel, None, f"{len(params)} parameters and "
                   f"{n_scales} scales for {n_sets} sets")
    shapes = _shapes(n_sets, d, hid)
    for i, p in enumerate(() if params_checked else params):  # (inline tests: 16 to 48 tensors a call)
        if p.shape != shapes[i] or p.dtype is not dtype or not p.is_contiguous() or not p.is_cpu:
            raise fail(kernel, f"parameter {i}", f"shape "
                       f"{tuple(p.shape)}, {p.dtype}, expected a contiguous CPU {tuple(shapes[i])}, {dtype}")
    for i, gr in enumerate(grads or ()):
        if gr.shape != shapes[i] or gr.dtype is not dtype or not gr.is_contiguous() or not gr.is_cpu:
            raise fail(kernel, f"grad {i}", f"shape {tuple(gr.shape)}, {gr.dtype}, expected a contiguous CPU "
                       f"{tuple(shapes[i])}, {dtype}")
    need = n_sets * _set_stride(m, half, d, hid, cop) + (2 * heads * heads if cop else 0)
    require_dense(kernel, "ws", ws, dtype=dtype, numel=need)
    per = m * n_sets * 2 * half * d
    for name, x, size in (("pts", pts, per), ("kl", kl, b), ("kl_mean", klm, 1), ("gpts", gpts, per),
                          ("dh", dh, m * d), ("dkeys", dkeys, m * nkeys * d), ("dnoise", dnoise,
                                                                               n_sets * m * half * d),
                          ("draw", draw, heads * heads)):
        if x is not None:
            require_dense(kernel, name, x, dtype=dtype, numel=size)
    if gkl is not None:
        require_view(kernel, "gkl", gkl, dtype=dtype, sizes=(b,), strides=(gks,))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _set_stride(m: int, half: int, d: int, hid: int, cop: bool) -> int:
    """Workspace entries per set (``set_stride`` of the C file)."""
    r = m * half
    return m * hid + 3 * m * d + r * d + r * hid + (r * d if cop else 0)
