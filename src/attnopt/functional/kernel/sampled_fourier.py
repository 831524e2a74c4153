r"""Sampled implicit-kernel attention in one autograd node (internal; small CPU sizes).

implicit-kernel-attention eq. 5–9, 11 for the stock density networks: the spectral points
``w = sign(z)·(c|z| + NN₂(|z|))``, ``z = μ + σ ⊙ e`` with ``[μ, ρ] = NN₁(h)``, ``h`` the keys'
mean per head (:mod:`.spectral`), then attention with the Fourier features of ``w`` and
the L^p key magnitude (:class:`attnopt.functional.kernel.fourier._WholeFourier`):

.. math:: O_i = \frac{\sum_j (f(q_i, k_j)^2 + \varepsilon)\, m_j v_j}
                       {\sum_j (f(q_i, k_j)^2 + \varepsilon)\, m_j},
          \qquad \mathrm{KL} = \operatorname{mean}_b \tfrac{R}{2} \textstyle\sum_s \sum_{m,j}
          \tfrac12 (\sigma^2 + \mu^2 - 1 - 2\log\sigma).

The sampler's C call and the attention's C call, forward and backward, run inside one
:class:`torch.autograd.Function`: the points never become an autograd tensor, the keys'
gradient from the summary is added in place (no second node, no expand node, no engine sum),
and the attention's argument checks are made once. At B·H = 8, N = 64 the two nodes and their
glue cost more than the arithmetic. The function, the random stream and every gradient are
those of :meth:`attnopt.nn.ImplicitKernelAttention.attend`'s two-node path, bitwise (tested).

The node calls the C functions itself (not through the two nodes' Functions): the constants
of a call shape (sizes, options, C entry points, scratch offsets) are a :class:`_Plan` built
once per shape; the summaries, points, KL, workspaces, the attention's saved block and, in
training, the base noise (made from its seed by ``_native/normal.c``, :mod:`.gaussian_noise`)
are one scratch tensor (one allocation, one saved tensor); the parameters' addresses go as one
int64 array; the finiteness checks are C bit tests on the contiguous heads and the points. A
call whose dtypes, shapes and options were seen before (:func:`_call_key`) makes only the checks
that can change between such calls (:func:`_still_applies`: tensor kinds and devices, transforms,
dispatch modes, the native switch, every parameter's shape, dtype and layout), not the path's
whole list. Measured (fwd+bwd ÷ SDPA, B·H = 8, N = 64, d = 64, one thread, IKAN R = 16): 2.3×
through the two Functions' code, 2.0× with the plan, 1.9× with the noise from its seed and the
per-call checks. What remains is the C arithmetic (~0.43 ms of ~0.8) and autograd's per-leaf
cost of the 16 network parameters (~5 µs each, ~80 µs).

Taken by :meth:`~attnopt.nn.ImplicitKernelAttention.attend` without a mask, ``need_weights``
or dropout, in the quadratic mode, where the C sampler (:func:`.spectral_cpu.library`)
and the whole-call Fourier path (:func:`attnopt.functional.kernel.fourier._whole_call`) both
apply; everything else takes the two nodes.
"""
from __future__ import annotations

import array
import ctypes
import itertools
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnopt import _func, _native
from attnopt._native.checks import fail, require, require_dense
from attnopt._validation import _finite_fns, check_finite
from attnopt.functional import dispatch
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel._fourier_c import _LP_MODES
from attnopt.functional.kernel._fourier_whole import (
    _CAP,
    _each,
    _heads_split,
    _size,
    _whole_call,
    check_whole,
)
from attnopt.functional.kernel._normal_c import seeded_fill
from attnopt.functional.kernel._spectral_c import (
    _PLAIN,
    _WRAPPED,
    _functions,
    _noise_layout,
    _set_stride,
    _shapes,
    check_sample,
)
from attnopt.functional.kernel._spectral_c import library as sampler_library

__all__ = ["sampled_fourier_attention"]


class _Plan(NamedTuple):
    """The constants of one call shape (no tensor, no address: shared between calls and threads)."""

    sample_fwd: Any
    sample_bwd: Any
    attend_fwd: Any
    attend_bwd: Any
    gemm: int
    set_threads: int
    nonfinite: Any  # finite.c's dense test for the dtype
    noise_fill: Any  # normal.c's seeded fill for the dtype, or None: the noise comes as a tensor
    libs: tuple[Any, Any]  # the sampler's and the attention's libraries (the calls' check: still them)
    size_fns: tuple[Any, Any]  # ffw_save_size, ffw_work_size (the checks' sizes: the kernel's own)
    param_shapes: tuple[torch.Size, ...]  # the network parameters' shapes
    dims: tuple[int, int, int, int, int, int]  # (S, B, H, R/2, d, hidden): the sampler's
    scales: Any  # the densities' base_scale (a C double array)
    threads: int  # threads over the heads (the attention's calls)
    fwd_tail: tuple[Any, ...]  # the attention forward's size and option arguments
    bwd_tail: tuple[Any, ...]  # the backward's (before the saved block)
    # the forward's scratch (one tensor, saved for the backward): offsets in elements of the
    # summaries h (B·H, d), the points (B, H, S·R, d), the per-example KL (B), the sampler's
    # workspace, the attention's saved block (B·H per-head blocks), its per-thread work and, from
    # a seed, the noise (S, B, H, R/2, d); the backward's: dpts, then the per-thread work
    at_h: int
    at_pts: int
    at_kl: int
    at_ws: int
    at_save: int
    at_work: int
    at_noise: int
    noise_strides: tuple[int, int, int]  # the seeded noise's (S, B, H) strides
    scratch: int
    work: int  # the attention's work entries per thread
    backward_scratch: int


_PLANS: dict[tuple[Any, ...], _Plan] = {}


def _plan(key: tuple[Any, ...], lib: Any, cfg: Any, nonfinite: Any, noise_fill: Any) -> _Plan:
    dtype, b, h, nq, nk, d, dv, nsets, half, hid, p, eps, scales, threads, cop = key[:15]
    cfg_lib = _native.library("fourier_features")
    fwd, bwd, save_size, work_size, gemm, set_threads = cfg
    r = 2 * half
    sizes = (nq, nk, d, dv, r, nsets)
    coef = 1.0 / math.sqrt(r) if nsets == 1 else 1.0 / (2 * math.sqrt(r))
    c4 = coef**4
    sample_fwd, sample_bwd = _functions(lib, dtype)
    work = _size(work_size, sizes)
    workspace = nsets * _set_stride(b * h, half, d, hid, cop) + (2 * h * h if cop else 0)
    noise = nsets * b * h * half * d if noise_fill is not None else 0
    at_pts, at_kl, at_ws, at_save, at_work, at_noise, total = itertools.accumulate(_aligned(n) for n in (
        b * h * d, b * h * nsets * r * d, b, workspace, b * h * _size(save_size, sizes), threads * work,
        noise))
    if len(_PLANS) > 256:  # many shapes (variable lengths): keep the table small
        _PLANS.clear()
    plan = _PLANS[key] = _Plan(
        sample_fwd, sample_bwd, fwd, bwd, gemm, set_threads, nonfinite, noise_fill, (lib, cfg_lib),
        (save_size, work_size),
        _shapes(nsets, d, hid), (nsets, b, h, half, d, hid),
        (ctypes.c_double * nsets)(*scales), threads,
        (nq, nk, d, dv, r, nsets, _LP_MODES.get(p, 0), p, 1.0 / math.sqrt(d), _CAP[dtype], c4, eps, 1),
        (nq, nk, d, dv, r, nsets, 1, c4, eps), 0, at_pts, at_kl, at_ws, at_save, at_work, at_noise,
        (b * h * half * d, h * half * d, half * d), total, work,
        _aligned(b * h * nsets * r * d) + threads * work)
    return plan


def _aligned(n: int) -> int:
    """``n`` elements rounded up to 16 (64 bytes in float32: every region starts on a cache line)."""
    return -(-n // 16) * 16


def _addresses(tensors: tuple[Tensor, ...] | list[Tensor]) -> tuple[array.array, int]:
    """The tensors' addresses as a C int64 array (kept alive by the caller) and its address."""
    addrs = array.array("q", [t.data_ptr() for t in tensors])
    return addrs, addrs.buffer_info()[0]


def _check_sampled(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, params: tuple[Tensor, ...],
                   scratch: Tensor) -> None:
    """The call's tensors against the shape its plan was made for: ``q (B, H, Nq, d)``, ``k (B, H, Nk, d)``,
    ``v (B, H, Nk, Dv)`` contiguous, the parameters' shapes, the scratch of ``plan.scratch`` entries (the
    regions of each C call are checked before it, by :func:`check_sample` and :func:`check_whole`). The
    parameters' shapes, dtype, layout and device are the plan's: :func:`_still_applies` (or
    :func:`_checked_plan`) checked them in this call, the only way to :func:`_apply` (no user code runs
    in between), so neither this nor the forward's :func:`check_sample` repeats that 16–48-tensor loop;
    the backward's does (``p.data = ...`` between the passes keeps the objects)."""
    _, b, h, _, d, _ = plan.dims
    nq, nk, _, dv = plan.fwd_tail[:4]
    kernel = "sampled_fourier"
    for name, t, shape in (("q", q, (b, h, nq, d)), ("k", k, (b, h, nk, d)), ("v", v, (b, h, nk, dv))):
        if t.shape != shape:
            raise fail(kernel, name, f"shape "
                       f"{tuple(t.shape)}, the plan's {shape}")
        require(kernel, name, t, dtype=q.dtype)
    if len(params) != len(plan.param_shapes):
        raise fail(kernel, None, f"{len(params)} parameters, the plan's {len(plan.param_shapes)}")
    require(kernel, "scratch", scratch, dtype=q.dtype, numel=plan.scratch)


class _SampledFourier(torch.autograd.Function):
    """q, k, v ``(B, H, N, d)``; noise ``(S, B|1, H, R/2, d)`` (no gradient), or its int64 seed
    (0-d, :mod:`.gaussian_noise`) with a seeded plan; raw ``(H, H)`` or None; the :class:`_Plan`;
    then the ``8·S`` network parameters.
    Returns ``(O (B, H, Nq, dv), KL batch mean (0-d))``."""

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, noise: Tensor, raw: Tensor | None, plan: _Plan,
        *params: Tensor,
    ) -> tuple[Tensor, Tensor]:
        nsets, b, h, half, d, hid = plan.dims
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # heads from a projection are views
        nonfinite = plan.nonfinite
        scratch = q.new_empty(plan.scratch)
        _check_sampled(plan, q, k, v, params, scratch)
        # kernel_attention's entry check (the message from check_finite, naming the argument)
        if nonfinite(q.data_ptr(), q.numel()) or nonfinite(k.data_ptr(), k.numel()) or nonfinite(
                v.data_ptr(), v.numel()):
            check_finite(q=q, k=k, v=v)
        rc = None if raw is None else raw.contiguous()
        out, klm = q.new_empty(b, h, q.shape[2], v.shape[3]), q.new_empty(())
        base, size = scratch.data_ptr(), scratch.element_size()
        pts, sr = base + plan.at_pts * size, nsets * 2 * half
        if plan.noise_fill is not None:  # the noise from its seed, into the scratch
            ne = None
            noise_at, (ns, nb, nh) = base + plan.at_noise * size, plan.noise_strides
            require("normal_fill_at", "seed", noise, dtype=torch.int64, numel=1)
            require_dense("normal_fill_at", "out", (scratch, plan.at_noise, plan.scratch), dtype=q.dtype,
                          numel=nsets * b * h * half * d)
            plan.noise_fill(noise.data_ptr(), noise_at, nsets * b * h * half * d)
        else:
            ne = _noise_layout(noise, nsets, (b, h), half, d)
            noise_at, (ns, nb, nh) = ne.data_ptr(), ne.stride()[:3]
        ctx.noise = noise_at - base if ne is None else None, ns, nb, nh
        # the sampler: the keys' mean, the networks, the points and the KL's batch mean in one call
        addrs, paddrs = _addresses(params)
        check_sample("ss_fwd", plan.dims, k, k.shape[2], (scratch, plan.at_h, plan.at_pts),
                     (scratch, plan.at_noise, plan.scratch) if ne is None else ne, (ns, nb,
                                                                                    nh), rc, params, nsets,
                     (scratch, plan.at_ws, plan.at_save), pts=(scratch, plan.at_pts, plan.at_kl),
                     kl=(scratch, plan.at_kl, plan.at_ws), klm=klm, params_checked=True)
        if plan.sample_fwd(*plan.dims, k.data_ptr(), k.shape[2], base + plan.at_h * size, noise_at,
                           ns, nb, nh, None if rc is None else rc.data_ptr(),
                           paddrs, plan.scales, pts, base + plan.at_kl * size, klm.data_ptr(),
                           base + plan.at_ws * size):
            raise MemoryError("spectral sampler (native): out of memory for its scratch")
        if nonfinite(pts, b * h * sr * d):  # the check NonStationaryFourier.stacked makes
            raise ValueError("spectral points must be finite (the density networks gave NaN or ±inf)")
        # the attention of every head with the points' features and the L^p key magnitude
        g = b * h
        head = (q.data_ptr(), k.data_ptr(), v.data_ptr(), pts, h * sr * d, sr * d, h, None)
        tail = (*plan.fwd_tail, base + plan.at_save * size, out.data_ptr())
        work, step = base + plan.at_work * size, plan.work * size
        fwd = plan.attend_fwd
        check_whole("ffw_fwd", plan.size_fns, plan.fwd_tail[:6], g, q, k, v, (scratch, plan.at_pts,
                                                                              plan.at_kl),
                    h * sr * d, sr * d, h, (scratch, plan.at_save, plan.at_work), out,
                    (scratch, plan.at_work, plan.at_noise), plan.threads, step=plan.work)
        if plan.threads == 1:
            fwd(plan.gemm, plan.set_threads, *head, 0, g, *tail, work)
        else:
            _each(plan.threads, g, lambda t, g0, g1: fwd(plan.gemm, plan.set_threads, *head, g0, g1, *tail,
                                                         work + t * step))
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, ne, rc, scratch, out, *params)
        return out, klm

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor, dkl: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(
            ctx, "ImplicitKernelAttention (sampled points, whole-call node)",
            "the Fourier-feature attention has no double backward at these sizes either")
        plan: _Plan = ctx.plan
        q, k, v, ne, rc, scratch, out, *params = ctx.saved_tensors
        need = ctx.needs_input_grad
        nsets, b, h, half, d, hid = plan.dims
        g, nq, dv, sr = b * h, q.shape[2], v.shape[3], nsets * 2 * half
        if dout.dtype != out.dtype:
            dout = dout.to(out.dtype)
        # as (g, nq, dv) with its strides (the gradient of a sum is an expanded scalar: strides 0)
        d3 = dout if dout.is_contiguous() else dout.reshape(g, nq, dv)
        dstrides = (nq * dv, dv, 1) if d3 is dout else (d3.stride(0), d3.stride(1), d3.stride(2))
        dq = torch.empty_like(q) if need[0] else None
        dk = torch.empty_like(k) if need[1] else None
        dvv = torch.empty_like(v) if need[2] else None
        need_pts = need[1] or need[4] or any(need[6:])
        bscratch = q.new_empty(plan.backward_scratch)  # dpts, then the attention's work per thread
        base, size = scratch.data_ptr(), scratch.element_size()
        at, ns, nb, nh = ctx.noise  # the noise's offset in the scratch (bytes; None: the saved tensor)
        noise_at = ne.data_ptr() if at is None else base + at
        dpts = bscratch.data_ptr() if need_pts else None
        head = (q.data_ptr(), k.data_ptr(), v.data_ptr(), base + plan.at_pts * size, h * sr * d, sr * d, h,
                d3.data_ptr(), *dstrides, out.data_ptr())
        outs = (None if dq is None else dq.data_ptr(), None if dk is None else dk.data_ptr(),
                None if dvv is None else dvv.data_ptr(), dpts)
        tail = (*plan.bwd_tail, base + plan.at_save * size)
        work, step = bscratch.data_ptr() + _aligned(b * h * sr * d) * size, plan.work * size
        bwd = plan.attend_bwd
        require("ffw_bwd", "scratch", scratch, dtype=q.dtype, numel=plan.scratch)
        require("ffw_bwd", "backward scratch", bscratch, dtype=q.dtype, numel=plan.backward_scratch)
        check_whole("ffw_bwd", plan.size_fns, plan.fwd_tail[:6], g, q, k, v, (scratch, plan.at_pts,
                                                                              plan.at_kl),
                    h * sr * d, sr * d, h, (scratch, plan.at_save, plan.at_work), out,
                    (bscratch,
                     _aligned(b * h * sr * d)), plan.threads, step=plan.work, dout=d3, dstrides=dstrides,
                    grads=(dq, dk, dvv), dw=None if dpts is None else (bscratch, 0, _aligned(b * h * sr * d)),
                    dsb=h * sr * d, dsh=sr * d)
        if plan.threads == 1:
            bwd(plan.gemm, plan.set_threads, *head, 0, g, *tail, work, *outs, h * sr * d, sr * d, 0)
        else:
            _each(plan.threads, g, lambda t, g0, g1: bwd(plan.gemm, plan.set_threads, *head, g0, g1, *tail,
                                                         work + t * step, *outs, h * sr * d, sr * d, 0))
        if dpts is None:
            return (dq, dk, dvv, None, None, None, *([None] * len(params)))
        # the sampler's backward: the KL's batch mean (dkl / B on every example, divided in C), the
        # networks' and the copula's gradients, and the summary's share of dk (dh / N on every key)
        # added to dk in C
        draw = q.new_empty(h, h) if need[4] else None
        every = [torch.empty_like(p) for p in params]  # (the C call writes all of them)
        addrs, paddrs = _addresses(params)  # again: ``p.data = ...`` swaps storage without a version bump
        gaddrs, pgaddrs = _addresses(every)
        if dkl.dtype != out.dtype:
            dkl = dkl.to(out.dtype)
        check_sample("ss_bwd", plan.dims, (scratch, plan.at_h, plan.at_pts), 0, None,
                     (scratch, at // size, plan.scratch) if at is not None else ne, (ns, nb,
                                                                                     nh), rc, params, nsets,
                     (scratch, plan.at_ws, plan.at_save), gpts=(bscratch, 0,
                                                                _aligned(b * h * sr * d)), gkl=dkl,
                     gks=0, nkeys=k.shape[2], dkeys=dk, draw=draw)  # (every: empty_like of checked params)
        if plan.sample_bwd(*plan.dims, base + plan.at_h * size, noise_at, ns, nb, nh,
                           None if rc is None else rc.data_ptr(), paddrs, plan.scales,
                           base + plan.at_ws * size, dpts, dkl.data_ptr(), 0, b, None, k.shape[2], outs[1], 1,
                           None, None if draw is None else draw.data_ptr(), pgaddrs):
            raise MemoryError("spectral sampler (native): out of memory for its scratch")
        grads = [gr if n else None for gr, n in zip(every, need[6:], strict=True)]
        return (dq, dk, dvv, None, draw, None, *grads)


#: ``torch.autograd.Function.apply`` without its ``torch.func`` dead-wrapper pass over the ~24
#: arguments (~8 µs): the caller has checked that no tensor is a wrapper and no transform is active
_apply = super(torch.autograd.Function, _SampledFourier).apply


def sampled_fourier_attention(
    q: Tensor, k: Tensor, v: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...],
    params: list[Tensor], p: float, eps: float, half: int,
) -> tuple[Tensor, Tensor] | None:
    """``(O, KL batch mean)`` in one node, or None where it does not apply.

    Args:
        q, k, v: ``(B, H, N, d)`` heads (no mask).
        noise: ``(S, B|1, H, R/2, d)`` base noise (no gradient), or the int64 seed (0-d) of its
            draw (:func:`.gaussian_noise.draw_seed`): the node makes the values in its scratch.
        raw: the copula's raw parameter ``(H, H)`` or None.
        scales: the densities' ``base_scale`` per set.
        params: :func:`.spectral.fusable` of the densities.
        p: the magnitude exponent (``1 <= p <= 2``).
        eps: the ``ε`` of ``f² + ε`` (``> 0``).
        half: ``R/2``, the base points per set and head.

    A call whose :func:`_call_key` was seen with a plan makes only the checks that can change
    between calls of one key (:func:`_still_applies`); the others make every check.
    """
    if torch.compiler.is_compiling():  # fake tensors: no memory for the C kernels (PyTorch path)
        return None
    if dispatch.current_backend() == "triton":  # the attention's Triton kernels (kernel_attention's router)
        return None
    key = _call_key(q, k, v, noise, raw, scales, params, p, eps, half)
    plan = _BY_CALL.get(key)
    if plan is None or not _still_applies(q, k, v, noise, raw, params, plan):
        plan = _checked_plan(q, k, v, noise, raw, scales, params, p, eps, half)
        if plan is None:
            return None
        if len(_BY_CALL) > 256:
            _BY_CALL.clear()
        _BY_CALL[key] = plan
    dispatch.record("kernel", "materialized")
    out: tuple[Tensor, Tensor] = _apply(q, k, v, noise, raw, plan, *params)
    return out


#: plans by :func:`_call_key`: keys whose calls passed every check once
_BY_CALL: dict[tuple[Any, ...], _Plan] = {}


def _call_key(
    q: Tensor, k: Tensor, v: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...],
    params: list[Tensor], p: float, eps: float, half: int,
) -> tuple[Any, ...]:
    """Everything :func:`_checked_plan`'s outcome depends on but the per-call state
    :func:`_still_applies` checks: dtypes, shapes, options, the thread count and the module
    constants of the size rules (tests and users change them)."""
    return (q.dtype, k.dtype, v.dtype, noise.dtype, None if raw is None else raw.dtype, q.shape, k.shape,
            v.shape, noise.shape, noise.requires_grad, half, scales, len(params), p, eps,
            torch.get_num_threads(),
            THRESHOLDS.kernel_wholecall_below, THRESHOLDS.kernel_wholecall_max_head_scores,
            THRESHOLDS.spectral_threaded_max_points, _native.min_parallel())


def _still_applies(
    q: Tensor, k: Tensor, v: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], plan: _Plan
) -> bool:
    """The checks of :func:`_checked_plan` that can change between calls of one :func:`_call_key`:
    plain CPU tensors with storage (no ``torch.func`` wrapper, no subclass), no transform, forward-AD
    level or dispatch mode, native kernels on and the plan's libraries still the built ones,
    ``auto``'s choice (``CROSSOVERS`` can be changed), and every parameter's shape, dtype, layout
    and kind (``p.data = ...`` keeps the object)."""
    if type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN or type(noise) not in _PLAIN:
        return False
    if not (q.is_cpu and k.is_cpu and v.is_cpu and noise.is_cpu):
        return False
    if _WRAPPED(q) or _WRAPPED(k) or _WRAPPED(v) or _WRAPPED(noise):
        return False
    if raw is not None and (type(raw) not in _PLAIN or not raw.is_cpu or _WRAPPED(raw)):
        return False
    if _func.under_transform() or torch._C._len_torch_dispatch_stack() or _native.switched_off():
        return False
    libs = _native._LIBS
    if libs.get("spectral_sample") is not plan.libs[0] or libs.get("fourier_features") is not plan.libs[1]:
        return False
    b, h, nq, _ = q.shape
    if dispatch.choose_impl("kernel", nq=nq, nk=k.shape[2], batch=b * h, dtype=q.dtype) != "materialized":
        return False
    dt = q.dtype
    for par, shape in zip(params, plan.param_shapes, strict=True):
        if (par.shape != shape or par.dtype is not dt or type(par) not in _PLAIN or not par.is_contiguous()
                or not par.is_cpu or _WRAPPED(par)):
            return False
    return True


def _checked_plan(
    q: Tensor, k: Tensor, v: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...],
    params: list[Tensor], p: float, eps: float, half: int,
) -> _Plan | None:
    """Every check of the path (the sampler's :func:`.spectral_cpu.library`, the attention's
    :func:`attnopt.functional.kernel.fourier._whole_call`, ...), then the shape's :class:`_Plan`."""
    if not (eps > 0 and 1.0 <= p <= 2.0) or noise.requires_grad:
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    if not (k.shape[:2] == v.shape[:2] == (b, h) and k.shape[3] == d and v.shape[2] == nk):
        return None  # (the two-node path reports bad shapes)
    if 0 in (b, h, nq, d, nk, dv):
        return None
    path = dispatch.choose_impl("kernel", nq=nq, nk=nk, batch=b * h, dtype=q.dtype)
    if path != "materialized":
        return None
    # a seed (a plain CPU int64 scalar: draw_seed's) stands for noise of k's dtype and kind
    seeded = noise.dtype == torch.int64
    if seeded and (noise.dim() != 0 or not noise.is_cpu):
        return None
    lib = sampler_library(k, k if seeded else noise, raw, params, True, half)
    if lib is None:
        return None
    # the attention's checks, with the points' stand-in: k has their dtype, device and storage kind
    cfg = _whole_call(q, k, v, k, None)
    if cfg is None:
        return None
    fns = _finite_fns()
    if fns is None:
        return None
    key = (q.dtype, b, h, nq, nk, d, dv, len(scales), half, params[0].shape[0], float(p),
           float(eps), scales, _heads_split(b * h, nq * nk), raw is not None, seeded, id(lib), id(cfg[0]))
    plan = _PLANS.get(key)
    if plan is None:
        fill = seeded_fill(q.dtype) if seeded else None
        if seeded and fill is None:
            return None
        plan = _plan(key, lib, cfg, fns[q.dtype][0], fill)
    return plan
