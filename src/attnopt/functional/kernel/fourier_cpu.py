r"""The Fourier-feature C kernels as ``torch.library`` ops (issue 30 item 2): ``attnopt::lp_magnitude``
(the L^p key magnitude's gradient factors), ``attnopt::ffw_fwd`` / ``attnopt::ffw_bwd`` (the whole
call, connected by ``register_autograd``; the fake writes out ``ffw_save_size``) and
``attnopt::ff_fwd`` / ``attnopt::ff_bwd`` (the per-pass node, every ``ff_*`` entry of
``fourier_features.c``; its outputs are what the backward reads, the views rebuilt from them). Their
bodies are the functions the eager autograd Functions of :mod:`.fourier` call (:mod:`._fourier_whole`,
:mod:`._fourier_pass`, :mod:`._fourier_c`): one implementation; where the C library is missing at run
time (or for strided tensors) the bodies run the passes' PyTorch ops inside the op. The router puts
the ops in traced graphs (compile / export); plain eager calls keep the Functions (the ``custom_op``
dispatch costs tens of µs a call).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel._fourier_c import _magnitude, _magnitude_native
from attnopt.functional.kernel._fourier_pass import (
    PassState,
    broadcast_batch,
    pass_backward,
    pass_consts,
    pass_forward,
    pass_layout,
    phi_views,
    weighted_inputs,
)
from attnopt.functional.kernel._fourier_whole import whole_backward, whole_forward

__all__ = ["ff_bwd", "ff_fwd", "ff_ready", "ffw_bwd", "ffw_fwd", "lp_magnitude", "traced_pass_attention",
           "traced_weighted_attention"]


@torch.library.custom_op("attnopt::lp_magnitude", mutates_args=(), device_types="cpu")
def lp_magnitude(k: Tensor, p: float, scale: float, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(a, u, c)`` of :func:`_magnitude` by ``lp_magnitude_*`` as one op (issue 30 item 2; ``u``,
    ``c`` empty unless ``grad``): the gradient *factors*, no autograd of its own (its consumers apply
    the chain rule). Eager code calls :func:`_magnitude_native` directly."""
    k = k.contiguous()
    out = _magnitude_native(k, p, scale, grad, torch.finfo(k.dtype).max / 8) if k.numel() else None
    if out is None:
        out = _magnitude(k, p, scale, grad)
    a, u, c = out
    return a, k.new_empty(0) if u is None else u.clone() if u is k else u, k.new_empty(0) if c is None else c


@lp_magnitude.register_fake
def _(k: Tensor, p: float, scale: float, grad: bool) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ARG001
    return (k.new_empty(k.shape[:-1]), k.new_empty(k.shape if grad else (0,)),
            k.new_empty(k.shape[:-1] if grad else (0,)))


@torch.library.custom_op("attnopt::ffw_fwd", mutates_args=(), device_types="cpu")
def ffw_fwd(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float, coef: float, nsets: int,
    p: float | None, scale: float, need_k: bool,
) -> tuple[Tensor, Tensor]:
    """``(out (*lead, Nq, dv), saved)`` of Fourier-feature kernel attention, one C call per thread
    (:func:`whole_forward`)."""
    return whole_forward(q, k, v, points, mask, eps, coef, nsets, p, scale, need_k, zeroed=True)


@ffw_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float,  # noqa: ARG001
      coef: float, nsets: int, p: float | None, scale: float, need_k: bool) -> tuple[Tensor, Tensor]:  # noqa: ARG001
    lead = q.shape[:-2] or (1,)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    # ffw_save_size of fourier_features.c, written out (symbolic sizes; opcheck compares it with the C)
    sr = points.shape[-2]
    r = sr // nsets
    save = nq * nk + (nq + nk) * 2 * r + 2 * (nq + nk) * sr + nk + nk * d + nk + nq
    return q.new_empty(*lead, nq, dv), q.new_empty(math.prod(lead), save)


@torch.library.custom_op("attnopt::ffw_bwd", mutates_args=(), device_types="cpu")
def ffw_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor, eps: float,
    coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool, need_v: bool, need_w: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d points)`` of :func:`ffw_fwd` (:func:`whole_backward`)."""
    return whole_backward(dout, q, k, v, points, save, out, eps, coef, nsets, magnitude, need_q, need_k,
                          need_v, need_w)


@ffw_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor,  # noqa: ARG001
      eps: float, coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool,  # noqa: ARG001
      need_v: bool, need_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (q.new_empty(q.shape if need_q else (0,)), k.new_empty(k.shape if need_k else (0,)),
            v.new_empty(v.shape if need_v else (0,)), points.new_empty(points.shape if need_w else (0,)))


def _ffw_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, points, _, eps, coef, nsets, p, _, _ = inputs
    out, save = output
    ctx.args = eps, coef, nsets, p is not None
    ctx.save_for_backward(q, k, v, points, save, out)


def _ffw_backward(ctx: Any, dout: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    need = ctx.needs_input_grad[:4]
    dq, dk, dv, dw = torch.ops.attnopt.ffw_bwd(dout, *ctx.saved_tensors, *ctx.args, *need)
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            dw if need[3] else None, None, None, None, None, None, None, None)


ffw_fwd.register_autograd(_ffw_backward, setup_context=_ffw_setup)


# ---- the per-pass path (ff_* of fourier_features.c): attnopt::ff_fwd / ff_bwd ----
#: ff_fwd's outputs: the attention, then what its backward reads, each a tensor of its own (a custom
#: op's outputs may not alias its inputs or each other: the views pq, pk, wm, xs and the given key
#: weight are rebuilt from phi and the inputs); one absent is empty (0,)
_FF_SAVED = 10
_FFOut = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _own(ts: tuple[Tensor | None, ...], like: Tensor) -> list[Tensor]:
    """``ts`` as op outputs: None → empty ``(0,)``, each contiguous (the fake's strides) and holding
    its own memory (a tensor sharing storage with an earlier one, or an alias of an input, is copied)."""
    seen: set[int] = set()
    outs = []
    for t in ts:
        if t is None:
            outs.append(like.new_empty(0))
            continue
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        outs.append(t)
    return outs


@torch.library.custom_op("attnopt::ff_fwd", mutates_args=(), device_types="cpu")
def ff_fwd(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, kw: Tensor | None, mask: Tensor | None, eps: float,
    coef: float, nsets: int, p: float | None, scale: float, need_k: bool,
) -> _FFOut:
    """The per-pass forward (:func:`pass_forward`, the body of the eager :class:`~.fourier._FusedFourier`)
    as one op: ``(out (…, Nq, dv), φ', cos P, sin P, m, vm, 1/den, u, c, F, W)``, all but ``out`` for
    :func:`ff_bwd` (``m`` the computed key weight, empty where ``kw`` is given or neither a magnitude
    nor a mask; ``u``, ``c`` empty unless ``need_k`` and a magnitude; ``F``, ``W`` empty above
    ``kernel_whole_elements`` scores). q, k, v of one batch shape, points broadcast to it. Without the
    C library (or for strided tensors) the passes are the PyTorch ops, inside the op."""
    inputs = {q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
    out, st, _ = pass_forward(q, k, v, points, kw, mask, eps, coef, nsets, p, scale, need_k)
    u = st.u
    if u is not None and u.untyped_storage().data_ptr() in inputs:  # (p = 2's PyTorch factors: u is k)
        u = u.clone()
    kept = (None, None) if st.kept is None else st.kept
    return tuple(_own((out, st.phi, st.cp, st.sp, None if kw is not None else st.kw, st.vm, st.inv, u, st.cm,
                       *kept), q))  # type: ignore[return-value]


@ff_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, points: Tensor, kw: Tensor | None, mask: Tensor | None,
      eps: float, coef: float, nsets: int, p: float | None, scale: float, need_k: bool) -> _FFOut:  # noqa: ARG001
    lead = v.shape[:-2]
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    sr = points.shape[-2]
    r = sr // nsets
    g = math.prod(lead)
    rows = (2, *lead, nq) if nq == nk else (*lead, nq + nk)  # P's layout (pass_forward)
    empty = (0,)
    computed = kw is None and (p is not None or mask is not None)
    mag = kw is None and need_k and p is not None
    kept = g * nq * nk <= THRESHOLDS.kernel_whole_elements  # blocked_forward's one block on the CPU
    return (q.new_empty(*lead, nq, dv), q.new_empty(*rows, 2 * r), q.new_empty(*rows, sr),
            q.new_empty(*rows, sr), q.new_empty((*lead, nk, 1) if computed else empty),
            q.new_empty(g, nk, dv + 1), q.new_empty(*lead, nq, 1),
            q.new_empty((*lead, nk, d) if mag else empty),
            q.new_empty((*lead, nk) if mag else empty), q.new_empty((g, nq, nk) if kept else empty),
            q.new_empty((g, nq, nk) if kept else empty))


def _pass_state(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, kw: Tensor | None, saved: tuple[Tensor, ...], eps: float,
    coef: float, nsets: int,
) -> tuple[PassState, Any]:
    """The :class:`PassState` of :func:`pass_forward` from the op's inputs and outputs (the views
    rebuilt: :func:`pass_layout`, :func:`phi_views`)."""
    phi, cp, sp, kwc, vm, inv, out, u, cm, f, w = saved
    cs = pass_consts(q, k, points, eps, coef, nsets)
    if q.device.type == "cpu":  # as pass_forward read them (the C passes take rows)
        k, v = k.contiguous(), v.contiguous()
    wm, xs = pass_layout(q, k, points, v.shape[:-2], cs)
    pq, pk = phi_views(phi, cs)
    if kw is None and kwc.dim() > 1:
        kw = kwc
    mag = u.dim() > 1
    return PassState(points, wm, cp, sp, pq, pk, kw, v, vm, inv, out, u if mag else None, cm if mag else None,
                     xs, (f, w) if f.dim() == 3 else None, phi), cs


@torch.library.custom_op("attnopt::ff_bwd", mutates_args=(), device_types="cpu")
def ff_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, kw: Tensor | None, phi: Tensor,
    cp: Tensor, sp: Tensor, kwc: Tensor, vm: Tensor, inv: Tensor, out: Tensor, u: Tensor, cm: Tensor,
    f: Tensor, w: Tensor, eps: float, coef: float, nsets: int, need_q: bool, need_k: bool, need_v: bool,
    need_w: bool, need_kw: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d points, d kw)`` of :func:`ff_fwd` (:func:`pass_backward`; a gradient not asked
    for is empty)."""
    st, cs = _pass_state(q, k, v, points, kw, (phi, cp, sp, kwc, vm, inv, out, u, cm, f, w), eps, coef, nsets)
    needs = (need_q, need_k, need_v, need_w, need_kw)
    grads = pass_backward(dout, st, cs, *needs)  # (Nq != Nk: dq and dk come together)
    return tuple(_own(tuple(gr if n else None for gr, n in zip(grads, needs, strict=True)), q))  # type: ignore[return-value]


@ff_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, kw: Tensor | None,  # noqa: ARG001
      phi: Tensor, cp: Tensor, sp: Tensor, kwc: Tensor, vm: Tensor, inv: Tensor, out: Tensor,  # noqa: ARG001
      u: Tensor, cm: Tensor, f: Tensor, w: Tensor, eps: float, coef: float, nsets: int,  # noqa: ARG001
      need_q: bool, need_k: bool, need_v: bool, need_w: bool, need_kw: bool,
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    kws = None if not need_kw else (kw if kw is not None else kwc).shape
    return (q.new_empty(q.shape if need_q else (0,)), q.new_empty(k.shape if need_k else (0,)),
            q.new_empty(v.shape if need_v else (0,)), q.new_empty(points.shape if need_w else (0,)),
            q.new_empty(kws if kws is not None else (0,)))


def _ff_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, points, kw, _, eps, coef, nsets, _, _, _ = inputs
    ctx.args = eps, coef, nsets
    ctx.save_for_backward(q, k, v, points, kw, *output[1:7], output[0], *output[7:])


def _ff_backward(ctx: Any, dout: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    need = ctx.needs_input_grad[:5]
    grads = torch.ops.attnopt.ff_bwd(dout, *ctx.saved_tensors, *ctx.args, *need)
    return (*(gr if n else None for gr, n in zip(grads, need, strict=True)), *(None,) * 7)


ff_fwd.register_autograd(_ff_backward, setup_context=_ff_setup)


def ff_ready() -> bool:
    """Whether the per-pass path's C library is there, readable while ``torch.compile`` /
    ``torch.export`` trace (:func:`attnopt._native.ready`: answered at trace time, a constant of the
    graph; False under ``backend("reference")`` and ``ATTNOPT_NATIVE=0``), so a traced router puts
    ``attnopt::ff_fwd`` where an eager call would run :class:`~.fourier._FusedFourier`'s C passes."""
    return _native.ready("fourier_features")


def traced_pass_attention(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, nsets: int, coef: float, eps: float, p: float | None,
    scale: float, key_mask: Tensor | None, need_k: bool,
) -> Tensor:
    """:func:`~.fourier.fused_fourier_magnitude_attention`'s per-pass call as the op ``attnopt::ff_fwd``
    (for a traced router: shapes only, no tensor memory read): the same broadcast, ``O (…, Nq, dv)``."""
    q, k, v = broadcast_batch(q, k, v, points, key_mask)
    outs = torch.ops.attnopt.ff_fwd(q, k, v, points.to(q.dtype), None, key_mask, float(eps), float(coef),
                                    nsets, p, float(scale), need_k)
    out: Tensor = outs[0]
    return out


def traced_weighted_attention(
    q: Tensor, k: Tensor, key_weight: Tensor | None, v: Tensor, eps: float, coef: float, ws: list[Tensor]
) -> Tensor:
    """:func:`~.fourier.fused_fourier_attention` (a given key weight ``(…, 1, Nk)``, point sets ``ws``)
    as the op ``attnopt::ff_fwd``, for a traced router: ``O (…, Nq, dv)``."""
    q, k, v, w, kw = weighted_inputs(q, k, key_weight, v, ws)
    out: Tensor = torch.ops.attnopt.ff_fwd(q, k, v, w, kw, None, float(eps), float(coef), len(ws), None, 1.0,
                                           False)[0]
    return out
