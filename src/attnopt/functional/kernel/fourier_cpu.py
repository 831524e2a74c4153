r"""The Fourier-feature C kernels as ``torch.library`` ops (issue 30 item 2): ``attnopt::lp_magnitude``
(the L^p key magnitude's gradient factors) and ``attnopt::ffw_fwd`` / ``attnopt::ffw_bwd`` (the whole
call, connected by ``register_autograd``; the fake writes out ``ffw_save_size``). Their bodies are the
functions the eager autograd Functions of :mod:`.fourier` call (:mod:`._fourier_whole`,
:mod:`._fourier_c`); the router puts them in traced graphs (compile / export).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnopt.functional.kernel._fourier_c import _magnitude, _magnitude_native
from attnopt.functional.kernel._fourier_whole import whole_backward, whole_forward

__all__ = ["ffw_bwd", "ffw_fwd", "lp_magnitude"]


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
