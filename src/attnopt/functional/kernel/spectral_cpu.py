r"""The implicit spectral densities' sampler in C (internal; ``_native/spectral_sample.c``).

The same function as :class:`.spectral._SpectralSample` (implicit-kernel-attention
eq. 5–8 for ``S`` point sets, the MIKAN copula ``e = L̃ε`` and the analytic KL): the whole
forward in one C call, the whole closed-form backward (``dh``, ``dε``, the copula's ``d raw``
and every network parameter's gradient) in another. At the sizes models train at the PyTorch
node is ~15 ops forward and ~30 backward on tensors of a few kB (B·H = 8: ~0.5–0.7 ms of per-op
overhead, more than SDPA's whole forward and backward); the C calls do the same arithmetic in
register-blocked loops, one thread.

Used for CPU float32/float64 tensors with storage (not ``torch.func`` / fake tensors), all of
one dtype, and the stock network shapes, on one torch thread or up to
``THRESHOLDS.spectral_threaded_max_points`` base points; elsewhere (and with ``ATTNOPT_NATIVE=0`` or no
compiler) the PyTorch node runs. Measured (one thread, loaded 2-core machine; IKAN's two sets,
R = 16, d = 64): forward + backward of the sampler alone 0.58 → 0.26 ms at B·H = 8 (the C
calls ~30 µs each, the rest Python and autograd), 1.1 → 0.7 ms at B·H = 64. float32's
``tanh`` is a rational approximation (max error ~6 ulp); float64 uses libm's. Double backward
differentiates the plain PyTorch form of the function (exact second derivatives).

The two calls are also ``torch.library`` ops (issue 30 item 2): ``attnopt::ss_fwd(src, noise, raw,
params, scales, kl_mean, keys) -> (points, kl, workspace, h or empty)`` (:func:`sample_forward`) and
``attnopt::ss_bwd`` (:func:`sample_backward`), connected by ``register_autograd`` (first order only:
double backward through the op is refused by PyTorch; the eager Function differentiates the plain
form). Plain eager code (:func:`native_sample`) calls the same functions through the autograd
Function :class:`_NativeSpectralSample`: the Python ``custom_op`` path costs a fixed few tens of µs
more per call, a large share of this ~0.3 ms node (figures in the issue-30 note).
"""
from __future__ import annotations

import ctypes
import math
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt.functional._autograd import double_backward
from attnopt.functional.kernel._spectral_c import (  # noqa: F401  (library, traced_applies: the router's)
    _functions,
    _noise_layout,
    _ptr,
    _set_stride,
    check_sample,
    library,
    traced_applies,
)
from attnopt.functional.kernel._spectral_plain import sample_plain

__all__ = ["library", "native_sample"]

_I64, _VP = ctypes.c_int64, ctypes.c_void_p
_PF64 = ctypes.POINTER(ctypes.c_double)


@_native.untraced
def sample_forward(
    src: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], scales: list[float], kl_mean: bool,
    keys: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(points, kl, workspace, h or empty)``: the sampler's forward C call (``ss_fwd``).

    Inputs as :class:`.spectral._SpectralSample`; ``keys``: ``src`` is ``(..., H, N, d)`` and ``h`` its
    mean over ``N`` (``ImplicitKernelAttention._head_summary``), taken in the C call and returned
    (empty otherwise); ``kl``: the per-example KL, or its batch mean (0-d) with ``kl_mean``. The
    workspace holds what the backward reads. The body of ``attnopt::ss_fwd``.
    """
    lib = _native.library("spectral_sample")
    assert lib is not None
    n_sets = len(scales)
    half, d = noise.shape[-2], noise.shape[-1]
    lead = src.shape[:-2] if keys else src.shape[:-1]
    heads = lead[-1]
    batch = math.prod(lead[:-1])
    hid = params[0].shape[0]
    m = batch * heads
    nkeys = src.shape[-2] if keys else 0
    hc = src.contiguous()
    h = src.new_empty(*lead, d) if keys else src
    ne = _noise_layout(noise, n_sets, lead, half, d)
    cop = raw is not None
    rc = raw.contiguous() if raw is not None else None
    pts = h.new_empty(*lead, n_sets * 2 * half, d)
    kl = h.new_empty(lead[:-1])
    klm = h.new_empty(()) if kl_mean else None
    ws = h.new_empty(n_sets * _set_stride(m, half, d, hid, cop) + (2 * heads * heads if cop else 0))
    addrs = (ctypes.c_int64 * len(params))(*[p.data_ptr() for p in params])
    sc = (ctypes.c_double * n_sets)(*scales)
    fwd, _ = _functions(lib, h.dtype)
    dims = (n_sets, batch, heads, half, d, hid)
    strides = (ne.stride(0), ne.stride(1), ne.stride(2))
    check_sample("ss_fwd", dims, hc, nkeys, h, ne, strides, rc, params, tuple(scales), ws, pts=pts, kl=kl,
                 klm=klm)
    if fwd(*dims, hc.data_ptr(), nkeys, h.data_ptr(), ne.data_ptr(), *strides, _ptr(rc), addrs, sc,
           pts.data_ptr(), kl.data_ptr(), _ptr(klm), ws.data_ptr()):
        raise MemoryError("spectral sampler (native): out of memory for its scratch")
    # the mean in C: no autograd node (nor aten op) of its own
    return pts, (kl if klm is None else klm), ws, h if keys else src.new_empty(0)


@_native.untraced
def sample_backward(
    gpts: Tensor, gkl: Tensor, src: Tensor, h: Tensor, noise: Tensor, raw: Tensor | None, ws: Tensor,
    params: list[Tensor], scales: list[float], kl_mean: bool, keys: bool, need_src: bool, need_noise: bool,
    need_raw: bool,
) -> list[Tensor]:
    """``[d src, d noise, d raw, *d params]`` of :func:`sample_forward` (``ss_bwd``, the closed-form
    backward in one C call); the first three empty where not needed. The body of ``attnopt::ss_bwd``."""
    lib = _native.library("spectral_sample")
    assert lib is not None
    if not keys:
        h = src
    n_sets = len(scales)
    half, d = noise.shape[-2], noise.shape[-1]
    lead = h.shape[:-1]
    heads = lead[-1]
    batch = math.prod(lead[:-1])
    dims = (n_sets, batch, heads, half, d, params[0].shape[0])
    m = batch * heads
    ne = _noise_layout(noise, n_sets, lead, half, d)
    strides = (ne.stride(0), ne.stride(1), ne.stride(2))
    sc = (ctypes.c_double * n_sets)(*scales)
    gp = gpts.contiguous()
    # the KL's gradient per example: the mean's backward hands an expanded (B,) tensor (stride 0);
    # of the mean taken here, gkl / B for every example (divided in C, read with stride 0)
    gk = gkl if gkl.dim() == 1 or kl_mean else gkl.contiguous()
    gdiv = batch if kl_mean else 1
    # keys: the mean's backward (dh / N on every key) in C, written to a new tensor
    dkeys = h.new_empty(src.shape) if keys and need_src else None
    dh = h.new_empty(m, d) if need_src and not keys else None
    dn = h.new_empty(n_sets, m, half, d) if need_noise else None
    draw = h.new_empty(heads, heads) if raw is not None and need_raw else None
    grads = [torch.empty_like(p) for p in params]
    # the addresses again from the saved parameters (``p.data = ...`` between forward and
    # backward swaps their storage without a version bump: never read a stale address)
    addrs = (ctypes.c_int64 * len(params))(*[p.data_ptr() for p in params])
    gaddrs = (ctypes.c_int64 * len(grads))(*[g.data_ptr() for g in grads])
    _, bwd = _functions(lib, h.dtype)
    rc = raw.contiguous() if raw is not None else None
    gks = 0 if kl_mean else gk.stride(0) if gk.dim() == 1 else 1
    nkeys = src.shape[-2] if keys else 0
    # held by a name through the call (a temporary's memory is freed as soon as its address is taken)
    hc = h.contiguous()
    check_sample("ss_bwd", dims, hc, 0, None, ne, strides, rc, params, tuple(scales), ws, gpts=gp,
                 gkl=gk, gks=gks, dh=dh, nkeys=nkeys, dkeys=dkeys, dnoise=dn, draw=draw, grads=grads)
    if bwd(*dims, hc.data_ptr(), ne.data_ptr(), *strides, _ptr(rc), addrs, sc,
           ws.data_ptr(), gp.data_ptr(), gk.data_ptr(), gks, gdiv, _ptr(dh), nkeys, _ptr(dkeys), 0,
           _ptr(dn), _ptr(draw), gaddrs):
        raise MemoryError("spectral sampler (native): out of memory for its scratch")
    empty = h.new_empty(0)
    dnoise = empty if dn is None else dn.view(n_sets, *h.shape[:-1], half, d).sum_to_size(noise.shape)
    dsrc = dkeys if keys else None if dh is None else dh.view_as(h)
    return [h.new_empty(0) if dsrc is None else dsrc, dnoise, h.new_empty(0) if draw is None else draw,
            *grads]


class _NativeSpectralSample(torch.autograd.Function):
    """:func:`sample_forward` / :func:`sample_backward` as one autograd node (plain eager calls);
    inputs as :class:`.spectral._SpectralSample`."""

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, src: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...], kl_mean: bool,
        keys: bool, *params: Tensor,
    ) -> tuple[Tensor, Tensor]:
        pts, kl, ws, h = sample_forward(src, noise, raw, list(params), list(scales), kl_mean, keys)
        ctx.scales, ctx.kl_mean, ctx.keys = scales, kl_mean, keys
        ctx.save_for_backward(src, h, noise, raw, ws, *params)
        return pts, kl

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, gpts: Tensor, gkl: Tensor) -> tuple[Tensor | None, ...]:
        src, h, noise, raw, ws, *params = ctx.saved_tensors
        need = ctx.needs_input_grad
        if double_backward(ctx):  # create_graph=True: differentiate the plain ops (exact double backward)
            return _plain_backward(ctx, src, noise, raw, params, gpts, gkl)
        scales = list(ctx.scales)
        dsrc, dnoise, draw, *grads = sample_backward(gpts, gkl, src, h, noise, raw, ws, params, scales,
                                                     ctx.kl_mean, ctx.keys, need[0], need[1], need[2])
        return (dsrc if need[0] else None, dnoise if need[1] else None,
                draw if raw is not None and need[2] else None, None, None, None,
                *(g if n else None for g, n in zip(grads, need[6:], strict=True)))


def _plain_backward(
    ctx: Any, src: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], gpts: Tensor, gkl: Tensor
) -> tuple[Tensor | None, ...]:
    inputs = [src, noise, raw, None, None, None, *params]
    need = [x for x, n in zip(inputs, ctx.needs_input_grad, strict=True) if n and x is not None]
    with torch.enable_grad():
        h = torch.div(src.sum(dim=-2), src.shape[-2]) if ctx.keys else src
        pts, kl = sample_plain(h, noise, raw, ctx.scales, params)
        if ctx.kl_mean:
            kl = kl.mean()
    grads = iter(torch.autograd.grad((pts, kl), need, (gpts, gkl), create_graph=True, allow_unused=True))
    return tuple(next(grads) if n and x is not None else None
                 for x, n in zip(inputs, ctx.needs_input_grad, strict=True))


def native_sample(
    h: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...], params: list[Tensor],
    _lib: ctypes.CDLL, kl_mean: bool = False, keys: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(points, kl)`` of :func:`.spectral.sample_spectral_points` in C (``lib``: :func:`library`);
    ``kl_mean``: the KL's batch mean (0-d) in place of the per-example KL; ``keys``: ``h`` is the
    keys ``(..., H, N ≥ 1, d)``, the summary their mean over ``N`` (taken inside the node)."""
    out: tuple[Tensor, Tensor] = _NativeSpectralSample.apply(h, noise, raw, scales, kl_mean, keys, *params)
    return out


# --- the sampler as torch.library ops (issue 30 item 2) ---------------------------------------------


@torch.library.custom_op("attnopt::ss_fwd", mutates_args=(), device_types="cpu")
def ss_fwd(
    src: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], scales: list[float], kl_mean: bool,
    keys: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(points, kl, workspace, h or empty)`` of the implicit spectral sampler (:func:`sample_forward`)."""
    return sample_forward(src, noise, raw, params, scales, kl_mean, keys)


@ss_fwd.register_fake
def _(src: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], scales: list[float],
      kl_mean: bool, keys: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n_sets, (half, d) = len(scales), noise.shape[-2:]
    lead = src.shape[:-2] if keys else src.shape[:-1]
    heads, hid = lead[-1], params[0].shape[0]
    m = math.prod(lead)
    cop = raw is not None
    ws = src.new_empty(n_sets * _set_stride(m, half, d, hid, cop) + (2 * heads * heads if cop else 0))
    return (src.new_empty(*lead, n_sets * 2 * half, d), src.new_empty(() if kl_mean else lead[:-1]), ws,
            src.new_empty(*lead, d) if keys else src.new_empty(0))


@torch.library.custom_op("attnopt::ss_bwd", mutates_args=(), device_types="cpu")
def ss_bwd(
    gpts: Tensor, gkl: Tensor, src: Tensor, h: Tensor, noise: Tensor, raw: Tensor | None, ws: Tensor,
    params: list[Tensor], scales: list[float], kl_mean: bool, keys: bool, need_src: bool, need_noise: bool,
    need_raw: bool,
) -> list[Tensor]:
    """``[d src, d noise, d raw, *d params]`` of :func:`ss_fwd` (:func:`sample_backward`)."""
    return sample_backward(gpts, gkl, src, h, noise, raw, ws, params, scales, kl_mean, keys, need_src,
                           need_noise, need_raw)


@ss_bwd.register_fake
def _(gpts: Tensor, gkl: Tensor, src: Tensor, h: Tensor, noise: Tensor, raw: Tensor | None,  # noqa: ARG001
      ws: Tensor, params: list[Tensor], scales: list[float], kl_mean: bool, keys: bool,  # noqa: ARG001
      need_src: bool, need_noise: bool, need_raw: bool) -> list[Tensor]:
    heads = (src.shape[-3] if keys else src.shape[-2])
    return [src.new_empty(src.shape if need_src else (0,)),
            noise.new_empty(noise.shape if need_noise else (0,)),
            src.new_empty((heads, heads) if raw is not None and need_raw else (0,)),
            *(p.new_empty(p.shape) for p in params)]


def _ss_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    src, noise, raw, params, scales, kl_mean, keys = inputs
    _, _, ws, h = output
    ctx.scales, ctx.kl_mean, ctx.keys, ctx.n_params = scales, kl_mean, keys, len(params)
    ctx.save_for_backward(src, h, noise, raw, ws, *params)


def _ss_backward(ctx: Any, gpts: Tensor, gkl: Tensor, *_unused: Tensor | None) -> tuple[Any, ...]:
    src, h, noise, raw, ws, *params = ctx.saved_tensors
    need = ctx.needs_input_grad
    dsrc, dnoise, draw, *grads = torch.ops.attnopt.ss_bwd(
        gpts, gkl, src, h, noise, raw, ws, params, ctx.scales, ctx.kl_mean, ctx.keys, need[0], need[1],
        raw is not None and need[2])
    return (dsrc if need[0] else None, dnoise if need[1] else None,
            draw if raw is not None and need[2] else None, grads if need[3] else None, None, None, None)


ss_fwd.register_autograd(_ss_backward, setup_context=_ss_setup)
